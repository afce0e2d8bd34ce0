"""The paper study end to end on the tiny corpus (real synthesized audio, real training),
plus its pure rules."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest

from wakefl.errors import ConfigError
from wakefl.sdk.wake_metrics import relative_fa_fr
from wakefl.tools.evaluation.cells import bootstrap_units
from wakefl.tools.studies.paper_experiment import run_paper_study
from wakefl.tools.studies.paper_figures import EvalSet, paired_fa_ratio, paired_fr_ratio
from wakefl.tools.studies.paper_report import render_markdown
from wakefl.tools.studies.paper_rules import (
    METHODS,
    NO_GLOBAL,
    SELFFL_ABLATIONS,
    resolve_profile,
    selection_score,
    split_speakers,
)
from wakefl.tools.studies.paper_tables import ci_side, format_cell

ROW_KEYS = {
    "setting",
    "method",
    "model",
    "device_type",
    "state",
    "relative_fa",
    "relative_fr",
    "relative_fa_ci",
}
DEVICE_TYPES = ["A", "B", "C", "D", "E"]


def test_split_speakers_is_a_balanced_partition():
    counts = {f"s{i}": c for i, c in enumerate([9, 7, 5, 5, 4, 3, 2, 2, 1, 1])}
    groups = split_speakers(counts, 4)
    flat = [s for g in groups for s in g]
    assert sorted(flat) == sorted(counts) and len(flat) == len(set(flat))
    sizes = [sum(counts[s] for s in g) for g in groups]
    assert max(sizes) - min(sizes) <= 2, sizes
    assert split_speakers(counts, 4) == groups  # deterministic
    with pytest.raises(ConfigError, match="cannot split 3 training speakers into 4"):
        split_speakers({"a": 1, "b": 1, "c": 1}, 4)


def test_profile_overrides_and_selection_score():
    prof = resolve_profile("small", width=0.5, rounds=4)
    assert (prof.width, prof.rounds, prof.sampling_rounds) == (0.5, 4, 8)
    with pytest.raises(ConfigError, match="unknown study profile"):
        resolve_profile("huge")
    with pytest.raises(ConfigError, match="--rounds"):
        resolve_profile("tiny", rounds=0)
    assert resolve_profile("small").target_fr == 0.05
    assert resolve_profile("small", target_fr=0.5).target_fr == 0.5
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ConfigError, match="--target-fr"):
            resolve_profile("small", target_fr=bad)
    assert selection_score([0.5, 1.5]) == 1.0
    assert selection_score([0.5, None]) > 100  # an unbounded ratio is never selected


def test_format_cell():
    row = {"relative_fa": 0.9234, "relative_fa_ci": [0.81, None], "note": ""}
    assert format_cell(row) == "0.92 [0.81, unbounded]"
    assert (
        format_cell(
            {"relative_fa": None, "relative_fa_ci": [None, None], "note": "diverged: lr=0.05: NaN"}
        )
        == "diverged"
    )
    assert format_cell(None) == "n/a"


def test_format_cell_marks_intervals_that_exclude_one():
    assert (
        format_cell({"relative_fa": 0.7, "relative_fa_ci": [0.5, 0.9], "note": ""})
        == "0.70 [0.50, 0.90]↓"
    )
    assert (
        format_cell({"relative_fa": 1.6, "relative_fa_ci": [1.2, None], "note": ""})
        == "1.60 [1.20, unbounded]↑"
    )
    assert (
        format_cell({"relative_fa": 0.9, "relative_fa_ci": [0.7, 1.1], "note": ""})
        == "0.90 [0.70, 1.10]"
    )
    assert [ci_side(c) for c in ([0.1, 0.99], [1.01, None], [None, None], [0.9, 1.0])] == [
        "below",
        "above",
        "includes 1",
        "includes 1",
    ]


def test_background_clips_are_their_own_bootstrap_units():
    units = bootstrap_units(["spk1", "nospeech-test", "spk1", "nospeech-test", "spk2"])
    assert units[0] == units[2] != units[4]
    assert units[1] != units[3]  # two background-only clips: two units
    assert len(set(units.tolist())) == 4


def _synthetic_evalset(seed: int) -> tuple[EvalSet, np.ndarray]:
    rng = np.random.default_rng(seed)
    speakers = np.repeat([f"s{i}" for i in range(20)], 20)
    labels = np.tile(np.repeat([1, 0], 10), 20)
    base = rng.normal(size=labels.size) + 2.5 * labels
    ev = EvalSet("A", None, labels, np.full(labels.size, "normal"), speakers, base)
    return ev, base


def test_paired_fa_ratio_against_the_same_and_a_better_model():
    ev, base = _synthetic_evalset(0)
    same = paired_fa_ratio(ev, base, base.copy(), 0.05, n_boot=200, seed=0)
    assert same == {"ratio": 1.0, "ci": [1.0, 1.0]}
    # Same positives, negatives pushed down: fewer false accepts at the same FR.
    better = np.where(ev.labels == 0, base - 1.0, base)
    res = paired_fa_ratio(ev, better, base, 0.05, n_boot=200, seed=0)
    pos, neg = ev.labels == 1, ev.labels == 0
    rel = relative_fa_fr(base[pos], base[neg], better[pos], better[neg], 0.05).relative_fa
    assert res["ratio"] == pytest.approx(rel, abs=1e-6)
    assert res["ci"][1] < 1.0 and ci_side(res["ci"]) == "below"
    back = paired_fa_ratio(ev, base, better, 0.05, n_boot=200, seed=0)
    assert back["ratio"] == pytest.approx(1.0 / res["ratio"], rel=1e-5)
    assert ci_side(back["ci"]) == "above"


def test_paired_fr_ratio_against_the_same_and_a_better_model():
    from wakefl.sdk.wake_metrics import relative_fr_at_matched_clip_fa

    ev, base = _synthetic_evalset(1)
    same = paired_fr_ratio(ev, base, base.copy(), 0.5, n_boot=200, seed=0)
    assert same == {"ratio": 1.0, "ci": [1.0, 1.0]}
    # Same negatives, wake words scored higher: fewer misses at the same false accepts.
    better = np.where(ev.labels == 1, base + 1.0, base)
    res = paired_fr_ratio(ev, better, base, 0.5, n_boot=200, seed=0)
    pos, neg = ev.labels == 1, ev.labels == 0
    rel = relative_fr_at_matched_clip_fa(base[pos], base[neg], better[pos], better[neg], 0.5)
    assert res["ratio"] == pytest.approx(rel.relative_fr, abs=1e-6)
    assert ci_side(res["ci"]) == "below"
    back = paired_fr_ratio(ev, base, better, 0.5, n_boot=200, seed=0)
    assert back["ratio"] == pytest.approx(1.0 / res["ratio"], rel=1e-5)
    assert ci_side(back["ci"]) == "above"


def test_tiny_study_end_to_end(tiny_corpus: Path, tmp_path: Path):
    from wakefl.tools.cli import main

    cache = tmp_path / "cache"
    result = run_paper_study(
        tmp_path / "run1",
        profile="tiny",
        seed=0,
        rounds=2,
        manifest=tiny_corpus,
        cache_dir=cache,
        progress=False,
        log=lambda _m: None,
        sampling_methods=("fedavg-w", "local"),
    )
    cfg, rows = result["config"], result["rows"]
    assert cfg["device_types"] == DEVICE_TYPES
    assert cfg["sampling_methods"] == ["fedavg-w", "local"]
    assert cfg["settings"] == ["full-participation", "sampling-0.25", "sampling-0.1"]
    assert cfg["tuning"]["grid"]["lr"] and set(cfg["tuning"]["per_method"]) == set(METHODS)
    for row in rows:
        assert set(row) >= ROW_KEYS, row
        assert row["model"] in ("global", "personalized")
        assert row["state"] in ("all", "normal", "playback", "alarm")
        assert len(row["relative_fa_ci"]) == 2
        if row["relative_fa"] is not None:
            assert row["relative_fa"] >= 0
            lo, hi = row["relative_fa_ci"]
            assert lo is None or lo <= row["relative_fa"] + 1e-9 or hi is None
    # Every method and device type is present, for both models where the method has both.
    full = {
        (r["method"], r["model"], r["device_type"])
        for r in rows
        if r["setting"] == "full-participation" and r["state"] == "all"
    }
    for m in METHODS:
        for dt in DEVICE_TYPES:
            assert (m, "personalized", dt) in full
            assert ((m, "global", dt) in full) == (m not in NO_GLOBAL)
    for setting in ("sampling-0.25", "sampling-0.1"):
        cells = {
            (r["method"], r["model"], r["device_type"], r["state"])
            for r in rows
            if r["setting"] == setting
        }
        # Self-FL's two levels and FedAvg-w with both models, local-only personalized only;
        # x device types x states
        assert len(cells) == (2 * 2 + 2 + 1) * 5 * 4
        assert {m for m, *_ in cells} == {"selffl-client", "selffl-cluster", "fedavg-w", "local"}
    for row in rows:
        if row["relative_fa"] is not None:
            assert 0 <= row["baseline_fa_count"] <= row["n_negative"] * row["personalized_models"]
            assert 0 <= row["candidate_fa_count"] <= row["n_negative"] * row["personalized_models"]
    # Self-FL against the best other method, per variant, model and device type.
    # Under client sampling Self-FL's levels meet the methods run there, and only those.
    comps = result["comparisons"]
    assert {(c["setting"], c["method"], c["model"], c["device_type"]) for c in comps} == {
        (s, m, model, dt)
        for s, variants in (
            ("full-participation", ("selffl", "selffl-alg2")),
            ("sampling-0.25", ("selffl-client", "selffl-cluster")),
            ("sampling-0.1", ("selffl-client", "selffl-cluster")),
        )
        for m in variants
        for model in ("global", "personalized")
        for dt in DEVICE_TYPES
    }
    assert all(not c["best_other"].startswith("selffl") for c in comps)
    sampled_comps = [c for c in comps if c["setting"] != "full-participation"]
    assert {c["best_other"] for c in sampled_comps} <= {"fedavg-w", "local"}
    assert all(c["best_other"] == "fedavg-w" for c in sampled_comps if c["model"] == "global")
    # The served-model gate: one decision per client of every Self-FL run, scored on test.
    gate = result["gate"]
    assert {(g["setting"], g["method"]) for g in gate} == {
        ("full-participation", "selffl"),
        ("full-participation", "selffl-alg2"),
        *(
            (s, lv)
            for s in ("sampling-0.25", "sampling-0.1")
            for lv in ("selffl-client", "selffl-cluster")
        ),
    }
    assert len(gate) == 2 * 5 + 2 * 2 * 20
    for g in gate:
        assert g["serves"] in ("personalized", "global", "baseline") and g["reason"]
        for rec in (g["served"], g["personalized"]):
            assert set(rec) == {"relative_fa", "relative_fa_ci", "relative_fr", "note"}
        if g["serves"] == "personalized":
            assert g["served"] == g["personalized"]
        if g["serves"] == "baseline":  # the warm start against itself
            assert g["served"]["relative_fa"] in (1.0, None)
        # the tie-switching ablation leaves the warm start whenever tie-keeping does
        assert g["serves_ties_switch"] in ("personalized", "global", "baseline")
        if g["serves"] != "baseline":
            assert g["serves_ties_switch"] != "baseline"
        if g["serves_ties_switch"] == g["serves"]:
            assert g["served_ties_switch"] == g["served"]
    # With matched FR the candidate's FR stays at the baseline's wherever scores allow it
    # (the match is made on all of a device type's clips, the "all" rows).
    matched = [
        r["relative_fr"] for r in rows if r["relative_fr"] is not None and r["state"] == "all"
    ]
    assert matched and sum(abs(v - 1.0) < 1e-9 for v in matched) > len(matched) / 2
    # Every whole-device-type cell also reports relative FR at matched FA, with an interval.
    for r in rows:
        if r["state"] == "all" and r["n_positive"] and r["n_negative"]:
            rec = r["relative_fr_at_matched_clip_fa"]
            assert (
                rec["unbounded"] == (rec["relative_fr"] is None) and len(rec["relative_fr_ci"]) == 2
            )
    # The state rows share the device type's thresholds: their false accepts add up.
    by_cell: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r["setting"], r["method"], r["model"], r["device_type"])
        by_cell.setdefault(key, {})[r["state"]] = r
    for cell in by_cell.values():
        if cell["all"]["relative_fa"] is None or "baseline_fa_count" not in cell["all"]:
            continue
        for field in ("baseline_fa_count", "candidate_fa_count", "n_negative"):
            assert (
                sum(cell[s].get(field, 0) for s in ("normal", "playback", "alarm"))
                == cell["all"][field]
            )
    # Self-FL's step counts: one per client and round it took part in.
    steps = [
        s
        for s in result["step_counts"]
        if s["setting"] == "full-participation" and s["method"] == "selffl"
    ]
    assert {(s["client"], s["round"]) for s in steps} == {
        (d, r) for d in DEVICE_TYPES for r in (1, 2)
    }
    assert all(1 <= s["local_steps"] <= cfg["profile"]["l_max"] for s in steps)
    assert all(s["sigma_sq"] >= 0 and s["sigma0_sq"] >= 0 for s in steps)
    sampled = [
        s
        for s in result["step_counts"]
        if s["setting"] == "sampling-0.25" and s["method"] == "selffl-client"
    ]
    assert len(sampled) == 5 * cfg["profile"]["sampling_rounds"]  # 5 of 20 per round

    out1 = tmp_path / "run1"
    md = (out1 / "results.md").read_text()
    for heading in (
        "Table 2a",
        "Table 2b",
        "Relative FR at matched FA per clip",
        "Table 5",
        "Table 6",
        "Tuning",
        "Comparison with",
        "What the test cells hold",
        "against the best other method",
        "Why the shape differs",
        "Served models with the gate on",
        "Served-model gate: of 90 Self-FL clients",
        "### Every method under client sampling, C = 0.25",
        "Against the best other method of each cell, sampling-0.1",
    ):
        assert heading in md
    assert "reduced width and rounds" in md
    for fig in (
        "fig11_steps_full_participation.png",
        "fig12_steps_sampling.png",
        "det_full-participation_global_A.png",
        "det_full-participation_personalized_E.png",
    ):
        assert (out1 / fig).stat().st_size > 1000
    assert json.loads((out1 / "results.json").read_text())["rows"] == rows
    assert render_markdown(result, None) == render_markdown(json.loads(json.dumps(result)), None)
    assert "Ablation, a gate that also switches on a tie" in render_markdown(result, None)
    assert "## Self-FL ablations" not in render_markdown(result, None)

    # Same seed, same tables: the CLI reruns Self-FL alone (warm start from the cache) and
    # must reproduce every Self-FL cell bit for bit.
    buf = io.StringIO()
    with redirect_stdout(buf):
        code = main(
            [
                "experiment",
                "paper",
                "--profile",
                "tiny",
                "--out",
                str(tmp_path / "run2"),
                "--rounds",
                "2",
                "--manifest",
                str(tiny_corpus),
                "--cache-dir",
                str(cache),
                "--methods",
                "selffl",
                "--json",
            ]
        )
    assert code == 0
    again = json.loads(buf.getvalue())
    assert again["config"]["methods"] == ["selffl"]
    first = sorted(
        json.dumps(r, sort_keys=True)
        for r in rows
        if r["method"].startswith("selffl") and r["method"] != "selffl-alg2"
    )
    second = sorted(json.dumps(r, sort_keys=True) for r in again["rows"])
    assert first == second


def test_cli_rejects_unknown_method(tiny_corpus: Path, tmp_path: Path, capsys):
    from wakefl.tools.cli import main

    code = main(
        [
            "experiment",
            "paper",
            "--profile",
            "tiny",
            "--out",
            str(tmp_path),
            "--manifest",
            str(tiny_corpus),
            "--methods",
            "selffl,fedprox",
        ]
    )
    assert code == 2
    assert "unknown method(s) fedprox" in capsys.readouterr().err


@pytest.mark.parametrize(
    "methods,sampling,why",
    [
        ("selffl,fedavg-w", "local", "local are not among the study's other methods (fedavg-w)"),
        ("selffl,fedavg-w", "selffl-alg2", "selffl-alg2 are not among"),
    ],
)
def test_cli_rejects_sampling_methods_outside_the_study(
    tiny_corpus: Path, tmp_path: Path, capsys, methods: str, sampling: str, why: str
):
    from wakefl.tools.cli import main

    args = ["experiment", "paper", "--profile", "tiny", "--out", str(tmp_path / "run")]
    args += ["--manifest", str(tiny_corpus), "--methods", methods, "--sampling-methods", sampling]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # refused before any work


def test_selffl_ablations_are_valid_self_fl_hyperparameters():
    from wakefl.sdk.selffl import make_strategy
    from wakefl.tools.studies.paper_rules import method_hyperparams

    prof = resolve_profile("tiny")
    for overrides in SELFFL_ABLATIONS.values():
        make_strategy("selffl", **{**method_hyperparams("selffl", 0.05, prof), **overrides})
    with pytest.raises(ConfigError, match="ablation"):
        run_paper_study("unused", profile="tiny", selffl_ablations=("nope",), log=lambda _m: None)
    with pytest.raises(ConfigError, match="ablations need"):
        run_paper_study(
            "unused",
            profile="tiny",
            methods=("fedavg-w",),
            sampling_rates=(),
            selffl_ablations=("paper-rules",),
            log=lambda _m: None,
        )


@pytest.mark.slow  # trains Self-FL twice per setting on the tiny corpus
def test_selffl_ablation_rows_in_settings_of_their_own(tiny_corpus: Path, tmp_path: Path):
    result = run_paper_study(
        tmp_path / "run",
        profile="tiny",
        seed=0,
        rounds=1,
        manifest=tiny_corpus,
        cache_dir=tmp_path / "cache",
        progress=False,
        methods=("selffl",),
        sampling_rates=(0.25,),
        selffl_ablations=("paper-rules",),
        log=lambda _m: None,
    )
    cfg = result["config"]
    assert cfg["selffl_ablations"] == {"paper-rules": SELFFL_ABLATIONS["paper-rules"]}
    assert cfg["settings"] == ["full-participation", "sampling-0.25"]
    methods = {(r["setting"], r["method"]) for r in result["rows"]}
    assert ("ablation-full-participation", "selffl+paper-rules") in methods
    assert ("ablation-sampling-0.25", "selffl-client+paper-rules") in methods
    assert cfg["method_labels"]["selffl-client+paper-rules"] == "Self-FL client-level, paper-rules"
    # the report sets each ablation row beside the default rules' row of its setting
    md = render_markdown(result, None)
    assert "## Self-FL ablations: the paper's rules back, global model" in md
    for setting in ("full-participation", "sampling-0.25"):
        for rules in ("wakefl (default)", "paper-rules"):
            assert md.count(f"| {setting} | {rules} | ") == 2  # global and personalized
    assert "| full-participation | paper-rules | n/a |" not in md
    # the main settings' rows are the same as without the ablation
    main = {
        (r["setting"], r["method"])
        for r in result["rows"]
        if not r["setting"].startswith("ablation")
    }
    assert main == {
        ("full-participation", "selffl"),
        ("sampling-0.25", "selffl-client"),
        ("sampling-0.25", "selffl-cluster"),
    }


def test_cli_passes_the_selffl_ablations(tmp_path: Path, monkeypatch):
    from wakefl.tools.cli import main
    from wakefl.tools.studies import paper_experiment

    seen: dict = {}
    monkeypatch.setattr(paper_experiment, "run_paper_study", lambda *a, **kw: seen.update(kw))
    base = ["experiment", "paper", "--out", str(tmp_path)]
    assert main([*base, "--selffl-ablations", "paper-rate, no-data-cap"]) == 0
    assert seen["selffl_ablations"] == ("paper-rate", "no-data-cap")
    assert "--selffl-ablations 'paper-rate, no-data-cap'" in seen["command"]
    assert main([*base, "--selffl-ablations", "all"]) == 0
    assert seen["selffl_ablations"] == tuple(SELFFL_ABLATIONS)
    assert main(base) == 0 and seen["selffl_ablations"] == ()
