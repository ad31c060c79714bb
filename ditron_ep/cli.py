"""Command line: `python -m ditron_ep {info,check,bench}` (also installed as `ditron-ep`).

* `info`  — versions, execution mode, backends available here, devices and GPU topology.
* `check` — self-check on emulated CPU ranks (default: 4), or, under torchrun, on the launched
  ranks (`torchrun --nproc-per-node 4 -m ditron_ep check --backend torch`): heap, signals and
  the bounded-wait timeout, the sequential reference against the float64 oracle, EP
  dispatch/combine (received rows vs the reference permutation bit for bit, combine vs the
  float64 oracle, run vs run bitwise) and the MoE layer (`moe` overlap vs sequential bitwise,
  run vs run bitwise, vs the float64 oracle; the same three for its gradients) for several
  routings. `--against MODULE:FN` checks the user's own MoE function instead, its gradients too
  with `--backward` (see ditron_ep/check/against.py for the contract).
  Prints a table, optionally writes it as JSON (`--json PATH`), exits 1 if any case failed.
* `bench` — the benchmarks of `ditron_ep.bench`: dispatch, combine and moe by default, and
  dispatch_combine (every stage, eager and CUDA-graph replays, 0-token cost), moe_timeline (the
  fused kernel's overlap report and per-stage timeline per plan variant) and grouped_gemm (the
  grouped SwiGLU FFN vs torch._grouped_mm, optionally a tile sweep) when named (`--bench all`: every
  one). Each times its baselines in the same run and checks its output against theirs, on emulated
  CPU ranks (tiny shapes, not performance figures) or, under torchrun, on the launched GPU ranks
  (`torchrun --nproc-per-node 4 -m ditron_ep bench --backend torch`). An entry's own settings are
  `--opt KEY=VALUE` (listed by `bench --help`). Prints a table per benchmark, optionally writes JSON
  (`--json PATH`, rewritten after every config; schema in ditron_ep/bench/report.py) and a plot
  (`--plot PATH`, needs matplotlib: `pip install 'ditron_ep[plot]'`).

Exit status: 0 success, 1 a check or benchmark failed, 2 bad arguments or a backend that cannot
run here.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

import ditron_ep
from ditron_ep.runtime import DitronConfigError, RankError, kernels_interpreted, mode_source
from ditron_ep.runtime.mode import BACKENDS

if TYPE_CHECKING:
    from ditron_ep.bench.runner import RowsFn
    from ditron_ep.bench.spec import BenchRequest, Row
    from ditron_ep.check.report import CheckReport

DEFAULT_WORLD_SIZE = 4
# bench on emulated ranks: 2 ranks (each a Triton interpreter process) keep the default run of
# every benchmark well under a minute on 2 CPU cores.
DEFAULT_BENCH_WORLD_SIZE = 2
# Per backend: (dtype, timed iterations, warm-up calls) unless given.
BENCH_DEFAULTS = {"emulated": ("fp32", 3, 1), "torch": ("bf16", 20, 5)}
BENCH_TIMEOUT_S = 3600.0  # one emulated run of every request; waits inside kernels are bounded anyway
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


# ============================================================================ arguments
def _gemm_shape(text: str) -> tuple[int, int, int]:
    """ "2048x8192x8192" -> (2048, 8192, 8192): three positive ints."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected MxKxN with three positive ints, e.g. 2048x8192x8192, got {text!r}")
    return tuple(int(p) for p in parts)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ditron_ep",
        description="ditron_ep: expert-parallel MoE megakernels in stock Triton.")
    parser.add_argument("--version", action="version", version=f"ditron_ep {ditron_ep.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{info,check,bench,tune}")
    sub.add_parser("info", help="versions, execution mode, backends, devices and GPU topology",
                   description="Print versions, execution mode, backends, devices and GPU topology.")
    check = sub.add_parser(
        "check", help="self-check: heap, signals, reference vs oracle",
        description="Self-check on emulated CPU ranks, or under torchrun on the launched ranks: "
                    "symmetric heap, signals and bounded waits, reference vs float64 oracle. "
                    "Exits 1 if any case fails.",
        epilog="GPU: torchrun --nproc-per-node 4 -m ditron_ep check --backend torch")
    check.add_argument("--world-size", type=_positive_int, default=None, metavar="N",
                       help=f"ranks (default {DEFAULT_WORLD_SIZE} emulated ranks; under torchrun "
                            f"the launched WORLD_SIZE, which N must then equal)")
    check.add_argument("--backend", choices=BACKENDS, default="emulated",
                       help="emulated (CPU ranks, default), torch (GPU ranks under torchrun), or "
                            "auto (torch under torchrun on GPUs, else emulated)")
    check.add_argument("--seed", type=int, default=0, help="seed of every input (default 0)")
    check.add_argument("--quick", action="store_true", help="fewer cases")
    check.add_argument("--json", type=Path, default=None, metavar="PATH",
                       help="also write the report as JSON to PATH")
    check.add_argument("--routings", type=_routings, default=None, metavar="R[,R...]",
                       help=f"routings of the dispatch / moe / --against cases, from "
                            f"{','.join(_routing_names())} (default {','.join(_case_routings())}; "
                            f"with --quick: uniform)")
    check.add_argument("--dtypes", type=_dtypes, default=None, metavar="D[,D...]",
                       help="dtypes of the dispatch / moe / --against cases, from fp32,bf16,fp16 "
                            "(default fp32 on emulated ranks, bf16 on GPUs; the MoE math runs on "
                            "emulated ranks in fp32 only, the Triton interpreter's bf16 math is wrong)")
    check.add_argument("--repeats", type=_repeats, default=2, metavar="N",
                       help="runs compared bit for bit (run vs run), at least 2 (default 2)")
    check.add_argument("--shape", type=_shape, default=None, metavar="T,H,I,E,K",
                       help="tokens (rank 0; rank r has T-3r), hidden, FFN width, experts, top-k "
                            "of the dispatch / moe / --against cases (default 16,32,16,8,2)")
    check.add_argument("--backward", action="store_true", default=None,
                       help="also check the gradients of the MoE cases (on by default without --against)")
    check.add_argument("--against", default=None, metavar="MODULE:FN",
                       help="check your own MoE forward instead of the built-in cases: "
                            "FN(x, topk_idx, topk_weights, w1, w2, *, group=None, "
                            "schedule='overlap') with the contract of ditron_ep.ops.moe; its "
                            "overlap output must equal its sequential output and every rerun bit "
                            "for bit, and match the float64 oracle. MODULE must be importable "
                            "from sys.path on every rank")
    _add_bench_parser(sub)
    return parser


