"""The synthetic Gaussian study, reduced (few clients, rounds and rates)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from wakefl.sdk.selffl import available_strategies
from wakefl.tools.cli import main
from wakefl.tools.studies.synthetic_study import CASES, best_by, make_fleet, run_study


def test_fleet_closed_forms_are_consistent():
    fleet = make_fleet("heterogeneous", torch.Generator().manual_seed(0), num_clients=6)
    z = [float(p.optimum) for p in fleet.problems.values()]
    sig = [p.sigma_sq for p in fleet.problems.values()]
    s0 = CASES["heterogeneous"][0]
    w = [1 / (s0 + s) for s in sig]
    assert fleet.global_target == pytest.approx(
        sum(a * b for a, b in zip(w, z, strict=True)) / sum(w)
    )
    assert all(10 <= p.num_samples <= 200 for p in fleet.problems.values())
    assert all(
        s == pytest.approx(0.1 / p.num_samples)
        for s, p in zip(sig, fleet.problems.values(), strict=True)
    )
    # personal targets lie between the client's own optimum and the others' mean
    for cid, zi in zip(fleet.problems, z, strict=True):
        assert (
            min(zi, fleet.global_target) - 1.0
            <= fleet.local_target[cid]
            <= max(zi, fleet.global_target) + 1.0
        )
        assert abs(fleet.local_target[cid] - zi) < abs(fleet.global_target - zi) + 1e-12


def test_reduced_study_selffl_personalizes_better_than_fedavg():
    methods = ["selffl"] + [m for m in ("fedavg-e",) if m in available_strategies()]
    doc = run_study(
        reps=1, seed=1, rounds=12, rates=(0.5, 1.0), methods=methods, num_clients=8, progress=False
    )
    rows = doc["results"]
    assert len(rows) == len(CASES) * 2 * len(methods)
    for r in rows:
        assert r["global_mae"] is not None and math.isfinite(r["global_mae"])
    het = {(r["method"], r["activity_rate"]): r for r in rows if r["case"] == "heterogeneous"}
    for c in (0.5, 1.0):
        # sigma_0^2 = 1: the personal models must be far closer to theta_m^(FL) than the
        # spread between clients (~1)
        assert het[("selffl", c)]["local_mae"] < 0.2
        if "fedavg-e" in methods:
            assert het[("selffl", c)]["local_mae"] < het[("fedavg-e", c)]["local_mae"]
    assert set(best_by(doc, "local_mae")) == set(CASES)


def test_cli_paper_synthetic_json(tmp_path, capsys):
    code = main(
        [
            "paper",
            "synthetic",
            "--reps",
            "1",
            "--rounds",
            "4",
            "--methods",
            "selffl",
            "--out",
            str(tmp_path),
            "--json",
        ]
    )
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["methods"] == ["selffl"]
    assert {r["activity_rate"] for r in doc["results"]} == {0.1, 0.2, 0.5, 0.8, 1.0}
    for p in doc["plots"]:
        with open(p, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "study.json").exists()
    assert main(["paper", "synthetic", "--methods", "nope", "--out", str(tmp_path)]) == 2


def test_selffl_overrides_run_an_ablation_row_with_the_papers_rules():
    paper = {"eqn10": "paper", "eqn10_max_factor": None}
    kw = dict(
        reps=1, seed=1, rounds=8, rates=(0.5,), methods=["selffl"], num_clients=6, progress=False
    )
    ablated = run_study(selffl_overrides=paper, **kw)
    default = run_study(**kw)
    assert ablated["config"]["selffl_overrides"] == paper
    assert default["config"]["selffl_overrides"] == {}
    for doc in (ablated, default):
        assert all(r["local_mae"] is not None and r["local_mae"] < 1.0 for r in doc["results"])
    # with sampling the two Eqn 10 rules give different personalized models
    assert [r["local_mae"] for r in ablated["results"]] != [
        r["local_mae"] for r in default["results"]
    ]
