"""The report of a benchmark run: the JSON document, the rich tables, the plot, the exit status.

JSON document (`build_document`, schema "ditron_ep.bench/2"):

    schema      "ditron_ep.bench/2"
    ok          bool: every row ok (exit status 0)
    complete    bool: false in the copies written after each config while the run goes on
    meta        {ditron_ep, date, commit, commit_dirty, backend ("emulated"|"torch"),
                 collectives ("gloo"|"nccl"), world_size, device, device_kind ("cpu"|"cuda"),
                 device_info {name, sm_count, memory_gib, cuda, hip, gpu_count, ...}, torch, triton,
                 python, host, timer, not_performance (str|null: set on CPU runs), wall_s}
    benchmarks  {name: {description, ours [impl], baselines [impl], references [impl], metric,
                 work_rule, check_rule, shape {hidden, experts, topk, inter}, tokens [int], dtype,
                 iters, warmup, routing, options [[key, value], ...] (the --opt given)}}
    rows        one per (bench, impl, tokens), in run order: spec.Row's fields — bench, impl,
                 kind ("ours"|"baseline"|"reference"), tokens, hidden, experts, topk, inter
                 (int|null), dtype, routing, world_size, iters, median_us / p20_us / p80_us
                 (float|null: slowest rank per iteration; a derived figure has only median_us),
                 metric ("GB/s"|"TFLOP/s"), metric_value (float|null), baseline (str|null: the first
                 of the row's baselines), speedup (float|null: baseline median / this median, ours
                 rows only), speedups ({row: float}: its baselines and the reference rows it names),
                 check (str), ok (bool), error (str|null), details (object: more figures of the row,
                 per benchmark)
"""
from __future__ import annotations

import datetime as _dt
import importlib
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any, Sequence

from rich import box
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

import ditron_ep
from ditron_ep.bench.environment import git_commit, git_dirty
from ditron_ep.bench.registry import BENCHMARKS
from ditron_ep.bench.spec import BenchRequest, Row
from ditron_ep.runtime import DitronConfigError

SCHEMA = "ditron_ep.bench/2"
CPU_NOTE = "CPU (Triton interpreter, emulated ranks) — not performance figures"
PLOT_INSTALL = "pip install 'ditron_ep[plot]'"


