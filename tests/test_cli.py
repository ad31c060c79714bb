"""`python -m ditron_ep`: info, check (on emulated ranks), the verdict logic, bad arguments.

The verdict and exit status are pure functions of the case results, so failures are tested with
fabricated results and fake rank runners; one real `check` runs on 2 emulated ranks.
"""
from __future__ import annotations

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
from ditron_ep.check import selfcheck
from ditron_ep.check.report import CaseResult, CheckReport, exit_status
from ditron_ep.ops.ep.naive import recv_order
from ditron_ep.ops.moe_layer.naive import ep_moe_oracle
from ditron_ep.runtime import RankError

REPO = Path(__file__).resolve().parents[1]
CASE_KEYS = {"case", "kind", "max_abs", "max_rel", "bitwise", "ok", "detail"}


def _render(report: CheckReport) -> str:
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(cli.build_table(report))
    return console.export_text()


def _report(*cases: CaseResult) -> CheckReport:
    return CheckReport("emulated", 2, 0, tuple(cases), wall_s=1.0)


PASSING = CaseResult("exchange fp32 16x64", "signal", 0.0, 0.0, True, True, "2 calls")
FAILING = CaseResult("reference zipf bf16", "reference", 0.5, 0.25, False, False,
                     "rank 1 output: 3/48 elements outside bf16 tolerance")


# ----------------------------------------------------------------------------- info
def test_info_prints_versions_and_exits_0() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "ditron_ep", "info"], capture_output=True,
                          text=True, timeout=120, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for name in ("ditron_ep", "python", "torch", "triton", "numpy", "rich", "nvshmem4py",
                 "deepspeed", "backend emulated", "backend torch", "kernels"):
        assert name in out, f"{name!r} missing from info:\n{out}"
    assert torch.__version__ in out
    if not torch.cuda.is_available():
        assert "CPU only" in out and "interpreted" in out


@pytest.mark.parametrize("version, broken", [("2.3.5", False), ("2.4.0", True), ("3.0.1", True)])
def test_numpy_that_breaks_the_interpreter_is_named(monkeypatch, version: str, broken: bool) -> None:
    import numpy

    monkeypatch.setattr(numpy, "__version__", version)
    problem = cli.interpreter_numpy_problem()
    assert (problem is not None) is broken
    if broken:
        assert f"numpy {version}" in problem and "numpy<2.4" in problem


