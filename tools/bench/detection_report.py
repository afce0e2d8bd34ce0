"""The detection benchmark's report: its figures as text tables and its DET curves as PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def format_table(result: dict[str, Any]) -> str:
    primary = f"hop {result['hop_s']} s, smoothing {result['smoothing']}"
    lines = _table_lines(result, primary)
    for label, figures in result.get("detectors", {}).items():
        lines += _table_lines(figures, label)
    lines += condition_lines(result.get("conditions", {}))
    lines += _voice_lines(result.get("fp32", {}))
    lines += _retimed_lines(result.get("retimed_phrases", {}))
    lines += carrier_lines(result.get("carrier_phrases", {}), result)
    lines += carrier_at_condition_lines(result.get("carrier_phrases_at_0.5_fa_h", {}))
    lines += breakdown_lines(result.get("miss_breakdown"))
    lines += _event_lines(result.get("fp32", {}))
    for split, ag in result.get("int8_agreement", {}).items():
        lines.append(
            f"\nint8 vs fp32 decisions at the shipped threshold ({primary}), {split}: "
            f"{ag['share']:.4f} ({ag['agree']}/{ag['decisions']})"
        )
    lines.append(
        "\n* fewer stream hours than 1/target: the threshold allows no false accept at all"
    )
    return "\n".join(lines)


def condition_lines(conditions: dict[str, Any]) -> list[str]:
    """fp32 held-out conditions side by side: FRR at the shipped threshold, FRR at <= 0.5
    FA/h, FA/h at the shipped threshold, and the stream hours that resolve it."""
    if not conditions:
        return []
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    lines = [
        "\nfp32, held-out conditions: FRR @shipped thr | FRR @<=0.5 FA/h | FA/h @shipped thr "
        "| stream h (1 false accept = FA/h)",
        "condition | type | FRR @shipped | FRR @0.5 FA/h | FA/h @shipped | hours (resolution)",
    ]
    for name, c in conditions.items():
        for d, r in [*c["by_type"].items(), ("all", c["all types"])]:
            flag = "" if r.get("resolved_at_0.5_fa_h", True) else "*"
            lines.append(
                f"{name} | {d} | {fmt(r.get('frr_at_shipped_threshold'), '.3f')} | "
                f"{fmt(r.get('frr_at_0.5_fa_h'), '.3f')}{flag} | "
                f"{fmt(r.get('fa_h_at_shipped_threshold'), '.2f')} | "
                f"{r['stream_hours']} ({fmt(r.get('fa_h_resolution'), '.2f')})"
            )
    return lines


def breakdown_lines(b: dict[str, Any] | None) -> list[str]:
    """fp32 FRR of the context probe's recordings per group of conditions (a table per
    group), one column per threshold."""
    if not b or not b["frr"]:
        return []
    names = list(b["frr"])
    lines = [
        f"\nfp32, where the misses come from: FRR of the context probe's {b['recordings']} "
        f"recordings ({b['speakers']} held-out speakers), at "
        + "; ".join(f"{n} {b['thresholds'][n]:.4f}" for n in names)
    ]
    for group, rates in b["frr"][names[0]].items():
        lines.append(f"{group} | " + " | ".join(names))
        for key in rates:
            lines.append(f"{key} | " + " | ".join(f"{b['frr'][n][group][key]:.3f}" for n in names))
    return lines


def _voice_lines(splits: dict[str, Any]) -> list[str]:
    """fp32 FRR of each voice family per device type: at 0.5 FA/h, and at the shipped
    threshold after the slash."""
    lines = []
    for split, rows in splits.items():
        types = [d for d in rows if not d.startswith("_") and "by_voice" in rows[d]]
        if not types:
            continue
        lines.append(f"\nfp32, {split}, FRR by voice @0.5 FA/h / @shipped thr")
        lines.append("voice | " + " | ".join(types))
        for v in sorted({v for d in types for v in rows[d]["by_voice"]}):
            cells = [_voice_cell(rows[d]["by_voice"].get(v)) for d in types]
            lines.append(f"{v} | " + " | ".join(cells))
    return lines


def _retimed_lines(by_precision: dict[str, Any]) -> list[str]:
    lines = []
    for precision, rows in by_precision.items():
        cells = []
        for d, r in rows.items():
            frr = r["frr_at_shipped_threshold"]
            cells.append(f"{d} {'-' if frr is None else format(frr, '.3f')} ({r['positives']})")
        lines.append(
            f"\n{precision}, re-timed phrases, FRR at the shipped threshold (clips): "
            + " | ".join(cells)
        )
    return lines


def carrier_lines(by_precision: dict[str, Any], result: dict[str, Any]) -> list[str]:
    """The phrase in running speech beside the isolated phrase of the same held-out split,
    both at the shipped threshold (clips), per device type."""
    lines = []
    for precision, rows in by_precision.items():
        splits = result.get(precision, {})
        isolated = splits.get("held-out speakers") or splits.get("validation") or {}
        cells = []
        for d, r in rows.items():
            frr = r["frr_at_shipped_threshold"]
            alone = (isolated.get(d) or {}).get("at_shipped_threshold", {}).get("frr")
            fa = r.get("fa_share_at_shipped_threshold")
            cells.append(
                f"{d} {_share(frr)} ({r['positives']}; isolated {_share(alone)})"
                + (
                    f", confusables accepted {_share(fa)} ({r['negatives']})"
                    if "negatives" in r
                    else ""
                )
            )
        lines.append(
            f"\n{precision}, phrases in running speech, FRR at the shipped threshold (clips): "
            + " | ".join(cells)
        )
    return lines


def carrier_at_condition_lines(by_condition: dict[str, Any]) -> list[str]:
    """fp32, the phrase in running speech at each held-out condition's one threshold for
    <= 0.5 FA/h: per device type and over all types (weighted by their clips), FRR and the
    share of confusables accepted."""
    lines = []
    for name, at in by_condition.items():
        rows = at["by_type"]
        cells = [
            f"{d} {_share(r['frr_at_shipped_threshold'])}"
            + (f" / {_share(r['fa_share_at_shipped_threshold'])}" if "negatives" in r else "")
            for d, r in rows.items()
        ]
        pos = sum(r["positives"] for r in rows.values())
        frr = sum(r["frr_at_shipped_threshold"] * r["positives"] for r in rows.values()) / pos
        lines.append(
            f"\nfp32, phrases in running speech at {name}'s threshold for 0.5 FA/h "
            f"({at['threshold']:.4f}), FRR / confusables accepted: "
            + " | ".join(cells)
            + f" | all {frr:.3f} ({pos})"
        )
    return lines


def _share(x: float | None) -> str:
    return "-" if x is None else format(x, ".3f")


def _event_lines(splits: dict[str, Any]) -> list[str]:
    """fp32's highest-scoring moments of each device type's negative streams."""
    lines = []
    for split, rows in splits.items():
        types = [d for d in rows if not d.startswith("_") and rows[d].get("top_stream_events")]
        if not types:
            continue
        lines.append(f"\nfp32, {split}, highest-scoring moments of the negative streams")
        lines.append("type | score | stream @ window end | said in the window")
        for d in types:
            for e in rows[d]["top_stream_events"]:
                said = "; ".join(e["said"]) or "-"
                lines.append(f"{d} | {e['score']:.4f} | {e['stream']} @ {e['end_s']} s | {said}")
    return lines


def _voice_cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    cell = f"{r['frr_at_0.5_fa_h']:.2f}"
    if "frr_at_shipped_threshold" in r:
        cell += f"/{r['frr_at_shipped_threshold']:.2f}"
    return cell


def _table_lines(result: dict[str, Any], detector: str) -> list[str]:
    lines = []
    for precision in ("fp32", "int8"):
        for split, rows in result.get(precision, {}).items():
            lines.append(f"\n{precision}, {split}, {detector} ({rows['_seconds']} s to score)")
            lines.append(
                "type | FRR @0.5 FA/h | FRR @0.1 FA/h | FA/h @5% FRR | shipped thr: FRR, FA/h | hours"
            )
            for d, r in rows.items():
                if d.startswith("_"):
                    continue
                a, b, c = r["frr_at_0.5_fa_h"], r["frr_at_0.1_fa_h"], r["fa_h_at_5pct_frr"]
                s = r.get("at_shipped_threshold")
                ship = f"{s['frr']:.3f}, {s['fa_per_hour']:.2f}" if s else "-"
                flag = lambda x: "" if x["resolved"] else "*"  # noqa: E731
                lines.append(
                    f"{d} | {a['frr']:.3f}{flag(a)} | {b['frr']:.3f}{flag(b)} | "
                    f"{c['fa_per_hour']:.2f} | {ship} | {r['stream_hours']}"
                )
            if "_pooled" in rows:
                lines += _pooled_lines(rows["_pooled"])
            for point in rows.get("_pooled_by_target", {}).values():
                lines += _pooled_lines(point)
    return lines


def _pooled_lines(p: dict[str, Any]) -> list[str]:
    """One threshold for every type, set on all their streams together."""
    cells = [f"{d} {r['frr']:.3f}, {r['fa_per_hour']:.2f}" for d, r in p["by_type"].items()]
    return [
        f"one threshold for all types, <= {p['fa_per_hour_target']} FA/h over their "
        f"{p['stream_hours']} h of streams{'' if p['resolved'] else '*'}: {p['threshold']:.6f} "
        f"({p['fa_per_hour']:.2f} FA/h); FRR, FA/h by type: " + " | ".join(cells)
    ]


def plot(curves: dict[str, list[tuple[float, float]]], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, pts in curves.items():
        fa, fr = zip(*sorted(pts), strict=True)
        ax.plot(np.maximum(fa, 1e-2), np.maximum(fr, 1e-3), marker=".", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("false accepts per hour (streams)")
    ax.set_ylabel("false-reject rate (clips)")
    ax.set_title(title)
    ax.axvline(0.5, color="grey", lw=0.5)
    ax.axhline(0.05, color="grey", lw=0.5)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
