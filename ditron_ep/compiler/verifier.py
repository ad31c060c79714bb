"""The plan verifier: structural checks of every level, and concrete checks for a routing instance.

`verify(plan)` checks, without a routing:
  1. queue order and the progress rule: every wait's producer is an earlier stage, of this rank
     ("local") or of any rank ("remote"), never the same or a later stage;
  2. counts: every wait's expected value equals what the notifies aimed at its family add up to
     (formulas: amount x hits summed over the notifying specs);
  3. buffers are aligned, disjoint and fit heap_bytes; signal families are disjoint, fit
     num_signals and cover their index space;
  4. schedule="sequential" has a stage barrier before every stage but the first (local, plus
     cross-rank before CROSS_RANK_BARRIER_BEFORE); "overlap" has none;
  5. parameters: num_programs >= 1, powers of two, n_chunks and tile counts match their formulas.

`verify_instance(plan, topk_idx_per_rank)` builds, in plain Python, every rank's concrete task
queue for one routing (which row tiles exist and their rows, which (token, k) are routed), lists
every individual wait and every notify (by interpreting the plan's wait / notify vocabulary),
and checks that each wait's expected value equals the sum of the notifies aimed at it, that
every contributing notify comes from an earlier task of the waiter's queue or from another rank's
earlier stage, that every notify is waited on, and that each notify spec's hits match its claim.

Both raise `PlanError` (a ValueError) naming the stage, signal or buffer.
"""
from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from typing import Sequence

import torch

from ditron_ep.compiler.plan import (
    COMM_STAGES,
    CROSS_RANK_BARRIER_BEFORE,
    DTYPE_BYTES,
    DYNAMIC_FORMULAS,
    GEMM_TILE_ORDERS,
    INDEX_SPACES,
    NOTIFY_ELEMENTS,
    SCHEDULES,
    SOURCE_ORDERS,
    STAGE_NAMES,
    WAIT_ELEMENTS,
    CorePlan,
    MoEPlan,
    PlanError,
    RoutingPlan,
    StagePlan,
    cdiv,
    is_dynamic_formula,
    is_nonnegative_int,
    is_positive_int,
    is_pow2,
    numel,
    row_tiles_bound,
    ticketed_stage,
)
from ditron_ep.runtime import control as C

__all__ = ["PlanError", "verify", "verify_core", "verify_device", "verify_instance",
           "verify_routing"]

# Counters must stay far from int32 wrap-around (signals are compared in int32).
_MAX_COUNT = 1 << 30


def verify(plan: MoEPlan) -> None:
    """Check every level of `plan`; raise PlanError naming the culprit."""
    verify_routing(plan.routing)
    verify_core(plan.core, plan.routing)
    verify_device(plan)


# ============================================================================================
# Task and core levels
# ============================================================================================
def verify_routing(r: RoutingPlan) -> None:
    for name in ("world_size", "num_experts", "experts_per_rank", "topk", "max_tokens", "hidden",
                 "ffn_hidden", "chunk_rows", "n_chunks", "ranks_per_node"):
        if not is_positive_int(getattr(r, name)):
            raise PlanError(f"routing.{name} must be a positive int, got {getattr(r, name)!r}")
    if r.experts_per_rank * r.world_size != r.num_experts:
        raise PlanError(f"routing.experts_per_rank={r.experts_per_rank} x world_size={r.world_size} "
                        f"!= num_experts={r.num_experts}")
    if r.topk > r.num_experts:
        raise PlanError(f"routing.topk={r.topk} exceeds num_experts={r.num_experts}")
    if r.dtype not in DTYPE_BYTES:
        raise PlanError(f"routing.dtype {r.dtype!r} unknown; use one of {tuple(DTYPE_BYTES)}")
    if not is_pow2(r.chunk_rows):
        raise PlanError(f"routing.chunk_rows must be a power of two, got {r.chunk_rows}")
    if r.n_chunks != cdiv(r.max_tokens, r.chunk_rows):
        raise PlanError(f"routing.n_chunks={r.n_chunks} != cdiv(max_tokens={r.max_tokens}, "
                        f"chunk_rows={r.chunk_rows}) = {cdiv(r.max_tokens, r.chunk_rows)}")
    if r.world_size % r.ranks_per_node:
        raise PlanError(f"routing.ranks_per_node={r.ranks_per_node} does not divide "
                        f"world_size={r.world_size}")


