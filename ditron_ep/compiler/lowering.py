"""Lowering: `MoESpec` -> verified `MoEPlan`, as one chain of named passes.

    spec --apply_overrides--> spec
         --fill_defaults-->   spec with every decision made
         --plan_routing-->    RoutingPlan                 (task level)      verify_routing
         --plan_core-->       CorePlan                    (core level)      verify_core
         --plan_queue-->      stages + signal families    (device level)
         --insert_stage_barriers (schedule="sequential")
         --number_stages / assign_signal_words / place_buffers --> DevicePlan   verify_device
         --seal-->            MoEPlan with verified_digest

The core level is chosen before the device level because the device level counts its GEMM
tasks and row-tile signals in tiles: n_row_tiles_max, n_tiles1 and n_tiles2 are functions of the
tile shapes.
"""
from __future__ import annotations

import dataclasses

import torch

from ditron_ep.compiler.core_config import default_gemm_configs
from ditron_ep.compiler.plan import (
    CROSS_RANK_BARRIER_BEFORE,
    DTYPE_BYTES,
    BufferPlacement,
    CorePlan,
    DevicePlan,
    MoEPlan,
    MoESpec,
    NotifySpec,
    RoutingPlan,
    SignalFamily,
    StagePlan,
    WaitSpec,
    cdiv,
    index_space_size,
    numel,
    row_tiles_bound,
)
from ditron_ep.compiler.verifier import verify, verify_core, verify_device, verify_routing
from ditron_ep.runtime import control as C

__all__ = ["DEFAULT_NUM_PROGRAMS", "OVERRIDABLE", "default_block_t", "default_comm_programs", "fill_defaults", "lower",
           "seal"]

# Persistent grid when the spec does not say: one program per SM / CU of the lent GPUs (H100 and
# H200: 132 SMs; MI300X: 304 CUs); 2 under the interpreter (two programs interleave the queue).
# Override with the device's count: every program must be resident, or spinning ones starve.
DEFAULT_NUM_PROGRAMS = {"cuda": 132, "hip": 304, "cpu": 2}
DEFAULT_CHUNK_ROWS = 16
DEFAULT_BLOCK_T = 16
# The megakernel's GEMM tasks walk the row tiles in groups of 8 (plan.GEMM_TILE_ORDERS): the
# programs sharing a weight column block take consecutive tickets. Programs take tickets as they
# free up, and with the role split a quarter of them join the GEMM late, so in row-major order
# the sharers of a column block drift apart; at T=4096 on 2xH200 a gate-up tile then took 94-99 us
# (median) against 88.5-92 us in groups of 8 (4: 91-93, 16: 90.5-95), and a call 6.03-6.08 ms
# against 5.70-5.80 (bench/results/moe_timeline_H200x2_20261122_s9_tile_order.log). The
# interpreter gets 2 so that small test shapes have several groups, short ones too.
DEFAULT_GEMM_TILE_ORDER = "grouped"
DEFAULT_GEMM_GROUP_ROWS = {"cuda": 8, "hip": 8, "cpu": 2}

# Spec fields `lower(spec, **overrides)` accepts: the decisions, not the op's shapes.
OVERRIDABLE = ("schedule", "chunk_rows", "ranks_per_node", "num_programs", "comm_programs", "recv_lag",
               "source_order",
               "gemm_tile_order", "gemm_group_rows", "combine_fused", "block_t", "heap_bytes", "gate_up_config",
               "down_config", "block_h")


