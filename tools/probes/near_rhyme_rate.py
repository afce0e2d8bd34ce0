"""How often a model fires on near-rhymes of its phrase, per near-rhyme said, on streams
that hold nothing else, and the false accepts per hour that rate gives on ordinary streams
at their own rate of near-rhymes.

Why: the held-out splits' false accepts are a few speakers' renditions of a few
near-rhymes, said again and again. In a pretraining corpus each speaker has 8 of the pool's
36 near-rhymes, always in the same synthesized voice, so the validation streams' 11.7 h rest
on about 430 speaker-near-rhyme pairs of 54 speakers, and a threshold set on their few
highest moments is a draw of speakers. A corpus built with `--profile pretrain-nearrhymes`
(and a seed of its own) has about 200 other speakers, each with every near-rhyme of the
pool: thousands of pairs, none of them a training speaker's. Builds of other seeds add
other speakers: `--near-rhymes` repeated pools them.

For each model:
- at each threshold (the model's card threshold, or LABEL=WEIGHTS@T, and `--threshold`):
  detector events (the shipped streaming rule) per 1,000 near-rhymes said, how many
  distinct speakers and speaker-near-rhyme pairs fired, and the projected FA/h per device
  type and over all types: each type's events per near-rhyme said times the near-rhymes
  said in the ordinary streams (`--streams`, counted from their transcripts, not scored).
  An event whose window holds two near-rhymes ("hey", then "nova is a star") is counted
  at the rate the ordinary streams pair near-rhymes within a window (about 0.31 of them in
  the pretraining corpus's) against these streams' (0.68: every neighbour is one);
- the lowest threshold whose projected FA/h over all types is within each `--fa-per-hour`
  target;
- the highest-scoring events, with who said what;
- with `--phrases DIR`, each threshold's FRR on that corpus's validation wake-phrase clips.

The projection counts near-rhymes only: what else the ordinary streams hold is left out
(the listed false accepts of the pretraining corpus's streams are near-rhymes).

    python -m wakefl.tools.probes.near_rhyme_rate --near-rhymes NEARRHYMES \\
        [--near-rhymes NEARRHYMES-SEED2] --streams PRETRAIN --streams PRETRAIN-VALSTREAMS \\
        --model full=pretrained:full [--model cand=run/last.safetensors@0.98] \\
        [--threshold 0.99] [--fa-per-hour 0.5 0.25] [--phrases PRETRAIN] [--threads 2] \\
        [--json rate.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from wakefl.edge_runtime.detection_rule import DEFAULT_REFRACTORY_S as REFRACTORY_S
from wakefl.edge_runtime.detection_rule import event_indices, refractory_hops
from wakefl.errors import ConfigError
from wakefl.operating_point import check_threshold
from wakefl.sdk.manifest import SAMPLE_RATE
from wakefl.tools.bench.detection import fa_rate
from wakefl.tools.bench.detection_scoring import (
    NO_THRESHOLD,
    SplitScores,
    lowest_within,
    window_speech,
)
from wakefl.tools.corpus.transcripts import StreamUtterance, read_transcript
from wakefl.tools.probes.context_probe import card_threshold, model_arg

DEFAULT_TARGETS = (0.5, 0.25)
TOP_EVENTS = 10


def target_key(fa_per_hour: float) -> str:
    """The JSON key of a run's projected threshold for a target rate (`thresholds`)."""
    return f"{fa_per_hour:g}"


def threshold_key(thr: float) -> str:
    """The JSON key of a threshold's figures (`at`): the threshold to 4 decimals."""
    return f"{thr:.4f}"


@dataclass(frozen=True)
class NearRhymeStreams:
    """One model's scores on one device type's near-rhyme streams, with what was said."""

    scores: SplitScores  # streams only: no clips
    transcripts: list[list[StreamUtterance]]

    @property
    def said(self) -> int:
        return sum(near_rhymes_said(t) for t in self.transcripts)

    @property
    def paired(self) -> float:
        return paired_share(self.transcripts, self.scores.window_s)


@dataclass(frozen=True)
class Event:
    """A detector event on a near-rhyme stream: its score, and the (speaker, text) of each
    near-rhyme whose words are in its window."""

    score: float
    heard: tuple[tuple[str, str], ...]

    @property
    def alone(self) -> bool:
        return len(self.heard) <= 1

    @property
    def who(self) -> tuple[str, str]:
        return self.heard[-1] if self.heard else ("?", "?")


