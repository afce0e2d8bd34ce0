"""The names of the update codecs and wire dtypes, without torch: what a command line offers
and a config file may name (the codecs themselves: protocol/update_codec.py)."""

from __future__ import annotations

PLAIN_CODECS = ("fp32", "fp16")  # the parameters themselves, in this dtype
DELTA_CODECS = ("fp16-delta", "int8-delta")  # the update relative to the round's model
CODECS = PLAIN_CODECS + DELTA_CODECS
WIRE_DTYPE_NAMES = PLAIN_CODECS  # tensor dtypes of the downlink (protocol/messages.py)
# Tensor names inside a frame, per delta codec (the frame prefixes them with "params.").
CODEC_TENSORS = {"fp16-delta": ("delta",), "int8-delta": ("q", "scale")}
