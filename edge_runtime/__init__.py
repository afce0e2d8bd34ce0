"""Detect-only runtime for devices: WAV decoding, onnxruntime scoring and streaming
detection, with numpy and onnxruntime as the only third-party dependencies."""

from .audio_input import load_audio, resample, to_float32
from .gate_rule import Gate
from .onnx_scorer import OnnxScorer
from .streaming_detector import (
    FALLBACK_THRESHOLD,
    Detection,
    DetectionResult,
    StreamingDetector,
    WindowScorer,
    detect_audio,
    detect_file,
    resolve_threshold,
)

__all__ = [
    "FALLBACK_THRESHOLD",
    "Detection",
    "DetectionResult",
    "Gate",
    "OnnxScorer",
    "StreamingDetector",
    "WindowScorer",
    "detect_audio",
    "detect_file",
    "load_audio",
    "resample",
    "resolve_threshold",
    "to_float32",
]