@dataclass(frozen=True)
class OrdinaryStreams:
    """What ordinary streams hold per device type: near-rhymes said, hours, and the share of
    their near-rhymes with another near-rhyme less than a window away."""

    said: dict[str, int]
    hours: dict[str, float]
    paired: dict[str, float]


def near_rhymes_said(transcript: Sequence[StreamUtterance]) -> int:
    return sum(1 for u in transcript if u.content == "conf")


def paired_share(transcripts: Sequence[Sequence[StreamUtterance]], window_s: float) -> float:
    """The share of near-rhymes with another near-rhyme of the same stream less than
    `window_s` before or after it: those one window can hold two of (0 with none said)."""
    paired = said = 0
    for t in transcripts:
        spans = sorted((u.start_s, u.end_s) for u in t if u.content == "conf")
        for k, (start, end) in enumerate(spans):
            before = k > 0 and start - spans[k - 1][1] < window_s
            after = k + 1 < len(spans) and spans[k + 1][0] - end < window_s
            paired += before or after
            said += 1
    return paired / said if said else 0.0


def event_speech(ns: NearRhymeStreams, thr: float) -> list[Event]:
    """Each detector event at `thr`, with the near-rhymes whose words overlap its window."""
    sc = ns.scores
    hops = refractory_hops(REFRACTORY_S, sc.hop_s, SAMPLE_RATE)
    out = []
    for stream, transcript in zip(sc.streams, ns.transcripts, strict=True):
        for j in event_indices(stream, thr, hops):
            heard = tuple(
                (u.speaker, u.text) for u in window_speech(transcript, j, sc) if u.content == "conf"
            )
            out.append(Event(float(stream[j]), heard))
    return out


def projected_fa_per_hour(
    events: Mapping[str, tuple[int, int]],
    said: Mapping[str, int],
    dense_paired: Mapping[str, float],
    ordinary: OrdinaryStreams,
) -> float:
    """False accepts per hour over the ordinary streams of the device types in `events`,
    each type's (alone, paired) events on its near-rhyme streams, of `said` near-rhymes,
    scaled to the near-rhymes its ordinary streams hold. An event whose window holds two
    near-rhymes ("hey", then "nova is a star") counts as often as ordinary streams pair
    their near-rhymes against the near-rhyme streams (`dense_paired`), where every
    neighbour is one."""
    hours = sum(ordinary.hours[d] for d in events)
    if hours <= 0:
        raise ConfigError("the ordinary streams have no hours to project onto")
    missing = {d for d in events if said.get(d, 0) <= 0}
    if missing:
        raise ConfigError(f"no near-rhymes said on device types {sorted(missing)}")
    expected = 0.0
    for d, (alone, paired) in events.items():
        ratio = ordinary.paired[d] / dense_paired[d] if dense_paired[d] > 0 else 0.0
        expected += ordinary.said[d] * (alone + paired * ratio) / said[d]
    return expected / hours


def _counts(events: Sequence[Event]) -> tuple[int, int]:
    alone = sum(e.alone for e in events)
    return alone, len(events) - alone


def projected_threshold(
    per: Mapping[str, NearRhymeStreams], ordinary: OrdinaryStreams, fa_per_hour: float
) -> float:
    """The lowest threshold whose projected FA/h over all device types is within
    `fa_per_hour`, among the near-rhyme streams' top 10 % of scores; above 1 when even
    their highest score projects more."""
    said = {d: ns.said for d, ns in per.items()}
    dense = {d: ns.paired for d, ns in per.items()}

    def projected(thr: float) -> float:
        events = {d: _counts(event_speech(ns, thr)) for d, ns in per.items()}
        return projected_fa_per_hour(events, said, dense, ordinary)

    streams = [s for ns in per.values() for s in ns.scores.streams if s.size]
    top = [s[s >= np.quantile(s, 0.9)] for s in streams]
    return lowest_within(
        np.concatenate([*top, [NO_THRESHOLD]]), lambda thr: projected(thr) <= fa_per_hour
    )