def verify_core(core: CorePlan, routing: RoutingPlan) -> None:
    if core.gate_up.block_m != core.down.block_m:
        raise PlanError(f"core: gate_up.block_m={core.gate_up.block_m} != down.block_m="
                        f"{core.down.block_m}; both GEMMs share the row tiles (rows_ready, "
                        f"gate_up_done count per row tile)")
    if core.gate_up.launch_options() != core.down.launch_options():
        raise PlanError(f"core: gate_up {core.gate_up} and down {core.down} differ in num_warps / num_stages; "
                        f"the megakernel is one launch, so both GEMM stages run with the same ones")
    if core.block_rows != routing.chunk_rows:
        raise PlanError(f"core.block_rows={core.block_rows} must equal routing.chunk_rows="
                        f"{routing.chunk_rows}: a dispatch copy block is one signalled chunk")
    if not is_pow2(core.block_h):
        raise PlanError(f"core.block_h must be a power of two, got {core.block_h}")


# ============================================================================================
# Device level
# ============================================================================================
def verify_device(plan: MoEPlan) -> None:
    _check_device_params(plan)
    _check_stages(plan)
    _check_barriers(plan)
    _check_signals(plan)
    _check_waits_and_notifies(plan)
    _check_counts(plan)
    _check_buffers(plan)


def _check_device_params(plan: MoEPlan) -> None:
    d, r, core = plan.device, plan.routing, plan.core
    for name, allowed in (("schedule", SCHEDULES), ("source_order", SOURCE_ORDERS),
                          ("gemm_tile_order", GEMM_TILE_ORDERS)):
        if getattr(d, name) not in allowed:
            raise PlanError(f"device.{name} must be one of {allowed}, got {getattr(d, name)!r}")
    if not is_positive_int(d.num_programs):
        raise PlanError(f"device.num_programs must be an int >= 1, got {d.num_programs!r}")
    first = [s.name for s in sorted(d.stages, key=lambda s: s.first_task)][:len(COMM_STAGES)]
    if d.comm_programs and tuple(first) != COMM_STAGES:
        raise PlanError(f"a role split needs the communication stages {COMM_STAGES} first in the queue, "
                        f"the queue starts with {first}")
    if not is_nonnegative_int(d.comm_programs) or d.comm_programs >= d.num_programs:
        raise PlanError(f"device.comm_programs must be an int in [0, num_programs={d.num_programs}) (0: one "
                        f"queue; otherwise at least one program must start on the compute queue), "
                        f"got {d.comm_programs!r}")
    n_send = d.stage("dispatch_send").num_tasks if d.has_stage("dispatch_send") else 0
    if not is_nonnegative_int(d.recv_lag):
        raise PlanError(f"device.recv_lag must be an int >= 0, got {d.recv_lag!r}")
    if d.schedule == "sequential" and d.recv_lag < n_send:
        raise PlanError(f"schedule='sequential' needs every dispatch_send before the first dispatch_recv "
                        f"(its stage barrier waits for them): recv_lag={d.recv_lag} < {n_send} send tasks")
    if not is_pow2(d.block_t):
        raise PlanError(f"device.block_t must be a power of two, got {d.block_t}")
    want_group = {"row_major": 1, "column_major": d.n_row_tiles_max}.get(d.gemm_tile_order)
    if want_group is not None and d.gemm_group_rows != want_group:
        raise PlanError(f"device.gemm_group_rows={d.gemm_group_rows!r}, but gemm_tile_order={d.gemm_tile_order} "
                        f"walks row tiles in groups of {want_group}")
    if not (is_positive_int(d.gemm_group_rows) and d.gemm_group_rows <= d.n_row_tiles_max):
        raise PlanError(f"device.gemm_group_rows must be an int in [1, n_row_tiles_max={d.n_row_tiles_max}], "
                        f"got {d.gemm_group_rows!r}")
    for name, want in (("n_row_tiles_max", row_tiles_bound(r, core.gate_up.block_m)),
                       ("n_tiles1", cdiv(r.ffn_hidden, core.gate_up.block_n)),
                       ("n_tiles2", cdiv(r.hidden, core.down.block_n))):
        if getattr(d, name) != want:
            raise PlanError(f"device.{name}={getattr(d, name)} but the routing and core tiles give {want}")


