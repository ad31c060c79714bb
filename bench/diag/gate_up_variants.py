"""Diagnostic (one GPU, not a benchmark): which gate-up tile program closes the gap to
torch._grouped_mm on the MoE layer's rank-0 rows?

    python bench/diag/gate_up_variants.py        # one line per (variant, config, grid)

Shape: the `layer` shape of bench/grouped_gemm.py (T=4096 on each of 4 ranks, top-8 uniform over
E=64, rank 0's 16 experts: ~2060 rows each, gathered by index from 16384 tokens), H=7168,
I=2048, bf16. Variants of the gate-up tile, all with rows gathered in the kernel:
  two-dot  gate and up as two [BK, BN] weight tiles, two tl.dot of width BN (the library's
           swiglu_tile before session 8; kept here as `two_dot_tile`);
  one-dot  gate and up columns loaded as one [BK, 2*BN] tile (two column blocks of W1) and one
           tl.dot of width 2*BN (A is read from shared memory once per K step instead of twice);
           the epilogue splits the accumulator into its halves. The library's swiglu_tile since
           session 8 does the same (`one_dot_tile` is this script's copy, so the comparison does
           not move with the library).
Each on a persistent grid (two programs per SM for BM=64, else one) and a one-tile-per-program
grid; torch._grouped_mm (rows pre-gathered, + silu*mul) in the same run; every variant's h
checked bitwise against the first variant's and against torch's within bf16 tolerance.
Result (8d5310e, before the library took the one-dot tile): gate_up_variants_H200_20261122_s8_8d5310e.log.
Down-GEMM configs of the library kernel too (deeper pipelines with BK=32).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from ditron_ep.bench.timing import summarize, time_fn  # noqa: E402
from ditron_ep.check import make_routing  # noqa: E402
from ditron_ep.compiler.core_config import GemmTileConfig as C  # noqa: E402
from ditron_ep.ops.moe_layer.grouped_ffn import launch_grouped_down  # noqa: E402
from ditron_ep.ops.moe_layer.grouped_gemm_kernels import build_tile_map, max_m_tiles, tile_coords  # noqa: E402

E, H, I, RANKS, T, K = 16, 7168, 2048, 4, 4096, 8


@triton.jit
def two_dot_tile(a_ptr, a_idx_ptr, w1_ptr, h_ptr, e, row0, n_rows, n0, H, I,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    o_m = tl.arange(0, BM)
    o_n = n0 + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_m = o_m < n_rows
    m_n = o_n < I
    i_a = tl.load(a_idx_ptr + row0 + o_m, mask=m_m, other=0).to(tl.int64)
    p_a = a_ptr + i_a[:, None] * H + o_k[None, :]
    p_g = w1_ptr + e.to(tl.int64) * H * (2 * I) + o_k[:, None] * (2 * I) + o_n[None, :]
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        m_k = o_k < H - k0
        b_a = tl.load(p_a, mask=m_m[:, None] & m_k[None, :], other=0.0)
        m_w = m_k[:, None] & m_n[None, :]
        acc_g = tl.dot(b_a, tl.load(p_g, mask=m_w, other=0.0), acc_g)
        acc_u = tl.dot(b_a, tl.load(p_g + I, mask=m_w, other=0.0), acc_u)
        p_a += BK
        p_g += BK * (2 * I)
    p_h = h_ptr + (row0 + o_m).to(tl.int64)[:, None] * I + o_n[None, :]
    tl.store(p_h, (acc_g * tl.sigmoid(acc_g) * acc_u).to(h_ptr.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit
def one_dot_tile(a_ptr, a_idx_ptr, w1_ptr, h_ptr, e, row0, n_rows, n0, H, I,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    o_m = tl.arange(0, BM)
    o_j = tl.arange(0, 2 * BN)
    o_k = tl.arange(0, BK)
    m_m = o_m < n_rows
    col = n0 + o_j % BN + (o_j // BN) * I  # [gate n0:n0+BN | up I+n0:I+n0+BN]
    m_j = n0 + o_j % BN < I
    i_a = tl.load(a_idx_ptr + row0 + o_m, mask=m_m, other=0).to(tl.int64)
    p_a = a_ptr + i_a[:, None] * H + o_k[None, :]
    p_w = w1_ptr + e.to(tl.int64) * H * (2 * I) + o_k[:, None] * (2 * I) + col[None, :]
    acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        m_k = o_k < H - k0
        b_a = tl.load(p_a, mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(p_w, mask=m_k[:, None] & m_j[None, :], other=0.0)
        acc = tl.dot(b_a, b_w, acc)
        p_a += BK
        p_w += BK * (2 * I)
    g, u = acc.reshape(BM, 2, BN).permute(0, 2, 1).split()
    o_n = n0 + tl.arange(0, BN)
    p_h = h_ptr + (row0 + o_m).to(tl.int64)[:, None] * I + o_n[None, :]
    tl.store(p_h, (g * tl.sigmoid(g) * u).to(h_ptr.dtype.element_ty), mask=m_m[:, None] & (o_n < I)[None, :])


@triton.jit
def gate_up_probe(a_ptr, a_idx_ptr, w1_ptr, h_ptr, tile_start_ptr, expert_off_ptr, rows_cap, m_tiles_cap, H, I,
                  E_local, ONE_DOT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    n_n = tl.cdiv(I, BN)
    n_m = tl.minimum(tl.load(tile_start_ptr + E_local), m_tiles_cap)
    for t in range(tl.program_id(0), n_m * n_n, tl.num_programs(0)):
        e, row0, n_rows = tile_coords(tile_start_ptr, expert_off_ptr, t // n_n, E_local, rows_cap, BM, BLOCK_E)
        if ONE_DOT:
            one_dot_tile(a_ptr, a_idx_ptr, w1_ptr, h_ptr, e, row0, n_rows, (t % n_n) * BN, H, I, BM, BN, BK)
        else:
            two_dot_tile(a_ptr, a_idx_ptr, w1_ptr, h_ptr, e, row0, n_rows, (t % n_n) * BN, H, I, BM, BN, BK)


def layer_case(dev, with_down=True):
    """Rank 0's share of the layer shape, drawn on `dev` (seed 7): (x [RANKS*T, H] bf16, row_index
    int32 [rows] expert-major then by token, sizes [E] rows per expert (CPU), offsets int32 [E + 1],
    w1 [E, H, 2I], w2 [E, I, H] or None when not with_down)."""
    gen = torch.Generator().manual_seed(7)
    topk_idx, _ = make_routing(RANKS * T, E * RANKS, K, "uniform", generator=gen)
    token, slot = torch.nonzero(topk_idx < E, as_tuple=True)
    order = torch.argsort(topk_idx[token, slot] * (RANKS * T) + token)
    row_index = token[order].to(torch.int32).to(dev)
    sizes = torch.bincount(topk_idx[topk_idx < E], minlength=E)
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = sizes.cumsum(0)
    g = torch.Generator(device=dev).manual_seed(7)
    x = torch.randn(RANKS * T, H, generator=g, device=dev).to(torch.bfloat16)
    w1 = (torch.randn(E, H, 2 * I, generator=g, device=dev) * H**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, I, H, generator=g, device=dev) * I**-0.5).to(torch.bfloat16) if with_down else None
    return x, row_index, sizes, offsets.to(dev), w1, w2


def median_us(fn):
    """(median, p20, p80) µs of 10 calls after 3, timed by the benchmarks' rule (ditron_ep.bench.timing)."""
    s = summarize(time_fn(fn, 10, 3, device="cuda"))
    return s["median"], s["p20"], s["p80"]


