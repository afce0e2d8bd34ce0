"""DET curves (false-reject rate against false-accept rate, log scales) as PNG files: the
baseline and every candidate of one device type on one plot, each model's operating
point marked and named in the legend. Curves that differ stay visible (the baseline thick
and pale underneath, candidates dashed on top); curves that coincide are said to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

_STYLES = ("--", ":", "-.", (0, (5, 1, 1, 1)))


def _floor(rates: np.ndarray, n: int) -> np.ndarray:
    # A log axis cannot show 0: rates of 0 are drawn at half of one count's rate.
    return np.maximum(rates, 0.5 / max(n, 1))


def coinciding(curves: dict[str, tuple[np.ndarray, np.ndarray]]) -> list[str]:
    """The models (after the first, the baseline) whose DET curve is the first's exactly."""
    items = list(curves.items())
    if not items:
        return []
    fa0, fr0 = items[0][1]
    return [
        name
        for name, (fa, fr) in items[1:]
        if fa.shape == fa0.shape and np.array_equal(fa, fa0) and np.array_equal(fr, fr0)
    ]


def _point_label(name: str, point: tuple[float, float]) -> str:
    fa, fr = point
    return f"{name} at its threshold: FRR {fr:.2f}, FA {fa:.3f}"


def _mark_point(
    ax: Any, name: str, point: tuple[float, float], color: Any, i: int, counts: tuple[int, int]
) -> None:
    """A model's operating point, named in the legend: the baseline's (i = 0) filled, the
    candidates' hollow and larger, so that one on the baseline's shows both."""
    pfa, pfr = point
    ax.plot(
        _floor(np.array([pfa]), counts[0]),
        _floor(np.array([pfr]), counts[1]),
        "o" if i == 0 else "s",
        color=color,
        markerfacecolor=color if i == 0 else "none",
        markeredgewidth=1.5,
        markersize=8 if i == 0 else 9 + 2 * i,
        zorder=3,
        label=_point_label(name, point),
    )


def plot_det(
    curves: dict[str, tuple[np.ndarray, np.ndarray]],
    out_path: str | Path,
    title: str,
    n_positive: int,
    n_negative: int,
    operating_points: dict[str, tuple[float, float]] | None = None,
) -> Path:
    """Writes one DET plot; `curves` maps a model name to (fa_rates, fr_rates), the
    baseline first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 5.2), dpi=110)
    same = coinciding(curves)
    try:
        for i, (name, (fa, fr)) in enumerate(curves.items()):
            style: dict = (
                {"color": "0.6", "linewidth": 4.0, "zorder": 1}
                if i == 0
                else {"linewidth": 1.6, "linestyle": _STYLES[(i - 1) % len(_STYLES)], "zorder": 2}
            )
            label = name + (" (= baseline)" if name in same else "")
            (line,) = ax.step(
                _floor(fa, n_negative), _floor(fr, n_positive), where="post", label=label, **style
            )
            if operating_points and name in operating_points:
                _mark_point(
                    ax, name, operating_points[name], line.get_color(), i, (n_negative, n_positive)
                )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(0.5 / max(n_negative, 1) * 0.8, 1.05)
        ax.set_ylim(0.5 / max(n_positive, 1) * 0.8, 1.05)
        ax.set_xlabel(f"false accepts per negative clip ({n_negative} clips)")
        ax.set_ylabel(f"false rejects per wake-word clip ({n_positive} clips)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower left", fontsize=7)
        note = "A rate of 0 is drawn at the lower edge of its axis."
        if same:
            note += f" {', '.join(same)}: the same curve as the baseline."
        fig.text(0.01, 0.005, note, fontsize=7, ha="left", va="bottom")
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)
    return out
