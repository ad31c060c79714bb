"""GPU suite fixtures: one NCCL process group per torchrun rank, collective-safe test verdicts.

Run the suite with ``tests/gpu/run_gpu_suite.sh`` (torchrun, one pytest per GPU). Every rank runs
the same tests in the same order. Three mechanisms keep the ranks together:

* ``dist_env`` (session, autouse) initialises ``torch.distributed`` once from torchrun's
  environment (NCCL, ``device_id`` = LOCAL_RANK) plus a gloo group used only for verdicts. When
  CUDA, torchrun's environment or compiled-kernel mode is missing, every test SKIPS with the
  reason (the runner script turns any skip into a failure).
* ``pytest_runtest_call`` gathers every rank's outcome over the gloo group after each test body,
  so a failure on one rank fails the test on every rank, with the failing ranks' messages. Test
  bodies record problems and assert only after their last collective, so no rank leaves its
  peers waiting in a collective.
* ``pytest_sessionfinish`` writes this rank's counts to ``$DITRON_GPU_RESULTS_DIR/rank<R>.json``
  (when set), which the runner checks: every rank > 0 passed, 0 skipped, 0 failed.
"""
from __future__ import annotations

import json
import os
import sys
import time
import types
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ditron_ep  # noqa: F401  (decides compiled vs interpreted kernels before any triton.jit)
from ditron_ep.runtime import SymmetricHeap, kernels_interpreted

RESULTS_DIR_ENV = "DITRON_GPU_RESULTS_DIR"
COLLECTIVE_TIMEOUT_ENV = "DITRON_GPU_COLLECTIVE_TIMEOUT_S"
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_MSG_CHARS = 3000  # per-rank failure text carried to the other ranks

_STATE = types.SimpleNamespace(verdict_group=None, rank=None, world=None, owns_pg=False)
_COUNTS = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "xfailed": 0, "xpassed": 0}
_DETAILS: dict[str, list[str]] = {"failed": [], "errors": [], "skipped": []}


def _environment_problem() -> str | None:
    """Why this process cannot run the GPU suite, or None."""
    if not torch.cuda.is_available():
        return "CUDA is not available in this process (the GPU suite needs NVIDIA GPUs)"
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing:
        return (f"not launched by torchrun (missing env {', '.join(missing)}); "
                f"run tests/gpu/run_gpu_suite.sh")
    if kernels_interpreted():
        return ("ditron_ep was imported with the Triton interpreter on (TRITON_INTERPRET or "
                "DITRON_BACKEND=emulated set); unset both for the GPU suite")
    local_rank, n_dev = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
    if local_rank >= n_dev:
        return f"LOCAL_RANK={local_rank} but only {n_dev} CUDA device(s) are visible"
    return None


def _timeout_s() -> int:
    return int(os.environ.get(COLLECTIVE_TIMEOUT_ENV, "300"))


@pytest.fixture(scope="session", autouse=True)
def dist_env():
    """Process group of the torchrun job: namespace(rank, world, local_rank, device)."""
    problem = _environment_problem()
    if problem is not None:
        pytest.skip(problem)
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(seconds=_timeout_s()))
        _STATE.owns_pg = True
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != int(os.environ["WORLD_SIZE"]):
        pytest.fail(f"process group has {world} ranks but WORLD_SIZE={os.environ['WORLD_SIZE']}")
    # Verdicts travel over gloo (CPU): they still get through when a rank's CUDA context is broken.
    _STATE.verdict_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=_timeout_s()))
    _STATE.rank, _STATE.world = rank, world
    yield types.SimpleNamespace(rank=rank, world=world, local_rank=local_rank, device=device)
    group, _STATE.verdict_group = _STATE.verdict_group, None
    if _STATE.owns_pg:
        try:
            torch.cuda.synchronize(device)
            dist.barrier()
            dist.destroy_process_group()
        except Exception as err:  # teardown must not mask the test results
            print(f"[rank {rank}] process-group teardown failed: {err!r}", file=sys.stderr)
    del group


@pytest.fixture
def make_heap(dist_env):
    """`make_heap(**kwargs)` -> SymmetricHeap(backend="torch", **kwargs); freed after the test.

    Freeing happens in teardown, after the per-test verdict exchange, when all ranks are in step.
    """
    heaps: list[SymmetricHeap] = []

    def make(**kwargs) -> SymmetricHeap:
        kwargs.setdefault("backend", "torch")
        kwargs.setdefault("size_bytes", 16 << 20)
        heap = SymmetricHeap(**kwargs)
        heaps.append(heap)
        return heap

    yield make
    for heap in reversed(heaps):
        heap.free()


