"""How a kernel's data reaches each peer: the Device-level transport choice.

`pointer`: the sender stores into the peer's arena through the peer pointer table and stamps the
peer's signal with a release atomic (every backend; intranode). `put`: NVSHMEM put-with-signal from
the sender's memory into the peer's symmetric arena, the signal delivered after the data (the
nvshmem backend only; what reaches a peer without a load/store mapping, e.g. on another node).
The choice is per peer, as a bit mask (bit p set: put to rank p), so one launch can mix both.
Either way the receiver waits on its own signal word with the same bounded wait, and the bytes
that land are the same, so results are bitwise equal between transports. The dispatch puts from
a symmetric send area; the combine's exact mode puts each (token, k) row straight from the
caller's `y` (its rank-reduced mode from a send area): fine over NVLink (NVSHMEM's P2P transport),
but NVSHMEM's remote (IB) transports need sources on the symmetric heap or registered — one of the
steps inter-node EP still needs (docs/design.md), with one signal per task (every thread signals
today: idempotent over NVLink, W remote atomics per task over IB).
"""
from __future__ import annotations

from ditron_ep.runtime.errors import DitronConfigError

TRANSPORTS = ("auto", "pointer", "put")
MAX_PUT_WORLD = 31  # the per-peer mask travels as an int32 kernel argument


def transport_problem(transport: object, backend: object, world: int) -> str | None:
    """Why `transport` cannot serve a heap of `backend` over `world` ranks (None: it can): the
    argument check of every op that takes a transport (EPBuffer, FusedMoE), before any heap."""
    if transport not in TRANSPORTS:
        return f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}"
    if transport == "put":
        if backend != "nvshmem":
            return (f"transport='put' (NVSHMEM put-with-signal) needs backend='nvshmem', got backend={backend!r}; "
                    f"or use transport='pointer'")
        if world > MAX_PUT_WORLD:
            return (f"transport='put' supports groups of up to {MAX_PUT_WORLD} ranks (a per-peer bit mask in one "
                    f"int32); this group has {world}. Use transport='pointer'")
    return None


def put_peer_mask(heap, transport: str) -> int:
    """Bit mask of the peers this rank reaches by put (0: pointers everywhere).

    "auto": pointers to every peer the heap maps (the nvshmem arena maps every peer, or its
    creation raised), so puts only where forced; "put": every peer, itself included (checks the
    put path on one node); "pointer": none.
    """
    if transport not in TRANSPORTS:
        raise DitronConfigError(f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
    if transport != "put":
        return 0
    if heap.backend != "nvshmem":
        raise DitronConfigError(
            f"transport='put' needs NVSHMEM's put-with-signal: build the heap (or buffer) with backend='nvshmem' "
            f"(this one is {heap.backend!r}), or use transport='pointer'")
    if heap.world_size > MAX_PUT_WORLD:
        raise DitronConfigError(f"transport='put' supports groups of up to {MAX_PUT_WORLD} ranks (a per-peer bit mask "
                                f"in one int32); this heap has {heap.world_size}. Use transport='pointer'")
    return (1 << heap.world_size) - 1


def put_signal_words(heap, name: str, count: int) -> int:
    """First of `count` uint64 put signals under `name` (two int32 words each, 8-byte aligned):
    NVSHMEM signals are 64-bit; the bounded wait reads the low word."""
    first = heap.alloc_signals(name, 2 * count + 1)
    return first + (first & 1)


def kernel_signals(heap, name: str, count: int, put_peers: int) -> int:
    """First of a kernel family's `count` signals under `name`: uint64 put signals when any peer is
    reached by put (`put_signal_words`), else int32 words."""
    return put_signal_words(heap, name, count) if put_peers else heap.alloc_signals(name, count)
