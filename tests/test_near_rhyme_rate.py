"""The near-rhyme streams add-on (`pretrain-nearrhymes`) and the probe that projects a
model's false accepts per hour from them (tools/probes/near_rhyme_rate.py)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from wakefl.errors import ConfigError
from wakefl.tools.bench.detection_scoring import SplitScores
from wakefl.tools.corpus.transcripts import StreamUtterance
from wakefl.tools.probes.near_rhyme_rate import (
    NearRhymeStreams,
    OrdinaryStreams,
    at_threshold,
    event_speech,
    main,
    paired_share,
    projected_fa_per_hour,
    projected_threshold,
    report,
)

HOP = 0.1  # the shipped detector's hop: one raw posterior per 0.1 s


def _streams(peaks: list[float], speaker: str = "spk001") -> NearRhymeStreams:
    """One 60 s stream (raw posteriors 0.01) with a near-rhyme every 6 s, each scoring one
    of `peaks` for three hops (so the 3-hop smoothing keeps the peak)."""
    raw = np.full(600, 0.01)
    said = []
    for k, p in enumerate(peaks):
        j = 40 + 60 * k
        raw[j : j + 3] = p
        # The window that ends at hop j + 2's end holds the utterance.
        end = (j + 2) * HOP + 1.5
        said.append(StreamUtterance(end - 1.0, end - 0.3, speaker, "conf", f"hey no{k}"))
    sc = SplitScores(np.empty(0), np.empty(0), [raw], 600 * HOP / 3600)
    return NearRhymeStreams(sc, [said])


def test_the_projection_scales_each_types_rate_per_near_rhyme_to_the_ordinary_streams():
    said = {"A": 100, "B": 50}
    dense = {"A": 0.8, "B": 0.5}
    ordinary = OrdinaryStreams({"A": 300, "B": 150}, {"A": 1.0, "B": 1.0}, {"A": 0.4, "B": 0.5})
    # A: 2 of 100 near-rhymes fire alone; its ordinary streams hold 300: 6 in 2 h.
    assert projected_fa_per_hour({"A": (2, 0), "B": (0, 0)}, said, dense, ordinary) == 3.0
    # A paired event counts at the ordinary streams' pairing against the near-rhyme
    # streams': half as often on A (0.4 / 0.8), as often on B (0.5 / 0.5).
    assert projected_fa_per_hour({"A": (0, 4)}, said, dense, ordinary) == pytest.approx(6.0)
    assert projected_fa_per_hour({"B": (1, 1)}, said, dense, ordinary) == pytest.approx(6.0)
    with pytest.raises(ConfigError, match="no near-rhymes said on device types"):
        projected_fa_per_hour({"A": (1, 0)}, {"A": 0}, dense, ordinary)
    empty = OrdinaryStreams({"A": 300}, {"A": 0.0}, {"A": 0.4})
    with pytest.raises(ConfigError, match="no hours"):
        projected_fa_per_hour({"A": (1, 0)}, said, dense, empty)


def test_a_near_rhyme_is_paired_when_another_is_less_than_a_window_away():
    def u(start: float, end: float, content: str = "conf") -> StreamUtterance:
        return StreamUtterance(start, end, "spk001", content, "hey no")

    # 0-1 and 2-3 are 1 s apart (paired); 2-3 and 4.6-5 1.6 s apart (not); the other
    # speech between 7 and 8 is no near-rhyme.
    said = [u(0, 1), u(2, 3), u(4.6, 5), u(7, 8, "other"), u(10, 11)]
    assert paired_share([said], 1.5) == pytest.approx(2 / 4)
    assert paired_share([said, [u(0, 1)]], 1.5) == pytest.approx(2 / 5)
    assert paired_share([[]], 1.5) == 0.0


def test_events_are_named_by_the_near_rhymes_in_their_window():
    ns = _streams([0.9, 0.99, 0.5], speaker="spk042")
    fired = event_speech(ns, 0.8)
    assert [(round(e.score, 3), e.heard, e.alone) for e in fired] == [
        (0.9, (("spk042", "hey no0"),), True),
        (0.99, (("spk042", "hey no1"),), True),
    ]
    assert event_speech(ns, 0.995) == []


def test_the_projected_threshold_is_the_lowest_within_the_target():
    # Ten near-rhymes said on each type, 100 in the ordinary streams over 10 h in all: each
    # event on a type's near-rhyme streams projects to 10 ordinary false accepts, 1 FA/h.
    per = {"A": _streams([0.9, 0.95, 0.97, *[0.2] * 7]), "B": _streams([0.96, *[0.2] * 9])}
    ordinary = OrdinaryStreams({"A": 100, "B": 100}, {"A": 5.0, "B": 5.0}, {"A": 0.0, "B": 0.0})
    # At most 2 FA/h projected: at most two events over both types, above 0.95's.
    thr = projected_threshold(per, ordinary, 2.0)
    assert thr == pytest.approx(0.96)
    cell = at_threshold(per, thr, ordinary)
    assert cell["all types"]["events"] == cell["all types"]["alone"] == 2
    assert cell["all types"]["projected_fa_per_hour"] == pytest.approx(2.0)
    assert cell["A"]["projected_fa_per_hour"] == pytest.approx(10 / 5.0)
    assert cell["all types"]["per_1000_said"] == pytest.approx(100.0)
    # Nothing is allowed below one event's worth: above every near-rhyme.
    assert projected_threshold(per, ordinary, 0.5) > 0.97
    # A threshold asked for within the key's 4 decimals of the projected one does not take
    # its entry: the entry is the projected threshold's, which set-threshold reads.
    out = report(per, ordinary, [thr + 4e-5], [2.0])
    assert f"{thr + 4e-5:.4f}" == f"{thr:.4f}" and list(out["at"]) == [f"{thr:.4f}"]
    assert out["at"][f"{thr:.4f}"]["all types"]["events"] == 2


def _speakers(folder: Path) -> dict[str, str]:
    with (folder / "speakers.csv").open(encoding="utf-8") as f:
        return {r["speaker"]: r["split"] for r in csv.DictReader(f)}


@pytest.mark.slow
def test_the_add_on_streams_hold_only_near_rhymes_of_validation_speakers(tmp_path) -> None:
    from wakefl.sdk.manifest import read_manifest
    from wakefl.tools.corpus.build import build_corpus
    from wakefl.tools.corpus.plan import PROFILES, texts_for
    from wakefl.tools.corpus.rendering import texts_said
    from wakefl.tools.corpus.speakers import make_speakers
    from wakefl.tools.corpus.transcripts import read_transcript

    manifest = build_corpus(tmp_path / "nr", 1, "pretrain-nearrhymes-micro", progress=False)
    rows = read_manifest(manifest)
    assert rows and {(r.kind, r.split) for r in rows} == {("stream", "val")}
    said = [u for r in rows for u in read_transcript(manifest.parent / r.path)]
    pool, others = texts_for(PROFILES["pretrain"], "hey nova")
    assert said and {u.content for u in said} == {"conf"}
    assert {u.text for u in said} <= set(pool)
    splits = _speakers(manifest.parent)
    assert {splits[u.speaker] for u in said} == {"val"}
    # Each speaker has the whole pool, and says nothing but near-rhymes.
    prof = PROFILES["pretrain-nearrhymes-micro"]
    val = [s for s in make_speakers(1, prof, "hey nova") if s.split == "val"]
    assert val and all(set(s.confusables) == set(pool) for s in val)
    assert not set(texts_said(prof, val[0], ("hey nova",))) & set(others)
    # An ordinary streams add-on still has its speakers' other speech.
    ordinary = PROFILES["pretrain-valstreams-micro"]
    speaker = next(s for s in make_speakers(0, ordinary, "hey nova") if s.split == "val")
    assert set(speaker.others) <= set(texts_said(ordinary, speaker, ("hey nova",)))


@pytest.mark.slow
def test_the_probe_scores_a_real_model_and_keeps_its_projection_within_target(
    tmp_path, pretrain_micro_corpus
) -> None:
    from wakefl.tools.corpus.build import build_corpus

    nr = build_corpus(tmp_path / "nr", 1, "pretrain-nearrhymes-micro", progress=False).parent
    out = tmp_path / "rate.json"
    main_corpus = str(pretrain_micro_corpus.parent)
    args = ["--near-rhymes", str(nr), "--streams", main_corpus, "--phrases", main_corpus]
    args += ["--model", "small=pretrained:small@0.5", "--threshold", "0.0", "0.01", "0.99"]
    assert main([*args, "--fa-per-hour", "5", "--threads", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["small"]
    assert r["threshold"] == 0.5 and r["speakers"] >= 1 and r["pairs"] >= r["speakers"]
    for key, cell in r["at"].items():
        per_type = [cell[d] for d in r["near_rhymes_said"]]
        assert cell["all types"]["events"] == sum(c["events"] for c in per_type), key
    # Events only fall as the threshold rises, and at the target's own threshold the
    # projection is within it.
    events = [r["at"][k]["all types"]["events"] for k in sorted(r["at"], key=float)]
    assert events[0] > 0 and events == sorted(events, reverse=True)
    # And the validation phrases missed only grow: none at 0, each type's share below it.
    frr = [r["at"][k]["frr"] for k in sorted(r["at"], key=float)]
    assert frr[0]["mean"] == 0.0 and [f["mean"] for f in frr] == sorted(f["mean"] for f in frr)
    assert all(f["mean"] == pytest.approx(np.mean([f[d] for d in "ABCDE"])) for f in frr)
    thr = r["thresholds"]["5"]
    assert r["at"][f"{thr:.4f}"]["all types"]["projected_fa_per_hour"] <= 5.0
    assert r["top_events"] and r["top_events"][0]["score"] >= r["top_events"][-1]["score"]
    # The ordinary streams need their transcripts: a corpus without them is refused.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "manifest.csv").write_text(
        "path,label,device_type,state,speaker,split,duration_s,kind\n"
        "s.wav,0,A,normal,mixed-val,val,10.0,stream\n"
    )
    with pytest.raises(ConfigError, match="no transcript"):
        main(["--near-rhymes", str(nr), "--streams", str(bare), "--model", "s=pretrained:small"])


@pytest.mark.parametrize("bad", ["1.5", "-0.1", "nan", "inf", "high"])
def test_a_threshold_outside_zero_to_one_is_refused_before_anything_is_read(bad, capsys):
    args = ["--near-rhymes", "nr", "--streams", "s", "--model", "m=pretrained:small"]
    with pytest.raises(SystemExit) as exc:
        main([*args, "--threshold", "0.9", bad])
    assert exc.value.code == 2 and "--threshold" in capsys.readouterr().err


def test_near_rhyme_corpora_of_other_seeds_pool_as_other_speakers(tmp_path) -> None:
    from wakefl.tools.probes.near_rhyme_rate import near_rhyme_corpora, pooled_near_rhymes

    # Two builds reuse the speaker name spk001 for two voices: pooled, they are two.
    one = {"A": _streams([0.999, 0.2])}
    two = {"A": _streams([0.2, 0.2, 0.999]), "B": _streams([0.999], "spk002")}
    pooled = pooled_near_rhymes([one, two], ["nr1", "nr2"])
    assert pooled["A"].said == 5 and len(pooled["A"].scores.raw_streams) == 2
    assert pooled["A"].scores.stream_hours == pytest.approx(2 * 600 * HOP / 3600)
    ordinary = OrdinaryStreams({"A": 10, "B": 10}, {"A": 1.0, "B": 1.0}, {"A": 0.3, "B": 0.3})
    r = report(pooled, ordinary, [0.9], [0.5])
    assert r["speakers"] == 3 and r["near_rhymes_said"] == {"A": 5, "B": 1}
    assert r["at"]["0.9000"]["A"]["events"] == 2
    assert r["at"]["0.9000"]["all types"]["speakers"] == 3
    assert pooled_near_rhymes([one], ["nr1"]) == one
    # Builds are told apart by their seed: the same seed twice is the same speakers.
    folders = []
    for name, seed in (("s1", 1), ("s2", 2), ("again", 1)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.csv").write_text("path\n")
        (tmp_path / name / "corpus.json").write_text(json.dumps({"seed": seed}))
        folders.append(tmp_path / name)
    assert near_rhyme_corpora(folders[:2]) == [f / "manifest.csv" for f in folders[:2]]
    with pytest.raises(ConfigError, match="same seed"):
        near_rhyme_corpora(folders)
    with pytest.raises(ConfigError, match="holds no manifest.csv"):
        near_rhyme_corpora([tmp_path / "none"])
