"""Errors a user can act on. The CLI prints their message and exits non-zero, without a
stack trace; anything else is a bug and keeps its trace."""


class WakeflError(Exception):
    """Base class for errors caused by input, configuration or the environment."""


class AudioError(WakeflError):
    """Audio that cannot be used: missing, corrupt, empty, wrong rate that cannot be fixed."""


class ConfigError(WakeflError):
    """A configuration, checkpoint or manifest that is invalid or inconsistent."""


class NonFiniteError(WakeflError):
    """NaN or Inf where finite numbers are required (parameters, uncertainties)."""


class ProtocolError(WakeflError):
    """A message on the wire that is malformed, hostile or out of protocol."""
