"""The evaluation report in a folder: DET plots (PNG), `report.md` (plots beside it),
`report.html` (plots embedded, a single self-contained file) and `results.json`."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from wakefl.tools.evaluation.cells import ALL, BASELINE
from wakefl.tools.evaluation.det_plot import coinciding, plot_det
from wakefl.tools.evaluation.evaluate import EvalResult

COLUMNS = (
    ("candidate", "candidate"),
    ("device_type", "device"),
    ("state", "state"),
    ("fr", "FR base→cand"),
    ("fa", "FA/clip base→cand"),
    ("relative_fa", "rel. FA [95% CI]"),
    ("relative_fr", "rel. FR"),
    ("fa_per_hour", "FA/hour base→cand"),
    ("n_positive", "wake words"),
    ("n_negative", "negatives"),
    ("n_speakers", "speakers"),
    ("stream_hours", "stream h"),
    ("note", "note"),
)


def _num(x: float | None, fmt: str = "{:.3f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _bound(x: float | str | None) -> str:
    return x if isinstance(x, str) else _num(x, "{:.2f}")


def _fph(x: float | None, saturated: bool) -> str:
    return _num(x, "{:.1f}") + (" (saturated)" if saturated else "")


def row_notes(row: dict[str, Any]) -> list[str]:
    """A row's notes, each once, its interval's note included."""
    parts = [p for n in (row["note"], row["relative_fa_ci"]["note"]) for p in n.split("; ") if p]
    return list(dict.fromkeys(parts))


def note_refs(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Every distinct note of `rows`, numbered in order of appearance: a table cites a note
    by number and lists each once below it, instead of repeating it on every row."""
    refs: dict[str, int] = {}
    for r in rows:
        for n in row_notes(r):
            refs.setdefault(n, len(refs) + 1)
    return refs


def _cells(row: dict[str, Any], refs: dict[str, int] | None = None) -> list[str]:
    ci_rec = row["relative_fa_ci"]
    ci = f"[{_bound(ci_rec['lower'])}, {_bound(ci_rec['upper'])}]"
    notes = row_notes(row)
    note = "; ".join(notes) if refs is None else " ".join(f"[{refs[n]}]" for n in notes)
    return [
        row["candidate"],
        row["device_type"],
        row["state"],
        f"{_num(row['baseline_fr'])} → {_num(row['fr'])}",
        f"{_num(row['baseline_fa'])} → {_num(row['fa'])}",
        f"{_num(row['relative_fa'])} {ci}",
        _num(row["relative_fr"]),
        f"{_fph(row['baseline_fa_per_hour'], row['baseline_fa_per_hour_saturated'])} → "
        f"{_fph(row['fa_per_hour'], row['fa_per_hour_saturated'])}",
        str(row["n_positive"]),
        str(row["n_negative"]),
        str(row["n_speakers"]),
        f"{row['stream_hours']:.3f}",
        note,
    ]


def _explanation(result: EvalResult) -> list[str]:
    st = result.settings
    return [
        f"Manifest `{result.manifest}`, split `{st.split}`: {result.summary['n_clips']} clips, "
        f"{result.summary['n_streams']} negative streams ({result.summary['stream_hours']:.3f} h).",
        _baseline_point(result),
        "Each candidate's threshold gives the FR "
        "closest to the baseline's (the lower FR when two are equally close, the largest "
        "threshold for that FR). States are evaluated at their device type's thresholds; "
        "device `all` pools every device type with one operating point.",
        "Relative FA = candidate FA / baseline FA at those thresholds (below 1 is better); a "
        "ratio over a baseline of 0 is n/a, 0/0 is 1 (see notes). The 95% interval comes from "
        f"{st.n_boot} bootstrap resamples of speakers, redoing the matching in each.",
        f"FA/hour: detection events of the streaming detector (hop {st.hop_s} s) on the negative "
        "streams at each model's threshold, over the stream hours shown. The refractory period "
        "caps it at one event per period; a figure within 20% of that ceiling is marked "
        "(saturated): the real rate of false triggers may be higher.",
        "An interval bound shown as `unbounded` comes from resamples in which the baseline made "
        "no false accept while the candidate did (a ratio over zero).",
    ]


def _baseline_point(result: EvalResult) -> str:
    shipped = result.summary.get("baseline_thresholds")
    if not shipped:
        return (
            f"Baseline operating point per device type: the largest threshold whose FR is at "
            f"most {result.settings.target_fr:.1%} (a score >= threshold accepts)."
        )
    text = (
        "Baseline operating point per device type: its shipped threshold ("
        + ", ".join(f"{d} {t:g}" for d, t in shipped.items())
        + "), not refitted; see the "
        "table of the baseline at its shipped threshold."
    )
    skipped = result.summary.get("pooled_rows_skipped")
    if skipped:
        text += f" Pooled rows omitted: {skipped['why']}."
    return text


