"""Exceptions raised by the runtime. One hierarchy so callers can catch `DitronError`."""
from __future__ import annotations


class DitronError(RuntimeError):
    """Base class of every error ditron_ep raises on purpose."""


class DitronConfigError(DitronError, ValueError):
    """A backend, mode or argument choice that cannot work; the message says what to change."""


class DitronTimeoutError(DitronError):
    """A bounded device-side wait ran out of polls.

    The kernel itself wrote the failing rank, stage and signal into the heap's error slot and
    returned; the host read that slot and raised this. Attributes mirror the slot.
    """

    def __init__(self, message: str, *, rank: int = -1, stage: str = "", signal: int = -1,
                 observed: int = 0, expected: int = 0) -> None:
        super().__init__(message)
        self.rank = rank
        self.stage = stage
        self.signal = signal
        self.observed = observed
        self.expected = expected


class DitronOutOfStepError(DitronError):
    """The ranks' calls on one buffer or layer are out of step: a rank is at another call number
    than a peer, or arrived at a call the peer had given up on (it timed out waiting). Raised
    before any data moves; the next call of every rank meets again (no reset needed)."""


class RankError(DitronError):
    """An emulated rank process failed (exception, crash, kill or host timeout)."""

    def __init__(self, message: str, *, rank: int = -1, remote_type: str = "",
                 remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback
