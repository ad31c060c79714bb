"""`python -m ditron_ep bench`: a real run of every registry entry on 2 emulated ranks (exit code,
JSON schema, each entry's rows and checks, table widths, plot), the launched-ranks path under
torchrun, bad arguments, the missing-matplotlib error, and the verdict logic on fabricated results.

One real run (every benchmark, one token count, one timed iteration, the grouped GEMM sweep, one
timeline variant and a larger layer) serves the schema, entry, table and plot tests; everything else runs no
ranks, except the torchrun test.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from ditron_ep import cli
from ditron_ep.bench import report
from ditron_ep.bench.alltoall import AllToAll
from ditron_ep.bench.ranks import RankContext
from ditron_ep.bench.registry import BENCHMARKS
from ditron_ep.bench.runner import build_rows
from ditron_ep.bench.spec import BenchRequest, Measurement, Row, Shape
from ditron_ep.check import make_routing

REPO = Path(__file__).resolve().parents[1]
TOKENS = (3,)
CAPACITY = 8   # of the moe entry's layer that serves every smaller T
VARIANT = "comm_programs=0,recv_lag=0"
ROW_KEYS = {f.name for f in dataclasses.fields(Row)}
META_KEYS = {"ditron_ep", "date", "commit", "commit_dirty", "backend", "collectives", "world_size", "device",
             "device_kind", "device_info", "torch", "triton", "python", "host", "timer", "not_performance", "wall_s"}
BENCH_KEYS = {"description", "ours", "baselines", "references", "metric", "work_rule", "check_rule", "shape",
              "tokens", "dtype", "iters", "warmup", "routing", "options"}
WIDTH = 160


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One `bench --bench all` on 2 emulated ranks (one token count: each costs every entry
    again): its exit status, JSON and plot."""
    out = tmp_path_factory.mktemp("bench")
    argv = ["bench", "--bench", "all", "--world-size", "2", "--tokens", *map(str, reversed(TOKENS)),
            "--iters", "1", "--warmup", "0", "--opt", f"variant={VARIANT}", "--opt", "sweep=1",
            "--opt", f"layer_tokens={CAPACITY}",
            "--json", str(out / "sub" / "bench.json")]
    if _has_matplotlib():
        argv += ["--plot", str(out / "bench.png")]
    status = cli.main(argv)
    return {"status": status, "doc": json.loads((out / "sub" / "bench.json").read_text()), "png": out / "bench.png"}


def _rows(doc: dict, bench: str, tokens: int | None = None) -> dict[str, dict]:
    return {r["impl"]: r for r in doc["rows"] if r["bench"] == bench and tokens in (None, r["tokens"])}


def _planned(name: str, b: dict, tokens: int) -> list:
    bench = BENCHMARKS[name]
    req = BenchRequest(name, Shape(**b["shape"]), tuple(b["tokens"]), b["dtype"], b["iters"], b["warmup"],
                       routing=b["routing"], options=tuple(tuple(p) for p in b["options"]))
    return list(bench.plan(req, tokens, bench.parse_options(req.options), False))


# ----------------------------------------------------------------------------- a real run
def test_every_benchmark_runs_and_passes(run: dict) -> None:
    doc = run["doc"]
    failed = [(r["bench"], r["impl"], r["tokens"], r["error"] or r["check"]) for r in doc["rows"] if not r["ok"]]
    assert run["status"] == 0 and doc["ok"] is True and doc["complete"] is True, failed