def shipped_table(result: EvalResult) -> list[str]:
    """Markdown lines: the baseline's FR, FA and FA/hour at its shipped threshold, per device
    type, beside which the rows give relative FA at matched FR."""
    if not result.summary.get("baseline_thresholds"):
        return []
    lines = [
        "## The baseline at its shipped threshold",
        "",
        "| device | threshold | FR | FA/clip | FA/hour | wake words | negatives | stream h |",
        "|---|---|---|---|---|---|---|---|",
    ]
    seen = set()
    for r in result.rows:
        if r["state"] != ALL or r["device_type"] in seen:
            continue
        seen.add(r["device_type"])
        lines.append(
            f"| {r['device_type']} | {r['baseline_threshold']:g} | {_num(r['baseline_fr'])} | "
            f"{_num(r['baseline_fa'])} | {_fph(r['baseline_fa_per_hour'], r['baseline_fa_per_hour_saturated'])} | "
            f"{r['n_positive']} | {r['n_negative']} | {r['stream_hours']:.3f} |"
        )
    return [*lines, ""]


def _matched_cell(rec: dict[str, Any] | None) -> str:
    """`0.42 [0.20, 0.81]` from a relative-FR-at-matched-FA record; n/a without one."""
    if rec is None:
        return "n/a"
    lo, hi = rec["relative_fr_ci"]
    return f"{_bound(rec['relative_fr'])} [{_bound(lo)}, {_bound(hi)}]"


def matched_fa_table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: per candidate and device type, both models' FRR and FA/hour at the
    operating point, and the relative FR at matched FA (on the streams, per hour, and on
    the clips) with its speaker bootstrap interval; the FA/hour one event amounts to."""
    whole = [r for r in rows if r["state"] == ALL and "relative_fr_at_matched_clip_fa" in r]
    if not whole:
        return []
    lines = [
        "## Relative FR at matched FA",
        "",
        "Both models at the lowest threshold whose false accepts stay at the baseline's "
        "(at its operating point): relative FR below 1 means the candidate misses fewer "
        "wake words at no more false accepts; `unbounded` where the baseline misses none.",
        "",
        "| candidate | device | FRR base→cand | FA/hour base→cand | rel. FR at matched FA/hour "
        "[95% CI] | rel. FR at matched FA/clip [95% CI] | one event = FA/hour |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in whole:
        res = r.get("fa_per_hour_resolution")
        lines.append(
            f"| {r['candidate']} | {r['device_type']} | {_num(r['baseline_fr'])} → "
            f"{_num(r['fr'])} | {_num(r['baseline_fa_per_hour'], '{:.1f}')} → "
            f"{_num(r['fa_per_hour'], '{:.1f}')} | "
            f"{_matched_cell(r.get('relative_fr_at_matched_fa_per_hour'))} | "
            f"{_matched_cell(r['relative_fr_at_matched_clip_fa'])} | {_num(res, '{:.1f}')} |"
        )
    return [*lines, ""]


def _inline_html(text: str) -> str:
    """Markdown's inline code and bold as HTML, the rest escaped."""
    parts = html.escape(text).split("`")
    out = "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))
    bold = out.split("**")
    return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(bold))


def _md_table_html(rows: list[list[str]]) -> str:
    head, *body = rows
    cells = ["<table><tr>" + "".join(f"<th>{_inline_html(c)}</th>" for c in head) + "</tr>"]
    cells += ["<tr>" + "".join(f"<td>{_inline_html(c)}</td>" for c in r) + "</tr>" for r in body]
    return "\n".join([*cells, "</table>"])


def markdown_html(lines: list[str]) -> str:
    """The Markdown this report writes (headings, paragraphs, lists, tables, inline code) as
    HTML, so the HTML report shows what the Markdown one says without raw markup."""
    out: list[str] = []
    block: list[Any] = []  # the open table's rows, or the open list's items
    kind = ""

    def close() -> None:
        if kind == "table" and block:
            out.append(_md_table_html(block))
        elif kind == "list" and block:
            out.append("<ul>" + "".join(f"<li>{_inline_html(t)}</li>" for t in block) + "</ul>")
        block.clear()

    for line in lines:
        now = "table" if line.startswith("|") else "list" if line.startswith("- ") else ""
        if now != kind:
            close()
            kind = now
        if now == "table":
            if not line.startswith("|---"):
                block.append([c.strip() for c in line.strip().strip("|").split(" | ")])
        elif now == "list":
            block.append(line[2:])
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{_inline_html(line[level:].strip())}</h{level}>")
        elif line.strip():
            out.append(f"<p>{_inline_html(line)}</p>")
    close()
    return "\n".join(out)


