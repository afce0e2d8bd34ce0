"""The paper study's tables (`wakefl.tools.studies.paper_report`): a cell's figure and interval,
and each table of the result dict as Markdown (Tables 2a/2b, 5, 6, tuning, power, the
comparisons, the gate and the Self-FL ablations). Pure functions of the result dict."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from wakefl.tools.studies.paper_figures import MATCHED_FA

ALL = "all"


def _fmt(x: float | None) -> str:
    return "unbounded" if x is None else f"{x:.2f}"


def ci_side(ci: Sequence[float | None] | None) -> str:
    """ "below" when a ratio's interval lies wholly below 1, "above" when wholly above,
    "includes 1" otherwise (a missing lower bound counts as 0, a missing upper one as
    unbounded)."""
    lo, hi = (ci or [None, None])[:2]
    if hi is not None and hi < 1.0:
        return "below"
    if lo is not None and lo > 1.0:
        return "above"
    return "includes 1"


_MARK = {"below": "↓", "above": "↑", "includes 1": ""}


def format_cell(row: dict[str, Any] | None, with_ci: bool = True) -> str:
    """`0.92 [0.81, 1.04]`; `n/a` for a missing cell; `unbounded` where the baseline's FA
    is 0 and the candidate's is not. With the interval, `↓` / `↑` mark an interval wholly
    below / above 1 (better / worse than the baseline beyond the resampling noise)."""
    if row is None:
        return "n/a"
    note = row.get("note") or ""
    if row.get("relative_fa") is None and note.startswith(("no wake-word", "no negative")):
        return "n/a"
    if note.startswith("diverged"):
        return "diverged"
    cell = _fmt(row.get("relative_fa"))
    if with_ci:
        lo, hi = row.get("relative_fa_ci") or [None, None]
        cell += (
            f" [{'-' if lo is None else f'{lo:.2f}'}, {'unbounded' if hi is None else f'{hi:.2f}'}]"
        )
        if row.get("relative_fa") is not None:
            cell += _MARK[ci_side([lo, hi])]
    return cell


def index_rows(
    rows: Iterable[dict[str, Any]],
) -> dict[tuple[str, str, str, str, str], dict[str, Any]]:
    return {(r["setting"], r["method"], r["model"], r["device_type"], r["state"]): r for r in rows}


def best_per_column(
    idx: dict,
    setting: str,
    model: str,
    methods: Sequence[str],
    device_types: Sequence[str],
    state: str,
) -> dict[str, set[str]]:
    best: dict[str, set[str]] = {}
    for dt in device_types:
        vals = {
            m: idx[(setting, m, model, dt, state)]["relative_fa"]
            for m in methods
            if (setting, m, model, dt, state) in idx
        }
        finite = {m: v for m, v in vals.items() if v is not None}
        if finite:
            low = min(finite.values())
            best[dt] = {m for m, v in finite.items() if v == low}
    return best


def _matched_fa_cell(row: dict[str, Any] | None) -> str:
    rec = None if row is None else row.get(MATCHED_FA)
    if rec is None:
        return "n/a"
    lo, hi = rec["relative_fr_ci"]
    return f"{_fmt(rec['relative_fr'])} [{_fmt(lo)}, {_fmt(hi)}]"


def method_table(
    result: dict[str, Any],
    setting: str,
    model: str,
    state: str = ALL,
    field: str = "relative_fa",
    methods: Sequence[str] | None = None,
) -> str:
    """Rows = methods (the study's, or `methods`), columns = device types (paper Table 2
    layout). Bold = lowest."""
    cfg = result["config"]
    idx = index_rows(result["rows"])
    dts = cfg["device_types"]
    methods = [
        m
        for m in (cfg["methods"] if methods is None else methods)
        if any((setting, m, model, dt, state) in idx for dt in dts)
    ]
    best = (
        best_per_column(idx, setting, model, methods, dts, state) if field == "relative_fa" else {}
    )
    lines = ["| Method | " + " | ".join(dts) + " |", "|---|" + "---|" * len(dts)]
    for m in methods:
        cells = []
        for dt in dts:
            row = idx.get((setting, m, model, dt, state))
            if field == "relative_fa":
                cell = format_cell(row)
                if row is not None and m in best.get(dt, set()):
                    cell = f"**{cell}**"
            elif field == MATCHED_FA:
                cell = _matched_fa_cell(row)
            else:
                cell = (
                    "n/a"
                    if row is None
                    else "diverged"
                    if (row.get("note") or "").startswith("diverged")
                    else _fmt(row.get(field))
                )
            cells.append(cell)
        lines.append(f"| {cfg['method_labels'].get(m, m)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sampling_table(result: dict[str, Any], model: str) -> str:
    """Rows = (activity rate, device state, level), columns = device types (Tables 5/6)."""
    cfg = result["config"]
    idx = index_rows(result["rows"])
    dts = cfg["device_types"]
    lines = [
        "| C | State | Self-FL | " + " | ".join(dts) + " |",
        "|---|---|---|" + "---|" * len(dts),
    ]
    for rate in cfg["activity_rates"]:
        setting = f"sampling-{rate:g}"
        for state in (*cfg["states"], ALL):
            for level in ("selffl-client", "selffl-cluster"):
                cells = [format_cell(idx.get((setting, level, model, dt, state))) for dt in dts]
                name = "client-level" if level == "selffl-client" else "cluster-level"
                lines.append(f"| {rate:g} | {state} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tuning_table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    tun = cfg["tuning"]
    grid = tun["grid"]["lr"]
    head = "| Method | fixed hyperparameters | " + " | ".join(f"val score lr={g:g}" for g in grid)
    lines = [head + " | selected lr |", "|---|---|" + "---|" * (len(grid) + 1)]
    for m in cfg["methods"]:
        t = tun["per_method"][m]
        fixed = ", ".join(f"{k}={v}" for k, v in sorted(t["hyperparams"].items()))
        vals = [t["validation_score"].get(f"{g:g}") for g in grid]
        cells = [
            "diverged" if f"{g:g}" in t.get("diverged", {}) else "-" if v is None else f"{v:.3f}"
            for g, v in zip(grid, vals, strict=True)
        ]
        sel = "none (all diverged)" if t["selected_lr"] is None else f"{t['selected_lr']:g}"
        lines.append(
            f"| {cfg['method_labels'].get(m, m)} | {fixed} | " + " | ".join(cells) + f" | {sel} |"
        )
    return "\n".join(lines)


def power_table(result: dict[str, Any]) -> str:
    """Per device type: what the test cells are made of (full participation, all states),
    so a reader can judge how small a difference the intervals can resolve."""
    cfg = result["config"]
    idx = index_rows(result["rows"])
    s = "full-participation"
    lines = [
        "| Device type | training clips (share) | test wake-word / other clips | baseline FR "
        "| baseline false accepts | median CI width (hi/lo), global models |",
        "|---|---|---|---|---|---|",
    ]
    sizes = cfg.get("train_clips_per_device_type", {})
    total = sum(sizes.values()) or 1
    for dt in cfg["device_types"]:
        rows = [
            idx[(s, m, "global", dt, ALL)]
            for m in cfg["methods"]
            if (s, m, "global", dt, ALL) in idx
        ]
        ref = next((r for r in rows if r.get("baseline_fa") is not None), None)
        widths = [
            r["relative_fa_ci"][1] / r["relative_fa_ci"][0]
            for r in rows
            if r["relative_fa_ci"][0] and r["relative_fa_ci"][1]
        ]
        if ref is None:
            continue
        fa_count = ref.get("baseline_fa_count")
        fa = (
            f"{fa_count} of {ref['n_negative']}"
            if fa_count is not None
            else f"{ref['baseline_fa']:.3f}"
        )
        lines.append(
            f"| {dt} | {sizes.get(dt, '?')} ({100 * sizes.get(dt, 0) / total:.0f} %) | "
            f"{ref['n_positive']} / {ref['n_negative']} | {ref['baseline_fr']:.3f} | {fa} | "
            f"{'n/a' if not widths else f'{float(np.median(widths)):.2f}x'} |"
        )
    return "\n".join(lines)


def comparison_table(result: dict[str, Any]) -> str:
    """Self-FL against 1 (the warm start) and against the best other method, per cell."""
    cfg = result["config"]
    idx = index_rows(result["rows"])
    labels = cfg["method_labels"]
    lines = [
        "| Setting | Model | Method | Device type | false accepts (candidate / baseline) | "
        "relative FA [95% CI] | vs baseline | best other method (relative FA) | FA ratio to "
        "it [95% CI] | vs best other |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result.get("comparisons", []):
        row = idx.get((c["setting"], c["method"], c["model"], c["device_type"], c["state"]))
        if row is None:
            continue
        vs1 = ci_side(row["relative_fa_ci"])
        vs1 = {"below": "better", "above": "worse", "includes 1": "not resolved"}[vs1]
        r, (lo, hi) = c["ratio_to_best_other"], c["ratio_to_best_other_ci"]
        side = {"below": "better", "above": "worse", "includes 1": "not resolved"}[
            ci_side(c["ratio_to_best_other_ci"])
        ]
        ratio = f"{_fmt(r)} [{'-' if lo is None else f'{lo:.2f}'}, {_fmt(hi)}]"
        counts = (
            "n/a"
            if row.get("candidate_fa_count") is None
            else f"{row['candidate_fa_count']} / {row['baseline_fa_count']} of {row['n_negative']}"
        )
        lines.append(
            f"| {c['setting']} | {c['model']} | {labels.get(c['method'], c['method'])} | "
            f"{c['device_type']} | {counts} | {format_cell(row)} | {vs1} | {labels.get(c['best_other'], c['best_other'])} "
            f"({_fmt(c['best_other_relative_fa'])}) | {ratio} | {side} |"
        )
    return "\n".join(lines)


def fr_comparison_table(result: dict[str, Any]) -> str:
    """Self-FL's relative FR at matched FA per clip against the best other method's, per
    cell, with the paired ratio of their FRs at that FA (empty when no row has it)."""
    idx = index_rows(result["rows"])
    labels = result["config"]["method_labels"]
    lines = [
        "| Setting | Model | Method | Device type | relative FR at matched FA [95% CI] | best "
        "other method (relative FR) | FR ratio to it [95% CI] | vs best other |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in result.get("comparisons", []):
        row = idx.get((c["setting"], c["method"], c["model"], c["device_type"], c["state"]))
        if row is None or "fr_best_other" not in c:
            continue
        r, (lo, hi) = c["fr_ratio_to_best_other"], c["fr_ratio_to_best_other_ci"]
        side = {"below": "better", "above": "worse", "includes 1": "tied"}[
            ci_side(c["fr_ratio_to_best_other_ci"])
        ]
        lines.append(
            f"| {c['setting']} | {c['model']} | {labels.get(c['method'], c['method'])} | "
            f"{c['device_type']} | {_matched_fa_cell(row)} | {labels.get(c['fr_best_other'], c['fr_best_other'])} "
            f"({_fmt(c['fr_best_other_relative_fr'])}) | "
            f"{_fmt(r)} [{'-' if lo is None else f'{lo:.2f}'}, {_fmt(hi)}] | {side} |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""


def gate_table(result: dict[str, Any]) -> str:
    """Per setting, Self-FL variant and device type: what its clients serve with the gate
    on, and how many served / personalized models are worse than the warm start beyond the
    CI on the test speakers (the worst served model's relative FA beside it)."""
    labels = result["config"]["method_labels"]
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for g in result.get("gate", []):
        groups.setdefault((g["setting"], g["method"], g["device_type"]), []).append(g)
    head = (
        "| setting | method | device type | clients | serve personalized / global / warm start "
        "| served worse beyond CI | personalized worse beyond CI | worst served rel. FA [CI] |"
    )
    lines = [head, "|" + "---|" * 8]
    for (setting, method, dt), gs in groups.items():
        kinds = [sum(g["serves"] == k for g in gs) for k in ("personalized", "global", "baseline")]
        worst = max(gs, key=lambda g: _worst_key(g["served"]))
        lines.append(
            f"| {setting} | {labels.get(method, method)} | {dt} | {len(gs)} | "
            f"{' / '.join(map(str, kinds))} | "
            f"{sum(ci_side(g['served']['relative_fa_ci']) == 'above' for g in gs)} | "
            f"{sum(ci_side(g['personalized']['relative_fa_ci']) == 'above' for g in gs)} | "
            f"{format_cell(worst['served'])} |"
        )
    return "\n".join(lines)


def _worst_key(rec: dict[str, Any]) -> tuple[float, float]:
    lo = (rec.get("relative_fa_ci") or [None, None])[0]
    fa = rec.get("relative_fa")
    return (math.inf if fa is None else fa, -math.inf if lo is None else lo)


def ablation_table(result: dict[str, Any], model: str) -> str:
    """Self-FL with wakefl's rules (the main settings' rows) against the same run with some
    rules switched back to the paper's (the "ablation-" settings), all states pooled. Rows
    = (setting, rules), columns = device types."""
    cfg = result["config"]
    idx = index_rows(result["rows"])
    dts = cfg["device_types"]
    lines = ["| setting | rules | " + " | ".join(dts) + " |", "|---|---|" + "---|" * len(dts)]
    runs = [("full-participation", "selffl")]
    runs += [(f"sampling-{rate:g}", "selffl-client") for rate in cfg["activity_rates"]]
    for setting, method in runs:
        variants = [(setting, method, "wakefl (default)")]
        variants += [
            (f"ablation-{setting}", f"{method}+{a}", a) for a in cfg.get("selffl_ablations", {})
        ]
        for row_setting, row_method, name in variants:
            cells = [format_cell(idx.get((row_setting, row_method, model, dt, ALL))) for dt in dts]
            lines.append(f"| {setting} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
