"""Benchmark EP dispatch / combine (`EPBuffer`) against NCCL `all_to_all_single`, on the launched ranks.

    torchrun --nproc-per-node 4 bench/dispatch_combine.py [--tokens 128 4096 8192] [--hidden 7168]
        [--topk 8] [--experts 64 256] [--routing uniform zipf] [--mode eager graph]
        [--num-programs N] [--graph-cache 4] [--iters 20] [--warmup 5] [--json [PATH]]
    TRITON_INTERPRET=1 GLOO_SOCKET_IFNAME=lo torchrun --nproc-per-node 2 bench/dispatch_combine.py --smoke

A config is (tokens T per rank, experts E, routing); every config runs every stage of every mode:
  eager  layout         `_launch_layout`: sender-side torch layout ops + the counts-exchange kernel
         dispatch       `_launch_dispatch` only: the data kernel, layout computed beforehand
         dispatch total public `dispatch(sync=True)`: layout + host read + allocations + data kernel
                        (+ the error-slot read when the buffer checks errors, the library default)
         combine        `_launch_combine` only: the combine kernel
         combine total  public `combine(...)` (+ the error-slot read)
  graph  one CUDA graph each: layout; dispatch(sync=False) (layout + data kernel); combine;
         dispatch+combine in one graph; and dispatch / combine with 0 tokens on every rank (the
         fixed cost of a cross-rank launch under this timing rule). Timed as replays.
  baseline  NCCL all_to_all_single with the real per-rank split sizes of the same routing:
         dispatch = each rank sends every other rank one row per (token, destination rank) it would
         dispatch; combine = the reverse exchange. Rows are pre-packed (no gather, no expansion) and
         nothing is sent to self. Timed eagerly in both modes.
Timing (ditron_ep/bench/timing.py): barrier + device sync before every iteration, CUDA events around it,
the slowest rank's time per iteration (all_reduce MAX), then median / p20 / p80.
One EPBuffer per (E, max T): by default max T is the config's T (`--buffer-per config`); with
`--buffer-per sweep` one buffer per E sized for the largest --tokens serves every T.
Per-config and per-stage failures are caught on every rank alike, recorded, and the sweep goes on;
with --json the file is rewritten after every config, so a killed run keeps what it measured.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: `bench.common`, `ditron_ep`

# No NVLink multicast on the lent machines (as tests/gpu/run_gpu_suite.sh); must precede NCCL init.
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ditron_ep  # noqa: E402,F401  (decides compiled vs interpreted kernels before any triton.jit)
from bench.common import add_run_options, json_path_of, log, payload_header, print_table, ranks_timer, write_json  # noqa: E402
from ditron_ep.bench.alltoall import AllToAll, gather_routing  # noqa: E402
from ditron_ep.bench.dispatch_combine import dispatch_kernel_call  # noqa: E402
from ditron_ep.bench.environment import device_info  # noqa: E402
from ditron_ep.bench.ep_inputs import BYTE_RULE, Bytes, Inputs, make_inputs, traffic_bytes  # noqa: E402
from ditron_ep.bench.ranks import Fatal, RankContext, StageFailed, all_ranks, guarded  # noqa: E402
from ditron_ep.bench.spec import DTYPES  # noqa: E402
from ditron_ep.bench.timing import capture_graph, gbps, summarize, time_fn  # noqa: E402
from ditron_ep.check import ROUTING_KINDS  # noqa: E402
from ditron_ep.ops import EPBuffer  # noqa: E402
from ditron_ep.runtime import kernels_interpreted  # noqa: E402

BENCH = "dispatch_combine"
# Issue targets (printed beside, never asserted): (T, E or None = any) -> stage kind -> µs.
TARGETS = {(4096, 256): {"dispatch": 450.0, "combine": 500.0}, (128, None): {"dispatch": 50.0, "combine": 50.0}}
DEEPEP_US = {(4096, 256): {"dispatch": 527.0, "combine": 597.0}}  # DeepEP v1 intranode, same machine
TARGET_NOTE = ("targets (issue; bf16, H=7168, top-8, uniform): T=4096 E=256 dispatch <= 450 µs, combine "
               "<= 500 µs; T=128 each <= 50 µs. DeepEP v1 on 4xH200 at T=4096 E=256: dispatch 527 µs, "
               "combine 597 µs (layout 34 µs).")
TABLE_COLUMNS = ["config", "stage", "median µs", "p20", "p80", "GB/s", "wire GB/s", "a2a µs", "a2a GB/s",
                 "speedup", "target", "check"]


# ============================================================================ arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 4096, 8192], help="tokens per rank T")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size H")
    p.add_argument("--topk", type=int, default=8, help="experts per token K")
    p.add_argument("--experts", type=int, nargs="+", default=[64, 256], help="experts E (multiple of ranks)")
    p.add_argument("--routing", nargs="+", default=None, choices=ROUTING_KINDS,
                   help="routings (default: uniform zipf; --smoke: uniform)")
    p.add_argument("--mode", nargs="+", default=["eager", "graph"], choices=["eager", "graph"])
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--num-programs", type=int, default=None, help="programs (SMs) per kernel; default all SMs")
    p.add_argument("--block-rows", type=int, default=16, help="EPBuffer block_rows (tokens per chunk)")
    p.add_argument("--block-hidden", type=int, default=None,
                   help="EPBuffer block_hidden (columns per copy step); default: the buffer's")
    p.add_argument("--hidden-slices", type=int, default=None,
                   help="EPBuffer hidden_slices (column slices per chunk); default: the buffer's")
    p.add_argument("--buffer-per", choices=["config", "sweep"], default="config",
                   help="config: one EPBuffer per (E, T) sized max_tokens=T; sweep: one per E sized max(--tokens)")
    p.add_argument("--graph-cache", type=int, default=4,
                   help="EPBuffer graph_cache: dispatch signatures whose layout replays from a CUDA graph (0: off)")
    p.add_argument("--no-check-errors", action="store_true",
                   help="build EPBuffer(check_errors=False): no error-slot read after each public call")
    add_run_options(p, bench="dispatch_combine", iters=20, warmup=5, time_budget=480.0, pg_timeout=300.0,
                    smoke_help="tiny config (T=16 H=64 E=8 K=2, 3 iters); also on CPU with emulated ranks (gloo)")
    return p


def apply_smoke(args: argparse.Namespace) -> None:
    args.tokens, args.hidden, args.experts, args.topk = [16], 64, [8], 2
    args.iters, args.warmup = 3, 1
    args.routing = args.routing or ["uniform"]


def validate_args(args: argparse.Namespace, world: int) -> None:
    for name in ("hidden", "topk", "iters", "block_rows"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or any(t < 1 for t in args.tokens):
        raise SystemExit("--warmup must be >= 0 and every --tokens value >= 1")
    bad = [e for e in args.experts if e % world or e < args.topk]
    if bad:
        raise SystemExit(f"--experts {bad}: each must be a multiple of the world size {world} and >= --topk")


# ============================================================================ context
@dataclass(kw_only=True)
class Ctx(RankContext):
    args: argparse.Namespace
    t0: float
    payload: dict[str, Any]
    json_path: Path | None
    rows: list[dict[str, Any]] = field(default_factory=list)  # table rows (rank 0 prints)

    def save(self) -> None:
        if self.rank == 0 and self.json_path is not None:
            write_json(self.json_path, self.payload)


# ============================================================================ results
def target_for(ctx: Ctx, T: int, E: int, routing: str, kind: str | None) -> tuple[float | None, float | None]:
    a = ctx.args
    if kind not in ("dispatch", "combine") or routing != "uniform" or ctx.dtype != torch.bfloat16 \
            or a.hidden != 7168 or a.topk != 8:
        return None, None
    for (t, e), tg in TARGETS.items():
        if t == T and (e is None or e == E):
            return tg[kind], DEEPEP_US.get((t, e), {}).get(kind)
    return None, None


def record(ctx: Ctx, cfg: dict[str, Any], label: str, stage: str, mode: str, kind: str | None,
           inp: Inputs | None, times: list[float] | None, error: str | None = None,
           baseline: dict[str, Any] | None = None, check: str | None = None) -> dict[str, Any]:
    s = summarize(times) if times else None
    by = traffic_bytes(ctx, inp, kind, ctx.args.hidden) if inp is not None else Bytes(None, None, None)
    med = s["median"] if s else None
    target, deepep = target_for(ctx, cfg["tokens"], cfg["experts"], cfg["routing"], kind)
    entry = {
        "config": cfg, "label": label, "stage": stage, "mode": mode, "kind": kind,
        "median_us": med, "p20_us": s["p20"] if s else None, "p80_us": s["p80"] if s else None,
        "min_us": s["min"] if s else None, "times_us": times,
        "bytes": by.rule, "bytes_max": by.rule_max, "wire_bytes": by.wire,
        "gbps": gbps(by.rule, med), "wire_gbps": gbps(by.wire, med),
        "baseline": baseline, "speedup": (baseline["median_us"] / med) if baseline and med else None,
        "target_us": target, "deepep_us": deepep,
        "meets_target": (med <= target) if (target is not None and med is not None) else None,
        "check": check, "error": error,
    }
    ctx.payload["results"].append(entry)
    row = table_row(entry)
    ctx.rows.append(row)
    if error:
        log(f"    {stage:<24} ERROR {error}")
    else:
        line = f"    {stage:<24} {row['median µs']:>9} µs (p20 {row['p20']}, p80 {row['p80']})"
        if entry["gbps"] is not None:
            line += f"  {row['GB/s']} GB/s"
        if baseline:
            line += f"  | a2a {row['a2a µs']} µs, ours x{row['speedup']}"
        log(line + (f"  target {row['target']}" if row["target"] else ""))
    return entry


def _f(v: float | None, digits: int = 1) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if abs(v) >= 10 or v == 0 else f"{v:.3g}"


def table_row(e: dict[str, Any]) -> dict[str, Any]:
    b = e["baseline"] or {}
    tgt = ""
    if e["target_us"] is not None:
        mark = "-" if e["meets_target"] is None else ("✓" if e["meets_target"] else "✗")
        tgt = f"<={e['target_us']:.0f} {mark}"
        if e["deepep_us"] is not None:
            tgt += f" (DeepEP {e['deepep_us']:.0f})"
    return {"config": e["label"], "stage": e["stage"] if not e["error"] else f"{e['stage']} (error)",
            "median µs": _f(e["median_us"]), "p20": _f(e["p20_us"]), "p80": _f(e["p80_us"]),
            "GB/s": _f(e["gbps"]), "wire GB/s": _f(e["wire_gbps"]) if e["kind"] in ("combine", "roundtrip") else "",
            "a2a µs": _f(b.get("median_us")), "a2a GB/s": _f(b.get("gbps")),
            "speedup": _f(e["speedup"], 2), "target": tgt, "check": e["check"] or ""}


def baseline_ref(entry: dict[str, Any] | None) -> dict[str, Any] | None:
    if not entry or entry["median_us"] is None:
        return None
    return {"stage": entry["stage"], "median_us": entry["median_us"], "p20_us": entry["p20_us"],
            "p80_us": entry["p80_us"], "gbps": entry["gbps"]}


# ============================================================================ one config
def run_config(ctx: Ctx, buf: EPBuffer, T: int, E: int, routing: str) -> None:
    a = ctx.args
    label = f"T{T} E{E} {routing}"
    cfg = {"tokens": T, "experts": E, "routing": routing, "hidden": a.hidden, "topk": a.topk,
           "dtype": a.dtype, "world_size": ctx.world, "num_programs": buf.num_programs,
           "buffer_max_tokens": buf.max_tokens, "block_rows": buf.block_rows,
           "block_hidden": buf.block_hidden, "hidden_slices": buf.n_slices,
           "check_errors": buf.check_errors}
    iters, warmup, dev = a.iters, a.warmup, ctx.device

    def timed(fn: Callable[[], object]) -> list[float]:
        with torch.no_grad():
            return time_fn(fn, iters, warmup, None, dev)

    def stage(name: str, mode: str, kind: str | None, setup: Callable[[], Callable[[], object]],
              baseline: dict[str, Any] | None = None, check: str | None = None) -> dict[str, Any]:
        """Set up (agreed on), then time (agreed on); record the result or the error."""
        try:
            fn = guarded(ctx, f"{name} setup", setup, buf)
            times = guarded(ctx, name, lambda: timed(fn), buf)
            return record(ctx, cfg, label, name, mode, kind, inp, times, baseline=baseline, check=check)
        except StageFailed as exc:
            return record(ctx, cfg, label, name, mode, kind, inp, None, error=str(exc))

    inp = guarded(ctx, "inputs", lambda: make_inputs(ctx, T, E, a.topk, a.hidden, routing))
    ctx.payload["traffic"].append({
        "label": label, "config": cfg,
        "recv_remote_tokens": [inp.recv_remote_tokens(r) for r in range(ctx.world)],
        "recv_remote_pairs": [inp.recv_remote_pairs(r) for r in range(ctx.world)],
        "rows_received": [inp.rows_received(r) for r in range(ctx.world)]})
    rr = [inp.recv_remote_tokens(r) for r in range(ctx.world)]
    log(f"  traffic: remote tokens received per rank {rr}, rows per rank "
        f"{[inp.rows_received(r) for r in range(ctx.world)]}")
    x, idx, w = inp.x, inp.idx, inp.w
    w32 = w.to(torch.float32).contiguous()

    # ---- baseline: NCCL all_to_all_single of pre-packed rows (ditron_ep/bench/alltoall.py)
    plan: dict[str, AllToAll] = {}

    def a2a_setup(reverse: bool) -> Callable[[], object]:
        if "a2a" not in plan:
            plan["a2a"] = AllToAll(ctx, x, *gather_routing(ctx, idx, w), E)
        a2a = plan["a2a"]
        if not reverse:
            return a2a.dispatch
        a2a.dispatch()       # the received rows, whose pre-reduced sums the combine sends back
        a2a.pack_combine()
        return a2a.combine

    backend = dist.get_backend()
    base_d = baseline_ref(stage(f"{backend} a2a dispatch", "baseline", "dispatch", lambda: a2a_setup(False)))
    base_c = baseline_ref(stage(f"{backend} a2a combine", "baseline", "combine", lambda: a2a_setup(True)))
    base_rt = None
    if base_d and base_c:
        base_rt = {"stage": f"{backend} a2a dispatch + combine (sum of medians)",
                   "median_us": base_d["median_us"] + base_c["median_us"], "p20_us": None, "p80_us": None,
                   "gbps": gbps(traffic_bytes(ctx, inp, "roundtrip", a.hidden).rule,
                                base_d["median_us"] + base_c["median_us"])}
    plan.clear()

    # ---- sanity: identity experts, so combine(dispatch(x)) = x * sum_k w = x (weights sum to 1)
    state: dict[str, Any] = {}

    def eager_roundtrip() -> str:
        with torch.no_grad():
            recv_x, handle = buf.dispatch(x, idx, w, sync=True)
            out = buf.combine(recv_x, handle, w)
        ref = x.float() * w.sum(-1, keepdim=True)
        err = (out.float() - ref).abs().max().item() if out.numel() else 0.0
        tol = 1e-2 * max(ref.abs().max().item() if ref.numel() else 0.0, 1.0)
        state.update(recv_x=recv_x, handle=handle, out=out)
        return "ok" if err <= tol else f"FAIL max|err|={err:.3g}"

    try:
        mine = guarded(ctx, "round-trip check", eager_roundtrip, buf)
        check = "ok" if all_ranks(ctx, mine == "ok") else "FAIL"
        if mine != "ok":
            print(f"[rank {ctx.rank}] round-trip check: {mine}", file=sys.stderr, flush=True)
    except StageFailed as exc:
        check = "error"
        state.clear()  # keep every rank on the same path below (it may have succeeded on some)
        record(ctx, cfg, label, "round-trip check", "eager", None, inp, None, error=str(exc))
    log(f"  round-trip check (combine(dispatch(x)) == x * sum(w), 1e-2 relative): {check}")

    # ---- eager stages
    if "eager" in a.mode:
        stage("layout", "eager", None, lambda: (lambda: buf._launch_layout(idx)), check=check)

        # Only the data kernel is timed (ditron_ep/bench/dispatch_combine.py: dispatch_kernel_call).
        stage("dispatch", "eager", "dispatch", lambda: dispatch_kernel_call(buf, x, idx, w32)[0], base_d, check)
        stage("dispatch total", "eager", "dispatch", lambda: (lambda: buf.dispatch(x, idx, w, sync=True)),
              base_d, check)

        def combine_setup(kernel_only: bool) -> Callable[[], object]:
            # A fresh dispatch per stage: every rank takes the same path even after a failed stage.
            with torch.no_grad():
                y, h = buf.dispatch(x, idx, w, sync=True)
            if kernel_only:
                return lambda: buf._launch_combine(y, w32, h)
            return lambda: buf.combine(y, h, w)

        stage("combine", "eager", "combine", lambda: combine_setup(True), base_c, check)
        stage("combine total", "eager", "combine", lambda: combine_setup(False), base_c, check)
    eager_out = state.get("out")
    state.clear()

    # ---- graph stages
    if "graph" in a.mode:
        if not ctx.on_cuda:
            log("    graph mode: skipped (CUDA graphs need a GPU)")
            ctx.payload["skipped"].append({"label": label, "what": "graph mode", "why": "no CUDA device"})
        else:
            run_graph_stages(ctx, buf, cfg, label, inp, eager_out, base_d, base_c, base_rt, check)


def run_graph_stages(ctx: Ctx, buf: EPBuffer, cfg: dict[str, Any], label: str, inp: Inputs,
                     eager_out: torch.Tensor | None, base_d: Any, base_c: Any, base_rt: Any,
                     check: str | None) -> None:
    a = ctx.args
    x, idx, w = inp.x, inp.idx, inp.w
    graphs: dict[str, Any] = {}

    def build() -> None:
        with torch.no_grad():  # eager warm-up: compiles the graph-mode specialisations on every rank
            r, h = buf.dispatch(x, idx, w, sync=False)
            buf.combine(r, h, w)
        torch.cuda.synchronize(ctx.device)
        graphs["layout"] = capture_graph(lambda: buf._launch_layout(idx))
        graphs["dispatch"] = capture_graph(lambda: buf.dispatch(x, idx, w, sync=False))
        recv_g, h_g = graphs["dispatch"][1]
        graphs["combine"] = capture_graph(lambda: buf.combine(recv_g, h_g, w))

        def both() -> torch.Tensor:
            r2, h2 = buf.dispatch(x, idx, w, sync=False)
            return buf.combine(r2, h2, w)

        graphs["dispatch+combine"] = capture_graph(both)
        # The same graphs with no tokens on any rank: the fixed cost of a cross-rank launch under
        # this timing rule (host skew after the barrier, graph launch, the ranks' entry barrier,
        # the counts exchange), which no amount of bandwidth removes.
        x0, idx0, w0 = x[:0], idx[:0], w[:0]
        with torch.no_grad():
            r0, h0 = buf.dispatch(x0, idx0, w0, sync=False)
            buf.combine(r0, h0, w0)
        torch.cuda.synchronize(ctx.device)
        graphs["dispatch, 0 tokens"] = capture_graph(lambda: buf.dispatch(x0, idx0, w0, sync=False))
        recv_0, h_0 = graphs["dispatch, 0 tokens"][1]
        graphs["combine, 0 tokens"] = capture_graph(lambda: buf.combine(recv_0, h_0, w0))

    try:
        guarded(ctx, "graph capture", build, buf)
    except StageFailed as exc:
        record(ctx, cfg, label, "graph capture", "graph", None, inp, None, error=str(exc))
        graphs.clear()
        return

    def timed_replay(name: str, kind: str | None, baseline: Any) -> bool:
        g = graphs[name][0]
        try:
            times = guarded(ctx, f"graph {name}", lambda: time_fn(g.replay, a.iters, a.warmup, None, ctx.device), buf)
            record(ctx, cfg, label, f"graph {name}", "graph", kind, inp, times, baseline=baseline, check=check)
            return True
        except StageFailed as exc:
            record(ctx, cfg, label, f"graph {name}", "graph", kind, inp, None, error=str(exc))
            return False

    timed_replay("layout", None, None)
    if timed_replay("dispatch", "dispatch", base_d):
        # The combine graph reads the dispatch graph's outputs: only valid after a good replay.
        timed_replay("combine", "combine", base_c)
    else:
        record(ctx, cfg, label, "graph combine", "graph", "combine", inp, None,
               error="skipped: the dispatch graph it reads from failed")
    rt_ok = timed_replay("dispatch+combine", "roundtrip", base_rt)
    if timed_replay("dispatch, 0 tokens", None, None):
        timed_replay("combine, 0 tokens", None, None)

    # Graph mode must equal default mode bit for bit (the library's contract).
    if not rt_ok or eager_out is None:
        verdict = "n/a (graph replay or eager round trip failed)"
    else:
        try:
            same = guarded(ctx, "graph bitwise check",
                           lambda: torch.equal(graphs["dispatch+combine"][1], eager_out), buf)
            verdict = "ok" if all_ranks(ctx, same) else "DIFFERS"
        except StageFailed as exc:
            verdict = f"error: {exc}"
    ctx.payload["graph_bitwise"].append({"label": label, "graph_equals_eager": verdict})
    log(f"  graph dispatch+combine output == eager output (bitwise): {verdict}")
    graphs.clear()


# ============================================================================ sweep
def synced_elapsed(ctx: Ctx) -> float:
    t = ctx.coll_tensor([time.time() - ctx.t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def sweep(ctx: Ctx) -> None:
    a = ctx.args
    configs = [(E, T, r) for E in a.experts for T in a.tokens for r in a.routing]
    n = len(configs)
    buf: EPBuffer | None = None
    buf_key: tuple[int, int] | None = None
    for i, (E, T, routing) in enumerate(configs, 1):
        label = f"T{T} E{E} {routing}"
        elapsed = synced_elapsed(ctx)
        if elapsed > a.time_budget:
            log(f"[{i}/{n} {elapsed:5.0f}s] {label}: skipped (time budget {a.time_budget:.0f}s spent)")
            ctx.payload["skipped"].append({"label": label, "what": "config", "why": "time budget"})
            continue
        log(f"[{i}/{n} {elapsed:5.0f}s] {label}  (H={a.hidden} K={a.topk} {a.dtype})")
        max_t = T if a.buffer_per == "config" else max(a.tokens)
        if buf_key != (E, max_t):
            if buf is not None:
                free_buffer(ctx, buf)
                buf = None
            buf_key = (E, max_t)
            try:
                buf = guarded(ctx, "EPBuffer", lambda: EPBuffer(
                    None, E, a.hidden, max_t, a.topk, ctx.dtype, num_programs=a.num_programs,
                    block_rows=a.block_rows, block_hidden=a.block_hidden, hidden_slices=a.hidden_slices,
                    check_errors=not a.no_check_errors, graph_cache=a.graph_cache))
                log(f"  EPBuffer(E={E}, max_tokens={max_t}, num_programs={buf.num_programs}, graph_cache={a.graph_cache}, "
                    f"block_hidden={buf.block_hidden}, hidden_slices={buf.n_slices}, "
                    f"heap {buf.heap.size_bytes / 2**20:.1f} MiB/rank)")
            except StageFailed as exc:
                buf = None
                log(f"  EPBuffer failed: {exc}")
        if buf is None:
            record(ctx, {"tokens": T, "experts": E, "routing": routing}, label, "EPBuffer", "eager", None,
                   None, None, error="EPBuffer construction failed (see above)")
        else:
            try:
                run_config(ctx, buf, T, E, routing)
            except StageFailed as exc:
                record(ctx, {"tokens": T, "experts": E, "routing": routing}, label, "config", "eager", None,
                       None, None, error=str(exc))
        ctx.save()
    if buf is not None:
        free_buffer(ctx, buf)


def free_buffer(ctx: Ctx, buf: EPBuffer) -> None:
    try:
        buf.free()
    except Exception as exc:  # noqa: BLE001
        log(f"  EPBuffer.free failed: {type(exc).__name__}: {exc}")
    gc.collect()
    if ctx.on_cuda:
        torch.cuda.empty_cache()


# ============================================================================ main
def init_distributed(args: argparse.Namespace) -> torch.device:
    if "RANK" not in os.environ:  # plain `python bench/dispatch_combine.py`: one rank
        for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                     ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29531")):
            os.environ.setdefault(k, v)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = timedelta(seconds=args.pg_timeout)
    if torch.cuda.is_available() and not kernels_interpreted():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device


def finish(ctx: Ctx, status: str) -> None:
    """Write the final JSON; after a complete run, leave the process group together (an aborted run
    exits without the collective: a peer may be stuck)."""
    ctx.save()
    if ctx.json_path is not None:
        log(f"wrote {ctx.json_path}")
    if status == "complete":
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        apply_smoke(args)
    args.routing = args.routing or ["uniform", "zipf"]
    t0 = time.time()
    device = init_distributed(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    validate_args(args, world)
    info = device_info(device)
    interpreted = kernels_interpreted()
    timer = ranks_timer(device.type, interpreted)
    json_path = json_path_of(args, BENCH, info["name"])
    payload = payload_header(BENCH, info, args, timer, interpreted, gpu_count=info["gpu_count"], world_size=world,
                             byte_rule=BYTE_RULE, targets=TARGET_NOTE, results=[], traffic=[], graph_bitwise=[],
                             skipped=[])
    ctx = Ctx(args=args, device=device, rank=rank, world=world, dtype=DTYPES[args.dtype], seed=args.seed, t0=t0,
              payload=payload, json_path=json_path)
    log(f"ditron_ep {BENCH}: {world} ranks on {info['name']} ({device.type}), torch {info['torch']}, "
        f"triton {info['triton']}, commit {payload['commit'][:12]}{' (dirty)' if payload['commit_dirty'] else ''}")
    log(f"timer: {timer}; slowest rank per iteration, median (p20, p80) of {args.iters} iterations "
        f"after {args.warmup} warm-up")
    log(f"byte rule: {BYTE_RULE}")
    log(TARGET_NOTE)
    status = "complete"
    try:
        sweep(ctx)
    except Fatal as exc:
        status = f"aborted: {exc}"
        log(f"ABORTED: {exc}")
    except KeyboardInterrupt:
        status = "interrupted"
    payload["status"] = status
    payload["wall_s"] = round(time.time() - t0, 1)
    errors = [r for r in payload["results"] if r["error"]]
    if rank == 0:
        title = (f"EP dispatch/combine — {info['name']} x{world}, {args.dtype}, H={args.hidden}, K={args.topk}, "
                 f"commit {payload['commit'][:12]}" + ("  [CPU interpreter timings: not performance]"
                                                       if device.type == "cpu" else ""))
        print_table(ctx.rows, title, TABLE_COLUMNS)
        log(f"GB/s: {BYTE_RULE}")
        log(f"{len(payload['results']) - len(errors)} stages measured, {len(errors)} failed, "
            f"{len(payload['skipped'])} skipped; {payload['wall_s']} s; status: {status}")
    finish(ctx, status)
    return 0 if status == "complete" and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
