"""Renders the paper study's result (`wakefl.tools.studies.paper_experiment`) as Markdown tables in
the paper's layout (Tables 2a/2b, 5, 6), step-count plots (Figures 11-12) and DET curves.

Rendering is a pure function of the result dict (plus the raw scores for DET curves), so
the same result always gives byte-identical tables. The tables themselves are
`paper_tables`, the findings in words `paper_findings`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from wakefl.tools.studies.paper_findings import shape_findings, why_findings
from wakefl.tools.studies.paper_tables import (
    MATCHED_FA,
    ablation_table,
    comparison_table,
    fr_comparison_table,
    gate_table,
    method_table,
    power_table,
    sampling_table,
    tuning_table,
)


def _md_ablations(result: dict[str, Any]) -> list[str]:
    """The Self-FL ablation tables, when the run has ablation rows."""
    ablations = result["config"].get("selffl_ablations") or {}
    if not ablations:
        return []
    rules = "; ".join(
        f"`{name}`: " + ", ".join(f"{k}={v!r}" for k, v in over.items())
        for name, over in ablations.items()
    )
    intro = (
        "Self-FL (Alg. 1; client level under sampling) at the selected learning rate with "
        "some of wakefl's rules switched back to the paper's (docs/SELF_FL.md, \"Deliberate "
        f'deviations"), all states pooled. {rules}.'
    )
    return [
        "## Self-FL ablations: the paper's rules back, global model",
        "",
        intro,
        "",
        ablation_table(result, "global"),
        "",
        "## Self-FL ablations: personalized models",
        "",
        ablation_table(result, "personalized"),
        "",
    ]


def render_markdown(result: dict[str, Any], figures: dict[str, Any] | None = None) -> str:
    cfg = result["config"]
    md = _md_preamble(result)
    md += _md_tables(result)
    md += ["## Comparison with the paper's shape", ""]
    md += [f"- {line}" for line in shape_findings(result)] + [""]
    md += ["## Why the shape differs from the paper's", ""]
    md += [f"- {line}" for line in why_findings(result)] + [""]
    if figures:
        md += ["## Figures", ""]
        for name, path in figures.items():
            md.append(f"- {name}: `{Path(path).name}`")
        md.append("")
    md += [
        "## Timings (s)",
        "",
        f"Total: {cfg.get('seconds_total', 0):.0f} s.",
        "",
        "| run | seconds |",
        "|---|---|",
    ]
    md += [f"| {k} | {v} |" for k, v in cfg["timings_s"].items()]
    return "\n".join(md) + "\n"


def _md_heading(cfg: dict[str, Any]) -> str:
    prof = cfg["profile"]
    heading = (
        f"# Self-FL wake-word study, profile `{prof['name']}`: width {prof['width']:g} "
        f"({cfg['model_params']:,} parameters), {prof['rounds']} rounds with full participation, "
        f"{prof['sampling_rounds']} with client sampling"
    )
    if prof["name"] != "full":
        heading += (
            " — reduced width and rounds (paper-scale settings are the `full` profile: "
            "width 1, 30/60 rounds, 20 fixed local steps, Self-FL l_max 40)"
        )
    grid = cfg.get("tuning", {}).get("grid", {}).get("lr")
    if grid:
        heading += (
            f"; every method tuned over the same learning rates "
            f"{{{', '.join(f'{g:g}' for g in grid)}}}"
        )
    return heading


def _md_preamble(result: dict[str, Any]) -> list[str]:
    """Heading, provenance, the metric and how to read a cell."""
    cfg = result["config"]
    ev = cfg["evaluation"]
    md = [_md_heading(cfg), ""]
    if cfg.get("command"):
        md += [f"Produced by: `{cfg['command']}` at commit `{cfg.get('commit', 'unknown')}`", ""]
    md += [
        f"Seed {cfg['seed']}; corpus `{cfg['manifest']}`; training clips per device type "
        f"{json.dumps(cfg['train_clips_per_device_type'])}; test clips per device type "
        f"{json.dumps(cfg['test_clips_per_device_type'])}.",
        "",
        f"Metric: relative FA at matched FR against the warm-start baseline (smaller than 1 "
        f"is better), on held-out test speakers; the baseline's operating point is where its "
        f"FR meets {ev['target_fr']:g} on each device type's test clips, and each candidate's "
        f"threshold matches that FR; the device-state rows count false accepts within the state "
        f"at those same thresholds (a device ships one threshold). Cells: value [{ev['ci']}, "
        f"{ev['n_boot']} replicates]; `unbounded`: the baseline makes no false accept in that "
        "cell but the candidate does; `↓` / `↑`: the interval lies wholly below / above 1 "
        "(better / worse than the warm start beyond the resampling noise); no mark: not "
        "resolved. Bold: lowest in its column (lowest is not the same as significantly lower: "
        "see the comparison with the best other method below).",
        "",
    ]
    if cfg["profile"]["name"] != "full":
        md += [
            "The corpus, model and round counts are far smaller than the paper's: "
            "differences within the confidence intervals are noise.",
            "",
        ]
    if any(r.get("baseline_fa_count") is not None for r in result["rows"]):
        md += [
            "## What the test cells hold (full participation, all states)",
            "",
            power_table(result),
            "",
        ]
    return md


def _md_tables(result: dict[str, Any]) -> list[str]:
    """Tables 2a/2b, the device states, Tables 5/6, tuning, the comparisons and the
    Self-FL ablations."""
    return (
        _md_full_participation(result)
        + _md_sampling(result)
        + _md_tuning(result)
        + _md_gate(result)
        + _md_comparisons(result)
        + _md_ablations(result)
    )


def _md_full_participation(result: dict[str, Any]) -> list[str]:
    """Tables 2a/2b and the global model per device state."""
    cfg = result["config"]
    full = "full-participation"
    md = [
        "## Table 2a: updated global model, full participation (5 clients, all active)",
        "",
        method_table(result, full, "global"),
        "",
        "Matched relative FR of the same cells (close to 1 means the match held):",
        "",
        method_table(result, full, "global", field="relative_fr"),
        "",
        "## Table 2b: personalized models, full participation",
        "",
        method_table(result, full, "personalized"),
        "",
        "Matched relative FR:",
        "",
        method_table(result, full, "personalized", field="relative_fr"),
        "",
    ]
    if any(MATCHED_FA in r for r in result["rows"]):
        md += [
            "Relative FR at matched FA per clip (fewer misses at the baseline's false-accept "
            "rate is below 1), with its speaker-bootstrap interval:",
            "",
            method_table(result, full, "personalized", field=MATCHED_FA),
            "",
        ]
    for state in cfg["states"]:
        md += [
            f"### Device state `{state}`: global model",
            "",
            method_table(result, full, "global", state=state),
            "",
        ]
    return md


def _md_sampling(result: dict[str, Any]) -> list[str]:
    """Tables 5 and 6 (client sampling), when the run has activity rates, then every method
    run under sampling beside Self-FL's two levels."""
    cfg = result["config"]
    if not cfg["activity_rates"]:
        return []
    ev = cfg["evaluation"]
    md = [
        f"## Table 5: client sampling, updated global model ({4 * len(cfg['device_types'])} "
        "clients, 4 per device type; cluster-level = clusters by device type)",
        "",
        sampling_table(result, "global"),
        "",
        f"## Table 6: client sampling, personalized models ({ev['personalized_sampling']})",
        "",
        sampling_table(result, "personalized"),
        "",
    ]
    rivals = cfg.get("sampling_methods") or []
    if not rivals:
        return md
    methods = ["selffl-client", "selffl-cluster", *rivals]
    for rate in cfg["activity_rates"]:
        setting = f"sampling-{rate:g}"
        md += [
            f"### Every method under client sampling, C = {rate:g} (all states; each method at "
            "its own selected learning rate)",
            "",
            "Updated global model:",
            "",
            method_table(result, setting, "global", methods=methods),
            "",
            "Personalized models:",
            "",
            method_table(result, setting, "personalized", methods=methods),
            "",
        ]
        if any(MATCHED_FA in r for r in result["rows"] if r["setting"] == setting):
            md += [
                "Personalized models, relative FR at matched FA per clip:",
                "",
                method_table(result, setting, "personalized", field=MATCHED_FA, methods=methods),
                "",
            ]
    return md


