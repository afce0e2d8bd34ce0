"""Renders the paper study's result (`wakefl.tools.paper_experiment`) as Markdown tables in
the paper's layout (Tables 2a/2b, 5, 6), step-count plots (Figures 11-12) and DET curves.

Rendering is a pure function of the result dict (plus the raw scores for DET curves), so
the same result always gives byte-identical tables."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ALL = "all"
def _fmt(x: float | None) -> str:
    return "unbounded" if x is None else f"{x:.2f}"


def format_cell(row: dict[str, Any] | None, with_ci: bool = True) -> str:
    """`0.92 [0.81, 1.04]`; `n/a` for a missing cell; `unbounded` where the baseline's FA
    is 0 and the candidate's is not."""
    if row is None:
        return "n/a"
    note = row.get("note") or ""
    if row.get("relative_fa") is None and note.startswith("no wake-word"):
        return "n/a"
    if note.startswith("diverged"):
        return "diverged"
    cell = _fmt(row.get("relative_fa"))
    if with_ci:
        lo, hi = row.get("relative_fa_ci") or [None, None]
        cell += f" [{'-' if lo is None else f'{lo:.2f}'}, {'unbounded' if hi is None else f'{hi:.2f}'}]"
    return cell


def _index(rows: Iterable[dict[str, Any]]) -> dict[tuple[str, str, str, str, str], dict[str, Any]]:
    return {(r["setting"], r["method"], r["model"], r["device_type"], r["state"]): r for r in rows}


def _best_per_column(idx: dict, setting: str, model: str, methods: Sequence[str],
                     device_types: Sequence[str], state: str) -> dict[str, set[str]]:
    best: dict[str, set[str]] = {}
    for dt in device_types:
        vals = {m: idx[(setting, m, model, dt, state)]["relative_fa"]
                for m in methods if (setting, m, model, dt, state) in idx}
        finite = {m: v for m, v in vals.items() if v is not None}
        if finite:
            low = min(finite.values())
            best[dt] = {m for m, v in finite.items() if v == low}
    return best


