"""What `wakefl demo` says at a glance: one row per device type with the baseline's and
the served model's false-reject rate and false accepts per hour at one matched
false-accept rate, the relative FR with its interval, and what each device's served-model
gate decided and why; what each figure can resolve; the same for the users kept out of
training. Pure functions of the evaluation rows and the gate records."""

from __future__ import annotations

from typing import Any

ALL = "all"


def _fmt(x: Any, spec: str = "{:.2f}") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, str):
        return x
    return spec.format(x)


def _interval(rec: dict[str, Any]) -> str:
    if not rec.get("replicates"):
        return "no interval"
    lo, hi = rec["relative_fr_ci"]
    return f"[{_fmt(lo)}, {_fmt(hi)}]"


def ci_above_one(rec: dict[str, Any] | None) -> bool:
    """Whether a relative-FR record's interval lies wholly above 1 (an unbounded lower
    end counts as above)."""
    if rec is None or not rec.get("replicates"):
        return False
    lo = rec["relative_fr_ci"][0]
    return not isinstance(lo, float | int) or lo > 1.0


def ci_below_one(rec: dict[str, Any] | None) -> bool:
    """Whether a relative-FR record's interval lies wholly below 1."""
    if rec is None or not rec.get("replicates"):
        return False
    hi = rec["relative_fr_ci"][1]
    return isinstance(hi, float | int) and hi < 1.0


def _own_row(rows: list[dict[str, Any]], candidate: str, device: str) -> dict[str, Any] | None:
    return next(
        (
            r
            for r in rows
            if r["candidate"] == candidate and r["device_type"] == device and r["state"] == ALL
        ),
        None,
    )


def device_summary(
    rows: list[dict[str, Any]],
    device_types: list[str],
    gates: dict[str, dict[str, Any]],
    served_name: str = "served-{}",
) -> list[dict[str, Any]]:
    """Per device type: its served model against the baseline at a matched false-accept
    rate (on the streams when there are, else on the clips), and the gate's decision."""
    out = []
    for t in device_types:
        r = _own_row(rows, served_name.format(t), t)
        if r is None:
            continue
        per_hour = r.get("relative_fr_at_matched_fa_per_hour")
        rec = per_hour if per_hour is not None else r.get("relative_fr_at_matched_clip_fa")
        gate = gates.get(t) or {}
        served = gate.get("served") or {}
        # Why it serves what it serves: the decision that switched to it, else the last one.
        decision = gate.get("switched_by") or gate.get("gate") or {}
        out.append(
            {
                "device_type": t,
                "matched_on": "FA/hour" if per_hour is not None else "FA/clip",
                "record": rec,
                "serves": served.get("model", "n/a"),
                "since_round": served.get("round"),
                "reason": decision.get("reason", "no gate decision recorded"),
                "n_positive": r["n_positive"],
                "n_speakers": r["n_speakers"],
                "stream_hours": r.get("stream_hours") or 0.0,
                "fa_per_hour_resolution": r.get("fa_per_hour_resolution"),
            }
        )
    return out


