"""Enrolment (sdk/enrolment.py, sdk/take_check.py, `DeviceClient.enrol`) on real speech
from espeak-ng decoded from WAV: refused takes say why, kept takes train and validate in
the next round, and nothing of them travels in any message the device publishes on a real
mosquitto on 127.0.0.1."""

from __future__ import annotations

import shutil
import subprocess
import wave
from pathlib import Path

import numpy as np
import pytest
from device_sim import FakeServer, ToneDataset, start_run, wait_until

from wakefl.protocol import topics
from wakefl.sdk.device_client import DeviceClient
from wakefl.sdk.device_state import DeviceStateStore
from wakefl.sdk.enrolment import ENROLMENT_DIR, Enrolment
from wakefl.sdk.mqtt_link import MqttLink


def _say(path: Path, text: str, *args: str) -> Path:
    if shutil.which("espeak-ng") is None:
        pytest.fail("espeak-ng is not installed; run scripts/setup.sh")
    subprocess.run(["espeak-ng", *args, "-w", str(path), text], check=True, capture_output=True)
    return path


def _write(path: Path, samples: np.ndarray, rate: int) -> Path:
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return path


def _read(path: Path) -> tuple[np.ndarray, int]:
    with wave.open(str(path), "rb") as f:
        raw, rate = f.readframes(f.getnframes()), f.getframerate()
    return np.frombuffer(raw, dtype="<i2").astype(np.float64) / 32767, rate