# ----------------------------------------------------------------------------- check, for real
def test_check_quick_on_two_ranks_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "sub" / "out.json"
    assert cli.main(["check", "--world-size", "2", "--quick", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert {"ok", "backend", "world_size", "cases"} <= set(report)
    assert report["ok"] is True and report["backend"] == "emulated" and report["world_size"] == 2
    names = [c["case"] for c in report["cases"]]
    assert len(names) == len(set(names)) == selfcheck.count_rows(selfcheck.plan_cases(2, quick=True))
    for case in report["cases"]:
        assert set(case) == CASE_KEYS
        assert case["kind"] in selfcheck.KINDS
        assert case["ok"] is True, case
    kinds = {c["kind"] for c in report["cases"]}
    assert kinds == set(selfcheck.KINDS) - {"against"}  # against runs only with --against
    assert "dispatch uniform fp32: rows vs permutation" in names
    assert "moe uniform fp32: overlap vs sequential" in names
    assert any("timeout" in n for n in names)
    reference = [c for c in report["cases"] if c["kind"] == "reference"]
    assert all(c["bitwise"] is True and 0 <= c["max_abs"] < 0.05 for c in reference)
    out = capsys.readouterr().out
    assert "PASS" in out and "FAIL" not in out and "backend emulated, 2 ranks" in out


# ----------------------------------------------------------------------------- verdict (pure)
def test_failing_case_fails_the_report_and_the_table() -> None:
    assert exit_status(_report(PASSING)) == 0
    report = _report(PASSING, FAILING)
    assert not report.ok and report.failures == [FAILING] and exit_status(report) == 1
    assert exit_status(_report()) == 1, "a run with no cases proves nothing"
    text = _render(report)
    assert "FAIL" in text and "PASS" in text and "NO" in text and "1/2 cases passed" in text
    assert "5.00e-01" in text and "2.50e-01" in text
    doc = report.to_json()
    assert doc["ok"] is False and [c["ok"] for c in doc["cases"]] == [True, False]


def test_json_has_no_bare_infinity() -> None:
    row = CaseResult("x", "reference", float("inf"), float("nan"), True, False, "").to_json()
    assert row["max_abs"] == "inf" and row["max_rel"] == "nan"
    json.loads(json.dumps(row, allow_nan=False))


def test_main_returns_1_and_writes_failed_json(monkeypatch, tmp_path: Path, capsys) -> None:
    monkeypatch.setattr(cli, "run_emulated_check", lambda world_size, **options: _report(PASSING, FAILING))
    path = tmp_path / "fail.json"
    assert cli.main(["check", "--json", str(path)]) == 1
    doc = json.loads(path.read_text())
    assert doc["ok"] is False and doc["cases"][1]["detail"].startswith("rank 1 output")
    assert "FAIL reference zipf bf16" in capsys.readouterr().out


def _oracle_runner(corrupt: str | None = None):
    """A fake RankRunner for the reference case: every rank 'returns' the oracle in its dtype."""

    def run(fn, backend, inputs, repeats):
        assert fn is selfcheck.rank_reference and repeats == 2
        outs = ep_moe_oracle(inputs.xs, inputs.topk_idxs, inputs.topk_weights, inputs.w1s, inputs.w2s)
        results = [[o.to(x.dtype), o.to(x.dtype)] for o, x in zip(outs, inputs.xs)]
        if corrupt == "value":
            results[1] = [r.clone() for r in results[1]]
            for r in results[1]:
                r[0, 3] += 1.0
        elif corrupt == "second_run":
            results[0][1] = results[0][1].clone()
            results[0][1][0, 0] = torch.nextafter(results[0][1][0, 0], torch.tensor(9.0, dtype=results[0][1].dtype))
        return results

    return run


@pytest.mark.parametrize("corrupt, bitwise", [(None, True), ("value", True), ("second_run", False)])
def test_reference_verdict(corrupt: str | None, bitwise: bool) -> None:
    (case,) = [c for c in selfcheck.plan_cases(2) if c.name == "reference zipf fp32"]
    result = selfcheck.run_case(case, _oracle_runner(corrupt), "emulated", 2)
    assert result.bitwise is bitwise
    assert result.ok is (corrupt is None), result
    if corrupt == "value":
        assert result.max_abs == pytest.approx(1.0, rel=1e-3)
        assert "rank 1 output" in result.detail and "outside" in result.detail
    if corrupt == "second_run":
        assert "differ bitwise" in result.detail


def test_case_that_raises_is_a_failed_row() -> None:
    def broken_runner(fn, *args):
        raise RankError("rank 1 raised OSError: no space left\n--- remote traceback ---\n...", rank=1)

    report = selfcheck.run_check(broken_runner, "emulated", 2, selfcheck.plan_cases(2)[:1])
    (row,) = report.cases
    assert not row.ok and row.kind == "heap"
    assert row.detail == "RankError: rank 1 raised OSError: no space left"
    assert exit_status(report) == 1


def test_plan_cases() -> None:
    full, quick = selfcheck.plan_cases(4), selfcheck.plan_cases(4, quick=True)
    assert len(quick) < len(full)
    assert not any("timeout" in c.name for c in selfcheck.plan_cases(1))
    routings = {c.params["routing"] for c in full if c.kind == "reference"}
    assert routings == set(selfcheck.REFERENCE_ROUTINGS)
    assert {c.params["dtype"] for c in full if c.kind == "reference"} == {"fp32", "bf16"}


# ----------------------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("argv, message", [
    (["check", "--world-size", "0"], "must be a positive integer, got 0"),
    (["check", "--world-size", "two"], "must be a positive integer"),
    (["check", "--backend", "nccl"], "invalid choice: 'nccl'"),
    (["launch"], "invalid choice: 'launch'"),
    ([], "required"),
    (["tune", "--tokens", "0"], "must be a positive integer, got 0"),
    (["tune", "--dtype", "fp32"], "invalid choice: 'fp32'"),
    (["tune", "--tp-gemm", "128x8192"], "expected MxKxN with three positive ints"),
], ids=["world0", "world-text", "backend", "command", "no-command", "tune-tokens", "tune-dtype", "tune-tp-gemm"])
def test_bad_arguments_exit_2(argv: list[str], message: str, capsys) -> None:
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_tune_without_a_gpu_says_where_to_run_it(capsys) -> None:
    """The tuner times kernels: on a machine without CUDA `tune` exits 2 saying so (the search itself
    runs in tests/gpu/test_hopper_gemm_gpu.py)."""
    assert cli.main(["tune", "--tokens", "128"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "tune times kernels on a CUDA GPU and none is visible here" in err, err


def test_torch_backend_without_torchrun_exits_2(monkeypatch, capsys) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert cli.main(["check", "--backend", "torch"]) == 2
    assert "torchrun" in capsys.readouterr().err


def test_world_size_must_match_torchrun(monkeypatch, capsys) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert cli.main(["check", "--world-size", "2"]) == 2
    assert "torchrun launched 3 ranks" in capsys.readouterr().err


# ----------------------------------------------------------------------------- dispatch / moe / --against
def test_plan_of_new_kinds() -> None:
    full = selfcheck.plan_cases(4)
    rows = [n for c in full for n in c.row_names]
    assert len(rows) == len(set(rows)) == selfcheck.count_rows(full)
    for kind in ("dispatch", "moe"):
        assert {c.params["routing"] for c in full if c.kind == kind} == set(selfcheck.CASE_ROUTINGS)
    assert {c.params["dtype"] for c in full if c.kind == "moe"} == {"fp32"}, "interpreter: fp32 only"
    # bf16 on emulated ranks: dispatch/combine only (the interpreter's bf16 math is wrong)
    both = selfcheck.plan_cases(2, dtypes=("fp32", "bf16"), routings=("drops",))
    assert {(c.kind, c.params["dtype"]) for c in both if c.kind in ("dispatch", "moe")} == {
        ("dispatch", "fp32"), ("dispatch", "bf16"), ("moe", "fp32")}
    gpu = selfcheck.plan_cases(2, backend="torch", routings=("uniform",))
    assert {(c.kind, c.params["dtype"]) for c in gpu if c.kind in ("dispatch", "moe")} == {
        ("dispatch", "bf16"), ("moe", "bf16")}
    against = selfcheck.plan_cases(2, against="m:f", routings=("uniform", "zipf"), repeats=3)
    assert [c.kind for c in against] == ["against"] * 2 and against[0].params["repeats"] == 3
    assert against[0].row_names == tuple(f"m:f uniform fp32: {r}" for r in
                                         ("overlap vs sequential", "run vs run", "vs oracle"))


def test_multi_row_case_that_raises_fails_every_row() -> None:
    (case,) = selfcheck.plan_cases(2, against="m:f", routings=("uniform",))

    def broken_runner(fn, *args):
        raise RankError("rank 0 raised ImportError: no module m", rank=0)

    report = selfcheck.run_check(broken_runner, "emulated", 2, [case])
    assert [r.case for r in report.cases] == list(case.row_names)
    assert not any(r.ok for r in report.cases) and exit_status(report) == 1


# One 2-rank run per function; K=4 so that a summation order can show (two terms added to zero
# commute: a + b == b + a).
AGAINST = ["check", "--world-size", "2", "--routings", "uniform", "--shape", "16,32,16,8,4"]


@pytest.mark.parametrize("spec, failing", [
    ("ditron_ep.ops.moe_layer.functional:moe", set()),
    ("cli_broken_impls:staged_moe", set()),
    ("cli_broken_impls:overlap_ulp_moe", {"overlap vs sequential"}),
    ("cli_broken_impls:swapped_rows_moe", {"vs oracle"}),
    # different random orders also make overlap differ from sequential
    ("cli_broken_impls:index_add_combine_moe", {"run vs run", "overlap vs sequential"}),
], ids=["ditron-moe", "staged", "ulp-in-overlap", "swapped-rows", "index-add-order"])
def test_against(spec: str, failing: set[str], tmp_path: Path, capsys) -> None:
    path = tmp_path / "against.json"
    status = cli.main([*AGAINST, "--against", spec, "--json", str(path)])
    doc = json.loads(path.read_text())
    assert status == (1 if failing else 0), doc
    assert doc["ok"] is (not failing) and doc["world_size"] == 2 and doc["backend"] == "emulated"
    rows = {c["case"].split(": ")[-1]: c for c in doc["cases"]}
    assert set(rows) == {"overlap vs sequential", "run vs run", "vs oracle"}
    for name, row in rows.items():
        assert set(row) == CASE_KEYS and row["kind"] == "against"
        assert row["case"].startswith(f"{spec} uniform fp32: ")
        assert row["ok"] is (name not in failing), row
        if name != "vs oracle":
            assert row["bitwise"] is (name not in failing)
    if "vs oracle" in failing:
        assert "outside torch.float32 tolerance" in rows["vs oracle"]["detail"]
        assert rows["vs oracle"]["max_abs"] > 1e-2
    if "overlap vs sequential" in failing and "run vs run" not in failing:  # exactly one ulp
        assert "rank 0: 1/" in rows["overlap vs sequential"]["detail"]
    out = capsys.readouterr().out
    assert ("FAIL" in out) is bool(failing)


@pytest.mark.parametrize("spec, failing", [
    ("ditron_ep.ops.moe_layer.functional:moe", set()),
    ("cli_broken_impls:grad_ulp_moe", {"backward: overlap vs sequential"}),
    ("cli_broken_impls:atomic_wgrad_moe", {"backward: run vs run", "backward: overlap vs sequential"}),
], ids=["ditron-moe", "grad-ulp-in-overlap", "atomic-wgrad"])
def test_against_backward(spec: str, failing: set[str], tmp_path: Path) -> None:
    """--backward adds three gradient rows; each broken backward fails exactly its rows, and its
    forward rows pass."""
    path = tmp_path / "against.json"
    status = cli.main([*AGAINST, "--against", spec, "--backward", "--json", str(path)])
    doc = json.loads(path.read_text())
    rows = {c["case"].split(": ", 1)[-1]: c for c in doc["cases"]}
    assert set(rows) == {"overlap vs sequential", "run vs run", "vs oracle", "backward: overlap vs sequential",
                         "backward: run vs run", "backward: vs oracle"}
    assert status == (1 if failing else 0), doc
    for name, row in rows.items():
        assert row["ok"] is (name not in failing), row
    assert "x, topk_weights, w1, w2 vs float64 autograd" in rows["backward: vs oracle"]["detail"]
    if spec.endswith("grad_ulp_moe"):
        assert "rank 0 grad w1: 1/" in rows["backward: overlap vs sequential"]["detail"]


@pytest.mark.parametrize("argv, message", [
    (["--against", "no_such_module_xyz:fn"], "cannot import module 'no_such_module_xyz'"),
    (["--against", "cli_broken_impls:nope"], "has no attribute 'nope'"),
    (["--against", "cli_broken_impls"], "MODULE:FN"),
    (["--against", "cli_broken_impls:_num_experts"], "expected fn(x, topk_idx"),
    (["--against", "cli_broken_impls:staged_moe", "--dtypes", "bf16"], "fp32 only"),
    (["--shape", "16,32,16,6,2"], "not a multiple of the world size 4"),
    (["--shape", "16,32,16,8"], "five positive integers"),
    (["--shape", "16,32,16,2,4"], "exceeds the number of experts"),
    (["--repeats", "1"], "at least 2 runs"),
    (["--routings", "uniform,bogus"], "unknown routing bogus"),
    (["--dtypes", "fp64"], "unknown dtype fp64"),
    (["--against", "cli_import_raises:f"], "importing module 'cli_import_raises' raised RuntimeError: boom at import"),
    (["--against", "cli_import_exits:f"], "importing module 'cli_import_exits' raised SystemExit: 3"),
    (["--against", "no_such_module_xyz:fire:"], "--against no_such_module_xyz:fire:: cannot import"),
    (["--json", "/proc/no_such_dir/r.json"], "cannot create the folder of output path /proc/no_such_dir/r.json"),
], ids=["module", "attr", "no-colon", "signature", "bf16-emulated", "experts", "shape-len", "topk",
        "repeats", "routing", "dtype", "import-raises", "import-exits", "emoji-code", "json-path"])
def test_bad_check_options_exit_2(argv: list[str], message: str, capsys) -> None:
    assert cli.main(["check", *argv]) == 2
    assert message in " ".join(capsys.readouterr().err.split())  # rich wraps at 80 columns


def _dispatch_runner(corrupt: str | None = None):
    """A fake RankRunner for a dispatch case: every rank 'returns' the reference permutation and
    a combine computed here, twice; `corrupt` breaks one thing."""

    def run(fn, backend, inputs, repeats):
        assert fn is selfcheck.rank_dispatch
        W, E = len(inputs.xs), inputs.num_experts
        terms = [torch.zeros(*i.shape, x.shape[1]) for i, x in zip(inputs.topk_idxs, inputs.xs)]
        received = []
        for r in range(W):
            order = recv_order(inputs.topk_idxs, r, E)
            rows = torch.stack([inputs.xs[s][t] for s, t, _ in order])
            experts = [int(inputs.topk_idxs[s][t, k]) for s, t, k in order]
            y = selfcheck._scaled_rows(rows, experts, rows.dtype)
            for row, (s, t, k) in enumerate(order):
                terms[s][t, k] = inputs.topk_weights[s][t, k] * y[row]
            counts = [experts.count(e) for e in range(r * E // W, (r + 1) * E // W)]
            received.append((rows, [sum(counts[:i]) for i in range(len(counts) + 1)]))
        results = []
        for r, (rows, offsets) in enumerate(received):
            out = terms[r].sum(dim=1).to(inputs.xs[r].dtype)
            results.append([(rows, offsets, out), (rows.clone(), list(offsets), out.clone())])
        if corrupt == "swap":  # in every run: the order is wrong, not unstable
            for run in results[0]:
                run[0][[0, 1]] = run[0][[1, 0]]
        elif corrupt == "rerun":
            out = results[1][1][2]
            out[0, 0] = torch.nextafter(out[0, 0], torch.tensor(9.0))
        elif corrupt == "combine":
            results[1][0][2][0, 0] += 0.5
        return results

    return run


@pytest.mark.parametrize("corrupt, failing", [
    (None, set()), ("swap", {"rows vs permutation"}), ("rerun", {"run vs run"}),
    ("combine", {"combine vs oracle", "run vs run"})])
def test_dispatch_verdict(corrupt: str | None, failing: set[str]) -> None:
    (case,) = selfcheck.plan_cases(2, routings=("zipf",))[-2:-1]
    assert case.kind == "dispatch"
    rows = selfcheck.run_case_rows(case, _dispatch_runner(corrupt), "emulated", 2)
    assert {r.case.split(": ")[-1] for r in rows if not r.ok} == failing, rows
    if corrupt == "swap":
        assert "rank 0: 2/" in rows[0].detail
