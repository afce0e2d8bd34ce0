"""Which model a device serves: the served-model gate applied after each round, and the
served model itself (for export and detection).

After a round trains, `ServingGate.after_round` scores the model served now, the new
personalized model, the downlinked global model and the baseline on the device's local
validation clips (joined, where `wakefl device` cut them, by windows of its validation
streams: sdk/stream_windows.py) and asks `served_model_gate.decide_served_model` which to serve
(docs/SELF_FL.md, "The served-model gate"). It switches only when the gate says so, and
folds the decision into the round's commit: the served model's parameters and name into
the state (saved with the round, atomically), the decision and its evidence into the
pending update's report (the device's summary) and, as the gate's flat scalars, into its
uplink record, with the served model's relative FA/FR against the baseline.

A device without validation clips (or without wake-word or other clips among them) has
nothing to compare on: it keeps serving its current model, which before any switch is the
baseline, the model it was shipped with. A scoring failure (e.g. a model whose scores are
NaN) keeps the current model too, and says why.
"""

from __future__ import annotations

import logging
import math
import os
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from wakefl.errors import ConfigError, WakeflError
from wakefl.sdk.device_state import DeviceState
from wakefl.sdk.round_training import RoundTrainer, json_safe
from wakefl.sdk.served_model_gate import TIE_RULES, GateDecision, decide_served_model

log = logging.getLogger("wakefl.device")

CANDIDATES = ("personalized", "global")


class ServingGate:
    """The served-model gate of one device (n_boot bootstrap replicates at `level`, at the
    device's target FR; the seed mixes the device id and the round; `ties` as in
    `decide_served_model`)."""

    def __init__(
        self,
        trainer: RoundTrainer,
        *,
        target_fr: float,
        seed: int = 0,
        n_boot: int = 500,
        level: float = 0.95,
        ties: str = "keep",
    ) -> None:
        if ties not in TIE_RULES:
            raise ConfigError(f"gate ties must be one of {', '.join(TIE_RULES)}, got {ties!r}")
        self.ties = ties
        self.trainer = trainer
        self.target_fr = float(target_fr)
        self.seed = int(seed)
        self.n_boot = int(n_boot)
        self.level = float(level)

    def after_round(self, st: DeviceState, global_params: Tensor, round_id: int) -> None:
        """Decide what `st` serves after `round_id` (trained: `st.personal_params` and
        `st.pending` are the round's) and record it in `st` and in the pending update."""
        assert st.pending is not None and st.baseline_params is not None
        if not st.served_name:  # before any decision the device serves the shipped model
            st.served_params, st.served_name = st.baseline_params, "baseline"
            st.served_round = st.baseline_round
        assert st.served_params is not None
        candidates = {"personalized": st.personal_params, "global": global_params}
        try:
            decision = self._decide(st.served_params, st.baseline_params, candidates, round_id)
        except (WakeflError, ValueError, RuntimeError) as exc:
            log.warning("round %d: served-model gate failed: %s", round_id, exc)
            st.pending.report["gate"] = {"serve": "served", "switched": False, "error": str(exc)}
            st.pending.report["served"] = self._served_figures(st)
            return
        if decision.switched:
            chosen = candidates[decision.serve]
            assert chosen is not None
            st.served_params, st.served_name, st.served_round = chosen, decision.serve, round_id
        served = self._served_figures(st)
        st.pending.report["gate"] = json_safe(decision.as_dict())
        st.pending.report["served"] = served
        st.pending.scalars.update(decision.uplink_scalars())
        for name in ("relative_fa", "relative_fr"):
            value = served.get(name)
            if isinstance(value, float) and math.isfinite(value):
                st.pending.scalars[f"gate_served_{name}"] = value

    def _decide(
        self,
        served: Tensor,
        baseline: Tensor,
        candidates: dict[str, Tensor | None],
        round_id: int,
    ) -> GateDecision:
        seed = zlib.crc32(f"{self.seed}:{self.trainer.device_id}:{round_id}:gate".encode())
        settings: dict[str, Any] = {
            "served_name": "served",
            "target_fr": self.target_fr,
            "n_boot": self.n_boot,
            "level": self.level,
            "seed": seed,
            "ties": self.ties,
        }
        if not self.trainer.has_validation():
            return decide_served_model([], [], {}, **settings)
        score = self.trainer.scores
        cands = {
            name: score(params)
            for name, params in candidates.items()
            # a candidate identical to the served model changes nothing (round 1's global
            # model is the warm start)
            if params is not None and not torch.equal(params, served)
        }
        return decide_served_model(
            self.trainer.labels(),
            score(served),
            cands,
            units=self.trainer.units(),
            baseline_scores=score(baseline),
            **settings,
        )

    def _served_figures(self, st: DeviceState) -> dict[str, Any]:
        """The served model and its point relative FA/FR against the baseline on the
        validation clips (1 for the baseline itself; None where unbounded or unknown)."""
        out: dict[str, Any] = {
            "model": st.served_name,
            "round": st.served_round,
            "relative_fa": None,
            "relative_fr": None,
        }
        if st.served_name == "baseline":
            out.update(relative_fa=1.0, relative_fr=1.0)
            return out
        labels = self.trainer.labels()
        if st.served_params is None or st.baseline_params is None or labels.size == 0:
            return out
        from wakefl.sdk.wake_metrics import relative_fa_fr

        pos, neg = labels == 1, labels == 0
        if not pos.any() or not neg.any():
            return out
        base, srv = self.trainer.scores(st.baseline_params), self.trainer.scores(st.served_params)
        try:
            res = relative_fa_fr(base[pos], base[neg], srv[pos], srv[neg], self.target_fr)
        except (WakeflError, ValueError) as exc:
            log.warning("no relative FA/FR for the served model: %s", exc)
            return out
        out.update(json_safe({"relative_fa": res.relative_fa, "relative_fr": res.relative_fr}))
        return out


