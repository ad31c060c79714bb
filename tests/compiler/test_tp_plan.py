"""The AllGather+GEMM plan (compiler/tp_plan.py): lowered plans verify for ragged shapes and print
their levels; plans the verifier must reject (a chunk that never lands, a tile that waits for too
few chunks, an output tile computed twice, a GEMM tile other than the sequential schedule's,
bad parameters) raise PlanError naming the problem."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ditron_ep.compiler.core_config import GemmTileConfig, default_gemm_configs
from ditron_ep.compiler.plan import PlanError
from ditron_ep.compiler.tp_plan import (AGGemmPlan, GemmARPlan, GemmRSPlan, lower_ag_gemm, lower_gemm_ar, lower_gemm_rs,
                                       planned_tile, sequential_tile, verify_ag_gemm, verify_gemm_ar, verify_gemm_rs)


@pytest.mark.parametrize("world, rows, n, chunk", [(2, 21, 24, None), (3, 5, 13, None), (4, 37, 50, 8), (2, 1, 1, None),
                                                   (3, 16, 32, 16)])
def test_lowered_plans_verify(world, rows, n, chunk):
    plan = lower_ag_gemm(world, rows, 40, n, "float32", "cpu", chunk_rows=chunk)
    assert plan.verified
    text = plan.describe()
    assert "verified" in text and "Task level" in text and "Device level" in text and "Core level" in text
    assert dataclasses.replace(plan, comm_programs=3).verified is False  # any change needs a new verification


def _broken(name: str):
    class Broken(AGGemmPlan):
        def copy_task(self, rank, t):
            c, d = super().copy_task(rank, t)
            return (c, rank) if name == "copy" and rank == 1 and c == 0 else (c, d)

        def waits(self, t_m):
            got = super().waits(t_m)
            return got[:-1] if name == "waits" and len(got) > 1 else got

        def gemm_task(self, rank, g):
            t_m, t_n = super().gemm_task(rank, g)
            return (0, 0) if name == "twice" and g == 1 else (t_m, t_n)
    return Broken


@pytest.mark.parametrize("name, match", [("copy", "never land"), ("waits", "waits for"),
                                         ("twice", "other than once")])
def test_plans_the_verifier_must_reject(name, match):
    good = lower_ag_gemm(3, 21, 40, 24, "float32", "cpu", chunk_rows=4)
    fields = {f.name: getattr(good, f.name) for f in dataclasses.fields(good) if f.name != "verified_digest"}
    with pytest.raises(PlanError, match=match):
        verify_ag_gemm(_broken(name)(**fields))


def test_a_tile_other_than_the_sequential_ones_is_rejected():
    good = lower_ag_gemm(2, 21, 40, 24, "float32", "cpu")
    with pytest.raises(PlanError, match="not the shape rule's"):
        verify_ag_gemm(dataclasses.replace(good, tile=GemmTileConfig(32, 32, 16, 4, 1)))


@pytest.mark.parametrize("field, value", [("chunk_rows", 0), ("rows", -1), ("comm_programs", -2)])
def test_bad_parameters_are_rejected(field, value):
    good = lower_ag_gemm(2, 21, 40, 24, "float32", "cpu")
    with pytest.raises(PlanError, match=field):
        verify_ag_gemm(dataclasses.replace(good, **{field: value}))


# ---- GEMM+ReduceScatter
@pytest.mark.parametrize("world, rows, n", [(2, 21, 24), (3, 5, 13), (4, 37, 50), (2, 1, 1), (3, 16, 32)])
def test_lowered_gemm_rs_plans_verify(world, rows, n):
    plan = lower_gemm_rs(world, rows, 40, n, "float32", "cpu")
    assert plan.verified and "GEMM+ReduceScatter" in plan.describe() and "Core level" in plan.describe()
    assert dataclasses.replace(plan, n=n + 1).verified is False


def _broken_rs(name: str):
    class Broken(GemmRSPlan):
        def gemm_task(self, rank, g):
            t_m, t_n = super().gemm_task(rank, g)
            return (0, 0) if name == "twice" and g == 1 else (t_m, t_n)

        def destinations(self, t_m):
            got = super().destinations(t_m)
            return got[:1] if name == "lost" and len(got) > 1 else got

        def reduce_waits(self, rank, t_m, t_n):
            got = super().reduce_waits(rank, t_m, t_n)
            return got[:-1] if name == "waits" else got

        def reduce_task(self, rank, j):
            t_m, t_n = super().reduce_task(rank, j)
            return (t_m, 0) if name == "reduce twice" else (t_m, t_n)
    return Broken


@pytest.mark.parametrize("name, match", [("twice", "lands from rank 0 twice"), ("lost", "never land"),
                                         ("waits", "waits for signals"), ("reduce twice", "reduced other than once")])
def test_gemm_rs_plans_the_verifier_must_reject(name, match):
    good = lower_gemm_rs(3, 21, 40, 40, "float32", "cpu")  # 21 rows a shard: tiles of 16 span two shards
    fields = {f.name: getattr(good, f.name) for f in dataclasses.fields(good) if f.name != "verified_digest"}
    with pytest.raises(PlanError, match=match):
        verify_gemm_rs(_broken_rs(name)(**fields))
    with pytest.raises(PlanError, match="not the shape rule's"):
        verify_gemm_rs(dataclasses.replace(good, tile=GemmTileConfig(32, 32, 16, 4, 1)))


# ---- GEMM+AllReduce
@pytest.mark.parametrize("world, rows, n", [(2, 21, 24), (3, 5, 13), (4, 37, 50), (3, 40, 40)])
def test_lowered_gemm_ar_plans_verify(world, rows, n):
    plan = lower_gemm_ar(world, rows, 40, n, "float32", "cpu")
    assert plan.verified and "GEMM+AllReduce" in plan.describe()


def _broken_ar(name: str):
    class Broken(GemmARPlan):
        def gemm_task(self, rank, g):
            return 0 if name == "twice" and g == 1 else super().gemm_task(rank, g)

        def reduce_task(self, rank, j):
            t = super().reduce_task(rank, j)
            return (t + 1) % self.n_tiles if name == "not owned" else t

        def copy_task(self, rank, j):
            return 0 if name == "copy" and j == 1 else super().copy_task(rank, j)

        def reduce_waits(self, t):
            got = super().reduce_waits(t)
            return got[:-1] if name == "short wait" else got

        def copy_waits(self, t):
            return [] if name == "copy no wait" else super().copy_waits(t)

        def result_destinations(self, t):
            got = super().result_destinations(t)
            return got[:-1] if name == "result lost" else got
    return Broken


@pytest.mark.parametrize("name, match", [("twice", "other than once"), ("not owned", "does not own"),
                                         ("copy", "copies tiles out other than once"), ("short wait", "reduce waits"),
                                         ("copy no wait", "not for its owner's stamp"),
                                         ("result lost", "not for its owner's stamp")])
def test_gemm_ar_plans_the_verifier_must_reject(name, match):
    good = lower_gemm_ar(3, 40, 40, 40, "float32", "cpu")
    fields = {f.name: getattr(good, f.name) for f in dataclasses.fields(good) if f.name != "verified_digest"}
    with pytest.raises(PlanError, match=match):
        verify_gemm_ar(_broken_ar(name)(**fields))


# ---- the sequential schedule's tile (gemm.matmul's, every overlapped plan's)
@pytest.mark.parametrize("rows, n, want", [
    (2048, 8192, (128, 256, 8)),   # 512 default tiles: kept
    (16384, 3584, (128, 256, 8)),
    (128, 8192, (128, 64, 4)),     # a decode-sized GEMM+AR: 32 default tiles -> 128, b read once
    (100, 1024, (128, 64, 4)),     # BN stops at 64
    (48, 8192, (64, 64, 4)),       # rows <= 64: one M-tile of 64
])
def test_the_gpu_tile_shrinks_until_the_product_fills_the_sms(rows, n, want):
    tile = sequential_tile("bfloat16", "cuda", rows, n)
    assert (tile.block_m, tile.block_n, tile.num_warps) == want
    default = default_gemm_configs(torch.bfloat16, "cuda")[1]
    assert (tile.block_k, tile.num_stages) == (default.block_k, default.num_stages)  # the same K steps


def test_the_tile_rows_do_not_depend_on_n_and_the_interpreter_keeps_its_tile():
    # an all-gather's chunk is one M-tile: ranks whose N differ must still chunk alike
    for rows in (48, 512, 4096):
        assert len({sequential_tile("bfloat16", "cuda", rows, n).block_m for n in (1, 64, 8192, 65536)}) == 1
        assert len({lower_ag_gemm(2, rows, 256, n, "bfloat16", "cuda").chunk_rows for n in (1, 64, 8192)}) == 1
    assert sequential_tile("float32", "cpu", 4, 4) == default_gemm_configs(torch.float32, "cpu")[1]
    plan = lower_gemm_ar(2, 128, 8192, 8192, "bfloat16", "cuda")
    assert plan.verified and plan.tile == sequential_tile("bfloat16", "cuda", 128, 8192)
    with pytest.raises(PlanError, match="not the shape rule's"):
        verify_gemm_ar(dataclasses.replace(plan, tile=default_gemm_configs(torch.bfloat16, "cuda")[1]))


def test_a_tuned_tile_is_planned_only_with_the_rules_rows_and_k_step(monkeypatch):
    """planned_tile takes the tuner cache's tile on NVIDIA when it keeps the shape rule's rows per
    tile and K step (the chunking and the summation order); the plans record the source and the
    verifier accepts such a tile and rejects one that changes either."""
    from ditron_ep.compiler import tuner

    rule = sequential_tile("bfloat16", "cuda", 2048, 8192)
    wide = dataclasses.replace(rule, block_n=128, num_stages=5)
    entries = {}
    monkeypatch.setattr(tuner, "tuned_tp_tile", lambda dtype, *, rows, k, n, cache=None: entries.get((rows, k, n)))
    assert planned_tile("bfloat16", "cuda", 2048, 4096, 8192) == (rule, "rule")  # a miss
    entries[(2048, 4096, 8192)] = wide
    assert planned_tile("bfloat16", "cuda", 2048, 4096, 8192) == (wide, "tuned")
    assert planned_tile("bfloat16", "cpu", 2048, 4096, 8192)[1] == "rule"  # the interpreter keeps its tile
    entries[(48, 4096, 8192)] = wide  # tuned at 128 rows (the same bucket), but 48 rows tile by 64
    assert planned_tile("bfloat16", "cuda", 48, 4096, 8192) == (sequential_tile("bfloat16", "cuda", 48, 8192), "rule")

    for lower in (lower_gemm_rs, lower_gemm_ar):
        plan = lower(2, 1024 if lower is lower_gemm_rs else 2048, 4096, 8192, "bfloat16", "cuda")
        assert plan.verified and plan.tile == wide and plan.tile_source == "tuned", plan
        assert f"GEMM tile {wide} (tuned" in plan.describe()
        verify = verify_gemm_rs if lower is lower_gemm_rs else verify_gemm_ar
        with pytest.raises(PlanError, match="rows per tile and K step"):
            verify(dataclasses.replace(plan, tile=dataclasses.replace(wide, block_k=32)))
        with pytest.raises(PlanError, match="not the shape rule's"):
            verify(dataclasses.replace(plan, tile_source="rule"))
        with pytest.raises(PlanError, match="tile_source must be one of"):
            verify(dataclasses.replace(plan, tile_source="guessed"))
    ag = lower_ag_gemm(2, 1024, 4096, 8192, "bfloat16", "cuda")
    assert ag.tile == wide and ag.chunk_rows == rule.block_m and ag.verified


def test_tp_gemm_candidates_keep_the_rule_rows_and_k_step_and_fit_shared_memory():
    from ditron_ep.compiler import tuner

    for rows, n in ((128, 8192), (2048, 8192), (48, 8192)):
        rule = sequential_tile("bfloat16", "cuda", rows, n)
        cands = tuner.tp_gemm_candidates(rule, 2)
        assert cands and rule not in cands and len(set(cands)) == len(cands)
        for c in cands:
            assert (c.block_m, c.block_k) == (rule.block_m, rule.block_k)
            assert (c.block_m + c.block_n) * c.block_k * 2 * c.num_stages <= tuner.SMEM_LIMIT
            assert c.num_warps == 8 or c.block_m * c.block_n <= 128 * 128
    # an entry round-trips through the cache file
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        cache = tuner.TuneCache(f"{d}/t.json")
        key = tuner.TuneKey(tuner.TP_GEMM_OP, (tuner.rows_bucket(2000), 8192, 3584), "bfloat16", 1, "NVIDIA H100")
        cache.put(key, {"gemm": ("portable", cands[0])}, {"gemm": 0.5})
        assert tuner.TuneCache(f"{d}/t.json").get(key) == {"gemm": ("portable", cands[0])}
