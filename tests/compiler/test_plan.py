"""The MoE plan compiler without a GPU: lowering, printing, the verifier and its rejections."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ditron_ep.check.routing import make_routing
from ditron_ep.compiler.core_config import GemmTileConfig
from ditron_ep.compiler.lowering import fill_defaults, lower, number_stages, seal
from ditron_ep.compiler.plan import STAGE_NAMES, MoEPlan, MoESpec, PlanError
from ditron_ep.compiler.verifier import verify, verify_instance

# (W, E, K, H, I, max_tokens): small shapes so that tiles are ragged in every dimension.
SHAPES = [(2, 8, 1, 64, 96, 40), (2, 8, 2, 48, 64, 17), (4, 16, 4, 64, 96, 40),
          (4, 64, 8, 32, 32, 24), (8, 8, 8, 64, 48, 9), (8, 256, 8, 64, 96, 24)]


def spec_of(W, E, K, H, I, T, **kw) -> MoESpec:  # noqa: E741
    return MoESpec(world_size=W, num_experts=E, topk=K, hidden=H, ffn_hidden=I, max_tokens=T,
                   device_type=kw.pop("device_type", "cpu"), **kw)


def routings(plan: MoEPlan, kind: str, seed: int = 0, drop_prob: float = 0.0,
             tokens: list[int] | None = None) -> list[torch.Tensor]:
    """topk_idx of every rank for one routing kind."""
    r = plan.routing
    g = torch.Generator().manual_seed(seed)
    tokens = tokens if tokens is not None else [r.max_tokens] * r.world_size
    return [make_routing(t, r.num_experts, r.topk, kind, generator=g, drop_prob=drop_prob,
                         num_ranks=r.world_size)[0] for t in tokens]


def replace_stage(plan: MoEPlan, name: str, **changes) -> MoEPlan:
    stages = tuple(dataclasses.replace(s, **changes) if s.name == name else s
                   for s in plan.device.stages)
    return dataclasses.replace(plan, device=dataclasses.replace(plan.device, stages=stages))


def replace_wait(plan: MoEPlan, stage: str, signal: str, **changes) -> MoEPlan:
    s = plan.device.stage(stage)
    waits = tuple(dataclasses.replace(w, **changes) if w.signal == signal else w for w in s.waits)
    return replace_stage(plan, stage, waits=waits)


def replace_device(plan: MoEPlan, **changes) -> MoEPlan:
    return dataclasses.replace(plan, device=dataclasses.replace(plan.device, **changes))


@pytest.fixture(scope="module")
def base() -> MoEPlan:
    return lower(spec_of(4, 16, 2, 64, 96, 40))


# --------------------------------------------------------------------------------------------
# Lowering
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["overlap", "sequential"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "W{}-E{}-K{}-H{}-I{}-T{}".format(*s))
def test_lower_gives_verified_plan(shape, schedule):
    plan = lower(spec_of(*shape, schedule=schedule))
    assert plan.verified
    plan.require_verified()
    verify(plan)
    W, E, K, H, I, T = shape  # noqa: E741
    d = plan.device
    assert [s.name for s in d.stages] == [n for n in STAGE_NAMES if n != "combine_send"]
    assert d.stage("dispatch_send").num_tasks == W * plan.routing.n_chunks
    # grouped tile order (the default): the last group of row tiles is padded to a whole group
    g = d.gemm_group_rows
    assert d.stage("gemm_gate_up").num_tasks == -(-d.n_row_tiles_max // g) * g * d.n_tiles1
    assert all(s.barrier_before == (schedule == "sequential" and s.index > 0) for s in d.stages)
    assert all(b.offset % 256 == 0 for b in d.buffers)
    assert d.buffers[-1].offset + d.buffers[-1].nbytes <= d.heap_bytes


@pytest.mark.parametrize("device_type,dtype", [("cuda", "bfloat16"), ("cuda", "float32"),
                                               ("hip", "float16"), ("cpu", "float32")])
def test_lower_production_shape(device_type, dtype):
    """DeepSeek-like layer (E=256, top-8, H=7168, I=2048, 4096 tokens per rank on 8 ranks)."""
    plan = lower(MoESpec(8, 256, 8, 7168, 2048, 4096, dtype=dtype, device_type=device_type))
    assert plan.verified
    assert plan.device.heap_bytes > plan.device.buffer("combine/land").nbytes


@pytest.mark.parametrize("max_tokens,num_programs,block_t", [
    (128, 132, 1), (1024, 132, 4), (4096, 132, 16), (4096, 304, 8), (40, 2, 16), (1, 132, 1)])
def test_combine_block_covers_the_grid(max_tokens, num_programs, block_t):
    """combine_reduce runs all at once after the last down tiles: tokens per task shrink until
    the stage has a task per program (or one token per task)."""
    plan = lower(MoESpec(4, 16, 2, 64, 96, max_tokens, device_type="cuda", num_programs=num_programs))
    assert plan.device.block_t == block_t
    n_tasks = plan.device.stage("combine_reduce").num_tasks
    assert n_tasks == -(-max_tokens // block_t)
    assert n_tasks >= num_programs or block_t == 1
    assert block_t == 16 or -(-max_tokens // (2 * block_t)) < num_programs  # the largest such block


@pytest.mark.parametrize("max_tokens,hidden,block_h,num_programs", [
    (4096, 7168, 512, 132), (4096, 7168, 1024, 132), (64, 40, 16, 2), (37, 96, 32, 8), (128, 7168, 512, 132)])
def test_combine_tasks_of_a_smaller_call_cover_every_output_once(max_tokens, hidden, block_h, num_programs):
    """A call with T < max_tokens gives the spare combine_reduce tasks column slices of its token
    blocks: every (token, column) of the call is reduced by exactly one task, and a full call
    keeps one slice per block."""
    plan = lower(MoESpec(4, 16, 2, hidden, 96, max_tokens, device_type="cuda", num_programs=num_programs,
                         block_h=block_h))
    n, bt = plan.device.stage("combine_reduce").num_tasks, plan.device.block_t
    for tokens in sorted({0, 1, bt - 1, bt, bt + 1, max_tokens // 3, max_tokens // 2, max_tokens - 1, max_tokens}):
        if not 0 <= tokens <= max_tokens:
            continue
        hits = torch.zeros(tokens, hidden, dtype=torch.int32)
        busy = 0
        for q in range(n):
            b, lo, hi = plan.combine_task(q, tokens)
            assert lo % block_h == 0 and lo < hi <= hidden
            if b * bt < tokens:
                hits[b * bt:(b + 1) * bt, lo:hi] += 1
                busy += 1
        assert bool((hits == 1).all()), f"T={tokens}: some output reduced {hits.min()}..{hits.max()} times"
        blocks = -(-tokens // bt)
        assert busy >= min(n, blocks * -(-hidden // block_h)) // 2  # the spare tasks are used
        if tokens == max_tokens:
            assert busy == blocks  # a full call: one task per block, all columns
    assert "combine_reduce in a call with fewer tokens" in plan.describe()


def test_describe_shows_every_stage_signal_and_buffer(base):
    for plan in (base, lower(spec_of(4, 16, 2, 64, 96, 40, schedule="sequential",
                                     combine_fused=False))):
        text = str(plan)
        assert text == plan.describe() and "[verified]" in text
        for s in plan.device.stages:
            assert f"S{s.index} {s.name}" in text and f"{s.num_tasks} tasks" in text
        for f in plan.device.signals:
            assert f.name in text
        for b in plan.device.buffers:
            assert b.name in text and f"{b.nbytes} B" in text and f"@{b.offset:>12}" in text
        for level in ("Task level", "Device level", "Core level"):
            assert level in text


FIELD_CHANGES = [  # (override, value, what must hold in the new plan)
    ("num_programs", 7, lambda p: p.device.num_programs == 7),
    ("chunk_rows", 8, lambda p: p.routing.n_chunks == 5 and p.core.block_rows == 8),
    ("source_order", "reverse_ring", lambda p: p.dest_of(1, 1) == 2),  # ring: rank-1 = 0
    ("gemm_tile_order", "column_major",
     lambda p: [c for c, _ in p.device.stage("gemm_down").grid] == ["col_tile", "row_tile"]),
    ("gemm_tile_order", "row_major",  # the default is "grouped", in groups of 2 under the interpreter
     lambda p: [c for c, _ in p.device.stage("gemm_gate_up").grid] == ["row_tile", "col_tile"]
     and p.device.gemm_group_rows == 1),
    ("gemm_group_rows", 3, lambda p: p.device.gemm_tile_order == "grouped" and p.device.gemm_group_rows == 3
     and "3 row tiles a group" in p.describe()),
    ("combine_fused", False, lambda p: p.device.has_stage("combine_send")
     and p.device.stage("combine_send").num_tasks == p.device.n_row_tiles_max),
    ("schedule", "sequential", lambda p: p.device.stage("gemm_down").barrier_before),
    ("block_t", 8, lambda p: p.device.stage("combine_reduce").num_tasks == 5),
    ("recv_lag", 3, lambda p: p.device.recv_lag == 3 and "right after send task g + 3" in p.describe()),
    ("gate_up_config", GemmTileConfig(32, 32, 32, 4, 1), lambda p: p.core.gate_up.block_m == 32),
]


@pytest.mark.parametrize("field,value,check", FIELD_CHANGES, ids=[f"{f}={v}" for f, v, _ in FIELD_CHANGES])
def test_device_field_change_gives_other_verified_plan(base, field, value, check):
    # Both GEMMs share row tiles, so a gate-up block_m change takes the down tile along.
    down = {"down_config": GemmTileConfig(32, 32, 16, 4, 1)} if field == "gate_up_config" else {}
    plan = lower(spec_of(4, 16, 2, 64, 96, 40), **{field: value}, **down)
    assert plan != base and plan.verified and check(plan) and not check(base)
    verify_instance(plan, routings(plan, "zipf", drop_prob=0.2))


# --------------------------------------------------------------------------------------------
# Concrete routings
# --------------------------------------------------------------------------------------------
PLAN_VARIANTS = {
    "overlap-fused": {},
    "sequential-fused": {"schedule": "sequential"},
    "overlap-unfused-colmajor": {"combine_fused": False, "gemm_tile_order": "column_major"},
    "sequential-unfused-reverse": {"schedule": "sequential", "combine_fused": False,
                                   "source_order": "reverse_ring", "chunk_rows": 4},
    "overlap-grouped3": {"gemm_tile_order": "grouped", "gemm_group_rows": 3},
    "sequential-grouped5-unfused": {"schedule": "sequential", "gemm_group_rows": 5, "combine_fused": False},
}


@pytest.mark.parametrize("variant", PLAN_VARIANTS)
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[4], SHAPES[5]],
                         ids=lambda s: "W{}-E{}-K{}".format(*s))
def test_verify_instance_ragged_routings(shape, variant):
    plan = lower(spec_of(*shape), **PLAN_VARIANTS[variant])
    W, T = plan.routing.world_size, plan.routing.max_tokens
    empty_rank = [T] * W
    empty_rank[W - 1] = 0
    cases = [
        routings(plan, "uniform"),
        routings(plan, "zipf", seed=1, drop_prob=0.3),             # skew and drops
        routings(plan, "one_expert", seed=2),                      # all tokens to expert 0
        routings(plan, "one_rank", seed=3),                        # every row on rank 0
        routings(plan, "uniform", seed=4, tokens=empty_rank),      # a rank with no tokens
        routings(plan, "uniform", seed=5, tokens=[1 + s % 3 for s in range(W)]),  # T < chunk
        routings(plan, "uniform", seed=6, drop_prob=1.0),          # every slot dropped
    ]
    for topk_idx in cases:
        verify_instance(plan, topk_idx)


def test_verify_instance_rejects_bad_routing(base):
    r = base.routing
    with pytest.raises(PlanError, match="one per rank"):
        verify_instance(base, routings(base, "uniform")[:-1])
    too_many = routings(base, "uniform", tokens=[r.max_tokens + 1] + [1] * (r.world_size - 1))
    with pytest.raises(PlanError, match="max_tokens"):
        verify_instance(base, too_many)


# --------------------------------------------------------------------------------------------
# Plans the verifier must reject
# --------------------------------------------------------------------------------------------
def test_rejects_wait_on_later_stage_of_same_rank(base):
    """gemm_down queued before gemm_gate_up: its wait on gate_up_done is on a later stage."""
    st = list(base.device.stages)
    st[2], st[3] = st[3], st[2]
    bad = replace_device(base, stages=number_stages(st))
    with pytest.raises(PlanError, match=r"stage gemm_down waits on signal gate_up_done.*later stage"):
        verify(bad)
    with pytest.raises(PlanError, match=r"gemm_down.*gate_up_done.*later task of its own queue"):
        verify_instance(bad, routings(base, "uniform"))


def test_rejects_remote_wait_on_same_stage(base):
    bad = replace_wait(base, "dispatch_recv", "dispatch_flag", producer_stage="dispatch_recv")
    with pytest.raises(PlanError, match=r"stage dispatch_recv waits on signal dispatch_flag notified "
                                        r"by another rank's tasks of the same stage"):
        verify(bad)


def test_rejects_expected_count_off_by_one(base):
    n_t1 = base.device.n_tiles1
    bad = replace_wait(base, "gemm_down", "gate_up_done", expected_count=n_t1 + 1)
    with pytest.raises(PlanError, match=r"stage gemm_down waits on signal gate_up_done"):
        verify(bad)
    with pytest.raises(PlanError, match=rf"gemm_down.*gate_up_done\[\d+\]: expects {n_t1 + 1} "
                                        rf"\(n_tiles1\) but the notifies aimed at it add up to {n_t1}"):
        verify_instance(bad, routings(base, "uniform"))
    # The reduce expecting one notify less than the down GEMM sends.
    n_t2 = base.device.n_tiles2
    bad = replace_wait(base, "combine_reduce", "land", expected_count=n_t2 - 1, expected="n_tiles2")
    with pytest.raises(PlanError, match="combine_reduce waits on signal land"):
        verify(bad)
    with pytest.raises(PlanError, match=r"combine_reduce.*land\[\d+\]: expects"):
        verify_instance(bad, routings(base, "zipf"))


def test_instance_catches_what_formulas_cannot():
    """combine_send adding 1 (not n_tiles2) per row while claiming n_tiles2 hits per word: the
    formulas balance (1 x n_tiles2), the routing shows each (token, k) gets one notify."""
    plan = lower(spec_of(4, 16, 2, 64, 96, 40, combine_fused=False))
    n_t2 = plan.device.n_tiles2
    s = plan.device.stage("combine_send")
    (land,) = [n for n in s.notifies if n.signal == "land"]
    bad = replace_stage(plan, "combine_send", notifies=(
        dataclasses.replace(land, amount=1, hits="n_tiles2", hits_count=n_t2),))
    verify(bad)  # structurally consistent
    with pytest.raises(PlanError, match=rf"combine_reduce.*land\[\d+\]: expects {n_t2} \(n_tiles2\) "
                                        rf"but the notifies aimed at it add up to 1"):
        verify_instance(bad, routings(plan, "uniform"))


def test_sequential_barriers_count_ticketed_tasks():
    """The GEMM stages hand out no ticket for row tiles past the routing's count, so the barrier
    after them counts ticketed(<stage>); the same plan counting the host bound tasks(<stage>)
    balances on formulas but never completes on a real routing."""
    plan = lower(spec_of(4, 16, 2, 64, 96, 40), schedule="sequential")
    (w,) = [w for w in plan.device.stage("gemm_down").waits if w.signal == "stage_done.gemm_gate_up"]
    assert (w.expected, w.expected_count) == ("ticketed(gemm_gate_up)", None)
    assert "ticketed(gemm_gate_up)" in plan.describe()
    bound = plan.device.stage("gemm_gate_up").num_tasks
    (n,) = [n for n in plan.device.stage("gemm_gate_up").notifies if n.signal == "stage_done.gemm_gate_up"]
    old = replace_wait(plan, "gemm_down", "stage_done.gemm_gate_up", expected="tasks(gemm_gate_up)",
                       expected_count=bound)
    old = replace_stage(old, "gemm_gate_up", notifies=tuple(
        dataclasses.replace(x, hits="tasks(gemm_gate_up)", hits_count=bound) if x is n else x
        for x in old.device.stage("gemm_gate_up").notifies))
    verify(old)  # structurally consistent
    with pytest.raises(PlanError, match=rf"gemm_down.*stage_done.gemm_gate_up\[0\]: expects {bound} "):
        verify_instance(old, routings(plan, "uniform"))


def test_rejects_gemm_stages_with_different_launch_options(base):
    """One launch runs both GEMM stages: a down config with other warps/stages would be ignored."""
    gu = base.core.gate_up
    bad = dataclasses.replace(base, core=dataclasses.replace(base.core, down=dataclasses.replace(
        base.core.down, num_warps=gu.num_warps * 2)))
    with pytest.raises(PlanError, match="differ in num_warps / num_stages"):
        verify(bad)


def test_instance_catches_unwaited_notify(base):
    """dispatch_recv covering one chunk too few: its flags are stamped but never waited on."""
    s = base.device.stage("dispatch_recv")
    grid = (("source_pos", base.routing.world_size), ("chunk", base.routing.n_chunks - 1))
    bad = replace_stage(base, "dispatch_recv", grid=grid, num_tasks=s.num_tasks - base.routing.world_size)
    with pytest.raises(PlanError, match=r"stage dispatch_recv: grid coordinate chunk"):
        verify(bad)
    with pytest.raises(PlanError, match=r"dispatch_flag\[\d+\] on rank \d is notified by .* but no "
                                        r"task waits on it"):
        verify_instance(bad, routings(base, "uniform"))


def test_rejects_overlapping_buffers(base):
    b = list(base.device.buffers)
    b[2] = dataclasses.replace(b[2], offset=b[1].offset)
    with pytest.raises(PlanError, match=f"buffer {b[1].name} .* overlaps buffer {b[2].name}|"
                                        f"buffer {b[2].name} .* overlaps buffer {b[1].name}"):
        verify(replace_device(base, buffers=tuple(b)))


def test_rejects_buffers_beyond_heap(base):
    last = base.device.buffers[-1]
    bad = replace_device(base, heap_bytes=last.offset + last.nbytes - 1)
    with pytest.raises(PlanError, match=f"buffer {last.name} ends at byte .* beyond heap_bytes"):
        verify(bad)
    with pytest.raises(PlanError, match=r"buffer \w+/\w+ ends at byte \d+, beyond heap_bytes=32768"):
        lower(spec_of(4, 16, 2, 64, 96, 40), heap_bytes=32768)


def test_rejects_misaligned_buffer_and_signal_overlap(base):
    b = list(base.device.buffers)
    b[-1] = dataclasses.replace(b[-1], offset=b[-1].offset + 64)
    with pytest.raises(PlanError, match=f"buffer {b[-1].name}: offset .* not 256-byte aligned"):
        verify(replace_device(base, buffers=tuple(b)))
    f = list(base.device.signals)
    f[2] = dataclasses.replace(f[2], first=f[1].first + 1)
    with pytest.raises(PlanError, match=f"signal {f[2].name}: words .* overlap"):
        verify(replace_device(base, signals=tuple(f)))
    f = list(base.device.signals)
    f[1] = dataclasses.replace(f[1], count=f[1].count - 1)
    with pytest.raises(PlanError, match=f"signal {f[1].name}: .* needs {f[1].count + 1}"):
        verify(replace_device(base, signals=tuple(f)))


def test_rejects_sequential_plan_missing_a_barrier():
    plan = lower(spec_of(4, 16, 2, 64, 96, 40, schedule="sequential", combine_fused=False))
    with pytest.raises(PlanError, match="stage gemm_down: schedule=sequential needs a stage barrier"):
        verify(replace_stage(plan, "gemm_down", barrier_before=False))
    s = plan.device.stage("combine_reduce")
    no_cross = tuple(w for w in s.waits if w.element != "all_ranks")
    bad = replace_stage(plan, "combine_reduce", waits=no_cross)
    with pytest.raises(PlanError, match="stage combine_reduce: schedule=sequential needs a cross-rank"):
        verify(bad)
    s = plan.device.stage("gemm_gate_up")
    bad = replace_stage(plan, "gemm_gate_up", waits=tuple(w for w in s.waits if w.element != "single"))
    with pytest.raises(PlanError, match="stage gemm_gate_up: .* does not wait for every task of "
                                        "dispatch_recv"):
        verify(bad)


def test_rejects_overlap_plan_with_a_barrier(base):
    with pytest.raises(PlanError, match="stage gemm_down: overlap plans have no stage barrier"):
        verify(replace_stage(base, "gemm_down", barrier_before=True))


def test_rejects_bad_parameters(base):
    with pytest.raises(PlanError, match="num_programs"):
        verify(replace_device(base, num_programs=0))
    with pytest.raises(PlanError, match="chunk_rows must be a power of two"):
        verify(dataclasses.replace(base, routing=dataclasses.replace(base.routing, chunk_rows=12)))
    with pytest.raises(PlanError, match="n_chunks"):
        verify(dataclasses.replace(base, routing=dataclasses.replace(base.routing, n_chunks=2)))
    with pytest.raises(PlanError, match="gate_up.block_m=32 != down.block_m=16"):
        verify(dataclasses.replace(base, core=dataclasses.replace(
            base.core, gate_up=GemmTileConfig(32, 16, 32, 4, 1))))
    with pytest.raises(PlanError, match="recv_lag"):
        verify(replace_device(base, recv_lag=-1))
    with pytest.raises(PlanError, match="needs every dispatch_send before the first dispatch_recv"):
        lower(spec_of(4, 16, 2, 64, 96, 40), schedule="sequential", recv_lag=2)
    with pytest.raises(ValueError, match="chunk_rows must be a power of two"):
        lower(spec_of(4, 16, 2, 64, 96, 40), chunk_rows=12)
    with pytest.raises(ValueError, match="cannot override"):
        lower(spec_of(4, 16, 2, 64, 96, 40), hidden=128)
    with pytest.raises(ValueError, match="multiple of world_size"):
        lower(spec_of(4, 10, 2, 64, 96, 40))


def test_verified_only_while_unchanged(base):
    changed = replace_device(base, num_programs=3)
    assert base.verified and not changed.verified
    with pytest.raises(PlanError, match="not verified"):
        changed.require_verified()
    assert seal(changed).verified
    with pytest.raises(PlanError):
        seal(replace_device(base, num_programs=0))


def test_rejects_inconsistent_gemm_groups(base):
    assert base.device.gemm_tile_order == "grouped" and base.device.gemm_group_rows == 2  # the CPU default
    grouped = lower(spec_of(4, 16, 2, 64, 96, 40), gemm_group_rows=3)
    row_major = lower(spec_of(4, 16, 2, 64, 96, 40), gemm_tile_order="row_major")
    with pytest.raises(PlanError, match="gemm_tile_order=row_major walks row tiles in groups of 1"):
        verify(replace_device(row_major, gemm_group_rows=2))
    with pytest.raises(PlanError, match="grid coordinate row_group\\[8\\] should be row_group\\[6\\]"):
        verify(replace_device(grouped, gemm_group_rows=4))  # the grid still has groups of 3
    with pytest.raises(PlanError, match="is grouped, but gemm_tile_order=row_major"):
        verify(replace_device(grouped, gemm_tile_order="row_major", gemm_group_rows=1))
    with pytest.raises(PlanError, match="gemm_group_rows must be an int in"):
        verify(replace_device(grouped, gemm_group_rows=0))
    with pytest.raises(ValueError, match="gemm_group_rows=4 sizes the groups of gemm_tile_order='grouped'"):
        lower(spec_of(4, 16, 2, 64, 96, 40), gemm_tile_order="column_major", gemm_group_rows=4)
    with pytest.raises(ValueError, match="gemm_group_rows must be an int >= 1"):
        lower(spec_of(4, 16, 2, 64, 96, 40), gemm_group_rows=0)
    big = lower(spec_of(4, 16, 2, 64, 96, 40), gemm_group_rows=10**6)  # clamped to the row tiles
    assert big.device.gemm_group_rows == big.device.n_row_tiles_max
    for order in ("row_major", "column_major", "grouped"):  # filled specs lower again unchanged
        spec = fill_defaults(spec_of(4, 16, 2, 64, 96, 40, gemm_tile_order=order))
        assert fill_defaults(spec) == spec and lower(spec) == lower(spec_of(4, 16, 2, 64, 96, 40,
                                                                          gemm_tile_order=order))


def test_package_exports_what_the_readme_shows():
    """README: `ditron_ep.compiler.lower(MoESpec(...))`, printed, shows what runs where."""
    import ditron_ep.compiler as compiler
    plan = compiler.lower(compiler.MoESpec(world_size=2, num_experts=4, topk=2, hidden=64, ffn_hidden=32,
                                           max_tokens=16, device_type="cpu"))
    assert plan is not None and compiler.verify(plan) is None and str(plan)
