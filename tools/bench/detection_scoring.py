"""The detection benchmark's scores and figures: a model's clip and stream scores on one
device type of one split (`SplitScores`), and what they give: FRR at a target FA/h, FA/h at
a target FRR, the figures at a threshold, one threshold for all device types, DET points,
FRR by voice family, the highest-scoring stream moments, and how often two models agree."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from wakefl.edge_runtime.detection_rule import (
    DEFAULT_HOP_S as HOP_S,
)
from wakefl.edge_runtime.detection_rule import (
    DEFAULT_REFRACTORY_S as REFRACTORY_S,
)
from wakefl.edge_runtime.detection_rule import (
    DEFAULT_SMOOTHING as SMOOTHING,
)
from wakefl.edge_runtime.detection_rule import (
    count_events,
    refractory_hops,
    smoothed,
    stream_windows,
)
from wakefl.edge_runtime.gate_rule import gate_open, gated_raw, main_scored, shut_closed
from wakefl.errors import ConfigError
from wakefl.progress_bars import bar_disabled
from wakefl.sdk.manifest import SAMPLE_RATE

if TYPE_CHECKING:
    from wakefl.tools.corpus.transcripts import StreamUtterance

FA_TARGETS = (0.5, 0.1)
TOP_EVENTS = 5  # the highest-scoring stream moments listed per device type
FRR_TARGET = 0.05


@dataclass
class SplitScores:
    """One model's scores on one device type of one split, for one detector setting."""

    pos: np.ndarray  # clip scores of wake-phrase clips
    neg: np.ndarray  # clip scores of other clips
    raw_streams: list[np.ndarray]  # raw window posteriors of each negative stream
    stream_hours: float
    hop_s: float = HOP_S
    smoothing: int = SMOOTHING
    pos_voices: np.ndarray | None = None  # each positive's voice family ("engine:voice")
    stream_files: list[Path] | None = None  # each stream's WAV, where its transcript lies
    # How the report names each stream (its file name when None): add-on streams carry
    # their corpus folder, since their file names repeat the main corpus's.
    stream_labels: list[str] | None = None
    window_s: float = 1.5
    # A two-stage detector's open hops per stream (gate_rule.py; None: one stage, all open).
    stream_open: list[np.ndarray] | None = None

    @property
    def streams(self) -> list[np.ndarray]:
        out = [smoothed(r, self.smoothing) for r in self.raw_streams]
        if self.stream_open is None:
            return out
        return [shut_closed(s, o) for s, o in zip(out, self.stream_open, strict=True)]

    def detector(self, hop_s: float, smoothing: int) -> SplitScores:
        """The same scores seen by a detector at `hop_s` (a multiple of this one's: its
        window ends are every k-th of these) and `smoothing`."""
        if self.stream_open is not None:
            raise ConfigError("a two-stage detector's scores are for its own hop and smoothing")
        step = hop_s / self.hop_s
        if step < 1 or abs(step - round(step)) > 1e-6:
            raise ConfigError(f"hop {hop_s} s is not a multiple of the scored hop {self.hop_s} s")
        return replace(
            self,
            raw_streams=[r[:: int(round(step))] for r in self.raw_streams],
            hop_s=hop_s,
            smoothing=smoothing,
        )


def stream_events(sc: SplitScores, thr: float) -> int:
    hops = refractory_hops(REFRACTORY_S, sc.hop_s, SAMPLE_RATE)
    return sum(count_events(s, thr, hops) for s in sc.streams)


def lowest_threshold(scs: list[SplitScores], fa_per_hour: float) -> float:
    """The lowest threshold at which the streams of `scs` together give at most
    `fa_per_hour` false accepts per hour (none at all with fewer hours than 1/target)."""
    hours = sum(sc.stream_hours for sc in scs)
    allowed = math.floor(fa_per_hour * hours + 1e-9)
    parts = [sc.pos for sc in scs] + [
        s[s >= np.quantile(s, 0.99)] for sc in scs for s in sc.streams
    ]
    return lowest_within(
        np.concatenate([*parts, [NO_THRESHOLD]]),
        lambda thr: sum(stream_events(sc, thr) for sc in scs) <= allowed,
    )


# Above every score: what a search reports when no candidate keeps within its target.
NO_THRESHOLD = 1.0 + 1e-9


