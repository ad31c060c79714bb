"""Sizing a cached buffer at first use, through the process group's store, with a deadline.

The functional ops (`ops.dispatch`, `ops.moe`) key their cached buffers by the call's shapes. A
rank whose shapes differ from its peers' finds a different key: it may build a buffer while they
reuse theirs. With a collective (all_reduce) for the size it would then wait in that collective
for peers that never join, until the backend's timeout or for ever. Through the store instead,
each rank posts (key, tokens) and polls for its peers' posts until a deadline, so it raises a
DitronConfigError that names the ranks missing; ranks that meet with different keys raise alike.
"""
from __future__ import annotations

import os
import time

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .errors import DitronConfigError

SIZING_TIMEOUT_ENV = "DITRON_SIZING_TIMEOUT_S"
# As long as NCCL's default collective timeout: ranks legitimately reach their first call with
# skew (loading weights, compiling), and this only bounds a wait that was unbounded before.
DEFAULT_SIZING_TIMEOUT_S = 600.0
_POLL_S = 0.005

# group name -> how many sizings this rank has completed in that group. A sizing that times out
# leaves it unchanged (and removes its post), so the ranks' next sizing still lines up.
_GENERATIONS: dict[str, int] = {}


def sizing_timeout_s() -> float:
    raw = os.environ.get(SIZING_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_SIZING_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise DitronConfigError(f"{SIZING_TIMEOUT_ENV}={raw!r}: set it to a positive number of seconds")
    return value


def _group_store(group: dist.ProcessGroup):
    # The default store is shared by every group; the group's name keeps the posts of
    # different groups apart (every member of a group knows it by the same name).
    return dist.PrefixStore(f"ditron_ep/sizing/{group.group_name}/", c10d._get_default_store())


def agree_on_tokens(group: dist.ProcessGroup | None, what: str, key: dict[str, object], tokens: int,
                    timeout_s: float | None = None) -> int:
    """Collective over `group`, with a deadline: the largest `tokens` over the ranks.

    Every rank posts `tokens` with its `key` (name -> value, shown by repr) under the group's next
    sizing number, then polls for its peers' posts. Raises DitronConfigError on every rank when
    the ranks' keys differ (naming each rank's), and on a rank whose peers have not posted within
    `timeout_s` (default: DITRON_SIZING_TIMEOUT_S, else 600 s), naming those peers."""
    g = group if group is not None else dist.group.WORLD
    timeout_s = sizing_timeout_s() if timeout_s is None else timeout_s
    rank, world = dist.get_rank(g), dist.get_world_size(g)
    shown = ", ".join(f"{k}={v!r}" for k, v in key.items())
    gen = _GENERATIONS.get(g.group_name, 0)
    store = _group_store(g)
    posts = [f"{gen}/rank{r}" for r in range(world)]
    store.set(posts[rank], f"{int(tokens)} {shown}")
    deadline = time.monotonic() + timeout_s
    while not store.check(posts):
        if time.monotonic() > deadline:
            missing = [r for r, p in enumerate(posts) if not store.check([p])]
            if missing:
                store.delete_key(posts[rank])  # leave nothing a later sizing could mistake for this one
                raise DitronConfigError(
                    f"{what}: rank(s) {', '.join(map(str, missing))} did not join the sizing of a new cached "
                    f"buffer for {shown} within {timeout_s:g} s (rank {rank} waited). Every rank must make the "
                    f"same calls with the same shapes and dtypes: a rank whose shapes differ reuses another "
                    f"cached buffer instead. If a rank is only slow to get here, raise {SIZING_TIMEOUT_ENV}.")
            break
        time.sleep(_POLL_S)
    values = [v.decode().split(" ", 1) for v in store.multi_get(posts)]
    # The last rank to read removes the posts (the store lives as long as the job).
    if store.add(f"{gen}/read", 1) == world:
        for p in posts + [f"{gen}/read"]:
            store.delete_key(p)
    _GENERATIONS[g.group_name] = gen + 1
    if any(k != shown for _, k in values):
        detail = "; ".join(f"rank {r}: {k}" for r, (_, k) in enumerate(values))
        raise DitronConfigError(f"{what}: the ranks size cached buffers for different shapes ({detail}); every "
                                f"rank must pass the same shapes and dtypes")
    return max(int(t) for t, _ in values)
