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

A cold run's time is Triton compilation (~5.5 s per EP dispatch/combine specialisation, ~8 s
per megakernel binary on 2xH100): every distinct specialisation of a kernel (constexprs, dtypes,
num_warps; ints equal to 1 or divisible by 16; pointers 16-byte aligned) compiles once per
process. So the tests share few shapes: EP in bf16 at E=64, H=1000, K=8, 320 tokens (and the
production E=256, H=7168), the megakernel at H=1024, I=512, K=4, 256 tokens, its plan variants
grouped into four binaries (overlap, sequential, one queue, classic tile orders) plus the traced
one; token counts are 0 or have cdiv(T, 16) % 4 == 0 (an aligned `tokens_to` slice), except the
decode-sized and unaligned calls the default plan's binary meets on purpose; fp16/fp32 and other
tilings run on emulated ranks (tests/ops, tests/runtime). Layers and buffers are module fixtures.
`_CompileLog` prints every compile's kernel, seconds, test and varying arguments at the end.
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
    """Process group of the torchrun job: namespace(rank, world, local_rank, device, timeout_s: the
    collectives' timeout, for process groups a test makes)."""
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
    yield types.SimpleNamespace(rank=rank, world=world, local_rank=local_rank, device=device, timeout_s=_timeout_s())
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
# Triton compile log: what a cold run spends its time on.


class _CompileLog:
    """Records every Triton compile of this process through Triton's JIT hooks (knobs.runtime
    jit_cache_hook before a compile, jit_post_compile_hook after it): kernel, seconds, the test
    running, and the kernel's specialisation (argument types, constexpr values, divisibility and
    alignment attributes), so the summary can name the arguments whose specialisation differs
    between a kernel's compiles. Never raises into Triton; hooks set by others are chained."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.test = "(session start)"
        self._started: list[float] = []
        self._prev_pre = self._prev_post = None
        self._installed = False

    def install(self) -> None:
        try:
            from triton import knobs
        except ImportError:  # older Triton: no hooks, no log
            return
        self._prev_pre, self._prev_post = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._pre, self._post
        self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            from triton import knobs
            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._prev_pre, self._prev_post
            self._installed = False

    def _pre(self, **kwargs):
        self._started.append(time.perf_counter())
        return self._prev_pre(**kwargs) if self._prev_pre is not None else None  # truthy would skip the compile

    def _post(self, **kwargs):
        t1 = time.perf_counter()
        t0 = self._started.pop() if self._started else t1
        try:
            fn, info = kwargs["fn"], kwargs["compile"]
            names = list(getattr(fn.jit_function, "arg_names", []))

            def name_of(path) -> str:
                i = path[0] if isinstance(path, tuple) and path else path
                return names[i] if isinstance(i, int) and i < len(names) else str(path)

            spec = {n: t for n, t in info["signature"].items() if t != "constexpr"}
            spec.update({name_of(p): f"={v!r}" for p, v in (info.get("constants") or {}).items()})
            for p, attr in ((info.get("configs") or [{}])[0] or {}).items():
                spec[name_of(p)] = f"{spec.get(name_of(p), '')} {attr}"
            spec["num_warps/num_stages"] = f"{info.get('num_warps')}/{info.get('num_stages')}"
            self.records.append({"kernel": fn.name, "s": t1 - t0, "test": self.test, "spec": spec})
        except Exception as err:  # the log must never break a launch
            self.records.append({"kernel": f"? ({type(err).__name__})", "s": t1 - t0, "test": self.test, "spec": {}})
        if self._prev_post is not None:
            self._prev_post(**kwargs)

    def totals(self) -> tuple[int, float]:
        return len(self.records), sum(r["s"] for r in self.records)

    def summary(self, rank, top: int = 15) -> list[str]:
        n, secs = self.totals()
        lines = [f"rank {rank}: {n} Triton compiles, {secs:.1f} s in all"]
        by_test: dict[str, list] = {}
        by_kernel: dict[str, list] = {}
        for r in self.records:
            by_test.setdefault(r["test"], []).append(r)
            by_kernel.setdefault(r["kernel"], []).append(r)
        lines.append(f"  tests that compiled most (compile s, compiles), top {top}:")
        for test, rs in sorted(by_test.items(), key=lambda kv: -sum(r["s"] for r in kv[1]))[:top]:
            lines.append(f"    {sum(r['s'] for r in rs):6.1f} s {len(rs):3d}  {test}")
        lines.append("  kernels (compile s, compiles; arguments whose specialisation differs between compiles):")
        for kernel, rs in sorted(by_kernel.items(), key=lambda kv: -sum(r["s"] for r in kv[1])):
            keys = sorted({k for r in rs for k in r["spec"]})
            varying = [k for k in keys if len({r["spec"].get(k) for r in rs}) > 1]
            lines.append(f"    {sum(r['s'] for r in rs):6.1f} s {len(rs):3d}  {kernel}"
                         + (f"  varying: {', '.join(varying)}" if varying else ""))
        return lines


_COMPILE_LOG = _CompileLog()


@pytest.fixture(scope="session", autouse=True)
def compile_log():
    """Installs the compile log for the session (see `_CompileLog`)."""
    _COMPILE_LOG.install()
    yield _COMPILE_LOG
    _COMPILE_LOG.uninstall()


def pytest_runtest_logstart(nodeid, location):
    _COMPILE_LOG.test = nodeid  # module fixtures set up by a test count towards it


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _COMPILE_LOG.records:
        terminalreporter.section("Triton compiles (a cold run's time)")
        for line in _COMPILE_LOG.summary(os.environ.get("RANK", "?")):
            terminalreporter.write_line(line)


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
    n_compiles, compile_s = _COMPILE_LOG.totals()
    record = {"rank": rank, "exitstatus": int(exitstatus), "collected": session.testscollected,
              "compiles": n_compiles, "compile_s": round(compile_s, 1),
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
