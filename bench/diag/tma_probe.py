"""Diagnostic (one GPU, not a benchmark): do TMA descriptor loads of the weight tiles (and of
contiguous activation rows) speed up the grouped gate-up and down GEMM tiles on Hopper?

    python bench/diag/tma_probe.py        # prints one line per (config, TMA use, grid)

Uniform routing, 16 experts x 2048 contiguous rows, H=7168, I=2048, bf16; the same tile loop as
ditron_ep's swiglu_tile / down_tile with loads by pointer or through host TensorDescriptors (3-D
over [E, K, N] for weights, so a K tail zero-fills per expert); one-tile and persistent grids;
torch._grouped_mm measured in the same run; every variant checked bitwise against the first.
Result on an H200 (bench/results/tma_probe_H200_20261122_s4.log): TMA did not help.
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

E, R, H, I = 16, 2048, 7168, 2048
BM, BK = 128, 64

@triton.jit
def gate_up(a_ptr, a_desc, w_ptr, w_desc, h_ptr, H, I, n_tiles, R,
            TMA_A: tl.constexpr, TMA_W: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    n_n = tl.cdiv(I, BN)
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        t_m = t // n_n; n0 = (t % n_n) * BN
        row0 = t_m * BM; e = row0 // R
        o_m = tl.arange(0, BM); o_n = n0 + tl.arange(0, BN); o_k = tl.arange(0, BK)
        p_a = a_ptr + (row0 + o_m).to(tl.int64)[:, None] * H + o_k[None, :]
        p_g = w_ptr + e.to(tl.int64) * H * (2 * I) + o_k[:, None] * (2 * I) + o_n[None, :]
        acc_g = tl.zeros((BM, BN), dtype=tl.float32); acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, H, BK):
            if TMA_A:
                b_a = a_desc.load([row0, k0])
            else:
                b_a = tl.load(p_a)
            if TMA_W:
                b_g = w_desc.load([e, k0, n0]).reshape(BK, BN)
                b_u = w_desc.load([e, k0, I + n0]).reshape(BK, BN)
            else:
                b_g = tl.load(p_g); b_u = tl.load(p_g + I)
            acc_g = tl.dot(b_a, b_g, acc_g); acc_u = tl.dot(b_a, b_u, acc_u)
            p_a += BK; p_g += BK * (2 * I)
        b_h = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(h_ptr + (row0 + o_m).to(tl.int64)[:, None] * I + o_n[None, :], b_h.to(h_ptr.dtype.element_ty))

@triton.jit
def down(h_ptr, h_desc, w_ptr, w_desc, y_ptr, I, H, n_tiles, R,
         TMA_A: tl.constexpr, TMA_W: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    n_n = tl.cdiv(H, BN)
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        t_m = t // n_n; n0 = (t % n_n) * BN
        row0 = t_m * BM; e = row0 // R
        o_m = tl.arange(0, BM); o_n = n0 + tl.arange(0, BN); o_k = tl.arange(0, BK)
        p_h = h_ptr + (row0 + o_m).to(tl.int64)[:, None] * I + o_k[None, :]
        p_w = w_ptr + e.to(tl.int64) * I * H + o_k[:, None] * H + o_n[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, I, BK):
            if TMA_A:
                b_h = h_desc.load([row0, k0])
            else:
                b_h = tl.load(p_h)
            if TMA_W:
                b_w = w_desc.load([e, k0, n0]).reshape(BK, BN)
            else:
                b_w = tl.load(p_w)
            acc = tl.dot(b_h, b_w, acc)
            p_h += BK; p_w += BK * H
        tl.store(y_ptr + (row0 + o_m).to(tl.int64)[:, None] * H + o_n[None, :], acc.to(y_ptr.dtype.element_ty))

def bench(fn, iters=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e) * 1e3)
    ts.sort(); return ts[len(ts) // 2]

FL_GU, FL_DN = 2 * E * R * H * 2 * I, 2 * E * R * I * H  # FLOPs of the two GEMMs


def layer_operands():
    """The probes' operands (bf16, on the GPU, seed 0): a [E*R, H], w1 [E, H, 2I], w2 [E, I, H],
    outputs h [E*R, I] and y [E*R, H], and torch._grouped_mm's offs (every expert R rows)."""
    torch.manual_seed(0)
    a = torch.randn(E * R, H, device="cuda").bfloat16()
    w1 = (torch.randn(E, H, 2 * I, device="cuda") * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, I, H, device="cuda") * I ** -0.5).bfloat16()
    h = torch.empty(E * R, I, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(E * R, H, device="cuda", dtype=torch.bfloat16)
    offs = torch.arange(R, E * R + 1, R, device="cuda", dtype=torch.int32)
    return a, w1, w2, h, y, offs


def main():
    a, w1, w2, h, y, offs = layer_operands()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fl_gu, fl_dn = FL_GU, FL_DN
    t_gu = bench(lambda: torch._grouped_mm(a, w1, offs=offs)); t_dn = bench(lambda: torch._grouped_mm(h, w2, offs=offs))
    print(f"torch._grouped_mm gate-up {t_gu:.0f} us {fl_gu / t_gu / 1e6:.0f} TF/s; down {t_dn:.0f} us {fl_dn / t_dn / 1e6:.0f} TF/s")
    ref_h = None; ref_y = None
    for BN1, BN2, w, s in ((128, 256, 8, 4), (128, 256, 8, 3)):
        for tma_a, tma_w in ((0, 0), (0, 1), (1, 1)):
            ad = TensorDescriptor.from_tensor(a, [BM, BK]); w1d = TensorDescriptor.from_tensor(w1, [1, BK, BN1])
            hd = TensorDescriptor.from_tensor(h, [BM, BK]); w2d = TensorDescriptor.from_tensor(w2, [1, BK, BN2])
            n1 = (E * R // BM) * (I // BN1); n2 = (E * R // BM) * (H // BN2)
            for grid_name, g1, g2 in (("one-tile", n1, n2), (f"persistent {sms}", sms, sms)):
                try:
                    f1 = lambda: gate_up[(g1,)](a, ad, w1, w1d, h, H, I, n1, R, TMA_A=tma_a, TMA_W=tma_w, BM=BM, BN=BN1, BK=BK, num_warps=w, num_stages=s)
                    f2 = lambda: down[(g2,)](h, hd, w2, w2d, y, I, H, n2, R, TMA_A=tma_a, TMA_W=tma_w, BM=BM, BN=BN2, BK=BK, num_warps=w, num_stages=s)
                    t1 = bench(f1); hh = h.clone(); t2 = bench(f2); yy = y.clone()
                    if ref_h is None: ref_h, ref_y = hh, yy
                    same = torch.equal(hh, ref_h) and torch.equal(yy, ref_y)
                    print(f"w{w} s{s} tmaA={tma_a} tmaW={tma_w} {grid_name:>15}: gate-up {t1:.0f} us {fl_gu / t1 / 1e6:.0f} TF/s ({t_gu / t1:.3f} of torch); down {t2:.0f} us {fl_dn / t2 / 1e6:.0f} TF/s ({t_dn / t2:.3f}); bitwise same as first: {same}", flush=True)
                except Exception as ex:
                    print(f"w{w} s{s} tmaA={tma_a} tmaW={tma_w} {grid_name}: FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)


if __name__ == "__main__":
    main()
