"""wakefl side by side with openWakeWord and microWakeWord ("hey jarvis"), each through its
own streaming path, on the same held-out corpora.

Detectors:
- wakefl: an ONNX or safetensors model of the phrase through the edge runtime's
  `StreamingDetector` (hop, smoothing and refractory period from the model's card), at the
  threshold its card ships;
- openWakeWord `hey_jarvis` (PyPI `pyopen-wakeword`): its mel and embedding models, then the
  classifier, one probability per 80 ms, at its default threshold 0.5;
- microWakeWord `hey_jarvis` (PyPI `pymicro-wakeword`): its micro frontend, one inference
  per 3 feature frames (30 ms), the mean of the last 5 probabilities, at the cutoff its
  model's JSON gives (0.97).

The peers are an optional extra: `pip install -e '.[peers]'`.

Each condition is a corpus folder (`manifest.csv` with clips and streams of the test split):
held-out speakers (the corpus's own test split), held-out acoustics (a build by the second
acoustic simulator) and unseen voices (`DIR/unseen`). Per condition and device type:

- detection at each detector's shipped threshold: a clip is streamed with its own background
  (noise shaped like the clip's quietest part) before and after it, so every detector's
  streaming state is warm when the clip starts; it is detected when the detector's score
  reaches the threshold between the clip's start and `TAIL_S` after its end. The clips of a
  device type are streamed back to back, far enough apart that no score sees two clips;
- FRR at <= 0.5 false accepts per hour: the lowest threshold (swept over the scores) at
  which the streams' events stay within it;
- FA/h at the shipped threshold on the same streams, with its resolution (one event in the
  streams' hours).

An event is a score at or above the threshold at least 1 s (`REFRACTORY_S`) after the
previous event, the rule wakefl's streaming detector applies; the same for every detector.

`--recordings WAV...` scores single recordings instead (a sentence holding the phrase, a
near miss): each detector's highest score on each, streamed whole after faint noise, and
whether it reaches the detector's threshold.

    python -m wakefl.tools.bench.peers --wakefl run/best.safetensors --corpus DIR \\
        [--held-out-acoustics DIR] [--json peers.json]
    python -m wakefl.tools.bench.peers --wakefl M.safetensors --recordings *.wav [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from wakefl.edge_runtime.audio_input import load_audio
from wakefl.edge_runtime.detection_rule import count_events, refractory_hops
from wakefl.errors import AudioError, ConfigError, WakeflError
from wakefl.tools.bench.detection_scoring import SplitScores, frr_at_fa, lowest_threshold
from wakefl.tools.bench.peer_detectors import (
    SAMPLE_RATE,
    Detector,
    MicroWakeWordDetector,
    OpenWakeWordDetector,
    ScoreTrack,
    WakeflDetector,
)

LEAD_S = 2.0  # background before each clip: every detector's context is warm at its start
TAIL_S = 1.5  # a detection up to this long after the clip's end counts for the clip
# Background after each clip: with the next clip's lead, the clips lie 4 s apart, so no
# detector's context (openWakeWord's, the longest, about 2 s) holds two clips.
AFTER_S = 2.0
REFRACTORY_S = 1.0
FA_TARGET = 0.5  # false accepts per hour
CONDITIONS = ("held-out speakers", "held-out acoustics", "unseen voices")
PEERS = ("openwakeword", "microwakeword")


def to_int16(wave: np.ndarray) -> np.ndarray:
    """float32 samples in [-1, 1] as the int16 the peers read (wakefl reads them back as
    the same values / 32768)."""
    return np.clip(np.round(np.asarray(wave, np.float64) * 32768.0), -32768, 32767).astype(np.int16)


def clip_stream(
    clips: list[np.ndarray], seed: int = 0
) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """The clips (float32) back to back, each with `LEAD_S` of its own background before it
    and `AFTER_S` after it, as int16; and each clip's scoring span in seconds: from its
    start to `TAIL_S` after its end."""
    from wakefl.tools.corpus.importer import background_noise

    lead, after = int(LEAD_S * SAMPLE_RATE), int(AFTER_S * SAMPLE_RATE)
    parts: list[np.ndarray] = []
    spans: list[tuple[float, float]] = []
    at = 0
    for i, clip in enumerate(clips):
        rng = np.random.default_rng([seed, i])
        pad = background_noise(clip, lead + after, rng)
        parts += [pad[:lead], np.asarray(clip, np.float32), pad[lead:]]
        start = at + lead
        spans.append((start / SAMPLE_RATE, (start + clip.size) / SAMPLE_RATE + TAIL_S))
        at = start + clip.size + after
    if not parts:
        return np.zeros(0, np.int16), []
    return to_int16(np.concatenate(parts)), spans


def clip_scores(track: ScoreTrack, spans: list[tuple[float, float]]) -> np.ndarray:
    """Each clip's highest score within its span (0 where the detector gave none there)."""
    out = np.zeros(len(spans))
    for i, (a, b) in enumerate(spans):
        inside = track.scores[(track.times_s > a) & (track.times_s <= b)]
        out[i] = float(inside.max()) if inside.size else 0.0
    return out


