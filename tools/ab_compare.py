"""A/B speed check of two versions of ditron_ep in one process, interleaved, on the launched ranks.

    git archive OLD_COMMIT ditron_ep | tar -x -C /tmp/ab_old      # then:
    torchrun --nproc-per-node 2 tools/ab_compare.py --old-root /tmp/ab_old --old-label OLD_COMMIT \
        [--pairs 5] [--iters 20] [--tokens 128 4096] [--json PATH]

The old tree is imported under another package name (`ditron_ep_ab_old`, a patched copy made by
rank 0), the new one is the `ditron_ep` on sys.path, so both run in the same process on the same
GPU state. Every case is timed as CUDA-graph replays (graph mode: `EPBuffer.dispatch(sync=False)`,
`EPBuffer.combine`, `FusedMoE(sync=False)`), with the benchmarks' rule: barrier and device sync
before every replay, CUDA events around it, the slowest rank's time per replay, the median of
`--iters`. `--pairs` rounds alternate the order (old, new), (new, old), ... Outputs of the two
versions are compared bit for bit on every case (same kernels: any difference is a bug), and every replay with its eager
default-mode call (a replay that refused its work would be fast and wrong).
Cases: dispatch (expert- and token-major) and combine (exact, rank-reduced, and of token rows:
topk_sum="caller") at H=7168, E=256, top-8; the MoE layer (overlap) at H=7168,
I=2048, E=64, top-8; bf16, uniform routing, each at every `--tokens`.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

OLD_NAME = "ditron_ep_ab_old"


def _patched_copy(old_root: Path, dest: Path) -> None:
    """Copy old_root/ditron_ep to dest/OLD_NAME, rewriting its absolute self-imports."""
    target = dest / OLD_NAME
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(old_root / "ditron_ep", target)
    for path in target.rglob("*.py"):
        text = path.read_text()
        new = re.sub(r"\bditron_ep\b(?=[.\s])", OLD_NAME, text)
        if new != text:
            path.write_text(new)


def import_old_ops(old_root: Path, folder: str):
    """`ditron_ep.ops` of the tree at old_root, imported as OLD_NAME.ops (rank 0 writes the patched
    copy under $TMPDIR/folder; every rank waits for it)."""
    copy_dir = Path(os.environ.get("TMPDIR", "/tmp")) / folder
    if dist.get_rank() == 0:
        copy_dir.mkdir(parents=True, exist_ok=True)
        _patched_copy(old_root, copy_dir)
    dist.barrier()
    sys.path.insert(0, str(copy_dir))
    return importlib.import_module(f"{OLD_NAME}.ops")


def _routing(T: int, E: int, K: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    scores = torch.rand(T, E, generator=g)
    w, idx = scores.topk(K, dim=1)
    return idx.to(device), (w / w.sum(1, keepdim=True)).float().to(device)


def _time_graph(graph: torch.cuda.CUDAGraph, iters: int, group) -> float:
    """Median over `iters` replays of the slowest rank's replay time, in µs."""
    times = torch.empty(iters, dtype=torch.float64, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(iters):
        dist.barrier(group)
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times[i] = start.elapsed_time(end) * 1e3
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return statistics.median(times.tolist())


def _capture(fn, warmup: bool = True):
    """CUDA graph of `fn` (after one eager call on a side stream when `warmup`); (graph, output)."""
    if warmup:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


class Cases:
    """One version's objects and captured graphs for every case, with the eager default-mode
    result every replay must reproduce bit for bit (as the benchmarks check graph rows)."""

    def __init__(self, ops, tokens: list[int], data: dict, with_layer: bool = True,
                 programs: int | None = None) -> None:
        self.graphs: dict[str, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.eager: dict[str, torch.Tensor] = {}
        self.objects: list = []
        self.inputs: list = []  # tensors a graph reads that nothing else holds: freed, their memory would be reused
        H, E_ep, E_moe, I, K = 7168, 256, 64, 2048, 8
        w1, w2 = data["w1"], data["w2"]
        for T in tokens:
            x, idx_ep, w_ep, idx_moe, w_moe = data[T]
            buf = ops.EPBuffer(None, num_experts=E_ep, hidden=H, max_tokens_per_rank=T, topk=K,
                               dtype=torch.bfloat16, num_programs=programs)
            self.objects.append(buf)
            recv, handle = buf.dispatch(x, idx_ep, w_ep)  # default mode: raises on any problem
            self.eager[f"dispatch T={T}"] = recv.clone()
            self.eager[f"combine T={T}"] = buf.combine(recv.clone(), handle, w_ep).clone()
            # the rank-reduced combine weighs by the weights the dispatch carried
            self.eager[f"combine reduced T={T}"] = buf.combine(recv.clone(), handle, topk_sum="expert_rank").clone()
            r_g, h_g = buf.dispatch(x, idx_ep, w_ep, sync=False)  # compiles the graph-mode variants
            buf.combine(r_g, h_g, w_ep)
            got = {}

            def dispatch(buf=buf, x=x, idx=idx_ep, w=w_ep, got=got):
                got["x"], got["h"] = buf.dispatch(x, idx, w, sync=False)
                return got["x"]

            self.graphs[f"dispatch T={T}"] = _capture(dispatch)
            tok, h_tok = buf.dispatch(x, idx_ep, w_ep, layout="token_major")
            self.eager[f"dispatch token_major T={T}"] = tok.clone()
            # combine(topk_sum="caller") of the token rows as they arrived (versions before session 31
            # have no such mode: the case is left out of the comparison)
            caller = "caller" in (buf.combine.__doc__ or "")
            if caller:
                self.eager[f"combine caller T={T}"] = buf.combine(tok, h_tok, topk_sum="caller").clone()
                r_tm, h_tm = buf.dispatch(x, idx_ep, w_ep, sync=False, layout="token_major")
                buf.combine(r_tm, h_tm, topk_sum="caller")  # compiles the graph-mode variants
            got_tm = {}

            def dispatch_tm(buf=buf, x=x, idx=idx_ep, w=w_ep, got=got_tm):
                got["x"], got["h"] = buf.dispatch(x, idx, w, sync=False, layout="token_major")
                return got["x"]

            self.graphs[f"dispatch token_major T={T}"] = _capture(dispatch_tm)
            # combine's input: the eager rows in the graph-mode buffer's fixed capacity, so its
            # replays must give the eager combine's result
            y, h_g = torch.zeros_like(got["x"]), got["h"]
            y[:recv.shape[0]] = recv
            self.inputs.append(y)
            # No eager warm-up here: the captured dispatch's handle is filled only by its replays.
            self.graphs[f"combine T={T}"] = _capture(lambda buf=buf, y=y, h=h_g, w=w_ep: buf.combine(y, h, w),
                                                    warmup=False)
            self.graphs[f"combine reduced T={T}"] = _capture(
                lambda buf=buf, y=y, h=h_g: buf.combine(y, h, topk_sum="expert_rank"), warmup=False)
            # along the token-major graph's handle: valid once that graph has replayed (replay_problems
            # and the timing loop replay the graphs in this order)
            if caller:
                self.graphs[f"combine caller T={T}"] = _capture(
                    lambda buf=buf, y=got_tm["x"], h=got_tm["h"]: buf.combine(y, h, topk_sum="caller"),
                    warmup=False)
            if not with_layer:
                continue
            layer = ops.FusedMoE(None, E_moe, H, I, T, K, torch.bfloat16)
            self.eager[f"moe T={T}"] = layer(x, idx_moe, w_moe, w1, w2).clone()
            self.graphs[f"moe T={T}"] = _capture(
                lambda layer=layer, x=x, idx=idx_moe, w=w_moe: layer(x, idx, w, w1, w2, sync=False))
            self.objects.append(layer)

    def replay_problems(self) -> list[str]:
        """Replay every graph once: its output must equal the eager call's; then no error recorded."""
        problems = []
        for name, (graph, out) in self.graphs.items():
            graph.replay()
            torch.cuda.synchronize()
            want = self.eager[name]
            if name.startswith("dispatch"):
                out = out[:want.shape[0]]
            if out.shape != want.shape or not torch.equal(out, want):
                problems.append(f"{name}: replay differs from the eager call")
        for obj in self.objects:
            try:
                obj.check()
            except Exception as exc:  # a recorded timeout or input problem
                problems.append(f"{type(obj).__name__}: {type(exc).__name__}: {exc}")
        return problems


def _on_every_rank(problems: list[str], world: int) -> list[str]:
    """Every rank's problems, each named with its rank, sorted (the same list on every rank)."""
    every_rank: list = [None] * world
    dist.all_gather_object(every_rank, problems)
    return sorted({f"{p} (rank {r})" for r, ps in enumerate(every_rank) for p in ps})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old-root", type=Path, required=True, help="folder holding the old ditron_ep/")
    parser.add_argument("--old-label", default="old")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--programs", type=int, default=None, help="the EP buffers' num_programs (default: all SMs)")
    parser.add_argument("--new-first", action="store_true", help="build the new version's cases first")
    parser.add_argument("--cases", choices=("all", "ep", "moe"), default="all",
                        help="ep: dispatch and combine only; moe: the layer only")
    args = parser.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    old_ops = import_old_ops(args.old_root, "ab_compare")
    new_ops = importlib.import_module("ditron_ep.ops")

    H, I, K = 7168, 2048, 8
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    data: dict = {"w1": (torch.randn(64 // world, H, 2 * I, generator=g, device="cuda") / H ** 0.5).to(torch.bfloat16),
                  "w2": (torch.randn(64 // world, I, H, generator=g, device="cuda") / I ** 0.5).to(torch.bfloat16)}
    for T in args.tokens:
        x = torch.randn(T, H, generator=g, device="cuda").to(torch.bfloat16)
        data[T] = (x, *_routing(T, 256, K, 10 * T + rank, x.device), *_routing(T, 64, K, 20 * T + rank, x.device))

    t0 = time.time()
    layer = args.cases != "ep"
    built = {}  # the version built first runs the process's first compiles and calls
    for label in ((args.old_label, "new") if not args.new_first else ("new", args.old_label)):
        built[label] = Cases(new_ops if label == "new" else old_ops, args.tokens, data, layer, args.programs)
    versions = {args.old_label: built[args.old_label], "new": built["new"]}
    if args.cases == "moe":
        for c in versions.values():
            c.graphs = {k: v for k, v in c.graphs.items() if k.startswith("moe")}
    names = [n for n in versions["new"].graphs if n in versions[args.old_label].graphs]  # cases both versions have
    mismatches = [f"{v}: {p}" for v, c in versions.items() for p in c.replay_problems()]
    for name in names:  # the two versions run the same kernels: same bits
        a, b = (c.eager[name] for c in versions.values())
        if a.shape != b.shape or not torch.equal(a, b):
            mismatches.append(f"{name}: old and new differ")
    mismatches = _on_every_rank(mismatches, world)
    medians: dict[str, dict[str, list[float]]] = {n: {v: [] for v in versions} for n in names}
    order = list(versions)
    for p in range(args.pairs):
        for v in (order if p % 2 == 0 else order[::-1]):
            for name in names:
                medians[name][v].append(_time_graph(versions[v].graphs[name][0], args.iters, None))
    wall = time.time() - t0
    mismatches += _on_every_rank([f"{v}: {p} (after timing)" for v, c in versions.items() for p in c.replay_problems()],
                                 world)
    if rank == 0:
        head = f"{'case':<24} {args.old_label + ' µs (min..max of pair medians)':>34} {'new µs':>28} {'new/old':>8}"
        print(f"A/B graph-mode medians, {world} ranks, {torch.cuda.get_device_name()}, {args.pairs} interleaved pairs "
              f"of {args.iters} replays; {wall:.0f} s")
        print(head)
        rows = []
        for name in names:
            a, b = medians[name][args.old_label], medians[name]["new"]
            ratio = statistics.median(b) / statistics.median(a)
            print(f"{name:<24} {statistics.median(a):>12.1f} ({min(a):.1f}..{max(a):.1f}){'':>4}"
                  f" {statistics.median(b):>10.1f} ({min(b):.1f}..{max(b):.1f}) {ratio:>8.3f}")
            rows.append({"case": name, "old_us": a, "new_us": b, "new_over_old": ratio})
        print("replays equal eager calls, no error recorded, old == new bit for bit:",
              "yes" if not mismatches else f"NO: {mismatches}")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({
                "device": torch.cuda.get_device_name(), "world_size": world, "old": args.old_label,
                "pairs": args.pairs, "iters": args.iters, "date": time.strftime("%Y-%m-%d"),
                "torch": torch.__version__, "rows": rows, "bitwise_mismatches": mismatches}, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
