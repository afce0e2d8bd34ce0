"""A device's local work in one round: build the model and the strategy the server
announces, run the strategy's `client_update` on the local data, score the new personal
model and the baseline on the validation set (relative FA/FR at matched FR), and fold it
all into the device's state as the round's commit (the caller saves it).

The baseline for relative FA/FR is the first global model the device receives in a run
(round 1's global model is the warm-start model; a device that joins later takes the
global model of the round it joined in and says so in `baseline_round`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import zlib
from collections import OrderedDict
from typing import Any, TypeGuard, cast

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from wakefl.errors import ConfigError, ProtocolError, WakeflError
from wakefl.protocol import messages
from wakefl.protocol.records import RecordError, check_record
from wakefl.sdk.device_state import DeviceState, PendingUpdate
from wakefl.sdk.local_training import dataset_size
from wakefl.sdk.selffl.strategy import ClientInstructions, ClientState, LocalProblem, Strategy

log = logging.getLogger("wakefl.device")


def looks_like_problem(obj: Any) -> TypeGuard[LocalProblem]:
    return isinstance(obj, LocalProblem) and not isinstance(obj, Dataset)


def round_generator(seed: int, device_id: str, round_id: int) -> torch.Generator:
    """The minibatch generator of one round: the same (seed, device, round) draws the same
    batches, different devices different ones."""
    mix = zlib.crc32(f"{seed}:{device_id}:{round_id}".encode())
    return torch.Generator().manual_seed(mix)


def personal_model(state: DeviceState) -> Any:
    """The state's personal model as a `KwsCnn` (ConfigError before the first round)."""
    from wakefl.models.kws_cnn import KwsCnn, ModelConfig, set_flat_params

    if state.personal_params is None or state.model_config is None:
        raise ConfigError(
            f"device {state.device_id} has no personal model yet: it has not taken part in a round"
        )
    model = KwsCnn(ModelConfig.from_dict(state.model_config))
    set_flat_params(model, state.personal_params)
    model.eval()
    return model