def test_json_schema(run: dict) -> None:
    doc = run["doc"]
    assert set(doc) == {"schema", "ok", "complete", "meta", "benchmarks", "rows"} and doc["schema"] == report.SCHEMA
    json.loads(json.dumps(doc, allow_nan=False))
    meta = doc["meta"]
    assert set(meta) == META_KEYS
    assert meta["backend"] == "emulated" and meta["collectives"] == "gloo" and meta["world_size"] == 2
    assert meta["device_kind"] == "cpu" and meta["not_performance"] == report.CPU_NOTE
    assert isinstance(meta["commit"], str) and meta["commit"] and isinstance(meta["wall_s"], float)
    assert meta["device_info"]["kind"] == "cpu" and meta["device_info"]["torch"] == meta["torch"]
    assert list(doc["benchmarks"]) == list(BENCHMARKS)
    expected = []
    for name, b in doc["benchmarks"].items():
        assert set(b) == BENCH_KEYS
        assert b["tokens"] == list(TOKENS) and b["dtype"] == "fp32" and (b["iters"], b["warmup"]) == (1, 0)
        gbs = ("dispatch", "combine", "dispatch_combine", "megatron_dispatch", "torchtitan_dispatch")
        assert b["metric"] == ("GB/s" if name in gbs else "TFLOP/s")
        options = {"moe_timeline": [["variant", VARIANT]], "grouped_gemm": [["sweep", "1"]],
                   "moe": [["layer_tokens", str(CAPACITY)]]}
        assert b["options"] == options.get(name, [])
        for t in TOKENS:
            impls = _planned(name, b, t)
            assert b["ours"] + b["baselines"] + b["references"] == list(dict.fromkeys(
                i.name for t_ in TOKENS for k in ("ours", "baseline", "reference")
                for i in _planned(name, b, t_) if i.kind == k))
            expected += [(name, i.name, t) for i in impls]
    assert [(r["bench"], r["impl"], r["tokens"]) for r in doc["rows"]] == expected
    for r in doc["rows"]:
        assert set(r) == ROW_KEYS
        b = doc["benchmarks"][r["bench"]]
        kind = "ours" if r["impl"] in b["ours"] else "baseline" if r["impl"] in b["baselines"] else "reference"
        assert r["kind"] == kind
        assert (r["hidden"], r["experts"], r["topk"], r["inter"]) == tuple(b["shape"].values())
        assert r["world_size"] == 2 and r["dtype"] == "fp32" and r["iters"] == 1 and r["metric"] == b["metric"]
        assert isinstance(r["median_us"], float) and r["median_us"] > 0
        if r["p20_us"] is None:   # a figure derived from other rows
            assert r["impl"].startswith("floor") and r["p80_us"] is None
        else:
            assert r["p20_us"] <= r["median_us"] <= r["p80_us"]
        assert r["ok"] is True and r["error"] is None and isinstance(r["check"], str) and r["check"]
        if r["kind"] == "ours" and r["speedups"]:
            assert r["baseline"] == next(iter(r["speedups"]))
            assert set(r["speedups"]) <= set(b["baselines"]) | set(b["references"])  # references: floors
            assert r["speedup"] == r["speedups"][r["baseline"]] > 0
            assert r["speedup"] == pytest.approx(_rows(doc, r["bench"], r["tokens"])[r["baseline"]]["median_us"]
                                                 / r["median_us"])
        else:
            assert r["speedup"] is None and r["speedups"] == {}


def test_ep_entries_check_every_stage(run: dict) -> None:
    doc = run["doc"]
    for t in TOKENS:
        d, c, dc = (_rows(doc, n, t) for n in ("dispatch", "combine", "dispatch_combine"))
        assert d["dispatch kernel"]["check"] == d["EPBuffer.dispatch"]["check"] == "ok: bit-exact"
        assert c["EPBuffer.combine"]["check"].startswith("ok: ") and c["all_to_all_single"]["check"] == "reference"
        assert dc["layout"]["check"] == "ok: received rows == the baseline's" and dc["layout"]["metric_value"] is None
        assert dc["dispatch kernel"]["check"] == "ok: bit-exact" and dc["combine kernel"]["check"].startswith("ok: ")
        assert list(dc["EPBuffer.dispatch"]["speedups"]) == ["a2a dispatch", "floor: dispatch"]
        assert list(dc["EPBuffer.combine"]["speedups"]) == ["a2a combine", "floor: combine"]
        assert dc["floor: dispatch"]["median_us"] > 0 and "NVLink" in dc["floor: dispatch"]["check"]
        assert dc["layout"]["speedups"] == {} and not any(i.startswith("graph") for i in dc)  # graphs: GPUs only
        moved = {i: dc[i]["metric_value"] * dc[i]["median_us"] * 1e3 for i in dc if i.startswith("a2a")}  # bytes
        assert moved["a2a dispatch+combine"] == pytest.approx(moved["a2a dispatch"] + moved["a2a combine"])


