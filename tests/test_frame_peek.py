"""The frame's fields read without decoding (protocol/frames.py `peek`) and the metadata of
the project's other safetensors files (`body_metadata`): the same header reader and bounds
as the decoder, on real encoded messages and on broken ones."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save as st_save

from wakefl.errors import ConfigError
from wakefl.protocol import frames
from wakefl.protocol import messages as M
from wakefl.protocol.round_settings import RoundSettings
from wakefl.sdk.selffl.strategy import ServerState
from wakefl.server.recorded_updates import server_state_from_bytes, server_state_to_bytes
from wakefl.server.shard_tasks import ShardResult


def _downlink(final: bool = False) -> bytes:
    down = M.Downlink(
        fleet="f1",
        run_id="run1",
        round_id=4,
        global_params=torch.arange(8.0),
        model_config={},
        instructions={"dev-a": {"sigma0_sq": 0.5}},
        settings=RoundSettings(),
        deadline=1.7e9,
        final=final,
    )
    return M.encode(down)


def test_peek_reads_the_fields_the_decoder_reads() -> None:
    frame = _downlink()
    fields = frames.peek(frame)
    decoded = M.decode_as(frame, M.Downlink)
    assert fields["round_id"] == decoded.round_id == 4
    assert fields["instructions"] == {"dev-a": {"sigma0_sq": 0.5}}
    assert fields["final"] is False and frames.peek(_downlink(final=True))["final"] is True


def _with_header_length(frame: bytes, hlen: int) -> bytes:
    at = frames.PREFIX_LEN
    return frame[:at] + hlen.to_bytes(8, "little") + frame[at + 8 :]


@pytest.mark.parametrize(
    ("mangle", "words"),
    [
        (lambda f: b"XXXX" + f[4:], "not a wakefl frame"),
        (lambda f: f[: frames.PREFIX_LEN - 1], "not a wakefl frame"),
        (lambda f: f[: frames.PREFIX_LEN + 5], "shorter than a safetensors header"),
        # A header length past the bound is refused before anything is read or allocated.
        (lambda f: _with_header_length(f, frames.MAX_HEADER_BYTES + 1), "out of bounds"),
        (lambda f: _with_header_length(f, len(f)), "out of bounds"),
        (lambda f: f[: frames.PREFIX_LEN + 20], "out of bounds"),
    ],
)
def test_peek_refuses_what_the_decoder_refuses(mangle, words: str) -> None:
    frame = mangle(_downlink())
    with pytest.raises(frames.FrameError, match=words) as info:
        frames.peek(frame)
    assert info.value.reason == "malformed"
    with pytest.raises(M.MessageRejected):
        M.decode(frame)


def test_peek_reads_the_message_key_only() -> None:
    body = st_save({"x": torch.zeros(2)}, metadata={"other": json.dumps({"a": 1})})
    with pytest.raises(frames.FrameError, match="no wakefl metadata"):
        frames.peek(frames.seal(body))
    assert frames.body_metadata(body, "other") == {"a": 1}


def test_the_server_state_file_round_trips_through_body_metadata() -> None:
    state = ServerState(
        round_id=7,
        global_params=torch.linspace(-1, 1, 5),
        tensors={"v": torch.ones(5)},
        scalars={"sigma0_sq": 0.5},
        clients={"dev-a": {"sigma_sq": 0.25}},
    )
    back = server_state_from_bytes(server_state_to_bytes(state))
    assert back.round_id == 7 and back.scalars == state.scalars and back.clients == state.clients
    assert torch.equal(back.global_params, state.global_params)
    with pytest.raises(frames.FrameError, match="out of bounds"):
        server_state_from_bytes((1 << 40).to_bytes(8, "little") + b"{}")


def test_a_shard_result_with_a_bad_header_is_one_config_error() -> None:
    good = ShardResult("t1", "w1", [1.0, 2.0]).encode()
    assert ShardResult.decode(good).norms == [1.0, 2.0]
    with pytest.raises(ConfigError, match="malformed shard result"):
        ShardResult.decode((1 << 40).to_bytes(8, "little") + good[8:])
