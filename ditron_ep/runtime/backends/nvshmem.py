"""NVSHMEM backend: the arena is one allocation on NVSHMEM's symmetric heap (nvshmem4py).

NVSHMEM is one instance per process: it is initialised the first time a heap asks for it, from
the heap's torch.distributed group (rank 0 of the group makes the unique id, every rank gets it by
a broadcast), and finalised at exit. It does not re-initialise cleanly after `finalize`, so heaps
are freed and rebuilt on the same instance; a heap over a different group raises. If the
application initialised NVSHMEM through nvshmem4py already, with PEs equal to the group's ranks,
that instance is adopted and left for its owner to finalise; one initialised otherwise (torch's
NVSHMEM symmetric-memory backend) is refused.

The peer pointer table comes from NVSHMEM's peer mapping (`nvshmem_ptr`), so every kernel written
for peer pointers runs unchanged. The symmetric address of the arena (what an NVSHMEM put names
as its destination) is this rank's own base: NVSHMEM allocations have the same offset in every
PE's heap.
"""
from __future__ import annotations

import atexit
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ditron_ep.runtime.agreement import agree
from ditron_ep.runtime.backends import Arena
from ditron_ep.runtime.errors import DitronConfigError

EXTRA = "pip install 'ditron_ep[nvshmem]'"  # -> nvshmem4py-cu13 (see pyproject.toml)
SUPPORTED_NVSHMEM4PY = ("0.4",)               # major.minor series this backend was written for
# The symmetric heap NVSHMEM reserves at init when NVSHMEM_SYMMETRIC_SIZE is not set: the first
# arena plus this much for later ones (NVSHMEM grows the heap past it where CUDA VMM allows).
HEAP_HEADROOM_BYTES = 512 << 20


@dataclass
class _Instance:
    ranks: tuple[int, ...]   # global ranks of the group NVSHMEM was initialised for, in PE order
    owned: bool              # initialised here (finalised at exit) or adopted
    live_arenas: int = 0


_instance: _Instance | None = None


def import_nvshmem():
    """`nvshmem.core`, or a DitronConfigError naming the extra that installs it."""
    try:
        import nvshmem
        import nvshmem.core as core
    except ImportError as err:
        raise DitronConfigError(
            f"backend 'nvshmem' needs nvshmem4py, which is not importable here ({err}); install it with "
            f"{EXTRA} (nvshmem4py-cu13 0.4.x, for CUDA 13), or use backend='torch'") from err
    version = getattr(nvshmem, "__version__", "unknown")
    if not any(version.startswith(v + ".") or version == v for v in SUPPORTED_NVSHMEM4PY):
        raise DitronConfigError(
            f"backend 'nvshmem' supports nvshmem4py {', '.join(v + '.x' for v in SUPPORTED_NVSHMEM4PY)}; "
            f"found {version}. Install a supported version with {EXTRA}")
    return core


def group_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_global_rank(group, r) for r in range(dist.get_world_size(group)))


def check_group(ranks: tuple[int, ...]) -> None:
    """Raise unless NVSHMEM (if initialised) spans exactly these global ranks in this order."""
    if _instance is not None and _instance.ranks != ranks:
        raise DitronConfigError(
            f"NVSHMEM is initialised once per process and this process initialised it for the global "
            f"ranks {list(_instance.ranks)}; a heap over the ranks {list(ranks)} cannot use it. Build every "
            f"nvshmem heap of a process on the same group (or use backend='torch' for the other group)")


def preflight(group: dist.ProcessGroup, rank: int, world_size: int) -> None:
    """This rank's checks before any collective (the heap agrees on every rank's verdict first):
    nvshmem4py importable and supported, NVSHMEM's host library loadable, and an instance, if there
    is one, usable for `group`. Any failure is a DitronConfigError (the heap's agreement carries
    only those to the peers: another exception would leave them waiting)."""
    check_group(group_ranks(group))
    core = import_nvshmem()
    try:
        initialised = _instance is None and _initialised(core)
        if initialised:
            pe, n, ours = core.my_pe(), core.n_pes(), _initialised_by_nvshmem4py()
    except Exception as err:  # e.g. libnvshmem_host not loadable: nvshmem4py dlopens it on first use
        raise DitronConfigError(f"NVSHMEM's host library does not load here ({type(err).__name__}: {err}); "
                                f"install nvidia-nvshmem-cu13 (the nvshmem extra) or use backend='torch'") from err
    if initialised and ((pe, n) != (rank, world_size) or not ours):
        how = "through nvshmem4py" if ours else "not through nvshmem4py (torch symmetric memory's NVSHMEM backend?)"
        raise DitronConfigError(
            f"NVSHMEM was initialised in this process before ditron_ep asked for it, {how}, as PE {pe} of "
            f"{n}; the heap's group has this process as rank {rank} of {world_size}. Use backend='torch', or "
            f"initialise NVSHMEM through nvshmem4py with PEs equal to the group's ranks")