def test_layer_entries_check_against_their_baselines(run: dict) -> None:
    doc = run["doc"]
    (small,) = TOKENS
    moe = _rows(doc, "moe", small)
    assert moe["moe overlap"]["check"].endswith(" <= rtol 1e-05")
    assert list(moe["moe staged"]["speedups"]) == ["torch-native", "grouped GEMM alone"]
    assert moe[f"FusedMoE sized for T={CAPACITY}"]["check"] == "ok: bitwise == moe overlap"
    assert moe["torch-native"]["check"].startswith("reference") and moe["gate-up: torch W col-major"]["kind"] == \
        "reference"
    floor = moe["floor: max(compute, memory)"]
    fastest = min(moe[n]["median_us"] for n in moe if n.startswith("gate-up: ")) + \
        min(moe[n]["median_us"] for n in moe if n.startswith("down: "))
    assert floor["median_us"] >= fastest * (1 - 1e-9) and floor["details"]["compute_us"] == pytest.approx(fastest)
    assert moe["memory copy"]["details"]["bytes_per_s"] > 0
    train = _rows(doc, "moe_train", small)
    assert train["moe overlap, fwd+bwd"]["check"].startswith("ok: grads vs fp32 <= ")
    assert train["moe sequential, recompute"]["check"].endswith("bitwise == default")
    assert train["torch-native, fwd+bwd"]["check"].startswith("reference: grads vs fp32 <= ")
    assert list(train["moe overlap, recompute"]["speedups"]) == ["torch-native, fwd+bwd"]
    assert train["floor: 3 x forward GEMMs"]["median_us"] == pytest.approx(3 * sum(
        train[n]["median_us"] for n in ("gate-up: dense, one expert's W", "down: dense, one expert's W")))
    timeline = _rows(doc, "moe_timeline", small)
    assert timeline["overlap"]["check"] == timeline[f"overlap {VARIANT}"]["check"] == "ok: bitwise == sequential"
    assert timeline[f"overlap {VARIANT}"]["details"]["plan"]["comm_programs"] == 0
    reports = timeline["overlap"]["details"]["overlap"]
    assert len(reports) == 2 and all(r["gate_up_tiles"] > 0 for r in reports)
    gemm = _rows(doc, "grouped_gemm", small)
    assert all(r["check"].endswith(" <= rtol 1e-05") for r in gemm.values() if r["kind"] == "ours")
    assert "FFN, best swept pair" in gemm and sum("one-tile" in i for i in gemm) == 4
    assert list(gemm["FFN"]["speedups"]) == ["torch FFN, W row-major", "torch FFN, W col-major"]


def test_table_fits_160_columns(run: dict) -> None:
    console = Console(record=True, width=WIDTH, file=io.StringIO())
    report.print_report(run["doc"], console)
    text = console.export_text()
    too_wide = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not too_wide, too_wide[:3]
    assert report.CPU_NOTE in text and "world size 2" in text and run["doc"]["meta"]["commit"][:12] in text
    for r in run["doc"]["rows"]:
        assert r["impl"] in text, f"{r['impl']} is cut in the table"
    assert "median µs" in text and "p20 µs" in text and "GB/s" in text and "TFLOP/s" in text
    assert "× a2a dispatch" in text and "× torch-native" in text and "× row-major" in text
    assert "overlap report per rank" in text   # moe_timeline's own view
    assert f"OK: {len(run['doc']['rows'])}/{len(run['doc']['rows'])} rows" in text


