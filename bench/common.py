"""Helpers every ditron_ep benchmark shares: timing, summaries, environment, table, JSON.

Timing rule (STYLE.md): before every iteration all ranks meet (`dist.barrier`) and drain their
device (`torch.cuda.synchronize`); the iteration is timed with CUDA events on the GPU, or with
`time.perf_counter` on the CPU (emulated ranks: interpreter timings, not performance). The figure
of an iteration is the slowest rank's (all_reduce MAX); benchmarks report the median and the
20th / 80th percentiles of those figures.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"


# ============================================================================ timing
def time_fn(fn: Callable[[], object], iters: int, warmup: int, group: dist.ProcessGroup | None = None,
            device: torch.device | str | None = None) -> list[float]:
    """Time `fn` `iters` times after `warmup` untimed calls; return the slowest rank's µs per iteration.

    Every rank of `group` must call this with the same `iters` and `warmup` (it is collective:
    one barrier per call of `fn` and one all_reduce at the end). Without torch.distributed
    initialised it times this process alone. On a CUDA `device` each call is bracketed by CUDA
    events on the current stream; otherwise by `time.perf_counter` (fn must be synchronous).
    If `fn` raises on some rank, that rank stops calling it but keeps joining the barriers and
    the all_reduce, then re-raises: the ranks' collectives stay matched.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    on_cuda = device.type == "cuda"
    distributed = dist.is_available() and dist.is_initialized()
    if on_cuda:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    local: list[float] = []
    error: BaseException | None = None
    for i in range(warmup + iters):
        if distributed:
            dist.barrier(group=group)
        if error is not None:
            continue
        try:
            if on_cuda:
                torch.cuda.synchronize(device)
            j = i - warmup
            if j < 0:
                fn()
            elif on_cuda:
                starts[j].record()
                fn()
                ends[j].record()
            else:
                t0 = time.perf_counter()
                fn()
                local.append((time.perf_counter() - t0) * 1e6)
        except Exception as exc:  # noqa: BLE001 - re-raised after the collectives below
            error = exc
    if error is None and on_cuda:
        try:
            torch.cuda.synchronize(device)
            local = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]  # ms -> µs
        except Exception as exc:  # noqa: BLE001
            error = exc
    if error is not None:
        local = [float("nan")] * iters
    if distributed:
        t = torch.tensor(local, dtype=torch.float64, device=device if on_cuda else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        local = t.tolist()
    if error is not None:
        raise error
    return local


def _quantile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of an ascending, non-empty sequence."""
    pos = q * (len(sorted_xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def summarize(times: Sequence[float]) -> dict[str, float]:
    """{median, p20, p80, min, n} of per-iteration times (same unit as given)."""
    if not times:
        raise ValueError("summarize needs at least one time")
    xs = sorted(float(t) for t in times)
    return {"median": _quantile(xs, 0.5), "p20": _quantile(xs, 0.2), "p80": _quantile(xs, 0.8),
            "min": xs[0], "n": len(xs)}


def gbps(num_bytes: float | None, micros: float | None) -> float | None:
    """Bytes over microseconds in GB/s (1e9 bytes per second); None when either is missing or zero."""
    if not num_bytes or not micros:
        return None
    return num_bytes / (micros * 1e-6) / 1e9


# ============================================================================ environment
def fs_safe(name: str) -> str:
    """`name` reduced to [A-Za-z0-9_.-] (runs of anything else become one '_')."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "unknown"


def device_info(device: torch.device | str | None = None) -> dict[str, Any]:
    """Where the benchmark ran: device name (and a filesystem-safe form), counts, versions."""
    import triton

    device = torch.device(device) if device is not None else None
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
    }
    if device is not None and device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(kind="cuda", name=props.name, sm_count=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1))
    else:
        cpu = platform.processor() or platform.machine() or "cpu"
        info.update(kind="cpu", name=f"cpu-{cpu}", cpu_count=os.cpu_count())
    info["safe_name"] = fs_safe(info["name"])
    return info


def git_commit(repo: Path | str = REPO_ROOT) -> str:
    """`git rev-parse HEAD` of `repo`; else $DITRON_COMMIT (the device machines get a copy of the
    tree without .git, so the launching command passes the hash); else "unknown"."""
    env = os.environ.get("DITRON_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                             timeout=10, check=True)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def git_dirty(repo: Path | str = REPO_ROOT) -> bool | None:
    """Whether tracked files differ from HEAD (None when git cannot tell)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                             capture_output=True, text=True, timeout=10, check=True)
        return bool(out.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None


def today() -> str:
    return _dt.date.today().strftime("%Y%m%d")


def default_json_path(bench: str, device_name: str) -> Path:
    """bench/results/<bench>_<device>_<YYYYMMDD>.json (device name made filesystem-safe)."""
    return RESULTS_DIR / f"{bench}_{fs_safe(device_name)}_{today()}.json"


# ============================================================================ output
def log(msg: str, *, rank: int | None = None) -> None:
    """Print on rank 0 only (all ranks when torch.distributed is not initialised), flushed."""
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank == 0:
        print(msg, flush=True)


def write_json(path: Path | str, payload: dict[str, Any]) -> Path:
    """Write `payload` as indented JSON, atomically (temp file + rename); create parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def print_table(rows: Sequence[dict[str, Any]], title: str, columns: Sequence[str] | None = None) -> None:
    """Print `rows` (dicts; columns = keys in first-seen order unless given) as a rich table."""
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is a dependency, but a table must never break a benchmark run
        print(title)
        print(" | ".join(columns))
        for r in rows:
            print(" | ".join(_cell(r.get(c)) for c in columns))
        sys.stdout.flush()
        return
    table = Table(title=title, show_lines=False)
    for c in columns:
        table.add_column(c, justify="left" if c in ("config", "stage", "target") else "right",
                         overflow="fold")
    for r in rows:
        table.add_row(*(_cell(r.get(c)) for c in columns))
    Console(width=max(160, Console().width)).print(table)
    sys.stdout.flush()