@pytest.fixture(scope="module")
def takes(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("takes")
    out = {
        "nova": _say(d / "nova.wav", "hey nova"),
        "nova_slow": _say(d / "nova_slow.wav", "hey nova", "-s", "130"),
        "nova_high": _say(d / "nova_high.wav", "hey nova", "-p", "70"),
        "morning": _say(d / "morning.wav", "good morning"),
        "sentence": _say(d / "sentence.wav", "what is the weather like today in the city"),
    }
    speech, rate = _read(out["nova"])
    out["clipped"] = _write(d / "clipped.wav", speech * 12, rate)  # overdriven: clipped
    out["silence"] = _write(d / "silence.wav", np.zeros(rate * 2), rate)
    return out


def test_refused_takes_say_why(tmp_path, takes):
    e = Enrolment(tmp_path / ENROLMENT_DIR)
    got = e.add([takes[k] for k in ("nova", "silence", "clipped", "sentence", "nova_slow")])
    verdicts = {Path(r.name).stem: r for r in got}
    assert verdicts["silence"].reason == "no speech heard: the voice-activity model found none"
    assert verdicts["clipped"].reason.startswith("clipped: ")
    assert "of speech, longer than the phrase window of 1.5 s" in verdicts["sentence"].reason
    assert [verdicts[k].accepted for k in ("nova", "nova_slow")] == [True, True]
    assert not any(verdicts[k].accepted for k in ("silence", "clipped", "sentence"))
    # A different phrase as short as the wake phrase: only the comparison with the user's
    # other takes tells it apart.
    (morning,) = e.add([takes["morning"]])
    assert not morning.accepted and "does not sound like the other takes" in morning.reason
    (high,) = e.add([takes["nova_high"]])
    assert high.accepted, high.reason


def test_kept_takes_alternate_splits_and_survive_a_restart(tmp_path, takes):
    folder = tmp_path / ENROLMENT_DIR
    got = Enrolment(folder).add([takes["nova"], takes["nova_slow"], takes["nova_high"]])
    assert [r.split for r in got] == ["train", "val", "train"]
    again = Enrolment(folder)  # a fresh process reads what was kept
    assert (again.count("train"), again.count("val")) == (2, 1)
    train = again.dataset("train", "A")
    wave0, label = train[0]
    assert tuple(wave0.shape) == (24000,) and label == 1
    assert train.rows[0].speaker == "enrolment" and train.rows[0].split == "train"
    # The phrase sits inside the kept window, not cut off at its edge.
    lo, hi = again.takes[0]["speech"]
    assert 0 <= lo < hi <= 24000 and np.abs(wave0.numpy()[lo:hi]).max() > 0.05
    # A lone take cannot be compared with anything: kept, and the result says so.
    (lone,) = Enrolment(tmp_path / "other").add([takes["nova"]])
    assert lone.accepted and lone.reason == "not compared: a single take"


def _pieces(folder: Path) -> list[bytes]:
    """Byte strings that would betray a kept take in a payload: 64-byte runs of its
    speech as 16-bit PCM (as stored) and as float32 (as the model sees it)."""
    out = []
    for wav in sorted(folder.glob("take-*.wav")):
        pcm, _ = _read(wav)
        loud = np.flatnonzero(np.abs(pcm) > 0.05)
        for at in loud[:: max(1, loud.size // 4)][:4]:
            seg = pcm[at : at + 16]
            out.append((seg * 32767).round().astype("<i2").tobytes())
            out.append(seg.astype("<f4").tobytes())
            out.append(seg.astype(">f4").tobytes())
    return out


def test_takes_train_and_validate_in_the_next_round_and_never_leave_the_device(
    tmp_path, mqtt_broker, takes
):
    fleet = "fenrol"
    server = FakeServer(mqtt_broker.url, fleet)
    spy = MqttLink(mqtt_broker.url, "spy-enrol", clean_start=True).connect()
    seen: list[tuple[str, bytes]] = []
    spy.subscribe(f"{topics.ROOT}/{fleet}/#", lambda topic, payload: seen.append((topic, payload)))
    train, val = ToneDataset(8, 1), ToneDataset(8, 2)  # 4 wake words each
    client = DeviceClient(
        "dev1", "A", train, tmp_path / "dev1", validation=val, broker_url=mqtt_broker.url,
        fleet=fleet, ack_timeout_s=1.0,
    )  # fmt: skip
    results = client.enrol(
        [takes["nova"], takes["silence"], takes["nova_slow"], takes["nova_high"]]
    )
    assert [r.accepted for r in results] == [True, False, True, True]
    assert client.num_samples == 8 + 2  # two takes train
    th, out = start_run(client)
    try:
        server.downlink(1, ["dev1"])
        up = server.next_uplink()
        assert up.num_samples == 10  # the round trained on the takes too
        server.ack("dev1", 1)
        assert wait_until(lambda: DeviceStateStore(tmp_path / "dev1").load().last_acked_round == 1)
        server.downlink(1, [], final=True)
        th.join(30)
        summary = out["summary"]
        # The gate saw the validating take among the wake words: 4 clips and 1 take.
        assert summary.gate["n_positive"] == 5
        assert "5 validation wake words" in summary.gate["reason"]
    finally:
        client.stop()
        th.join(10)
        client.close()
        server.close()
    spy.close()
    device_messages = [p for t, p in seen if "/dev1" in t and p]
    assert any("/up/" in t for t, _ in seen) and device_messages
    pieces = _pieces(tmp_path / "dev1" / ENROLMENT_DIR)
    assert len(pieces) >= 6
    for payload in device_messages:
        assert not any(piece in payload for piece in pieces)
    # The uplink's record holds scalars only (numbers), no audio and no file names.
    assert all(isinstance(v, float) for v in up.record.values())
    assert not any("take" in k or "enrol" in k for k in up.record)
    # A restarted device finds its takes in its state folder.
    again = DeviceClient(
        "dev1", "A", train, tmp_path / "dev1", validation=val, broker_url=mqtt_broker.url,
        fleet=fleet,
    )  # fmt: skip
    try:
        assert again.num_samples == 10 and again.trainer.labels().sum() == 5
    finally:
        again.close()


def test_wakefl_device_enrol_keeps_and_refuses_takes_from_the_command_line(
    tmp_path, mqtt_broker, takes
):
    import os
    import sys

    # A device type with two clips per split, enough to start the device.
    rows = ["path,label,device_type,state,speaker,split,duration_s,kind"]
    from wakefl.edge_runtime import load_audio

    speech = load_audio(takes["nova"], 16000)  # a corpus is 16 kHz
    for split in ("train", "val"):
        for label, wave_ in ((1, speech), (0, np.zeros(24000))):
            dst = _write(tmp_path / f"{split}-{label}.wav", wave_, 16000)
            rows.append(f"{dst.name},{label},A,normal,u1,{split},1.5,clip")
    (tmp_path / "manifest.csv").write_text("\n".join(rows) + "\n")
    state = tmp_path / "state"
    args = [
        "device", "--id", "dev1", "--type", "A", "--data", str(tmp_path / "manifest.csv"),
        "--broker", mqtt_broker.url, "--state", str(state), "--idle-timeout", "2",
        "--enrol", str(takes["nova"]), str(takes["silence"]), str(takes["nova_slow"]),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "wakefl.tools.cli", *args],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert f"enrolment take {takes['nova']}: kept (training)" in out, out[-3000:]
    assert f"enrolment take {takes['silence']}: refused: no speech heard" in out
    assert f"enrolment take {takes['nova_slow']}: kept (validation)" in out
    assert "2 of 3 enrolment take(s) kept" in out
    # No server answered: the device gave up after its idle timeout, its takes kept.
    assert proc.returncode != 0 and "no message from the server" in out
    assert (Enrolment(state / ENROLMENT_DIR).count("train"), 1) == (1, 1)