@pytest.mark.skipif(not _has_matplotlib(), reason="matplotlib not installed (pip install 'ditron_ep[plot]')")
def test_plot_is_written(run: dict) -> None:
    assert run["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_under_torchrun_rank_0_reports(tmp_path: Path) -> None:
    """The launched-ranks path (as on GPUs), here with gloo ranks that torchrun starts."""
    path = tmp_path / "torchrun.json"
    env = dict(os.environ, TRITON_INTERPRET="1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", COLUMNS="160",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "ditron_ep", "bench", "--bench", "dispatch", "--tokens", "4", "--iters", "1",
                           "--warmup", "0", "--opt", "block_rows=8", "--json", str(path)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(path.read_text())
    assert doc["ok"] is True and doc["complete"] is True and doc["meta"]["world_size"] == 2
    assert doc["meta"]["collectives"] == "gloo" and doc["benchmarks"]["dispatch"]["options"] == [["block_rows", "8"]]
    assert [(r["impl"], r["tokens"]) for r in doc["rows"]] == [
        ("dispatch kernel", 4), ("EPBuffer.dispatch", 4), ("dispatch kernel token_major", 4),
        ("EPBuffer.dispatch token_major", 4),
        ("all_to_all_single", 4)]
    assert done.stdout.count("ditron_ep bench") == 1, "only rank 0 prints the report"
    assert max(map(len, done.stdout.splitlines())) <= WIDTH


# ----------------------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("argv, message", [
    (["--tokens", "0"], "must be a positive integer, got 0"),
    (["--iters", "x"], "must be a positive integer, got 'x'"),
    (["--warmup", "-1"], "must be a non-negative integer, got -1"),
    (["--bench", "gemm"], "invalid choice: 'gemm'"),
    (["--backend", "nccl"], "invalid choice: 'nccl'"),
    (["--world-size", "4", "--experts", "6"], "--experts 6 is not a multiple of the world size 4"),
    (["--world-size", "3"], "--experts 8 is not a multiple of the world size 3"),
    (["--topk", "9"], "--topk 9 exceeds --experts 8"),
    (["--dtype", "bf16"], "moe on emulated ranks runs in fp32 only, not bf16"),
    (["--backend", "torch"], "torchrun --nproc-per-node N -m ditron_ep bench --backend torch"),
    (["--opt", "sweep"], "expected KEY=VALUE, got 'sweep'"),
    (["--opt", "sweep=1"], "--opt sweep: no benchmark of this run has it"),
    (["--bench", "dispatch_combine", "--opt", "mode=lazy"], "must be a comma-separated list of eager, graph"),
    (["--bench", "dispatch", "--opt", "buffer_tokens=4", "--tokens", "8"], "buffer_tokens=4 is below the largest"),
    (["--bench", "moe_timeline", "--opt", "variant=comm_programs"], "expected FIELD=VALUE"),
    (["--bench", "moe_timeline", "--opt", "variant=gate_up_config=BM7"], "expected BM<m>-BN<n>-BK<k>"),
    (["--bench", "grouped_gemm", "--opt", "ranks=3"], "--experts 8 is not a multiple of --opt ranks=3"),
    (["--bench", "moe", "--routing", "one_rank"], "moe runs the routings uniform, zipf only"),
    (["--time-budget", "0"], "must be a positive number"),
], ids=["tokens0", "iters-text", "warmup-neg", "bench", "backend", "experts", "world3", "topk", "bf16-moe", "torch",
        "opt-form", "opt-unknown", "opt-mode", "opt-capacity", "opt-variant", "opt-config", "opt-ranks", "routing",
        "budget"])
def test_bad_arguments_exit_2_before_any_rank_starts(argv: list[str], message: str, monkeypatch, capsys) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(cli, "run_emulated_bench", _no_ranks)
    assert cli.main(["bench", *argv]) == 2
    assert message in " ".join(capsys.readouterr().err.split())  # rich wraps at 80 columns


def _no_ranks(*args, **kwargs):
    raise AssertionError("ranks started despite bad arguments")


def test_requests_from_arguments(monkeypatch) -> None:
    seen: list[BenchRequest] = []

    def ranks_that_fail(world: int, requests: list[BenchRequest], *args) -> None:
        seen.extend(requests)
        return None  # as when the ranks could not start: exit 1

    monkeypatch.setattr(cli, "run_emulated_bench", ranks_that_fail)
    assert cli.main(["bench", "--dtype", "bf16", "--bench", "dispatch", "combine", "dispatch", "--tokens", "16", "4",
                     "16", "--hidden", "32", "--routing", "zipf", "--opt", "num_programs=3"]) == 1
    assert [(r.bench, r.dtype, r.tokens, r.shape, r.routing, r.options) for r in seen] == [
        (name, "bf16", (4, 16), Shape(hidden=32, experts=8, topk=2), "zipf", (("num_programs", "3"),))
        for name in ("dispatch", "combine")]
    assert (seen[0].iters, seen[0].warmup) == (3, 1)
    seen.clear()
    assert cli.main(["bench"]) == 1
    assert [r.bench for r in seen] == [n for n, b in BENCHMARKS.items() if b.default] == ["dispatch", "combine", "moe"]
    seen.clear()
    assert cli.main(["bench", "--bench", "all", "--opt", "mode=eager", "--opt", "variant=recv_lag=4",
                     "--opt", "variant=comm_programs=0"]) == 1
    by = {r.bench: r.options for r in seen}
    assert list(by) == list(BENCHMARKS) and by["dispatch_combine"] == (("mode", "eager"),)
    assert by["moe_timeline"] == (("variant", "recv_lag=4"), ("variant", "comm_programs=0"))
    assert by["dispatch"] == by["moe"] == by["grouped_gemm"] == ()


