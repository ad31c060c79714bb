"""The plan of the fused EP MoE megakernel: plain frozen data at three levels (Task, Device, Core).

* Task level — `RoutingPlan`: what crosses ranks (shapes of the EP group, chunking into signalled
  blocks, node topology).
* Device level — `DevicePlan`: the per-rank ordered task queue (`StagePlan`s, each with the
  signals it waits on and notifies), signal words, and where every buffer lives in the
  symmetric heap.
* Core level — `CorePlan`: the tile programs (GEMM tile configs, copy block sizes).

`MoEPlan` bundles the three; `ditron_ep.compiler.lowering.lower` builds one from a `MoESpec`
and `ditron_ep.compiler.verifier` checks it. Kernels read the plan and refuse one whose
`verified` is False (`require_verified`).

Signals, waits and notifies are described in a small vocabulary so that the verifier can count,
for any concrete routing, the notifies aimed at every individual wait:

* a `SignalFamily` is a range of int32 signal words indexed by an *index space* (`INDEX_SPACES`);
* a `WaitSpec` names the words a task of its stage waits on (`WAIT_ELEMENTS`) and the value it
  waits for (`expected`: a formula name, `expected_count` its value where static);
* a `NotifySpec` names the words a task hits (`NOTIFY_ELEMENTS`), what it adds per hit
  (`amount`; an epoch flag takes one stamp), and how many hits every word gets over the whole
  call from all tasks of all ranks (`hits`, `hits_count` where static).

Formulas are names. Static ones are evaluated by `MoEPlan.static_env` ("1", "n_tiles1",
"n_tiles2", "tasks(<stage>)"); the routing-dependent ones are "rows_in_tile" (rows of the waited
row tile) and "ticketed(<stage>)" (tasks of a stage that get a ticket on the rank: a stage that
skips empty row tiles hands out none for them), which the verifier evaluates per routing instance
and kernels compute from the layout.

Heap layout (the same as `runtime.heap.SymmetricHeap`): [control block | `num_signals` int32
signal words | buffers]. Allocating `device.buffers` in order with `SymmetricHeap.alloc` on a heap
of `heap_bytes` bytes and `num_signals` signals gives exactly the offsets recorded here.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import NamedTuple

from ditron_ep.compiler.core_config import DEVICE_TYPES, GemmTileConfig
from ditron_ep.runtime import control as C

__all__ = [
    "CROSS_RANK_BARRIER_BEFORE", "DTYPE_BYTES", "GEMM_TILE_ORDERS", "INDEX_SPACES",
    "NOTIFY_ELEMENTS", "SCHEDULES", "SOURCE_ORDERS", "STAGE_NAMES", "WAIT_ELEMENTS",
    "BufferPlacement", "CorePlan", "DevicePlan", "Element", "MoEPlan", "MoESpec", "NotifySpec",
    "PlanError", "RoutingPlan", "SignalFamily", "StagePlan", "WaitSpec", "cdiv", "combine_task_split",
    "index_space_size",
    "is_nonnegative_int", "is_positive_int", "is_pow2", "numel", "row_tiles_bound",
]

SCHEDULES = ("overlap", "sequential")
SOURCE_ORDERS = ("ring", "reverse_ring")
# Orders of the (row tile, col tile) tasks of a GEMM stage. "grouped" walks the row tiles in groups
# of gemm_group_rows: one column tile over the group's rows, then the next column tile, then the next
# group (a GROUP_M swizzle), so the programs that share a weight column block take consecutive
# tickets (lowering.DEFAULT_GEMM_TILE_ORDER says what that bought). "row_major" is groups of one
# row tile, "column_major" one group of every row tile. The kernels decode tickets with
# ops/moe_layer/grouped_gemm_kernels.py::grouped_tile; StagePlan.coords gives the plan's numbering.
GEMM_TILE_ORDERS = ("row_major", "column_major", "grouped")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4, "int64": 8}
ACTIVATION_DTYPES = ("bfloat16", "float16", "float32")

# Every stage the megakernel knows, in queue order (combine_send exists only when the down GEMM
# does not send its tiles itself, i.e. combine_fused=False).
STAGE_NAMES = ("dispatch_send", "dispatch_recv", "gemm_gate_up", "gemm_down", "combine_send",
               "combine_reduce")
# The communication queue of a role split: the first stages of the queue (tickets [0, first
# ticket of the next stage)); comm programs take these first, every program the rest.
COMM_STAGES = ("dispatch_send", "dispatch_recv")

# Stages that, under schedule="sequential", also wait for the previous stage on every rank
# (cross-rank stage barrier); every other stage boundary waits for this rank only.
CROSS_RANK_BARRIER_BEFORE = ("gemm_gate_up", "combine_reduce")

# Index spaces of signal families: name -> meaning of word x.
INDEX_SPACES = {
    "src_chunk": "x = source_rank * n_chunks + chunk",
    "row_tile": "x = GEMM row tile of this rank",
    "token_slot": "x = token * topk + k, token of this rank",
    "single": "x = 0",
    "rank": "x = rank",
}


class Element(NamedTuple):
    """A word-selection rule of the wait / notify vocabulary."""

    key: str                  # index space of the words (INDEX_SPACES)
    target: str               # notifies: "local" | "remote"; waits: "" (a wait polls its own rank)
    needs: tuple[str, ...]    # task coordinates (grid names) the rule reads
    meaning: str


# Notify vocabulary: which words a task hits.
NOTIFY_ELEMENTS = {
    "src_chunk@dest": Element("src_chunk", "remote", ("dest_pos", "chunk"),
                              "word (this rank, chunk) on the task's destination rank"),
    "row_tile/placed_row": Element("row_tile", "local", ("source_pos", "chunk"),
                                   "one hit per GEMM row the task places, at the row's tile"),
    "row_tile": Element("row_tile", "local", ("row_tile",),
                        "the task's row tile (tiles beyond the routing's count are skipped)"),
    "token_slot@source/tile_row": Element("token_slot", "remote", ("row_tile",),
                                          "one hit per row of the task's tile, at (token, k) on "
                                          "the row's source rank"),
    "single": Element("single", "local", (), "word 0, by every ticketed task of the stage"),
    "this_rank@all_ranks/stage_end": Element("rank", "remote", (),
                                             "word [this rank] on every rank, once, by the task "
                                             "that completes the stage on this rank"),
}

# Wait vocabulary: which words of its own rank a task waits on.
WAIT_ELEMENTS = {
    "src_chunk": Element("src_chunk", "", ("source_pos", "chunk"), "word (task's source rank, chunk)"),
    "row_tile": Element("row_tile", "", ("row_tile",), "the task's row tile (none when it is empty)"),
    "token_slot/block": Element("token_slot", "", ("token_block",),
                                "every routed (token, k) of the task's token block"),
    "single": Element("single", "", (), "word 0, by every ticketed task of the stage"),
    "all_ranks": Element("rank", "", (), "every word [0, world_size)"),
}

# Formulas whose value depends on the routing (evaluated per instance / by kernels from the layout).
DYNAMIC_FORMULAS = ("rows_in_tile", "ticketed(<stage>)")


def ticketed_stage(formula: str) -> str | None:
    """The stage named by a "ticketed(<stage>)" formula, else None."""
    if formula.startswith("ticketed(") and formula.endswith(")"):
        return formula[len("ticketed("):-1]
    return None


def is_dynamic_formula(formula: str) -> bool:
    return formula == "rows_in_tile" or ticketed_stage(formula) in STAGE_NAMES


class PlanError(ValueError):
    """A plan that breaks an invariant; the message names the stage, signal or buffer."""


def is_positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def is_nonnegative_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def is_pow2(v) -> bool:
    return is_positive_int(v) and v & (v - 1) == 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def combine_task_split(num_tasks: int, tokens: int, block_t: int, hidden: int, block_h: int) -> tuple[int, int]:
    """(column slices per token block, columns per slice) of one call's combine_reduce tasks.

    The stage has num_tasks = cdiv(max_tokens, block_t) tasks; a call with fewer tokens fills
    only cdiv(tokens, block_t) blocks, so the spare tasks take column slices of them (task q:
    block q // slices, slice q % slices; a slice is a whole number of block_h columns, none
    empty). A layer sized for prefill thus keeps the decode combine spread over the grid. Every
    output element is still reduced by one task in k order: the split changes no bit. The
    megakernel computes the same split on the device (moe_fused.py, S4)."""
    n_blocks = max(cdiv(tokens, block_t), 1)
    n_col_blocks = cdiv(hidden, block_h)
    per = cdiv(n_col_blocks, min(max(num_tasks // n_blocks, 1), n_col_blocks))
    return cdiv(n_col_blocks, per), per * block_h


def row_tiles_bound(routing: "RoutingPlan", block_m: int) -> int:
    """Most GEMM row tiles one rank can get: tiles never span two experts, so the count is
    sum_e cdiv(rows_e, BM) <= floor((R + E_local * (BM - 1)) / BM) with R = W * max_tokens * topk
    the most rows a rank can receive. (Not min(topk, E_local): nothing stops a router from
    repeating an expert within a token, and each (token, k) is its own row.)"""
    r = routing
    rows = r.world_size * r.max_tokens * r.topk
    return (rows + r.experts_per_rank * (block_m - 1)) // block_m


def index_space_size(key: str, routing: "RoutingPlan", n_row_tiles_max: int) -> int:
    """Words a signal family indexed by `key` (`INDEX_SPACES`) needs on each rank."""
    r = routing
    return {"src_chunk": r.world_size * r.n_chunks, "row_tile": n_row_tiles_max,
            "token_slot": r.max_tokens * r.topk, "single": 1, "rank": r.world_size}[key]


# ============================================================================================
# Task level
# ============================================================================================
@dataclasses.dataclass(frozen=True)
class RoutingPlan:
    """What crosses ranks: the EP group's shapes and the chunking of dispatch into signalled blocks.

    Tokens rank s sends to rank d are numbered 0.. in token order (their staging slot on d);
    chunk c holds slots [c * chunk_rows, (c + 1) * chunk_rows) and is one signal.
    """

    world_size: int
    num_experts: int
    experts_per_rank: int
    topk: int
    max_tokens: int          # tokens per rank, at most
    hidden: int
    ffn_hidden: int
    dtype: str               # activation dtype name: "bfloat16" | "float16" | "float32"
    chunk_rows: int          # tokens per dispatch signal (power of two)
    n_chunks: int            # cdiv(max_tokens, chunk_rows)
    ranks_per_node: int      # ranks sharing one NVLink domain; == world_size: all NVLink

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def elem_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def describe(self) -> str:
        r = self
        return "\n".join([
            "Task level (RoutingPlan)",
            f"  world_size={r.world_size}  num_experts={r.num_experts} ({r.experts_per_rank}/rank)  "
            f"topk={r.topk}  max_tokens={r.max_tokens}/rank  hidden={r.hidden}  "
            f"ffn_hidden={r.ffn_hidden}  dtype={r.dtype}",
            f"  dispatch chunks: chunk_rows={r.chunk_rows}  n_chunks={r.n_chunks} per (source, dest)",
            f"  topology: ranks_per_node={r.ranks_per_node} ({r.num_nodes} node"
            f"{'s' if r.num_nodes != 1 else ''}"
            f"{', all NVLink' if r.num_nodes == 1 else ''})",
        ])


# ============================================================================================
# Device level
# ============================================================================================
@dataclasses.dataclass(frozen=True)
class WaitSpec:
    """What every (non-skipped) task of a stage waits on before it runs.

    signal: family name; on: "local" (producer is an earlier stage of this rank) or "remote"
    (producer is an earlier stage of any rank, this one included); producer_stage: the stage
    whose tasks notify it; element: which words (`WAIT_ELEMENTS`); expected: formula of the
    value every word must reach (notifies summed; stamps counted for epoch flags);
    expected_count: its value where static, None where it depends on the routing.
    """

    signal: str
    on: str
    producer_stage: str
    element: str
    expected: str
    expected_count: int | None


@dataclasses.dataclass(frozen=True)
class NotifySpec:
    """What every task of a stage notifies when its work is done.

    signal: family name; target: "local" (this rank's words) or "remote" (words on other ranks
    too); element: which words it hits (`NOTIFY_ELEMENTS`); amount: added per hit (counters) /
    1 = one epoch stamp (flags); hits: formula of the hits every word receives over the whole call
    from all tasks of all ranks; hits_count: its value where static.
    """

    signal: str
    target: str
    element: str
    amount: int
    hits: str
    hits_count: int | None


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One stage of the ordered task queue.

    Tickets [first_task, first_task + num_tasks) of the queue belong to this stage; ticket
    first_task + q decodes into task coordinates by mixed radix over `grid` (outermost first).
    num_tasks is a host bound; `skip` says which tasks never run ("never"; "empty_row_tile":
    tasks of row tiles beyond the routing's tile count get no ticket; the row tiles
    [0, max(count, 1)) do, so a rank without rows still runs one position of no-op tasks, which
    perform the "single" / stage-end notifies and barrier waits; "chunk_past_call": dispatch
    tasks of chunks at or past cdiv(largest T of any rank in the call, chunk_rows), at least
    one chunk, get no ticket: they hold no token on any rank). Ticketed tasks run in this
    order. barrier_before: every task of this stage first waits for the previous stage
    (schedule="sequential").
    """

    name: str
    index: int
    first_task: int
    grid: tuple[tuple[str, int], ...]
    num_tasks: int
    skip: str
    waits: tuple[WaitSpec, ...]
    notifies: tuple[NotifySpec, ...]
    barrier_before: bool

    def coords(self, q: int) -> dict[str, int]:
        """Task coordinates of the q-th task of this stage (0 <= q < num_tasks); a grouped GEMM
        grid (row_group, col_tile, row_in_group) also gets its row_tile = row_group * G + row_in_group."""
        out: dict[str, int] = {}
        for name, extent in reversed(self.grid):
            q, out[name] = divmod(q, extent)
        if "row_in_group" in out:
            out["row_tile"] = out["row_group"] * dict(self.grid)["row_in_group"] + out["row_in_group"]
        return out

    def coord_names(self) -> list[str]:
        """The grid's coordinate names, plus the row_tile a grouped GEMM grid derives."""
        names = [c for c, _ in self.grid]
        return names + ["row_tile"] if "row_in_group" in names and "row_tile" not in names else names