def lowest_within(candidates: np.ndarray, within: Callable[[float], bool]) -> float:
    """The lowest of `candidates` at which `within` holds, by bisection: false accepts only
    fall as the threshold rises, so `within` holds from some candidate on (the highest, at
    least, is taken to)."""
    cands = np.unique(candidates)
    lo, hi = 0, len(cands) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if within(float(cands[mid])):
            hi = mid
        else:
            lo = mid + 1
    return float(cands[lo])


def window_speech(
    transcript: list[StreamUtterance], hop: int, sc: SplitScores
) -> list[StreamUtterance]:
    """The utterances whose words overlap the window that ends at smoothed hop `hop`."""
    end = hop * sc.hop_s + sc.window_s
    return [u for u in transcript if u.end_s > end - sc.window_s and u.start_s < end]


def is_fa_target(fa_per_hour: float) -> bool:
    """A sane false-accept rate target in FA/h: above 0 and at most 10 (NaN is not)."""
    return 0.0 < fa_per_hour <= 10.0


def pooled_target_key(fa_per_hour: float) -> str:
    """The JSON key of a report's extra one-for-all-types point (`_pooled_by_target`)."""
    return f"{fa_per_hour:g}"


def pooled_operating_point(per: dict[str, SplitScores], fa_per_hour: float) -> dict[str, Any]:
    """One threshold for every device type: the lowest at which all their streams together
    give at most `fa_per_hour` false accepts per hour, with each type's FRR and FA/h there.
    Set on validation streams, it is a shipped threshold chosen at a resolvable FA rate."""
    thr = lowest_threshold(list(per.values()), fa_per_hour)
    hours = sum(sc.stream_hours for sc in per.values())
    by_type = {d: at_threshold(sc, thr) for d, sc in per.items()}
    # Each type's events were just counted for its own FA/h: sum those, not count again.
    events = sum(by_type[d]["fa_per_hour"] * sc.stream_hours for d, sc in per.items())
    return {
        "fa_per_hour_target": fa_per_hour,
        "threshold": thr,
        "stream_hours": round(hours, 3),
        "fa_per_hour": round(events) / hours,
        "resolved": hours * fa_per_hour >= 1.0,
        "by_type": by_type,
    }


def frr_at_fa(sc: SplitScores, fa_per_hour: float) -> dict[str, Any]:
    """FRR at the lowest threshold whose stream false accepts stay within the target. With
    fewer stream hours than 1/target, that means no false accept at all (flagged)."""
    thr = lowest_threshold([sc], fa_per_hour)
    return {
        "fa_per_hour_target": fa_per_hour,
        "threshold": thr,
        "frr": float(np.mean(sc.pos < thr)),
        "fa_per_hour": stream_events(sc, thr) / sc.stream_hours,
        "resolved": sc.stream_hours * fa_per_hour >= 1.0,
    }


def fa_at_frr(sc: SplitScores, frr: float) -> dict[str, Any]:
    thr = float(np.quantile(sc.pos, frr, method="lower")) if sc.pos.size else 1.0
    return {
        "frr_target": frr,
        "threshold": thr,
        "frr": float(np.mean(sc.pos < thr)),
        "fa_per_hour": stream_events(sc, thr) / sc.stream_hours,
    }


def at_threshold(sc: SplitScores, thr: float) -> dict[str, Any]:
    return {
        "threshold": thr,
        "frr": float(np.mean(sc.pos < thr)),
        "clip_far": float(np.mean(sc.neg >= thr)),
        "fa_per_hour": stream_events(sc, thr) / sc.stream_hours,
    }


def det_points(sc: SplitScores, n: int = 60) -> list[tuple[float, float]]:
    """(FA/h, FRR) over thresholds spread across the positives' scores."""
    thrs = np.unique(np.quantile(sc.pos, np.linspace(0.0, 0.5, n)))
    return [
        (stream_events(sc, float(t)) / sc.stream_hours, float(np.mean(sc.pos < t))) for t in thrs
    ]


def gated_split(
    main: SplitScores, gate: SplitScores, gate_threshold: float, hold: int
) -> tuple[SplitScores, float]:
    """`main`'s scores seen through the two-stage detector with `gate`'s model as its gate
    (gate_rule.py; both at the same hop), and the share of stream windows the main model
    scores there. A clip is one window: accepted where the gate passes and `main` does."""
    raws, opens, scored, total = [], [], 0, 0
    for r, g in zip(main.raw_streams, gate.raw_streams, strict=True):
        op = gate_open(g, gate_threshold, hold)
        sc = main_scored(op, main.smoothing)
        raws.append(gated_raw(r, sc))
        opens.append(op)
        scored, total = scored + int(sc.sum()), total + sc.size
    gated = replace(
        main,
        pos=np.where(gate.pos >= gate_threshold, main.pos, 0.0),
        neg=np.where(gate.neg >= gate_threshold, main.neg, 0.0),
        raw_streams=raws,
        stream_open=opens,
    )
    return gated, scored / max(1, total)


