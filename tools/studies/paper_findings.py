"""The paper study's findings in words (`wakefl.tools.studies.paper_report`): how the result's
shape compares with the paper's, and why it differs. Pure functions of the result dict."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from wakefl.tools.studies.paper_tables import ALL, best_per_column, ci_side, format_cell, index_rows


def _selffl_shape(
    idx: dict, cfg: dict[str, Any], vals: Callable[[str, str], dict[str, float | None]]
) -> tuple[list[str], list[str]]:
    """Findings on Self-FL's global and personalized models against the baseline and the
    other methods, and where they differ from the paper's."""
    s = "full-participation"
    dts = cfg["device_types"]
    out: list[str] = []
    mismatch: list[str] = []
    for method, label in (("selffl", "Alg. 1"), ("selffl-alg2", "Alg. 2")):
        for model in ("global", "personalized"):
            sf = vals(method, model)
            if not sf:
                continue
            below = [dt for dt, v in sf.items() if v is not None and v < 1.0]
            best = best_per_column(idx, s, model, cfg["methods"], dts, ALL)
            wins = [dt for dt in dts if method in best.get(dt, set())]
            sig = [
                dt
                for dt in dts
                if (s, method, model, dt, ALL) in idx
                and (idx[(s, method, model, dt, ALL)]["relative_fa_ci"][1] or np.inf) < 1.0
            ]
            out.append(
                f"Self-FL ({label}) {model} model: relative FA below 1 on {len(below)} of "
                f"{len(sf)} device types ({', '.join(below) or 'none'}); the 95% CI lies wholly "
                f"below 1 on {len(sig)} ({', '.join(sig) or 'none'}); lowest of all methods on "
                f"{len(wins)} of {len(dts)} ({', '.join(wins) or 'none'}). Paper: below 1 on 4 "
                "of 5 (global) and 5 of 5 (personalized), best on most device types."
            )
            if 2 * len(wins) <= len(dts):
                mismatch.append(
                    f"Self-FL ({label})'s {model} model is the best method on "
                    f"{len(wins)} of {len(dts)} device types, not on most"
                )
            if len(below) < len(sf) - 1:
                mismatch.append(
                    f"Self-FL ({label})'s {model} model does not improve on the "
                    f"baseline on {len(sf) - len(below)} device types"
                )
    return out, mismatch


def _weighting_shape(
    cfg: dict[str, Any], vals: Callable[[str, str], dict[str, float | None]]
) -> tuple[list[str], list[str]]:
    """The finding on sample-size weighting (FedAvg-w against FedAvg-e), and where it
    differs from the paper's."""
    dts = cfg["device_types"]
    out: list[str] = []
    mismatch: list[str] = []
    fw, fe = vals("fedavg-w", "global"), vals("fedavg-e", "global")
    if fw and fe:
        worse = [
            dt
            for dt in dts
            if (w := fw.get(dt)) is not None and (e := fe.get(dt)) is not None and w > e
        ]
        big = [dt for dt in dts if (w := fw.get(dt)) is None or w > 2.0]
        out.append(
            f"Sample-size weighting: FedAvg-w's global model is worse than FedAvg-e's on "
            f"{len(worse)} of {len(dts)} device types, and above 2x the baseline's FA on "
            f"{len(big)}. Paper: FedAvg-w and DITTO-w 4.0-12.8x, far worse than every "
            "equally weighted method."
        )
        if not big:
            sizes = cfg.get("train_clips_per_device_type", {})
            mismatch.append(
                "sample-size weighting does not blow up the FA as in the paper "
                f"(training clips per device type here: {sizes})"
            )
    return out, mismatch


def shape_findings(result: dict[str, Any]) -> list[str]:
    """Plain statements comparing this run's shape with the paper's claims; they are
    computed from the rows, so they say the opposite when the results do."""
    cfg = result["config"]
    idx = index_rows(result["rows"])
    dts = cfg["device_types"]
    s = "full-participation"

    def vals(method: str, model: str) -> dict[str, float | None]:
        return {
            dt: idx[(s, method, model, dt, ALL)]["relative_fa"]
            for dt in dts
            if (s, method, model, dt, ALL) in idx
        }

    out, mismatch = _selffl_shape(idx, cfg, vals)
    weighting, weighting_mismatch = _weighting_shape(cfg, vals)
    out += weighting
    mismatch += weighting_mismatch
    if mismatch:
        out.append("Where the shape differs from the paper's: " + "; ".join(mismatch) + ".")
    elif out:
        out.append("The shape matches the paper's on these criteria.")
    return out