def at_threshold(
    per: Mapping[str, NearRhymeStreams], thr: float, ordinary: OrdinaryStreams
) -> dict[str, Any]:
    """Each device type's and all types' events (alone and paired), firing speakers and
    speaker-near-rhyme pairs, and projected FA/h at `thr`."""
    fired = {d: event_speech(ns, thr) for d, ns in per.items()}
    said = {d: ns.said for d, ns in per.items()}
    dense = {d: ns.paired for d, ns in per.items()}
    out: dict[str, Any] = {}
    for d, ev in fired.items():
        out[d] = _cell(ev, said[d])
        out[d]["projected_fa_per_hour"] = projected_fa_per_hour(
            {d: _counts(ev)}, said, dense, ordinary
        )
    out["all types"] = _cell([e for ev in fired.values() for e in ev], sum(said.values()))
    out["all types"]["projected_fa_per_hour"] = projected_fa_per_hour(
        {d: _counts(ev) for d, ev in fired.items()}, said, dense, ordinary
    )
    return out


def _cell(events: list[Event], said: int) -> dict[str, Any]:
    alone, paired = _counts(events)
    return {
        "events": len(events),
        "alone": alone,
        "paired": paired,
        "per_1000_said": 1000.0 * len(events) / max(said, 1),
        "speakers": len({e.who[0] for e in events}),
        "pairs": len({e.who for e in events}),
    }


def ordinary_near_rhymes(manifests: Sequence[Path], window_s: float) -> OrdinaryStreams:
    """Near-rhymes said, hours and paired share per device type in the validation streams
    of `manifests`, from their transcripts (nothing is scored)."""
    from wakefl.sdk.manifest import read_manifest

    said: dict[str, int] = {}
    hours: dict[str, float] = {}
    transcripts: dict[str, list[list[StreamUtterance]]] = {}
    for m in manifests:
        for r in read_manifest(m):
            if r.kind != "stream" or r.split != "val":
                continue
            transcript = read_transcript(r.resolve(m))
            if not transcript:
                raise ConfigError(f"{r.resolve(m)}: no transcript beside the stream")
            said[r.device_type] = said.get(r.device_type, 0) + near_rhymes_said(transcript)
            hours[r.device_type] = hours.get(r.device_type, 0.0) + r.duration_s / 3600
            transcripts.setdefault(r.device_type, []).append(transcript)
    if not said:
        raise ConfigError(f"no validation streams in {', '.join(map(str, manifests))}")
    paired = {d: paired_share(t, window_s) for d, t in transcripts.items()}
    return OrdinaryStreams(said, hours, paired)


def score_near_rhymes(
    scorer: Any, manifest: Path, progress: str | None
) -> dict[str, NearRhymeStreams]:
    """Each device type's validation streams of a near-rhyme corpus, scored."""
    from wakefl.sdk.manifest import read_manifest
    from wakefl.tools.bench.detection_scoring import stream_scores

    rows = [r for r in read_manifest(manifest) if r.kind == "stream" and r.split == "val"]
    if not rows:
        raise ConfigError(
            f"{manifest}: no validation streams (build --profile pretrain-nearrhymes)"
        )
    per: dict[str, NearRhymeStreams] = {}
    for d in sorted({r.device_type for r in rows}):
        files = [r.resolve(manifest) for r in rows if r.device_type == d]
        bar = f"{progress} {d}" if progress else None
        raw, seconds = stream_scores(scorer, files, None, 128, bar)
        empty = np.empty(0)
        sc = SplitScores(
            empty, empty, raw, seconds / 3600, window_s=scorer.window_samples / SAMPLE_RATE
        )
        per[d] = NearRhymeStreams(sc, [read_transcript(f) for f in files])
        if progress:  # a line per device type: a run of hours says where it is in a log
            print(f"[near-rhymes] {progress} {d}: {seconds / 3600:.2f} h scored", file=sys.stderr)
    return per


