"""Benchmark the grouped SwiGLU expert FFN (`grouped_swiglu_ffn`) against torch._grouped_mm, one GPU.

    python bench/grouped_gemm.py [--shapes uniform layer ragged decode] [--iters 20] [--warmup 5]
        [--no-sweep] [--time-budget 480] [--json [PATH]]
    python bench/grouped_gemm.py --smoke [--json PATH]    # tiny shapes; on the CPU under the interpreter

Shapes (bf16, H=7168, I=2048, E_local=16, 32768 rows in all):
  uniform  16 experts x 2048 rows, rows contiguous;
  layer    the MoE layer's rank 0: T=4096 tokens on each of 4 ranks, top-8 uniform routing over
           E=64 experts (16 per rank): ~2048 rows per expert, each row gathered in the kernel
           through row_index from the 16384 tokens (torch's baseline gets the rows pre-gathered);
  ragged   zipf-like expert sizes (1/(rank+1)^1.1), two experts empty;
  decode   the layer shape at T=128 tokens per rank (~1024 rows, ~64 per expert): the weights'
           bytes, not the FLOPs, bound it (not run by default).
Stages: gate-up = x_r @ W1[e] (+ SwiGLU: fused in ours, silu(g)*u elementwise in torch's),
down = h @ W2[e], ffn = both (ours: `grouped_swiglu_ffn`; torch: two _grouped_mm + silu*mul).
The sweep times every gate-up and down tile config (GATE_UP_CONFIGS / DOWN_CONFIGS) with a
persistent grid (one program per SM) and a one-tile-per-program grid; ffn then runs the best
of each. torch._grouped_mm runs with W [E, K, N] row-major and column-major; the faster is the
baseline. FLOPs = 2·rows·H·2I (gate-up) + 2·rows·I·H (down), rows = routed rows.
Timing (ditron_ep/bench/timing.py): device sync before every iteration, CUDA events around it, median
(p20, p80). Every measurement that fails is recorded and the run goes on; with --json the file
is rewritten after every shape.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: `bench.common`, `ditron_ep`

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ditron_ep  # noqa: E402,F401  (decides compiled vs interpreted kernels before any triton.jit)
from bench.common import add_run_options, json_path_of, log, payload_header, print_table, write_json  # noqa: E402
from ditron_ep.bench.environment import device_info  # noqa: E402
from ditron_ep.bench.timing import summarize, time_fn  # noqa: E402
from ditron_ep.check import make_routing  # noqa: E402
from ditron_ep.compiler.core_config import GemmTileConfig, default_gemm_configs  # noqa: E402
from ditron_ep.ops.moe_layer.grouped_ffn import grouped_swiglu_ffn, launch_grouped_down, launch_grouped_swiglu  # noqa: E402
from ditron_ep.ops.moe_layer.grouped_gemm_kernels import build_tile_map  # noqa: E402
from ditron_ep.runtime import kernels_interpreted  # noqa: E402

BENCH = "grouped_gemm"
FLOP_RULE = ("FLOPs = 2*rows*H*2I (gate-up) + 2*rows*I*H (down), rows = routed rows; TFLOP/s = FLOPs / median "
             "time. The SwiGLU elementwise op is not counted (fused in ours, separate kernels in torch's).")
TARGET_NOTE = ("target: ours >= 85% of torch._grouped_mm's ffn throughput. DESIGN.md (H200, 16x2048 rows): "
               "torch._grouped_mm 677 (7168->4096) / 662 (2048->7168) TFLOP/s; a stock-Triton BM128 BN256 BK64 "
               "8-warp 4-stage tile 649 / 594.")
C = GemmTileConfig
GATE_UP_CONFIGS = [C(128, 128, 64, 8, 4), C(128, 128, 64, 8, 3), C(128, 64, 64, 4, 4), C(256, 64, 64, 8, 3)]
DOWN_CONFIGS = [C(128, 256, 64, 8, 4), C(128, 256, 64, 8, 3), C(128, 128, 64, 4, 4), C(256, 128, 64, 8, 3)]
# Small row tiles for the decode shape (~64 rows per expert): more weight bytes in flight per row.
DECODE_GATE_UP_CONFIGS = [C(64, 128, 64, 4, 4), C(64, 64, 128, 4, 4), C(64, 128, 128, 4, 3), C(64, 64, 64, 4, 6)]
DECODE_DOWN_CONFIGS = [C(64, 256, 64, 8, 4), C(64, 128, 128, 4, 4), C(64, 128, 64, 4, 6), C(64, 64, 128, 4, 4)]
SMOKE_CONFIGS = ([C(16, 16, 32, 4, 1), C(32, 16, 16, 4, 1)], [C(16, 32, 16, 4, 1), C(32, 64, 32, 4, 1)])
ONE_TILE = 2**31 - 1  # num_programs that gives every tile its own program (the launcher clamps the grid)
COLUMNS = ["shape", "stage", "impl", "programs", "median µs", "p20", "p80", "TFLOP/s", "vs torch", "check"]


# ============================================================================ shapes
def expert_sizes(kind: str, experts: int, rows: int, gen: torch.Generator) -> list[int]:
    if kind == "uniform":
        return [rows // experts] * experts
    weights = torch.tensor([1.0 / (r + 1) ** 1.1 for r in range(experts - 2)] + [0.0, 0.0])
    weights = weights[torch.randperm(experts, generator=gen)]  # empty experts land anywhere
    sizes = (weights / weights.sum() * rows).floor().long()
    sizes[int(weights.argmax())] += rows - int(sizes.sum())
    return sizes.tolist()


def build_case(name: str, smoke: bool, dtype: torch.dtype, device: torch.device, seed: int) -> dict[str, Any]:
    """Inputs of one shape: x, expert_offsets, w1, w2, row_index (layer only), and the sizes."""
    gen = torch.Generator().manual_seed(seed)
    E, H, I, ranks, T, K = (3, 48, 24, 4, 16, 2) if smoke else (16, 7168, 2048, 4, 4096, 8)
    rows = 40 if smoke else 32768
    if name == "decode":
        T = 8 if smoke else 128
    row_index = None
    if name in ("layer", "decode"):  # rank 0's experts of a top-K routing of ranks*T tokens over E*ranks experts
        topk_idx, _ = make_routing(ranks * T, E * ranks, K, "uniform", generator=gen)
        token, slot = torch.nonzero(topk_idx < E, as_tuple=True)
        order = torch.argsort(topk_idx[token, slot] * (ranks * T) + token)  # expert-major, then token
        row_index = token[order].to(torch.int32)
        sizes = torch.bincount(topk_idx[topk_idx < E], minlength=E).tolist()
        n_x = ranks * T
    else:
        sizes, n_x = expert_sizes(name, E, rows, gen), rows
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    # Drawn on the device (GiBs of weights); scaled so that h and y are O(1).
    dev_gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=dev_gen, device=device) * scale).to(dtype)

    return {"x": randn(n_x, H), "w1": randn(E, H, 2 * I, scale=H**-0.5), "w2": randn(E, I, H, scale=I**-0.5),
            "expert_offsets": offsets.to(device), "row_index": None if row_index is None else row_index.to(device),
            "sizes": sizes, "H": H, "I": I}


# ============================================================================ torch baseline
def torch_layouts(case: dict[str, Any]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """W1, W2 as [E, K, N] row-major and as column-major views of [E, N, K] storage."""
    w1, w2 = case["w1"], case["w2"]
    return {"torch W row-major": (w1, w2),
            "torch W col-major": (w1.transpose(1, 2).contiguous().transpose(1, 2),
                                  w2.transpose(1, 2).contiguous().transpose(1, 2))}


def torch_gate_up(x_rows: torch.Tensor, w1: torch.Tensor, offs: torch.Tensor, inter: int) -> torch.Tensor:
    g = torch._grouped_mm(x_rows, w1, offs=offs, out_dtype=x_rows.dtype)  # [rows, 2I]
    return F.silu(g[:, :inter]) * g[:, inter:]


def torch_down(h: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(h, w2, offs=offs, out_dtype=h.dtype)


# ============================================================================ measuring
class Runner:
    def __init__(self, args: argparse.Namespace, device: torch.device, payload: dict[str, Any]):
        self.args, self.device, self.payload = args, device, payload
        self.table: list[dict[str, Any]] = []

    def measure(self, shape: str, stage: str, impl: str, programs: str, flops: float, fn: Callable[[], object],
                torch_us: float | None = None, check: str = "") -> float | None:
        """Time fn; record a result row (also on failure); return the median µs or None."""
        row: dict[str, Any] = {"shape": shape, "stage": stage, "impl": impl, "programs": programs,
                               "flops": flops, "error": None}
        try:
            stats = summarize(time_fn(fn, self.args.iters, self.args.warmup, device=self.device))
        except Exception as exc:  # noqa: BLE001 - one failing config must not end a one-shot GPU run
            row["error"] = f"{type(exc).__name__}: {exc}"
            log(f"  {shape} {stage} {impl} [{programs}] FAILED: {row['error'][:300]}")
            self.payload["results"].append(row)
            self.table.append({**row, "check": "FAILED"})
            return None
        tflops = flops / (stats["median"] * 1e-6) / 1e12
        row.update(median_us=stats["median"], p20_us=stats["p20"], p80_us=stats["p80"], tflops=tflops,
                   ratio_vs_torch=None if torch_us is None else torch_us / stats["median"], check=check)
        self.payload["results"].append(row)
        self.table.append({**row, "median µs": stats["median"], "p20": stats["p20"], "p80": stats["p80"],
                           "TFLOP/s": tflops, "vs torch": row["ratio_vs_torch"]})
        return stats["median"]


def run_shape(r: Runner, name: str, dtype: torch.dtype, sweep: bool) -> dict[str, Any]:
    args, device = r.args, r.device
    case = build_case(name, args.smoke, dtype, device, args.seed)
    x, w1, w2, off, idx, H, I = (case[k] for k in ("x", "w1", "w2", "expert_offsets", "row_index", "H", "I"))
    rows = idx.shape[0] if idx is not None else x.shape[0]
    routed = sum(case["sizes"])
    flops_gu, flops_dn = 2.0 * routed * H * 2 * I, 2.0 * routed * I * H
    log(f"{name}: E_local={len(case['sizes'])} rows={routed} (min {min(case['sizes'])}, max {max(case['sizes'])} "
        f"per expert) H={H} I={I} {'gathered' if idx is not None else 'contiguous'} rows")
    interp = kernels_interpreted()
    precision = "ieee" if interp else "tf32"
    offs = off[1:]  # torch._grouped_mm: cumulative row ends
    x_rows = x[idx.long()] if idx is not None else x

    # ---- torch baseline, both weight layouts; the faster is the reference
    torch_us: dict[str, float] = {}
    torch_y = None
    for impl, (tw1, tw2) in torch_layouts(case).items():
        h_t = torch_gate_up(x_rows, tw1, offs, I)
        gu = r.measure(name, "gate-up", impl, "-", flops_gu, lambda: torch_gate_up(x_rows, tw1, offs, I))
        dn = r.measure(name, "down", impl, "-", flops_dn, lambda h=h_t: torch_down(h, tw2, offs))
        ffn = r.measure(name, "ffn", impl, "-", flops_gu + flops_dn,
                        lambda: torch_down(torch_gate_up(x_rows, tw1, offs, I), tw2, offs))
        for stage, us in (("gate-up", gu), ("down", dn), ("ffn", ffn)):
            if us is not None and us < torch_us.get(stage, float("inf")):
                torch_us[stage] = us
        if torch_y is None:
            torch_y = torch_down(h_t, tw2, offs)
        del h_t

    # ---- ours: sweep each GEMM's tile config and grid
    default_gu, default_dn = default_gemm_configs(dtype, "cpu" if interp else ("hip" if torch.version.hip else "cuda"))
    sms = 1 if device.type == "cpu" else torch.cuda.get_device_properties(device).multi_processor_count
    grids = {"one-tile": ONE_TILE, f"persistent {sms}": sms} if not interp else {"1": 1, "3": 3}
    gu_cfgs, dn_cfgs = SMOKE_CONFIGS if args.smoke else (GATE_UP_CONFIGS, DOWN_CONFIGS)
    if name == "decode" and not args.smoke:
        gu_cfgs, dn_cfgs = gu_cfgs + DECODE_GATE_UP_CONFIGS, dn_cfgs + DECODE_DOWN_CONFIGS
    if not sweep:
        gu_cfgs, dn_cfgs, grids = [default_gu], [default_dn], {f"persistent {sms}": sms}
    h = torch.empty(rows, I, dtype=dtype, device=device)
    y = torch.empty(rows, H, dtype=dtype, device=device)
    best: dict[str, tuple[float, GemmTileConfig, int, str]] = {}
    for stage, cfgs, flops in (("gate-up", gu_cfgs, flops_gu), ("down", dn_cfgs, flops_dn)):
        for cfg in cfgs:
            tiles = build_tile_map(off, cfg.block_m)
            for grid_name, programs in grids.items():
                if stage == "gate-up":
                    fn = lambda: launch_grouped_swiglu(x, idx, w1, h, off, tiles, cfg, programs, precision, 1)  # noqa: E731
                else:
                    fn = lambda: launch_grouped_down(h, w2, y, off, tiles, cfg, programs, precision, 1)  # noqa: E731
                label = f"ours {cfg}" + (" (default)" if cfg in (default_gu, default_dn) else "")
                us = r.measure(name, stage, label, grid_name, flops, fn, torch_us.get(stage))
                if us is not None and us < best.get(stage, (float("inf"),))[0]:
                    best[stage] = (us, cfg, programs, grid_name)
    result: dict[str, Any] = {"shape": name, "torch_us": torch_us,
                              "best": {k: {"us": v[0], "config": str(v[1]), "num_programs": v[2], "grid": v[3]}
                                       for k, v in best.items()}}
    if "gate-up" not in best or "down" not in best:
        return result
    # ---- ours, the whole FFN with the best configs (one grid size for both launches: the best down's)
    cfg_pair = (best["gate-up"][1], best["down"][1])
    programs, grid_name = best["down"][2:]
    ours_y = grouped_swiglu_ffn(x, off, w1, w2, row_index=idx, config=cfg_pair, num_programs=programs,
                                input_precision=precision, check=False)
    check = ""
    if torch_y is not None:
        ref = torch_y[:routed].float()
        rel = float((ours_y[:routed].float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        check = f"max rel err {rel:.1e} vs torch"
        result["max_rel_err_vs_torch"] = rel
    r.measure(name, "ffn", f"ours {cfg_pair[0]} + {cfg_pair[1]}", grid_name, flops_gu + flops_dn,
              lambda: grouped_swiglu_ffn(x, off, w1, w2, row_index=idx, config=cfg_pair, num_programs=programs,
                                         input_precision=precision, check=False),
              torch_us.get("ffn"), check)
    return result


# ============================================================================ main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["uniform", "layer", "ragged"],
                   choices=["uniform", "layer", "ragged", "decode"])
    p.add_argument("--no-sweep", action="store_true", help="time only the default configs, persistent grid")
    add_run_options(p, bench="grouped_gemm", iters=20, warmup=5, time_budget=480.0, skipped="shapes",
                    smoke_help="tiny shapes (E_local=3, 40 rows, H=48, I=24), 3 iterations; float32 under the interpreter")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.iters, args.warmup = 3, 1
    t0 = time.time()
    interp = kernels_interpreted()
    if not interp and not torch.cuda.is_available():
        raise SystemExit("compiled kernels need a GPU; run with --smoke on the CPU")
    device = torch.device("cpu") if interp else torch.device("cuda", torch.cuda.current_device())
    dtype = torch.float32 if interp else torch.bfloat16  # the interpreter computes bf16 tl.dot wrongly
    info = device_info(device)
    timer = "cuda_events" if device.type == "cuda" else "cpu_perf_counter (Triton interpreter: NOT GPU performance)"
    json_path = json_path_of(args, BENCH, info["name"])
    payload = payload_header(BENCH, info, args, timer, interp, dtype=str(dtype), flop_rule=FLOP_RULE,
                             target=TARGET_NOTE, results=[], shapes=[], skipped=[])
    log(f"ditron_ep {BENCH} on {info['name']} ({device.type}), torch {info['torch']}, triton {info['triton']}, "
        f"commit {payload['commit'][:12]}{' (dirty)' if payload['commit_dirty'] else ''}, {dtype}")
    log(f"timer: {timer}; median (p20, p80) of {args.iters} iterations after {args.warmup} warm-up")
    log(FLOP_RULE)
    log(TARGET_NOTE)
    runner = Runner(args, device, payload)
    status = "complete"
    for name in args.shapes:
        if time.time() - t0 > args.time_budget:
            payload["skipped"].append(name)
            log(f"{name}: skipped, time budget of {args.time_budget:.0f} s spent")
            continue
        try:
            payload["shapes"].append(run_shape(runner, name, dtype, not args.no_sweep))
        except Exception as exc:  # noqa: BLE001 - record and go on with the next shape
            payload["shapes"].append({"shape": name, "error": traceback.format_exc()})
            log(f"{name}: FAILED: {exc!r}")
            status = "complete with errors"
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if json_path is not None:
            write_json(json_path, payload)
    payload["status"] = status
    payload["wall_s"] = round(time.time() - t0, 1)
    print_table(runner.table, f"grouped SwiGLU FFN vs torch._grouped_mm — {info['name']}, {dtype}, commit "
                f"{payload['commit'][:12]}" + ("  [CPU interpreter timings: not performance]" if interp else ""),
                COLUMNS)
    for s in payload["shapes"]:
        if "best" in s:
            log(f"best {s['shape']}: " + "; ".join(f"{k} {v['config']} grid {v['grid']} "
                                                    f"{v['us']:.1f} µs" for k, v in s["best"].items()))
    failed = [row for row in payload["results"] if row["error"]]
    log(f"{len(payload['results']) - len(failed)} measurements, {len(failed)} failed; {payload['wall_s']} s; "
        f"status: {status}")
    if json_path is not None:
        write_json(json_path, payload)
        log(f"wrote {json_path}")
    return 0 if status == "complete" and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