def _plots(result: EvalResult, out_dir: Path) -> dict[str, Path]:
    plots = {}
    for device, curves in result.det.items():
        if not curves:
            continue
        rows = [r for r in result.rows if r["device_type"] == device and r["state"] == ALL]
        n_pos, n_neg = rows[0]["n_positive"], rows[0]["n_negative"]
        title = "all device types (pooled)" if device == ALL else f"device type {device}"
        plots[device] = plot_det(
            curves,
            out_dir / f"det_{device}.png",
            f"DET, {title}",
            n_pos,
            n_neg,
            result.operating_points.get(device),
        )
    return plots


def _same_as_base(result: EvalResult, device: str) -> list[str]:
    return coinciding(result.det.get(device, {}))


def results_table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines of every row, with each distinct note once below the table."""
    refs = note_refs(rows)
    lines = ["## Results", "", "| " + " | ".join(h for _, h in COLUMNS) + " |"]
    lines.append("|" + "---|" * len(COLUMNS))
    for row in rows:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in _cells(row, refs)) + " |")
    lines.append("")
    if refs:
        lines += ["Notes:", ""] + [f"- [{k}] {n}" for n, k in refs.items()] + [""]
    return lines


def _markdown(result: EvalResult, plots: dict[str, Path], summary: list[str]) -> str:
    lines = ["# Wake-word evaluation: relative FA/FR against the baseline", "", *summary]
    if summary:
        lines += ["## How the evaluation was done", ""]
    lines += [f"- {t}" for t in _explanation(result)]
    lines += ["", "Models: " + ", ".join(f"`{n}` = `{p}`" for n, p in result.models.items()), ""]
    lines += shipped_table(result)
    lines += matched_fa_table(result.rows)
    lines += results_table(result.rows)
    lines += ["## DET curves", ""]
    for device, path in plots.items():
        lines += [f"### {device}", "", f"![DET {device}]({path.name})", ""]
        lines += [
            f"{n} has the same DET curve as the baseline." for n in _same_as_base(result, device)
        ]
        lines.append("")
    return "\n".join(lines) + "\n"


def _html(result: EvalResult, plots: dict[str, Path], summary: list[str]) -> str:
    esc = html.escape
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        "<title>wakefl evaluation</title><style>body{font-family:sans-serif;margin:2em}"
        "table{border-collapse:collapse;font-size:0.85em}td,th{border:1px solid #bbb;"
        "padding:3px 6px}th{background:#eee}tr.all{font-weight:bold}</style></head><body>",
        "<h1>Wake-word evaluation: relative FA/FR against the baseline</h1>",
        markdown_html(summary),
        "<h2>How the evaluation was done</h2>" if summary else "",
        "<ul>",
    ]
    parts += [f"<li>{_inline_html(t)}</li>" for t in _explanation(result)]
    parts.append(
        "</ul><p>Models: "
        + ", ".join(
            f"<code>{esc(n)}</code> = <code>{esc(p)}</code>" for n, p in result.models.items()
        )
        + "</p>"
    )
    parts.append(markdown_html(shipped_table(result) + matched_fa_table(result.rows)))
    parts.append(markdown_html(results_table(result.rows)))
    parts.append("<h2>DET curves</h2>")
    for device, path in plots.items():
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        parts.append(
            f"<h3>{esc(device)}</h3><img alt='DET {esc(device)}' src='data:image/png;base64,{data}'>"
        )
        parts += [
            f"<p>{esc(n)} has the same DET curve as the baseline.</p>"
            for n in _same_as_base(result, device)
        ]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def result_json(result: EvalResult) -> dict[str, Any]:
    """The JSON document `wakefl eval --json` prints and `results.json` holds."""
    st = result.settings
    return {
        "rows": result.rows,
        "baseline": result.models[BASELINE],
        "models": result.models,
        "manifest": result.manifest,
        "split": st.split,
        "target_fr": st.target_fr,
        "operating_point": "shipped threshold"
        if result.summary.get("baseline_thresholds")
        else "target FR",
        "n_boot": st.n_boot,
        "summary": result.summary,
    }


def write_report(
    result: EvalResult,
    out_dir: str | Path,
    formats: tuple[str, ...] = ("md", "html"),
    summary: list[str] | None = None,
) -> dict[str, Path]:
    """Writes the plots, the report(s) and results.json into `out_dir`; returns the paths.
    `summary`: Markdown lines put first in the reports (the demo's at-a-glance table)."""
    summary = summary or []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = _plots(result, out)
    written: dict[str, Path] = {f"det_{d}": p for d, p in plots.items()}
    if "md" in formats:
        written["md"] = out / "report.md"
        written["md"].write_text(_markdown(result, plots, summary), encoding="utf-8")
    if "html" in formats:
        written["html"] = out / "report.html"
        written["html"].write_text(_html(result, plots, summary), encoding="utf-8")
    written["json"] = out / "results.json"
    written["json"].write_text(json.dumps(result_json(result), indent=2, allow_nan=False) + "\n")
    return written