def _check_stages(plan: MoEPlan) -> None:
    d, r = plan.device, plan.routing
    names = [s.name for s in d.stages]
    if len(set(names)) != len(names):
        raise PlanError(f"stage names repeat: {names}")
    for s in d.stages:
        if s.name not in STAGE_NAMES:
            raise PlanError(f"stage {s.name!r} unknown; stages are {STAGE_NAMES}")
    want = [n for n in STAGE_NAMES if n != "combine_send" or not d.combine_fused]
    if sorted(names) != sorted(want):
        raise PlanError(f"combine_fused={d.combine_fused} needs stages {want}, plan has {names}")
    extents = {"dest_pos": r.world_size, "source_pos": r.world_size, "chunk": r.n_chunks,
               "row_tile": d.n_row_tiles_max, "token_block": cdiv(r.max_tokens, d.block_t),
               "row_group": cdiv(d.n_row_tiles_max, d.gemm_group_rows), "row_in_group": d.gemm_group_rows}
    gemm_grids = {("row_tile", "col_tile"): "row_major", ("col_tile", "row_tile"): "column_major",
                  ("row_group", "col_tile", "row_in_group"): "grouped"}
    first = 0
    for i, s in enumerate(d.stages):
        if s.index != i:
            raise PlanError(f"stage {s.name} has index {s.index} but is at position {i} of the queue")
        if s.first_task != first:
            raise PlanError(f"stage {s.name}: first_task={s.first_task}, but the stages before it "
                            f"hold {first} tickets")
        coords = s.coord_names()
        if s.name in ("gemm_gate_up", "gemm_down"):
            order = gemm_grids.get(tuple(c for c, _ in s.grid))
            if order != d.gemm_tile_order:
                raise PlanError(f"stage {s.name}: grid {[c for c, _ in s.grid]} is "
                                f"{order or 'no GEMM tile order'}, but gemm_tile_order={d.gemm_tile_order} "
                                f"(grids: {gemm_grids})")
        for coord, extent in s.grid:
            want_extent = extents.get(coord)
            if coord == "col_tile":
                want_extent = {"gemm_gate_up": d.n_tiles1, "gemm_down": d.n_tiles2}.get(s.name)
            if want_extent is None or extent != want_extent:
                raise PlanError(f"stage {s.name}: grid coordinate {coord}[{extent}] should be "
                                f"{coord}[{want_extent}]")
        if s.num_tasks != numel(tuple(e for _, e in s.grid)):
            raise PlanError(f"stage {s.name}: num_tasks={s.num_tasks} != product of its grid {s.grid}")
        want_skip = ("empty_row_tile" if "row_tile" in coords else
                     "chunk_past_call" if s.name in COMM_STAGES else "never")
        if s.skip != want_skip:
            raise PlanError(f"stage {s.name}: skip={s.skip!r}, expected {want_skip!r}")
        first += s.num_tasks


def _check_signals(plan: MoEPlan) -> None:
    d = plan.device
    names = [f.name for f in d.signals]
    if len(set(names)) != len(names):
        raise PlanError(f"signal family names repeat: {names}")
    end = 0
    for f in sorted(d.signals, key=lambda f: f.first):
        if f.key not in INDEX_SPACES or f.scope not in ("local", "remote") or \
                f.kind not in ("epoch_flag", "counter"):
            raise PlanError(f"signal {f.name}: key={f.key!r} scope={f.scope!r} kind={f.kind!r} "
                            f"must be in {tuple(INDEX_SPACES)} / (local, remote) / (epoch_flag, counter)")
        if f.first < end:
            raise PlanError(f"signal {f.name}: words [{f.first}, {f.first + f.count}) overlap the "
                            f"family before it (ends at {end})")
        need = plan.index_space_size(f.key)
        if f.count < need:
            raise PlanError(f"signal {f.name}: {f.count} words, but its index space {f.key} "
                            f"({INDEX_SPACES[f.key]}) needs {need}")
        end = f.first + f.count
        for role in ("producer", "consumer"):
            if not d.has_stage(getattr(f, role)):
                raise PlanError(f"signal {f.name}: {role} stage {getattr(f, role)!r} is not in the queue")
        if f.kind == "counter" and f.reset.startswith("none"):
            raise PlanError(f"signal {f.name}: a counter needs a reset before the next call")
    if end > d.num_signals:
        raise PlanError(f"signal families need {end} words, device.num_signals={d.num_signals}")


