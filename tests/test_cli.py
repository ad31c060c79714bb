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
from ditron_ep.determinism import selfcheck
from ditron_ep.determinism.oracle import ep_moe_oracle
from ditron_ep.determinism.selfcheck import CaseResult, CheckReport, exit_status
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
    assert len(names) == len(set(names)) == len(selfcheck.plan_cases(2, quick=True))
    for case in report["cases"]:
        assert set(case) == CASE_KEYS
        assert case["kind"] in selfcheck.KINDS
        assert case["ok"] is True, case
    kinds = {c["kind"] for c in report["cases"]}
    assert kinds == set(selfcheck.KINDS)
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
    monkeypatch.setattr(cli, "run_emulated_check", lambda world_size, seed, quick: _report(PASSING, FAILING))
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
], ids=["world0", "world-text", "backend", "command", "no-command"])
def test_bad_arguments_exit_2(argv: list[str], message: str, capsys) -> None:
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_torch_backend_without_torchrun_exits_2(monkeypatch, capsys) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert cli.main(["check", "--backend", "torch"]) == 2
    assert "torchrun" in capsys.readouterr().err


def test_world_size_must_match_torchrun(monkeypatch, capsys) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert cli.main(["check", "--world-size", "2"]) == 2
    assert "torchrun launched 3 ranks" in capsys.readouterr().err
