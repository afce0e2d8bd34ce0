"""wakefl: on-device wake-word personalization with Self-FL."""

__version__ = "0.1.0"
