"""Host time of eager `EPBuffer.dispatch` / `combine` (issue 26), step by step, optionally old vs new.

    torchrun --nproc-per-node 2 tools/host_profile.py [--old-root /tmp/ab_old --old-label OLD]
        [--tokens 128 4096 | --varying T T ...] [--iters 30] [--rounds 2] [--cprofile] [--json PATH]

Eager calls at small T are bound by host time, which CUDA-event timings of the kernels do not show.
Every call here starts after a barrier and a device sync; the buffer's steps (`STEPS`, wrapped
methods) are stamped with the host clock from the call's start. Printed per (version, T, op), the
median over `--iters` calls on each rank: each step's start-end in µs, `ret` (the call returned)
and `idle` (the device was done after it). With `--old-root` (a folder holding an old
`ditron_ep/`, e.g. `git archive OLD ditron_ep | tar -x -C /tmp/ab_old`) both versions run in one
process, as in tools/ab_compare.py, in `--rounds` alternating rounds. `--cprofile`: rank 0 also
prints a cProfile of 200 dispatch + combine pairs of the new version (by own time).
Cases: E=256, H=7168, top-8, bf16, uniform routing; dispatch in both layouts; combine exact and rank-reduced.
`--varying T ...`: serving's changing token counts instead: one buffer sized for the largest T,
each call's T the next in turn (`_profile_varying`); printed per version and round, slowest rank.
"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.ab_compare import _routing, import_old_ops  # noqa: E402

STEPS = ("_check_routing", "_layout", "_status_ahead", "_rows_and_tokens", "_launch_dispatch", "_launch_combine",
         "_finish")
E, H, K = 256, 7168, 8


def _stamped(buf, marks: list) -> None:
    """Wrap the buffer's steps (instance attributes) so each call appends (name, start, end)."""
    for name in STEPS:
        f = getattr(buf, name, None)
        if f is None:  # an older version without this step
            continue

        def g(*a, _f=f, _n=name, **kw):
            t0 = time.perf_counter()
            r = _f(*a, **kw)
            marks.append((_n, t0, time.perf_counter()))
            return r
        setattr(buf, name, g)


def _profile_version(ops, T: int, iters: int, x, idx, w) -> dict[str, dict]:
    """{op: {"steps": {name: [start, end]}, "ret": µs, "idle": µs}} medians on this rank."""
    buf = ops.EPBuffer(None, num_experts=E, hidden=H, max_tokens_per_rank=T, topk=K, dtype=torch.bfloat16)
    marks: list = []
    calls = {
        "dispatch": lambda st: st.update(zip(("rx", "h"), buf.dispatch(x, idx, w))),
        "combine": lambda st: buf.combine(st["rx"], st["h"], w),
        "combine reduced": lambda st: buf.combine(st["rx"], st["h"], topk_sum="expert_rank"),
        "dispatch token_major": lambda st: buf.dispatch(x, idx, w, layout="token_major"),
    }
    state: dict = {}
    for _ in range(6):  # compiles, layout graph capture (a signature's second call)
        for fn in calls.values():
            fn(state)
    _stamped(buf, marks)
    rows: dict[str, list] = {op: [] for op in calls}
    for _ in range(iters):
        for op, fn in calls.items():
            dist.barrier()
            torch.cuda.synchronize()
            marks.clear()
            t0 = time.perf_counter()
            fn(state)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            rows[op].append(([(n, (a - t0) * 1e6, (b - t0) * 1e6) for n, a, b in marks], (t1 - t0) * 1e6,
                             (t2 - t0) * 1e6))
    out = {}
    for op, rs in rows.items():
        names = [n for n, _, _ in rs[0][0]]
        same = [r for r in rs if [n for n, _, _ in r[0]] == names]
        out[op] = {"steps": {f"{i}:{n}": [statistics.median(r[0][i][1] for r in same),
                                          statistics.median(r[0][i][2] for r in same)] for i, n in enumerate(names)},
                   "ret": statistics.median(r[1] for r in rs), "idle": statistics.median(r[2] for r in rs)}
    state.clear()
    buf.free()
    return out


