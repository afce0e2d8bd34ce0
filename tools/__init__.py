"""Everything around the product that runs on a workstation: the `wakefl` command line
(cli/), corpora (corpus/), training (training/), evaluation (evaluation/), benchmarks
(bench/), the paper's studies (studies/) and fleets on one machine (fleet/). tools/ may
use every other part of wakefl; nothing imports it."""
