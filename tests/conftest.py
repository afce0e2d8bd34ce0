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


# --- The tiny synthetic corpus, built once per test session (tools/corpus/build.py). ---


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory):
    """Path of the tiny corpus's manifest.csv: $WAKEFL_TEST_CORPUS when it names an existing
    manifest, otherwise the tiny profile built once into a session temporary folder."""
    env = os.environ.get("WAKEFL_TEST_CORPUS")
    if env and Path(env).is_file():
        return Path(env)
    from wakefl.tools.corpus.build import build_corpus

    return build_corpus(
        tmp_path_factory.mktemp("tiny_corpus"), seed=0, profile="tiny", progress=False
    )


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
    return espeak_wav(
        tmp_path_factory.mktemp("speech") / "hey_nova.wav",
        "hey nova. turn on the kitchen lights, please. hey nova",
    )


@pytest.fixture(scope="session")
def pretrain_micro_corpus(tmp_path_factory) -> Path:
    """The pretraining corpus's micro profile (about 15 s to build): what the training
    tests decode, augment and train on."""
    from wakefl.tools.corpus.build import build_corpus

    return build_corpus(
        tmp_path_factory.mktemp("pretrain-micro"),
        seed=0,
        profile="pretrain-micro",
        progress=False,
        tts_cache_dir=tmp_path_factory.getbasetemp() / "tts",
    )


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
    probe = torch.from_numpy(
        synthetic_calibration_windows(cfg.window_samples, cfg.sample_rate, n=24, seed=7)
    )
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


# --- Test tiers ---------------------------------------------------------------------------
# `pytest -m "not slow"` is the fast tier a developer runs while working (about 40 s of tests
# on 2 cores); CI runs every test. A test is in the slow tier when it needs the synthetic corpus
# (about 15 s to build), a real MQTT broker, or is named below (several seconds alone:
# training, CLI subprocesses, large exports). Whole modules marked with `pytestmark` and
# Self-FL's own convergence tests carry the marker in their files.
SLOW_FIXTURES = frozenset({"tiny_corpus", "mqtt_broker", "pretrain_micro_corpus"})
SLOW_MODULES = frozenset(
    {
        "test_broker_security.py",  # a TLS-configured mosquitto per test
        "test_device_client.py",  # devices training the CNN against a real broker
        "test_device_serving.py",  # the same, under faults
    }
)
# Fixtures slow only in their own module: test_pretrain.py's `corpus` and `voices_corpus`
# build the pretraining corpus's micro profile (about 15 s), and every test using them
# trains or decodes it.
SLOW_MODULE_FIXTURES = {"test_pretrain.py": frozenset({"corpus", "voices_corpus"})}
SLOW_TESTS = frozenset(
    {
        "test_corpus_build.py::test_same_seed_gives_byte_identical_corpus",
        "test_edge_runtime.py::test_cli_edge_detect",
        "test_edge_runtime.py::test_cli_edge_detect_runs_at_the_models_threshold_and_says_so",
        "test_log_format.py::test_the_server_prints_its_progress_in_the_log_format",
        "test_onnx_export.py::test_export_carries_the_threshold_of_the_weights_card",
        "test_pretrained_models.py::test_an_exported_shipped_model_carries_its_threshold",
        "test_edge_runtime.py::test_events_do_not_depend_on_chunking_or_format",
        "test_kws_model.py::test_frontend_matches_librosa_on_speech",
        "test_onnx_export.py::test_cli_model_info_and_export",
        "test_onnx_export.py::test_int8_size_and_agreement",
        "test_pretrain.py::test_batches_depend_only_on_seed_and_step",
        "test_pretrain.py::test_corpus_has_streams_per_split_and_an_unseen_voices_corpus",
        "test_publish.py::test_publish_writes_fp16_weights_config_and_card",
        "test_pretrain.py::test_train_checkpoint_resume_equals_uninterrupted_run",
        "test_server_refusals.py::test_broker_queue_overflow_is_reported_by_the_server",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.path.name
        name = getattr(item, "originalname", item.name)  # one entry covers every parameter
        if (
            module in SLOW_MODULES
            or f"{module}::{name}" in SLOW_TESTS
            or SLOW_FIXTURES & set(getattr(item, "fixturenames", ()))
            or SLOW_MODULE_FIXTURES.get(module, frozenset())
            & set(getattr(item, "fixturenames", ()))
        ):
            item.add_marker(pytest.mark.slow)
