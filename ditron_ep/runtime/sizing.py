"""Sizing a cached buffer at first use, through the process group's store, with a deadline.

The functional ops (`ops.dispatch`, `ops.moe`) key their cached buffers by the call's shapes. A
rank whose shapes differ from its peers' finds a different key: it may build a buffer while they
reuse theirs. With a collective (all_reduce) for the size it would then wait in that collective
for peers that never join, until the backend's timeout or for ever. Through the store instead,
each rank posts (key, tokens) and polls for its peers' posts until a deadline, so it raises a
DitronConfigError that names the ranks missing; ranks that meet with different keys raise alike.

Sizings are numbered per group (generations). Each generation ends in ONE verdict, set once in
the store with compare_set: "ok" by the first rank that sees every post, "timeout" by the first
rank whose deadline passes first. Every rank follows that verdict, so no rank can give up while a
peer goes on into the buffer's constructor (a collective). After "ok" every rank moves to the
next generation. After "timeout" the ranks that had posted raise and move on; a rank that had not
posted (it was elsewhere, e.g. reusing another cached buffer) passes over that generation when it
next sizes, so the ranks' next sizings still line up.

A rank that rejects its own arguments before it could size (`refuse_sizing`) sets the verdict
"refused" on the generation its peers are sizing in, so they raise at once, naming it and its
reason, instead of waiting out the deadline. Unlike "timeout", a "refused" generation is not
passed over by a rank that arrives later: that rank was meant to size in it, so it raises too.
"""
from __future__ import annotations

import os
import time

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ditron_ep.runtime.errors import DitronConfigError

SIZING_TIMEOUT_ENV = "DITRON_SIZING_TIMEOUT_S"
# As long as NCCL's default collective timeout: ranks legitimately reach their first call with
# skew (loading weights, compiling), and this only bounds a wait that was unbounded before.
DEFAULT_SIZING_TIMEOUT_S = 600.0
_POLL_S = (0.001, 0.05)  # first and longest pause between polls (backing off, to spare a shared store)
_OK, _TIMEOUT, _REFUSED = "ok", "timeout", "refused"
_REASON_CHARS = 500  # a refusal's reason, as stored for the peers

# group name -> the generation this rank's next sizing in that group uses.
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
    """The default store under a prefix of the group's name (every member of a group knows it by
    the same name; the store is shared by every group), or None where torch offers no default
    store through this (private) accessor."""
    try:
        return dist.PrefixStore(f"ditron_ep/sizing/{group.group_name}/", c10d._get_default_store())
    except (AttributeError, RuntimeError, ValueError):
        return None


def _agree_by_collective(group: dist.ProcessGroup, what: str, shown: str, tokens: int) -> int:
    """Fallback without a store: one all_gather_object of (key, tokens). Unbounded if a rank never
    joins (the reason the store is preferred), but still names differing shapes."""
    posts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(posts, (shown, int(tokens)), group=group)
    return _largest(what, posts)


def _largest(what: str, posts: list) -> int:
    """The largest tokens of [(key shown, tokens)] over the ranks; DitronConfigError if keys differ."""
    if any(k != posts[0][0] for k, _ in posts):
        detail = "; ".join(f"rank {r}: {k}" for r, (k, _) in enumerate(posts))
        raise DitronConfigError(f"{what}: the ranks size cached buffers for different shapes ({detail}); every "
                                f"rank must pass the same shapes and dtypes")
    return max(t for _, t in posts)


def _current_generation(store, group_name: str) -> int:
    """This rank's next sizing generation in the group, past those abandoned on a timeout."""
    gen = _GENERATIONS.get(group_name, 0)
    while store.check([f"{gen}/verdict"]) and store.get(f"{gen}/verdict").decode().startswith(_TIMEOUT):
        gen += 1  # abandoned before this rank got there: not this call's generation
    return gen