def summary_table(summary: list[dict[str, Any]]) -> list[str]:
    """Markdown lines of the per-device-type table."""
    lines = [
        "| device | baseline FRR | baseline FA/h | served model | served FRR | served FA/h "
        "| relative FR [95% CI] | gate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        rec = s["record"] or {}
        per_hour = s["matched_on"] == "FA/hour"
        fa_b = _fmt(rec.get("baseline_fa"), "{:.1f}") if per_hour else "n/a"
        fa_c = _fmt(rec.get("candidate_fa"), "{:.1f}") if per_hour else "n/a"
        gate = (
            "kept the baseline"
            if s["serves"] in ("baseline", "n/a")
            else f"switched in round {_fmt(s.get('since_round'), '{:.0f}')}"
        )
        rel = f"{_fmt(rec.get('relative_fr'))} {_interval(rec)}" if rec else "n/a"
        if ci_below_one(rec):
            rel = f"**{rel}**"
        lines.append(
            f"| {s['device_type']} | {_fmt(rec.get('baseline_fr'))} | {fa_b} | {s['serves']} | "
            f"{_fmt(rec.get('candidate_fr'))} | {fa_c} | {rel} | {gate} |"
        )
    return lines


def resolution_lines(summary: list[dict[str, Any]]) -> list[str]:
    """What the figures can resolve, once when every device type has the same amounts."""
    texts = []
    for s in summary:
        res = s.get("fa_per_hour_resolution")
        fa = (
            f"{s['stream_hours'] * 60:.0f} minutes of stream: one false accept is "
            f"{res:.0f} FA/h, so they cannot resolve less than {res:.0f} FA/h "
            "(0 means fewer than that)"
            if res
            else "no stream: FA is matched on the clips"
        )
        n = s["n_positive"]
        frr = f"{n} wake-word test clips: FRR moves in steps of {1 / n:.1%}"
        texts.append((s["device_type"], f"{frr}; {fa}."))
    distinct = {t for _, t in texts}
    if len(distinct) == 1:
        return [f"Resolution, every device type: {distinct.pop()}"]
    return [f"Resolution, device type {d}: {t}" for d, t in texts]


def gate_lines(summary: list[dict[str, Any]]) -> list[str]:
    """The gate's reason per device type, as a Markdown list."""
    return [
        f"- **{s['device_type']}** serves the {s['serves']} model"
        + (
            f" of round {_fmt(s.get('since_round'), '{:.0f}')}"
            if s["serves"] not in ("baseline", "n/a")
            else ""
        )
        + f": {s['reason']}"
        for s in summary
    ]


def targets_line(summary: list[dict[str, Any]]) -> str:
    """How many device types' served models miss fewer wake words beyond the noise."""
    below = [s["device_type"] for s in summary if ci_below_one(s["record"])]
    return (
        f"The served model misses fewer wake words than the baseline at the same false-accept "
        f"rate, with the whole interval below 1, on {len(below)} of {len(summary)} device "
        f"types{': ' + ', '.join(below) if below else ''}."
    )


def new_users_table(rows: list[dict[str, Any]], device_types: list[str]) -> list[str]:
    """Markdown lines: the served models on users kept out of their device type's training
    data, at matched FA per clip (these users have no streams)."""
    lines = [
        "| device | baseline FRR | served FRR | relative FR [95% CI] | wake words |",
        "|---|---|---|---|---|",
    ]
    for t in device_types:
        r = _own_row(rows, f"served-{t}", t)
        rec = None if r is None else r.get("relative_fr_at_matched_clip_fa")
        if r is None or rec is None:
            continue
        lines.append(
            f"| {t} | {_fmt(rec['baseline_fr'])} | {_fmt(rec['candidate_fr'])} | "
            f"{_fmt(rec['relative_fr'])} {_interval(rec)} | {r['n_positive']} |"
        )
    return lines


def summary_markdown(
    summary: list[dict[str, Any]],
    new_users_rows: list[dict[str, Any]] | None,
    device_types: list[str],
    baseline_note: str,
) -> list[str]:
    """The demo's summary section: table, resolution, the gate's reasons, new users."""
    matched_on = {s["matched_on"] for s in summary}
    how = "FA/hour on the test streams" if matched_on == {"FA/hour"} else "FA on the test clips"
    md = [
        "## Summary: what personalization changed, per device type",
        "",
        f"{baseline_note} Both models are then held to the false accepts the baseline makes "
        f"there ({how}), each at the lowest threshold that keeps them: FRR is the share of "
        "the test wake words each misses there, relative FR = served FRR / baseline FRR "
        "(below 1: fewer misses; bold: the whole 95% speaker-bootstrap interval below 1).",
        "",
        *summary_table(summary),
        "",
        targets_line(summary),
        "",
        *resolution_lines(summary),
        "",
        "What each device's served-model gate decided on its validation data (clips, and "
        "windows of its validation streams where it has them), and why:",
        "",
        *gate_lines(summary),
        "",
    ]
    if new_users_rows:
        md += [
            "### Users kept out of training",
            "",
            "The same served models on users of each device type that its training data never "
            "heard, at the baseline's false-accept rate on their clips:",
            "",
            *new_users_table(new_users_rows, device_types),
            "",
        ]
    return md


# ----------------------------------------------------------------------------- the rows
def gate_evidence(decision: dict[str, Any] | None, serves: str) -> dict[str, Any] | None:
    """What the gate saw when it chose the served model: its rule, the validation counts,
    each candidate's verdict, and the served model's relative FR at matched FA (with its
    interval) against the model served before and against the baseline. None while the
    device serves its baseline (no decision chose it)."""
    if not decision or serves in ("baseline", "n/a"):
        return None
    against = {
        c["reference"]: {
            "relative_fr_matched_fa": c.get("relative_fr_matched_fa"),
            "relative_fr_matched_fa_ci": c.get("relative_fr_matched_fa_ci"),
            "relative_fa": c.get("relative_fa"),
            "relative_fa_ci": c.get("relative_fa_ci"),
        }
        for c in decision.get("comparisons", [])
        if c.get("candidate") == serves
    }
    return {
        "rule": decision.get("rule"),
        "n_positive": decision.get("n_positive"),
        "n_negative": decision.get("n_negative"),
        "verdicts": decision.get("verdicts"),
        "against": against,
    }


def demo_rows(summary: list[dict[str, Any]], gates: dict[str, dict[str, Any]]) -> list[dict]:
    """One JSON row per device type: the served model's relative FR against the baseline
    on the test data with its interval, whether that interval lies wholly below or above
    1, and the gate's decision with its evidence."""
    rows = []
    for s in summary:
        rec = s["record"] or {}
        gate = gates.get(s["device_type"]) or {}
        decision = gate.get("switched_by") or gate.get("gate")
        rows.append(
            {
                "device_type": s["device_type"],
                "matched_on": s["matched_on"],
                "baseline_fr": rec.get("baseline_fr"),
                "served_fr": rec.get("candidate_fr"),
                "baseline_fa": rec.get("baseline_fa"),
                "served_fa": rec.get("candidate_fa"),
                "relative_fr": rec.get("relative_fr"),
                "relative_fr_ci": rec.get("relative_fr_ci") if rec.get("replicates") else None,
                "gain_beyond_interval": ci_below_one(rec),
                "worse_beyond_interval": ci_above_one(rec),
                "serves": s["serves"],
                "since_round": s.get("since_round"),
                "gate_switched": s["serves"] not in ("baseline", "n/a"),
                "gate_reason": s["reason"],
                "gate_evidence": gate_evidence(decision, s["serves"]),
            }
        )
    return rows


def _ratio_ci(point: Any, ci: Any) -> str:
    if not ci:
        return f"{_fmt(point)} (no interval)"
    return f"{_fmt(point)} [{_fmt(ci[0])}, {_fmt(ci[1])}]"


def readme_table(rows: list[dict[str, Any]]) -> list[str]:
    """The README's table of a demo run: per device type the baseline's and the served
    model's FRR at the baseline's false-accept rate, the relative FR with its interval
    (bold: wholly below 1), and the gate's validation evidence for the model it serves."""
    lines = [
        "| type | baseline FRR | served model | served FRR | relative FR [95 % CI] "
        "| gate's evidence: relative FR at matched FA on validation |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        rel = _ratio_ci(r["relative_fr"], r["relative_fr_ci"])
        if r["gain_beyond_interval"]:
            rel = f"**{rel}**"
        served = (
            f"{r['serves']} (round {_fmt(r['since_round'], '{:.0f}')})"
            if r["gate_switched"]
            else "baseline (kept)"
        )
        ev = r.get("gate_evidence") or {}
        vs = (ev.get("against") or {}).get("served") or {}
        evidence = (
            _ratio_ci(vs.get("relative_fr_matched_fa"), vs.get("relative_fr_matched_fa_ci"))
            if vs
            else "n/a"
        )
        lines.append(
            f"| {r['device_type']} | {_fmt(r['baseline_fr'])} | {served} | "
            f"{_fmt(r['served_fr'])} | {rel} | {evidence} |"
        )
    return lines


def counts_line(rows: list[dict[str, Any]]) -> str:
    """How many served models gain, and how many are worse, beyond their test interval."""
    gains = [r["device_type"] for r in rows if r["gain_beyond_interval"]]
    worse = [r["device_type"] for r in rows if r["worse_beyond_interval"]]
    return (
        f"Served models that miss fewer wake words than the baseline beyond their interval: "
        f"{len(gains)} of {len(rows)}{' (' + ', '.join(gains) + ')' if gains else ''}; "
        f"worse beyond their interval: {len(worse)}"
        f"{' (' + ', '.join(worse) + ')' if worse else ''}."
    )


def spread_table(docs: list[dict[str, Any]]) -> list[str]:
    """The README's table of one profile over seeds: per device type and seed the served
    model's relative FR with its interval (bold: wholly below 1, marked "worse": wholly
    above), or "kept" where the gate kept the baseline; then the counts per seed."""
    seeds = [f"seed {d['seed']}" for d in docs]
    lines = ["| type | " + " | ".join(seeds) + " |", "|---|" + "---|" * len(docs)]
    by_seed = [{r["device_type"]: r for r in d["rows"]} for d in docs]
    for dt in sorted({t for rows in by_seed for t in rows}):
        cells = []
        for rows in by_seed:
            r = rows.get(dt)
            if r is None:
                cells.append("n/a")
            elif not r["gate_switched"]:
                cells.append("kept")
            else:
                rel = f"{_ratio_ci(r['relative_fr'], r['relative_fr_ci'])} {r['serves']}"
                if r["gain_beyond_interval"]:
                    rel = f"**{rel}**"
                cells.append(f"{rel} (worse)" if r["worse_beyond_interval"] else rel)
        lines.append(f"| {dt} | " + " | ".join(cells) + " |")
    for label, key in (("gain", "gain_beyond_interval"), ("worse", "worse_beyond_interval")):
        counts = [sum(bool(r[key]) for r in d["rows"]) for d in docs]
        lines.append(
            f"| {label} beyond the interval | "
            + " | ".join(f"{c} of {len(d['rows'])}" for c, d in zip(counts, docs, strict=True))
            + " |"
        )
    return lines
