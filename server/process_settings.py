"""How a server process is set up to handle model-sized updates on its threads:
`apply_server_settings` is called once by every server role's entry point.

**Freed heap is kept** (glibc's malloc, set through `mallopt`).

Every uplink passes through buffers of its own size: paho's receive buffer, the publish
payload it slices from it, the decoded float32 vector, the float64 chunks. By default glibc
serves a block of more than 128 KiB (a threshold that then adapts, up to 32 MiB) with a fresh
`mmap` and returns it to the kernel on `free`, so each 3 MB buffer costs its pages' faults
and zeroing again on first touch: about 2 ms of an int8-delta update's 25 ms
(docs/SCALE.md, "Server CPU per update"). With a fixed threshold above any buffer of the
protocol and a trim threshold above the round's working set, freed blocks stay in the
process and the next update's buffers reuse them.

The cost is memory that the process keeps once it has used it: at most `trim_bytes` of
free heap on top of its peak, a bounded amount for a server that holds a few model-sized
vectors. Other C libraries (musl, macOS) have no `mallopt`: nothing is changed there.

**The GIL changes hands sooner.** Paho's network thread (reading, hashing and checking
uplinks) and the recorder thread (writing them, folding them into the round's receipts)
both spend most of an update in C code that releases the GIL, and take it back between
steps: up to 5 ms each time (CPython's default switch interval) when the other thread is
running Python. At 0.5 ms the two overlap instead of taking turns: a 50-device round's
median fell from 1.33-1.38 s to 1.16 s on 2 cores (docs/SCALE.md, "Server CPU per update").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger("wakefl.server")

# glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# Above the largest buffer of a full-size model's update (the float32 vector, 11.7 MB; a
# 23 MB float64 copy where a strategy widens a whole vector), within what glibc accepts for
# the mmap threshold (HEAP_MAX_SIZE / 2 = 32 MiB on 64-bit).
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 256 * 1024 * 1024
GIL_SWITCH_S = 0.0005


def keep_freed_heap(
    mmap_bytes: int = MMAP_THRESHOLD_BYTES, trim_bytes: int = TRIM_THRESHOLD_BYTES
) -> bool:
    """Serve blocks below `mmap_bytes` from the heap and keep up to `trim_bytes` of freed
    heap in the process (this process, every thread). True when glibc took both settings;
    False where the C library has no `mallopt` or refused a value."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    took = (
        mallopt(_M_MMAP_THRESHOLD, mmap_bytes) == 1 and mallopt(_M_TRIM_THRESHOLD, trim_bytes) == 1
    )
    if not took:
        log.warning("malloc kept its defaults: mallopt refused the heap settings")
    return took


def apply_server_settings() -> dict[str, object]:
    """Both settings of this module, for this process; what was set."""
    sys.setswitchinterval(GIL_SWITCH_S)
    return {"keep_freed_heap": keep_freed_heap(), "gil_switch_s": sys.getswitchinterval()}
