"""Figures of a corpus: per device type counts and hours, and how measurably the device
types differ (spectral centroid, band-energy shares, and how well a nearest-centroid rule
on band shares tells the device type of held-out clips).

    python -m wakefl.tools.studies.corpus_stats CORPUS/manifest.csv
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import soundfile as sf

from wakefl.sdk.manifest import ManifestRow, read_manifest

BAND_EDGES_HZ = (0, 300, 1000, 2500, 4000, 8001)


def band_features(x: np.ndarray, sample_rate: int = 16000) -> np.ndarray:
    """log10 share of the clip's energy in each band of BAND_EDGES_HZ."""
    spec = np.abs(np.fft.rfft(x)) ** 2
    f = np.fft.rfftfreq(x.size, 1.0 / sample_rate)
    e = np.array(
        [
            spec[(f >= a) & (f < b)].sum()
            for a, b in zip(BAND_EDGES_HZ[:-1], BAND_EDGES_HZ[1:], strict=True)
        ]
    )
    return np.log10(e / max(e.sum(), 1e-20) + 1e-9)


def spectral_centroid(x: np.ndarray, sample_rate: int = 16000) -> float:
    spec = np.abs(np.fft.rfft(x)) ** 2
    f = np.fft.rfftfreq(x.size, 1.0 / sample_rate)
    return float((spec * f).sum() / max(spec.sum(), 1e-20))


def nearest_centroid_accuracy(features: dict[str, np.ndarray], rows: list[ManifestRow]) -> float:
    """Fit one centroid per device type on training clips; score val and test clips."""
    devices = sorted({r.device_type for r in rows})
    centroids = {
        d: np.mean(
            [features[r.path] for r in rows if r.split == "train" and r.device_type == d], axis=0
        )
        for d in devices
    }
    held = [r for r in rows if r.split != "train"]
    hits = [
        min(devices, key=lambda d: float(np.sum((features[r.path] - centroids[d]) ** 2)))
        == r.device_type
        for r in held
    ]
    return float(np.mean(hits))


def report(manifest_path: str | Path) -> str:
    rows = read_manifest(manifest_path)
    clips = [r for r in rows if r.kind == "clip"]
    feats: dict[str, np.ndarray] = {}
    cents: dict[str, float] = {}
    for r in clips:
        x, sr = sf.read(str(r.resolve(manifest_path)))
        feats[r.path] = band_features(x, sr)
        cents[r.path] = spectral_centroid(x, sr)
    lines = ["device  clips(train/val/test)  pos  streams  hours  centroid_Hz  " + "  ".join(
        f"{a}-{min(b, 8000)}Hz" for a, b in zip(BAND_EDGES_HZ[:-1], BAND_EDGES_HZ[1:], strict=True))]  # fmt: skip
    for d in sorted({r.device_type for r in rows}):
        dc = [r for r in clips if r.device_type == d]
        n = Counter(r.split for r in dc)
        streams = [r for r in rows if r.device_type == d and r.kind == "stream"]
        hours = sum(r.duration_s for r in rows if r.device_type == d) / 3600
        shares = np.median([10 ** feats[r.path] for r in dc], axis=0)
        lines.append(
            f"{d:6}  {n['train']}/{n['val']}/{n['test']:<14}  {sum(r.label for r in dc):4}  "
            f"{len(streams):7}  {hours:5.3f}  {np.median([cents[r.path] for r in dc]):11.0f}  "
            + "  ".join(f"{s:9.3f}" for s in shares)
        )
    acc = nearest_centroid_accuracy(feats, clips)
    lines.append(
        f"device type identified from band shares (nearest centroid, held-out clips): "
        f"{acc:.1%} (chance {1 / len({r.device_type for r in clips}):.0%})"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m wakefl.tools.studies.corpus_stats MANIFEST.csv")
    print(report(sys.argv[1]))