def _check_waits_and_notifies(plan: MoEPlan) -> None:
    """Rule 1 (progress) and the consistency of every wait / notify with its family."""
    d = plan.device
    notified, waited = set(), set()
    for s in d.stages:
        for w in s.waits:
            where = f"stage {s.name} waits on signal {w.signal}"
            if not d.has_stage(w.producer_stage):
                raise PlanError(f"{where}: producer stage {w.producer_stage!r} is not in the queue")
            p = d.stage(w.producer_stage)
            if w.on not in ("local", "remote"):
                raise PlanError(f"{where}: on={w.on!r} must be 'local' or 'remote'")
            rank = "this rank" if w.on == "local" else "another rank"
            if p.index == s.index:
                raise PlanError(f"{where} notified by {rank}'s tasks of the same stage "
                                f"{p.name} (S{p.index}): a wait must be on an earlier stage")
            if p.index > s.index:
                raise PlanError(f"{where} notified by {rank}'s later stage {p.name} (S{p.index} > "
                                f"S{s.index}): a wait must be on an earlier stage")
            f = _family(plan, w.signal, where)
            if (w.on == "local") != (f.scope == "local"):
                raise PlanError(f"{where}: on={w.on} but the family's scope is {f.scope}")
            if f.producer != w.producer_stage or f.consumer != s.name:
                raise PlanError(f"{where}: family {f.name} goes {f.producer} -> {f.consumer}, the wait "
                                f"says {w.producer_stage} -> {s.name}")
            _check_element(where, w.element, WAIT_ELEMENTS, f.key, s)
            if f.kind == "epoch_flag" and w.expected_count != 1:
                raise PlanError(f"{where}: an epoch flag is stamped once per call; a wait on it "
                                f"expects 1 stamp, not {w.expected_count}")
            if d.comm_programs and s.name in COMM_STAGES and p.name not in COMM_STAGES:
                raise PlanError(f"{where} notified by {p.name}, which is not on the communication queue: with "
                                f"a role split (comm_programs={d.comm_programs}) that queue must drain by "
                                f"itself, or its programs could wait on work no program will take")
            waited.add(w.signal)
        for n in s.notifies:
            where = f"stage {s.name} notifies signal {n.signal}"
            f = _family(plan, n.signal, where)
            if f.producer != s.name:
                raise PlanError(f"{where}: the family's producer is {f.producer}")
            target = _check_element(where, n.element, NOTIFY_ELEMENTS, f.key, s).target
            if n.target != target:
                raise PlanError(f"{where}: element {n.element} hits {target} words, target says {n.target}")
            if (n.target == "local") != (f.scope == "local"):
                raise PlanError(f"{where}: target={n.target} but the family's scope is {f.scope}")
            if f.kind == "epoch_flag" and n.amount != 1:
                raise PlanError(f"{where}: an epoch flag takes one stamp per hit, amount={n.amount}")
            if f.kind == "counter" and not 1 <= n.amount < _MAX_COUNT:
                raise PlanError(f"{where}: amount={n.amount} must be in [1, 2^30)")
            notified.add(n.signal)
    for f in d.signals:
        if f.name not in notified or f.name not in waited:
            missing = "never notified" if f.name not in notified else "never waited on"
            raise PlanError(f"signal {f.name}: {missing}")


def _check_counts(plan: MoEPlan) -> None:
    """Rule 2, on formulas: expected value == sum over notify specs of amount x hits."""
    env = plan.static_env()
    totals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for s in plan.device.stages:
        for n in s.notifies:
            where = f"stage {s.name} notifies signal {n.signal}"
            hits = _term(where, "hits", n.hits, n.hits_count, env)
            for sym, coef in hits.items():
                totals[n.signal][sym] += n.amount * coef
    for s in plan.device.stages:
        for w in s.waits:
            where = f"stage {s.name} waits on signal {w.signal}"
            expected = _term(where, "expected", w.expected, w.expected_count, env)
            got = {k: v for k, v in totals[w.signal].items() if v}
            if expected != got:
                raise PlanError(f"{where}: expects {_show(expected)} but the notifies aimed at it "
                                f"add up to {_show(got)}")
            if sum(expected.values()) >= _MAX_COUNT:
                raise PlanError(f"{where}: expected count {_show(expected)} nears int32 wrap-around")