def _md_tuning(result: dict[str, Any]) -> list[str]:
    """The learning-rate grid and what each method selected."""
    cfg = result["config"]
    return [
        "## Tuning (the same grid for every method)",
        "",
        f"Grid: learning rate in {cfg['tuning']['grid']['lr']}; selection: "
        f"{cfg['tuning']['selection']}. A one-point grid runs no selection. Under client "
        f"sampling Self-FL runs at its selected learning rate "
        f"({cfg['tuning']['sampling_lr']:g}), and every other method at its own.",
        "",
        tuning_table(result),
        "",
    ]


def _md_gate(result: dict[str, Any]) -> list[str]:
    """The served models with the gate on, when the run has them."""
    if not result.get("gate"):
        return []
    return [
        "## Served models with the gate on (all states)",
        "",
        "Each Self-FL client serves what the served-model gate decides on its device "
        "type's validation speakers: its personalized model or the global model when "
        "that is not worse than the warm start beyond the noise and better in the point "
        "figures, else the warm start (docs/SELF_FL.md). Counts of clients whose served "
        "(personalized) model's relative FA on the test speakers has a 95% CI wholly "
        "above 1.",
        "",
        gate_table(result),
        "",
    ]


def _md_comparisons(result: dict[str, Any]) -> list[str]:
    """Self-FL against the warm start and the best other method, when the run has them."""
    if not result.get("comparisons"):
        return []
    ev = result["config"]["evaluation"]
    return [
        "## Self-FL against the warm start and against the best other method "
        "(each setting, all states)",
        "",
        "`vs baseline`: the relative FA's 95% CI lies wholly below 1 (better), wholly "
        "above (worse), or includes 1 (not resolved). `FA ratio to it`: Self-FL's FA "
        "over the best other method's FA at the same matched FR, with a paired bootstrap "
        f"over the same resampling units ({ev['n_boot']} replicates); the best other "
        "method is picked on the test set, which favours it.",
        "",
        comparison_table(result),
        "",
        *_fr_comparison(result),
    ]