def _add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from ditron_ep.bench.registry import BENCHMARKS
    from ditron_ep.check import ROUTING_KINDS

    names = list(BENCHMARKS)
    defaults = [n for n, b in BENCHMARKS.items() if b.default]
    options = "\n".join(f"  {o.key} ({', '.join(n for n, b in BENCHMARKS.items() if o in b.options)}): {o.help}"
                        for o in dict.fromkeys(o for b in BENCHMARKS.values() for o in b.options))
    tune = sub.add_parser(
        "tune", help="search the expert GEMMs' tiles and paths on this GPU, into the tuner cache",
        description="Search the (path, tile) of each of the expert MLP's six GEMMs (forward, act_grad, dgrad, "
                    "wgrad) at a layer's per-rank shape on this process's GPU, and record the fastest in the tuner "
                    "cache ($DITRON_TUNE_CACHE, default ~/.cache/ditron_ep/tuned_gemms.json; --cache). "
                    "grouped_mlp(path='auto'), the staged schedule and every backward then use them on machines "
                    "that read the same file (docs/gemm.md). One entry per token count: rows = T * topk. "
                    "--tp-gemm: the TP ops' dense GEMM tiles instead; --ep (under torchrun): the EP copy "
                    "kernels' tiling at an SM budget.")
    tune.add_argument("--tokens", type=_positive_int, nargs="+", default=[4096], metavar="T",
                      help="tokens per rank, one entry each (default 4096)")
    tune.add_argument("--hidden", type=_positive_int, default=7168, metavar="H")
    tune.add_argument("--inter", type=_positive_int, default=2048, metavar="I", help="expert FFN width")
    tune.add_argument("--experts", type=_positive_int, default=64, metavar="E", help="experts in all")
    tune.add_argument("--topk", type=_positive_int, default=8, metavar="K")
    tune.add_argument("--world-size", type=_positive_int, default=2, metavar="W",
                      help="ranks of the job the entry is for (E/W local experts; part of the cache key)")
    tune.add_argument("--activation", default="swiglu")
    tune.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    tune.add_argument("--tp-gemm", nargs="+", default=None, metavar="MxKxN", type=_gemm_shape,
                      help="instead: the tensor-parallel ops' dense GEMM [M, K] @ [K, N] at each shape (M: the rows "
                           "of the product, W*M per rank for AllGather+GEMM and GEMM+ReduceScatter); only tiles whose "
                           "output is bitwise the shape rule's are kept")
    tune.add_argument("--ep", action="store_true",
                      help="instead: the EP dispatch/combine copy tiling (rows per chunk, columns per step, warps) "
                           "of an EPBuffer of --tokens, --hidden, --experts, --topk at --num-programs, on every rank "
                           "of a torchrun job together (its world size is the key's)")
    tune.add_argument("--num-programs", type=_positive_int, default=None, metavar="P",
                      help="--ep: the SM budget of the copy kernels (default: every SM)")
    tune.add_argument("--reps", type=_positive_int, default=10, help="timed calls per candidate (median)")
    tune.add_argument("--cache", type=Path, default=None, metavar="PATH", help="the cache file to write")
    bench = sub.add_parser(
        "bench", help="benchmarks against baselines measured in the same run",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Time ditron_ep's EP dispatch / combine, MoE layer, fused kernel timeline and grouped GEMM "
                    "against their baselines, measured\nin the same run (median, p20, p80 of the slowest rank per "
                    "iteration; GB/s or TFLOP/s; speedup), after checking every output against\nthe baseline's. On "
                    "emulated CPU ranks (default; tiny shapes, not performance figures) or, under torchrun, on the "
                    "launched GPU\nranks (default shapes: dispatch/combine H=7168 E=256 top-8, the layer H=7168 I=2048 "
                    "E=64 top-8, T in 128 4096). Exits 1 if a\nbenchmark or a check failed.",
        epilog=f"options (--opt KEY=VALUE; the benchmarks that take it):\n{options}\n\n"
               "GPU: torchrun --nproc-per-node 4 -m ditron_ep bench --backend torch --bench all --json out.json")
    bench.add_argument("--bench", nargs="+", choices=[*names, "all"], default=None, metavar="NAME",
                       help=f"benchmarks to run, from {' '.join(names)}, or all (default: {' '.join(defaults)})")
    bench.add_argument("--tokens", nargs="+", type=_positive_int, default=None, metavar="T",
                       help="tokens per rank, one config each (default: each benchmark's, per backend)")
    for flag, metavar, what in (("--hidden", "H", "hidden size"),
                                ("--experts", "E", "experts in all, a multiple of the ranks"),
                                ("--topk", "K", "experts per token"),
                                ("--inter", "I", "expert FFN width (moe, moe_timeline, grouped_gemm)")):
        bench.add_argument(flag, type=_positive_int, default=None, metavar=metavar,
                           help=f"{what} (default: each benchmark's, per backend)")
    bench.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                       help="token and weight dtype (default fp32 on emulated ranks, bf16 on GPUs; the layer "
                            "benchmarks run on emulated ranks in fp32 only, the Triton interpreter's bf16 math is "
                            "wrong)")
    bench.add_argument("--routing", choices=ROUTING_KINDS, default="uniform",
                       help="how tokens choose their experts (default uniform; the layer benchmarks take uniform "
                            "or zipf)")
    bench.add_argument("--iters", type=_positive_int, default=None, metavar="N",
                       help="timed iterations (default 3 on emulated ranks, 20 on GPUs)")
    bench.add_argument("--warmup", type=_non_negative_int, default=None, metavar="N",
                       help="untimed calls before timing (default 1 on emulated ranks, 5 on GPUs)")
    bench.add_argument("--opt", type=_option, action="append", default=None, metavar="KEY=VALUE",
                       help="a setting of the benchmarks that declare KEY (repeatable; listed below)")
    bench.add_argument("--time-budget", type=_positive_float, default=None, metavar="SECONDS",
                       help="configs not started within this many seconds are recorded as not run")
    bench.add_argument("--seed", type=int, default=0, help="seed of every input (default 0)")
    bench.add_argument("--world-size", type=_positive_int, default=None, metavar="N",
                       help=f"ranks (default {DEFAULT_BENCH_WORLD_SIZE} emulated ranks; under torchrun the "
                            f"launched WORLD_SIZE, which N must then equal)")
    bench.add_argument("--backend", choices=BACKENDS, default="emulated",
                       help="emulated (CPU ranks, default), torch (GPU ranks under torchrun), or auto")
    bench.add_argument("--json", type=Path, default=None, metavar="PATH",
                       help="also write the results as JSON, rewritten after every config (schema: "
                            "ditron_ep/bench/report.py)")
    bench.add_argument("--plot", type=Path, default=None, metavar="PATH",
                       help="also plot time against tokens per rank to PATH (PNG; needs matplotlib: "
                            "pip install 'ditron_ep[plot]')")