def lower(spec: MoESpec, **overrides) -> MoEPlan:
    """Plan one EP MoE forward and verify it.

    Args:
        spec: the op (shapes, dtype, device type, schedule) and optional decision overrides.
        **overrides: more overrides of the `OVERRIDABLE` spec fields (e.g. num_programs=64,
            combine_fused=False); they win over the spec's.

    Returns:
        a verified MoEPlan (`plan.verified` is True).

    Raises:
        ValueError: the spec or an override is invalid; PlanError (a ValueError) if the plan
            breaks an invariant (e.g. a heap_bytes override too small for the buffers).
    """
    spec = fill_defaults(apply_overrides(spec, overrides))
    routing = plan_routing(spec)
    verify_routing(routing)
    core = plan_core(spec, routing)
    verify_core(core, routing)
    stages, families = plan_queue(spec, routing, core)
    if spec.schedule == "sequential":
        stages, families = insert_stage_barriers(stages, families, routing)
    stages, families = number_stages(stages), assign_signal_words(families)
    n_rt = row_tiles_bound(routing, core.gate_up.block_m)
    device = DevicePlan(
        schedule=spec.schedule, num_programs=spec.num_programs, comm_programs=spec.comm_programs,
        recv_lag=spec.recv_lag, source_order=spec.source_order,
        gemm_tile_order=spec.gemm_tile_order,
        gemm_group_rows=gemm_group_rows(spec, n_rt),
        combine_fused=spec.combine_fused,
        block_t=spec.block_t, n_row_tiles_max=n_rt,
        n_tiles1=cdiv(routing.ffn_hidden, core.gate_up.block_n),
        n_tiles2=cdiv(routing.hidden, core.down.block_n),
        stages=stages, signals=families, num_signals=sum(f.count for f in families),
        buffers=(), heap_bytes=0)
    buffers, heap_bytes = place_buffers(routing, device, core)
    device = dataclasses.replace(device, buffers=buffers, heap_bytes=spec.heap_bytes or heap_bytes)
    plan = MoEPlan(routing, device, core)
    verify_device(plan)
    return dataclasses.replace(plan, verified_digest=plan.digest())


def seal(plan: MoEPlan) -> MoEPlan:
    """Run the whole verifier on `plan` (built or edited by hand) and return
    it marked verified. Raises PlanError naming the culprit otherwise."""
    verify(plan)
    return dataclasses.replace(plan, verified_digest=plan.digest())


# ============================================================================================
# Passes
# ============================================================================================
def apply_overrides(spec: MoESpec, overrides: dict) -> MoESpec:
    unknown = sorted(set(overrides) - set(OVERRIDABLE))
    if unknown:
        raise ValueError(f"lower() cannot override {unknown}: only decisions {OVERRIDABLE} can be; "
                         f"change the op's shapes with dataclasses.replace(spec, ...)")
    return dataclasses.replace(spec, **overrides) if overrides else spec