def method_table(result: dict[str, Any], setting: str, model: str, state: str = ALL,
                 field: str = "relative_fa") -> str:
    """Rows = methods, columns = device types (paper Table 2 layout). Bold = lowest."""
    cfg = result["config"]
    idx = _index(result["rows"])
    dts = cfg["device_types"]
    methods = [m for m in cfg["methods"] if any((setting, m, model, dt, state) in idx for dt in dts)]
    best = _best_per_column(idx, setting, model, methods, dts, state) if field == "relative_fa" else {}
    lines = ["| Method | " + " | ".join(dts) + " |", "|---|" + "---|" * len(dts)]
    for m in methods:
        cells = []
        for dt in dts:
            row = idx.get((setting, m, model, dt, state))
            if field == "relative_fa":
                cell = format_cell(row)
                if row is not None and m in best.get(dt, set()):
                    cell = f"**{cell}**"
            else:
                cell = ("n/a" if row is None else "diverged"
                        if (row.get("note") or "").startswith("diverged") else _fmt(row.get(field)))
            cells.append(cell)
        lines.append(f"| {cfg['method_labels'].get(m, m)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sampling_table(result: dict[str, Any], model: str) -> str:
    """Rows = (activity rate, device state, level), columns = device types (Tables 5/6)."""
    cfg = result["config"]
    idx = _index(result["rows"])
    dts = cfg["device_types"]
    lines = ["| C | State | Self-FL | " + " | ".join(dts) + " |", "|---|---|---|" + "---|" * len(dts)]
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
        cells = ["diverged" if f"{g:g}" in t.get("diverged", {}) else "-" if v is None
                 else f"{v:.3f}" for g, v in zip(grid, vals, strict=True)]
        sel = "none (all diverged)" if t["selected_lr"] is None else f"{t['selected_lr']:g}"
        lines.append(f"| {cfg['method_labels'].get(m, m)} | {fixed} | " + " | ".join(cells)
                     + f" | {sel} |")
    return "\n".join(lines)


def shape_findings(result: dict[str, Any]) -> list[str]:
    """Plain statements comparing this run's shape with the paper's claims; they are
    computed from the rows, so they say the opposite when the results do."""
    cfg = result["config"]
    idx = _index(result["rows"])
    dts = cfg["device_types"]
    s = "full-participation"
    out: list[str] = []

    def vals(method: str, model: str) -> dict[str, float | None]:
        return {dt: idx[(s, method, model, dt, ALL)]["relative_fa"]
                for dt in dts if (s, method, model, dt, ALL) in idx}

    mismatch: list[str] = []
    for model in ("global", "personalized"):
        sf = vals("selffl", model)
        if not sf:
            continue
        below = [dt for dt, v in sf.items() if v is not None and v < 1.0]
        best = _best_per_column(idx, s, model, cfg["methods"], dts, ALL)
        wins = [dt for dt in dts if "selffl" in best.get(dt, set())]
        sig = [dt for dt in dts if (s, "selffl", model, dt, ALL) in idx
               and (idx[(s, "selffl", model, dt, ALL)]["relative_fa_ci"][1] or np.inf) < 1.0]
        out.append(
            f"Self-FL (Alg. 1) {model} model: relative FA below 1 on {len(below)} of {len(sf)} "
            f"device types ({', '.join(below) or 'none'}); the 95% CI lies wholly below 1 on "
            f"{len(sig)} ({', '.join(sig) or 'none'}); lowest of all methods on {len(wins)} of "
            f"{len(dts)} ({', '.join(wins) or 'none'}). Paper: below 1 on 4 of 5 (global) and "
            "5 of 5 (personalized), best on most device types.")
        if 2 * len(wins) <= len(dts):
            mismatch.append(f"Self-FL's {model} model is the best method on "
                            f"{len(wins)} of {len(dts)} device types, not on most")
        if len(below) < len(sf) - 1:
            mismatch.append(f"Self-FL's {model} model does not improve on the baseline on "
                            f"{len(sf) - len(below)} device types")
    fw, fe = vals("fedavg-w", "global"), vals("fedavg-e", "global")
    if fw and fe:
        worse = [dt for dt in dts if fw.get(dt) is not None and fe.get(dt) is not None
                 and fw[dt] > fe[dt]]
        big = [dt for dt in dts if fw.get(dt) is None or fw[dt] > 2.0]
        out.append(
            f"Sample-size weighting: FedAvg-w's global model is worse than FedAvg-e's on "
            f"{len(worse)} of {len(dts)} device types, and above 2x the baseline's FA on "
            f"{len(big)}. Paper: FedAvg-w and DITTO-w 4.0-12.8x, far worse than every "
            "equally weighted method.")
        if not big:
            sizes = cfg.get("train_clips_per_device_type", {})
            mismatch.append("sample-size weighting does not blow up the FA as in the paper "
                            f"(training clips per device type here: {sizes})")
    if mismatch:
        out.append("Where the shape differs from the paper's: " + "; ".join(mismatch) + ".")
    elif out:
        out.append("The shape matches the paper's on these criteria.")
    return out


def render_markdown(result: dict[str, Any], figures: dict[str, Any] | None = None) -> str:
    cfg = result["config"]
    prof = cfg["profile"]
    reduced = prof["name"] != "full"
    heading = (
        f"# Self-FL wake-word study, profile `{prof['name']}`: width {prof['width']:g} "
        f"({cfg['model_params']:,} parameters), {prof['rounds']} rounds with full participation, "
        f"{prof['sampling_rounds']} with client sampling"
    )
    if reduced:
        heading += (" — reduced width and rounds (paper-scale settings are the `full` profile: "
                    "width 1, 30/60 rounds, 20 fixed local steps, Self-FL l_max 40)")
    ev = cfg["evaluation"]
    md = [heading, ""]
    if cfg.get("command"):
        md += [f"Produced by: `{cfg['command']}` at commit `{cfg.get('commit', 'unknown')}`", ""]
    md += [
        f"Seed {cfg['seed']}; corpus `{cfg['manifest']}`; training clips per device type "
        f"{json.dumps(cfg['train_clips_per_device_type'])}; test clips per device type "
        f"{json.dumps(cfg['test_clips_per_device_type'])}.",
        "",
        f"Metric: relative FA at matched FR against the warm-start baseline (smaller than 1 "
        f"is better), on held-out test speakers; the baseline's operating point is where its "
        f"FR meets {ev['target_fr']:g} on each cell. Cells: value [{ev['ci']}, "
        f"{ev['n_boot']} replicates]; `unbounded`: the baseline makes no false accept in that "
        "cell but the candidate does. Bold: lowest in its column.",
        "",
    ]
    if reduced:
        md += ["The corpus, model and round counts are far smaller than the paper's: cells hold "
               "few clips, so differences within the confidence intervals are noise.", ""]
    full = "full-participation"
    md += ["## Table 2a: updated global model, full participation (5 clients, all active)", "",
           method_table(result, full, "global"), "",
           "Matched relative FR of the same cells (close to 1 means the match held):", "",
           method_table(result, full, "global", field="relative_fr"), "",
           "## Table 2b: personalized models, full participation", "",
           method_table(result, full, "personalized"), "",
           "Matched relative FR:", "",
           method_table(result, full, "personalized", field="relative_fr"), ""]
    for state in cfg["states"]:
        md += [f"### Device state `{state}`: global model", "",
               method_table(result, full, "global", state=state), ""]
    if cfg["activity_rates"]:
        md += [f"## Table 5: client sampling, updated global model ({4 * len(cfg['device_types'])} "
               "clients, 4 per device type; cluster-level = clusters by device type)", "",
               sampling_table(result, "global"), "",
               "## Table 6: client sampling, personalized models "
               f"({ev['personalized_sampling']})", "",
               sampling_table(result, "personalized"), ""]
    md += ["## Tuning (the same grid for every method)", "",
           f"Grid: learning rate in {cfg['tuning']['grid']['lr']}; selection: "
           f"{cfg['tuning']['selection']}. A one-point grid runs no selection. Client sampling "
           f"reuses Self-FL's selected learning rate ({cfg['tuning']['sampling_lr']:g}).", "",
           tuning_table(result), ""]
    md += ["## Comparison with the paper's shape", ""]
    md += [f"- {line}" for line in shape_findings(result)] + [""]
    if figures:
        md += ["## Figures", ""]
        for name, path in figures.items():
            md.append(f"- {name}: `{Path(path).name}`")
        md.append("")
    md += ["## Timings (s)", "", f"Total: {cfg.get('seconds_total', 0):.0f} s.", "",
           "| run | seconds |", "|---|---|"]
    md += [f"| {k} | {v} |" for k, v in cfg["timings_s"].items()]
    return "\n".join(md) + "\n"


# ---- plots ------------------------------------------------------------------------------


def plot_step_counts(step_counts: Sequence[dict[str, Any]], settings: Sequence[str],
                     method: str, path: Path, title: str) -> Path | None:
    """Local step counts per client and round (one panel per setting)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = method.split("|")
    # One panel per (setting, method): a client's points of two methods must not be joined.
    panels = [(s, m) for s in settings for m in methods
              if any(r["setting"] == s and r["method"] == m for r in step_counts)]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 3.8), squeeze=False)
    for ax, (setting, meth) in zip(axes[0], panels, strict=True):
        recs = [r for r in step_counts if r["setting"] == setting and r["method"] == meth]
        clients = sorted({r["client"] for r in recs})
        for cid in clients:
            pts = sorted((r["round"], r["local_steps"]) for r in recs if r["client"] == cid)
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", ms=3, lw=1, label=cid if len(clients) <= 10 else None)
        ax.set_xlabel("round")
        ax.set_ylabel("local SGD steps")
        ax.set_title(f"{setting}, {meth}", fontsize=9)
        if len(clients) <= 10:
            ax.legend(fontsize=7, ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_det_curves(det: dict[str, Any], labels: dict[str, str], out: Path, stem: str,
                    title: str) -> dict[str, Path]:
    """One DET plot per device type (`wakefl.tools.det_plot`): the baseline and each method."""
    from wakefl.sdk.wake_metrics import det_curve
    from wakefl.tools.det_plot import plot_det

    paths: dict[str, Path] = {}
    for dt in sorted(det):
        lab = det[dt]["labels"]
        curves = {labels.get(name, name): det_curve(scores[lab == 1], scores[lab == 0])
                  for name, scores in det[dt]["scores"].items()}  # baseline first
        paths[dt] = plot_det(curves, out / f"{stem}_{dt}.png", f"{title}, device type {dt}",
                             int((lab == 1).sum()), int((lab == 0).sum()))
    return paths


def write_report(result: dict[str, Any], out: Path, det: dict[str, dict[str, Any]] | None = None
                 ) -> dict[str, Path]:
    """Write results.json, the figures and results.md into `out`; return their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = result["config"]
    figures: dict[str, Path] = {}
    sampling = [s for s in cfg["settings"] if s.startswith("sampling")]
    p = plot_step_counts(result["step_counts"], ["full-participation"], "selffl|selffl-alg2",
                         out / "fig11_steps_full_participation.png",
                         "Self-FL local steps per client and round, full participation (Fig. 11)")
    if p:
        figures["Figure 11: Self-FL steps, full participation"] = p
    p = plot_step_counts(result["step_counts"], sampling, "selffl-client|selffl-cluster",
                         out / "fig12_steps_sampling.png",
                         "Self-FL local steps per client and round, client sampling (Fig. 12)")
    if p:
        figures["Figure 12: Self-FL steps, client sampling"] = p
    for key, d in sorted((det or {}).items()):
        setting, model = key.split("/")
        for dt, p in plot_det_curves(d, cfg["method_labels"], out, f"det_{setting}_{model}",
                                     f"{setting}, {model}").items():
            figures[f"DET curves, {setting}, {model} models, device type {dt}"] = p
    paths = {"json": out / "results.json", "markdown": out / "results.md", **figures}
    paths["json"].write_text(json.dumps(result, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    paths["markdown"].write_text(render_markdown(result, figures), encoding="utf-8")
    return paths
