"""Publishing a pretraining run: fp16 weights with their config and card, the last
checkpoint, blends and soups of published models, and the shipped threshold set on
validation streams."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from micro_training import SETTINGS

from wakefl.errors import ConfigError
from wakefl.models.kws_cnn import load_model, weights_digest
from wakefl.tools.corpus.build import build_corpus
from wakefl.tools.training.pretrain import pretrain
from wakefl.tools.training.publish import publish, publish_blend, publish_soup, set_stream_threshold
from wakefl.tools.training.settings import BEST


@pytest.fixture(scope="module")
def corpus(pretrain_micro_corpus: Path) -> Path:
    return pretrain_micro_corpus


def test_publish_writes_fp16_weights_config_and_card(corpus: Path, tmp_path: Path) -> None:
    pretrain(corpus, tmp_path / "run", SETTINGS, progress=False, max_steps=3)
    out = publish(tmp_path / "run", "small", dest=tmp_path / "ship")
    from safetensors.torch import load_file

    assert all(t.dtype == torch.float16 for t in load_file(str(out)).values())
    model = load_model(out)
    best = load_model(tmp_path / "run" / BEST)
    for (_, p), (_, q) in zip(model.named_parameters(), best.named_parameters(), strict=True):
        torch.testing.assert_close(p, q.half().float())
    card = json.loads(out.with_suffix(".card.json").read_text())
    # The shipped threshold is set where the validation clips' FR is at most 5%, on the
    # fp16 weights that ship; the config JSON carries it for `wakefl eval`.
    assert card["operating_point"]["val_frr"] <= 0.05
    assert card["threshold"] == card["operating_point"]["threshold"]
    assert (
        json.loads(out.with_suffix(".json").read_text())["shipped_threshold"] == card["threshold"]
    )
    with pytest.raises(ConfigError):
        publish(tmp_path / "run", "medium", dest=tmp_path / "ship")


def test_publish_the_last_checkpoint(corpus: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    run = tmp_path / "run"
    pretrain(corpus, run, SETTINGS, progress=False, max_steps=3)
    pretrain(corpus, run, SETTINGS, resume=True, progress=False, max_steps=2)
    out = publish(run, "small", dest=tmp_path / "ship", checkpoint="last")
    state = load_file(str(run / "state.safetensors"))
    for k, p in load_model(out).named_parameters():
        torch.testing.assert_close(p, state[f"model.{k}"].half().float())
    card = json.loads(out.with_suffix(".card.json").read_text())
    last = json.loads((run / "history.jsonl").read_text().splitlines()[-1])
    assert card["step"] == last["step"] == 5 and card["checkpoint"] == "last"
    assert card["validation"]["frr"] == last["frr"]
    # a last checkpoint without its validation record is refused
    (run / "history.jsonl").write_text((run / "history.jsonl").read_text().splitlines()[0] + "\n")
    with pytest.raises(ConfigError, match="not validated"):
        publish(run, "small", dest=tmp_path / "ship", checkpoint="last")
    with pytest.raises(ConfigError, match="best or last"):
        publish(run, "small", dest=tmp_path / "ship", checkpoint="middle")


def test_a_blend_of_two_published_models_ships_in_fp16_with_its_parents(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from wakefl.models.kws_cnn import save_model
    from wakefl.tools.cli import main as cli

    run = tmp_path / "run"
    pretrain(corpus, run, SETTINGS, progress=False, max_steps=3)
    first = publish(run, "small", dest=tmp_path / "a")
    pretrain(corpus, run, SETTINGS, resume=True, progress=False, max_steps=2)
    second = publish(run, "small", dest=tmp_path / "b", checkpoint="last")
    argv = ["model", "blend", "--first", str(first), "--second", str(second), "--alpha", "0.5"]
    assert cli([*argv, "--publish", "small"]) == 2  # no corpus to set its threshold on
    assert "--corpus" in capsys.readouterr().err
    ship = ["--publish", "small", "--dest", str(tmp_path / "c"), "--corpus", str(corpus)]
    assert cli([*argv, *ship]) == 0
    out = tmp_path / "c" / "small.safetensors"
    from safetensors.torch import load_file

    a, b, mixed = (load_file(str(f)) for f in (first, second, out))
    for k, t in mixed.items():
        assert t.dtype == torch.float16
        assert torch.equal(t, ((a[k].float() + b[k].float()) / 2).half())
    card = json.loads(out.with_suffix(".card.json").read_text())
    assert card["blend"]["first"]["weights_digest"] == weights_digest(first)
    assert card["blend"]["second"]["weights_digest"] == weights_digest(second)
    assert card["blend"]["alpha"] == 0.5 and card["operating_point"]["val_frr"] <= 0.05
    assert (
        json.loads(out.with_suffix(".json").read_text())["shipped_threshold"] == card["threshold"]
    )
    # A model blended with itself is itself, and ships at the threshold `publish` gave it.
    same = publish_blend(first, first, 0.3, "small", corpus, dest=tmp_path / "d")
    assert weights_digest(same) == weights_digest(first)
    first_card = json.loads(first.with_suffix(".card.json").read_text())
    assert (
        json.loads(same.with_suffix(".card.json").read_text())["threshold"]
        == first_card["threshold"]
    )
    # Parents without a card, or shipping other detector settings, are refused.
    bare = save_model(load_model(first), tmp_path / "bare" / "small.safetensors")
    with pytest.raises(ConfigError, match="no card"):
        publish_blend(first, bare, 0.5, "small", corpus, dest=tmp_path / "e")
    changed = second.with_suffix(".card.json")
    changed.write_text(json.dumps({**json.loads(changed.read_text()), "smoothing": 5}))
    with pytest.raises(ConfigError, match="detector settings"):
        publish_blend(first, second, 0.5, "small", corpus, dest=tmp_path / "e")
    assert not (tmp_path / "e").exists()


def test_a_soup_of_published_models_ships_in_fp16_with_each_parent_and_share(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file

    from wakefl.models.kws_cnn import save_model
    from wakefl.tools.cli import main as cli

    run = tmp_path / "run"
    parents = []
    for i, steps in enumerate((3, 2, 2)):
        pretrain(corpus, run, SETTINGS, resume=i > 0, progress=False, max_steps=steps)
        parents.append(publish(run, "small", dest=tmp_path / f"p{i}", checkpoint="last"))
    argv = ["model", "soup", "--models", *map(str, parents), "--shares", "0.5", "0.25", "0.25"]
    assert cli([*argv, "--publish", "small"]) == 2  # no corpus to set its threshold on
    assert "--corpus" in capsys.readouterr().err
    ship = ["--publish", "small", "--dest", str(tmp_path / "s"), "--corpus", str(corpus)]
    assert cli([*argv, *ship]) == 0
    out = tmp_path / "s" / "small.safetensors"
    loaded = [load_file(str(f)) for f in (*parents, out)]
    for k, t in loaded[-1].items():
        assert t.dtype == torch.float16
        parts = [p[k].double() for p in loaded[:3]]
        expected = (0.5 * parts[0] + 0.25 * parts[1] + 0.25 * parts[2]).float().half()
        assert torch.equal(t, expected)
    card = json.loads(out.with_suffix(".card.json").read_text())
    assert [p["weights_digest"] for p in card["soup"]] == [weights_digest(p) for p in parents]
    assert [p["share"] for p in card["soup"]] == [0.5, 0.25, 0.25]
    assert card["operating_point"]["val_frr"] <= 0.05
    # Any parent without a card is refused before anything is written.
    bare = tmp_path / "bare" / "small.safetensors"
    save_model(load_model(parents[0]), bare)
    with pytest.raises(ConfigError, match="no card"):
        publish_soup([*parents, bare], [0.25] * 4, "small", corpus, dest=tmp_path / "e")
    assert not (tmp_path / "e").exists()


def test_set_threshold_ships_the_one_the_validation_streams_set(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from wakefl.tools.bench.detection import main as bench
    from wakefl.tools.cli import main as cli

    run = tmp_path / "run"
    pretrain(corpus, run, SETTINGS, progress=False, max_steps=3)
    out = publish(run, "small", dest=tmp_path / "ship")
    val = build_corpus(tmp_path / "val", 0, "pretrain-valstreams-micro", progress=False).parent
    report = tmp_path / "val.json"
    argv = ["--weights", str(out), "--corpus", str(corpus.parent), "--split", "val"]
    more = ["--pooled-fa-per-hour", "0.25", "2", "--threads", "1"]
    assert bench([*argv, "--extra-streams", str(val), "--json", str(report), *more]) == 0
    bench_json = json.loads(report.read_text())
    pooled = bench_json["fp32"]["validation"]["_pooled"]
    # A stricter target never sets a lower threshold on the same streams.
    extra = bench_json["fp32"]["validation"]["_pooled_by_target"]
    assert sorted(extra) == ["0.25", "2"] and extra["0.25"]["fa_per_hour_target"] == 0.25
    assert extra["0.25"]["threshold"] >= pooled["threshold"] >= extra["2"]["threshold"]
    set_threshold = ["model", "set-threshold", "--weights", str(out), "--from", str(report)]
    # A micro corpus's few minutes of validation stream cannot resolve 0.5 FA/h: refused,
    # and the card and config stay as they were.
    files = [out.with_suffix(".card.json"), out.with_suffix(".json")]
    before = [f.read_text() for f in files]
    assert not pooled["resolved"]
    capsys.readouterr()
    assert cli(set_threshold) == 2
    assert "cannot resolve 0.5 FA/h" in capsys.readouterr().err
    assert [f.read_text() for f in files] == before
    # With hours enough (as 2 h per device type give), an untrained model still has no
    # threshold within 0.5 FA/h; a trained one's ships.
    pooled["resolved"] = True
    report.write_text(json.dumps(bench_json))
    assert pooled["threshold"] > 1.0
    with pytest.raises(ConfigError, match="no threshold keeps"):
        set_stream_threshold(out, report)
    pooled["threshold"] = 0.875
    report.write_text(json.dumps(bench_json))
    assert cli(set_threshold) == 0
    assert "shipped threshold 0.875000" in capsys.readouterr().out
    card = json.loads(files[0].read_text())
    assert (
        card["threshold"] == 0.875 and card["clip_threshold"] == json.loads(before[0])["threshold"]
    )
    assert card["stream_operating_point"]["stream_hours"] == pooled["stream_hours"]
    assert json.loads(files[1].read_text())["shipped_threshold"] == 0.875
    assert load_model(out) is not None  # the weights are untouched and still load
    # A benchmark of other weights: refused. Publishing again (same weights, new file bytes)
    # keeps the digest, so the same report still fits.
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**bench_json, "weights_digest": "0" * 64}))
    with pytest.raises(ConfigError, match="scored other weights"):
        set_stream_threshold(out, other)
    publish(run, "small", dest=tmp_path / "ship")
    assert set_stream_threshold(out, report)["threshold"] == 0.875
    # A stricter target ships the point the benchmark set for it, and says which it was;
    # one the benchmark was not asked for, or an absurd one, is refused.
    extra["0.25"].update(resolved=True, threshold=0.9375)
    report.write_text(json.dumps(bench_json))
    assert cli([*set_threshold, "--fa-per-hour", "0.25"]) == 0
    card = json.loads(files[0].read_text())
    assert card["threshold"] == 0.9375
    assert card["stream_operating_point"]["fa_per_hour_target"] == 0.25
    with pytest.raises(ConfigError, match="no point at 0.1 FA/h.*--pooled-fa-per-hour 0.1"):
        set_stream_threshold(out, report, 0.1)
    for absurd in (float("nan"), 0.0, -1.0, 1e9):
        with pytest.raises(ConfigError, match="an FA/h target is in"):
            set_stream_threshold(out, report, absurd)
    assert json.loads(files[0].read_text())["threshold"] == 0.9375
    other.write_text("{}")
    with pytest.raises(ConfigError, match="not the JSON"):
        set_stream_threshold(out, other)
    # With a near-rhyme probe of the same weights, the higher of the two thresholds ships.
    from wakefl.tools.probes.near_rhyme_rate import main as near_rhyme_rate

    nr = build_corpus(tmp_path / "nr", 1, "pretrain-nearrhymes-micro", progress=False).parent
    probe = tmp_path / "nr.json"
    probe_argv = ["--near-rhymes", str(nr), "--streams", str(corpus.parent), "--streams", str(val)]
    probe_argv += ["--model", f"m={out}@0.5", "--fa-per-hour", "0.25", "--threads", "1"]
    assert near_rhyme_rate([*probe_argv, "--json", str(probe)]) == 0
    result = json.loads(probe.read_text())
    shipped = ["--fa-per-hour", "0.25", "--near-rhymes", str(probe)]
    # Three steps of training leave no threshold within 0.25 FA/h on the near-rhymes of a
    # micro corpus's validation streams: refused, and the card stays as it was.
    assert result["m"]["thresholds"]["0.25"] > 1.0
    before = [f.read_text() for f in files]
    assert cli([*set_threshold, *shipped]) == 2
    assert "no threshold keeps the projection within 0.25 FA/h" in capsys.readouterr().err
    assert [f.read_text() for f in files] == before
    # Its point set higher than the streams': that one ships, and the card says why.
    result["m"]["thresholds"]["0.25"] = 0.96875
    result["m"]["at"]["0.9688"] = next(iter(result["m"]["at"].values()))
    probe.write_text(json.dumps(result))
    assert cli([*set_threshold, *shipped]) == 0
    assert "near-rhyme streams: 0.968750" in capsys.readouterr().out
    card = json.loads(files[0].read_text())
    assert card["threshold"] == 0.96875 == card["near_rhyme_operating_point"]["threshold"]
    assert json.loads(files[1].read_text())["shipped_threshold"] == 0.96875
    # Set again without it: the streams' point alone, and no stale near-rhyme point.
    assert set_stream_threshold(out, report, 0.25)["threshold"] == 0.9375
    assert "near_rhyme_operating_point" not in json.loads(files[0].read_text())
    # A probe of other weights, or without the target's threshold, is refused.
    extra["0.1"] = {**extra["0.25"], "fa_per_hour_target": 0.1}
    report.write_text(json.dumps(bench_json))
    with pytest.raises(ConfigError, match="no threshold for 0.1 FA/h"):
        set_stream_threshold(out, report, 0.1, probe)
    result["m"]["weights_digest"] = "0" * 64
    probe.write_text(json.dumps(result))
    with pytest.raises(ConfigError, match="scored other weights"):
        set_stream_threshold(out, report, 0.25, probe)
    assert json.loads(files[0].read_text())["threshold"] == 0.9375