@dataclass
class DeviceAudio:
    """One device type's test audio in one condition."""

    pos: list[np.ndarray]  # wake-phrase clips, float32
    streams: list[np.ndarray]  # negative streams, float32
    pos_voices: list[str]  # each positive's voice family ("engine:voice"), "?" if unknown


def load_condition(
    folder: Path, max_clips: int | None, max_stream_s: float | None
) -> dict[str, DeviceAudio]:
    """The wake-phrase clips and negative streams of the test split of the corpus in
    `folder`, by device type (false accepts are counted on the streams, so the negative
    clips are not needed)."""
    from wakefl.edge_runtime import load_audio
    from wakefl.sdk.manifest import read_manifest
    from wakefl.tools.corpus.rendering import voice_families

    manifest = folder / "manifest.csv"
    if not manifest.is_file():
        raise ConfigError(f"{folder} holds no manifest.csv (a corpus folder is expected)")
    rows = [r for r in read_manifest(manifest) if r.split == "test"]
    families = voice_families(manifest)
    out: dict[str, DeviceAudio] = {}
    for d in sorted({r.device_type for r in rows}):
        clips = [r for r in rows if r.device_type == d and r.kind == "clip"][:max_clips]
        streams = [r for r in rows if r.device_type == d and r.kind == "stream"]
        if not any(r.label == 1 for r in clips) or not streams:
            raise ConfigError(
                f"{manifest}: device type {d} needs test wake-phrase clips and streams"
            )
        load = lambda r: load_audio(r.resolve(manifest), SAMPLE_RATE)  # noqa: E731
        cap = None if max_stream_s is None else int(max_stream_s * SAMPLE_RATE)
        out[d] = DeviceAudio(
            pos=[load(r) for r in clips if r.label == 1],
            streams=[load(r)[:cap] for r in streams],
            pos_voices=[families.get(r.speaker, "?") for r in clips if r.label == 1],
        )
    return out


def score_device(det: Detector, audio: DeviceAudio) -> SplitScores:
    """One detector's wake-phrase clip and stream scores on one device type, as the
    detection benchmark's figures take them (its scores already smoothed: smoothing 1)."""
    pos_wave, pos_spans = clip_stream(audio.pos, seed=1)
    pos = clip_scores(det.track(pos_wave), pos_spans)
    streams = [det.track(to_int16(s)).scores for s in audio.streams]
    hours = sum(s.size for s in audio.streams) / SAMPLE_RATE / 3600
    return SplitScores(pos, np.zeros(0), streams, hours, hop_s=det.hop_s, smoothing=1)


def stream_events(sc: SplitScores, threshold: float) -> int:
    """Events on the streams at `threshold`, the refractory period a whole number of hops."""
    hops = refractory_hops(REFRACTORY_S, sc.hop_s, SAMPLE_RATE)
    return sum(count_events(s, threshold, hops) for s in sc.streams)


def device_figures(sc: SplitScores, threshold: float) -> dict[str, Any]:
    """Detection and FA/h at the shipped threshold and FRR at <= FA_TARGET FA/h."""
    return {
        "positives": int(sc.pos.size),
        "stream_hours": round(sc.stream_hours, 4),
        "detected_at_shipped": float(np.mean(sc.pos >= threshold)),
        "fa_per_hour_at_shipped": stream_events(sc, threshold) / sc.stream_hours,
        "fa_per_hour_resolution": 1.0 / sc.stream_hours,
        f"frr_at_{FA_TARGET}_fa_h": frr_at_fa(sc, FA_TARGET),
    }


