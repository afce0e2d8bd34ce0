"""The detection benchmark's detector settings and the edge benchmark's delay measurement
agree with the streaming detector the edge runtime runs."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from wakefl.edge_runtime import StreamingDetector
from wakefl.edge_runtime.detection_rule import stream_windows
from wakefl.errors import ConfigError
from wakefl.tools.bench.detection import fa_rate, parse_detector
from wakefl.tools.bench.detection_scoring import SplitScores, stream_events

SR, WINDOW = 16000, 24000


class EnergyScorer:
    """A deterministic posterior from the window's loudness, standing in for a model: what
    is checked is where windows fall and how their posteriors become events."""

    sample_rate = SR
    window_samples = WINDOW

    def score(self, windows: np.ndarray) -> np.ndarray:
        rms = np.sqrt(np.mean(np.asarray(windows, dtype=np.float64) ** 2, axis=1))
        return 1.0 - np.exp(-8.0 * rms)


def _stream(seconds: float = 30.0) -> np.ndarray:
    rng = np.random.default_rng(0)
    x = 0.01 * rng.standard_normal(int(seconds * SR))
    for start in (3.0, 9.5, 17.2, 24.0):  # loud bursts the detector fires on
        a = int(start * SR)
        x[a : a + int(0.8 * SR)] += 0.4 * rng.standard_normal(int(0.8 * SR))
    return x.astype(np.float32)


@pytest.mark.parametrize(("hop_s", "smoothing"), [(0.2, 1), (0.2, 2), (0.3, 3)])
def test_a_coarser_detector_from_fine_scores_matches_the_streaming_detector(hop_s, smoothing):
    wave, scorer = _stream(), EnergyScorer()
    raw = scorer.score(stream_windows(wave, WINDOW, int(0.1 * SR)))
    fine = SplitScores(np.array([0.9]), np.array([0.1]), [raw], wave.size / SR / 3600, 0.1, 3)
    coarse = fine.detector(hop_s, smoothing)
    det = StreamingDetector(scorer, hop_s=hop_s, smoothing=smoothing, threshold=0.5)
    posteriors, _ = det.feed(wave)
    assert np.allclose(coarse.raw_streams[0], [r for _, r, _ in posteriors])
    assert np.allclose(coarse.streams[0], [s for _, _, s in posteriors])
    for thr in (0.3, 0.5, 0.8):
        det = StreamingDetector(scorer, hop_s=hop_s, smoothing=smoothing, threshold=thr)
        assert stream_events(coarse, thr) == len(det.feed(wave)[1])


def test_detector_settings_are_checked():
    sc = SplitScores(np.array([0.9]), np.array([0.1]), [np.zeros(10)], 0.01, 0.1, 3)
    with pytest.raises(ConfigError, match="multiple"):
        sc.detector(0.15, 2)
    assert parse_detector("0.2:1") == (0.2, 1)
    for bad in ("0.2", "x:1", "0.2:0", "-1:2"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_detector(bad)


@pytest.mark.parametrize(
    ("text", "rate"), [("0.25", 0.25), ("2", 2.0), ("10", 10.0), ("nan", None), ("0", None),
                       ("-0.5", None), ("inf", None), ("11", None), ("x", None)],
)  # fmt: skip
def test_an_extra_pooled_target_is_a_sane_fa_rate(text: str, rate: float | None) -> None:
    if rate is None:
        with pytest.raises(argparse.ArgumentTypeError):
            fa_rate(text)
    else:
        assert fa_rate(text) == rate


def test_the_delay_is_measured_from_the_end_of_speech_to_the_detection():
    from wakefl.tools.bench.edge import detection_delay, speech_end

    rng = np.random.default_rng(3)
    utt = np.concatenate(
        [0.3 * rng.standard_normal(int(0.6 * SR)), 0.001 * rng.standard_normal(int(0.3 * SR))]
    )
    assert abs(speech_end(utt, SR) - int(0.6 * SR)) <= int(0.01 * SR)
    stream = 0.005 * rng.standard_normal(int(6.0 * SR))
    start = int(2.0 * SR)
    stream[start : start + utt.size] += utt
    end = start + speech_end(utt, SR)
    streams = [(stream.astype(np.float32), start, end)]
    res = detection_delay(EnergyScorer(), streams, threshold=0.5, hop_s=0.1, smoothing=1)
    det = StreamingDetector(EnergyScorer(), hop_s=0.1, smoothing=1, threshold=0.5)
    first = det.feed(stream.astype(np.float32))[1][0].time_s
    assert res["detected"] == res["phrases"] == 1
    assert res["delay_median_ms"] == pytest.approx((first - end / SR) * 1e3)
    missed = detection_delay(EnergyScorer(), streams, threshold=0.99, hop_s=0.1, smoothing=1)
    assert missed["detected"] == 0 and missed["delay_median_ms"] is None


def test_frr_by_voice_family_uses_the_split_threshold(tmp_path) -> None:
    from wakefl.tools.bench.detection_report import format_table
    from wakefl.tools.bench.detection_scoring import summarize
    from wakefl.tools.corpus.rendering import voice_families

    (tmp_path / "speakers.csv").write_text(
        "speaker,split,engine,voice,variant,rate,pitch\n"
        "u0,test,pico,en-US,,100,100\nu1,test,festival,slt,,100,0\n"
    )
    families = voice_families(tmp_path / "manifest.csv")
    assert families == {"u0": "pico:en-US", "u1": "festival:slt"}
    stream = np.full(600, 0.3)
    stream[300] = 0.7  # the one window the streams would false-accept below 0.7
    sc = SplitScores(
        pos=np.array([0.9, 0.95, 0.6, 0.8, 0.5, 0.65, 0.99, 0.75]),
        neg=np.array([0.1]),
        raw_streams=[stream],
        stream_hours=0.5,
        smoothing=1,
        pos_voices=np.array([families[s] for s in ["u0"] * 4 + ["u1"] * 4]),
    )
    out = summarize(sc, shipped=0.9)
    # Half an hour of stream allows no false accept at 0.5 FA/h: the lowest threshold
    # above the stream's 0.7 is the positive at 0.75.
    assert out["frr_at_0.5_fa_h"]["threshold"] == 0.75
    assert out["by_voice"] == {
        "festival:slt": {
            "positives": 4,
            "frr_at_0.5_fa_h": 0.5,
            "frr_at_shipped_threshold": 0.75,
        },
        "pico:en-US": {"positives": 4, "frr_at_0.5_fa_h": 0.25, "frr_at_shipped_threshold": 0.5},
    }
    table = format_table(
        {"hop_s": 0.1, "smoothing": 1, "fp32": {"unseen voices": {"A": out, "_seconds": 1.0}}}
    )
    assert "pico:en-US | 0.25/0.50" in table and "festival:slt | 0.50/0.75" in table
    assert voice_families(tmp_path / "elsewhere" / "manifest.csv") == {}
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "speakers.csv").write_text("speaker,age\nalice,40\n")
    assert voice_families(tmp_path / "mine" / "manifest.csv") == {}


def test_the_validation_split_is_scored_apart_from_the_test_split(tmp_path, capsys) -> None:
    import soundfile as sf

    from wakefl.tools.bench.detection_conditions import corpus_splits
    from wakefl.tools.bench.detection_scoring import score_split

    rng = np.random.default_rng(1)
    rows = ["path,label,device_type,state,speaker,split,duration_s,kind"]
    # Validation audio is louder than test audio, and its stream twice as long, so each
    # figure shows which split it came from.
    for split, gain, seconds in (("test", 0.05, 20.0), ("val", 0.3, 40.0)):
        for i, label in enumerate((1, 0)):
            name = f"{split}_{i}.wav"
            sf.write(tmp_path / name, gain * rng.standard_normal(WINDOW), SR)
            rows.append(f"{name},{label},A,normal,s{i},{split},1.5,clip")
        sf.write(
            tmp_path / f"{split}_stream.wav", gain * rng.standard_normal(int(seconds * SR)), SR
        )
        rows.append(f"{split}_stream.wav,0,A,normal,mix,{split},{seconds},stream")
    (tmp_path / "manifest.csv").write_text("\n".join(rows) + "\n")
    scorer = EnergyScorer()
    test = score_split(scorer, tmp_path / "manifest.csv", "A", None)
    assert capsys.readouterr().err == ""  # no label, nothing said
    val = score_split(scorer, tmp_path / "manifest.csv", "A", None, split="val", progress="fp32 v")
    # With a label, one line per device type reaches a log file as well as a terminal.
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.startswith("[bench] fp32 v A: 2 clips and 0.01 h of stream scored in "), said
    assert test.stream_hours == pytest.approx(20.0 / 3600)
    assert val.stream_hours == pytest.approx(40.0 / 3600)
    assert val.pos[0] > 0.9 > 0.5 > test.pos[0]
    # Choosing on validation leaves both reported splits (held-out, unseen) unread.
    (tmp_path / "unseen").mkdir()
    (tmp_path / "unseen" / "manifest.csv").write_text(rows[0] + "\n")
    assert corpus_splits(tmp_path, "val") == {"validation": tmp_path / "manifest.csv"}
    assert list(corpus_splits(tmp_path, "test")) == ["held-out speakers", "unseen voices"]
    with pytest.raises(ConfigError, match="no manifest.csv"):
        corpus_splits(tmp_path / "unseen" / "none", "val")
    with pytest.raises(ConfigError, match="no train clips"):
        score_split(scorer, tmp_path / "manifest.csv", "A", None, split="train")


def test_the_highest_stream_moments_are_distinct_events_with_what_was_said(tmp_path) -> None:
    from wakefl.tools.bench.detection_report import format_table
    from wakefl.tools.bench.detection_scoring import summarize, top_stream_events

    wav = tmp_path / "A_stream_000.wav"
    wav.write_bytes(b"")  # only its name and the transcript beside it are read
    (tmp_path / "A_stream_000.transcript.csv").write_text(
        "start_s,end_s,speaker,content,text\n"
        "2.0,2.8,spk1,conf,hey noelle\n"
        "10.1,10.9,spk2,other,turn it up\n"
    )
    stream = np.full(200, 0.1)  # 20 s at 0.1 s hops; window k ends at 0.1 k + 1.5 s
    stream[14:17] = [0.8, 0.9, 0.85]  # one event: windows ending 2.9-3.1 s
    stream[95] = 0.6  # ends at 11.0 s
    stream[150] = 0.7  # ends at 16.5 s, nothing said there
    sc = SplitScores(
        np.array([0.9]), np.array([0.1]), [stream], 20 / 3600, smoothing=1, stream_files=[wav]
    )
    top = top_stream_events(sc, k=3)
    # The three windows above 0.8 are one event (within the 1 s refractory period).
    assert [e["score"] for e in top] == pytest.approx([0.9, 0.7, 0.6])
    assert [e["end_s"] for e in top] == [3.0, 16.5, 11.0]
    assert [e["said"] for e in top] == [
        ["hey noelle (conf, spk1)"],
        [],
        ["turn it up (other, spk2)"],
    ]
    out = summarize(sc, shipped=None)
    assert len(out["top_stream_events"]) == 5
    table = format_table(
        {"hop_s": 0.1, "smoothing": 1, "fp32": {"held-out speakers": {"A": out, "_seconds": 1.0}}}
    )
    assert "A | 0.9000 | A_stream_000.wav @ 3.0 s | hey noelle (conf, spk1)" in table
    (tmp_path / "A_stream_000.transcript.csv").write_text("start,text\n1,x\n")
    with pytest.raises(ConfigError, match="not a stream transcript"):
        top_stream_events(sc)


def test_retimed_phrases_report_each_types_misses_at_the_shipped_threshold(tmp_path) -> None:
    import soundfile as sf

    from wakefl.tools.bench.detection_conditions import score_retimed
    from wakefl.tools.bench.detection_report import format_table

    rng = np.random.default_rng(2)
    rows = ["path,label,device_type,state,speaker,split,duration_s,kind"]
    # A: two loud clips and one quiet, B: one quiet; a val clip that the test split ignores.
    for i, (device, gain, split) in enumerate(
        (("A", 0.3, "test"), ("A", 0.3, "test"), ("A", 0.01, "test"), ("B", 0.01, "test"),
         ("B", 0.3, "val"))
    ):  # fmt: skip
        sf.write(tmp_path / f"c{i}.wav", gain * rng.standard_normal(WINDOW), SR)
        rows.append(f"c{i}.wav,1,{device},normal,s{i},{split},1.5,clip")
    (tmp_path / "manifest.csv").write_text("\n".join(rows) + "\n")
    scorer = EnergyScorer()
    out = score_retimed(scorer, tmp_path / "manifest.csv", "test", shipped=0.5)
    assert out == {
        "A": {"positives": 3, "frr_at_shipped_threshold": pytest.approx(1 / 3)},
        "B": {"positives": 1, "frr_at_shipped_threshold": 1.0},
    }
    val = score_retimed(scorer, tmp_path / "manifest.csv", "val", shipped=0.5)
    assert val == {"B": {"positives": 1, "frr_at_shipped_threshold": 0.0}}
    assert (
        score_retimed(scorer, tmp_path / "manifest.csv", "test", None)["A"][
            "frr_at_shipped_threshold"
        ]
        is None
    )
    table = format_table({"hop_s": 0.1, "smoothing": 3, "retimed_phrases": {"fp32": out}})
    assert (
        "fp32, re-timed phrases, FRR at the shipped threshold (clips): A 0.333 (3) | B 1.000 (1)"
        in table
    )
    with pytest.raises(ConfigError, match="no train wake-phrase clips"):
        score_retimed(scorer, tmp_path / "manifest.csv", "train", 0.5)
    with pytest.raises(ConfigError, match="does not exist"):
        score_retimed(scorer, tmp_path / "none.csv", "test", 0.5)


def test_phrases_in_running_speech_are_reported_beside_isolated_ones(tmp_path) -> None:
    import soundfile as sf

    from wakefl.tools.bench.detection_conditions import score_addon_clips
    from wakefl.tools.bench.detection_report import (
        carrier_at_condition_lines,
        carrier_lines,
        format_table,
    )

    rng = np.random.default_rng(3)
    rows = ["path,label,device_type,state,speaker,split,duration_s,kind"]
    # A: a loud and a quiet phrase, one loud confusable (accepted) and three quiet ones.
    for i, (label, gain) in enumerate(
        ((1, 0.3), (1, 0.01), (0, 0.3), (0, 0.01), (0, 0.01), (0, 0.01))
    ):
        sf.write(tmp_path / f"r{i}.wav", gain * rng.standard_normal(WINDOW), SR)
        rows.append(f"r{i}.wav,{label},A,normal,s{i},test,1.5,clip")
    (tmp_path / "manifest.csv").write_text("\n".join(rows) + "\n")
    out = score_addon_clips(EnergyScorer(), tmp_path / "manifest.csv", "test", 0.5, "--carrier")
    assert out == {
        "A": {
            "positives": 2,
            "frr_at_shipped_threshold": 0.5,
            "negatives": 4,
            "fa_share_at_shipped_threshold": 0.25,
        }
    }
    isolated = {"A": {"at_shipped_threshold": {"frr": 0.125}}}
    lines = carrier_lines({"fp32": out}, {"fp32": {"held-out speakers": isolated}})
    assert lines == [
        "\nfp32, phrases in running speech, FRR at the shipped threshold (clips): "
        "A 0.500 (2; isolated 0.125), confusables accepted 0.250 (4)"
    ]
    assert "phrases in running speech" in format_table(
        {"hop_s": 0.1, "smoothing": 3, "carrier_phrases": {"fp32": out}}
    )
    with pytest.raises(ConfigError, match="--carrier: .* has no val wake-phrase clips"):
        score_addon_clips(EnergyScorer(), tmp_path / "manifest.csv", "val", 0.5, "--carrier")
    # At each held-out condition's threshold for 0.5 FA/h: a higher one misses more.
    from wakefl.tools.bench.detection import carrier_at_conditions

    conds = {
        "held-out speakers": {"all types": {"threshold_at_0.5_fa_h": 0.5}},
        "held-out acoustics": {"all types": {"threshold_at_0.5_fa_h": 2.0}},
        "unseen voices": {"all types": {}},
    }
    at = carrier_at_conditions(EnergyScorer(), tmp_path / "manifest.csv", "test", conds)
    assert set(at) == {"held-out speakers", "held-out acoustics"}
    assert at["held-out speakers"]["by_type"] == out
    assert at["held-out acoustics"]["by_type"]["A"]["frr_at_shipped_threshold"] == 1.0
    table = carrier_at_condition_lines(at)
    assert table[0].endswith(
        "(0.5000), FRR / confusables accepted: A 0.500 / 0.250 | all 0.500 (2)"
    )
    assert table[1].startswith("\nfp32, phrases in running speech at held-out acoustics's")


def test_earlier_reports_of_the_same_weights_give_the_carrier_its_thresholds(tmp_path) -> None:
    import json

    from wakefl.tools.bench.detection import conditions_from, main

    speakers = {"held-out speakers": {"all types": {"threshold_at_0.5_fa_h": 0.97}}}
    acoustics = {"held-out acoustics": {"all types": {"threshold_at_0.5_fa_h": 0.91}}}
    reports = []
    for i, (digest, conds) in enumerate((("d1", speakers), ("d1", acoustics), ("d2", speakers))):
        reports.append(tmp_path / f"r{i}.json")
        reports[-1].write_text(json.dumps({"weights_digest": digest, "conditions": conds}))
    got = conditions_from(reports[:2], {"weights_digest": "d1"})
    assert {k: v["all types"]["threshold_at_0.5_fa_h"] for k, v in got.items()} == {
        "held-out speakers": 0.97,
        "held-out acoustics": 0.91,
    }
    assert got["held-out acoustics"]["from_report"].endswith("r1.json")
    # Another model's thresholds would read the carrier at another model's FA/h.
    with pytest.raises(ConfigError, match="scored other weights"):
        conditions_from(reports, {"weights_digest": "d1"})
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable JSON report"):
        conditions_from([tmp_path / "bad.json"], {"weights_digest": "d1"})
    (tmp_path / "none.json").write_text(
        json.dumps({"weights_digest": "d1", "conditions": {"x": {"all types": {}}}})
    )
    with pytest.raises(ConfigError, match="no condition there has a threshold"):
        conditions_from([tmp_path / "none.json"], {"weights_digest": "d1"})
    # Without --carrier there is nothing to read at them.
    argv = ["--weights", "w.safetensors", "--corpus", str(tmp_path), "--conditions-from"]
    with pytest.raises(ConfigError, match="give --carrier"):
        main([*argv, str(reports[0])])


def test_held_out_conditions_pool_the_types_by_their_positives_and_stream_hours() -> None:
    from wakefl.tools.bench.detection_conditions import held_out_conditions
    from wakefl.tools.bench.detection_report import condition_lines
    from wakefl.tools.bench.detection_scoring import pooled_operating_point, summarize

    def scores(pos: list[float], peaks: list[float], hours: float) -> SplitScores:
        stream = np.zeros(int(hours * 36000))
        stream[np.arange(len(peaks)) * 1000 + 500] = peaks
        return SplitScores(np.array(pos), np.zeros(2), [stream], hours, smoothing=1)

    # A: 4 positives, one below the shipped 0.9, one false accept above it in 2 h.
    # B: 2 positives, both below, no false accept in 1 h.
    per = {
        "A": scores([0.95, 0.97, 0.99, 0.5], [0.92, 0.3], 2.0),
        "B": scores([0.6, 0.7], [0.2], 1.0),
    }
    rows: dict = {d: summarize(sc, shipped=0.9) for d, sc in per.items()}
    rows["_pooled"] = pooled_operating_point(per, 0.5)
    out = held_out_conditions({"held-out acoustics": rows})["held-out acoustics"]
    every = out["all types"]
    assert every["positives"] == 6 and every["stream_hours"] == 3.0
    assert every["fa_h_resolution"] == pytest.approx(1 / 3)
    assert every["frr_at_shipped_threshold"] == pytest.approx((1 + 2) / 6)
    assert every["fa_h_at_shipped_threshold"] == pytest.approx(1 / 3)
    # Over 3 h, 0.5 FA/h allows one false accept: the pooled threshold lies below 0.92.
    assert every["threshold_at_0.5_fa_h"] < 0.92 and every["resolved_at_0.5_fa_h"]
    assert out["by_type"]["A"]["fa_h_at_shipped_threshold"] == pytest.approx(0.5)
    assert out["by_type"]["A"]["fa_h_resolution"] == pytest.approx(0.5)
    assert out["by_type"]["B"]["frr_at_shipped_threshold"] == 1.0
    assert not out["by_type"]["B"]["resolved_at_0.5_fa_h"]  # 1 h allows none at 0.5 FA/h
    lines = condition_lines({"held-out acoustics": out})
    assert "held-out acoustics | B | 1.000 | " in "\n".join(lines)
    assert any(line.startswith("held-out acoustics | all | 0.500 |") for line in lines)
    assert held_out_conditions({"x": {"_seconds": 1.0}}) == {}


@pytest.mark.slow  # two int8 exports
def test_layouts_are_compared_on_their_int8_graphs(capsys):
    from wakefl.tools.bench.edge import compare_layouts, main

    rows = compare_layouts(["v1", "v2,first_time_pool=3"], width=0.25, hop=0.2, rounds=2)
    assert [r["arch"] for r in rows] == ["v1", "v2,first_time_pool=3"]
    assert rows[0]["ratio"] == 1.0 and all(r["int8_ms_per_window"] > 0 for r in rows)
    for r in rows:
        assert r["core_share"] == pytest.approx(r["int8_ms_per_window"] / 1e3 / 0.2)
    with pytest.raises(ConfigError, match="--arch"):
        compare_layouts(["v3"], width=0.25, hop=0.1, rounds=1)
    with pytest.raises(SystemExit):  # the cost of untrained layouts: weights would be ignored
        main(["--layouts", "v1", "--weights", "w.safetensors"])
    assert main(["--layouts", "v1", "--width", "0.25"]) == 0
    assert "v1" in capsys.readouterr().out
