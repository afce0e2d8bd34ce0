"""The inputs of `wakefl eval` beside the models and the manifest: which device type each
candidate is paired with (`model.onnx:A`, a pairing file) and the baseline's shipped
threshold per device type (`--threshold`, a thresholds file, or the model card)."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from wakefl.errors import ConfigError
from wakefl.operating_point import check_threshold, metadata_threshold, shipped_threshold_in
from wakefl.tools.evaluation.settings import EvalSettings

_NAME_CHARS = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")


@dataclass(frozen=True)
class CandidateSpec:
    """A candidate model and the device type it is paired with (None: every device type)."""

    path: str
    device_type: str | None = None


def _is_name(text: str) -> bool:
    return bool(text) and set(text) <= _NAME_CHARS and text[0] not in "_.-"


def parse_candidate(spec: str) -> CandidateSpec:
    """`model.onnx` (every device type) or `model.onnx:A` (device type A only). A path that
    exists as given is never split, so a file name holding ':' still works."""
    text = spec.strip()
    if Path(text).is_file() or ":" not in text:
        return CandidateSpec(text)
    path, _, device = text.rpartition(":")
    device = device.strip()
    if not _is_name(device):
        raise ConfigError(
            f"--candidate {spec!r}: {device!r} after ':' is not a device type name "
            "(letters, digits, '_', '-', '.')"
        )
    return CandidateSpec(path.strip(), device)


def read_pairing(path: str | Path) -> list[CandidateSpec]:
    """A pairing file: CSV with columns `model,device_type` (model paths relative to the
    file's folder), one personalized model per device type."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"pairing file not found: {path}")
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        header = [h.strip() for h in reader.fieldnames or []]
        if not {"model", "device_type"} <= set(header):
            raise ConfigError(
                f"{path}: a pairing file needs the columns model,device_type; got {','.join(header)}"
            )
        reader.fieldnames = header
        out = []
        for line, rec in enumerate(reader, start=2):
            model, device = (rec.get("model") or "").strip(), (rec.get("device_type") or "").strip()
            if not model or not _is_name(device):
                raise ConfigError(
                    f"{path}:{line}: needs a model path and a device type name, got "
                    f"{model!r}, {device!r}"
                )
            out.append(
                CandidateSpec(
                    str(path.parent / model) if not Path(model).is_absolute() else model, device
                )
            )
    if not out:
        raise ConfigError(f"{path}: the pairing file lists no models")
    return out


def read_thresholds(path: str | Path) -> dict[str, float]:
    """A thresholds file per device type: JSON `{"A": 0.62, "B": 0.55, "*": 0.6}` or CSV
    with columns `device_type,threshold` ("*" stands for every device type not named)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"thresholds file not found: {path}")
    text = path.read_text(encoding="utf-8-sig")
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(data, dict) or not data:
            raise ConfigError(f"{path}: expected a JSON object of device type -> threshold")
        items = list(data.items())
    else:
        rows = list(csv.DictReader(text.splitlines()))
        if not rows or not {"device_type", "threshold"} <= set(rows[0]):
            raise ConfigError(
                f"{path}: a CSV thresholds file needs the columns device_type,threshold"
            )
        items = []
        for r in rows:
            try:
                items.append((r["device_type"].strip(), float(r["threshold"])))
            except (TypeError, ValueError):
                raise ConfigError(f"{path}: threshold {r['threshold']!r} is not a number") from None
    return {str(k).strip(): check_threshold(v, f"{path}: device type {k!r}") for k, v in items}


def card_threshold(model_path: str | Path) -> float | None:
    """The shipped threshold a model carries (wakefl/operating_point.py, the one reader of
    that format): `shipped_threshold` in the JSON beside the model (`<model>.json`, the
    config a checkpoint is saved with, or an exported model's sidecar), else in an ONNX
    file's metadata. None: neither names one."""
    path = Path(model_path)
    card = path.with_suffix(".json")
    if card.is_file():
        try:
            config = json.loads(card.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{card}: model card is not a JSON object ({exc})") from None
        value = shipped_threshold_in(config, str(card))
        if value is not None:
            return value
    if path.suffix.lower() != ".onnx":
        return None
    import onnx

    meta = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    return metadata_threshold(meta, str(path))


def _shipped_for(setting: float | dict[str, float] | None, device: str) -> float | None:
    if setting is None or isinstance(setting, float):
        return setting
    return setting.get(device, setting.get("*"))


def baseline_thresholds(
    st: EvalSettings, baseline_path: str | Path, devices: list[str]
) -> dict[str, float] | None:
    """The baseline's shipped threshold per device type, or None to fit it to the target FR."""
    setting = st.threshold
    if st.at_shipped_threshold:
        if setting is not None:
            raise ConfigError(
                "--at-shipped-threshold takes the baseline card's threshold: do not "
                "also give --threshold or --thresholds"
            )
        setting = card_threshold(baseline_path)
        if setting is None:
            raise ConfigError(
                f"--at-shipped-threshold: the baseline {baseline_path} has no model card "
                "with a shipped_threshold (in its .json or ONNX metadata); give --threshold"
            )
    if setting is None:
        return None
    if not isinstance(setting, dict):
        setting = float(check_threshold(setting, "--threshold"))
    out = {d: _shipped_for(setting, d) for d in devices}
    missing = [d for d, t in out.items() if t is None]
    if missing:
        raise ConfigError(
            f"no shipped threshold for device type(s) {', '.join(missing)}; name them "
            'in the thresholds file or give a "*" entry'
        )
    return {d: float(t) for d, t in out.items() if t is not None}
