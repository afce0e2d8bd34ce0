"""The aggregation server's configuration (`ServerConfig`) and what it reports of each
round (`RoundReport`), shared by every server role."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from wakefl.errors import ConfigError
from wakefl.finite import all_finite
from wakefl.protocol import topics
from wakefl.protocol.messages import DEFAULT_MAX_BYTES
from wakefl.protocol.round_settings import RoundSettings, SettingsError
from wakefl.protocol.update_codec import CODECS
from wakefl.sdk.selffl.update_screening import ScreeningRules


@dataclass
class ServerConfig:
    broker_url: str
    state_dir: Path
    initial_params: Tensor
    model_config: dict[str, Any] = field(default_factory=dict)
    fleet: str = topics.DEFAULT_FLEET
    rounds: int = 10
    activity_rate: float = 1.0
    min_clients: int | None = None  # quorum; default: every sampled device
    round_timeout: float = 600.0
    devices: dict[str, str] | None = None  # static registry id -> type; None: Hello registers
    strategy_name: str = "selffl"
    strategy_args: dict[str, Any] = field(default_factory=dict)
    wire_dtype: str = "fp32"  # the downlink's tensors (and plain uplinks, by default)
    # What devices send (announced in the downlink; protocol/update_codec.py): "" = plain in
    # wire_dtype, or fp32 / fp16 / fp16-delta / int8-delta. Any known codec is accepted.
    uplink_codec: str = ""
    max_bytes: int = DEFAULT_MAX_BYTES
    ack_timeout_s: float = 30.0
    start_timeout: float | None = None  # give up waiting for devices (None: wait forever)
    # A static registry without min_clients waits this long for every device before the
    # first round, then starts with those online (None: min(round_timeout, 60 s)).
    start_grace_s: float | None = None
    screening: ScreeningRules = field(default_factory=ScreeningRules)
    keep_update_rounds: int = 2  # tensor files of older rounds are deleted after aggregation
    seed: int = 0

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir)
        topics.check_name(self.fleet, "fleet")
        if not 0.0 < self.activity_rate <= 1.0:
            raise ConfigError(f"activity rate must be in (0, 1], got {self.activity_rate}")
        if self.rounds < 0 or self.round_timeout <= 0:
            raise ConfigError("rounds must be >= 0 and the round timeout > 0")
        if self.min_clients is not None and self.min_clients < 1:
            raise ConfigError("--min-clients must be >= 1")
        if self.start_grace_s is not None and self.start_grace_s < 0:
            raise ConfigError("the start grace period must be >= 0 s")
        if self.uplink_codec not in ("", *CODECS):
            raise ConfigError(f"uplink codec must be one of {CODECS}, got {self.uplink_codec!r}")
        if self.initial_params.dim() != 1 or not all_finite(self.initial_params):
            raise ConfigError("initial parameters must be a finite flat vector")
        try:
            self.round_settings()
        except SettingsError as exc:
            raise ConfigError(f"the round settings devices would get are refused: {exc}") from None

    def round_settings(self) -> RoundSettings:
        """What every downlink of the run announces (docs/PROTOCOL.md, "Downlink")."""
        return RoundSettings(
            strategy=self.strategy_name,
            strategy_args=self.strategy_args,
            ack_timeout_s=self.ack_timeout_s,
            wire_dtype=self.wire_dtype,
            uplink_codec=self.uplink_codec or self.wire_dtype,
            rounds=self.rounds,
        )


@dataclass
class RoundReport:
    round_id: int
    sampled: list[str]
    reported: dict[str, dict[str, float]]  # device -> its uplink record and num_samples
    state_summary: str  # the strategy's figures of the new state (Strategy.describe_server)
    wall_s: float
    closed_by: str  # "all" (every sampled device answered or declined), "quorum", "deadline"
    # Where the wall time went: waiting for devices to come online (the start grace, or
    # --min-clients), opening (sampling, downlink encode and publish), collecting (until
    # the round closed), aggregating plus persisting the new state.
    phases_s: dict[str, float] = field(default_factory=dict)
    declined: dict[str, str] = field(default_factory=dict)  # device -> its reason
    screened: dict[str, str] = field(default_factory=dict)  # device -> clipped / refused, why

    def time_words(self) -> str:
        """The round's time for its closing line, the wait for devices apart: a first round
        that waited out the start grace would otherwise look slow for a quick training."""
        waited = self.phases_s.get("wait", 0.0)
        if waited < 0.05:
            return f"in {self.wall_s:.2f} s"
        return (
            f"in {self.wall_s - waited:.2f} s, after waiting {waited:.1f} s for devices "
            "to come online"
        )
