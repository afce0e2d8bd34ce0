"""`wakefl demo` end to end at its smallest setting: real broker, server and device
processes over 127.0.0.1, then the evaluation report with a row per device type."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

TYPES = ["A", "B", "C", "D", "E"]


def test_demo_smallest_setting_writes_a_report_per_device_type(tmp_path, tiny_corpus):
    env = dict(
        os.environ, WAKEFL_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"
    )
    workdir = tmp_path / "demo"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wakefl.tools.cli",
            "demo",
            "--manifest",
            str(tiny_corpus),
            "--width",
            "0.125",
            "--rounds",
            "2",
            "--warm-epochs",
            "2",
            "--workdir",
            str(workdir),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # Progress was visible: rounds, devices reporting, step counts and uncertainties.
    assert "round 2/2: closed by all with 5/5 updates" in out
    assert "sigma0^2=" in out and "local steps" in out

    report = workdir / "report"
    for name in (
        "report.md",
        "report.html",
        "demo_summary.md",
        "results.json",
        "demo_results.json",
    ):
        assert (report / name).is_file(), name
    # The demo's own rows, from which the README's tables are rendered: per device type the
    # served relative FR with its interval and the gate's decision with its evidence.
    doc = json.loads((report / "demo_results.json").read_text())
    assert [r["device_type"] for r in doc["rows"]] == TYPES and doc["elapsed_s"] > 0
    for r in doc["rows"]:
        assert "relative_fr" in r and "relative_fr_ci" in r and r["gate_reason"]
        assert r["gate_switched"] == (r["gate_evidence"] is not None)
    assert "| type | baseline FRR | served model |" in out and "beyond their interval" in out
    summary = (report / "demo_summary.md").read_text()
    # One row per device type: both models' FRR and FA/h, relative FR, the gate's decision.
    assert "| device | baseline FRR | baseline FA/h | served model | served FRR |" in summary
    for t in TYPES:
        assert f"\n| {t} | " in summary and f"- **{t}** serves the " in summary
        gate = json.loads((workdir / "models" / f"served-{t}.gate.json").read_text())
        assert gate["gate"]["reason"] and gate["served"]["model"] in (
            "baseline",
            "personalized",
            "global",
        )
    assert "Resolution" in summary and "FA/h" in summary
    # The main report leads with the same summary; the HTML shows no raw Markdown there.
    assert (report / "report.md").read_text().count("## Summary") == 1
    html = (report / "report.html").read_text()
    assert "<h2>Summary" in html and "`" not in html.split("<h2>Results")[0]
    rows = json.loads((report / "results.json").read_text())["rows"]
    for t in TYPES:
        own = [
            r
            for r in rows
            if r["candidate"] == f"served-{t}" and r["device_type"] == t and r["state"] == "all"
        ]
        assert len(own) == 1 and own[0]["n_positive"] > 0 and own[0]["n_negative"] > 0
        assert any(r["candidate"] == "global" and r["device_type"] == t for r in rows)
    assert list(report.glob("*.png")), "DET curves missing"
    # Each device says which model its served-model gate left it serving, and the table
    # gives the absolute FRR and FA/h beside the relative figures.
    for t in TYPES:
        assert f"dev{t} serves the " in out
    # The warm-start baseline went to the cache named by WAKEFL_CACHE, not the user's.
    assert list((tmp_path / "cache" / "baselines").glob("baseline-*.safetensors"))


def test_demo_defaults_suit_the_fleet_and_keep_the_other_profiles():
    from pathlib import Path

    from wakefl.tools.fleet.demo import DemoSettings

    fleet = DemoSettings()
    assert fleet.profile == "fleet" and fleet.runs_fleet()
    assert fleet.model_width() == 0.25 and fleet.shipped_threshold() and not fleet.global_scored()
    for other in (DemoSettings(profile="demo"), DemoSettings(manifest=Path("m.csv"))):
        assert not other.runs_fleet() and other.model_width() == 1.0
        assert other.local_steps() == (10, 5) and other.global_scored()
        assert not other.shipped_threshold()
        assert other.round_count() == 3 and other.local_epochs() == 2.0
        assert other.gate_fr() == other.target_fr
    assert DemoSettings(width=0.5, l_max=4).model_width() == 0.5
    assert DemoSettings(l_max=4).local_steps() == (4, 20)
    # The fleet trains longer: more rounds and more passes over each device's clips.
    assert fleet.round_count() > 3 and fleet.local_epochs() > 2.0
    # Its gate compares where the shipped baseline works on its users.
    assert fleet.gate_fr() == 0.5
    assert DemoSettings(gate_target_fr=0.2).gate_fr() == 0.2
    assert DemoSettings(rounds=2, max_local_epochs=1.0).round_count() == 2
    assert DemoSettings(max_local_epochs=1.0).local_epochs() == 1.0
    # The fleet with more enrolment runs with the fleet's settings, unless a manifest of
    # one's own replaces its corpus.
    enrolled = DemoSettings(profile="fleet-enrolled")
    assert enrolled.runs_fleet() and enrolled.local_steps() == fleet.local_steps()
    assert enrolled.round_count() == fleet.round_count() and enrolled.gate_fr() == 0.5
    assert not DemoSettings(profile="fleet-enrolled", manifest=Path("m.csv")).runs_fleet()


def test_the_fleet_gate_adds_the_validation_streams_add_on_unless_told_otherwise():
    from pathlib import Path

    from wakefl.tools.fleet.demo import DemoSettings, _command, _val_streams_label

    for profile in ("fleet", "fleet-enrolled"):
        st = DemoSettings(profile=profile, seed=2)
        assert st.adds_val_streams()
        assert _val_streams_label(st) == "fleet-valstreams seed 2 (the default add-on)"
        assert "--val-streams" not in _command(st) and "--no-val-streams" not in _command(st)
        own = DemoSettings(profile=profile, val_streams_addon=False)
        assert not own.adds_val_streams() and _val_streams_label(own) is None
        assert _command(own).endswith("--no-val-streams")
    # A manifest of one's own, an add-on of one's own or another profile: no default add-on.
    assert not DemoSettings(manifest=Path("m.csv")).adds_val_streams()
    assert not DemoSettings(profile="demo").adds_val_streams()
    given = DemoSettings(val_streams=Path("v/manifest.csv"))
    assert not given.adds_val_streams() and "--val-streams" in _command(given)


def test_demo_corpus_folder_keeps_a_build_of_another_recipe(tmp_path, monkeypatch):
    import json
    from dataclasses import asdict

    from wakefl.tools.corpus.plan import PROFILES
    from wakefl.tools.fleet.demo import corpus_folder

    monkeypatch.setenv("WAKEFL_CACHE", str(tmp_path))
    plain = corpus_folder("fleet-micro", 0)
    assert plain.name == "fleet-micro-seed0"
    # A finished build of an earlier recipe of the profile stays where it is.
    plain.mkdir(parents=True)
    (plain / "corpus.json").write_text(json.dumps({"profile": {"name": "fleet-micro"}}))
    other = corpus_folder("fleet-micro", 0)
    assert other != plain and other.name.startswith("fleet-micro-seed0-")
    assert corpus_folder("fleet-micro", 1).name == "fleet-micro-seed1"
    # A build of the current recipe is reused where it is.
    recipe = json.loads(json.dumps(asdict(PROFILES["fleet-micro"])))
    (plain / "corpus.json").write_text(json.dumps({"profile": recipe}))
    assert corpus_folder("fleet-micro", 0) == plain


def test_demo_refuses_bad_arguments_cleanly(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wakefl.tools.cli",
            "demo",
            "--manifest",
            str(tmp_path / "missing.csv"),
            "--workdir",
            str(tmp_path / "w"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_demo_results_name_the_command_and_round_the_time(tmp_path):
    import json
    from pathlib import Path

    from wakefl.tools.fleet.demo import DemoSettings, write_results

    rows = [{"device_type": "A", "relative_fr": 0.5, "relative_fr_ci": [0.2, 0.9]}]
    out = write_results(DemoSettings(profile="fleet-enrolled"), rows, 312.4, tmp_path / "r.json")
    doc = json.loads(out.read_text())
    assert doc["command"] == "wakefl demo --profile fleet-enrolled --seed 0"
    assert (doc["elapsed_s"], doc["rounds"], doc["rows"]) == (312, 4, rows)
    own = DemoSettings(manifest=Path("m.csv"), rounds=2, width=0.125)
    doc = json.loads(write_results(own, [], 1.0, tmp_path / "s.json").read_text())
    assert (
        doc["command"]
        == "wakefl demo --profile fleet --seed 0 --manifest m.csv --rounds 2 --width 0.125"
    )


def test_the_demo_hands_every_device_its_addon_validation_streams(tmp_path):
    import json
    from pathlib import Path

    from wakefl.tools.fleet.demo import DemoSettings, _device_args, write_results

    addon = Path("/data/fleet-valstreams-seed2/manifest.csv")
    st = DemoSettings(profile="fleet-enrolled", seed=2, val_streams=addon)
    args = _device_args(st, "mqtt://127.0.0.1:1", tmp_path, Path("m.csv"), "devA", "A", Path("s"))
    assert args[args.index("--val-streams") + 1] == str(addon)
    plain = _device_args(DemoSettings(), "mqtt://127.0.0.1:1", tmp_path, Path("m.csv"), "devA",
                         "A", Path("s"))  # fmt: skip
    assert "--val-streams" not in plain
    doc = json.loads(write_results(st, [], 1.0, tmp_path / "r.json").read_text())
    # Recorded as results record paths: without the folders of the machine that ran it.
    want = "wakefl demo --profile fleet-enrolled --seed 2 --val-streams fleet-valstreams-seed2/manifest.csv"
    assert doc["command"] == want


def test_the_demo_refuses_an_add_on_of_its_own_beside_no_val_streams(tmp_path):
    import argparse

    import pytest

    from wakefl.errors import ConfigError
    from wakefl.tools.cli import demo as demo_cli

    parser = argparse.ArgumentParser()
    demo_cli.register(parser.add_subparsers())
    addon = tmp_path / "manifest.csv"
    addon.write_text("path,label\n")
    args = parser.parse_args(["demo", "--val-streams", str(addon), "--no-val-streams"])
    with pytest.raises(ConfigError, match="contradict"):
        args.func(args)
    args = parser.parse_args(["demo", "--no-val-streams"])
    assert args.no_val_streams and args.val_streams is None


def test_two_runs_wanting_one_corpus_build_it_once_over_a_killed_builds_remains(
    tmp_path, monkeypatch, capsys
):
    import threading

    from wakefl.tools.fleet.demo import DemoSettings, corpus_folder, corpus_manifest

    monkeypatch.setenv("WAKEFL_CACHE", str(tmp_path))
    out = corpus_folder("fleet-micro", 0)
    # A build killed half way: files, no corpus.json, no completion mark.
    (out / "clips").mkdir(parents=True)
    (out / "clips" / "half.wav").write_bytes(b"RIFF")
    st = DemoSettings(profile="fleet-micro", seed=0)
    got: list = []
    runs = [threading.Thread(target=lambda: got.append(corpus_manifest(st))) for _ in range(2)]
    for t in runs:
        t.start()
    for t in runs:
        t.join(timeout=600)
    said = capsys.readouterr().out
    assert got == [out / "manifest.csv"] * 2 and (out / ".complete").is_file()
    assert not (out / "clips" / "half.wav").exists()
    assert said.count("removing an unfinished build") == 1
    assert said.count("building the fleet-micro corpus") == 1
    assert said.count("reusing the fleet-micro corpus") == 1
    assert "waiting for it" in said


def test_a_cache_folder_lock_waits_bounded_and_dies_with_its_holder(tmp_path):
    from wakefl.cache_lock import folder_lock, lock_path
    from wakefl.errors import WakeflError

    folder = tmp_path / "corpus" / "x-seed0"
    told: list[str] = []
    with (
        folder_lock(folder),
        pytest.raises(WakeflError, match="held .* for over"),
        folder_lock(folder, wait_s=0.3, on_wait=told.append, poll_s=0.05),
    ):
        pass
    assert len(told) == 1 and "waiting" in told[0]
    # A holder killed without releasing it: the kernel frees the lock.
    code = (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(lock_path(folder))!r}, os.O_RDWR)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(WakeflError), folder_lock(folder, wait_s=0.2, poll_s=0.05):
            pass
        holder.kill()
        holder.wait(timeout=30)
        with folder_lock(folder, wait_s=10, poll_s=0.05):
            pass
    finally:
        holder.kill()