def test_world_size_must_match_torchrun(monkeypatch, capsys) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert cli.main(["bench", "--world-size", "2"]) == 2
    assert "torchrun launched 4 ranks" in capsys.readouterr().err


def test_plot_without_matplotlib_exits_2_before_running(monkeypatch, tmp_path: Path, capsys) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    monkeypatch.setattr(cli, "run_emulated_bench", _no_ranks)
    assert cli.main(["bench", "--plot", str(tmp_path / "p.png")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--plot needs matplotlib" in err and "pip install 'ditron_ep[plot]'" in err
    assert not (tmp_path / "p.png").exists()


def test_help_lists_every_option(capsys) -> None:
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for b in BENCHMARKS.values():
        assert all(f"  {o.key} (" in out for o in b.options)


# ----------------------------------------------------------------------------- verdict (pure)
REQUEST = BenchRequest("moe", Shape(64, 8, 2, 32), (16,), "fp32", iters=3, warmup=1, options=(("refs", "0"),))
MOE_IMPLS = BENCHMARKS["moe"].plan(REQUEST, 16, BENCHMARKS["moe"].parse_options(REQUEST.options), False)


def _measured(check_ok: bool = True, drop: str | None = None) -> list[Measurement]:
    times = {"moe overlap": 200.0, "moe sequential": 300.0, "moe staged": 100.0, "torch-native": 400.0,
             "grouped GEMM alone": 50.0}
    out = [Measurement(i, [t * 0.9, t, t * 1.2], 1e9, "ok: 1.0e-07 <= rtol 1e-05", True)
           for i, t in times.items() if i != drop]
    if not check_ok:
        out[0] = dataclasses.replace(out[0], check="FAIL: 5.0e-01 > rtol 1e-05", ok=False)
    return out


def test_rows_speedups_and_metric() -> None:
    rows = build_rows(BENCHMARKS["moe"], REQUEST, 16, 2, _measured(), MOE_IMPLS)
    by = {r.impl: r for r in rows}
    assert [r.impl for r in rows] == [i.name for i in MOE_IMPLS] == [
        "moe overlap", "moe sequential", "moe staged", "torch-native", "grouped GEMM alone"]
    assert by["moe overlap"].speedup == pytest.approx(2.0) and by["moe overlap"].baseline == "torch-native"
    assert by["moe staged"].speedups == pytest.approx({"torch-native": 4.0, "grouped GEMM alone": 0.5})
    assert by["torch-native"].speedup is None and by["torch-native"].kind == "baseline"
    assert by["moe overlap"].metric_value == pytest.approx(1e9 / 200e-6 / 1e12)
    assert (by["moe overlap"].p20_us, by["moe overlap"].p80_us) == pytest.approx((188.0, 224.0))  # interpolated
    assert report.exit_status(rows) == 0


def test_failed_check_and_missing_result_fail_the_run() -> None:
    rows = build_rows(BENCHMARKS["moe"], REQUEST, 16, 2, _measured(check_ok=False, drop="moe staged"), MOE_IMPLS)
    by = {r.impl: r for r in rows}
    assert not by["moe overlap"].ok and by["moe overlap"].median_us == 200.0, "measured, but its check failed"
    assert not by["moe staged"].ok and "returned no result" in by["moe staged"].error
    assert by["moe sequential"].ok
    assert report.exit_status(rows) == 1 and report.exit_status([]) == 1


def test_a_failed_baseline_gives_no_speedup() -> None:
    measured = _measured()
    measured[3] = Measurement("torch-native", None, 1e9, "", False, error="boom")
    by = {r.impl: r for r in build_rows(BENCHMARKS["moe"], REQUEST, 16, 2, measured, MOE_IMPLS)}
    assert by["moe overlap"].speedups == pytest.approx({"grouped GEMM alone": 0.25})
    assert by["moe overlap"].baseline == "torch-native" and by["moe overlap"].speedup is None


def test_main_exits_1_and_reports_a_failed_check(monkeypatch, tmp_path: Path, capsys) -> None:
    rows = build_rows(BENCHMARKS["moe"], REQUEST, 16, 2, _measured(check_ok=False), MOE_IMPLS)
    monkeypatch.setattr(cli, "run_emulated_bench", lambda world, requests, *args: rows)
    path = tmp_path / "fail.json"
    assert cli.main(["bench", "--bench", "moe", "--opt", "refs=0", "--json", str(path)]) == 1
    doc = json.loads(path.read_text())
    assert doc["ok"] is False and [r["ok"] for r in doc["rows"]] == [False, True, True, True, True]
    out = capsys.readouterr().out
    assert "FAIL moe T=16 moe overlap: FAIL: 5.0e-01 > rtol 1e-05" in " ".join(out.split())
    assert "FAILED: 4/5 rows" in out


def test_gpu_only_rows_are_planned_on_gpus_only() -> None:
    moe = BENCHMARKS["moe"]
    on_cpu = {i.name for i in moe.plan(REQUEST, 16, moe.parse_options(REQUEST.options), False)}
    on_gpu = {i.name for i in moe.plan(REQUEST, 16, moe.parse_options(REQUEST.options), True)}
    assert on_gpu - on_cpu == {"moe overlap, CUDA graph", "FusedMoE, graph cache off"}
    graph = Measurement("moe overlap, CUDA graph", [90.0, 100.0, 110.0], 1e9, "ok: bitwise == eager overlap", True)
    impls = moe.plan(REQUEST, 16, moe.parse_options(REQUEST.options), True)
    by = {r.impl: r for r in build_rows(moe, REQUEST, 16, 2, [*_measured(), graph], impls)}
    assert by[graph.impl].ok and by[graph.impl].kind == "ours" and by[graph.impl].speedup == pytest.approx(4.0)
    assert not by["FusedMoE, graph cache off"].ok and "returned no result" in by["FusedMoE, graph cache off"].error


# ----------------------------------------------------------------------------- the baseline's reference
def _exchange(plans: list[AllToAll], reverse: bool) -> None:
    """all_to_all_single among `plans` without a process group: rank r receives, in source-rank
    order, the slice each other rank's send buffer holds for r."""
    for r, p in enumerate(plans):
        parts = []
        for s, q in enumerate(plans):
            splits, buf = (q.recv_splits, q.back_send) if reverse else (q.send_splits, q.send)
            start = sum(splits[:r])
            parts.append(buf[start:start + splits[r]])
        (p.back_recv if reverse else p.recv).copy_(torch.cat(parts))


@pytest.mark.parametrize("world", [2, 3])
def test_alltoall_reference_is_the_ep_permutation_and_combine(world: int) -> None:
    T, E, K, H = 7, 3 * world, 2, 5
    xs = [torch.randn(T, H, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    routing = [make_routing(T, E, K, "zipf", generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
    idx_all, w_all = [i for i, _ in routing], [w for _, w in routing]
    plans = [AllToAll(RankContext(rank=r, world=world, device=torch.device("cpu"), dtype=torch.float32),
                      xs[r], idx_all, w_all, E) for r in range(world)]
    _exchange(plans, reverse=False)
    e_local = E // world
    for r, p in enumerate(plans):
        want = [xs[s][t] for e in range(r * e_local, (r + 1) * e_local) for s in range(world)
                for t in range(T) for k in range(K) if idx_all[s][t, k] == e]
        assert torch.equal(p.expected_dispatch(), torch.stack(want) if want else xs[r][:0])
        p.pack_combine()
    _exchange(plans, reverse=True)
    for r, p in enumerate(plans):
        torch.testing.assert_close(p.expected_combine(), xs[r] * w_all[r].sum(1, keepdim=True))


def test_commit_named_by_the_environment_has_no_dirty_flag(monkeypatch) -> None:
    from ditron_ep.bench.environment import git_commit, git_dirty
    monkeypatch.setenv("DITRON_COMMIT", "abc1234")
    assert git_commit() == "abc1234" and git_dirty() is None


def test_unwritable_output_path_exits_2_before_running(capsys) -> None:
    assert cli.main(["bench", "--json", "/proc/no_such_dir/b.json"]) == 2
    assert "cannot create the folder of output path" in " ".join(capsys.readouterr().err.split())