# ============================================================================ document
def make_meta(backend: str, collectives: str, world_size: int, device: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """`meta` of the document; `device` is environment.device_info() of rank 0's device."""
    cpu = device["kind"] == "cpu"
    return {
        "ditron_ep": ditron_ep.__version__, "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "commit": git_commit(), "commit_dirty": git_dirty(), "backend": backend, "collectives": collectives,
        "world_size": world_size, "device": device["name"], "device_kind": device["kind"], "device_info": device,
        "torch": device["torch"], "triton": device["triton"], "python": platform.python_version(),
        "host": device["host"], "timer": "cpu_perf_counter" if cpu else "cuda_events",
        "not_performance": CPU_NOTE if cpu else None, "wall_s": round(wall_s, 1),
    }


def build_document(meta: dict[str, Any], requests: Sequence[BenchRequest], rows: Sequence[Row],
                   complete: bool = True) -> dict[str, Any]:
    benchmarks = {}
    on_gpu = meta["device_kind"] == "cuda"
    for req in requests:
        b = BENCHMARKS[req.bench]
        impls = b.impls_of(req, on_gpu)
        benchmarks[b.name] = {
            "description": b.description, "ours": list(impls["ours"]), "baselines": list(impls["baseline"]),
            "references": list(impls["reference"]), "metric": b.metric, "work_rule": b.work_rule,
            "check_rule": b.check_rule,
            "shape": {"hidden": req.shape.hidden, "experts": req.shape.experts, "topk": req.shape.topk,
                      "inter": req.shape.inter},
            "tokens": list(req.tokens), "dtype": req.dtype, "iters": req.iters, "warmup": req.warmup,
            "routing": req.routing, "options": [list(p) for p in req.options]}
    return {"schema": SCHEMA, "ok": complete and exit_status(rows) == 0, "complete": complete, "meta": meta,
            "benchmarks": benchmarks, "rows": [_finite(r.to_json()) for r in rows]}


def _finite(value: Any) -> Any:
    # Strict JSON has no NaN / Infinity: a non-finite figure is reported as missing.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(doc: dict[str, Any], path: Path) -> None:
    """Write `doc` (strict JSON) to `path` through a temporary file: a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)


class PartialJson:
    """Rewrites the document (complete=false) with the rows so far after every config, so that a
    run killed at a time limit keeps what it measured. Picklable: sent to emulated rank 0."""

    def __init__(self, path: Path, requests: Sequence[BenchRequest], backend: str, collectives: str,
                 world_size: int, device: dict[str, Any]) -> None:
        self.path, self.requests, self.device = Path(path), list(requests), device
        self.backend, self.collectives, self.world_size = backend, collectives, world_size
        self.start = time.time()

    def __call__(self, rows: Sequence[Row]) -> None:
        meta = make_meta(self.backend, self.collectives, self.world_size, self.device, time.time() - self.start)
        write_json(build_document(meta, self.requests, rows, complete=False), self.path)


def exit_status(rows: Sequence[Row]) -> int:
    """0 if there are rows and every one is ok (measured, and its check passed), else 1."""
    return 0 if rows and all(r.ok for r in rows) else 1


# ============================================================================ tables
def _num(v: float | None) -> str:
    if v is None:
        return "—"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"


def _short_names(names: Sequence[str]) -> list[str]:
    """`names` without the words they all begin with (two or more names), for a narrow cell."""
    if len(names) < 2:
        return list(names)
    words = [n.split(" ") for n in names]
    common = 0
    while all(len(w) > common + 1 and w[common] == words[0][common] for w in words):
        common += 1
    return [" ".join(w[common:]) for w in words]


def speedup_cell(row: dict[str, Any]) -> str:
    """"1.52× torch-native, 0.88× grouped GEMM alone": this row's speedups, in its baselines' order."""
    names = list(row["speedups"])
    if not names:
        return "—"
    return ", ".join(f"{_num(row['speedups'][b])}× {short}" for b, short in zip(names, _short_names(names)))


def header(meta: dict[str, Any]) -> Text:
    dirty = " (dirty)" if meta["commit_dirty"] else ""
    text = Text("ditron_ep bench", style="bold")
    text.append(f" — device {meta['device']} · world size {meta['world_size']} · backend {meta['backend']} "
                f"({meta['collectives']})\ncommit {meta['commit'][:12]}{dirty} · torch {meta['torch']} · "
                f"triton {meta['triton']} · ditron_ep {meta['ditron_ep']} · {meta['date']}")
    if meta["not_performance"]:
        text.append("\n" + meta["not_performance"], style="bold yellow")
    return text


def build_tables(doc: dict[str, Any]) -> Group:
    """One table per benchmark: a row per (tokens, impl), each of ours with its speedups over its
    baselines; then the benchmark's own view of its details, if any."""
    parts: list[Any] = [header(doc["meta"])]
    for name, b in doc["benchmarks"].items():
        s = b["shape"]
        shape = f"H={s['hidden']} E={s['experts']} K={s['topk']}" + (f" I={s['inter']}" if s["inter"] else "")
        opts = "".join(f", {k}={v}" for k, v in b["options"])
        table = Table(title=escape(f"{name} — {b['description']}\n{shape}, {b['dtype']}, {b['routing']} routing, "
                                   f"{b['iters']} iterations after {b['warmup']} warm-up{opts}"),
                      title_justify="left", box=box.SIMPLE_HEAD)
        table.add_column("T", justify="right")
        table.add_column("impl", no_wrap=True)
        table.add_column("kind")
        for col in ("median µs", "p20 µs", "p80 µs", b["metric"]):
            table.add_column(col, justify="right")
        table.add_column("speedup", overflow="fold", ratio=1, min_width=16)
        table.add_column("check", overflow="fold", ratio=1, min_width=25)  # "ok: 3.4e-07 <= rtol 1e-05"
        rows = [r for r in doc["rows"] if r["bench"] == name]
        for i, r in enumerate(rows):
            if r["error"]:
                check = f"[bold red]ERROR[/] {escape(r['error'])}"
            elif not r["ok"]:
                check = f"[bold red]{escape(r['check'] or 'FAIL')}[/]"
            else:
                check = f"[green]{escape(r['check'])}[/]" if r["kind"] == "ours" else escape(r["check"])
            last = i + 1 == len(rows) or rows[i + 1]["tokens"] != r["tokens"]
            table.add_row(str(r["tokens"]), r["impl"], r["kind"], _num(r["median_us"]), _num(r["p20_us"]),
                          _num(r["p80_us"]), _num(r["metric_value"]),
                          speedup_cell(r), check, end_section=last)
        parts.append(table)
        if BENCHMARKS[name].view is not None:
            parts += BENCHMARKS[name].view(b, rows)
    failed = sum(not r["ok"] for r in doc["rows"])
    status = "[bold green]OK[/]" if doc["ok"] else "[bold red]FAILED[/]"
    notes = [f"{status}: {len(doc['rows']) - failed}/{len(doc['rows'])} rows measured and checked in "
             f"{doc['meta']['wall_s']} s. Times: slowest rank per iteration; speedup = the baseline's median / "
             f"this median; reference rows are other figures of the same run."]
    rules: dict[tuple[str, str], list[str]] = {}   # one note per rule, naming the benchmarks it serves
    for name, b in doc["benchmarks"].items():
        rules.setdefault((b["metric"], b["work_rule"]), []).append(name)
    notes += [f"{metric} ({', '.join(names)}): {escape(rule)}" for (metric, rule), names in rules.items()]
    notes += [f"check ({name}): {escape(b['check_rule'])}" for name, b in doc["benchmarks"].items()]
    parts.append(Text.from_markup("\n".join(notes)))
    return Group(*parts)


def print_report(doc: dict[str, Any], console: Console) -> None:
    console.print(build_tables(doc))
    for r in doc["rows"]:
        if not r["ok"]:
            console.print(f"[bold red]FAIL[/] {r['bench']} T={r['tokens']} {r['impl']}: "
                          f"{escape(r['error'] or r['check'])}",
                          highlight=False)


# ============================================================================ plot
def require_matplotlib() -> None:
    """DitronConfigError unless matplotlib can be imported (checked before any benchmark runs)."""
    try:
        importlib.import_module("matplotlib.figure")
    except ImportError as exc:
        raise DitronConfigError(f"--plot needs matplotlib, which is not installed here: {PLOT_INSTALL}") from exc


def plot(doc: dict[str, Any], path: Path) -> None:
    """One panel per benchmark: median time (bars p20–p80) against tokens per rank, log-log, ours
    (solid) against each baseline (dashed) and reference (dotted)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    names = list(doc["benchmarks"])
    fig = Figure(figsize=(max(5.5 * len(names), 7.0), 5.0), layout="constrained")
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    for ax, name in zip(axes, names):
        b = doc["benchmarks"][name]
        for impl in (*b["ours"], *b["baselines"], *b["references"]):
            pts = sorted((r for r in doc["rows"] if r["bench"] == name and r["impl"] == impl
                          and r["median_us"] is not None), key=lambda r: r["tokens"])
            if not pts:
                continue
            med = [r["median_us"] for r in pts]
            err = [[m - (r["p20_us"] if r["p20_us"] is not None else m) for m, r in zip(med, pts)],
                   [(r["p80_us"] if r["p80_us"] is not None else m) - m for m, r in zip(med, pts)]]
            kind = pts[0]["kind"]
            ax.errorbar([r["tokens"] for r in pts], med, yerr=err, marker={"ours": "o"}.get(kind, "s"),
                        linestyle={"ours": "-", "baseline": "--"}.get(kind, ":"), capsize=3,
                        label=impl + ("" if kind == "ours" else f" ({kind})"))
        s = b["shape"]
        ax.set_title(f"{name}: H={s['hidden']} E={s['experts']} K={s['topk']}"
                     + (f" I={s['inter']}" if s["inter"] else "") + f", {b['dtype']}", fontsize=10)
        ax.set_xscale("log", base=2)
        tokens = sorted({r["tokens"] for r in doc["rows"] if r["bench"] == name})
        ax.set_xticks(tokens, labels=[str(t) for t in tokens], minor=False)
        ax.set_xticks([], minor=True)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("time per call, µs (median, bars p20–p80)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    m = doc["meta"]
    title = (f"ditron_ep bench — {m['device']} ×{m['world_size']} ({m['collectives']})\n"
             f"commit {m['commit'][:12]}, {m['date'][:10]}")
    if m["not_performance"]:
        title += "\n" + m["not_performance"]
    fig.suptitle(title, fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