# ----------------------------------------------------------------------------- the model
def served_params(st: DeviceState) -> Tensor | None:
    """The parameters the device serves: the gate's choice, or the baseline before any
    decision (None before the first round)."""
    return st.served_params if st.served_params is not None else st.baseline_params


def model_of(st: DeviceState, params: Tensor | None, what: str) -> Any:
    """`params` in the state's model as an eval-mode `KwsCnn` (ConfigError before the
    first round)."""
    from wakefl.models.kws_cnn import KwsCnn, ModelConfig, set_flat_params

    if params is None or st.model_config is None:
        raise ConfigError(
            f"device {st.device_id} has no {what} yet: it has not taken part in a round"
        )
    model = KwsCnn(ModelConfig.from_dict(st.model_config))
    set_flat_params(model, params)
    model.eval()
    return model


def save_checkpoint(model: Any, path: str | Path) -> Path:
    """A safetensors checkpoint (+ JSON config) of `model`."""
    from wakefl.models.kws_cnn import save_model

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_model(model, path)
    return path


def save_onnx(
    model: Any, path: str | Path, int8: bool = False, operating_point: Any = None
) -> Path:
    """`model` as ONNX for the edge runtime (log-mel in, probability out), written to a
    temp name and renamed, so a detector that reloads the file never sees half of it.
    `operating_point` (models.kws_cnn.operating_point) goes into its metadata."""
    from wakefl.models.kws_cnn import export_onnx

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    export_onnx(model, tmp, int8=int8, operating_point=operating_point)
    os.replace(tmp, path)
    return path


def served_operating_point(st: DeviceState) -> Any:
    """The threshold the served model is exported with: a shipped model's own when it is
    one (the baseline before any switch, when the fleet started from a shipped model);
    else the baseline's shipped threshold, with a note that the served model was not tuned
    for it; None when the baseline is no shipped model."""
    from wakefl.models.kws_cnn.operating_point import for_model

    served = model_of(st, served_params(st), "served model")
    baseline = (
        model_of(st, st.baseline_params, "baseline") if st.baseline_params is not None else None
    )
    what = f"the served {st.served_name or 'baseline'} model (round {st.served_round})"
    return for_model(served, baseline, what)


class ModelAccess:
    """The personalized and served models of a device whose `state` is a `DeviceState`
    (mixed into `DeviceClient`)."""

    state: DeviceState

    def personal_params(self) -> Tensor | None:
        """The latest personalized model as a flat vector (None before any round); what
        the device serves is `served_params`."""
        return self.state.personal_params

    def personal_model(self) -> Any:
        """The latest personalized model as a `KwsCnn` (ConfigError before a round)."""
        return model_of(self.state, self.state.personal_params, "personal model")

    def served_params(self) -> Tensor | None:
        """The model the device serves, the gate's choice (None before any round)."""
        return served_params(self.state)

    def served_model(self) -> Any:
        """The served model as a `KwsCnn` (ConfigError before the first round)."""
        return model_of(self.state, self.served_params(), "served model")

    def export_personal_model(self, path: str | Path) -> Path:
        """Write the personalized model as a safetensors checkpoint (+ JSON config)."""
        return save_checkpoint(self.personal_model(), path)

    def export_served_model(self, path: str | Path) -> Path:
        """Write the served model as a safetensors checkpoint (+ JSON config)."""
        return save_checkpoint(self.served_model(), path)

    def export_onnx(self, path: str | Path, int8: bool = False) -> Path:
        """Hand the served model to the edge runtime: an ONNX file (log-mel in,
        probability out) that `wakefl.edge_runtime.OnnxScorer` loads, written atomically.
        Its metadata carries the threshold to run it at (`served_operating_point`)."""
        point = served_operating_point(self.state)
        if point is None:
            log.warning(
                "the served model is exported without a threshold: its baseline is "
                "no shipped model, so detectors fall back to 0.5"
            )
        return save_onnx(self.served_model(), path, int8=int8, operating_point=point)


__all__ = [
    "ModelAccess",
    "CANDIDATES",
    "ServingGate",
    "model_of",
    "save_checkpoint",
    "save_onnx",
    "served_operating_point",
    "served_params",
]