@dataclasses.dataclass(frozen=True)
class SignalFamily:
    """A range of int32 signal words: [first, first + count) of every rank's signal area.

    scope: "remote" (written by other ranks) or "local" (only by this rank); kind: "epoch_flag"
    (stamped with the call epoch, reused across calls) or "counter" (atomic adds); key: index
    space (`INDEX_SPACES`); reset: who returns a counter to zero for the next call.
    """

    name: str
    first: int
    count: int
    key: str
    scope: str
    kind: str
    producer: str
    consumer: str
    reset: str


@dataclasses.dataclass(frozen=True)
class BufferPlacement:
    """A named buffer in every rank's arena: bytes [offset, offset + nbytes) from the arena base.

    scope: "symmetric" (peers read or write it) or "private" (only this rank touches it).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int
    scope: str
    role: str = ""


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """The per-rank plan of the persistent launch: task queue, signals, heap placement."""

    schedule: str               # "overlap" | "sequential"
    num_programs: int           # persistent grid size
    # Role split: the first comm_programs programs to start take the communication queue
    # (dispatch_send, dispatch_recv), the others the compute queue (the GEMM stages, then
    # combine_reduce); a comm program joins the compute queue once its queue is empty. 0: one
    # queue for all.
    comm_programs: int
    # The two dispatch stages share the start of the queue, interleaved (language/task_queue.py):
    # dispatch_recv task g comes right after dispatch_send task g + recv_lag, so the rows already
    # here are placed, and their GEMM tiles start, while remote chunks are still being sent.
    # recv_lag >= the number of send tasks: every send first (what "sequential" needs).
    recv_lag: int
    source_order: str           # order of destinations in dispatch_send: "ring" | "reverse_ring"
    gemm_tile_order: str        # order of (row tile, col tile) in the GEMM stages (GEMM_TILE_ORDERS)
    # Row tiles per group of that order: 1 for row_major, n_row_tiles_max for column_major.
    gemm_group_rows: int
    combine_fused: bool         # gemm_down sends its tiles itself (no combine_send stage)
    block_t: int                # tokens per combine_reduce task
    n_row_tiles_max: int        # host bound of GEMM row tiles per rank
    n_tiles1: int               # column tiles of gate-up: cdiv(ffn_hidden, gate_up.block_n)
    n_tiles2: int               # column tiles of down: cdiv(hidden, down.block_n)
    stages: tuple[StagePlan, ...]
    signals: tuple[SignalFamily, ...]
    num_signals: int            # int32 signal words per rank
    buffers: tuple[BufferPlacement, ...]
    heap_bytes: int             # arena bytes per rank (control block + signals + buffers)

    @property
    def num_tasks(self) -> int:
        return sum(s.num_tasks for s in self.stages)

    @property
    def signal_offset(self) -> int:
        """Bytes from the arena base to signal word 0."""
        return C.CTRL_BYTES

    @property
    def data_offset(self) -> int:
        """Bytes from the arena base to the first buffer."""
        return C.align_up(C.CTRL_BYTES + 4 * self.num_signals)

    def stage(self, name: str) -> StagePlan:
        return _by_name(self.stages, name, "stage")

    def signal(self, name: str) -> SignalFamily:
        return _by_name(self.signals, name, "signal family")

    def buffer(self, name: str) -> BufferPlacement:
        return _by_name(self.buffers, name, "buffer")

    def has_stage(self, name: str) -> bool:
        return any(s.name == name for s in self.stages)

    def describe(self) -> str:
        d = self
        lines = [
            "Device level (DevicePlan)",
            f"  schedule={d.schedule}  num_programs={d.num_programs}  comm_programs={d.comm_programs}  "
            f"recv_lag={d.recv_lag}  source_order={d.source_order}  "
            f"gemm_tile_order={d.gemm_tile_order}"
            f"{f' ({d.gemm_group_rows} row tiles a group)' if d.gemm_tile_order == 'grouped' else ''}  "
            f"combine_fused={d.combine_fused}  block_t={d.block_t}",
            f"  GEMM tiles per rank: rows <= {d.n_row_tiles_max} (bound)  x  gate-up cols "
            f"{d.n_tiles1}, down cols {d.n_tiles2}",
            f"  queue: {d.num_tasks} tasks per rank (host bound; skipped tasks get no ticket), in this order:",
        ]
        if d.has_stage("dispatch_send") and d.recv_lag < d.stage("dispatch_send").num_tasks:
            lines.append(f"    (dispatch_send and dispatch_recv share their tickets, interleaved: recv task g "
                         f"right after send task g + {d.recv_lag})")
        for s in d.stages:
            grid = " x ".join(f"{n}[{e}]" for n, e in s.grid) or "-"
            barrier = "  [barrier before]" if s.barrier_before else ""
            lines.append(f"    S{s.index} {s.name:<15} tasks [{s.first_task}, "
                         f"{s.first_task + s.num_tasks})  {s.num_tasks} tasks = {grid}  "
                         f"skip: {s.skip}{barrier}")
            for w in s.waits:
                value = _formula(w.expected, w.expected_count)
                lines.append(f"        wait   {w.signal}[{w.element}] == {value}  "
                             f"<- {w.producer_stage} ({w.on})")
            for n in s.notifies:
                hits = _formula(n.hits, n.hits_count)
                what = "stamp epoch" if self.signal_kind(n.signal) == "epoch_flag" else f"+{n.amount}"
                lines.append(f"        notify {n.signal}[{n.element}] {what} ({n.target}); "
                             f"hits per word: {hits}")
        lines.append(f"  signals: {d.num_signals} int32 words per rank at arena byte "
                     f"{d.signal_offset}")
        for f in d.signals:
            lines.append(f"    [{f.first:>6}, {f.first + f.count:>6})  {f.name:<28} {f.kind:<10} "
                         f"{f.scope:<6} {f.key:<10} {f.producer} -> {f.consumer}; reset: {f.reset}")
        lines.append(f"  heap: {d.heap_bytes} bytes per rank ({_human(d.heap_bytes)}); buffers from "
                     f"byte {d.data_offset}")
        for b in d.buffers:
            shape = "x".join(str(s) for s in b.shape)
            lines.append(f"    @{b.offset:>12}  {b.name:<14} {b.scope:<9} {b.dtype:<8} [{shape}] "
                         f"{b.nbytes} B  {b.role}")
        return "\n".join(lines)

    def signal_kind(self, name: str) -> str:
        return next((f.kind for f in self.signals if f.name == name), "?")


# ============================================================================================
# Core level
# ============================================================================================
@dataclasses.dataclass(frozen=True)
class CorePlan:
    """Tile programs: the two GEMM tiles (same block_m: they share row tiles) and copy blocks."""

    gate_up: GemmTileConfig
    down: GemmTileConfig
    block_rows: int          # rows per dispatch copy block (= routing.chunk_rows)
    block_h: int             # hidden columns per copy / reduce block
    # (kernel, "path:tile (tuned|default)") of the staged schedule's and the backward's expert
    # GEMMs (grouped_mlp, compiler/tuner.py): part of the plan's identity, as they set result bits
    expert_gemms: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        lines = [
            "Core level (CorePlan)",
            f"  gemm_gate_up: {self.gate_up}   gemm_down: {self.down}",
            f"  copy blocks: block_rows={self.block_rows}  block_h={self.block_h}",
        ]
        if self.expert_gemms:
            lines.append("  staged / backward expert GEMMs: "
                         + "  ".join(f"{k}={v}" for k, v in self.expert_gemms))
        return "\n".join(lines)


# ============================================================================================
# The whole plan and the op spec
# ============================================================================================
@dataclasses.dataclass(frozen=True)
class MoEPlan:
    """Task, device and core levels of one fused EP MoE forward.

    verified_digest: digest of the three levels recorded by `lowering.lower` after the verifier
    passed; any change to a level (dataclasses.replace included) makes `verified` False.
    """

    routing: RoutingPlan
    device: DevicePlan
    core: CorePlan
    verified_digest: str = ""

    def digest(self) -> str:
        return hashlib.sha256(repr((self.routing, self.device, self.core)).encode()).hexdigest()[:16]

    @property
    def verified(self) -> bool:
        return self.verified_digest == self.digest()

    def require_verified(self) -> None:
        """Raise PlanError unless this exact plan passed the verifier (kernels call this)."""
        if not self.verified:
            raise PlanError("plan is not verified (built by hand or changed after lowering); "
                            "build it with ditron_ep.compiler.lowering.lower or pass it through "
                            "lowering.seal(plan), which runs the verifier")

    def static_env(self) -> dict[str, int]:
        """Values of the static formula names used by waits and notifies."""
        env = {"1": 1, "n_tiles1": self.device.n_tiles1, "n_tiles2": self.device.n_tiles2}
        env.update({f"tasks({s.name})": s.num_tasks for s in self.device.stages})
        return env

    def dest_of(self, rank: int, dest_pos: int) -> int:
        """Destination rank of dispatch_send coordinate dest_pos on `rank`: source_order "ring"
        is rank, rank-1, rank-2, ... (rank r-i hears from r i-th); "reverse_ring" rank, rank+1, ..."""
        step = -1 if self.device.source_order == "ring" else 1
        return (rank + step * dest_pos) % self.routing.world_size

    def source_of(self, rank: int, source_pos: int) -> int:
        """Source rank of dispatch_recv coordinate source_pos on `rank`: rank, rank+1, ..."""
        return (rank + source_pos) % self.routing.world_size

    def dispatch_chunks(self, call_max_tokens: int) -> int:
        """Chunks per (rank pair) the dispatch stages ticket in a call whose largest T over all
        ranks is call_max_tokens (skip "chunk_past_call"; the megakernel computes the same)."""
        r = self.routing
        return min(max(cdiv(call_max_tokens, r.chunk_rows), 1), r.n_chunks)

    def combine_task(self, q: int, tokens: int) -> tuple[int, int, int]:
        """(token block, first column, end column) of combine_reduce task q in a call with `tokens`
        tokens on this rank (combine_task_split); a block >= cdiv(tokens, block_t) is empty."""
        d, h = self.device, self.routing.hidden
        slices, cols = combine_task_split(d.stage("combine_reduce").num_tasks, tokens, d.block_t, h,
                                          self.core.block_h)
        j = q % slices
        return q // slices, j * cols, min((j + 1) * cols, h)

    def index_space_size(self, key: str) -> int:
        """Words a family indexed by `key` needs on each rank."""
        return index_space_size(key, self.routing, self.device.n_row_tiles_max)

    def describe(self) -> str:
        r = self.routing
        head = (f"MoEPlan [{'verified' if self.verified else 'NOT verified'}]  W={r.world_size} "
                f"E={r.num_experts} K={r.topk} H={r.hidden} I={r.ffn_hidden} {r.dtype} "
                f"max_tokens={r.max_tokens}  schedule={self.device.schedule}")
        lines = [head, r.describe(), self.device.describe()]
        if self.device.has_stage("combine_reduce"):
            n = self.device.stage("combine_reduce").num_tasks
            t_one = min(self.device.block_t, r.max_tokens)  # a call that fills one block
            slices, cols = combine_task_split(n, t_one, self.device.block_t, r.hidden, self.core.block_h)
            lines.append(f"  combine_reduce in a call with fewer tokens: its token blocks take the stage's {n} "
                         f"tasks as column slices (T={t_one}: {slices} slices of {cols} columns)")
        return "\n".join(lines + [self.core.describe()])

    __str__ = describe


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """The op to plan: one EP MoE forward (dispatch -> SwiGLU FFN -> combine).

    Shapes: world_size ranks, num_experts experts in all (a multiple of world_size), topk slots
    per token, hidden H, ffn_hidden I, at most max_tokens tokens per rank. dtype names the
    activation dtype ("bfloat16", "float16", "float32"); device_type is "cuda", "hip" or "cpu"
    (Triton interpreter). Every other field is an optional override of a decision the lowering
    makes (None: its default).
    """

    world_size: int
    num_experts: int
    topk: int
    hidden: int
    ffn_hidden: int
    max_tokens: int
    dtype: str = "bfloat16"
    device_type: str = "cuda"
    schedule: str = "overlap"
    # Task level
    chunk_rows: int | None = None
    ranks_per_node: int | None = None
    # Device level
    num_programs: int | None = None
    comm_programs: int | None = None
    recv_lag: int | None = None
    source_order: str | None = None
    gemm_tile_order: str | None = None
    gemm_group_rows: int | None = None  # row tiles a group when gemm_tile_order="grouped"
    combine_fused: bool | None = None
    block_t: int | None = None
    heap_bytes: int | None = None
    # Core level
    gate_up_config: GemmTileConfig | None = None
    down_config: GemmTileConfig | None = None
    block_h: int | None = None

    def check(self) -> None:
        """Raise ValueError, saying what to fix, unless the spec describes a plannable op."""
        for name in ("world_size", "num_experts", "topk", "hidden", "ffn_hidden", "max_tokens"):
            if not is_positive_int(getattr(self, name)):
                raise ValueError(f"MoESpec.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.num_experts % self.world_size:
            raise ValueError(f"num_experts={self.num_experts} is not a multiple of world_size="
                             f"{self.world_size}; choose E = k * {self.world_size}")
        if self.topk > self.num_experts:
            raise ValueError(f"topk={self.topk} exceeds num_experts={self.num_experts}")
        if self.dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"dtype must be one of {ACTIVATION_DTYPES}, got {self.dtype!r}")
        if self.device_type not in DEVICE_TYPES:
            raise ValueError(f"device_type must be one of {DEVICE_TYPES}, got {self.device_type!r}")
        for name, allowed in (("schedule", SCHEDULES), ("source_order", SOURCE_ORDERS),
                              ("gemm_tile_order", GEMM_TILE_ORDERS)):
            v = getattr(self, name)
            if v is not None and v not in allowed:
                raise ValueError(f"MoESpec.{name} must be one of {allowed}, got {v!r}")
        for name in ("chunk_rows", "block_t", "block_h"):
            v = getattr(self, name)
            if v is not None and not is_pow2(v):
                raise ValueError(f"MoESpec.{name} must be a power of two, got {v!r}")
        for name in ("num_programs", "gemm_group_rows"):
            v = getattr(self, name)
            if v is not None and not is_positive_int(v):
                raise ValueError(f"MoESpec.{name} must be an int >= 1, got {v!r}")
        for name in ("comm_programs", "recv_lag"):
            v = getattr(self, name)
            if v is not None and not is_nonnegative_int(v):
                raise ValueError(f"MoESpec.{name} must be an int >= 0, got {v!r}")
        if self.ranks_per_node is not None and (not is_positive_int(self.ranks_per_node)
                                                or self.world_size % self.ranks_per_node):
            raise ValueError(f"MoESpec.ranks_per_node must divide world_size={self.world_size}, "
                             f"got {self.ranks_per_node!r}")


def _by_name(items, name: str, what: str):
    for item in items:
        if item.name == name:
            return item
    raise KeyError(f"no {what} named {name!r}; have {[i.name for i in items]}")


def _formula(name: str, count: int | None) -> str:
    return name if count is None or name == str(count) else f"{count} ({name})"


def _human(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