def _steps_summary(result: dict[str, Any], method: str) -> dict[str, list[int]]:
    """Self-FL's local steps per device type in the full-participation setting, after the
    warm-up rounds (clients with a variance)."""
    out: dict[str, list[int]] = {}
    for r in result.get("step_counts", []):
        if (
            r["setting"] == "full-participation"
            and r["method"] == method
            and r.get("sigma_sq", 1.0)
        ):
            out.setdefault(r["device_type"], []).append(int(r["local_steps"]))
    return out


def why_findings(result: dict[str, Any]) -> list[str]:
    """Statements, computed from the numbers, on what limits this run and why its shape
    may differ from the paper's."""
    prof = result["config"]["profile"]
    out = _why_resolution(result) + _why_steps(result) + _why_imbalance(result)
    out += _why_sampling(result) + _why_gate(result)
    out.append(
        f"Scale: {prof['rounds']} rounds of a width-{prof['width']:g} model on synthetic "
        "speech through simulated devices, against the paper's internal far-field recordings "
        "and many more rounds; the paper's Self-FL gains are a few percent of FA (Table 2a: "
        "0.91-1.01), well inside the intervals a corpus of this size gives."
    )
    return out


def _why_resolution(result: dict[str, Any]) -> list[str]:
    """How many cells the intervals resolve, against the warm start and the best other."""
    cells = [
        r
        for r in result["rows"]
        if r["setting"] == "full-participation"
        and r["state"] == ALL
        and r["relative_fa"] is not None
    ]
    sides = [ci_side(r["relative_fa_ci"]) for r in cells]
    out = [
        f"Resolution: of {len(cells)} full-participation cells (every method, both models, all "
        f"states pooled), the 95% CI lies wholly below 1 in {sides.count('below')} and wholly "
        f"above 1 in {sides.count('above')}; the rest cannot be told apart from the warm start. "
        "The baseline's false-accept counts per device type are in the table above: the "
        "interval of a ratio of two such counts is what bounds every conclusion here."
    ]
    settings: dict[str, list[dict[str, Any]]] = {}
    for c in result.get("comparisons", []):
        settings.setdefault(c.get("setting", "full-participation"), []).append(c)
    for setting, comps in settings.items():
        out += _against_best_other(setting, comps)
    return out


def _against_best_other(setting: str, comps: list[dict[str, Any]]) -> list[str]:
    """How Self-FL fared against the best other method of each cell of one setting."""
    cs = [ci_side(c["ratio_to_best_other_ci"]) for c in comps]
    out = [
        f"Against the best other method of each cell, {setting} (chosen on the test set, which "
        f"favours it): Self-FL's FA is lower beyond the CI in {cs.count('below')} of "
        f"{len(comps)} comparisons, higher in {cs.count('above')}, not resolved in "
        f"{cs.count('includes 1')}."
    ]
    fr = [ci_side(c["fr_ratio_to_best_other_ci"]) for c in comps if "fr_best_other" in c]
    if fr:
        out.append(
            f"By the relative FR at matched FA per clip, {setting}: Self-FL misses fewer wake "
            f"words than the best other method beyond the CI in {fr.count('below')} of "
            f"{len(fr)} comparisons, more in {fr.count('above')}, tied within the CI in "
            f"{fr.count('includes 1')}."
        )
    return out


