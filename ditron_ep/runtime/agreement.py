"""Cross-rank agreement: one call record per call, read by every rank before any data moves.

Every call on a buffer or layer opens with an exchange it makes anyway (the counts exchange of a
dispatch / FusedMoE call, the entry barrier of a combine). That exchange carries each rank's
call record: its call number (the stamp it signals with), status flags (FLAG_* in
runtime/control.py: it rejected its own arguments, its request needs another buffer, bad expert
ids, too many tokens, it gave up on the call) and its request fields (the arguments every rank
must share). Every rank reads every record, so every rank raises the same error, before
anything moves; `call_error` and `raise_call_records` turn records into that error.

Building a resource is the one collective without a record to ride on: `agree` gathers every
rank's verdict first, so a rank that rejects its arguments never leaves its peers waiting in the
heap's set-up. `CallSlot` is what the functional forms (and the modules and integrations, one
each) keep: a resource built at first use and rebuilt on every rank together when the records
of a call say every rank needs another one.
"""
from __future__ import annotations

import os
from typing import Callable, Generic, TypeVar

import torch
import torch.distributed as dist

from ditron_ep.runtime import control as C
from ditron_ep.runtime.fast_launch import capturing
from ditron_ep.runtime.errors import DitronConfigError, DitronOutOfStepError

R = TypeVar("R")
# Request fields that are not ints travel in a call record as their index here.
SYMBOLS = (None, torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
           "swiglu", "geglu", "gelu", "gelu_tanh", "relu", "silu", "overlap", "sequential", "staged")


def field_word(v: object) -> int:
    """A request field as a call record's int32 word."""
    return v if isinstance(v, int) else SYMBOLS.index(v) if v in SYMBOLS else len(SYMBOLS)


def field_value(word: int, like: object) -> object:
    """The field a record word stands for (`like`: a value of the same kind)."""
    return word if isinstance(like, int) else SYMBOLS[word] if 0 <= word < len(SYMBOLS) else f"#{word}"


def require_member(group: dist.ProcessGroup | None, what: str) -> None:
    """DitronConfigError unless this rank belongs to `group`. Local (no collective): a rank outside
    a group takes no part in its collectives — torch skips them with a warning and leaves outputs
    unwritten, or fails with an error that does not say why."""
    if group is not None and dist.get_rank(group) < 0:
        raise DitronConfigError(
            f"{what}: this rank (global rank {dist.get_rank()}) is not a member of the process group it was given "
            f"(ranks {dist.get_process_group_ranks(group)}); pass the group this rank belongs to (e.g. its own "
            f"expert- or tensor-parallel group), or call it on that group's ranks only")


def agree(group: dist.ProcessGroup | None, what: str, problem: str | None, same: dict[str, object] | None = None,
          value: int = 0, every_value: bool = False) -> int | list[int]:
    """Collective (every rank of `group`): raise DitronConfigError on every rank if any rank has
    a `problem` (naming the ranks when only some have one), or if `same` (name -> value) differs
    between ranks (naming each rank's); else return the largest `value` over the ranks (with
    every_value, every rank's, in rank order)."""
    require_member(group, what)
    posts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(posts, (problem, same, value), group=group)
    ranks = [r for r, (p, _, _) in enumerate(posts) if p]
    if ranks:
        distinct = sorted({posts[r][0] for r in ranks})
        detail = distinct[0] if len(distinct) == 1 else "; ".join(f"rank {r}: {posts[r][0]}" for r in ranks)
        where = "" if len(ranks) == len(posts) else f" (on rank(s) {', '.join(map(str, ranks))}; raised on every rank)"
        raise DitronConfigError(f"{what}: {detail}{where}")
    differ = differing(dict(enumerate(s for _, s, _ in posts)))
    if differ:
        raise DitronConfigError(f"{what}: every rank must pass the same {differ}")
    return [v for _, _, v in posts] if every_value else max(v for _, _, v in posts)