def main():
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    x, row_index, sizes, offsets, w1, w2 = layer_case(dev)
    rows = int(offsets[-1])
    print(f"# {torch.cuda.get_device_name(dev)}, {sms} SMs, triton {triton.__version__}, torch {torch.__version__}; "
          f"rows={rows} (min {int(sizes.min())}, max {int(sizes.max())} per expert), H={H}, I={I}, bf16", flush=True)
    flop_gu = 2.0 * rows * H * 2 * I
    flop_dn = 2.0 * rows * I * H

    def line(name, us, flop, ref_us=None, extra=""):
        med, p20, p80 = us
        rel = f" ({ref_us / med:.3f} of torch)" if ref_us else ""
        print(f"{name:58s} {med:8.1f} us (p20 {p20:.0f}, p80 {p80:.0f}) {flop / med / 1e6:6.1f} TF/s{rel}{extra}",
              flush=True)

    x_rows = x[row_index.long()]
    offs = offsets[1:].to(torch.int32)

    def torch_gu():
        y = torch._grouped_mm(x_rows, w1, offs=offs, out_dtype=torch.bfloat16)
        return F.silu(y[:, :I]) * y[:, I:]

    h_ref = torch_gu()
    t_gu = median_us(torch_gu)
    line("torch._grouped_mm gate-up + silu*mul", t_gu, flop_gu)
    t_gu_mm = median_us(lambda: torch._grouped_mm(x_rows, w1, offs=offs, out_dtype=torch.bfloat16))
    line("torch._grouped_mm gate-up GEMM only", t_gu_mm, flop_gu)
    h_torch_dn = h_ref.contiguous()
    t_dn = median_us(lambda: torch._grouped_mm(h_torch_dn, w2, offs=offs, out_dtype=torch.bfloat16))
    line("torch._grouped_mm down", t_dn, flop_dn)

    h_base = None
    variants = [(False, C(128, 128, 64, 8, 4)), (True, C(128, 128, 64, 8, 4)), (False, C(128, 128, 32, 8, 8)),
                (True, C(128, 128, 32, 8, 8)), (True, C(128, 128, 32, 8, 6)), (True, C(64, 128, 64, 4, 2)),
                (True, C(64, 128, 32, 4, 4)), (True, C(128, 64, 64, 8, 4)), (True, C(128, 128, 64, 8, 3))]
    for one_dot, cfg in variants:
        tile_start = build_tile_map(offsets, cfg.block_m)
        m_cap = max_m_tiles(rows, E, cfg.block_m)
        n_tiles = m_cap * triton.cdiv(I, cfg.block_n)
        per_sm = 2 if cfg.block_m == 64 else 1
        for grid_name, grid in ((f"persistent {per_sm * sms}", per_sm * sms), ("one-tile", n_tiles)):
            h = torch.full((rows, I), float("nan"), device=dev, dtype=torch.bfloat16)

            def run():
                gate_up_probe[(min(grid, n_tiles),)](
                    x, row_index, w1, h, tile_start, offsets, rows, m_cap, H, I, E, one_dot,
                    cfg.block_m, cfg.block_n, cfg.block_k, 16, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

            name = f"gate-up {'one-dot' if one_dot else 'two-dot'} {cfg} {grid_name}"
            try:
                run()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001  (a config that does not compile is a result too)
                print(f"{name:58s} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", flush=True)
                continue
            if h_base is None:
                h_base = h.clone()
            same = torch.equal(h, h_base)
            err = ((h.float() - h_ref.float()).abs().max() / h_ref.float().abs().max()).item()
            line(name, median_us(run), flop_gu, t_gu[0], f"; bitwise = first variant: {same}; max rel err vs "
                 f"torch {err:.1e}")

    h_in = h_base if h_base is not None else h_ref.contiguous()
    y_base = None
    for cfg in (C(128, 256, 64, 8, 4), C(128, 256, 32, 8, 8), C(128, 256, 32, 8, 6), C(128, 128, 64, 8, 4)):
        tile_start = build_tile_map(offsets, cfg.block_m)
        for grid_name, programs in ((f"persistent {sms}", sms), ("one-tile", 2**31 - 1)):
            y = torch.full((rows, H), float("nan"), device=dev, dtype=torch.bfloat16)
            name = f"down {cfg} {grid_name}"

            def run_dn():
                launch_grouped_down(h_in, w2, y, offsets, tile_start, cfg, programs, "tf32", 1)

            try:
                run_dn()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001
                print(f"{name:58s} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", flush=True)
                continue
            if y_base is None:
                y_base = y.clone()
            line(name, median_us(run_dn), flop_dn, t_dn[0], f"; bitwise = first: {torch.equal(y, y_base)}")


if __name__ == "__main__":
    main()