def _profile_varying(ops, tokens: list[int], iters: int, rank: int) -> dict[str, float]:
    """Serving's changing token counts: one buffer sized for max(tokens), each call's T the next
    of `tokens` in turn (fresh routing per T), dispatch (both layouts) + exact combine; median µs
    (this rank) of the host's return and of the device being done, per op, after 2 warm-up rounds."""
    buf = ops.EPBuffer(None, num_experts=E, hidden=H, max_tokens_per_rank=max(tokens), topk=K, dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(99 + rank)
    inputs = [(torch.randn(T, H, generator=g, device="cuda").to(torch.bfloat16),
               *_routing(T, E, K, 17 * T + rank, torch.device("cuda"))) for T in tokens]
    rows: dict[str, list] = {"dispatch": [], "combine": [], "dispatch token_major": []}
    for it in range(iters + 2):
        for x, idx, w in inputs:
            for op in rows:
                dist.barrier()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if op == "dispatch":
                    rx, h = buf.dispatch(x, idx, w)
                elif op == "combine":
                    buf.combine(rx, h, w)
                else:
                    buf.dispatch(x, idx, w, layout="token_major")
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                if it >= 2:
                    rows[op].append(((t1 - t0) * 1e6, (time.perf_counter() - t0) * 1e6))
    del rx, h
    buf.free()
    return {f"{op} {what}": statistics.median(r[i] for r in rs) for op, rs in rows.items()
            for i, what in enumerate(("ret", "idle"))}


def _cprofile(ops, T: int, x, idx, w) -> str:
    buf = ops.EPBuffer(None, num_experts=E, hidden=H, max_tokens_per_rank=T, topk=K, dtype=torch.bfloat16)
    for _ in range(6):
        rx, h = buf.dispatch(x, idx, w)
        buf.combine(rx, h, w)
    torch.cuda.synchronize()
    prof = cProfile.Profile() if dist.get_rank() == 0 else None
    if prof:
        prof.enable()
    for _ in range(200):
        rx, h = buf.dispatch(x, idx, w)
        buf.combine(rx, h, w)
    torch.cuda.synchronize()
    text = ""
    if prof:
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
        text = s.getvalue()
    del rx, h
    buf.free()
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old-root", type=Path, default=None)
    ap.add_argument("--old-label", default="old")
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--varying", type=int, nargs="+", default=None, metavar="T",
                    help="instead of --tokens: calls whose T cycles through these on one buffer (serving)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    versions = {"new": importlib.import_module("ditron_ep.ops")}
    if args.old_root is not None:
        versions = {args.old_label: import_old_ops(args.old_root, "host_profile"), **versions}
    g = torch.Generator(device="cuda").manual_seed(4321 + rank)
    results: list[dict] = []
    if args.varying:
        for r in range(args.rounds):
            for label in (list(versions) if r % 2 == 0 else list(versions)[::-1]):
                got = _profile_varying(versions[label], args.varying, args.iters, rank)
                every: list = [None] * world
                dist.all_gather_object(every, got)
                results.append({"version": label, "round": r, "varying": args.varying, "per_rank": every})
                if rank == 0:
                    print(f"{label:>10} r{r} T cycling {args.varying}: " + " | ".join(
                        f"{k} {max(e[k] for e in every):.0f}" for k in got), flush=True)
        args.tokens = []
    for T in args.tokens:
        x = torch.randn(T, H, generator=g, device="cuda").to(torch.bfloat16)
        idx, w = _routing(T, E, K, 30 * T + rank, x.device)
        for r in range(args.rounds):
            for label in (list(versions) if r % 2 == 0 else list(versions)[::-1]):
                got = _profile_version(versions[label], T, args.iters, x, idx, w)
                every: list = [None] * world
                dist.all_gather_object(every, got)
                for op in got:
                    results.append({"version": label, "round": r, "T": T, "op": op,
                                    "per_rank": [e[op] for e in every]})
                    if rank == 0:
                        for rk, e in enumerate(every):
                            steps = " | ".join(f"{n.split(':', 1)[1]} {a:.0f}-{b:.0f}" for n, (a, b) in e[op]["steps"].items())
                            print(f"{label:>10} r{r} rank{rk} T={T:<5} {op:<16} {steps} | ret {e[op]['ret']:.0f} "
                                  f"idle {e[op]['idle']:.0f}", flush=True)
        if args.cprofile:
            text = _cprofile(versions["new"], T, x, idx, w)
            if rank == 0:
                print(f"==== new, T={T}: cProfile of 200 eager dispatch + combine pairs (rank 0)\n{text}", flush=True)
    if rank == 0:
        print(f"{'version':>10} {'T':>5} {'op':<16} {'ret µs (slowest rank, median of rounds)':>40}")
        summary = [{"version": row["version"], "round": row["round"], "varying": row["varying"],
                    **{k: max(e[k] for e in row["per_rank"]) for k in row["per_rank"][0]}}
                   for row in results if "varying" in row]
        for label in versions:
            for T in args.tokens:
                for op in ("dispatch", "combine", "combine reduced"):
                    rets = [max(p["ret"] for p in row["per_rank"]) for row in results
                            if row["version"] == label and row["T"] == T and row["op"] == op]
                    summary.append({"version": label, "T": T, "op": op, "ret_us": statistics.median(rets)})
                    print(f"{label:>10} {T:>5} {op:<16} {statistics.median(rets):>40.0f}")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({
                "device": torch.cuda.get_device_name(), "world_size": world, "date": time.strftime("%Y-%m-%d"),
                "commit": os.environ.get("DITRON_COMMIT"), "torch": torch.__version__, "summary": summary,
                "rows": results}, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
