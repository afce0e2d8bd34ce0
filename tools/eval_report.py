"""The evaluation report in a folder: DET plots (PNG), `report.md` (plots beside it),
`report.html` (plots embedded, a single self-contained file) and `results.json`."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from wakefl.tools.det_plot import plot_det
from wakefl.tools.evaluation import ALL, BASELINE, EvalResult

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


def _cells(row: dict[str, Any]) -> list[str]:
    low, high = row["relative_fa_ci"]
    ci = f"[{_num(low, '{:.2f}')}, {'unbounded' if high is None and low is not None else _num(high, '{:.2f}')}]"
    return [
        row["candidate"],
        row["device_type"],
        row["state"],
        f"{_num(row['baseline_fr'])} → {_num(row['fr'])}",
        f"{_num(row['baseline_fa'])} → {_num(row['fa'])}",
        f"{_num(row['relative_fa'])} {ci}",
        _num(row["relative_fr"]),
        f"{_num(row['baseline_fa_per_hour'], '{:.1f}')} → {_num(row['fa_per_hour'], '{:.1f}')}",
        str(row["n_positive"]),
        str(row["n_negative"]),
        str(row["n_speakers"]),
        f"{row['stream_hours']:.3f}",
        row["note"] or "",
    ]


def _explanation(result: EvalResult) -> list[str]:
    st = result.settings
    return [
        f"Manifest `{result.manifest}`, split `{st.split}`: {result.summary['n_clips']} clips, "
        f"{result.summary['n_streams']} negative streams ({result.summary['stream_hours']:.3f} h).",
        f"Baseline operating point per device type: the largest threshold whose FR is at most "
        f"{st.target_fr:.1%} (a score >= threshold accepts). Each candidate's threshold gives the FR "
        "closest to the baseline's (the lower FR when two are equally close, the largest "
        "threshold for that FR). States are evaluated at their device type's thresholds; "
        "device `all` pools every device type with one operating point.",
        "Relative FA = candidate FA / baseline FA at those thresholds (below 1 is better); a "
        "ratio over a baseline of 0 is n/a, 0/0 is 1 (see notes). The 95% interval comes from "
        f"{st.n_boot} bootstrap resamples of speakers, redoing the matching in each.",
        f"FA/hour: detection events of the streaming detector (hop {st.hop_s} s) on the negative "
        "streams at each model's threshold, over the stream hours shown.",
    ]


def _plots(result: EvalResult, out_dir: Path) -> dict[str, Path]:
    plots = {}
    for device, curves in result.det.items():
        if not curves:
            continue
        rows = [r for r in result.rows if r["device_type"] == device and r["state"] == ALL]
        n_pos, n_neg = rows[0]["n_positive"], rows[0]["n_negative"]
        title = "all device types (pooled)" if device == ALL else f"device type {device}"
        plots[device] = plot_det(curves, out_dir / f"det_{device}.png", f"DET, {title}", n_pos,
                                 n_neg, result.operating_points.get(device))
    return plots


def _markdown(result: EvalResult, plots: dict[str, Path]) -> str:
    lines = ["# Wake-word evaluation: relative FA/FR against the baseline", ""]
    lines += [f"- {t}" for t in _explanation(result)]
    lines += ["", "Models: " + ", ".join(f"`{n}` = `{p}`" for n, p in result.models.items()), ""]
    lines += ["## Results", ""]
    lines.append("| " + " | ".join(h for _, h in COLUMNS) + " |")
    lines.append("|" + "---|" * len(COLUMNS))
    for row in result.rows:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in _cells(row)) + " |")
    lines += ["", "## DET curves", ""]
    for device, path in plots.items():
        lines += [f"### {device}", "", f"![DET {device}]({path.name})", ""]
    return "\n".join(lines) + "\n"


def _html(result: EvalResult, plots: dict[str, Path]) -> str:
    esc = html.escape
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        "<title>wakefl evaluation</title><style>body{font-family:sans-serif;margin:2em}"
        "table{border-collapse:collapse;font-size:0.85em}td,th{border:1px solid #bbb;"
        "padding:3px 6px}th{background:#eee}tr.all{font-weight:bold}</style></head><body>",
        "<h1>Wake-word evaluation: relative FA/FR against the baseline</h1><ul>",
    ]
    parts += [f"<li>{esc(t)}</li>" for t in _explanation(result)]
    parts.append("</ul><p>Models: " + ", ".join(
        f"<code>{esc(n)}</code> = <code>{esc(p)}</code>" for n, p in result.models.items()) + "</p>")
    parts.append("<h2>Results</h2><table><tr>" + "".join(f"<th>{esc(h)}</th>" for _, h in COLUMNS) + "</tr>")
    for row in result.rows:
        cls = " class='all'" if row["state"] == ALL else ""
        parts.append(f"<tr{cls}>" + "".join(f"<td>{esc(c)}</td>" for c in _cells(row)) + "</tr>")
    parts.append("</table><h2>DET curves</h2>")
    for device, path in plots.items():
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        parts.append(f"<h3>{esc(device)}</h3><img alt='DET {esc(device)}' src='data:image/png;base64,{data}'>")
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
        "n_boot": st.n_boot,
        "summary": result.summary,
    }


def write_report(result: EvalResult, out_dir: str | Path, formats: tuple[str, ...] = ("md", "html")) -> dict[str, Path]:
    """Writes the plots, the report(s) and results.json into `out_dir`; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = _plots(result, out)
    written: dict[str, Path] = {f"det_{d}": p for d, p in plots.items()}
    if "md" in formats:
        written["md"] = out / "report.md"
        written["md"].write_text(_markdown(result, plots), encoding="utf-8")
    if "html" in formats:
        written["html"] = out / "report.html"
        written["html"].write_text(_html(result, plots), encoding="utf-8")
    written["json"] = out / "results.json"
    written["json"].write_text(json.dumps(result_json(result), indent=2, allow_nan=False) + "\n")
    return written