def pooled_figures(per: dict[str, SplitScores], threshold: float) -> dict[str, Any]:
    """The same over all device types together: one threshold for all their streams."""
    hours = sum(sc.stream_hours for sc in per.values())
    pos = np.concatenate([sc.pos for sc in per.values()])
    events = sum(stream_events(sc, threshold) for sc in per.values())
    thr = lowest_threshold(list(per.values()), FA_TARGET)
    fa_events = sum(stream_events(sc, thr) for sc in per.values())
    return {
        "positives": int(pos.size),
        "stream_hours": round(hours, 4),
        "detected_at_shipped": float(np.mean(pos >= threshold)),
        "fa_per_hour_at_shipped": events / hours,
        "fa_per_hour_resolution": 1.0 / hours,
        f"frr_at_{FA_TARGET}_fa_h": {
            "fa_per_hour_target": FA_TARGET,
            "threshold": thr,
            "frr": float(np.mean(pos < thr)),
            "fa_per_hour": fa_events / hours,
            "resolved": hours * FA_TARGET >= 1.0,
        },
    }


def by_voice(
    per: dict[str, SplitScores], voices: dict[str, list[str]], thr: float
) -> dict[str, Any]:
    """Detection at the shipped threshold per voice family, over all device types."""
    pos = np.concatenate([per[d].pos for d in per])
    names = np.array([v for d in per for v in voices[d]])
    return {
        str(v): {
            "positives": int(np.sum(names == v)),
            "detected": float(np.mean(pos[names == v] >= thr)),
        }
        for v in sorted(set(names.tolist()))
    }