def _why_steps(result: dict[str, Any]) -> list[str]:
    """The step counts Eqn 16 gave, and what fewer steps than the baselines' mean."""
    cfg = result["config"]
    prof = cfg["profile"]
    k = prof["local_steps"]
    out = []
    for method in ("selffl", "selffl-alg2"):
        steps = _steps_summary(result, method)
        if not steps:
            continue
        per = "; ".join(
            f"{dt} {np.mean(v):.1f} ({min(v)}-{max(v)})" for dt, v in sorted(steps.items())
        )
        label = cfg["method_labels"].get(method, method)
        extra = (
            f"; the model it sends trains {prof['converge_steps']} more steps towards "
            "local convergence"
            if method == "selffl-alg2"
            else ""
        )
        out.append(
            f"{label}: Eqn 16 gave {per} local steps per round after the warm-up rounds "
            f"(mean, range; cap l_max = {prof['l_max']}), against the fixed {k} of the "
            f"baselines{extra}."
        )
    st1 = _steps_summary(result, "selffl")
    if not st1:
        return out
    mean1 = float(np.mean([x for v in st1.values() for x in v]))
    if mean1 < k:
        sig = [
            r
            for r in result.get("step_counts", [])
            if r["setting"] == "full-participation"
            and r["method"] == "selffl"
            and r.get("sigma_sq")
        ]
        med = float(np.median([r["sigma_sq"] for r in sig])) if sig else float("nan")
        lr = (cfg["tuning"]["per_method"].get("selffl") or {}).get("selected_lr")
        rate = (
            ""
            if not (sig and lr)
            else (
                f" With the selected eta = {lr:g} and B = {prof['batch_size']}, the median "
                f"sigma_m^2 = {med:.3g} (trace variance over the client's past personal "
                f"models) makes eta/(B sigma_m^2) = {lr / (prof['batch_size'] * med):.3g} per "
                "step, so a few steps already cover the distance Eqn 16 asks for."
            )
        )
        out.append(
            f"Self-FL (Alg. 1) therefore trains {mean1:.1f} steps per round on average "
            "after the warm-up rounds, "
            f"fewer than the baselines' {k}: its models stay closer to the warm start, "
            f"which limits how far their FA can move either way.{rate}"
        )
    return out


def _why_imbalance(result: dict[str, Any]) -> list[str]:
    """The largest device type's share of the data, and how the weightings treat it."""
    cfg = result["config"]
    sizes = cfg.get("train_clips_per_device_type", {})
    if not sizes:
        return []
    idx = index_rows(result["rows"])
    dts = cfg["device_types"]
    s = "full-participation"
    total = sum(sizes.values())
    top = max(sizes, key=lambda d: sizes[d])
    ran = [m for m in ("selffl", "selffl-alg2") if m in cfg["methods"]]
    worse = {
        m: [
            dt
            for dt in dts
            if (s, m, "global", dt, ALL) in idx
            and ci_side(idx[(s, m, "global", dt, ALL)]["relative_fa_ci"]) == "above"
        ]
        for m in ran
    }
    above = {
        m: [
            dt
            for dt in dts
            if (s, m, "global", dt, ALL) in idx
            and (idx[(s, m, "global", dt, ALL)]["relative_fa"] or np.inf) > 1.0
        ]
        for m in ran
    }
    short = {"selffl": "Alg. 1", "selffl-alg2": "Alg. 2"}
    fw = (idx.get((s, "fedavg-w", "global", top, ALL)) or {}).get("relative_fa")
    fe = (idx.get((s, "fedavg-e", "global", top, ALL)) or {}).get("relative_fa")
    weighting = (
        ""
        if fw is None or fe is None
        else (
            f" On {top}, sample-size-weighted FedAvg-w reaches {fw:.2f} and equally weighted "
            f"FedAvg-e {fe:.2f}: "
            + (
                "keeping " + top + "'s share of the training signal helps it"
                if fw < fe
                else "giving the smaller device types an equal say does not cost " + top + " here"
            )
            + "."
        )
    )
    return [
        f"Data imbalance: device type {top} holds {100 * sizes[top] / total:.0f} % of the "
        "pooled training clips the warm start was trained on; Self-FL's precision weights "
        "give every device type a similar say in the global model, as equal weighting does."
        f"{weighting}"
        + "".join(
            f" Self-FL ({short[m]}) global model: above 1 on "
            f"{', '.join(above[m]) or 'no device type'}, beyond the CI on "
            f"{', '.join(worse[m]) or 'none'}."
            for m in ran
        )
    ]


