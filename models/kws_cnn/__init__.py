"""The wake-word model: log-mel frontend + CNN, safetensors checkpoints, ONNX export."""

from .checkpoint import load_model, read_config, save_model, weights_digest
from .config import ARCH_VERSION, ARCHITECTURE, ModelConfig
from .flat_params import get_flat_params, head_slice, num_flat_params, set_flat_params
from .initial_model import load_initial_model
from .model import KwsCnn
from .onnx_export import export_onnx

__all__ = [
    "weights_digest",
    "ARCHITECTURE",
    "ARCH_VERSION",
    "KwsCnn",
    "ModelConfig",
    "export_onnx",
    "get_flat_params",
    "head_slice",
    "load_initial_model",
    "load_model",
    "num_flat_params",
    "read_config",
    "save_model",
    "set_flat_params",
]
