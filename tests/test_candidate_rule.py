"""The rule a candidate `full` ships by, read off its reports: each part's bar, the order,
and the threshold every part is read at."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from wakefl.tools.evaluation.candidate_rule import SMALL_STEP8, Bars, main, read_rule

THR = 0.9845


def _bench(conditions: dict[str, dict[str, float]], threshold: float = THR) -> dict[str, Any]:
    return {
        "shipped_threshold": threshold,
        "conditions": {k: {"all types": v} for k, v in conditions.items()},
    }


def _reports() -> dict[str, Any]:
    """A candidate that passes every part, each figure near its bar."""
    return {
        "card": {"threshold": THR},
        "val": _bench(
            {"validation": {"threshold_at_0.5_fa_h": 0.9691, "frr_at_0.5_fa_h": 0.04}}, 0.97
        ),
        "near_rhymes": {
            "leg": {
                "at": {
                    "0.9691": {"A": {"events": 3}, "frr": {"A": 0.02, "mean": 0.04}},
                    "0.9845": {"frr": {"A": 0.1, "B": 0.08, "mean": 0.09}},
                }
            }
        },
        "export": {"int8_agreement": {"agree": 105, "windows": 106}},
        "voices": [
            {"audio": v, "events": [{"time_s": 1.0, "score": 0.999}], "max_score": 0.999}
            for v in ("en-us", "en-gb", "slt", "rms")
        ],
        "acoustics": _bench(
            {
                "held-out acoustics": {
                    "frr_at_shipped_threshold": 0.43,
                    "fa_h_at_shipped_threshold": 0.0,
                    "stream_hours": 0.25,
                }
            }
        ),
        "test": {
            **_bench(
                {
                    "held-out speakers": {
                        "frr_at_shipped_threshold": 0.062,
                        "fa_h_at_shipped_threshold": 7 / 15,
                        "stream_hours": 15.0,
                    },
                    "unseen voices": {"frr_at_shipped_threshold": 0.6},
                }
            ),
            "int8_agreement": {
                "held-out speakers": {"agree": 99, "decisions": 100},
                "unseen voices": {"agree": 995, "decisions": 1000},
            },
        },
    }


def _set(reports: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(reports)
    *head, last = path.split("/")
    node = out
    for key in head:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[int(last) if isinstance(node, list) else last] = value
    return out


def test_a_candidate_at_every_bar_passes_all_four_parts_in_order() -> None:
    parts = read_rule(_reports())
    assert [p.name for p in parts] == ["int8", "validation", "held-out acoustics", "test split"]
    assert all(p.passed for p in parts)
    assert parts[1].figures["set_by"] == "near-rhyme projection"
    assert parts[1].figures["mean_frr"] == pytest.approx(0.09)
    assert parts[3].figures["false_accepts"] == 7


ACOUSTICS = "acoustics/conditions/held-out acoustics/all types/frr_at_shipped_threshold"
HELD_OUT = "test/conditions/held-out speakers/all types"


@pytest.mark.parametrize(
    ("path", "value", "fails"),
    [
        ("export/int8_agreement/agree", 104, "int8"),  # 98.1 % of 106
        ("voices/3/events", [], "int8"),  # one voice not detected
        ("voices", [], "int8"),  # no voice tried is no voice detected
        ("near_rhymes/leg/at/0.9845/frr/mean", 0.095, "validation"),
        (ACOUSTICS, 0.514, "held-out acoustics"),  # fewer misses than step 29, not as many
        (f"{HELD_OUT}/fa_h_at_shipped_threshold", 8 / 15, "test split"),
        (f"{HELD_OUT}/frr_at_shipped_threshold", 0.109, "test split"),
        ("test/conditions/unseen voices/all types/frr_at_shipped_threshold", 0.62, "test split"),
        ("test/int8_agreement/unseen voices/agree", 989, "test split"),
    ],
)
def test_a_part_below_its_bar_fails_and_ends_the_reading(path: str, value: Any, fails: str) -> None:
    parts = read_rule(_set(_reports(), path, value))
    assert parts[-1].name == fails and not parts[-1].passed
    assert all(p.passed for p in parts[:-1])


def test_the_validation_streams_threshold_reads_their_pooled_frr() -> None:
    reports = _set(_reports(), "card/threshold", 0.9691)
    reports = _set(reports, "acoustics/shipped_threshold", 0.9691)
    parts = read_rule(_set(reports, "test/shipped_threshold", 0.9691))
    assert parts[1].figures["set_by"] == "validation streams"
    assert parts[1].figures["mean_frr"] == pytest.approx(0.04)
    tighter = read_rule(reports, Bars(val_mean_frr=0.03))
    assert tighter[-1].name == "validation" and not tighter[-1].passed


def test_missing_reports_end_the_reading_and_a_report_at_another_threshold_is_refused() -> None:
    assert [p.name for p in read_rule({**_reports(), "acoustics": None})] == [
        "int8",
        "validation",
    ]
    with pytest.raises(ValueError, match="scored at 0.98"):
        read_rule(_set(_reports(), "acoustics/shipped_threshold", 0.98))
    with pytest.raises(ValueError, match="no FRR at the threshold"):
        read_rule(_set(_reports(), "card/threshold", 0.99))
    with pytest.raises(ValueError, match="not a number"):
        read_rule(_set(_reports(), "card/threshold", float("nan")))


def _write(
    tmp_path: Path, reports: dict[str, Any]
) -> tuple[dict[str, Path], list[Path], list[str]]:
    """The reports as files: one per report, one per voice, and the command's arguments for
    the card, validation, near-rhyme and export reports."""
    files = {}
    for key, value in reports.items():
        if key == "voices":
            continue
        files[key] = tmp_path / f"{key}.json"
        files[key].write_text(json.dumps(value))
    voices = []
    for i, v in enumerate(reports["voices"]):
        voices.append(tmp_path / f"voice{i}.json")
        voices[-1].write_text(json.dumps(v))
    args = []
    for key in ("card", "val", "near_rhymes", "export"):
        args += [f"--{key.replace('_', '-')}", str(files[key])]
    return files, voices, args


def test_the_command_prints_each_part_and_exits_by_the_rule(tmp_path: Path, capsys) -> None:
    files, voices, args = _write(tmp_path, _set(_reports(), "voices/0/events", []))
    assert main([*args, "--voices", *map(str, voices), "--json", str(tmp_path / "r.json")]) == 1
    assert "int8: FAILS" in capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text())[0]["passed"] is False
    assert main([*args, "--voices", *map(str, voices[1:])]) == 0
    files["val"].write_text("{not json")
    assert main(args) == 2


def test_the_small_bars_are_step_8s_and_the_command_chooses_them(tmp_path: Path) -> None:
    reports = _set(_reports(), "export/int8_agreement/agree", 104)  # step 8's own count
    assert not read_rule(reports)[0].passed  # full's 99 %
    assert read_rule(reports, SMALL_STEP8)[0].passed
    worse = _set(reports, "export/int8_agreement/agree", 103)
    assert not read_rule(worse, SMALL_STEP8)[0].passed
    _, voices, args = _write(tmp_path, reports)
    args += ["--voices", *map(str, voices)]
    assert main(args) == 1
    assert main([*args, "--bars", "small-step8"]) == 0
    with pytest.raises(SystemExit):
        main([*args, "--bars", "step7-small"])
