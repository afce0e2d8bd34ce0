"""The operating point a model ships with, as it is stored: the detection threshold and the
detector settings (hop, smoothing, refractory period) it was chosen for. This module owns
the format: every reader goes through it, and so does every writer of the config's
threshold, the sidecar and the ONNX metadata. It needs neither torch nor onnx, so the edge
runtime reads exported models through it and the training side writes through it.

Where it is stored:
- a model's card beside a checkpoint (`<w>.card.json`): `threshold` and the settings, read
  with `from_card` (the card holds more: the validation figures and provenance that
  pretraining and publishing write, tools/training);
- the config JSON beside a checkpoint (`<w>.json`) and the JSON sidecar of an exported
  ONNX file: `shipped_threshold` (`with_shipped_threshold`, `shipped_threshold_in`; the
  sidecar also holds the settings and the source, `OperatingPoint.sidecar`);
- an exported ONNX file's metadata: every entry as JSON text (`OperatingPoint.metadata`,
  `metadata_threshold`).

Choosing a model's operating point (a shipped model's card, a baseline's threshold for a
model trained on a device) needs the weights, and lives in models/kws_cnn/operating_point.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from wakefl.errors import ConfigError

# The shipped detector's settings: the streaming detector's defaults
# (edge_runtime/detection_rule.py) and those of a card that names none.
DEFAULT_HOP_S = 0.1
DEFAULT_SMOOTHING = 3
DEFAULT_REFRACTORY_S = 1.0

THRESHOLD_KEY = "shipped_threshold"
SOURCE_KEY = "threshold_source"
METADATA_KEYS = (THRESHOLD_KEY, "hop_s", "smoothing", "refractory_s", SOURCE_KEY)


def check_threshold(value: Any, where: str) -> float:
    """`value` as a threshold: a finite number in [0, 1] (not a bool), else ConfigError."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0.0 <= value <= 1.0
    ):
        raise ConfigError(f"{where}: a threshold must be a number in [0, 1], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class OperatingPoint:
    """A threshold on the smoothed posterior, the detector settings it was set for, and
    where it comes from (`source`, one line for a person)."""

    threshold: float
    hop_s: float = DEFAULT_HOP_S
    smoothing: int = DEFAULT_SMOOTHING
    refractory_s: float = DEFAULT_REFRACTORY_S
    source: str = ""

    def sidecar(self) -> dict[str, Any]:
        """The JSON written beside an exported model (`wakefl eval --at-shipped-threshold`
        reads `shipped_threshold` there)."""
        return {
            THRESHOLD_KEY: float(self.threshold),
            "hop_s": float(self.hop_s),
            "smoothing": int(self.smoothing),
            "refractory_s": float(self.refractory_s),
            SOURCE_KEY: self.source,
        }

    def metadata(self) -> dict[str, str]:
        """The ONNX metadata entries: the sidecar's numbers as JSON text, the source as is."""
        return {
            key: value if key == SOURCE_KEY else json.dumps(value)
            for key, value in self.sidecar().items()
        }

    def with_source(self, source: str) -> OperatingPoint:
        return OperatingPoint(self.threshold, self.hop_s, self.smoothing, self.refractory_s, source)


def from_card(card: Mapping[str, Any], source: str) -> OperatingPoint:
    """The operating point of a card (`threshold`, or a config's `shipped_threshold`, and
    optional detector settings)."""
    threshold = card.get("threshold", card.get(THRESHOLD_KEY))
    if not isinstance(threshold, int | float) or not 0.0 <= float(threshold) <= 1.0:
        raise ConfigError(f"{source}: no threshold in [0, 1] (got {threshold!r})")
    return OperatingPoint(
        threshold=float(threshold),
        hop_s=float(card.get("hop_s", DEFAULT_HOP_S)),
        smoothing=int(card.get("smoothing", DEFAULT_SMOOTHING)),
        refractory_s=float(card.get("refractory_s", DEFAULT_REFRACTORY_S)),
        source=source,
    )


def with_shipped_threshold(config: Mapping[str, Any], threshold: float) -> dict[str, Any]:
    """A checkpoint's config JSON carrying `threshold` as its shipped threshold."""
    return {**config, THRESHOLD_KEY: check_threshold(threshold, "the shipped threshold")}


def shipped_threshold_in(config: Any, where: str) -> float | None:
    """The shipped threshold in a config JSON or sidecar already parsed (None: it names
    none); ConfigError for one that is not an object or a threshold that is not one."""
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: model card is not a JSON object")
    value = config.get(THRESHOLD_KEY)
    return None if value is None else check_threshold(value, f"{where}: {THRESHOLD_KEY}")


def metadata_threshold(meta: Mapping[str, str], where: str) -> float | None:
    """The shipped threshold in an exported model's metadata (None when it holds none)."""
    text = meta.get(THRESHOLD_KEY)
    if text is None:
        return None
    try:
        value = float(json.loads(text))
    except (ValueError, TypeError):
        raise ConfigError(f"{where}: metadata {THRESHOLD_KEY} {text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"{where}: metadata {THRESHOLD_KEY} {value} is not in [0, 1]")
    return float(value)