def _why_gate(result: dict[str, Any]) -> list[str]:
    """With the served-model gate on: served models worse than the warm start beyond the
    CI, against the personalized models served without it."""
    gate = result.get("gate") or []
    if not gate:
        return []
    worse = [g for g in gate if ci_side(g["served"]["relative_fa_ci"]) == "above"]
    worse_p = sum(ci_side(g["personalized"]["relative_fa_ci"]) == "above" for g in gate)
    kinds = {k: sum(g["serves"] == k for g in gate) for k in ("personalized", "global", "baseline")}
    where = "; ".join(
        f"{g['setting']} {g['method']} {g['client']} ({g['serves']}, {format_cell(g['served'])})"
        for g in worse
    )
    return [
        f"Served-model gate: of {len(gate)} Self-FL clients (every setting), "
        f"{kinds['personalized']} serve their personalized model, {kinds['global']} the "
        f"global model and {kinds['baseline']} keep the warm start, decided on their device "
        f"type's validation speakers. On the test speakers, {len(worse)} served model(s) "
        f"are worse than the warm start beyond the CI"
        + (f" ({where})" if worse else "")
        + f", against {worse_p} of the personalized models served without the gate."
    ] + _why_gate_ties(gate)


def _fa_above_one(rec: dict[str, Any]) -> bool:
    fa = rec.get("relative_fa")
    return fa is None or fa > 1.0  # None: unbounded


def _why_gate_ties(gate: list[dict[str, Any]]) -> list[str]:
    """The same clients under the earlier rule that switches on a tie (an ablation row;
    results written before the rule changed have no such field)."""
    rows = [g for g in gate if "served_ties_switch" in g]
    if not rows:
        return []
    switched = sum(g["serves_ties_switch"] != "baseline" for g in rows)
    worse = sum(ci_side(g["served_ties_switch"]["relative_fa_ci"]) == "above" for g in rows)
    above_one = sum(_fa_above_one(g["served_ties_switch"]) for g in rows)
    above_one_keep = sum(_fa_above_one(g["served"]) for g in rows)
    better = sum(ci_side(g["served_ties_switch"]["relative_fa_ci"]) == "below" for g in rows)
    better_keep = sum(ci_side(g["served"]["relative_fa_ci"]) == "below" for g in rows)
    return [
        f"Ablation, a gate that also switches on a tie (the same errors on the validation "
        f"clips): {switched} of {len(rows)} clients would leave the warm start, "
        f"{worse} of the served models would be worse than it beyond the CI, "
        f"{above_one} would have a point relative FA above 1 on the test speakers "
        f"(against {above_one_keep} with ties keeping the served model), and {better} "
        f"would be better than the warm start beyond the CI (against {better_keep})."
    ]


def _why_sampling(result: dict[str, Any]) -> list[str]:
    """What client sampling did to the personalized models at each activity rate."""
    cfg = result["config"]
    prof = cfg["profile"]
    sizes = cfg.get("train_clips_per_device_type", {})
    out = []
    for rate in cfg.get("activity_rates", []):
        setting = f"sampling-{rate:g}"
        pers = [
            r
            for r in result["rows"]
            if r["setting"] == setting
            and r["state"] == ALL
            and r["model"] == "personalized"
            and r["relative_fa"] is not None
        ]
        if not pers:
            continue
        up = sum(ci_side(r["relative_fa_ci"]) == "above" for r in pers)
        down = sum(ci_side(r["relative_fa_ci"]) == "below" for r in pers)
        takes: dict[str, int] = {}
        for r in result.get("step_counts", []):
            if r["setting"] == setting and r["method"] == "selffl-client":
                takes[r["client"]] = takes.get(r["client"], 0) + 1
        n_clients = 4 * len(cfg["device_types"])
        counts = [takes.get(c, 0) for c in sorted(takes)] + [0] * (n_clients - len(takes))
        smallest = min(sizes.values()) if sizes else 0
        out.append(
            f"Client sampling at C = {rate:g}: the personalized models are worse than the warm "
            f"start beyond the CI in {up} of {len(pers)} cells (all states pooled) and better in "
            f"{down}. Each of the {n_clients} clients holds a quarter of its device type's "
            f"training clips (down to {smallest // 4} clips) and took part in "
            f"{min(counts)}-{max(counts)} of {prof['sampling_rounds']} rounds (client level); a "
            "client that never took part personalizes with the warm-up rule (the fixed warm-up "
            "steps from the global model), and one that took part once already has a variance "
            "from within its first round (the early variance; the paper's rule needs 2 rounds); "
            "all at the learning rate selected with full participation, where each client had "
            "4 times the data."
        )
    return out
