"""DET curves (false-reject rate against false-accept rate, log scales) as PNG files: the
baseline and every candidate of one device type on one plot, each model's operating
point marked."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _floor(rates: np.ndarray, n: int) -> np.ndarray:
    # A log axis cannot show 0: rates of 0 are drawn at half of one count's rate.
    return np.maximum(rates, 0.5 / max(n, 1))


def plot_det(
    curves: dict[str, tuple[np.ndarray, np.ndarray]],
    out_path: str | Path,
    title: str,
    n_positive: int,
    n_negative: int,
    operating_points: dict[str, tuple[float, float]] | None = None,
) -> Path:
    """Writes one DET plot; `curves` maps a model name to (fa_rates, fr_rates)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5.5, 4.5), dpi=110)
    try:
        for i, (name, (fa, fr)) in enumerate(curves.items()):
            style = {"color": "black", "linewidth": 2.0} if i == 0 else {"linewidth": 1.4}
            (line,) = ax.step(
                _floor(fa, n_negative), _floor(fr, n_positive), where="post", label=name, **style
            )
            if operating_points and name in operating_points:
                pfa, pfr = operating_points[name]
                ax.plot(
                    _floor(np.array([pfa]), n_negative),
                    _floor(np.array([pfr]), n_positive),
                    "o",
                    color=line.get_color(),
                    markersize=5,
                )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(0.5 / max(n_negative, 1) * 0.8, 1.05)
        ax.set_ylim(0.5 / max(n_positive, 1) * 0.8, 1.05)
        ax.set_xlabel(f"false-accept rate per clip ({n_negative} negatives; 0 drawn at 1/2 count)")
        ax.set_ylabel(f"false-reject rate ({n_positive} wake words)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)
    return out