def _option(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return value


def _routing_names() -> list[str]:
    from ditron_ep.check.selfcheck import REFERENCE_ROUTINGS

    return sorted(REFERENCE_ROUTINGS)


def _case_routings() -> tuple[str, ...]:
    from ditron_ep.check.selfcheck import CASE_ROUTINGS

    return CASE_ROUTINGS


def _comma_list(text: str, allowed: Sequence[str], what: str) -> tuple[str, ...]:
    items = tuple(p.strip() for p in text.split(",") if p.strip())
    if not items:
        raise argparse.ArgumentTypeError(f"no {what} given")
    bad = [p for p in items if p not in allowed]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad)}; choose from {', '.join(allowed)}")
    return tuple(dict.fromkeys(items))


def _routings(text: str) -> tuple[str, ...]:
    return _comma_list(text, _routing_names(), "routing")


def _dtypes(text: str) -> tuple[str, ...]:
    return _comma_list(text, ("fp32", "bf16", "fp16"), "dtype")


def _repeats(text: str) -> int:
    value = _positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"run vs run needs at least 2 runs, got {value}")
    return value


def _shape(text: str) -> tuple[int, int, int, int, int]:
    parts = text.split(",")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 5 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be five positive integers T,H,I,E,K, got {text!r}")
    T, H, I, E, K = values
    if K > E:
        raise argparse.ArgumentTypeError(f"top-k K={K} exceeds the number of experts E={E}")
    return values  # type: ignore[return-value]