def near_rhyme_corpora(folders: Sequence[Path]) -> list[Path]:
    """The manifests of the `--near-rhymes` corpora, checked to be builds of different
    seeds: one seed given twice would count its speakers twice."""
    from wakefl.tools.corpus.build import read_corpus_info

    for folder in folders:
        if not (folder / "manifest.csv").exists():
            raise ConfigError(f"--near-rhymes: {folder} holds no manifest.csv")
    seeds: dict[Any, Path] = {}
    for folder in folders if len(folders) > 1 else ():
        info = read_corpus_info(folder)
        seed = info.get("seed") if isinstance(info, dict) else None
        if seed is None:
            raise ConfigError(f"--near-rhymes: {folder} has no corpus.json seed to tell it apart")
        if seed in seeds:
            raise ConfigError(
                f"--near-rhymes: {folder} and {seeds[seed]} are builds of the same seed "
                f"({seed}): their speakers are the same"
            )
        seeds[seed] = folder
    return [f / "manifest.csv" for f in folders]


def pooled_near_rhymes(
    parts: Sequence[Mapping[str, NearRhymeStreams]], tags: Sequence[str]
) -> dict[str, NearRhymeStreams]:
    """Several near-rhyme corpora's scored streams as one, per device type. Each corpus's
    speakers are named with its tag, since builds of other seeds reuse speaker names for
    other voices."""
    if len(parts) == 1:
        return dict(parts[0])
    out: dict[str, NearRhymeStreams] = {}
    for d in sorted({d for part in parts for d in part}):
        mine = [(tag, part[d]) for tag, part in zip(tags, parts, strict=True) if d in part]
        first = mine[0][1].scores
        scores = SplitScores(
            first.pos,
            first.neg,
            [r for _, ns in mine for r in ns.scores.raw_streams],
            sum(ns.scores.stream_hours for _, ns in mine),
            hop_s=first.hop_s,
            smoothing=first.smoothing,
            window_s=first.window_s,
        )
        transcripts = [
            [replace(u, speaker=f"{tag}/{u.speaker}") for u in t]
            for tag, ns in mine
            for t in ns.transcripts
        ]
        out[d] = NearRhymeStreams(scores, transcripts)
    return out


def phrase_scores(scorer: Any, manifest: Path) -> dict[str, np.ndarray]:
    """The scores of each device type's validation wake-phrase clips in `manifest`."""
    from wakefl.sdk.manifest import read_manifest
    from wakefl.tools.bench.detection_scoring import clip_scores

    rows = [r for r in read_manifest(manifest) if r.kind == "clip" and r.split == "val"]
    pos = [r for r in rows if r.label == 1]
    if not pos:
        raise ConfigError(f"{manifest}: no validation wake-phrase clips to give an FRR")
    return {
        d: clip_scores(scorer, [r for r in pos if r.device_type == d], manifest, 128)
        for d in sorted({r.device_type for r in pos})
    }


def frr_at(phrases: Mapping[str, np.ndarray], thr: float) -> dict[str, float]:
    """Each device type's share of phrases scored below `thr`, and their mean over types."""
    out = {d: float(np.mean(s < thr)) for d, s in phrases.items()}
    return {**out, "mean": float(np.mean(list(out.values())))}


