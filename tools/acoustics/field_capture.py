"""The second, held-out acoustic simulation (tools/acoustics/field_acoustics.py) as a corpus
build's acoustics step (`CorpusProfile.acoustics = "field"`, registered in
tools/corpus/build.py's ACOUSTICS): each device type A-E stands in image-source rooms of
its field device and records through that device's front end (band, input level, noise
suppression, AGC, clipping, the mu-law link with packet loss, the converter's bit depth).
The corpus recipe (who says what, the background and its SNR) stays the build's; only
the rooms and the capture chain are the field simulation's.

Rooms draw from a generator key of their own (FLEET_ROOMS), apart from the held-out
add-on's rooms and from the training augmentation's, so no corpus repeats another's room.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from wakefl.tools.acoustics.field_acoustics import (
    FIELD_DEVICES,
    front_end,
    image_source_room,
    to_level,
)

# Generator key of the rooms (field_acoustics.HELD_OUT_ROOMS is 7101, TRAINING_ROOMS 7202).
FLEET_ROOMS = 7303
_DEVICE_INDEX = {name: i for i, name in enumerate(FIELD_DEVICES)}


class FieldAcoustics:
    """The field devices' rooms and front ends, under the device types' names."""

    def room(self, seed: int, device: str, index: int) -> np.ndarray:
        """The talker-to-microphone response of room `index` of `device`'s field device
        (an image-source room: about a second to simulate)."""
        dev = FIELD_DEVICES[device]
        rng = np.random.default_rng([seed, _DEVICE_INDEX[device], FLEET_ROOMS, index])
        return image_source_room(rng, dev.rt60_s, dev.distance_m).speech_rir

    def capture(self, rng: np.random.Generator, device: str, field_: np.ndarray) -> np.ndarray:
        """What `device`'s field device records of the sound field: brought to a 0 dBFS
        active level, then through its front end at an input level drawn from its range."""
        dev = FIELD_DEVICES[device]
        level = float(rng.uniform(*dev.level_db))
        return front_end(
            rng, dev, to_level(np.asarray(field_, dtype=np.float64), 0.0, active=True), level
        )


class FieldForSome:
    """The field simulation for the device types in `field_types`, `others` for the rest:
    a fleet where some device types are hardware that training never simulated."""

    def __init__(self, field_types: frozenset[str], others: Any) -> None:
        self.field_types = field_types
        self.field = FieldAcoustics()
        self.others = others

    def _for(self, device: str) -> Any:
        return self.field if device in self.field_types else self.others

    def room(self, seed: int, device: str, index: int) -> np.ndarray:
        return self._for(device).room(seed, device, index)

    def capture(self, rng: np.random.Generator, device: str, field_: np.ndarray) -> np.ndarray:
        return self._for(device).capture(rng, device, field_)