def _fr_comparison(result: dict[str, Any]) -> list[str]:
    table = fr_comparison_table(result)
    if not table:
        return []
    return [
        "The same by the relative FR at matched FA per clip (how many fewer wake words are "
        "missed at the baseline's false-accept rate): `FR ratio to it` is Self-FL's FR over "
        "the best other method's FR, each held to that false-accept rate, with the same "
        "paired bootstrap; `tied`: its CI includes 1.",
        "",
        table,
        "",
    ]


# ---- plots ------------------------------------------------------------------------------


def plot_step_counts(
    step_counts: Sequence[dict[str, Any]],
    settings: Sequence[str],
    method: str,
    path: Path,
    title: str,
) -> Path | None:
    """Local step counts per client and round (one panel per setting)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = method.split("|")
    # One panel per (setting, method): a client's points of two methods must not be joined.
    panels = [
        (s, m)
        for s in settings
        for m in methods
        if any(r["setting"] == s and r["method"] == m for r in step_counts)
    ]
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


def plot_det_curves(
    det: dict[str, Any], labels: dict[str, str], out: Path, stem: str, title: str
) -> dict[str, Path]:
    """One DET plot per device type (`wakefl.tools.evaluation.det_plot`): the baseline and each method."""
    from wakefl.sdk.wake_metrics import det_curve
    from wakefl.tools.evaluation.det_plot import plot_det

    paths: dict[str, Path] = {}
    for dt in sorted(det):
        lab = det[dt]["labels"]
        curves = {
            labels.get(name, name): det_curve(scores[lab == 1], scores[lab == 0])
            for name, scores in det[dt]["scores"].items()
        }  # baseline first
        paths[dt] = plot_det(
            curves,
            out / f"{stem}_{dt}.png",
            f"{title}, device type {dt}",
            int((lab == 1).sum()),
            int((lab == 0).sum()),
        )
    return paths


def write_report(
    result: dict[str, Any], out: Path, det: dict[str, dict[str, Any]] | None = None
) -> dict[str, Path]:
    """Write results.json, the figures and results.md into `out`; return their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = result["config"]
    figures: dict[str, Path] = {}
    sampling = [s for s in cfg["settings"] if s.startswith("sampling")]
    p = plot_step_counts(
        result["step_counts"],
        ["full-participation"],
        "selffl|selffl-alg2",
        out / "fig11_steps_full_participation.png",
        "Self-FL local steps per client and round, full participation (Fig. 11)",
    )
    if p:
        figures["Figure 11: Self-FL steps, full participation"] = p
    p = plot_step_counts(
        result["step_counts"],
        sampling,
        "selffl-client|selffl-cluster",
        out / "fig12_steps_sampling.png",
        "Self-FL local steps per client and round, client sampling (Fig. 12)",
    )
    if p:
        figures["Figure 12: Self-FL steps, client sampling"] = p
    for key, d in sorted((det or {}).items()):
        setting, model = key.split("/")
        for dt, p in plot_det_curves(
            d, cfg["method_labels"], out, f"det_{setting}_{model}", f"{setting}, {model}"
        ).items():
            figures[f"DET curves, {setting}, {model} models, device type {dt}"] = p
    paths = {"json": out / "results.json", "markdown": out / "results.md", **figures}
    paths["json"].write_text(json.dumps(result, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    paths["markdown"].write_text(render_markdown(result, figures), encoding="utf-8")
    return paths
