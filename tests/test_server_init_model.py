"""`wakefl server --init-model` takes a shipped model by name, as `demo` and `eval` do."""

from __future__ import annotations

import pytest
import torch

from wakefl.errors import ConfigError
from wakefl.models.kws_cnn import get_flat_params, load_initial_model
from wakefl.models.kws_cnn.pretrained import load_pretrained


def test_init_model_takes_a_shipped_model_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("WAKEFL_CACHE", str(tmp_path))
    params, cfg = load_initial_model("pretrained:small", 1.0, 0)
    shipped = load_pretrained("small")
    assert torch.equal(params, get_flat_params(shipped)) and cfg == shipped.cfg.to_dict()
    with pytest.raises(ConfigError, match="shipped model"):
        load_initial_model("pretrained:medium", 1.0, 0)
