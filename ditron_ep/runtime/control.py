"""Byte layout of the control block at the start of every rank's arena (int32 words).

Kernels (language/primitives.py) and the host (runtime/heap.py) both read these numbers; they
live here once. All words are int32 and compared with wrap-around arithmetic.
"""
from __future__ import annotations

CTRL_WORDS = 2048            # 8 KiB control block
CTRL_BYTES = CTRL_WORDS * 4

EPOCH = 0                    # call counter, advanced by the last program of every launch
ARRIVALS = 1                 # programs of the current launch that have finished
TASKS = 2                    # next ticket of the launch's ordered task queue
TASKS_B = 3                  # next ticket of the compute queue when a launch splits roles
ROLES = 4                    # programs of the current launch that have taken a role (role split)
LAYOUT_SEQ = 5               # layout counts exchanges so far: its parity picks the landing half
ERR_FLAG = 16                # 0 = fine, 1 = a bounded wait timed out
ERR_RANK = 17
ERR_STAGE = 18
ERR_SIGNAL = 19
ERR_OBSERVED = 20
ERR_EXPECTED = 21
ERR_EPOCH = 22
REFUSAL_SEEN = 23            # 1 + lowest rank whose refusal made this rank skip a call; 0 = none (the host clears it)
REFUSERS_SEEN = 24           # how many ranks refused that call (with REFUSAL_SEEN; the host clears it)
BARRIER = 512                # BARRIER + p: epoch at which rank p last entered the call barrier
MAX_WORLD = 512
REFUSED = 1024               # REFUSED + (e & 1) * MAX_WORLD + p: e when rank p refused call e (ops/ep/refusal_kernels.py)

ALIGN = 256                  # every allocation starts on a 256-byte boundary
ARENA_ALIGN = 16             # kernels assume (tl.multiple_of) every arena base is 16-byte aligned


def refusal_slot(epoch: int) -> int:
    """First word of the REFUSED slot of the call with this epoch (two slots, by its parity);
    language/primitives.refusal_slot is the kernels' copy of this rule."""
    return REFUSED + (epoch & 1) * MAX_WORLD


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def to_int32(v: int) -> int:
    """Wrap a Python int into the signed int32 range (epochs wrap around)."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= (1 << 31) else v