def ensure_initialised(group: dist.ProcessGroup, rank: int, world_size: int, device: torch.device,
                       first_arena_bytes: int) -> None:
    """Collective over `group` (after `preflight` passed on every rank): initialise NVSHMEM for it
    once per process, or adopt the application's nvshmem4py instance (see the module doc)."""
    global _instance
    if _instance is not None:
        return
    core = import_nvshmem()
    ranks = group_ranks(group)
    initialised = _initialised(core)  # on all ranks or on none
    agree(group, "NVSHMEM instance", None, same={"NVSHMEM initialised before": initialised})
    if initialised:  # the application's own nvshmem4py instance, over these ranks (preflight checked)
        _instance = _Instance(ranks, owned=False)
        return
    import numpy as np
    from cuda.core import Device

    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(first_arena_bytes + HEAP_HEADROOM_BYTES))
    # the library never uses NVLink multicast, and on shared hosts multicast objects are unwelcome
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    # rank 0 sends the unique id's raw bytes (what nvshmem4py's own MPI bootstrap sends), or why it has none
    problem = None
    try:
        uid = core.get_unique_id(empty=rank != 0)
        uid_bytes = uid._data.view(np.int8)
    except Exception as err:  # noqa: BLE001 - reported on every rank below
        problem = f"{type(err).__name__}: {err}"
    payload: list[object] = [(problem or uid_bytes.tobytes()) if rank == 0 else None]
    dist.broadcast_object_list(payload, src=ranks[0], group=group)
    if not isinstance(payload[0], bytes):
        problem = f"no unique id from rank 0 ({payload[0]})"
    elif problem is None:
        uid_bytes[:] = np.frombuffer(payload[0], dtype=np.int8)
    agree(group, "NVSHMEM's bootstrap over the heap's group failed", problem)
    try:  # every rank gets here, so none waits alone in NVSHMEM's bootstrap
        cuda_device = Device(device.index if device.index is not None else torch.cuda.current_device())
        cuda_device.set_current()
        core.init(device=cuda_device, uid=uid, rank=rank, nranks=world_size, initializer_method="uid")
    except Exception as err:  # noqa: BLE001 - every rank learns every verdict (a lone raise strands the peers)
        problem = f"{type(err).__name__}: {err}"
    agree(group, "NVSHMEM did not initialise over the heap's group", problem)
    _instance = _Instance(ranks, owned=True)
    atexit.register(_finalize_at_exit)


def _initialised(core) -> bool:
    """Whether NVSHMEM (the library, whoever called its init) is initialised in this process."""
    from nvshmem.bindings import Init_status as S

    return core.init_status() in (S.STATUS_IS_INITIALIZED, S.STATUS_LIMITED_MPG, S.STATUS_FULL_MPG)


def _initialised_by_nvshmem4py() -> bool:
    """nvshmem4py allocates only on an instance its own `init` made (it tracks that itself)."""
    from nvshmem.core import _internal_tracking as tracking

    return tracking._is_initialized.get("status") == tracking.InternalInitStatus.INITIALIZED


def _finalize_at_exit() -> None:
    """Finalise the instance this module made, on a clean exit only: `finalize` frees leftover
    buffers collectively and ends in a barrier, so a rank leaving with heaps still live (an error
    on its way out, a peer gone) would wait there forever. Then the driver reclaims the memory."""
    global _instance
    inst, _instance = _instance, None
    if inst is None or not inst.owned or inst.live_arenas:
        return
    try:
        import nvshmem.core as core

        core.finalize()
    except Exception:  # at exit there is no one left to tell; a peer that died already is common
        pass


def create_arena(size_bytes: int, group: dist.ProcessGroup, rank: int, world_size: int,
                 device: torch.device) -> Arena:
    """Collective: one arena of `size_bytes` on NVSHMEM's symmetric heap, peers by `nvshmem_ptr`."""
    ensure_initialised(group, rank, world_size, device, size_bytes)
    core = import_nvshmem()
    from nvshmem import bindings

    local = core.bytetensor((size_bytes,))
    # nvshmem_ptr itself, not nvshmem4py's peer tensors: those are tracked, and a tracked view of
    # this rank's own buffer (nvshmem_ptr of the own PE is the buffer) holds it past free_tensor
    bases = [int(bindings.ptr(local.data_ptr(), pe)) for pe in range(world_size)]
    unreachable = [pe for pe, b in enumerate(bases) if b == 0]
    try:  # every rank learns every verdict, then all free together
        agree(group, "NVSHMEM gives no load/store mapping between some ranks (another node, or no P2P); the "
                     "heap's pointer table needs every peer in the same NVLink/PCIe domain",
              f"cannot reach ranks {unreachable}" if unreachable else None)
    except DitronConfigError:
        core.free_tensor(local)
        raise
    local.zero_()
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    assert _instance is not None
    _instance.live_arenas += 1
    held = [local]

    def release() -> None:  # collective (nvshmem_free synchronises the PEs): SymmetricHeap.free calls it on all
        if not held:
            return
        tensor = held.pop()
        core.free_tensor(tensor)
        if _instance is not None:
            _instance.live_arenas -= 1

    return Arena(local=local, peer_bases=bases, release=release)
