#!/usr/bin/env bash
# Score a candidate `full` (or `small`, SCORE_BARS below) by the rule it ships by
# (models/kws_cnn/pretrained/MODEL_CARD.md), part by part, stopping at the first part that fails:
#   scripts/score_candidate.sh WEIGHTS.safetensors DATA OUT
# DATA holds (or gets, built with the seeds the rule names) the corpora the parts read;
# OUT gets a copy of the weights, its card with the rule's threshold, and every report.
# A step whose report is already in OUT is not run again, so a killed run continues.
# About 2.5 hours on 2 cores with DATA built (41 minutes of validation and near-rhymes,
# 77 minutes of test split), 35 minutes more to build DATA.
# Two settings a rule may name, from the environment:
#   SCORE_FA_PER_HOUR=0.25   the threshold at that rate (validation streams and near-rhyme
#                            projection alike) in place of 0.5: a margin
#   SCORE_TEST_STREAMS=pretrain-streams-second   the test split's streams from that add-on
#                            alone (built with seed 0), in place of the main corpus's and
#                            `pretrain-streams`': streams no earlier reading has scored
#   SCORE_BARS=small-step8   whose figures the bars are (candidate_rule --bars): a
#                            candidate `small` against the step-8 `small`
set -euo pipefail
if [ $# -ne 3 ]; then
    echo "usage: $0 WEIGHTS.safetensors DATA OUT" >&2
    exit 2
fi
weights=$1 data=$2 out=$3
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$root/.venv/bin/python"
wakefl="$root/.venv/bin/wakefl"
mkdir -p "$out" "$data"
# Reports record the paths they were given; run the steps that name files inside OUT from
# OUT, so a committed report names its files, never this machine's folders.
out="$(cd "$out" && pwd)"
W="$out/candidate.safetensors"
# The weights, their config and their card (the probes read the threshold off the card; the
# rule's threshold is written into this copy, never into the weights given).
for ext in .safetensors .json .card.json; do
    [ -f "${W%.safetensors}$ext" ] || cp "${weights%.safetensors}$ext" "${W%.safetensors}$ext"
done
log() { echo "[score $(date -u +%H:%M:%S)] $*"; }
fa=${SCORE_FA_PER_HOUR:-0.5}
test_streams=${SCORE_TEST_STREAMS:-pretrain-streams}
margin=() pooled=() only=() rates=(0.5 0.4 0.25 0.2)
[ "$fa" = 0.5 ] || { margin=(--fa-per-hour "$fa"); pooled=(--pooled-fa-per-hour "$fa"); }
case " ${rates[*]} " in *" $fa "*) ;; *) rates+=("$fa") ;; esac
[ "$test_streams" = pretrain-streams ] || only=(--only-extra-streams)

build() {  # build PROFILE SEED: a corpus DATA/PROFILE, once
    [ -f "$data/$1/manifest.csv" ] && return 0
    log "building $1 (seed $2)"
    "$wakefl" corpus build --profile "$1" --seed "$2" --out "$data/$1" --quiet
}
build pretrain 0
build pretrain-valstreams 0
build pretrain-nearrhymes 1

gate() {  # gate [REPORT ARGS]: read the rule on what is there; stop when a part fails
    "$py" -m wakefl.tools.evaluation.candidate_rule --card "${W%.safetensors}.card.json" \
        --val "$out/val.json" --near-rhymes "$out/near-rhymes.json" "$@" \
        --bars "${SCORE_BARS:-step29-full}" \
        --json "$out/rule.json" || { log "the rule stops here (rule.json)"; exit 1; }
}

# The threshold: the validation streams' beside the near-rhyme projection's, one core each.
if [ ! -f "$out/val.json" ] || [ ! -f "$out/near-rhymes.json" ]; then
    log "validation streams and near-rhymes"
    "$py" -m wakefl.tools.bench.detection --weights "$W" --corpus "$data/pretrain" --split val \
        --extra-streams "$data/pretrain-valstreams" "${pooled[@]}" --threads 1 \
        --json "$out/val.json.tmp" &
    bench=$!
    "$py" -m wakefl.tools.probes.near_rhyme_rate --near-rhymes "$data/pretrain-nearrhymes" \
        --streams "$data/pretrain" --streams "$data/pretrain-valstreams" \
        --phrases "$data/pretrain" --model "candidate=$W" \
        --fa-per-hour "${rates[@]}" --threads 1 --json "$out/near-rhymes.json.tmp"
    wait "$bench"
    mv "$out/val.json.tmp" "$out/val.json"
    mv "$out/near-rhymes.json.tmp" "$out/near-rhymes.json"
fi
"$wakefl" model set-threshold --weights "$W" --from "$out/val.json" \
    --near-rhymes "$out/near-rhymes.json" "${margin[@]}"

# (1) int8, and the phrase alone in four voices through `wakefl edge detect`.
(cd "$out" && "$wakefl" model export --weights candidate.safetensors --int8 \
    --out candidate-int8.onnx --json) > "$out/export.json"
voices=()
for v in espeak-ng:en-us espeak-ng:en-gb flite:slt flite:rms; do
    engine=${v%%:*} voice=${v#*:} wav="hey-nova-${v/:/-}.wav"
    (
        cd "$out"
        if [ "$engine" = espeak-ng ]; then espeak-ng -v "$voice" -w "$wav" "hey nova"
        else flite -voice "$voice" -t "hey nova" -o "$wav"; fi
        "$wakefl" edge detect --model candidate-int8.onnx --json "$wav"
    ) > "$out/detect-${v/:/-}.json"
    voices+=("$out/detect-${v/:/-}.json")
done
gate --export "$out/export.json" --voices "${voices[@]}"

# (3) held-out acoustics, on the add-on's test half.
build pretrain-acoustics-subset 0
if [ ! -f "$out/acoustics.json" ]; then
    log "held-out acoustics"
    "$py" -m wakefl.tools.bench.detection --weights "$W" --corpus "$data/pretrain-acoustics-subset" \
        --max-stream-seconds 180 --threads 2 --json "$out/acoustics.json.tmp"
    mv "$out/acoustics.json.tmp" "$out/acoustics.json"
fi
gate --export "$out/export.json" --voices "${voices[@]}" --acoustics "$out/acoustics.json"

# (4) the 3-hour test split, read once.
build "$test_streams" 0
if [ ! -f "$out/test.json" ]; then
    log "the 3-hour test split ($test_streams)"
    "$py" -m wakefl.tools.bench.detection --weights "$W" --corpus "$data/pretrain" \
        --extra-streams "$data/$test_streams" "${only[@]}" --int8 --threads 2 \
        --json "$out/test.json.tmp"
    mv "$out/test.json.tmp" "$out/test.json"
fi
gate --export "$out/export.json" --voices "${voices[@]}" --acoustics "$out/acoustics.json" \
    --test "$out/test.json"
log "every part of the rule holds (rule.json)"