def agree_words(group: dist.ProcessGroup | None, what: str, problem: str | None, same: dict[str, object],
                device: torch.device, extra: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    """`agree` for ops on the data path: every rank posts one fixed-size row of words — its problem
    flag and the `same` fields (field_word) — and reads every rank's (`_exchange_rows`); only when a
    row is flagged or differs does it fall back to `agree`, which builds the message and raises on
    every rank. `same` must have the same keys on every rank (a rank with a problem still passes
    them, any values). `extra`: int words (the same count on every rank) that ride along without
    having to agree; returns every rank's, in rank order, so that every rank can make the same
    choice from them (e.g. a GEMM tile each rank looked up in its own tuner cache)."""
    require_member(group, what)
    n_same = 1 + len(same)
    words = [1 if problem else 0, *(field_word(v) for v in same.values()), *extra]
    rows = _exchange_rows(group, words, device)
    if any(r[0] for r in rows) or any(r[1:n_same] != rows[0][1:n_same] for r in rows):
        agree(group, what, problem, None if problem else same)
        raise DitronConfigError(f"{what}: the ranks' arguments differ ({', '.join(same)})")  # agree raised already
    return [tuple(r[n_same:]) for r in rows]


# NCCL groups exchange agree_words' rows through the rendezvous store: a tensor all_gather there
# is a GPU collective whose read-back waits for everything queued on the stream (~350-450 µs a
# call on 2xH200, bench/results/HISTORY.md session 22), the store a few TCP round trips of the host.
# Other groups (gloo: emulated CPU ranks, whose FileStore rereads its whole log on every access)
# all_gather on `device`. DITRON_AGREE_TRANSPORT=store|tensor (or tests, setting this) forces either;
# every rank must see the same setting (a rank on the other transport waits until the timeout).
# Jobs of more than STORE_MAX_WORLD ranks keep the all_gather: one TCPStore server answers every
# rank's three requests a call.
AGREE_TRANSPORT = os.environ.get("DITRON_AGREE_TRANSPORT", "auto")
STORE_MAX_WORLD = 16
if AGREE_TRANSPORT not in ("auto", "store", "tensor"):
    raise DitronConfigError(f"DITRON_AGREE_TRANSPORT must be auto, store or tensor, got {AGREE_TRANSPORT!r}")
_STORE_AGREEMENTS: dict = {}


def _exchange_rows(group: dist.ProcessGroup | None, words: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's `words` (a list of ints, the same length on every rank), in rank order."""
    via = AGREE_TRANSPORT if AGREE_TRANSPORT != "auto" else "store" if (
        "nccl" in str(dist.get_backend(group)) and dist.get_world_size() <= STORE_MAX_WORLD) else "tensor"
    if capturing(device):
        # under CUDA-graph capture (collective: every rank captures the call) the tensor exchange's
        # read-back cannot run; the store's is host-only. The agreement runs once, at capture.
        via = "store"
    if via == "store":
        key = group_key(group)
        base = dist.distributed_c10d._get_default_store()
        agreement = _STORE_AGREEMENTS.get(key)
        if agreement is None or agreement.base is not base:  # (a process group made again: a new store)
            _STORE_AGREEMENTS.pop(key, None)
            agreement = _STORE_AGREEMENTS[key] = StoreAgreement(group, base)
        return agreement.exchange(words)
    world = dist.get_world_size(group)
    row = torch.tensor(words, dtype=torch.int64, device=device)
    rows = torch.empty(world * row.numel(), dtype=torch.int64, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(rows, row, group=group)
    return rows.cpu().view(world, -1).tolist()


class StoreAgreement:
    """A group's rows exchanged through the default c10d store (the rendezvous TCPStore under
    torchrun): call c of rank r sets key "c/r"; every rank reads the group's keys of call c (the
    store's get waits for a key, up to the store's timeout), then deletes its own key of call c - 2,
    which every peer has read by then (it could not have finished call c - 1 without this rank's
    key c - 1, set after this rank had read call c - 2). No GPU work, no stream sync. The group's
    name (the same on its members) keeps groups apart, and an epoch the group's ranks draw from a
    store counter when they make it (all on their first exchange on the group) keeps a group made
    again after destroy_process_group (same name, maybe the same store, the last two keys of each
    rank left there) from reading the old one's keys. Every rank makes a group's calls in the same
    order, as for any collective. A call that fails (a peer that never comes: the store's timeout)
    raises DitronOutOfStepError, and so does every later call of the group on that rank: its call
    number may be ahead of its peers', so no row is compared again."""

    def __init__(self, group: dist.ProcessGroup | None, base: dist.Store) -> None:
        name = group_key(group)
        self.base = base
        self.rank, self.world, self.call = dist.get_rank(group), dist.get_world_size(group), 0
        self.failed = ""
        # each incarnation's W ranks add 1 once, all before any of them completes its first exchange:
        # they get values in (epoch * W, (epoch + 1) * W] (one counter per group size)
        where = f"ditron_ep/agree/{name}/{self.world}"
        epoch = (base.add(f"{where}/members", 1) - 1) // self.world
        self.store = dist.PrefixStore(f"{where}/{epoch}/", base)

    def exchange(self, words: list[int]) -> list[list[int]]:
        if self.failed:  # its call number may be ahead of its peers': never compare rows again
            raise DitronOutOfStepError(f"this group's agreement failed at call {self.call} ({self.failed}); its "
                                       f"calls are out of step: make the process group again")
        self.call += 1
        c = self.call
        try:
            self.store.set(f"{c}/{self.rank}", ",".join(map(str, words)))
            keys = [f"{c}/{r}" for r in range(self.world)]
            values = self.store.multi_get(keys) if hasattr(self.store, "multi_get") else \
                [self.store.get(k) for k in keys]
            if c > 2:
                self.store.delete_key(f"{c - 2}/{self.rank}")
        except Exception as err:  # a peer that never came (the store's timeout), a store gone
            self.failed = f"{type(err).__name__}: {err}"
            raise DitronOutOfStepError(f"the agreement of call {c} on this group failed: a peer did not arrive or "
                                       f"the store failed ({self.failed}); no data moved") from err
        return [[int(w) for w in bytes(v).decode().split(",")] for v in values]


def differing(fields: dict[int, dict | None]) -> str:
    """'' when every rank's fields (rank -> {name: value}) agree, else each differing field with
    every rank's value ("hidden: rank 0 32, rank 1 48")."""
    known = {r: f for r, f in fields.items() if f}
    names = [n for n in next(iter(known.values()), {}) if any(f.get(n) != fields[min(known)][n] for f in known.values())]
    return "; ".join(f"{n}: " + ", ".join(f"rank {r} {f.get(n)!r}" for r, f in known.items()) for n in names)


def group_key(group: dist.ProcessGroup | None) -> str | int:
    """What names a process group (None = the default group): its name, the same on its members."""
    g = group if group is not None else dist.group.WORLD
    return g.group_name if hasattr(g, "group_name") else id(g)


def per_group(registry: dict, group: dist.ProcessGroup | None, make: Callable[[dist.ProcessGroup | None], R]) -> R:
    """The registry's entry for the process group (keyed by its name; None = the default group),
    made by `make(group)` at first use: what the functional forms keep per group."""
    key = group_key(group)
    if key not in registry:
        registry[key] = make(group)
    return registry[key]


class RebuildNeeded(Exception):
    """Every rank's request of this call (`fields`, up to `tokens` tokens) needs another buffer
    than the one the call reached; raised on every rank alike, caught by `CallSlot`."""

    def __init__(self, fields: dict, tokens: int) -> None:
        super().__init__(f"rebuild for {fields}")
        self.fields, self.tokens = fields, tokens


def call_error(flags: int, ranks: list[int], me: int, call: int, calls: dict[int, int],
               fields: dict[int, dict | None] | None = None) -> Exception | None:
    """The error every rank raises for a call whose records hold `flags` (FLAG_* of `ranks`),
    seen by rank `me` at call number `call`; calls: rank -> its call number; fields: rank -> its
    request fields. Out of step and refusals only (input problems: the buffers raise those)."""
    who = ", ".join(map(str, ranks))
    if flags & (C.FLAG_OUT_OF_STEP | C.FLAG_GAVE_UP):
        at = ", ".join(f"rank {r} at call {calls[r]}" for r in ranks if r in calls)
        gave_up = " and had given up on it (it timed out waiting for this rank)" if flags & C.FLAG_GAVE_UP else ""
        return DitronOutOfStepError(
            f"the ranks' calls on this buffer are out of step: rank {me} is at call {call}, {at}{gave_up}. A rank "
            f"skipped a call or arrived after its peers left it. Nothing moved in this call; the next call of "
            f"every rank meets again")
    if flags & C.FLAG_UNREAD:
        return DitronConfigError(
            f"rank(s) {who} held an error of an earlier call not yet raised there (a combine with check_errors="
            f"False, a graph-mode call, or a call under autograd whose backward pass had not ended); it is raised there now, and no rank moved anything in this call "
            f"(call {call})")
    if flags & C.FLAG_REFUSED:
        differ = differing(fields or {})
        return DitronConfigError(
            f"rank(s) {who} rejected their own arguments to call {call} and raised the reason there"
            f"{f' ({differ})' if differ else ''}; no rank moved anything. Fix that call: every rank must call "
            f"with valid arguments, in the same order")
    if flags & C.FLAG_MODE_MISMATCH:
        return DitronConfigError(
            f"rank(s) {who} called this combine in another mode than rank {me} (call {call}): combine's topk_sum or "
            f"partial_dtype differ, or, in a backward, the dispatches' layout= did; no rank moved anything. Every rank "
            f"must pass the same topk_sum, partial_dtype and dispatch layout")
    return None


class CallSlot(Generic[R]):
    """One collectively built resource (an EPBuffer or a FusedMoE) that the functional forms keep
    per process group, and a module or integration keeps for itself: built at first use, sized
    by the largest request over the ranks, and rebuilt on every rank together when a call's
    records say every rank needs another one (more tokens; other shapes, when every rank agrees).

    build(fields, tokens) builds it; fields_of(resource) are the request fields it serves."""

    def __init__(self, group: dist.ProcessGroup | None, what: str, build: Callable[[dict, int], R],
                 fields_of: Callable[[R], dict]) -> None:
        self.group, self.what, self.resource = group, what, None
        self._build, self._fields_of = build, fields_of

    def run(self, fields: dict | None, tokens: int, error: Exception | None, sync: bool,
            call: Callable[[R], object], join_flagged: Callable[[R, int, dict | None], None]) -> object:
        """`call` on the resource for this request (`fields`, `tokens`). A rank whose own
        arguments failed (`error`) joins the call flagged FLAG_REFUSED and raises it; a request
        the resource does not serve joins flagged FLAG_REBUILD (its peers learn it from the
        records, sync=True: every rank rebuilds, or raises naming the fields that differ)."""
        res = self.resource
        if res is None or getattr(res, "freed", False):
            problem = None if error is None else str(error) if isinstance(error, ValueError) else \
                f"{type(error).__name__}: {error}"
            try:
                tokens = agree(self.group, self.what, problem, fields if error is None else None, max(tokens, 1))
            except DitronConfigError:
                if error is not None:  # a rank that failed raises its own error
                    raise error from None
                raise
            res = self.resource = self._build(fields, tokens)
        elif error is not None:
            join_flagged(res, C.FLAG_REFUSED, fields)
        if error is not None:
            raise error
        for _ in range(2):  # a rebuild, then the call on the new resource
            try:
                if fields != self._fields_of(res):
                    if not sync:
                        join_flagged(res, C.FLAG_REFUSED, fields)
                        raise DitronConfigError(f"{self.what}: graph mode (sync=False) needs the cached buffer for "
                                                f"this request to exist: call once with sync=True")
                    join_flagged(res, C.FLAG_REBUILD, fields)  # raises on every rank (a read)
                return call(res)
            except RebuildNeeded as need:
                fields, tokens = need.fields, max(need.tokens, res.max_tokens)
            except Exception as err:  # noqa: BLE001 - only a capacity problem read in this call rebuilds
                if not (sync and getattr(err, "needed", None) and not getattr(err, "pending", True)):
                    raise
                tokens = max(err.needed, 2 * res.max_tokens)  # geometric growth: few regrows
                fields = self._fields_of(res)
            res.free()
            res = self.resource = self._build(fields, tokens)
        return call(res)

    def free(self) -> None:
        """Free the resource (collective: call on every rank)."""
        if self.resource is not None:
            self.resource.free()
        self.resource = None
