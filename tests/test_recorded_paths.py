"""Results name no folder of the machine that produced them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from wakefl.recorded_paths import recorded_path

RESULTS = Path(__file__).resolve().parents[1] / "tools" / "results"


@pytest.mark.parametrize(
    ("path", "base", "recorded"),
    [
        ("{cache}/corpus/pretrain-seed0", None, "$WAKEFL_CACHE/corpus/pretrain-seed0"),
        ("{cache}/baselines/b.safetensors", "{tmp}/study", "$WAKEFL_CACHE/baselines/b.safetensors"),
        ("{tmp}/study/corpus/manifest.csv", "{tmp}/study", "corpus/manifest.csv"),
        ("{tmp}/s1920/corpus/manifest.csv", "{tmp}/study", "../s1920/corpus/manifest.csv"),
        ("{cwd}/runs/a/full.safetensors", None, "runs/a/full.safetensors"),
        ("{tmp}/runs/pub-u22/full.safetensors", None, "pub-u22/full.safetensors"),
    ],
)
def test_paths_are_recorded_relative_to_the_run_or_the_cache(
    path: str, base: str | None, recorded: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, cwd = tmp_path / "cache", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.setenv("WAKEFL_CACHE", str(cache))
    monkeypatch.chdir(cwd)
    where = {"cache": cache, "tmp": tmp_path / "elsewhere", "cwd": cwd}
    assert recorded_path(path.format(**where), base and base.format(**where)) == recorded


def test_no_committed_result_holds_an_absolute_path() -> None:
    absolute = re.compile(
        r"""(?:^|["'`\s(=])(/(?:root|home|tmp|work|Users|var|opt|mnt)/[^\s"'`]*)"""
    )
    found = [
        f"{f.relative_to(RESULTS)}: {m.group(1)}"
        for f in sorted(RESULTS.rglob("*"))
        if f.suffix in {".json", ".md", ".csv", ".jsonl", ".txt"}
        for m in absolute.finditer(f.read_text(encoding="utf-8"))
    ]
    assert RESULTS.is_dir() and not found, found[:10]
