"""What fills an n/a cell of `wakefl eval`: a table of the reasons a figure is missing."""

from __future__ import annotations

import pytest

from wakefl.sdk.wake_metrics import NO_CELL_NOTE
from wakefl.tools.evaluation.missing_figures import what_fills, with_remedy


@pytest.mark.parametrize(
    ("reason", "recordings"),
    [
        ("no wake-word clips: FRR not measured", "wake-word recordings (label 1)"),
        ("no wake-word clips here: FR not measured", "wake-word recordings (label 1)"),
        ("no negative streams here: FA/h not measured", "negative recordings of 10 s or more"),
        ("no negative clips here: FA not measured", "negative recordings shorter than 10 s"),
        ("not measured: no negative clips here", "negative recordings shorter than 10 s"),
        (NO_CELL_NOTE, "wake-word recordings (label 1) and short other recordings"),
        ("no interval: no resample could be evaluated", None),
        ("FA/h saturated at one event per refractory period", None),
    ],
)
def test_what_fills_each_missing_figure(reason, recordings):
    fills = what_fills(reason, "val")
    if recordings is None:
        assert fills is None and with_remedy(reason, "val") == reason
    else:
        assert fills is not None and fills.startswith(f"add {recordings}")
        assert "to the val split" in fills and "--split val" in fills
        assert with_remedy(reason, "val") == f"{reason}; to measure it, {fills}"
