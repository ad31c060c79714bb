"""The benchmark runner on emulated ranks, with a stand-in registry entry (no kernels): rows agree
on every rank, a stage that fails on one rank fails on all of them and the run goes on, configs
past the time budget are recorded as not run, and the JSON is rewritten after every config."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from ditron_ep.bench.ranks import StageFailed, guarded
from ditron_ep.bench.registry import BENCHMARKS
from ditron_ep.bench.report import PartialJson
from ditron_ep.bench.runner import run_requests
from ditron_ep.bench.spec import BenchContext, Benchmark, BenchRequest, Impl, Measurement, Shape

TIMEOUT_S = 120
REQUEST = BenchRequest("stand-in", Shape(16, 4, 2), (1, 3), "fp32", iters=2, warmup=1)


def _plan(req: BenchRequest, tokens: int, options: Mapping[str, Any], on_gpu: bool) -> tuple[Impl, ...]:
    return (Impl("mine", against=("theirs",)), Impl("fails at T=3", against=("theirs",)), Impl("theirs", "baseline"),
            Impl("derived", "reference", timed=False))


def _run(ctx: BenchContext, tokens: int) -> list[Measurement]:
    def body() -> None:
        if tokens == 3 and ctx.rank == 1:
            raise RuntimeError("boom")

    try:
        guarded(ctx, "a stage", body)
        broken = ctx.measure("fails at T=3", lambda: None, 1e6, "ok", True)
    except StageFailed as exc:
        broken = Measurement("fails at T=3", work=1e6, ok=False, error=str(exc))
    return [ctx.measure("mine", lambda: sum(range(100)), 1e6, "ok: fine", True), broken,
            ctx.measure("theirs", lambda: sum(range(20_000)), 1e6, "reference", True),
            Measurement("derived", value_us=123.0, check="derived", details={"from": "mine"})]


STAND_IN = Benchmark(name="stand-in", description="no kernels", metric="GB/s", work_rule="1 MB a call",
                     check_rule="none", shapes={"emulated": REQUEST.shape}, tokens={"emulated": (1, 3)},
                     plan=_plan, run=_run)


def run_stand_in(budget: float | None, json_path: str | None) -> list[dict]:
    """Rank function: the stand-in entry through run_requests (registered on this rank meanwhile)."""
    BENCHMARKS[STAND_IN.name] = STAND_IN
    try:
        partial = None if json_path is None else PartialJson(Path(json_path), [REQUEST], "emulated", "gloo", 2,
                                                             {"kind": "cpu", "name": "cpu", "torch": "-",
                                                              "triton": "-", "host": "-"})
        return [r.to_json() for r in run_requests([REQUEST], "emulated", on_config=partial, time_budget_s=budget)]
    finally:
        del BENCHMARKS[STAND_IN.name]


def test_rows_agree_and_a_failed_stage_fails_its_row_on_every_rank(emulated_cluster, tmp_path: Path) -> None:
    path = tmp_path / "partial.json"
    ranks = emulated_cluster(2).run(run_stand_in, None, str(path), timeout_s=TIMEOUT_S)
    assert ranks[0] == ranks[1], "every rank gets the same rows"
    rows = {(r["impl"], r["tokens"]): r for r in ranks[0]}
    assert [(r["impl"], r["tokens"]) for r in ranks[0]] == [(i.name, t) for t in (1, 3) for i in _plan(
        REQUEST, t, {}, False)]
    mine = rows[("mine", 1)]
    assert mine["ok"] and mine["speedup"] == rows[("theirs", 1)]["median_us"] / mine["median_us"]
    assert mine["metric_value"] == 1e6 / (mine["median_us"] * 1e-6) / 1e9
    assert rows[("fails at T=3", 1)]["ok"]
    failed = rows[("fails at T=3", 3)]
    assert not failed["ok"] and failed["error"] == "rank 1: a stage: RuntimeError: boom"
    assert rows[("mine", 3)]["ok"], "the run goes on after a failed stage"
    derived = rows[("derived", 3)]
    assert (derived["median_us"], derived["p20_us"], derived["details"]) == (123.0, None, {"from": "mine"})
    doc = json.loads(path.read_text())   # rank 0 rewrote it after every config; the last has every row
    assert doc["complete"] is False and doc["ok"] is False and len(doc["rows"]) == len(ranks[0])


def test_configs_past_the_time_budget_are_not_run(emulated_cluster) -> None:
    rows = emulated_cluster(2).run(run_stand_in, 1e-9, None, timeout_s=TIMEOUT_S)[0]
    assert len(rows) == 8 and all(not r["ok"] for r in rows)
    assert {r["error"] for r in rows} == {"not run: the time budget of 1e-09 s was spent"}