# ---------------------------------------------------------------------------------------------
# Collective verdict: every rank fails a test when any rank fails it.


def _gather_verdicts(mine: tuple[str, str]) -> list[tuple[str, str]]:
    out: list = [None] * _STATE.world
    dist.all_gather_object(out, mine, group=_STATE.verdict_group)
    return out


def _force_exception(outcome, exc: BaseException) -> None:
    if hasattr(outcome, "force_exception"):  # pluggy >= 1.1
        outcome.force_exception(exc)
    else:
        raise exc


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    outcome = yield
    if _STATE.verdict_group is None or "dist_env" not in getattr(item, "fixturenames", ()):
        return
    excinfo = outcome.excinfo
    if excinfo is None:
        mine = ("passed", "")
    elif issubclass(excinfo[0], pytest.skip.Exception):
        mine = ("skipped", str(excinfo[1]))
    else:
        mine = ("failed", f"{excinfo[0].__name__}: {excinfo[1]}"[:_MSG_CHARS])
    t0 = time.time()
    try:
        verdicts = _gather_verdicts(mine)
    except Exception as err:
        _force_exception(outcome, pytest.fail.Exception(
            f"rank {_STATE.rank}: could not exchange the test verdict with the other ranks after "
            f"{time.time() - t0:.0f} s ({err!r}); a peer is probably stuck in a collective or "
            f"crashed. This rank's own outcome: {mine[0]} {mine[1]}", pytrace=False))
        return
    bad = [(r, k, m) for r, (k, m) in enumerate(verdicts) if k != "passed"]
    if not bad:
        return
    kinds = {k for _, k, _ in bad}
    if kinds == {"skipped"} and len(bad) == _STATE.world:
        return  # skipped everywhere alike: keep the skip (the runner counts it as a failure)
    text = "\n".join(f"rank {r} {k}: {m}" for r, k, m in bad)
    if mine[0] == "failed":
        others = [(r, k, m) for r, k, m in bad if r != _STATE.rank]
        if others:
            item.add_report_section("call", "other ranks",
                                    "\n".join(f"rank {r} {k}: {m}" for r, k, m in others))
        return  # keep this rank's own traceback
    _force_exception(outcome, pytest.fail.Exception(
        f"rank {_STATE.rank} {mine[0]}; not every rank passed:\n{text}", pytrace=False))


# ---------------------------------------------------------------------------------------------
# Per-rank result file for the runner script.


def pytest_runtest_logreport(report):
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            _COUNTS["xpassed" if report.passed else "xfailed"] += 1
        elif report.passed:
            _COUNTS["passed"] += 1
        elif report.failed:
            _COUNTS["failed"] += 1
            _DETAILS["failed"].append(report.nodeid)
        elif report.skipped:
            _COUNTS["skipped"] += 1
            _DETAILS["skipped"].append(f"{report.nodeid}: {_skip_reason(report)}")
    elif report.failed:  # setup or teardown
        _COUNTS["errors"] += 1
        _DETAILS["errors"].append(f"{report.nodeid} ({report.when})")
    elif report.skipped and report.when == "setup":
        _COUNTS["skipped"] += 1
        _DETAILS["skipped"].append(f"{report.nodeid}: {_skip_reason(report)}")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)[:300]


def pytest_sessionfinish(session, exitstatus):
    out_dir = os.environ.get(RESULTS_DIR_ENV)
    if not out_dir:
        return
    rank = os.environ.get("RANK", "x")
    record = {"rank": rank, "exitstatus": int(exitstatus), "collected": session.testscollected,
              **_COUNTS, **{f"{k}_ids": v[:20] for k, v in _DETAILS.items()}}
    path = Path(out_dir) / f"rank{rank}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)



# ---------------------------------------------------------------------------------------------
# Collection on machines without CUDA.

_GPU_DIR = Path(__file__).resolve().parent


def _gpu_dir_requested(config) -> bool:
    """Whether a command-line path names tests/gpu or something inside it."""
    base = Path(config.invocation_params.dir)
    for arg in config.args:
        p = (base / str(arg).split("::", 1)[0]).resolve()
        if p == _GPU_DIR or _GPU_DIR in p.parents:
            return True
    return False


def pytest_ignore_collect(collection_path, config):
    # tests/conftest.py ignores this folder when CUDA is absent, so the CPU suite never lists
    # these tests. Asked for by path (`pytest tests/gpu`), they are collected anyway and skip
    # with the reason, instead of "no tests collected".
    p = Path(collection_path).resolve()
    if (p == _GPU_DIR or _GPU_DIR in p.parents) and _gpu_dir_requested(config):
        return False
    return None
