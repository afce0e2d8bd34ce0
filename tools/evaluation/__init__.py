"""Evaluating wake-word models: scoring ONNX or safetensors models on a corpus exactly
as a device does, `wakefl eval` (candidates against a baseline per device type and
state), its report and DET plots, and the probe of how timing changes a score."""