def _plan_options(args: argparse.Namespace, world_size: int, backend: str) -> dict:
    """plan_cases keyword arguments from the command line; DitronConfigError if they cannot run."""
    from ditron_ep.check.against import load_moe_fn
    from ditron_ep.check.selfcheck import DEFAULT_SHAPE, default_dtypes, moe_dtypes

    shape = args.shape or DEFAULT_SHAPE
    if shape[3] % world_size:
        raise DitronConfigError(f"--shape: E={shape[3]} experts is not a multiple of the world size "
                                f"{world_size}")
    dtypes = args.dtypes or default_dtypes(backend)
    if args.against is not None:
        load_moe_fn(args.against)  # a bad MODULE:FN is a usage error, before any rank starts
        if not moe_dtypes(backend, dtypes):
            raise DitronConfigError(f"--against on {backend} ranks runs in fp32 only (the Triton "
                                    f"interpreter's bf16 math is wrong); add fp32 to --dtypes")
    return dict(routings=args.routings, dtypes=dtypes, repeats=args.repeats, shape=shape,
                against=args.against, backend=backend, backward=args.backward)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m ditron_ep` and `ditron-ep`; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: usage error (2), --help / --version (0)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        if args.command == "info":
            return cmd_info(_console())
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "tune":
            return cmd_tune(args)
        return cmd_check(args)
    except DitronConfigError as exc:
        _console(stderr=True).print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        return EXIT_USAGE


def _console(**kwargs) -> Console:
    """A rich console that leaves ":name:" text alone (emoji codes would rewrite user text in
    messages: a module named `fire` in `m:fire`)."""
    return Console(emoji=False, **kwargs)


def _check_output_paths(*paths: Path | None) -> None:
    """DitronConfigError, before anything runs, for an output path that cannot be written (a
    run of minutes must not end in a traceback)."""
    for path in paths:
        if path is None:
            continue
        if path.is_dir():
            raise DitronConfigError(f"output path {path} is a directory; give a file name")
        if path.exists():  # a file (or /dev/stdout, a pipe): writing it needs only its own permission
            if not os.access(path, os.W_OK):
                raise DitronConfigError(f"output path {path} is not writable; pick another path")
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DitronConfigError(f"cannot create the folder of output path {path}: {exc.strerror or exc}") from None
        if not os.access(path.parent, os.W_OK):
            raise DitronConfigError(f"cannot create output file {path}: its folder is not writable; pick another path")


# ============================================================================ info
def _version_of(module: str, *distributions: str) -> str:
    """Installed version of `module` (by its distribution metadata, else `__version__`), without
    importing heavy packages; "not installed" when it cannot be found."""
    try:
        if importlib.util.find_spec(module) is None:
            return "not installed"
    except (ImportError, ValueError):
        return "not installed"
    for dist in distributions or (module,):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        return str(getattr(importlib.import_module(module), "__version__", "installed"))
    except Exception:  # noqa: BLE001 - a broken optional package is still "not importable"
        return "installed, not importable"


def _versions() -> dict[str, str]:
    import numpy
    import torch
    kernels_interpreted()  # fix the kernel mode before triton is imported (ditron_ep.runtime.mode)
    import triton

    if torch.version.cuda:
        torch_build = f"CUDA {torch.version.cuda}"
    elif getattr(torch.version, "hip", None):
        torch_build = f"ROCm {torch.version.hip}"
    else:
        torch_build = "CPU build"
    return {
        "ditron_ep": ditron_ep.__version__,
        "python": platform.python_version(),
        "torch": f"{torch.__version__} ({torch_build})",
        "triton": triton.__version__,
        "numpy": numpy.__version__,
        "rich": importlib.metadata.version("rich"),
        "nvshmem4py": _version_of("nvshmem", "nvshmem4py-cu13", "nvshmem4py-cu12", "nvshmem4py"),
        "deepspeed": _version_of("deepspeed"),
    }


def interpreter_numpy_problem() -> str | None:
    """Why this NumPy breaks the Triton 3.6 interpreter (emulated ranks), or None."""
    import numpy

    major, minor = (int(p) for p in numpy.__version__.split(".")[:2])
    if (major, minor) < (2, 4):
        return None
    return (f"numpy {numpy.__version__} breaks the Triton interpreter that emulated ranks run "
            f"kernels in (it calls int() on size-1 arrays); pip install 'numpy<2.4'")


def _backends() -> dict[str, tuple[bool, str]]:
    """backend -> (available here, why)."""
    import torch

    shm = os.path.isdir("/dev/shm")
    emulated = (shm, "CPU ranks over /dev/shm, Triton interpreter" if shm else "/dev/shm is missing")
    if shm and interpreter_numpy_problem():
        emulated = (False, interpreter_numpy_problem())
    try:
        import torch.distributed._symmetric_memory  # noqa: F401

        symm = True
    except ImportError:
        symm = False
    if not torch.cuda.is_available():
        torch_backend = (False, "no CUDA/ROCm device visible")
    elif not symm:
        torch_backend = (False, "torch.distributed._symmetric_memory not importable")
    else:
        torch_backend = (True, "torch symmetric memory on GPU (run under torchrun)")
    return {"emulated": emulated, "torch": torch_backend}


def _devices() -> list[tuple[str, str, str]]:
    """(index, name, memory) of every visible GPU; empty on a CPU-only machine."""
    import torch

    if not torch.cuda.is_available():
        return []
    rows = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        rows.append((str(i), props.name, f"{props.total_memory / 2**30:.1f} GiB"))
    return rows


def _topology() -> str | list[list[bool]] | None:
    """`nvidia-smi topo -m` output, else the peer-access matrix; None without GPUs."""
    import torch

    if not torch.cuda.is_available():
        return None
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            done = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=20)
            if done.returncode == 0 and done.stdout.strip():
                return done.stdout.rstrip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    n = torch.cuda.device_count()
    return [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)] for i in range(n)]


def cmd_info(console: Console) -> int:
    versions = Table(title="Versions", title_justify="left")
    versions.add_column("package")
    versions.add_column("version")
    for name, version in _versions().items():
        versions.add_row(name, version, style="dim" if version == "not installed" else None)
    console.print(versions)

    runtime = Table(title="Runtime", title_justify="left")
    runtime.add_column("item")
    runtime.add_column("value")
    interpreted = kernels_interpreted()
    runtime.add_row("kernels", f"{'interpreted (Triton interpreter)' if interpreted else 'compiled for the GPU'}, "
                               f"chosen because {mode_source()}")
    for name, (available, why) in _backends().items():
        runtime.add_row(f"backend {name}", f"[green]available[/] — {why}" if available
                        else f"[yellow]unavailable[/] — {why}")
    console.print(runtime)

    devices = Table(title="Devices", title_justify="left")
    for column in ("index", "name", "memory"):
        devices.add_column(column)
    rows = _devices()
    for row in rows:
        devices.add_row(*row)
    if not rows:
        devices.add_row("-", f"CPU only ({os.cpu_count()} cores)", "-")
    console.print(devices)

    topology = _topology()
    if isinstance(topology, str):
        console.print("[bold]GPU topology[/] (nvidia-smi topo -m)")
        console.print(Text.from_ansi(topology), highlight=False)
    elif topology is not None:
        peers = Table(title="GPU peer access (torch.cuda.can_device_access_peer)", title_justify="left")
        peers.add_column("")
        for j in range(len(topology)):
            peers.add_column(f"GPU{j}")
        for i, row in enumerate(topology):
            peers.add_row(f"GPU{i}", *("self" if i == j else "yes" if ok else "no" for j, ok in enumerate(row)))
        console.print(peers)
    return EXIT_OK


# ============================================================================ check
def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _emulated_world_size(args: argparse.Namespace, default: int) -> int:
    """Ranks to emulate for `args.command` outside torchrun; DitronConfigError if it cannot run here."""
    if args.backend == "torch":
        raise DitronConfigError(
            "backend 'torch' runs on GPU ranks that are already launched; start them with "
            f"torchrun --nproc-per-node N -m ditron_ep {args.command} --backend torch")
    if not os.path.isdir("/dev/shm"):
        raise DitronConfigError("the emulated backend needs POSIX shared memory (/dev/shm), "
                                "which this machine lacks")
    problem = interpreter_numpy_problem()
    if problem:  # the run goes on (its failures show where), but say why first
        _console(stderr=True).print(f"[bold yellow]warning:[/] {problem}", highlight=False)
    return args.world_size or default


def _launched_ranks(args: argparse.Namespace) -> tuple[int, int, str]:
    """Under torchrun: (world size, rank, backend); DitronConfigError if the arguments disagree."""
    from ditron_ep.runtime import resolve_backend

    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if args.world_size is not None and args.world_size != world_size:
        raise DitronConfigError(f"--world-size {args.world_size} but torchrun launched {world_size} "
                                f"ranks; drop --world-size or launch {args.world_size} ranks")
    return world_size, rank, resolve_backend(args.backend)


@contextmanager
def _process_group(backend: str) -> Iterator[None]:
    """The default process group of the launched ranks (NCCL on GPUs, gloo on emulated ranks),
    initialised here unless it already is, and then destroyed here too."""
    import torch
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        if backend == "torch":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


def cmd_check(args: argparse.Namespace) -> int:
    _check_output_paths(args.json)
    if _under_torchrun():
        return _check_launched_ranks(args)
    world_size = _emulated_world_size(args, DEFAULT_WORLD_SIZE)
    options = _plan_options(args, world_size, "emulated")
    report = run_emulated_check(world_size, seed=args.seed, quick=args.quick, **options)
    if report is None:
        return EXIT_FAILED
    return emit_report(report, _console(width=_table_width()), args.json)


def run_emulated_check(world_size: int, *, seed: int, quick: bool, **options) -> "CheckReport | None":
    """Start one pool of emulated ranks, run every case on it, with a progress bar on stderr.

    `options`: plan_cases keyword arguments (routings, dtypes, repeats, shape, against).
    Returns None (after printing why) if the ranks could not start.
    """
    from ditron_ep.check.selfcheck import count_rows, plan_cases, run_check
    from ditron_ep.runtime import EmulatedCluster

    cases = plan_cases(world_size, quick=quick, **options)
    cluster = EmulatedCluster(world_size, timeout_s=300)
    try:
        with _case_progress(count_rows(cases), f"starting {world_size} emulated ranks") as hooks:
            try:
                cluster.start()
            except RankError as exc:
                _console(stderr=True).print(f"[bold red]error:[/] emulated ranks failed to start: {exc}",
                                           highlight=False)
                return None
            return run_check(cluster.run, "emulated", world_size, cases, seed=seed, **hooks)
    finally:
        cluster.shutdown()


def _check_launched_ranks(args: argparse.Namespace) -> int:
    """Under torchrun: every process is one rank; all run the cases, rank 0 reports."""
    from ditron_ep.check.report import exit_status
    from ditron_ep.check.selfcheck import count_rows, local_runner, plan_cases, run_check

    world_size, rank, backend = _launched_ranks(args)
    options = _plan_options(args, world_size, backend)
    with _process_group(backend):
        cases = plan_cases(world_size, quick=args.quick, **options)
        if rank == 0:
            with _case_progress(count_rows(cases), "") as hooks:
                report = run_check(local_runner, backend, world_size, cases, seed=args.seed, **hooks)
            return emit_report(report, _console(width=_table_width()), args.json)
        # Every rank evaluates the same gathered results, so every rank exits alike.
        return exit_status(run_check(local_runner, backend, world_size, cases, seed=args.seed))


@contextmanager
def _progress_bar(total: int, first: str, width: int) -> Iterator[Callable[[str | None, int], None]]:
    """A transient progress bar on stderr over `total` steps, showing `first` until the first
    update; yields update(description or None to keep it, steps done since the last update)."""
    bar = Progress(TextColumn(f"{{task.description:<{width}}}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=_console(stderr=True), transient=True)
    task = bar.add_task(first, total=total)

    def update(description: str | None, done: int) -> None:
        if description is None:
            bar.advance(task, done)
        else:
            bar.update(task, description=description, advance=done)

    with bar:
        yield update


@contextmanager
def _case_progress(total: int, first: str) -> Iterator[dict[str, Callable[..., None]]]:
    """A progress bar over `total` check cases; yields run_check's `on_case_start` /
    `on_case_done` hooks."""
    with _progress_bar(total, first, 36) as update:
        yield {"on_case_start": lambda case: update(case.name, 0),
               "on_case_done": lambda result: update(None, 1)}


def _table_width() -> int | None:
    # Piped output (CI logs, tests) would otherwise wrap at 80 columns; the tables are laid out for
    # 160 (COLUMNS, when set, decides).
    return None if (sys.stdout.isatty() or os.environ.get("COLUMNS")) else 160


# ============================================================================ report (pure)
def format_error(value: float | None) -> str:
    if value is None:
        return "—"
    if value == 0:
        return "0"
    return f"{value:.2e}"


def build_table(report: "CheckReport") -> Table:
    """The report as a rich table: one row per case, then a verdict caption."""
    table = Table(title=f"ditron_ep check — backend {report.backend}, {report.world_size} ranks, "
                        f"seed {report.seed}", title_justify="left",
                  caption=_verdict_line(report), caption_justify="left")
    table.add_column("case", no_wrap=True)
    table.add_column("max abs err", justify="right")
    table.add_column("max rel err", justify="right")
    table.add_column("bitwise", justify="center")
    table.add_column("verdict", justify="center")
    table.add_column("detail", overflow="fold")
    for case in report.cases:
        bitwise = "—" if case.bitwise is None else "yes" if case.bitwise else "[red]NO[/]"
        verdict = "[green]PASS[/]" if case.ok else "[bold red]FAIL[/]"
        table.add_row(case.case, format_error(case.max_abs), format_error(case.max_rel), bitwise,
                      verdict, case.detail)
    return table


def _verdict_line(report: "CheckReport") -> str:
    passed = sum(c.ok for c in report.cases)
    status = "[bold green]OK[/]" if report.ok else "[bold red]FAILED[/]"
    return (f"{status}: {passed}/{len(report.cases)} cases passed in {report.wall_s:.1f} s. "
            f"rel err = max |err| / max |expected|; bitwise = received == sent (signal), "
            f"run == run (reference, run vs run), received == reference permutation (dispatch), "
            f"overlap == sequential (moe, against).")


def emit_report(report: "CheckReport", console: Console, json_path: Path | None) -> int:
    """Print the table, write the JSON report if asked, return the exit status."""
    from ditron_ep.check.report import exit_status

    console.print(build_table(report))
    for case in report.failures:
        console.print(f"[bold red]FAIL[/] {escape(case.case)}: {escape(case.detail)}", highlight=False)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return exit_status(report)


# ============================================================================ bench
def cmd_bench(args: argparse.Namespace) -> int:
    from ditron_ep.bench.environment import device_info
    from ditron_ep.bench.report import PartialJson, make_meta, require_matplotlib

    if args.plot is not None:
        require_matplotlib()  # a missing optional extra is a usage error, before anything runs
    _check_output_paths(args.json, args.plot)
    if _under_torchrun():
        return _bench_launched_ranks(args)
    world_size = _emulated_world_size(args, DEFAULT_BENCH_WORLD_SIZE)
    requests = bench_requests(args, world_size, "emulated")
    device = device_info("cpu")
    partial = None if args.json is None else PartialJson(args.json, requests, "emulated", "gloo", world_size, device)
    start = time.perf_counter()
    rows = run_emulated_bench(world_size, requests, partial, args.time_budget)
    if rows is None:
        return EXIT_FAILED
    meta = make_meta("emulated", "gloo", world_size, device, time.perf_counter() - start)
    return emit_bench(meta, requests, rows, args, _console(width=_table_width()))


def bench_requests(args: argparse.Namespace, world_size: int, backend: str) -> list["BenchRequest"]:
    """One request per selected benchmark from the command line and the backend's defaults; each
    gets the --opt settings it declares. DitronConfigError for one that cannot run, or for a
    setting no selected benchmark declares."""
    from ditron_ep.bench.registry import BENCHMARKS
    from ditron_ep.bench.spec import BenchRequest, Shape

    dtype, iters, warmup = BENCH_DEFAULTS[backend]
    dtype = args.dtype or dtype
    iters = args.iters or iters
    warmup = warmup if args.warmup is None else args.warmup
    if args.bench is None:
        names = [n for n, b in BENCHMARKS.items() if b.default]
    else:
        names = list(BENCHMARKS) if "all" in args.bench else list(dict.fromkeys(args.bench))
    given = args.opt or []
    declared = {n: {o.key for o in BENCHMARKS[n].options} for n in names}
    unknown = [k for k in dict.fromkeys(k for k, _ in given) if not any(k in d for d in declared.values())]
    if unknown:
        have = "; ".join(f"{n}: {', '.join(sorted(d)) or 'none'}" for n, d in declared.items())
        raise DitronConfigError(f"--opt {', '.join(unknown)}: no benchmark of this run has "
                                f"{'it' if len(unknown) == 1 else 'them'} (options: {have})")
    requests = []
    for name in names:
        bench = BENCHMARKS[name]
        d = bench.shapes[backend]
        shape = Shape(hidden=args.hidden or d.hidden, experts=args.experts or d.experts, topk=args.topk or d.topk,
                      inter=None if d.inter is None else (args.inter or d.inter))
        tokens = tuple(sorted(set(args.tokens))) if args.tokens else bench.tokens[backend]
        options = tuple((k, v) for k, v in given if k in declared[name])
        req = BenchRequest(name, shape, tokens, dtype, iters, warmup, args.seed, args.routing, options)
        bench.check_request(req, world_size, backend)
        requests.append(req)
    return requests


def run_emulated_bench(world_size: int, requests: Sequence["BenchRequest"], on_config: "RowsFn | None" = None,
                       time_budget_s: float | None = None) -> "list[Row] | None":
    """Run `requests` on one pool of emulated ranks, with a progress bar on stderr fed by rank 0
    (which also calls `on_config` after every config). Returns rank 0's rows, or None (after
    printing why) if the ranks failed."""
    from ditron_ep.bench.progress import FileSink, follow
    from ditron_ep.bench.runner import iterations, run_requests
    from ditron_ep.runtime import EmulatedCluster

    cluster = EmulatedCluster(world_size, timeout_s=BENCH_TIMEOUT_S)
    with tempfile.TemporaryDirectory(prefix="ditron_bench_") as tmp, \
            _progress_bar(iterations(requests, False), f"starting {world_size} emulated ranks", 52) as update:
        events = Path(tmp) / "progress.jsonl"
        try:
            cluster.start()
            with follow(events, update):
                return cluster.run(run_requests, requests, "emulated", FileSink(events), on_config, time_budget_s)[0]
        except RankError as exc:
            _console(stderr=True).print(f"[bold red]error:[/] the benchmark ranks failed: {escape(str(exc))}",
                                       highlight=False)
            return None
        finally:
            cluster.shutdown()


def _bench_launched_ranks(args: argparse.Namespace) -> int:
    """Under torchrun: every process is one rank; all run the benchmarks, rank 0 reports."""
    import torch
    import torch.distributed as dist

    from ditron_ep.bench.environment import device_info
    from ditron_ep.bench.report import PartialJson, exit_status, make_meta
    from ditron_ep.bench.runner import iterations, run_requests

    world_size, rank, backend = _launched_ranks(args)
    requests = bench_requests(args, world_size, backend)
    with _process_group(backend):
        start = time.perf_counter()
        if rank != 0:  # the rows agree on every rank, so every rank exits alike
            return exit_status(run_requests(requests, backend, time_budget_s=args.time_budget))
        device = device_info(torch.device("cuda", torch.cuda.current_device()) if backend == "torch" else "cpu")
        collectives = dist.get_backend()
        partial = None if args.json is None else PartialJson(args.json, requests, backend, collectives, world_size,
                                                             device)
        with _progress_bar(iterations(requests, backend == "torch"), "", 52) as update:
            rows = run_requests(requests, backend, update, partial, args.time_budget)
        meta = make_meta(backend, collectives, world_size, device, time.perf_counter() - start)
        return emit_bench(meta, requests, rows, args, _console(width=_table_width()))


def emit_bench(meta: dict, requests: Sequence["BenchRequest"], rows: Sequence["Row"], args: argparse.Namespace,
               console: Console) -> int:
    """Print the tables, write the JSON and the plot if asked; return the exit status."""
    from ditron_ep.bench.report import build_document, exit_status, plot, print_report, write_json

    doc = build_document(meta, requests, rows)
    print_report(doc, console)
    if args.json is not None:
        write_json(doc, args.json)
        console.print(f"wrote {args.json}", markup=False, highlight=False)
    if args.plot is not None:
        plot(doc, args.plot)
        console.print(f"wrote {args.plot}", markup=False, highlight=False)
    return exit_status(rows)


def _tune_ep(args: argparse.Namespace, dtype, cache, console) -> int:
    """`tune --ep`: tuner.tune_ep_copy at each --tokens on the ranks torchrun launched (NCCL)."""
    import torch.distributed as dist

    from ditron_ep.compiler import tuner

    if not _under_torchrun():
        raise DitronConfigError("tune --ep times dispatch and combine across the job's ranks: launch it with "
                                "torchrun --nproc-per-node <GPUs> -m ditron_ep tune --ep ...")
    with _process_group("torch"):
        rank = dist.get_rank()
        say = (lambda line: console.print(f"  {escape(line)}", highlight=False)) if rank == 0 else None
        for t in args.tokens:
            chosen = tuner.tune_ep_copy(None, args.experts, args.hidden, t, args.topk, dtype,
                                        num_programs=args.num_programs, reps=args.reps, cache=cache, log=say)
            if rank == 0:
                console.print(f"EP copy T={t} (W={dist.get_world_size()}, programs "
                              f"{args.num_programs or 'all'}): {chosen}", highlight=False)
    if rank == 0:
        console.print(f"wrote {(cache or tuner.TuneCache()).path} (on every rank)", highlight=False)
    return EXIT_OK


def cmd_tune(args: argparse.Namespace) -> int:
    """`tune`: tuner.tune_grouped_mlp at each token count (or tune_tp_gemm at each --tp-gemm shape) on this
    process's GPU; --ep: tuner.tune_ep_copy on the torchrun job's ranks."""
    import torch

    if not torch.cuda.is_available():
        raise DitronConfigError("tune times kernels on a CUDA GPU and none is visible here; run it on the GPU "
                                "machine the model will train or serve on")
    if args.experts % args.world_size:
        raise DitronConfigError(f"--experts {args.experts} is not a multiple of --world-size {args.world_size}")
    from ditron_ep.compiler import tuner
    from ditron_ep.ops.moe_layer.experts import check_activation, width_factor

    check_activation(args.activation)
    console = _console()
    cache = tuner.TuneCache(args.cache) if args.cache is not None else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if args.ep:
        return _tune_ep(args, dtype, cache, console)
    if args.tp_gemm:
        for m, k, n in args.tp_gemm:
            chosen = tuner.tune_tp_gemm(m, k, n, dtype, reps=args.reps, cache=cache,
                                        log=lambda line: console.print(f"  {escape(line)}", highlight=False))
            console.print(f"TP GEMM {m}x{k}x{n}: {chosen}", highlight=False)
        console.print(f"wrote {(cache or tuner.TuneCache()).path}", highlight=False)
        return EXIT_OK
    dev = torch.device("cuda", torch.cuda.current_device())
    e_local = args.experts // args.world_size
    width = width_factor(args.activation) * args.inter
    gen = torch.Generator(device=dev).manual_seed(0)
    w1 = (torch.randn(e_local, args.hidden, width, generator=gen, device=dev) / args.hidden ** 0.5).to(dtype)
    w2 = (torch.randn(e_local, args.inter, args.hidden, generator=gen, device=dev) / args.inter ** 0.5).to(dtype)
    for t in args.tokens:
        rows = t * args.topk  # the rows a rank receives on average: T * K over its E/W experts
        sizes = [rows // e_local + (e < rows % e_local) for e in range(e_local)]
        offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        x = torch.randn(rows, args.hidden, generator=gen, device=dev).to(dtype)
        chosen = tuner.tune_grouped_mlp(x, offsets, w1, w2, activation=args.activation, reps=args.reps, cache=cache,
                                        world_size=args.world_size,
                                        log=lambda line: console.print(f"  {escape(line)}", highlight=False))
        console.print(f"T={t} (rows {rows}, {e_local} local experts): "
                      + ", ".join(f"{k}={tuner.choice_text(v)}" for k, v in chosen.items()), highlight=False)
    console.print(f"wrote {(cache or tuner.TuneCache()).path}", highlight=False)
    return EXIT_OK