def report(
    per: Mapping[str, NearRhymeStreams],
    ordinary: OrdinaryStreams,
    thresholds: Sequence[float],
    targets: Sequence[float],
    phrases: Mapping[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """One model's figures on the near-rhyme streams (see the module's docstring); with
    `phrases` (validation wake-phrase scores per device type), the FRR at each threshold."""
    missing = set(ordinary.said) - set(per)
    if missing:
        raise ConfigError(f"the near-rhyme corpus has no streams of device types {sorted(missing)}")
    pairs = {(u.speaker, u.text) for ns in per.values() for t in ns.transcripts for u in t}
    out: dict[str, Any] = {
        "near_rhyme_hours": round(sum(ns.scores.stream_hours for ns in per.values()), 3),
        "near_rhymes_said": {d: ns.said for d, ns in per.items()},
        "speakers": len({s for s, _ in pairs}),
        "pairs": len(pairs),
        "paired_share": {d: ns.paired for d, ns in per.items()},
        "ordinary_near_rhymes_per_hour": {
            d: ordinary.said[d] / ordinary.hours[d] for d in ordinary.said
        },
        "ordinary_paired_share": ordinary.paired,
        "thresholds": {target_key(t): projected_threshold(per, ordinary, t) for t in targets},
    }
    # Keyed to 4 decimals: a threshold asked for that shares a key with a projected one
    # yields to it, so `set-threshold` reads the projected threshold's own figures.
    keyed = {threshold_key(t): t for t in thresholds} | {
        threshold_key(t): t for t in out["thresholds"].values()
    }
    every = sorted(keyed.values())
    out["at"] = {threshold_key(t): at_threshold(per, t, ordinary) for t in every}
    if phrases is not None:
        for t in every:
            out["at"][threshold_key(t)]["frr"] = frr_at(phrases, t)
    fired = [(e, d) for d, ns in per.items() for e in event_speech(ns, every[0])]
    out["top_events"] = [
        {"score": e.score, "device_type": d, "said": [f"{t} ({s})" for s, t in e.heard]}
        for e, d in sorted(fired, key=lambda x: -x[0].score)[:TOP_EVENTS]
    ]
    return out


def _scorer(weights: Path, tmp: Path, threads: int) -> Any:
    from wakefl.edge_runtime import OnnxScorer
    from wakefl.models.kws_cnn import export_onnx, load_model

    return OnnxScorer(export_onnx(load_model(weights), tmp / "model.onnx"), threads=threads)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from wakefl.models.kws_cnn import weights_digest
    from wakefl.recorded_paths import recorded_path

    results: dict[str, Any] = {}
    near_rhymes = near_rhyme_corpora(args.near_rhymes)
    # The ordinary streams' counts depend on the window only: read once per window length.
    ordinary_by_window: dict[float, OrdinaryStreams] = {}
    for label, (weights, given) in args.model:
        thr = card_threshold(weights) if given is None else given
        with tempfile.TemporaryDirectory(prefix="wakefl-near-rhymes-") as tmp:
            scorer = _scorer(weights, Path(tmp), args.threads)
            window_s = scorer.window_samples / SAMPLE_RATE
            if window_s not in ordinary_by_window:
                manifests = [m / "manifest.csv" for m in args.streams]
                ordinary_by_window[window_s] = ordinary_near_rhymes(manifests, window_s)
            ordinary = ordinary_by_window[window_s]
            per = pooled_near_rhymes(
                [score_near_rhymes(scorer, m, label) for m in near_rhymes],
                [m.parent.name for m in near_rhymes],
            )
            phrases = None
            if args.phrases is not None:
                phrases = phrase_scores(scorer, args.phrases / "manifest.csv")
        results[label] = {
            "weights": recorded_path(weights),
            "weights_digest": weights_digest(weights),
            "threshold": thr,
            **report(per, ordinary, [thr, *args.threshold], args.fa_per_hour, phrases),
        }
    return results


def _table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| model | threshold | events per 1,000 said (alone / paired) | speakers / pairs firing "
        "| projected FA/h | validation FRR, mean |",
        "|---|---|---|---|---|---|",
    ]
    for label, r in results.items():
        for key, cell in r["at"].items():
            a = cell["all types"]
            lines.append(
                f"| {label} | {key} | {a['per_1000_said']:.2f} ({a['alone']} / {a['paired']}) "
                f"| {a['speakers']} / {a['pairs']} "
                f"| {a['projected_fa_per_hour']:.2f} | "
                + (f"{cell['frr']['mean']:.1%} |" if "frr" in cell else "— |")
            )
        for target, thr in r["thresholds"].items():
            lines.append(f"| {label} | {thr:.4f} | threshold for {target} FA/h projected | | | |")
    return lines


def _unit(text: str) -> float:
    try:
        return check_threshold(float(text), repr(text))
    except (ValueError, ConfigError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--near-rhymes",
        type=Path,
        action="append",
        required=True,
        help="a pretrain-nearrhymes corpus (repeat with builds of other seeds: more speakers)",
    )
    p.add_argument(
        "--streams",
        type=Path,
        action="append",
        required=True,
        help="a corpus whose validation streams the projection is for (repeat: main and add-on)",
    )
    p.add_argument(
        "--phrases",
        type=Path,
        default=None,
        help="a corpus whose validation wake-phrase clips give the FRR at each threshold",
    )
    p.add_argument("--model", type=model_arg, action="append", required=True)
    p.add_argument("--threshold", type=_unit, nargs="*", default=[], help="more thresholds")
    p.add_argument("--fa-per-hour", type=fa_rate, nargs="*", default=list(DEFAULT_TARGETS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    results = run(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(_table(results)))
    return 0


if __name__ == "__main__":
    from wakefl.tools.script_errors import run_script

    raise SystemExit(run_script(main, __file__))
