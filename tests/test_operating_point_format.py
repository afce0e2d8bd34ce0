"""The operating point's stored format (wakefl/operating_point.py), its one owner: table tests
of its rules, the round trip through each place it is stored, and that the edge runtime
reads it with torch absent."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from wakefl.edge_runtime import detection_rule
from wakefl.errors import ConfigError
from wakefl.operating_point import (
    DEFAULT_HOP_S,
    DEFAULT_REFRACTORY_S,
    DEFAULT_SMOOTHING,
    METADATA_KEYS,
    OperatingPoint,
    check_threshold,
    from_card,
    metadata_threshold,
    shipped_threshold_in,
    with_shipped_threshold,
)


@pytest.mark.parametrize("value", [0, 0.0, 0.5, 1, 1.0])
def test_a_threshold_is_a_number_in_the_unit_interval(value) -> None:
    assert check_threshold(value, "x") == float(value)


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), float("inf"), True, "0.5", None, {}])
def test_anything_else_is_refused_in_one_line(value) -> None:
    with pytest.raises(ConfigError, match=r"^card: a threshold must be a number in \[0, 1\]"):
        check_threshold(value, "card")


def test_the_detector_defaults_are_defined_once() -> None:
    assert (detection_rule.DEFAULT_HOP_S, detection_rule.DEFAULT_SMOOTHING) == (
        DEFAULT_HOP_S,
        DEFAULT_SMOOTHING,
    )
    assert detection_rule.DEFAULT_REFRACTORY_S == DEFAULT_REFRACTORY_S
    point = OperatingPoint(0.5)
    assert (point.hop_s, point.smoothing, point.refractory_s) == (
        DEFAULT_HOP_S,
        DEFAULT_SMOOTHING,
        DEFAULT_REFRACTORY_S,
    )


@pytest.mark.parametrize(
    ("card", "expected"),
    [
        ({"threshold": 0.7}, OperatingPoint(0.7, source="s")),
        ({"shipped_threshold": 0.6, "smoothing": 5}, OperatingPoint(0.6, smoothing=5, source="s")),
        (
            {"threshold": 0.4, "hop_s": 0.05, "refractory_s": 2},
            OperatingPoint(0.4, hop_s=0.05, refractory_s=2.0, source="s"),
        ),
    ],
)
def test_from_card(card, expected) -> None:
    assert from_card(card, "s") == expected


@pytest.mark.parametrize("card", [{}, {"threshold": 2.0}, {"threshold": "0.5"}])
def test_a_card_without_a_threshold_is_refused(card) -> None:
    with pytest.raises(ConfigError, match="no threshold in"):
        from_card(card, "the card")


def test_each_place_reads_back_what_was_written() -> None:
    point = OperatingPoint(0.8125, hop_s=0.05, smoothing=4, refractory_s=1.5, source="card X")
    meta = point.metadata()
    assert tuple(meta) == METADATA_KEYS and all(isinstance(v, str) for v in meta.values())
    assert metadata_threshold(meta, "m.onnx") == 0.8125
    assert from_card(point.sidecar(), "card X") == point
    assert (
        from_card({k: json.loads(v) for k, v in meta.items() if k != "threshold_source"}, "card X")
        == point
    )
    config = with_shipped_threshold({"width": 0.25}, 0.8125)
    assert config == {"width": 0.25, "shipped_threshold": 0.8125}
    assert shipped_threshold_in(config, "c.json") == 0.8125
    assert shipped_threshold_in({"width": 0.25}, "c.json") is None
    assert metadata_threshold({}, "m.onnx") is None


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ([0.5], "not a JSON object"),
        ({"shipped_threshold": 7}, "must be a number in"),
        # One threshold per model: thresholds per device type are `wakefl eval --thresholds`.
        ({"shipped_threshold": {"A": 0.5}}, "must be a number in"),
    ],
)
def test_a_config_with_a_bad_threshold_is_refused(config, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        shipped_threshold_in(config, "c.json")
    with pytest.raises(ConfigError, match="the shipped threshold: a threshold must be"):
        with_shipped_threshold({}, 1.5)


@pytest.mark.parametrize(("text", "words"), [("abc", "not a number"), ("1.5", "not in")])
def test_bad_metadata_is_refused(text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        metadata_threshold({"shipped_threshold": text}, "m.onnx")


def test_the_evaluation_reads_the_config_beside_a_model(tmp_path: Path) -> None:
    from wakefl.tools.evaluation.inputs import card_threshold

    model = tmp_path / "m.safetensors"
    assert card_threshold(model) is None
    model.with_suffix(".json").write_text(json.dumps(with_shipped_threshold({}, 0.42)))
    assert card_threshold(model) == 0.42
    model.with_suffix(".json").write_text(json.dumps({"shipped_threshold": {"A": 0.5}}))
    with pytest.raises(ConfigError, match="must be a number in"):
        card_threshold(model)


def test_the_format_and_the_edge_runtime_import_without_torch() -> None:
    code = textwrap.dedent("""
        import sys

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "torchaudio", "onnx"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        sys.meta_path.insert(0, NoTorch())
        import wakefl.edge_runtime
        from wakefl.operating_point import OperatingPoint, metadata_threshold
        print(metadata_threshold(OperatingPoint(0.25).metadata(), "m"))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "0.25"
