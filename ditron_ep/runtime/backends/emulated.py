"""CPU backend: every rank's arena is a file in /dev/shm mapped by all ranks of the group.

Each rank creates its own segment, every rank maps every segment, and after a barrier each rank
unlinks its own file: from then on the memory lives exactly as long as some rank maps it, so a
crashed or killed rank leaves nothing behind. A launcher-owned prefix (DITRON_SHM_PREFIX) lets
the parent sweep the short window between create and unlink.
"""
from __future__ import annotations

import mmap
import os
import uuid

import torch
import torch.distributed as dist

from ditron_ep.runtime.backends import Arena

SHM_DIR = "/dev/shm"
SHM_PREFIX_ENV = "DITRON_SHM_PREFIX"


def segment_prefix() -> str:
    return os.environ.get(SHM_PREFIX_ENV, "ditron")


def _segment_path(tag: str, rank: int) -> str:
    return os.path.join(SHM_DIR, f"{segment_prefix()}_{tag}_r{rank}")


def create_arena(size_bytes: int, group: dist.ProcessGroup, rank: int, world_size: int) -> Arena:
    if not os.path.isdir(SHM_DIR):
        raise OSError(f"{SHM_DIR} is missing: the emulated backend needs POSIX shared memory")
    tag = [uuid.uuid4().hex[:12] if rank == 0 else None]
    dist.broadcast_object_list(tag, src=dist.get_global_rank(group, 0), group=group)
    own = _segment_path(tag[0], rank)
    fd = os.open(own, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size_bytes)  # zero-filled by the kernel
    finally:
        os.close(fd)
    maps: list[mmap.mmap] = []
    try:
        dist.barrier(group=group)
        for peer in range(world_size):
            fd = os.open(_segment_path(tag[0], peer), os.O_RDWR)
            try:
                maps.append(mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
            finally:
                os.close(fd)
        dist.barrier(group=group)
    finally:
        # Every rank has mapped every segment (or failed): the names are no longer needed.
        try:
            os.unlink(own)
        except FileNotFoundError:
            pass
    views = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]

    def release() -> None:
        views.clear()
        for m in maps:
            try:
                m.close()
            except BufferError:
                pass  # a tensor view is still alive; the mapping goes when it does
        maps.clear()

    return Arena(local=views[rank], peer_bases=[v.data_ptr() for v in views], release=release,
                 peer_views=views)


def leftover_segments(prefix: str) -> list[str]:
    """Segments in /dev/shm whose name starts with `prefix` (for sweeping and for tests)."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(os.path.join(SHM_DIR, n) for n in names if n.startswith(prefix))


def sweep_segments(prefix: str) -> None:
    for path in leftover_segments(prefix):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
