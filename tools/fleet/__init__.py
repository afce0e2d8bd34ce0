"""A fleet on one machine: `wakefl demo` end to end and its report, the fleet's state
as `wakefl status` shows it, the load generator that stands in for many devices, the
configurations of bridged edge brokers, and the benchmarks of the server and broker
(`python -m wakefl.tools.fleet.bench_<name>`; bench_federation_report is what
bench_federation prints, not a benchmark of its own)."""