def fill_defaults(spec: MoESpec) -> MoESpec:
    """Check the spec and decide every field it leaves open (None), at every level."""
    spec.check()
    if spec.gemm_group_rows is not None and spec.gemm_tile_order not in (None, "grouped"):
        raise ValueError(f"gemm_group_rows={spec.gemm_group_rows} sizes the groups of gemm_tile_order='grouped', "
                         f"but gemm_tile_order={spec.gemm_tile_order!r}; drop one of the two")
    gate_up, down = default_gemm_configs(getattr(torch, spec.dtype), spec.device_type)
    # A copy / reduce block moves 1 KiB of each row: 512 columns of 2-byte values, 256 of fp32.
    block_h = min(1024 // DTYPE_BYTES[spec.dtype], 1 << (spec.hidden - 1).bit_length())
    decided = {
        "chunk_rows": DEFAULT_CHUNK_ROWS, "ranks_per_node": spec.world_size,
        "num_programs": DEFAULT_NUM_PROGRAMS[spec.device_type], "source_order": "ring",
        "gemm_tile_order": "grouped" if spec.gemm_group_rows is not None else DEFAULT_GEMM_TILE_ORDER,
        "combine_fused": True,
        "gate_up_config": gate_up, "down_config": down, "block_h": block_h,
    }
    spec = dataclasses.replace(spec, **{k: v for k, v in decided.items() if getattr(spec, k) is None})
    if spec.gemm_tile_order == "grouped" and spec.gemm_group_rows is None:  # other orders leave it None
        spec = dataclasses.replace(spec, gemm_group_rows=DEFAULT_GEMM_GROUP_ROWS[spec.device_type])
    if spec.block_t is None:
        spec = dataclasses.replace(spec, block_t=default_block_t(spec.max_tokens, spec.num_programs))
    if spec.comm_programs is None:
        spec = dataclasses.replace(spec, comm_programs=default_comm_programs(spec.num_programs))
    if spec.recv_lag is None:
        spec = dataclasses.replace(spec, recv_lag=default_recv_lag(spec))
    return spec


def default_recv_lag(spec: MoESpec) -> int:
    """Overlap: a receive trails its send by one wave of the programs that take dispatch tasks
    (by then the chunk has usually landed). Sequential: every send first (its stage barrier
    waits for all of them)."""
    if spec.schedule == "sequential":
        return spec.world_size * cdiv(spec.max_tokens, spec.chunk_rows)
    return spec.comm_programs or spec.num_programs


def gemm_group_rows(spec: MoESpec, n_row_tiles: int) -> int:
    """Row tiles a group of the GEMM task order (plan.GEMM_TILE_ORDERS): row_major 1, column_major
    all of them, grouped the spec's (at most all of them)."""
    if spec.gemm_tile_order == "grouped":
        return min(spec.gemm_group_rows, n_row_tiles)
    return 1 if spec.gemm_tile_order == "row_major" else n_row_tiles


def default_block_t(max_tokens: int, num_programs: int) -> int:
    """Tokens per combine_reduce task: DEFAULT_BLOCK_T, halved (down to 1) while the stage would
    have fewer tasks than programs. The stage starts when the last down tiles land, so its tasks
    all run at once: at T=128, 8 tasks of 16 tokens left 124 of 132 SMs idle and took ~105 µs;
    128 tasks of one token took ~40 µs. At T=4096, 16 tokens (256 tasks) beat 4 and 1 (2xH200,
    bench/results/moe_timeline_H200x2_20261122_s6_*)."""
    block_t = DEFAULT_BLOCK_T
    while block_t > 1 and cdiv(max_tokens, block_t) < num_programs:
        block_t //= 2
    return block_t


def default_comm_programs(num_programs: int) -> int:
    """A quarter of the grid starts on the communication queue (33 of an H200's 132 SMs: enough
    to keep NVLink busy with sends while the rest runs the GEMM tiles of rows already here); at
    least one, and none (one shared queue) for a grid of one program."""
    return 0 if num_programs < 2 else max(1, num_programs // 4)


def plan_routing(spec: MoESpec) -> RoutingPlan:
    """Task level: group shapes and dispatch chunking."""
    return RoutingPlan(
        world_size=spec.world_size, num_experts=spec.num_experts,
        experts_per_rank=spec.num_experts // spec.world_size, topk=spec.topk,
        max_tokens=spec.max_tokens, hidden=spec.hidden, ffn_hidden=spec.ffn_hidden,
        dtype=spec.dtype, chunk_rows=spec.chunk_rows,
        n_chunks=cdiv(spec.max_tokens, spec.chunk_rows), ranks_per_node=spec.ranks_per_node)


def plan_core(spec: MoESpec, routing: RoutingPlan) -> CorePlan:
    """Core level: the GEMM tile programs and the copy blocks (dispatch copies chunk_rows rows)."""
    from ditron_ep.compiler.tuner import planned_expert_gemms

    return CorePlan(gate_up=spec.gate_up_config, down=spec.down_config,
                    block_rows=routing.chunk_rows, block_h=spec.block_h,
                    expert_gemms=planned_expert_gemms(spec))


def plan_queue(spec: MoESpec, routing: RoutingPlan,
               core: CorePlan) -> tuple[list[StagePlan], list[SignalFamily]]:
    """Device level: the stages of the queue with their waits and notifies, and the signal
    families those use (index and first_task / first word are assigned by later passes)."""
    W, NC = routing.world_size, routing.n_chunks
    n_rt = row_tiles_bound(routing, core.gate_up.block_m)
    n_t1 = cdiv(routing.ffn_hidden, core.gate_up.block_n)
    n_t2 = cdiv(routing.hidden, core.down.block_n)
    fused = spec.combine_fused

    def gemm_grid(n_cols: int) -> tuple[tuple[str, int], ...]:
        if spec.gemm_tile_order == "grouped":
            g = gemm_group_rows(spec, n_rt)  # rows past n_rt in the last group: tasks never ticketed
            return ("row_group", cdiv(n_rt, g)), ("col_tile", n_cols), ("row_in_group", g)
        grid = (("row_tile", n_rt), ("col_tile", n_cols))
        return grid if spec.gemm_tile_order == "row_major" else grid[::-1]

    def family(name, key, scope, kind, producer, consumer, reset) -> SignalFamily:
        return SignalFamily(name, -1, index_space_size(key, routing, n_rt), key, scope, kind,
                            producer, consumer, reset)

    last_gemm = "gemm_down" if fused else "combine_send"
    land_notify = (NotifySpec("land", "remote", "token_slot@source/tile_row", 1, "n_tiles2", n_t2)
                   if fused else
                   NotifySpec("land", "remote", "token_slot@source/tile_row", n_t2, "1", 1))
    stages = [
        _stage("dispatch_send", (("dest_pos", W), ("chunk", NC)), "chunk_past_call", waits=(),
               notifies=(NotifySpec("dispatch_flag", "remote", "src_chunk@dest", 1, "1", 1),)),
        _stage("dispatch_recv", (("source_pos", W), ("chunk", NC)), "chunk_past_call",
               waits=(WaitSpec("dispatch_flag", "remote", "dispatch_send", "src_chunk", "1", 1),),
               notifies=(NotifySpec("rows_ready", "local", "row_tile/placed_row", 1,
                                    "rows_in_tile", None),)),
        _stage("gemm_gate_up", gemm_grid(n_t1), "empty_row_tile",
               waits=(WaitSpec("rows_ready", "local", "dispatch_recv", "row_tile",
                               "rows_in_tile", None),),
               notifies=(NotifySpec("gate_up_done", "local", "row_tile", 1, "n_tiles1", n_t1),)),
        _stage("gemm_down", gemm_grid(n_t2), "empty_row_tile",
               waits=(WaitSpec("gate_up_done", "local", "gemm_gate_up", "row_tile",
                               "n_tiles1", n_t1),),
               notifies=(land_notify if fused else
                         NotifySpec("gemm_down_done", "local", "row_tile", 1, "n_tiles2", n_t2),)),
    ]
    if not fused:
        stages.append(_stage(
            "combine_send", (("row_tile", n_rt),), "empty_row_tile",
            waits=(WaitSpec("gemm_down_done", "local", "gemm_down", "row_tile", "n_tiles2", n_t2),),
            notifies=(land_notify,)))
    stages.append(_stage(
        "combine_reduce", (("token_block", cdiv(routing.max_tokens, spec.block_t)),),
        "never", waits=(WaitSpec("land", "remote", last_gemm, "token_slot/block", "n_tiles2", n_t2),),
        notifies=()))

    families = [
        family("dispatch_flag", "src_chunk", "remote", "epoch_flag", "dispatch_send",
               "dispatch_recv", "none (epoch-valued)"),
        family("rows_ready", "row_tile", "local", "counter", "dispatch_recv", "gemm_gate_up",
               "layout launch"),
        family("gate_up_done", "row_tile", "local", "counter", "gemm_gate_up", "gemm_down",
               "layout launch"),
    ]
    if not fused:
        families.append(family("gemm_down_done", "row_tile", "local", "counter", "gemm_down",
                               "combine_send", "layout launch"))
    families.append(family("land", "token_slot", "remote", "counter", last_gemm, "combine_reduce",
                           "combine_reduce, after use"))
    return stages, families


def insert_stage_barriers(stages: list[StagePlan], families: list[SignalFamily],
                          routing: RoutingPlan) -> tuple[list[StagePlan], list[SignalFamily]]:
    """schedule="sequential": before stage k+1, every task of stage k on this rank is done
    (local counter stage_done.<k>); before the stages of CROSS_RANK_BARRIER_BEFORE, on every rank
    (the task that completes stage k stamps stage_barrier.<k>[this rank] on every rank)."""
    stages, families = list(stages), list(families)
    for k in range(1, len(stages)):
        prev, cur = stages[k - 1], stages[k]
        # a stage that skips tasks counts the tasks that got a ticket (routing-dependent)
        tasks, count = ((f"ticketed({prev.name})", None) if prev.skip != "never"
                        else (f"tasks({prev.name})", prev.num_tasks))
        notifies = [NotifySpec(f"stage_done.{prev.name}", "local", "single", 1, tasks, count)]
        waits = [WaitSpec(f"stage_done.{prev.name}", "local", prev.name, "single", tasks, count)]
        families.append(SignalFamily(f"stage_done.{prev.name}", -1, 1, "single", "local", "counter",
                                     prev.name, cur.name, "layout launch"))
        if cur.name in CROSS_RANK_BARRIER_BEFORE:
            notifies.append(NotifySpec(f"stage_barrier.{prev.name}", "remote",
                                       "this_rank@all_ranks/stage_end", 1, "1", 1))
            waits.append(WaitSpec(f"stage_barrier.{prev.name}", "remote", prev.name, "all_ranks", "1", 1))
            families.append(SignalFamily(f"stage_barrier.{prev.name}", -1, routing.world_size, "rank",
                                         "remote", "epoch_flag", prev.name, cur.name,
                                         "none (epoch-valued)"))
        stages[k - 1] = dataclasses.replace(prev, notifies=prev.notifies + tuple(notifies))
        stages[k] = dataclasses.replace(cur, waits=tuple(waits) + cur.waits, barrier_before=True)
    return stages, families


def number_stages(stages: list[StagePlan]) -> tuple[StagePlan, ...]:
    """Queue order: index and first ticket of every stage."""
    out, first = [], 0
    for i, s in enumerate(stages):
        out.append(dataclasses.replace(s, index=i, first_task=first))
        first += s.num_tasks
    return tuple(out)


def assign_signal_words(families: list[SignalFamily]) -> tuple[SignalFamily, ...]:
    """Consecutive signal words, family after family (as SymmetricHeap.alloc_signals does)."""
    out, first = [], 0
    for f in families:
        out.append(dataclasses.replace(f, first=first))
        first += f.count
    return tuple(out)


def place_buffers(routing: RoutingPlan, device: DevicePlan,
                  core: CorePlan) -> tuple[tuple[BufferPlacement, ...], int]:
    """Heap placement after the control block and signal words, ALIGN-aligned, in the order
    SymmetricHeap.alloc would place them. Returns (buffers, bytes the arena needs)."""
    r, act = routing, routing.dtype
    W, T, K, H, I = r.world_size, r.max_tokens, r.topk, r.hidden, r.ffn_hidden
    rows = device.n_row_tiles_max * core.gate_up.block_m  # row tile i owns rows [i*BM, (i+1)*BM)
    specs = [  # name, shape, dtype, scope, role
        ("dispatch/x", (W, T, H), act, "symmetric",
         "tokens staged by each source rank, by staging slot (S0 writes on the peer)"),
        ("dispatch/meta", (W, T, 1 + 2 * K), "int32", "symmetric",
         "per staged token: source token, K local experts (-1: not here), K row positions"),
        ("gemm/tiles", (device.n_row_tiles_max, 4), "int32", "private",
         "row tiles in the order the GEMM stages take them (rows that arrive first, first): local "
         "expert, first row, rows, natural index (names its signal words); from the layout"),
        ("gemm/rows", (rows, 4), "int32", "private",
         "per GEMM row: source rank, staging slot, source token, k (S1 writes)"),
        ("gemm/h", (rows, I), act, "private", "SwiGLU output (S2 writes, S3 reads)"),
    ]
    if not device.combine_fused:
        specs.append(("gemm/y", (rows, H), act, "private", "down output (S3 writes, S4 sends)"))
    specs.append(("combine/land", (T, K, H), act, "symmetric",
                  "y row of each (token, k) of this rank, written by the expert's rank"))
    out, offset = [], device.data_offset
    for name, shape, dtype, scope, role in specs:
        nbytes = numel(shape) * DTYPE_BYTES[dtype]
        out.append(BufferPlacement(name, shape, dtype, offset, nbytes, scope, role))
        offset = C.align_up(offset + nbytes)
    return tuple(out), offset


def _stage(name: str, grid: tuple[tuple[str, int], ...], skip: str, *, waits, notifies) -> StagePlan:
    num_tasks = numel(tuple(e for _, e in grid))
    return StagePlan(name=name, index=-1, first_task=-1, grid=grid, num_tasks=num_tasks,
                     skip=skip, waits=tuple(waits), notifies=tuple(notifies), barrier_before=False)