def refuse_sizing(group: dist.ProcessGroup | None, reason: str) -> None:
    """This rank rejected its arguments to a call whose peers are sizing a new cached buffer for
    it (the caller knows they must be: `refuse_through_match`): set the verdict of this rank's
    current sizing generation to "refused", so peers waiting in `agree_on_tokens` raise at once
    with `reason`, and move this rank past that generation as they will be.

    Only that exact generation: if the peers already abandoned it ("timeout": this rank came
    late), this rank moves past it and marks nothing, since a later generation would be a later
    call's. Best effort: without a store (the collective fallback), outside the group, or when
    the store fails, it does nothing (the peers' wait stays bounded by their deadline), so the
    rank's own error is what it raises."""
    try:
        if not dist.is_initialized():
            return
        g = group if group is not None else dist.group.WORLD
        store = _group_store(g)
        if store is None or dist.get_rank(g) < 0:  # no store, or not a member: no sizing of this group to refuse
            return
        gen = _GENERATIONS.get(g.group_name, 0)
        verdict = store.compare_set(f"{gen}/verdict", "",
                                    f"{_REFUSED} {dist.get_rank(g)} {reason[:_REASON_CHARS]}").decode()
        # first verdict wins: another rank's refusal of this call stays; so does a timeout, past
        # which this rank moves with the peers (and past any later ones, as a sizing would)
        _GENERATIONS[g.group_name] = (_current_generation(store, g.group_name) if verdict.startswith(_TIMEOUT)
                                      else gen + 1)
    except Exception:  # noqa: BLE001  (telling the peers must never replace this rank's own error)
        return


def agree_on_tokens(group: dist.ProcessGroup | None, what: str, key: dict[str, object], tokens: int,
                    timeout_s: float | None = None) -> int:
    """Collective over `group`, with a deadline: the largest `tokens` over the ranks.

    Every rank posts `tokens` with its `key` (name -> value, shown by repr) under the group's next
    sizing generation, then polls for its peers' posts. Raises DitronConfigError on every rank
    when the ranks' keys differ (naming each rank's), and on every rank that posted when some
    rank's deadline (`timeout_s`; default DITRON_SIZING_TIMEOUT_S, else 600 s) passed before all
    had posted, naming the ranks missing; at once on every rank when a rank refused the call
    (`refuse_sizing`), naming it and its error."""
    g = group if group is not None else dist.group.WORLD
    timeout_s = sizing_timeout_s() if timeout_s is None else timeout_s
    rank, world = dist.get_rank(g), dist.get_world_size(g)
    shown = ", ".join(f"{k}={v!r}" for k, v in key.items())
    store = _group_store(g)
    if store is None:
        return _agree_by_collective(g, what, shown, tokens)
    gen = _current_generation(store, g.group_name)
    posts = [f"{gen}/rank{r}" for r in range(world)]
    verdict_key = f"{gen}/verdict"
    store.set(posts[rank], f"{int(tokens)} {shown}")
    deadline = time.monotonic() + timeout_s
    pause = _POLL_S[0]
    while True:
        if store.check(posts):
            verdict = store.compare_set(verdict_key, "", _OK).decode()
        elif time.monotonic() > deadline:
            # the verdict names the ranks missing when it was set, so every rank reports the same
            missing = ",".join(str(r) for r, p in enumerate(posts) if not store.check([p]))
            verdict = store.compare_set(verdict_key, "", f"{_TIMEOUT} {missing}").decode()
        elif store.check([verdict_key]):
            verdict = store.get(verdict_key).decode()
        else:
            time.sleep(pause)
            pause = min(2 * pause, _POLL_S[1])
            continue
        break
    _GENERATIONS[g.group_name] = gen + 1
    if verdict.startswith(_REFUSED):
        store.delete_key(posts[rank])
        refuser, _, reason = verdict[len(_REFUSED):].strip().partition(" ")
        raise DitronConfigError(
            f"{what}: rank {refuser} rejected its arguments to this call, so no buffer was sized for {shown} "
            f"(seen from rank {rank}); rank {refuser}'s error: {reason}")
    if verdict.startswith(_TIMEOUT):
        store.delete_key(posts[rank])  # nobody reads an abandoned generation's posts; its verdict stays
        missing = verdict[len(_TIMEOUT):].strip().replace(",", ", ")
        who = (f"rank(s) {missing} did not join" if missing else
               "a rank's deadline passed before every rank had joined (all have joined since)")
        raise DitronConfigError(
            f"{what}: {who} the sizing of a new cached buffer for {shown} within {timeout_s:g} s (seen from rank "
            f"{rank}). Every rank must make the same calls with the same shapes and dtypes: a rank whose shapes "
            f"differ reuses another cached buffer instead. If a rank is only slow to get here, raise "
            f"{SIZING_TIMEOUT_ENV} on every rank.")
    # "ok" is set only once every post is there, and nothing is deleted before every rank has read.
    values = [v.decode().split(" ", 1) for v in store.multi_get(posts)]
    if store.add(f"{gen}/read", 1) == world:  # the last rank to read removes the generation's keys
        for k in posts + [verdict_key, f"{gen}/read"]:
            store.delete_key(k)
    return _largest(what, [(k, int(t)) for t, k in values])