class RoundTrainer:
    """The model, strategy and local problem of one device, kept across rounds while the
    server's announcement does not change them."""

    def __init__(
        self,
        train: Dataset | LocalProblem,
        validation: Dataset | None,
        *,
        device_id: str,
        seed: int,
        target_fr: float,
        eval_batch_size: int,
        expected_width: float | None,
    ) -> None:
        self.train_data = train
        self.validation = validation
        self.device_id = device_id
        self.seed = seed
        self.target_fr = target_fr
        self.eval_batch_size = eval_batch_size
        self.expected_width = expected_width
        self._model: Any = None
        self._model_key: str | None = None
        self._problem: LocalProblem | None = train if looks_like_problem(train) else None
        self._strategy: Strategy | None = None
        self._strategy_key: str | None = None
        # Validation scores by parameter digest: the baseline, served, personal and global
        # models are scored once each, however often the gate and the report ask.
        self._scores: OrderedDict[str, np.ndarray] = OrderedDict()
        self._labels: np.ndarray | None = None
        self._note: tuple[int, str] | None = None  # the last trained round's ClientResult.note

    @property
    def num_samples(self) -> int:
        if self._problem is not None:
            return int(self._problem.num_samples)
        return dataset_size(self.train_data)  # type: ignore[arg-type]

    def describe(self, record: dict[str, float], round_id: int | None = None) -> str:
        """An uplink record for a progress line, in the running strategy's words, with the
        strategy's note on round `round_id` when this process trained it (why this many
        local steps, for Self-FL)."""
        if self._strategy is not None:
            words = self._strategy.describe_result(record)
        else:
            words = ", ".join(f"{k}={v:.3g}" for k, v in sorted(record.items()))
        if self._note is not None and self._note[0] == round_id and self._note[1]:
            return f"{words} ({self._note[1]})"
        return words

    def replace_data(self, train: Dataset | LocalProblem, validation: Dataset | None) -> None:
        """New local data (enrolment takes joined): the local problem is rebuilt over it,
        and the validation labels and scores are computed afresh."""
        self.train_data, self.validation = train, validation
        self._problem = train if looks_like_problem(train) else None
        self._scores.clear()
        self._labels = None

    def new_run(self) -> None:
        """A new run brings a new baseline (and a new model, maybe)."""
        self._scores.clear()

    # ------------------------------------------------------------------ building
    def _ensure_model(self, model_config: dict[str, Any]) -> Any:
        from wakefl.models.kws_cnn import KwsCnn, ModelConfig

        key = json.dumps(model_config, sort_keys=True)
        if self._model is not None and key == self._model_key:
            return self._model
        cfg = ModelConfig.from_dict(model_config)
        if self.expected_width is not None and not math.isclose(cfg.width, self.expected_width):
            raise ConfigError(
                f"the server runs model width {cfg.width}, this device was "
                f"configured for width {self.expected_width}"
            )
        for name, data in (("training", self.train_data), ("validation", self.validation)):
            window = getattr(data, "window_samples", None)
            if window is not None and int(window) != cfg.window_samples:
                raise ConfigError(
                    f"the {name} data has {window}-sample windows, the server's "
                    f"model expects {cfg.window_samples}"
                )
        self._model = KwsCnn(cfg)
        self._model_key = key
        if not looks_like_problem(self.train_data):
            self._problem = None  # rebuilt over the new model
        return self._model

    def _strategy_for(self, down: messages.Downlink) -> Strategy:
        """The strategy the server runs: `settings.strategy` with `settings.strategy_args`
        (docs/PROTOCOL.md)."""
        from wakefl.sdk.selffl.registry import make_strategy

        name, args = down.settings.strategy, dict(down.settings.strategy_args)
        key = json.dumps([name, args], sort_keys=True, default=str)
        if self._strategy is None or key != self._strategy_key:
            try:
                self._strategy = make_strategy(name, **args)
            except TypeError as exc:
                raise ConfigError(
                    f"strategy {name!r} refuses the server's arguments {args}: {exc}"
                ) from exc
            self._strategy_key = key
        return self._strategy

    def _local_problem(self, strategy: Strategy) -> LocalProblem:
        # The minibatch size is the strategy's B (it enters Self-FL's step-count rule).
        batch = int(getattr(strategy, "batch_size", 16))
        if self._problem is not None and (
            looks_like_problem(self.train_data)
            or getattr(self._problem, "batch_size", batch) == batch
        ):
            return self._problem
        from wakefl.sdk.local_training import TorchLocalProblem

        self._problem = TorchLocalProblem(
            self._model, cast(Dataset, self.train_data), batch_size=batch
        )
        return self._problem

    # ------------------------------------------------------------------ the round
    def train(self, st: DeviceState, down: messages.Downlink) -> None:
        """Train round `down` and commit the result into `st`: new variance state,
        personal model and the update to send, all or nothing (an exception leaves them as
        they were; only a first baseline may have been taken)."""
        model = self._ensure_model(down.model_config)
        strategy = self._strategy_for(down)
        problem = self._local_problem(strategy)
        d = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if down.global_params.numel() != d:
            raise ProtocolError(
                f"the global model has {down.global_params.numel()} parameters, "
                f"the announced model config has {d}"
            )
        if st.baseline_params is None:
            st.baseline_params = down.global_params.clone()
            st.baseline_round = down.round_id
        try:
            scalars = check_record(
                down.instructions.get(self.device_id, {}), strategy.downlink_schema, "instructions"
            )
        except RecordError as exc:
            raise ConfigError(
                f"the server's instructions do not fit strategy {strategy.name} "
                f"as this device knows it: {exc}"
            ) from None
        instructions = ClientInstructions(
            client_id=self.device_id,
            round_id=down.round_id,
            global_params=down.global_params,
            scalars=scalars,
            tensors=dict(down.tensors),
        )
        result, new_client = strategy.client_update(
            instructions,
            st.client,
            problem,
            round_generator(self.seed, self.device_id, down.round_id),
        )
        self._note = (down.round_id, result.note)
        personal = new_client.tensors.get("personal", result.params)
        report = self.relative_report(personal, st)
        st.client = ClientState(tensors=dict(new_client.tensors), scalars=dict(new_client.scalars))
        st.personal_params = personal
        st.model_config = dict(down.model_config)
        st.participations += 1
        st.last_trained_round = down.round_id
        st.pending = PendingUpdate(
            round_id=down.round_id,
            num_samples=int(result.num_samples),
            scalars=dict(result.scalars),
            tensors={"params": result.params, **result.tensors},
            report=report,
            wire_dtype=down.settings.wire_dtype,
        )

    # ------------------------------------------------------------------ validation
    def has_validation(self) -> bool:
        return self.validation is not None and dataset_size(self.validation) > 0

    def labels(self) -> np.ndarray:
        """The validation clips' labels (1 = wake word; empty without validation clips)."""
        if not self.has_validation():
            return np.zeros(0, dtype=np.int64)
        if self._labels is None:
            assert self.validation is not None
            labels = getattr(self.validation, "labels", None)
            if labels is None:
                labels = [int(self.validation[i][1]) for i in range(dataset_size(self.validation))]
            self._labels = np.asarray(labels, dtype=np.int64)
        return self._labels

    def units(self) -> list[str] | None:
        """Each validation clip's speaker (the gate's bootstrap unit), when the data says."""
        rows = getattr(self.validation, "rows", None)
        speakers = [getattr(r, "speaker", None) for r in rows] if rows is not None else []
        if not speakers or any(not sp for sp in speakers):
            return None
        return [str(sp) for sp in speakers]

    def scores(self, params: Tensor) -> np.ndarray:
        """The model with `params` scored on the validation clips (the round's model must
        be built: `train` builds it)."""
        from wakefl.sdk.local_training import load_flat_trainable, predict_scores

        assert self.validation is not None and self._model is not None
        flat = params.detach().to("cpu").contiguous()
        key = hashlib.sha256(flat.numpy().tobytes()).hexdigest() + str(flat.dtype)
        if key in self._scores:
            self._scores.move_to_end(key)
            return self._scores[key]
        load_flat_trainable(self._model, flat)
        out = predict_scores(self._model, self.validation, batch_size=self.eval_batch_size)
        self._scores[key] = out
        while len(self._scores) > 6:
            self._scores.popitem(last=False)
        return out

    def relative_report(self, personal: Tensor, st: DeviceState) -> dict[str, Any]:
        """Local relative FA/FR of the personal model against the baseline on the
        validation set, at the baseline's operating point (target FR) and matched FR."""
        if not self.has_validation():
            return {}
        from wakefl.sdk.wake_metrics import local_relative_report

        assert st.baseline_params is not None
        base, cand = self.scores(st.baseline_params), self.scores(personal)
        try:
            rep = local_relative_report(base, cand, self.labels(), target_fr=self.target_fr)
        except (WakeflError, ValueError) as exc:
            log.warning("no relative FA/FR this round: %s", exc)
            return {"error": str(exc)}
        return _json_safe(rep)


def _json_safe(value: Any) -> Any:
    """The report as plain JSON values; non-finite numbers become None."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float | np.integer | np.floating):
        v = float(value)
        return v if math.isfinite(v) else None
    return str(value)


def json_safe(value: Any) -> Any:
    """`value` as plain JSON values (non-finite numbers become None)."""
    return _json_safe(value)


__all__ = ["RoundTrainer", "json_safe", "looks_like_problem", "personal_model", "round_generator"]