def clip_scores(scorer: Any, clips: list[Any], manifest: Path, batch: int) -> np.ndarray:
    """The model's score of each clip row, decoded to its window, in `batch`es."""
    from wakefl.sdk.dataset import load_clip

    waves = np.stack([load_clip(r.resolve(manifest), scorer.window_samples) for r in clips])
    return np.concatenate([scorer.score(waves[i : i + batch]) for i in range(0, len(waves), batch)])


def score_split(
    scorer: Any,
    manifest: Path,
    device: str,
    max_stream_s: float | None,
    batch: int = 128,
    split: str = "test",
    extra_streams: tuple[Path, ...] = (),
    progress: str | None = None,
    own_streams: bool = True,
) -> SplitScores:
    """Clip and stream scores of `device` in `split` of `manifest`; the streams of the same
    device and split in each of `extra_streams` (add-on manifests) are scored beside its own,
    or, with `own_streams` false, in place of its own (its clips are scored either way).
    With a `progress` label, a bar over the streams where stderr is a terminal, and one line
    on stderr when the device is done: a benchmark of hours of stream says where it is in a
    log file too."""
    from wakefl.sdk.manifest import read_manifest
    from wakefl.tools.corpus.rendering import voice_families

    t0 = time.perf_counter()

    rows = [r for r in read_manifest(manifest) if r.split == split and r.device_type == device]
    clips = [r for r in rows if r.kind == "clip"]
    if not clips:
        raise ConfigError(f"{manifest}: device type {device} has no {split} clips")
    scores = clip_scores(scorer, clips, manifest, batch)
    labels = np.array([r.label for r in clips])
    own = [r for r in rows if r.kind == "stream"] if own_streams else None
    found = _stream_files(manifest, own, extra_streams, device, split)
    files = [f for f, _ in found]
    if not files:
        raise ConfigError(f"{manifest}: device type {device} has no {split} streams")
    bar = f"{progress} {device}" if progress is not None else None
    raw, seconds = stream_scores(scorer, files, max_stream_s, batch, bar)
    if progress is not None:
        print(
            f"[bench] {progress} {device}: {len(clips)} clips and {seconds / 3600:.2f} h of "
            f"stream scored in {time.perf_counter() - t0:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    families = voice_families(manifest)
    voices = None
    if families:
        voices = np.array([families.get(r.speaker, "?") for r in clips if r.label == 1])
    return SplitScores(
        scores[labels == 1],
        scores[labels == 0],
        raw,
        seconds / 3600,
        pos_voices=voices,
        stream_files=files,
        stream_labels=[label for _, label in found],
        window_s=scorer.window_samples / scorer.sample_rate,
    )


def _stream_files(
    manifest: Path, own: list[Any] | None, extra_streams: tuple[Path, ...], device: str, split: str
) -> list[tuple[Path, str]]:
    """The streams to score, each with the label a report names it by: `manifest`'s own rows
    (None: left out, where add-ons replace them), then each add-on's of `device` and `split`."""
    from wakefl.sdk.manifest import read_manifest

    if own is None and not extra_streams:
        raise ConfigError("streams only from add-ons, but no add-on was given")
    found = [(r.resolve(manifest), Path(r.path).name) for r in own or []]
    for m in extra_streams:
        found += [
            (r.resolve(m), f"{m.parent.name}/{r.path}")
            for r in read_manifest(m)
            if r.kind == "stream" and r.split == split and r.device_type == device
        ]
    return found


def stream_scores(
    scorer: Any, files: list[Path], max_stream_s: float | None, batch: int, bar: str | None
) -> tuple[list[np.ndarray], float]:
    """Each stream's raw window posteriors at the shipped hop, and the seconds scored."""
    from wakefl.edge_runtime import load_audio

    raw, seconds = [], 0.0
    shown = tqdm(files, desc=bar, unit="stream", leave=False, disable=bar_disabled(bar is not None))
    for f in shown:
        w = load_audio(f, scorer.sample_rate)
        if max_stream_s is not None:
            w = w[: int(max_stream_s * scorer.sample_rate)]
        if w.size < scorer.window_samples:
            raise ConfigError(
                f"{f}: {w.size / scorer.sample_rate:g} s of stream (--max-stream-seconds "
                f"{max_stream_s}) is shorter than the model's window of "
                f"{scorer.window_samples / scorer.sample_rate:g} s"
            )
        wins = stream_windows(w, scorer.window_samples, int(round(HOP_S * scorer.sample_rate)))
        raw.append(
            np.concatenate(
                [
                    scorer.score(np.ascontiguousarray(wins[i : i + batch]))
                    for i in range(0, len(wins), batch)
                ]
            ).astype(np.float64)
        )
        seconds += w.size / scorer.sample_rate
    return raw, seconds


def summarize(sc: SplitScores, shipped: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "positives": int(sc.pos.size),
        "negative_clips": int(sc.neg.size),
        "stream_hours": round(sc.stream_hours, 3),
        # The smallest FA/h these streams can show: one false accept in their hours.
        "fa_h_resolution": 1.0 / sc.stream_hours,
        **{f"frr_at_{t}_fa_h": frr_at_fa(sc, t) for t in FA_TARGETS},
        "fa_h_at_5pct_frr": fa_at_frr(sc, FRR_TARGET),
    }
    if shipped is not None:
        out["at_shipped_threshold"] = at_threshold(sc, shipped)
    if sc.pos_voices is not None:
        out["by_voice"] = by_voice(sc, out["frr_at_0.5_fa_h"]["threshold"], shipped)
    if sc.stream_files is not None:
        out["top_stream_events"] = top_stream_events(sc)
    return out


def top_stream_events(sc: SplitScores, k: int = TOP_EVENTS) -> list[dict[str, Any]]:
    """The `k` highest-scoring moments of the negative streams, as distinct detector events
    (at least a refractory period apart), with what the stream's transcript says was spoken
    in the window: the false accepts that set the threshold, and what they heard."""
    from wakefl.tools.corpus.transcripts import read_transcript

    assert sc.stream_files is not None
    refractory = refractory_hops(REFRACTORY_S, sc.hop_s, SAMPLE_RATE)
    found: list[tuple[float, int, int]] = []
    for i, stream in enumerate(sc.streams):
        taken: list[int] = []
        for j in np.argsort(stream, kind="stable")[::-1]:
            if len(taken) == k:
                break
            if all(abs(int(j) - t) >= refractory for t in taken):
                taken.append(int(j))
                found.append((float(stream[j]), i, int(j)))
    top = sorted(found, reverse=True)[:k]
    transcripts = {i: read_transcript(sc.stream_files[i]) for i in {i for _, i, _ in top}}
    out = []
    for score, i, j in top:
        said = [
            f"{u.text} ({u.content}, {u.speaker})" for u in window_speech(transcripts[i], j, sc)
        ]
        out.append(
            {
                "score": score,
                "stream": sc.stream_labels[i] if sc.stream_labels else sc.stream_files[i].name,
                "end_s": round(j * sc.hop_s + sc.window_s, 2),
                "said": said,
            }
        )
    return out


def by_voice(sc: SplitScores, thr: float, shipped: float | None) -> dict[str, Any]:
    """FRR of each voice family's positives at the split's 0.5 FA/h threshold (all families
    share the negative streams) and at the shipped threshold."""
    assert sc.pos_voices is not None
    out: dict[str, Any] = {}
    for v in sorted(set(sc.pos_voices.tolist())):
        pos = sc.pos[sc.pos_voices == v]
        out[v] = {"positives": int(pos.size), "frr_at_0.5_fa_h": float(np.mean(pos < thr))}
        if shipped is not None:
            out[v]["frr_at_shipped_threshold"] = float(np.mean(pos < shipped))
    return out


def agreement(a: SplitScores, b: SplitScores, thr: float) -> tuple[int, int]:
    """(agreeing decisions, decisions) of two models at one threshold, over every clip and
    every smoothed stream window."""
    agree = total = 0
    for x, y in [(a.pos, b.pos), (a.neg, b.neg), *zip(a.streams, b.streams, strict=True)]:
        agree += int(np.sum((x >= thr) == (y >= thr)))
        total += x.size
    return agree, total
