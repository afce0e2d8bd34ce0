"""The settings of one `wakefl eval` run (tools/evaluation/evaluate.py), on their own so that
every module of the evaluation can take them without importing the runner that uses them."""

from __future__ import annotations

from dataclasses import dataclass

from wakefl.operating_point import DEFAULT_HOP_S


@dataclass
class EvalSettings:
    split: str = "test"
    target_fr: float = 0.05
    n_boot: int = 200
    seed: int = 0
    batch: int = 64
    hop_s: float = DEFAULT_HOP_S
    smoothing: int | None = None  # None: the detector's default
    refractory_s: float | None = None  # None: the detector's default
    progress: bool = True
    # The baseline's shipped threshold: one for every device type, or one per device type
    # (key "*": every device type not named). None: fitted to `target_fr`.
    threshold: float | dict[str, float] | None = None
    at_shipped_threshold: bool = False  # take the threshold from the baseline's model card
