"""Diagnostic (one GPU, not a benchmark): does the GEMM tile order change the grouped SwiGLU
FFN's speed? The library's standalone kernels (`launch_grouped_swiglu` / `launch_grouped_down`)
with tiles walked in groups of G M-tiles (`grouped_tile`; G=1 is M-tile major, the order before
session 9), on the persistent grid, at the MoE layer's per-rank shapes:

    python bench/diag/tile_order.py [--groups 1 2 4 8 16]

  4 ranks: 16 local experts x ~2050 rows (T=4096, top-8 of E=64, uniform);
  2 ranks: 32 local experts x ~1025 rows.
H=7168, I=2048, bf16, rows gathered by index. Every order's output is checked bitwise against
G=1's. Timing: median (p20, p80) of 20 calls after 3 (ditron_ep.bench.timing's rule).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402

from ditron_ep.bench.timing import summarize, time_fn  # noqa: E402
from ditron_ep.compiler.core_config import default_gemm_configs  # noqa: E402
from ditron_ep.ops.moe_layer.grouped_ffn import launch_grouped_down, launch_grouped_swiglu  # noqa: E402
from ditron_ep.ops.moe_layer.grouped_gemm_kernels import build_tile_map  # noqa: E402

H, I, T, K = 7168, 2048, 4096, 8


def rank_case(dev, ranks: int, e_local: int, seed: int = 7):
    """One rank's expert rows of the layer: (x [ranks*T, H], row_index [rows], offsets [e_local+1],
    w1, w2); each of the ranks*T tokens picks K of e_local*ranks experts uniformly, this rank
    keeps the (token, k) of its e_local experts, expert-major then by token."""
    g = torch.Generator().manual_seed(seed)
    n_tok, n_exp = ranks * T, e_local * ranks
    topk = torch.rand(n_tok, n_exp, generator=g).topk(K, dim=1).indices
    token, slot = torch.nonzero(topk < e_local, as_tuple=True)
    order = torch.argsort(topk[token, slot] * n_tok + token)
    row_index = token[order].to(torch.int32).to(dev)
    sizes = torch.bincount(topk[topk < e_local], minlength=e_local)
    offsets = torch.zeros(e_local + 1, dtype=torch.int32)
    offsets[1:] = sizes.cumsum(0)
    gd = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(n_tok, H, generator=gd, device=dev).to(torch.bfloat16)
    w1 = (torch.randn(e_local, H, 2 * I, generator=gd, device=dev) * H ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(e_local, I, H, generator=gd, device=dev) * I ** -0.5).to(torch.bfloat16)
    return x, row_index, offsets.to(dev), w1, w2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gu_cfg, dn_cfg = default_gemm_configs(torch.bfloat16, "cuda")
    print(f"# {torch.cuda.get_device_name(dev)}, {sms} SMs, triton {triton.__version__}, torch {torch.__version__}; "
          f"H={H} I={I} bf16; gate-up {gu_cfg}, down {dn_cfg}, {sms} programs", flush=True)
    for ranks, e_local in ((4, 16), (2, 32)):
        x, idx, off, w1, w2 = rank_case(dev, ranks, e_local)
        rows = int(off[-1])
        tiles = build_tile_map(off, gu_cfg.block_m)
        h = torch.empty(rows, I, dtype=torch.bfloat16, device=dev)
        y = torch.empty(rows, H, dtype=torch.bfloat16, device=dev)
        print(f"## {ranks}-rank shape: {e_local} experts, {rows} rows, {int(tiles[-1])} M-tiles", flush=True)
        base = None
        for g in args.groups:
            def gate_up():
                launch_grouped_swiglu(x, idx, w1, h, off, tiles, gu_cfg, sms, "tf32", g)

            def down():
                launch_grouped_down(h, w2, y, off, tiles, dn_cfg, sms, "tf32", g)

            s_gu = summarize(time_fn(gate_up, 20, 3, device="cuda"))
            s_dn = summarize(time_fn(down, 20, 3, device="cuda"))
            gate_up()
            down()
            torch.cuda.synchronize()
            if base is None:
                base = (h.clone(), y.clone())
            same = torch.equal(h, base[0]) and torch.equal(y, base[1])
            fl_gu, fl_dn = 4.0 * rows * H * I, 2.0 * rows * I * H
            print(f"G={g:3d}  gate-up {s_gu['median']:7.1f} us (p20 {s_gu['p20']:.0f}, p80 {s_gu['p80']:.0f}) "
                  f"{fl_gu / s_gu['median'] / 1e6:5.1f} TF/s   down {s_dn['median']:7.1f} us (p20 {s_dn['p20']:.0f}, "
                  f"p80 {s_dn['p80']:.0f}) {fl_dn / s_dn['median'] / 1e6:5.1f} TF/s   bitwise == G={args.groups[0]}: "
                  f"{same}", flush=True)


if __name__ == "__main__":
    main()
