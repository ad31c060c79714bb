"""Byte layout of the control block at the start of every rank's arena (int32 words), and the
bits of a call record's flags.

Kernels (language/primitives.py) and the host (runtime/heap.py) both read these numbers; they
live here once. All words are int32 and compared with wrap-around arithmetic.
"""
from __future__ import annotations

CTRL_WORDS = 4096            # 16 KiB control block
CTRL_BYTES = CTRL_WORDS * 4

CALL = 0                     # this rank's call number on the heap: the last call an opening launch began
ARRIVALS = 1                 # programs of the current launch that have finished
TASKS = 2                    # next ticket of the launch's ordered task queue
TASKS_B = 3                  # next ticket of the compute queue when a launch splits roles
ROLES = 4                    # programs of the current launch that have taken a role (role split)
GO = 5                       # the last call whose opening found every rank in step and none flagged
RESYNC = 6                   # opening launch: calls a peer was ahead by, less one (call_end moves CALL on)
NO_GO = 7                    # opening launch: 1 if a program found a peer missing, out of step or flagged
ABORT = 8                    # a wait of the current launch timed out: its other waits give up (call_end clears)
ERR_FLAG = 16                # 0 = fine, 1 = a bounded wait timed out (the host reads and clears it)
ERR_RANK = 17
ERR_STAGE = 18
ERR_SIGNAL = 19              # for opening stages: the rank waited for
ERR_OBSERVED = 20
ERR_EXPECTED = 21            # for opening stages: the call number
FAIL_FLAGS = 23              # barrier-opened call that did not go: FLAG_* bits seen (the host reads and clears)
FAIL_RANK = 24               # 1 + the lowest rank whose record stopped it
FAIL_CALL = 25               # this rank's call number then
FAIL_PEER_CALL = 26          # that rank's call number then
BARRIER = 512                # BARRIER + p: call number at which rank p last entered a barrier-opened call
MAX_WORLD = 512
RECORD = 2048                # RECORD + (c & 1) * 2 * MAX_WORLD + 2 * p: rank p's (flags, call number) of a
                             # barrier-opened call c (the call number says the rank entered that call)
HOST_WORDS = 32              # words the host reads for errors: [0, HOST_WORDS)

# Flags of a call record (the counts exchange and barrier-opened calls carry them).
FLAG_BAD_EXPERT = 1          # an expert id outside [-1, E) (offending slots dropped)
FLAG_TOO_MANY_TOKENS = 2     # T > max_tokens_per_rank (tokens past it dropped)
FLAG_GAVE_UP = 4             # the rank timed out waiting for a peer in this call and left it
FLAG_REFUSED = 8             # the rank rejected its own arguments (it joined the call only to say so)
FLAG_REBUILD = 16            # the rank's request needs another buffer (functional forms rebuild it)
FLAG_OUT_OF_STEP = 32        # set by the reader: the rank's call number differs from the reader's
FLAG_MISSING = 64            # set by the reader: the rank did not arrive within the bounded wait
FLAG_UNREAD = 128            # the rank holds an error of an earlier call that its host has not raised yet
FLAG_TOO_MANY_ROWS = 256     # graph mode: a dispatch received more rows than its max_recv_rows (the rest dropped)
# Mode bits of a barrier-opened call's record: how the caller asked the call to run, where both
# ends of a transfer must agree (combine's topk_sum and partial dtype). Not problems by themselves:
# a reader whose own mode bits differ sets FLAG_MODE_MISMATCH on that peer.
FLAG_MODE_RANK_REDUCED = 512  # combine(topk_sum="expert_rank")
FLAG_MODE_FP32_PARTIALS = 1024  # ... with partial_dtype=torch.float32
FLAG_MODE_TOKEN_ROWS = 2048  # the backward of a token-major dispatch: one row per (token, rank) returns
MODE_FLAGS = FLAG_MODE_RANK_REDUCED | FLAG_MODE_FP32_PARTIALS | FLAG_MODE_TOKEN_ROWS
FLAG_MODE_MISMATCH = 4096    # set by the reader: the rank's mode bits differ from the reader's
# Any of these stops the call on every rank (nothing moves); the others only drop slots/tokens.
STOP_FLAGS = (FLAG_GAVE_UP | FLAG_REFUSED | FLAG_REBUILD | FLAG_OUT_OF_STEP | FLAG_MISSING | FLAG_UNREAD
              | FLAG_MODE_MISMATCH)

ALIGN = 256                  # every allocation starts on a 256-byte boundary
ARENA_ALIGN = 16             # kernels assume (tl.multiple_of) every arena base is 16-byte aligned


def record_slot(call: int) -> int:
    """First word of the RECORD slot of barrier-opened call `call` (two slots, by its parity; two
    words per rank); language/primitives.record_slot is the kernels' copy of this rule."""
    return RECORD + (call & 1) * 2 * MAX_WORLD


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def to_int32(v: int) -> int:
    """Wrap a Python int into the signed int32 range (call numbers wrap around)."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= (1 << 31) else v
