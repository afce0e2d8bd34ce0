"""Shared test set-up: CPU only, few threads (CI has 2 cores), deterministic seeds."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import shutil  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


# --- The tiny synthetic corpus, built once per test session (tools/corpus_build.py). ---


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory):
    """Path of the tiny corpus's manifest.csv: $WAKEFL_TEST_CORPUS when it names an existing
    manifest, otherwise the tiny profile built once into a session temporary folder."""
    env = os.environ.get("WAKEFL_TEST_CORPUS")
    if env and Path(env).is_file():
        return Path(env)
    from wakefl.tools.corpus_build import build_corpus

    return build_corpus(tmp_path_factory.mktemp("tiny_corpus"), seed=0, profile="tiny", progress=False)


# --- a real mosquitto on 127.0.0.1 for MQTT tests (server/device) -----------------------


@pytest.fixture
def mqtt_broker(tmp_path):
    """A managed mosquitto on a free loopback port, persistence under tmp_path; stopped after."""
    from wakefl.server.broker import ManagedBroker

    broker = ManagedBroker(tmp_path / "broker").start()
    try:
        yield broker
    finally:
        broker.stop()


# --- wake-word model and edge runtime fixtures -------------------------------------------

def espeak_wav(path: Path, text: str) -> Path:
    """Real speech from espeak-ng (22.05 kHz 16-bit mono WAV)."""
    if shutil.which("espeak-ng") is None:
        pytest.fail("espeak-ng is not installed; run scripts/setup.sh")
    subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True)
    return path


@pytest.fixture(scope="session")
def hey_nova_wav(tmp_path_factory) -> Path:
    return espeak_wav(tmp_path_factory.mktemp("speech") / "hey_nova.wav",
                      "hey nova. turn on the kitchen lights, please. hey nova")


@pytest.fixture(scope="session")
def tiny_kws_model():
    """A seeded width-0.25 KwsCnn whose output layer is scaled up, so its wake
    probabilities spread over (0, 1) instead of clustering at 0.5: comparisons between
    runtimes then test something."""
    from wakefl.models.kws_cnn import KwsCnn, ModelConfig
    from wakefl.models.kws_cnn.quantize import synthetic_calibration_windows

    torch.manual_seed(1234)
    model = KwsCnn(ModelConfig(width=0.25)).eval()
    cfg = model.cfg
    probe = torch.from_numpy(synthetic_calibration_windows(cfg.window_samples, cfg.sample_rate,
                                                           n=24, seed=7))
    with torch.no_grad():
        logits = model(probe)
        d = logits[:, 1] - logits[:, 0]
        k = 3.0 / float(d.std())
        out = model.head[-1]
        out.weight.mul_(k)
        out.bias.mul_(k)
        out.bias[1] -= k * float(d.median())
    return model


@pytest.fixture(scope="session")
def tiny_kws_onnx(tiny_kws_model, tmp_path_factory) -> Path:
    from wakefl.models.kws_cnn import export_onnx

    return export_onnx(tiny_kws_model, tmp_path_factory.mktemp("onnx") / "tiny.onnx")