def _check_barriers(plan: MoEPlan) -> None:
    """Rule 4: sequential = a barrier before every stage but the first; overlap = none."""
    d = plan.device
    for k, s in enumerate(d.stages):
        barrier_waits = [w for w in s.waits if w.element in ("single", "all_ranks")]
        if d.schedule == "overlap" or k == 0:
            if s.barrier_before or barrier_waits:
                raise PlanError(f"stage {s.name}: {'overlap plans have' if k else 'the first stage has'} "
                                f"no stage barrier, but barrier_before={s.barrier_before} and "
                                f"barrier waits {[w.signal for w in barrier_waits]}")
            continue
        prev = d.stages[k - 1]
        if not s.barrier_before:
            raise PlanError(f"stage {s.name}: schedule=sequential needs a stage barrier before it "
                            f"(barrier_before=False)")
        if not any(w.element == "single" and w.on == "local" and w.producer_stage == prev.name
                   for w in barrier_waits):
            raise PlanError(f"stage {s.name}: schedule=sequential, but it does not wait for every "
                            f"task of {prev.name} on this rank (a local 'single' wait)")
        cross = any(w.element == "all_ranks" and w.producer_stage == prev.name for w in barrier_waits)
        if cross != (s.name in CROSS_RANK_BARRIER_BEFORE):
            raise PlanError(f"stage {s.name}: schedule=sequential {'needs' if not cross else 'has'} a "
                            f"cross-rank barrier on {prev.name}; only {CROSS_RANK_BARRIER_BEFORE} have one")


def _check_buffers(plan: MoEPlan) -> None:
    """Rule 3: aligned, after the signal words, disjoint, inside heap_bytes."""
    d = plan.device
    names = [b.name for b in d.buffers]
    if len(set(names)) != len(names):
        raise PlanError(f"buffer names repeat: {names}")
    prev = None
    for b in sorted(d.buffers, key=lambda b: b.offset):
        if b.dtype not in DTYPE_BYTES or b.scope not in ("symmetric", "private"):
            raise PlanError(f"buffer {b.name}: dtype {b.dtype!r} / scope {b.scope!r} unknown")
        if b.nbytes != numel(b.shape) * DTYPE_BYTES[b.dtype]:
            raise PlanError(f"buffer {b.name}: nbytes={b.nbytes} but {b.dtype}{list(b.shape)} takes "
                            f"{numel(b.shape) * DTYPE_BYTES[b.dtype]}")
        if b.offset % C.ALIGN:
            raise PlanError(f"buffer {b.name}: offset {b.offset} is not {C.ALIGN}-byte aligned")
        if b.offset < d.data_offset:
            raise PlanError(f"buffer {b.name}: offset {b.offset} is inside the control block / "
                            f"signal words (buffers start at {d.data_offset})")
        if prev is not None and b.offset < prev.offset + prev.nbytes:
            raise PlanError(f"buffer {b.name} [{b.offset}, {b.offset + b.nbytes}) overlaps buffer "
                            f"{prev.name} [{prev.offset}, {prev.offset + prev.nbytes})")
        if b.offset + b.nbytes > d.heap_bytes:
            raise PlanError(f"buffer {b.name} ends at byte {b.offset + b.nbytes}, beyond "
                            f"heap_bytes={d.heap_bytes}")
        prev = b


# ============================================================================================
# Routing instances
# ============================================================================================
@dataclasses.dataclass(frozen=True)
class _Task:
    rank: int
    stage: StagePlan
    pos: int                 # ticket in the rank's queue
    coords: dict

    def __str__(self) -> str:
        c = ", ".join(f"{k}={v}" for k, v in self.coords.items())
        return f"rank {self.rank} {self.stage.name}({c}) [ticket {self.pos}]"


