"""Output helpers of the standalone benchmark scripts: result paths, rank-0 logging, JSON, tables.

The measurement code they share (timing rule, device and commit, rank agreement, EP inputs,
baselines) lives in the package, `ditron_ep.bench`, so that an installed ditron_ep can run
benchmarks too (`python -m ditron_ep bench`).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import torch.distributed as dist

from ditron_ep.bench.environment import fs_safe

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"


def today() -> str:
    return _dt.date.today().strftime("%Y%m%d")


def default_json_path(bench: str, device_name: str) -> Path:
    """bench/results/<bench>_<device>_<YYYYMMDD>.json (device name made filesystem-safe)."""
    return RESULTS_DIR / f"{bench}_{fs_safe(device_name)}_{today()}.json"


# ============================================================================ arguments
def add_run_options(p: argparse.ArgumentParser, *, bench: str, iters: int, warmup: int, time_budget: float,
                    smoke_help: str, skipped: str = "configs", pg_timeout: float | None = None) -> None:
    """The options every benchmark script shares: --iters --warmup --seed --json --time-budget
    [--pg-timeout] --smoke, with the script's defaults."""
    p.add_argument("--iters", type=int, default=iters)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", nargs="?", const="auto", default=None, metavar="PATH",
                   help=f"write results as JSON (no value: bench/results/{bench}_<device>_<date>.json)")
    p.add_argument("--time-budget", type=float, default=time_budget,
                   help=f"seconds; {skipped} not started by then are skipped (recorded as such)")
    if pg_timeout is not None:
        p.add_argument("--pg-timeout", type=float, default=pg_timeout, help="seconds before a stuck collective aborts")
    p.add_argument("--smoke", action="store_true", help=smoke_help)


# ============================================================================ output
def log(msg: str, *, rank: int | None = None) -> None:
    """Print on rank 0 only (all ranks when torch.distributed is not initialised), flushed."""
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank == 0:
        print(msg, flush=True)


def ranks_timer(device_type: str, interpreted: bool) -> str:
    """What the distributed scripts time with, as recorded in their JSON."""
    if device_type == "cuda":
        return "cuda_events"
    return "cpu_perf_counter" + (" (Triton interpreter, emulated ranks: NOT GPU performance)" if interpreted else "")


def json_path_of(args: argparse.Namespace, bench: str, device_name: str) -> Path | None:
    """Where --json writes: None without it, the default path for a bare --json, else the path given."""
    if args.json is None:
        return None
    return default_json_path(bench, device_name) if args.json == "auto" else Path(args.json)


def payload_header(bench: str, info: dict[str, Any], args: argparse.Namespace, timer: str, interpreted: bool,
                   **fields: Any) -> dict[str, Any]:
    """The fields every benchmark's JSON starts with (what ran where, when, at which commit), then `fields`."""
    from ditron_ep.bench.environment import git_commit, git_dirty
    return {"benchmark": bench, "device": info["name"], "device_info": info, "torch": info["torch"],
            "triton": info["triton"], "date": _dt.datetime.now().isoformat(timespec="seconds"),
            "commit": git_commit(), "commit_dirty": git_dirty(), "timer": timer, "interpreted": interpreted,
            "args": vars(args), "status": "running", **fields}


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
