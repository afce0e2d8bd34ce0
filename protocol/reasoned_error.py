"""The base of the protocol's refusals: an error that carries a wire reject code (`reason`,
docs/PROTOCOL.md) and what was wrong (`detail`), so that every layer (frames, codecs,
records, round settings, messages) refuses in the one form the server counts and acks."""

from __future__ import annotations


class ReasonedError(Exception):
    """`str()` is "reason: detail"; combined with the exception type a caller expects
    (ValueError, ProtocolError) by the subclasses."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