class _Instance:
    """One routing, as the megakernel sees it: staging slots, GEMM rows and row tiles per rank."""

    def __init__(self, plan: MoEPlan, topk_idx_per_rank: Sequence[torch.Tensor]) -> None:
        r = plan.routing
        W, K, E, El, BS = r.world_size, r.topk, r.num_experts, r.experts_per_rank, r.chunk_rows
        BM = plan.core.gate_up.block_m
        if len(topk_idx_per_rank) != W:
            raise PlanError(f"verify_instance: {len(topk_idx_per_rank)} topk_idx tensors for "
                            f"world_size={W}; pass one per rank")
        self.idx: list[list[list[int]]] = []
        for s, t in enumerate(topk_idx_per_rank):
            if t.ndim != 2 or t.shape[1] != K or t.shape[0] > r.max_tokens:
                raise PlanError(f"verify_instance: rank {s} topk_idx has shape {tuple(t.shape)}, "
                                f"needs [T <= max_tokens={r.max_tokens}, topk={K}]")
            rows = t.tolist()
            if any(not -1 <= e < E for row in rows for e in row):
                raise PlanError(f"verify_instance: rank {s} topk_idx holds ids outside [-1, {E})")
            self.idx.append(rows)
        # Staging slot of token t of rank s on rank d: its rank among the tokens s sends to d.
        slot = [[dict() for _ in range(W)] for _ in range(W)]  # slot[s][d][t]
        for s in range(W):
            for t, row in enumerate(self.idx[s]):
                for d in sorted({e // El for e in row if e >= 0}):
                    slot[s][d][t] = len(slot[s][d])
        # GEMM rows of local expert e on rank d, ordered by (source rank, source token).
        self.tiles: list[list[list[tuple[int, int, int]]]] = []   # [d][i] -> rows (s, t, k)
        self.placed: list[dict] = []                              # [d][(s, c)] -> tile per row
        for d in range(W):
            tiles, placed = [], defaultdict(list)
            for e in range(El):
                rows = [(s, t, k) for s in range(W) for t, row in enumerate(self.idx[s])
                        for k, g in enumerate(row) if g == d * El + e]
                for b in range(0, len(rows), BM):
                    for (s, t, k) in rows[b:b + BM]:
                        placed[(s, slot[s][d][t] // BS)].append(len(tiles))
                    tiles.append(rows[b:b + BM])
            if len(tiles) > plan.device.n_row_tiles_max:
                raise PlanError(f"stage gemm_gate_up: rank {d} gets {len(tiles)} row tiles, above the "
                                f"host bound n_row_tiles_max={plan.device.n_row_tiles_max}")
            self.tiles.append(tiles)
            self.placed.append(placed)

    def rows_in_tile(self, rank: int, i: int) -> int:
        return len(self.tiles[rank][i]) if i < len(self.tiles[rank]) else 0


def _notify_targets(plan: MoEPlan, inst: _Instance, task: _Task, element: str,
                    last_of_stage: bool) -> list[tuple[int, int]]:
    """(rank, word) hit by `task` for a notify of `element` (one entry per hit)."""
    c, me, K = task.coords, task.rank, plan.routing.topk
    if element == "src_chunk@dest":
        return [(plan.dest_of(me, c["dest_pos"]), me * plan.routing.n_chunks + c["chunk"])]
    if element == "row_tile/placed_row":
        return [(me, i) for i in inst.placed[me].get((plan.source_of(me, c["source_pos"]), c["chunk"]), ())]
    if element == "row_tile":
        return [(me, c["row_tile"])] if c["row_tile"] < len(inst.tiles[me]) else []
    if element == "token_slot@source/tile_row":
        i = c["row_tile"]
        return [(s, t * K + k) for s, t, k in inst.tiles[me][i]] if i < len(inst.tiles[me]) else []
    if element == "single":
        return [(me, 0)]
    if element == "this_rank@all_ranks/stage_end":
        return [(d, me) for d in range(plan.routing.world_size)] if last_of_stage else []
    raise PlanError(f"stage {task.stage.name}: notify element {element!r} unknown")


def _wait_words(plan: MoEPlan, inst: _Instance, task: _Task, element: str) -> list[int]:
    """Words of the task's own rank that `task` waits on for a wait of `element`."""
    c, me, r = task.coords, task.rank, plan.routing
    if element == "src_chunk":
        return [plan.source_of(me, c["source_pos"]) * r.n_chunks + c["chunk"]]
    if element == "row_tile":
        return [c["row_tile"]] if c["row_tile"] < len(inst.tiles[me]) else []
    if element == "token_slot/block":
        # the call's tokens decide which block task q reduces (MoEPlan.combine_task). Not modelled:
        # each slice's +1 after its wait and the last slice's reset of the counters (checked by
        # the reruns in tests/ops/test_moe_fused.py and tests/gpu/test_moe_gpu.py)
        bt, n_tok = plan.device.block_t, len(inst.idx[me])
        b = plan.combine_task(c["token_block"], n_tok)[0]
        return [t * r.topk + k for t in range(b * bt, (b + 1) * bt)
                if t < n_tok for k, g in enumerate(inst.idx[me][t]) if g >= 0]
    if element == "single":
        return [0]
    if element == "all_ranks":
        return list(range(r.world_size))
    raise PlanError(f"stage {task.stage.name}: wait element {element!r} unknown")


def verify_instance(plan: MoEPlan, topk_idx_per_rank: Sequence[torch.Tensor]) -> None:
    """Check `plan` on one concrete routing (`topk_idx_per_rank[s]`: int [T_s, topk] of rank s,
    -1 = dropped slot): every individual wait's expected value equals the notifies aimed at it,
    all of which come from earlier tasks of the waiter's queue or from other ranks' earlier
    stages; every notify is waited on; every notify spec's hits per word match its formula.
    Raises PlanError naming the rank, task, stage and signal."""
    d, W = plan.device, plan.routing.world_size
    inst = _Instance(plan, topk_idx_per_rank)
    families = {f.name: f for f in d.signals}
    # Only ticketed tasks run: a stage that skips empty row tiles takes positions [0, max(n, 1))
    # of the rank's n row tiles (the kernel's n_pos), all of them in plan order; the dispatch
    # stages take the chunks below the call's largest T over all ranks (at least one chunk).
    n_call = plan.dispatch_chunks(max(len(rows) for rows in inst.idx))

    def ticketed(t: _Task) -> bool:
        if t.stage.skip == "chunk_past_call":
            return t.coords["chunk"] < n_call
        return t.stage.skip != "empty_row_tile" or t.coords["row_tile"] < max(len(inst.tiles[t.rank]), 1)

    queues = [list(filter(ticketed, (_Task(rank, s, s.first_task + q, s.coords(q))
                                     for s in d.stages for q in range(s.num_tasks))))
              for rank in range(W)]
    n_ticketed = [Counter(t.stage.name for t in queue) for queue in queues]
    last_of_stage = {(t.rank, t.stage.name): t.pos for queue in queues for t in queue}

    def value(stage: str, formula: str, count: int | None, rank: int, word: int) -> int:
        if count is not None:
            return count
        if formula == "rows_in_tile":
            return inst.rows_in_tile(rank, word)
        if ticketed_stage(formula) in STAGE_NAMES:
            return n_ticketed[rank][ticketed_stage(formula)]
        raise PlanError(f"stage {stage}: dynamic formula {formula!r} unknown; have {DYNAMIC_FORMULAS}")

    def check_word(task: _Task, verb: str, signal: str, rank: int, word: int) -> None:
        f = families.get(signal)
        if f is None:
            raise PlanError(f"{task} {verb} {signal}: no signal family {signal!r}")
        if not (0 <= rank < W and 0 <= word < f.count):
            raise PlanError(f"{task} {verb} {signal}: word {word} on rank {rank} is outside signal "
                            f"{signal} ({f.count} words, {W} ranks)")

    # Every notify: (rank, signal, word) -> [(task, amount)]; hits per (stage, spec).
    notifies: dict[tuple[int, str, int], list[tuple[_Task, int]]] = defaultdict(list)
    hits: dict[tuple[str, int], dict[tuple[int, int], int]] = defaultdict(lambda: defaultdict(int))
    for queue in queues:
        for task in queue:
            s = task.stage
            last = task.pos == last_of_stage[(task.rank, s.name)]
            for j, n in enumerate(s.notifies):
                for rank, word in _notify_targets(plan, inst, task, n.element, last):
                    check_word(task, "notifies", n.signal, rank, word)
                    notifies[(rank, n.signal, word)].append((task, n.amount))
                    hits[(s.name, j)][(rank, word)] += 1

    # Every wait: expected value == notifies aimed at it, all of them from earlier work.
    waited = set()
    summary: dict[tuple[int, str, int], tuple[int, _Task | None, _Task | None]] = {}
    for queue in queues:
        for task in queue:
            for w in task.stage.waits:
                for word in _wait_words(plan, inst, task, w.element):
                    check_word(task, "waits on", w.signal, task.rank, word)
                    key = (task.rank, w.signal, word)
                    waited.add(key)
                    if key not in summary:
                        summary[key] = _summarize(task.rank, notifies.get(key, []))
                    got, latest_local, latest_remote = summary[key]
                    expected = value(task.stage.name, w.expected, w.expected_count, task.rank, word)
                    if got != expected:
                        raise PlanError(f"{task} waits on {w.signal}[{word}]: expects {expected} "
                                        f"({w.expected}) but the notifies aimed at it add up to {got}")
                    _check_progress(task, w.signal, word, latest_local, latest_remote)
    for (rank, signal, word), sources in notifies.items():
        if (rank, signal, word) not in waited:
            raise PlanError(f"signal {signal}[{word}] on rank {rank} is notified by {sources[0][0]} "
                            f"but no task waits on it (the count would carry into the next call)")
    # Every notify spec: hits per word as its formula claims.
    for s in d.stages:
        for j, n in enumerate(s.notifies):
            for (rank, word), h in hits[(s.name, j)].items():
                want = value(s.name, n.hits, n.hits_count, rank, word)
                if h != want:
                    raise PlanError(f"stage {s.name} notifies signal {n.signal}: claims {want} hits "
                                    f"({n.hits}) per word, but {n.signal}[{word}] on rank {rank} "
                                    f"gets {h}")


def _summarize(rank: int, sources: list[tuple[_Task, int]]) -> tuple[int, _Task | None, _Task | None]:
    """(sum of amounts, latest notifier of `rank` by ticket, latest other-rank notifier by stage)."""
    local = [t for t, _ in sources if t.rank == rank]
    remote = [t for t, _ in sources if t.rank != rank]
    return (sum(a for _, a in sources), max(local, key=lambda t: t.pos, default=None),
            max(remote, key=lambda t: t.stage.index, default=None))


def _check_progress(waiter: _Task, signal: str, word: int, latest_local: _Task | None,
                    latest_remote: _Task | None) -> None:
    """Rule 1 on concrete tasks: same rank -> earlier ticket; other rank -> earlier stage."""
    if latest_local is not None and latest_local.pos >= waiter.pos:
        raise PlanError(f"{waiter} waits on {signal}[{word}]: notified by {latest_local}, a later "
                        f"task of its own queue — the interpreter would hang, a GPU may deadlock")
    if latest_remote is not None and latest_remote.stage.index >= waiter.stage.index:
        rel = "the same" if latest_remote.stage.index == waiter.stage.index else "a later"
        raise PlanError(f"{waiter} waits on {signal}[{word}]: notified by {latest_remote}, another "
                        f"rank's task of {rel} stage — no progress guarantee")


# ============================================================================================
# Helpers
# ============================================================================================
def _family(plan: MoEPlan, name: str, where: str):
    try:
        return plan.device.signal(name)
    except KeyError:
        raise PlanError(f"{where}: no signal family named {name!r}") from None


def _check_element(where: str, element: str, vocab: dict, key: str, stage: StagePlan):
    """The element exists, indexes the family's index space, and the stage's grid has the task
    coordinates it reads. Returns its vocabulary entry."""
    if element not in vocab:
        raise PlanError(f"{where}: element {element!r} unknown; have {tuple(vocab)}")
    entry = vocab[element]
    if entry.key != key:
        raise PlanError(f"{where}: element {element} indexes {entry.key}, the family indexes {key}")
    coords = stage.coord_names()
    missing = [c for c in entry.needs if c not in coords]
    if missing:
        raise PlanError(f"{where}: element {element} needs task coordinates {missing}, stage "
                        f"{stage.name} has grid {coords}")
    return entry


def _term(where: str, what: str, formula: str, count: int | None, env: dict[str, int]) -> dict[str, int]:
    """A formula as a linear form {symbol: coefficient}; '' is the constant term."""
    if count is None:
        if not is_dynamic_formula(formula):
            raise PlanError(f"{where}: {what}={formula!r} has no static value but is not a dynamic "
                            f"formula {DYNAMIC_FORMULAS}")
        return {formula: 1}
    if formula not in env:
        raise PlanError(f"{where}: {what} formula {formula!r} unknown; have {sorted(env)} and "
                        f"{DYNAMIC_FORMULAS}")
    if env[formula] != count:
        raise PlanError(f"{where}: {what}_count={count} but {formula} = {env[formula]}")
    return {"": count}


def _show(form: dict[str, int]) -> str:
    parts = [str(v) if k == "" else (k if v == 1 else f"{v}*{k}") for k, v in sorted(form.items())]
    return " + ".join(parts) or "0"
