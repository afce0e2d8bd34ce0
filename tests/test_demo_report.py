"""The demo's at-a-glance summary (tools/fleet/demo_report.py) on constructed evaluation rows and
gate records, and the Markdown the HTML report renders from it."""

from __future__ import annotations

from wakefl.tools.evaluation.report import markdown_html
from wakefl.tools.fleet.demo_report import (
    ci_above_one,
    ci_below_one,
    counts_line,
    demo_rows,
    device_summary,
    readme_table,
    resolution_lines,
    summary_markdown,
)


def _record(base_fr, cand_fr, ci, base_fa=0.0, cand_fa=0.0, replicates=200):
    return {
        "baseline_fr": base_fr,
        "candidate_fr": cand_fr,
        "relative_fr": None
        if base_fr == 0 and cand_fr
        else (cand_fr / base_fr if base_fr else 1.0),
        "relative_fr_ci": list(ci),
        "baseline_fa": base_fa,
        "candidate_fa": cand_fa,
        "replicates": replicates,
        "unbounded": base_fr == 0 and cand_fr > 0,
    }


def _row(device, candidate, per_hour, clip=None, hours=0.1, n_pos=54):
    return {
        "candidate": candidate,
        "device_type": device,
        "state": "all",
        "n_positive": n_pos,
        "n_speakers": 4,
        "stream_hours": hours,
        "fa_per_hour_resolution": 1 / hours if hours else None,
        "relative_fr_at_matched_fa_per_hour": per_hour,
        "relative_fr_at_matched_clip_fa": clip or per_hour,
    }


ROWS = [
    _row("A", "served-A", _record(0.8, 0.2, (0.1, 0.4), 10.0, 0.0)),
    _row("B", "served-B", _record(0.5, 0.5, (0.8, 1.3))),
    _row("B", "global", _record(0.5, 0.4, (0.5, 1.0))),  # not a served model: not summarised
]
GATES = {
    "A": {
        "served": {"model": "personalized", "round": 2.0},
        "gate": {"reason": "the served model is kept: ..."},
        "switched_by": {"reason": "personalized is served: ..."},
    },
    "B": {"served": {"model": "baseline"}, "gate": {"reason": "the served model is kept: ..."}},
}


def test_one_row_per_device_type_with_the_gate_and_its_reason():
    summary = device_summary(ROWS, ["A", "B"], GATES)
    assert [s["device_type"] for s in summary] == ["A", "B"]
    assert summary[0]["serves"] == "personalized" and summary[1]["serves"] == "baseline"
    md = summary_markdown(summary, None, ["A", "B"], "The baseline works at its shipped threshold.")
    text = "\n".join(md)
    # A: 0.80 -> 0.20 at 10 -> 0 FA/h, relative FR 0.25 with its interval below 1 (bold).
    assert (
        "| A | 0.80 | 10.0 | personalized | 0.20 | 0.0 | **0.25 [0.10, 0.40]** | switched in round 2 |"
        in text
    )
    assert (
        "| B | 0.50 | 0.0 | baseline | 0.50 | 0.0 | 1.00 [0.80, 1.30] | kept the baseline |" in text
    )
    assert "on 1 of 2 device types: A." in text
    assert "- **A** serves the personalized model of round 2: personalized is served" in text
    assert "- **B** serves the baseline model: the served model is kept" in text
    # The resolution is stated once when the device types share it: 6 minutes, 10 FA/h.
    assert text.count("Resolution") == 1 and "cannot resolve less than 10 FA/h" in text
    assert "steps of 1.9%" in text


def test_resolution_per_device_type_when_they_differ_and_clip_matching_without_streams():
    rows = [
        _row("A", "served-A", _record(0.4, 0.2, (0.1, 0.9)), hours=0.5),
        _row("B", "served-B", None, clip=_record(0.4, 0.4, (0.5, 1.5)), hours=0.0),
    ]
    summary = device_summary(rows, ["A", "B"], {})
    lines = resolution_lines(summary)
    assert len(lines) == 2 and "2 FA/h" in lines[0] and "FA is matched on the clips" in lines[1]
    assert summary[1]["matched_on"] == "FA/clip" and summary[1]["reason"].startswith("no gate")
    assert ci_below_one(summary[0]["record"]) and not ci_below_one(summary[1]["record"])
    assert not ci_below_one(_record(0.4, 0.0, (None, None), replicates=0))


def test_new_users_are_reported_apart_and_the_html_has_no_raw_markdown():
    new_rows = [_row("A", "served-A", None, clip=_record(0.9, 0.6, (0.4, 0.9)), hours=0.0)]
    summary = device_summary(ROWS, ["A", "B"], GATES)
    md = summary_markdown(summary, new_rows, ["A", "B"], "Note `x`.")
    text = "\n".join(md)
    assert "### Users kept out of training" in text
    assert "| A | 0.90 | 0.60 | 0.67 [0.40, 0.90] | 54 |" in text
    html = markdown_html(md)
    assert "`" not in html and "**" not in html
    assert "<code>x</code>" in html and "<table>" in html and "<b>A</b>" in html
    assert html.count("<ul>") == 1 and "<h2>" in html and "<h3>" in html


def test_the_json_rows_carry_the_served_figures_and_the_gates_evidence():
    switched = {
        "reason": "personalized is served: ...",
        "rule": {"upper_bound": 1.0, "min_positives": 10, "ties": "keep"},
        "n_positive": 43,
        "n_negative": 529,
        "verdicts": {"personalized": "admit", "global": "not_shown_no_worse"},
        "comparisons": [
            {
                "candidate": "personalized",
                "reference": "served",
                "relative_fa": 1.0,
                "relative_fa_ci": [1.0, 1.0],
                "relative_fr_matched_fa": 0.5,
                "relative_fr_matched_fa_ci": [0.3, 0.9],
            },
            {"candidate": "global", "reference": "served", "relative_fr_matched_fa": 0.9},
        ],
    }
    gates = {"A": {**GATES["A"], "switched_by": switched}, "B": GATES["B"]}
    rows = [
        *ROWS,
        _row("C", "served-C", _record(0.3, 0.5, (1.2, 2.0))),  # worse beyond its interval
    ]
    summary = device_summary(rows, ["A", "B", "C"], gates)
    out = demo_rows(summary, gates)
    a, b, c = out
    assert (a["relative_fr"], a["relative_fr_ci"]) == (0.25, [0.1, 0.4])
    assert a["gain_beyond_interval"] and not a["worse_beyond_interval"] and a["gate_switched"]
    ev = a["gate_evidence"]
    assert ev["n_positive"] == 43 and ev["verdicts"]["personalized"] == "admit"
    assert ev["against"]["served"]["relative_fr_matched_fa_ci"] == [0.3, 0.9]
    assert not b["gate_switched"] and b["gate_evidence"] is None
    assert c["worse_beyond_interval"] and not c["gain_beyond_interval"]
    table = readme_table(out)
    assert table[2] == (
        "| A | 0.80 | personalized (round 2) | 0.20 | **0.25 [0.10, 0.40]** | 0.50 [0.30, 0.90] |"
    )
    assert table[3] == "| B | 0.50 | baseline (kept) | 0.50 | 1.00 [0.80, 1.30] | n/a |"
    assert counts_line(out) == (
        "Served models that miss fewer wake words than the baseline beyond their interval: "
        "1 of 3 (A); worse beyond their interval: 1 (C)."
    )
    assert ci_above_one({"replicates": 10, "relative_fr_ci": [None, None]})  # unbounded
