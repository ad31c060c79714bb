"""Arena providers for the symmetric heap: each maps one byte arena per rank and reports the
address of every peer's arena as seen from this process."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Arena:
    """One rank's symmetric arena and the peer base addresses as seen from this process."""

    local: torch.Tensor          # uint8 [size_bytes], this rank's arena
    peer_bases: list[int]        # address of rank p's arena in this process, p = 0..W-1
    release: Callable[[], None]  # frees what the backend holds (idempotent)
    peer_views: list[torch.Tensor] | None = None  # host views of peer arenas (emulated only)
