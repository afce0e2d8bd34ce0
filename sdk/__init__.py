"""The wakefl device SDK: local data, the Self-FL client, the federation client and its
persistent state.

Names are imported on first use, so `import wakefl.sdk` stays cheap (no torch, no paho)
for an app that only needs part of it.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "DeviceClient": "wakefl.sdk.device_client",
    "RoundOutcome": "wakefl.sdk.device_client",
    "RunSummary": "wakefl.sdk.device_client",
    "DeviceState": "wakefl.sdk.device_state",
    "DeviceStateStore": "wakefl.sdk.device_state",
    "PendingUpdate": "wakefl.sdk.device_state",
    "load_or_create": "wakefl.sdk.device_state",
    "WakeWordDataset": "wakefl.sdk.dataset",
    "read_manifest": "wakefl.sdk.manifest",
    "TorchLocalProblem": "wakefl.sdk.local_training",
    "predict_scores": "wakefl.sdk.local_training",
    "local_relative_report": "wakefl.sdk.wake_metrics",
    "MqttLink": "wakefl.sdk.mqtt_link",
    "ClientState": "wakefl.sdk.selffl.strategy",
    "LocalProblem": "wakefl.sdk.selffl.strategy",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'wakefl.sdk' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
