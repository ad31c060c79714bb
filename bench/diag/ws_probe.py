"""Diagnostic (one GPU, not a benchmark): does Triton's automatic warp specialization on Hopper
(`tl.range(..., warp_specialize=True)`, Triton >= 3.5) speed up the grouped gate-up and down GEMM
tiles at the MoE layer's shape?

    python bench/diag/ws_probe.py        # one line per (GEMM, config, where WS is asked for)

Same shapes and tile loops as bench/diag/tma_probe.py (uniform routing, 16 experts x 2048
contiguous rows, H=7168, I=2048, bf16, TMA descriptor loads of both operands, which Hopper's
warp specialization needs): WS off; WS on the K loop of one-tile programs; WS on the flattened
tile loop of a persistent grid (the structure of Triton's persistent-matmul tutorial).
torch._grouped_mm is measured in the same run; every variant is checked bitwise against the
first. Prediction before running: WS overlaps the TMA producer with the wgmma consumer, so if
the pass handles these loops, 5-15 % on gate-up (ours 0.92-0.94 of torch at s4) and little on down.
Outcome on an H200 (bench/results/ws_probe_H200_20261123_s13_a1db7cf.log; the run hit its 420 s
limit before the down GEMM): gate-up 2,673 us with WS on the K loop against 2,725 without (2 %,
w8 s4; none at s3); WS on the persistent tile loop 22-28 % slower. Not worth porting.
"""
import torch
import triton
import triton.language as tl
from tma_probe import BK, BM, FL_DN, FL_GU, E, H, I, R, bench, layer_operands  # the same shapes and timer
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def gate_up(a_desc, w_desc, h_ptr, H, I, n_tiles, R, WS_K: tl.constexpr, WS_TILES: tl.constexpr,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    n_n = tl.cdiv(I, BN)
    for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), flatten=WS_TILES, warp_specialize=WS_TILES):
        t_m = t // n_n
        n0 = (t % n_n) * BN
        row0 = t_m * BM
        e = row0 // R
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in tl.range(0, H, BK, warp_specialize=WS_K):
            b_a = a_desc.load([row0, k0])
            b_g = w_desc.load([e, k0, n0]).reshape(BK, BN)
            b_u = w_desc.load([e, k0, I + n0]).reshape(BK, BN)
            acc_g = tl.dot(b_a, b_g, acc_g)
            acc_u = tl.dot(b_a, b_u, acc_u)
        b_h = acc_g * tl.sigmoid(acc_g) * acc_u
        o_m = tl.arange(0, BM)
        o_n = n0 + tl.arange(0, BN)
        tl.store(h_ptr + (row0 + o_m).to(tl.int64)[:, None] * I + o_n[None, :], b_h.to(h_ptr.dtype.element_ty))


@triton.jit
def down(h_desc, w_desc, y_ptr, I, H, n_tiles, R, WS_K: tl.constexpr, WS_TILES: tl.constexpr,
         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    n_n = tl.cdiv(H, BN)
    for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), flatten=WS_TILES, warp_specialize=WS_TILES):
        t_m = t // n_n
        n0 = (t % n_n) * BN
        row0 = t_m * BM
        e = row0 // R
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in tl.range(0, I, BK, warp_specialize=WS_K):
            b_h = h_desc.load([row0, k0])
            b_w = w_desc.load([e, k0, n0]).reshape(BK, BN)
            acc = tl.dot(b_h, b_w, acc)
        o_m = tl.arange(0, BM)
        o_n = n0 + tl.arange(0, BN)
        tl.store(y_ptr + (row0 + o_m).to(tl.int64)[:, None] * H + o_n[None, :], acc.to(y_ptr.dtype.element_ty))


def main():
    a, w1, w2, h, y, offs = layer_operands()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fl_gu, fl_dn = FL_GU, FL_DN
    t_gu = bench(lambda: torch._grouped_mm(a, w1, offs=offs))
    t_dn = bench(lambda: torch._grouped_mm(h, w2, offs=offs))
    print(f"# {torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}")
    print(f"torch._grouped_mm gate-up {t_gu:.0f} us {fl_gu / t_gu / 1e6:.0f} TF/s; "
          f"down {t_dn:.0f} us {fl_dn / t_dn / 1e6:.0f} TF/s", flush=True)
    refs = {}
    variants = [("off", 0, 0, "one-tile"), ("K loop", 1, 0, "one-tile"), ("tile loop", 0, 1, "persistent"),
                ("off", 0, 0, "persistent")]
    for gemm in ("gate-up", "down"):
        bn = 128 if gemm == "gate-up" else 256
        for warps, stages in ((8, 4), (8, 3)):  # 4 warps: 4x slower, minutes to compile
            for ws_name, ws_k, ws_tiles, grid_kind in variants:
                label = f"{gemm:7} BN{bn} w{warps} s{stages} WS {ws_name:9} {grid_kind:10}"
                try:
                    if gemm == "gate-up":
                        ad = TensorDescriptor.from_tensor(a, [BM, BK])
                        wd = TensorDescriptor.from_tensor(w1, [1, BK, bn])
                        n_tiles = (E * R // BM) * (I // bn)
                        grid = (n_tiles if grid_kind == "one-tile" else sms,)
                        fn = lambda: gate_up[grid](ad, wd, h, H, I, n_tiles, R, WS_K=ws_k, WS_TILES=ws_tiles,  # noqa: E731
                                                   BM=BM, BN=bn, BK=BK, num_warps=warps, num_stages=stages)
                        out, flops, ref_t = h, fl_gu, t_gu
                    else:
                        hd = TensorDescriptor.from_tensor(h, [BM, BK])
                        wd = TensorDescriptor.from_tensor(w2, [1, BK, bn])
                        n_tiles = (E * R // BM) * (H // bn)
                        grid = (n_tiles if grid_kind == "one-tile" else sms,)
                        fn = lambda: down[grid](hd, wd, y, I, H, n_tiles, R, WS_K=ws_k, WS_TILES=ws_tiles,  # noqa: E731
                                                BM=BM, BN=bn, BK=BK, num_warps=warps, num_stages=stages)
                        out, flops, ref_t = y, fl_dn, t_dn
                    t = bench(fn)
                    got = out.clone()
                    same = torch.equal(got, refs.setdefault(gemm, got))
                    print(f"{label}: {t:.0f} us {flops / t / 1e6:.0f} TF/s ({ref_t / t:.3f} of torch); "
                          f"bitwise same as first: {same}", flush=True)
                except Exception as ex:  # noqa: BLE001  (a probe: report and go on)
                    print(f"{label}: FAILED {type(ex).__name__}: {str(ex).splitlines()[0][:200] if str(ex) else ''}",
                          flush=True)


if __name__ == "__main__":
    main()