def score_condition(dets: list[Detector], audio: dict[str, DeviceAudio]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for det in dets:
        t0 = time.perf_counter()
        per = {d: score_device(det, a) for d, a in audio.items()}
        rows: dict[str, Any] = {d: device_figures(sc, det.threshold) for d, sc in per.items()}
        rows["all"] = pooled_figures(per, det.threshold)
        rows["by_voice"] = by_voice(per, {d: a.pos_voices for d, a in audio.items()}, det.threshold)
        rows["seconds_to_score"] = round(time.perf_counter() - t0, 1)
        out[det.name] = rows
    return out


def wakefl_operating_point(model: Path, threshold: float | None) -> dict[str, Any]:
    """The threshold and detector settings a wakefl model ships with: its card beside a
    safetensors file (`<model>.card.json`, as `wakefl model pretrain` and `publish` write
    it), else `shipped_threshold` in the JSON beside the model or an ONNX file's metadata.
    `threshold` overrides the threshold."""
    from wakefl.models.kws_cnn.pretrained import card_beside
    from wakefl.operating_point import DEFAULT_HOP_S, DEFAULT_SMOOTHING
    from wakefl.tools.evaluation.inputs import card_threshold

    card = card_beside(model) if model.suffix == ".safetensors" else None
    card = card or {}
    shipped: Any = card.get("threshold")
    if shipped is None:
        shipped = card_threshold(model)
    if threshold is not None:
        shipped = threshold
    if not isinstance(shipped, int | float):
        raise ConfigError(f"{model}: no shipped threshold beside it; give --wakefl-threshold")
    return {
        "threshold": float(shipped),
        "hop_s": float(card.get("hop_s", DEFAULT_HOP_S)),
        "smoothing": int(card.get("smoothing", DEFAULT_SMOOTHING)),
    }


def wakefl_detector(model: Path, threshold: float | None, tmp: Path) -> WakeflDetector:
    """A wakefl model as a detector: a safetensors checkpoint is exported to ONNX (fp32)
    first, since a device runs the ONNX file."""
    if not model.is_file():
        raise ConfigError(f"wakefl model {model} not found")
    if model.suffix not in (".onnx", ".safetensors"):
        raise ConfigError(f"{model}: give a .onnx or .safetensors wakefl model")
    op = wakefl_operating_point(model, threshold)
    onnx_path = model
    if model.suffix == ".safetensors":
        from wakefl.models.kws_cnn import export_onnx, load_model

        onnx_path = export_onnx(load_model(model).float().eval(), tmp / "wakefl.onnx")
    return WakeflDetector(onnx_path, op["threshold"], op["hop_s"], op["smoothing"], "wakefl")


def _describe_corpus(folder: Path) -> dict[str, Any]:
    """What a condition's corpus is, without its absolute path: folder name and build."""
    from wakefl.tools.corpus.build import read_corpus_info

    info = read_corpus_info(folder)
    out: dict[str, Any] = {"folder": folder.name}
    if isinstance(info, dict):
        prof = info.get("profile")
        out.update(
            phrase=info.get("phrase"),
            seed=info.get("seed"),
            profile=prof.get("name") if isinstance(prof, dict) else prof,
            subset=info.get("subset", "main"),
        )
    return out


def score_recordings(dets: list[Detector], paths: list[Path]) -> dict[str, Any]:
    """Each recording (one utterance: a sentence holding the phrase, or a near miss) streamed
    whole through each detector, with `LEAD_S` of faint noise before it and `AFTER_S` after,
    so that every detector's streaming state is warm when the speech starts: its highest
    score and whether that reaches the detector's shipped threshold."""
    noise = np.random.default_rng(0).standard_normal(int((LEAD_S + AFTER_S) * SAMPLE_RATE))
    noise = (noise * 3e-4).astype(np.float32)  # -70 dBFS: nothing a detector could hear
    lead = int(LEAD_S * SAMPLE_RATE)
    out: dict[str, Any] = {}
    for path in paths:
        try:  # the edge runtime's decoder: the recording is heard as `wakefl edge detect` hears it
            wave = load_audio(path, SAMPLE_RATE)
        except AudioError as exc:
            raise ConfigError(f"cannot decode {exc}") from None
        padded = to_int16(np.concatenate([noise[:lead], wave, noise[lead:]]))
        out[path.name] = {}
        for d in dets:
            top = float(np.max(d.track(padded).scores, initial=0.0))
            out[path.name][d.name] = {"max_score": top, "detected": top >= d.threshold}
    return out


def _conditions(args: argparse.Namespace) -> dict[str, Path | None]:
    """Each condition's corpus folder (None: not given). `--corpus DIR` stands for the held-out
    speakers of DIR and, when DIR/unseen exists, its unseen voices."""
    given: dict[str, Path | None] = {
        "held-out speakers": args.held_out_speakers,
        "held-out acoustics": args.held_out_acoustics,
        "unseen voices": args.unseen_voices,
    }
    if args.corpus is not None:
        given["held-out speakers"] = given["held-out speakers"] or args.corpus
        if (args.corpus / "unseen" / "manifest.csv").is_file():
            given["unseen voices"] = given["unseen voices"] or args.corpus / "unseen"
    if not any(given.values()):
        raise ConfigError("no condition to score: give --corpus or a condition's folder")
    return given


def _detectors(args: argparse.Namespace, tmp: Path) -> list[Detector]:
    dets: list[Detector] = []
    if args.wakefl is not None:
        dets.append(wakefl_detector(args.wakefl, args.wakefl_threshold, tmp))
    if "openwakeword" in args.peers:
        dets.append(OpenWakeWordDetector())
    if "microwakeword" in args.peers:
        dets.append(MicroWakeWordDetector())
    if not dets:
        raise ConfigError("no detector to score: give --wakefl MODEL or --peers")
    return dets


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    if args.recordings and any(
        (args.corpus, args.held_out_speakers, args.held_out_acoustics, args.unseen_voices)
    ):
        raise ConfigError("--recordings scores recordings instead of the conditions: give one")
    conditions = {} if args.recordings else _conditions(args)
    result: dict[str, Any] = {
        "fa_per_hour_target": FA_TARGET,
        "refractory_s": REFRACTORY_S,
        "clip_padding_s": {"before": LEAD_S, "after": AFTER_S, "counted_after_end": TAIL_S},
        "max_clips_per_type": args.max_clips,
        "max_stream_seconds": args.max_stream_seconds,
    }
    with tempfile.TemporaryDirectory(prefix="wakefl-bench-peers-") as tmp:
        dets = _detectors(args, Path(tmp))
        result["detectors"] = {d.name: {"threshold": d.threshold, "hop_s": d.hop_s} for d in dets}
        if args.wakefl is not None:
            result["detectors"]["wakefl"].update(_wakefl_identity(args.wakefl))
        if args.recordings:
            result["recordings"] = score_recordings(dets, args.recordings)
            return result
        result["conditions"] = {}
        for name, folder in conditions.items():
            if folder is None:
                result["conditions"][name] = {"status": "not scored: no corpus given"}
                continue
            audio = load_condition(folder, args.max_clips, args.max_stream_seconds)
            result["conditions"][name] = {
                "corpus": _describe_corpus(folder),
                "figures": score_condition(dets, audio),
            }
    return result


def _wakefl_identity(model: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"model_file": model.name}
    if model.suffix == ".safetensors":
        from wakefl.models.kws_cnn import weights_digest

        out["weights_digest"] = weights_digest(model)
    return out


SETTINGS = ("fa_per_hour_target", "refractory_s", "clip_padding_s", "max_clips_per_type",
            "max_stream_seconds")  # fmt: skip


def merge_results(earlier: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """`later`'s detectors beside `earlier`'s, so detectors can be scored at different
    times (the peers once, wakefl models as they are trained). Refused unless both were
    scored with the same settings on the same corpora."""
    for key in SETTINGS:
        if earlier.get(key) != later.get(key):
            raise ConfigError(f"--add-to: {key} differs ({earlier.get(key)} vs {later.get(key)})")
    out = json.loads(json.dumps(earlier))
    out["detectors"].update(later["detectors"])
    for name, body in later["conditions"].items():
        mine = out["conditions"].setdefault(name, body)
        if mine is body or "figures" not in body:
            continue
        if "figures" not in mine:
            out["conditions"][name] = body
        elif mine["corpus"] != body["corpus"]:
            raise ConfigError(f"--add-to: {name} was scored on another corpus ({mine['corpus']})")
        else:
            mine["figures"].update(body["figures"])
    return out


def format_table(result: dict[str, Any]) -> str:
    key = f"frr_at_{FA_TARGET}_fa_h"
    lines = [
        f"detection at each detector's shipped threshold | FRR at <= {FA_TARGET} FA/h | "
        "FA/h at the shipped threshold (resolution: one event), per device type and over all"
    ]
    for cond, body in result["conditions"].items():
        if "figures" not in body:
            lines.append(f"\n{cond}: {body['status']}")
            continue
        lines.append(f"\n{cond} ({body['corpus']['folder']})")
        lines.append("detector (thr) | type | detected | FRR @0.5 FA/h | FA/h | hours")
        for name, rows in body["figures"].items():
            thr = result["detectors"][name]["threshold"]
            for d, r in rows.items():
                if d in ("by_voice", "seconds_to_score"):
                    continue
                f = r[key]
                flag = "" if f["resolved"] else "*"
                lines.append(
                    f"{name} ({thr:.4g}) | {d} | {r['detected_at_shipped']:.3f} "
                    f"({r['positives']}) | {f['frr']:.3f}{flag} | "
                    f"{r['fa_per_hour_at_shipped']:.2f} (1 = {r['fa_per_hour_resolution']:.2f}) | "
                    f"{r['stream_hours']}"
                )
    lines.append(
        "\n* fewer stream hours than 1/0.5: the swept threshold allows no false accept at all"
    )
    return "\n".join(lines)


def format_recordings(result: dict[str, Any]) -> str:
    names = list(result["detectors"])
    lines = [
        "recording | "
        + " | ".join(f"{n} ({result['detectors'][n]['threshold']:.4g})" for n in names)
    ]
    for rec, by in result["recordings"].items():
        cells = [f"{by[n]['max_score']:.3f}{' fires' if by[n]['detected'] else ''}" for n in names]
        lines.append(f"{rec} | " + " | ".join(cells))
    return "\n".join(lines)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        out = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(out, dict) or "conditions" not in out or "detectors" not in out:
        raise ConfigError(f"{path} is not a bench_peers result")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--wakefl", type=Path, default=None, help="a wakefl .onnx or .safetensors model")
    p.add_argument(
        "--wakefl-threshold", type=float, default=None, help="instead of the model's card's"
    )
    p.add_argument(
        "--peers",
        nargs="*",
        choices=PEERS,
        default=list(PEERS),
        help="the peers to score (default both; none: wakefl alone)",
    )
    p.add_argument(
        "--corpus", type=Path, default=None, help="held-out speakers, and DIR/unseen if built"
    )
    p.add_argument("--held-out-speakers", type=Path, default=None, metavar="DIR")
    p.add_argument(
        "--held-out-acoustics",
        type=Path,
        default=None,
        metavar="DIR",
        help="a build of the phrase by the second acoustic simulator",
    )
    p.add_argument("--unseen-voices", type=Path, default=None, metavar="DIR")
    p.add_argument(
        "--recordings",
        type=Path,
        nargs="+",
        default=None,
        metavar="WAV",
        help="instead of the conditions: each recording's highest score per detector",
    )
    p.add_argument("--max-clips", type=int, default=None, help="the first N clips per device type")
    p.add_argument("--max-stream-seconds", type=float, default=None)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument(
        "--add-to",
        type=Path,
        default=None,
        metavar="JSON",
        help="an earlier run's JSON: its detectors' figures are kept beside these",
    )
    args = p.parse_args(argv)
    try:
        result = run(args)
        if args.add_to is not None:
            result = merge_results(_read_json(args.add_to), result)
    except WakeflError as exc:
        print(f"bench_peers: {exc}", file=sys.stderr)
        return 2
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(format_recordings(result) if "recordings" in result else format_table(result))
    return 0


if __name__ == "__main__":
    from wakefl.tools.script_errors import run_script

    raise SystemExit(run_script(main, __file__))
