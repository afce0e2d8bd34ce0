"""The README's demo tables are what the demo's committed results render
(tools/studies/demo_readme.py): a change that moves a figure changes a JSON under
tools/results/ and the table with it."""

from __future__ import annotations

import json
from pathlib import Path

from wakefl.tools.studies.demo_readme import BLOCK, main, render, rewrite

ROOT = Path(__file__).resolve().parents[1]


def test_every_demo_table_in_the_readme_is_what_its_json_renders():
    readme = (ROOT / "README.md").read_text()
    blocks = list(BLOCK.finditer(readme))
    assert blocks, "the README has no demo table"
    for m in blocks:
        doc = json.loads((ROOT / m.group("path")).read_text())
        assert m.group("body") == "\n".join(render(doc)) + "\n", m.group("path")
        # The rows carry what the checks on the demo need.
        for row in doc["rows"]:
            for key in ("relative_fr", "relative_fr_ci", "gate_switched", "gate_evidence"):
                assert key in row
    assert main(["--check", "--readme", str(ROOT / "README.md")]) == 0


def test_rewrite_replaces_a_stale_table_and_check_says_so(tmp_path):
    doc = {
        "command": "wakefl demo --profile fleet --seed 0",
        "elapsed_s": 300,
        "rows": [
            {
                "device_type": "A",
                "baseline_fr": 0.5,
                "served_fr": 0.25,
                "relative_fr": 0.5,
                "relative_fr_ci": [0.3, 0.8],
                "gain_beyond_interval": True,
                "worse_beyond_interval": False,
                "serves": "personalized",
                "since_round": 2,
                "gate_switched": True,
                "gate_evidence": None,
            }
        ],
    }
    (tmp_path / "r.json").write_text(json.dumps(doc))
    stale = "intro\n<!-- demo-table: r.json -->\nold table\n<!-- /demo-table -->\nafter\n"
    readme = tmp_path / "README.md"
    readme.write_text(stale)
    assert main(["--check", "--readme", str(readme)]) == 1
    assert main(["--readme", str(readme)]) == 0
    new = readme.read_text()
    assert new == rewrite(stale, tmp_path) and new.startswith("intro\n") and "after" in new
    assert "| A | 0.50 | personalized (round 2) | 0.25 | **0.50 [0.30, 0.80]** | n/a |" in new
    assert main(["--check", "--readme", str(readme)]) == 0


def test_a_spread_block_sets_the_seeds_side_by_side(tmp_path):
    def row(dt, switched, rel, ci, gain=False, worse=False):
        return {
            "device_type": dt,
            "gate_switched": switched,
            "serves": "personalized" if switched else "baseline",
            "relative_fr": rel,
            "relative_fr_ci": ci,
            "gain_beyond_interval": gain,
            "worse_beyond_interval": worse,
        }

    runs = {
        "s0.json": {"seed": 0, "rows": [row("A", True, 0.5, [0.3, 0.8], gain=True)]},
        "s1.json": {"seed": 1, "rows": [row("A", False, 1.0, [1.0, 1.0])]},
        "s2.json": {"seed": 2, "rows": [row("A", True, 1.4, [1.1, 1.9], worse=True)]},
    }
    for name, doc in runs.items():
        (tmp_path / name).write_text(json.dumps(doc))
    text = "<!-- demo-spread: s0.json s1.json s2.json -->\nold\n<!-- /demo-spread -->\n"
    readme = tmp_path / "README.md"
    readme.write_text(text)
    assert main(["--check", "--readme", str(readme)]) == 1
    assert main(["--readme", str(readme)]) == 0
    new = readme.read_text()
    assert "| type | seed 0 | seed 1 | seed 2 |" in new
    assert (
        "| A | **0.50 [0.30, 0.80] personalized** | kept | 1.40 [1.10, 1.90] personalized "
        "(worse) |" in new
    )
    assert "| gain beyond the interval | 1 of 1 | 0 of 1 | 0 of 1 |" in new
    assert "| worse beyond the interval | 0 of 1 | 0 of 1 | 1 of 1 |" in new
    assert main(["--check", "--readme", str(readme)]) == 0
