"""Diagnostic (one GPU, not a benchmark): do CTA clusters (Triton's num_ctas=2 on Hopper) make
the grouped GEMM tiles cheaper under the board's power cap?

    python bench/diag/cluster_probe.py [--seconds 2.5]

Why: sustained, our GEMMs and torch's run power-capped, ours at a ~7 % lower clock
(sustained_gemm_*_s14_*.log); cuBLAS's Hopper kernels pair CTAs in clusters that share (multicast)
an operand tile, which halves that operand's L2-to-SM traffic. Triton 3.6 accepts num_ctas=2 on
sm_90 and splits one program's block over the cluster's two CTAs. Variants (sustained, second half
of a back-to-back window, as sustained_gemm): the library's persistent kernels at their default
tiles; the same kernels with num_ctas=2 and BM doubled (each CTA keeps a 128-row tile); and
tma_probe's TMA kernels (contiguous rows, one tile a program) at num_ctas 1 and 2. Outputs are
compared bit for bit with the default's (the TMA probe's with its own num_ctas=1 run).
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tma_probe  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from sustained_gemm import board_sampler, print_sustained, run_window  # noqa: E402
from tile_order import H, I, rank_case  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from ditron_ep.compiler.core_config import default_gemm_configs  # noqa: E402
from ditron_ep.ops.moe_layer.grouped_gemm_kernels import (  # noqa: E402
    build_tile_map,
    grouped_down_kernel,
    grouped_swiglu_kernel,
    max_m_tiles,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=2.5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    sms = props.multi_processor_count
    gu, dn = default_gemm_configs(torch.bfloat16, "cuda")
    x, idx, off, w1, w2 = rank_case(dev, 4, 16)
    rows, E_local = int(off[-1]), w1.shape[0]
    h = torch.empty(rows, I, dtype=torch.bfloat16, device=dev)
    y = torch.empty(rows, H, dtype=torch.bfloat16, device=dev)
    fl_gu, fl_dn = 4.0 * rows * H * I, 2.0 * rows * I * H

    def library(ctas: int):
        bm_gu, bm_dn = gu.block_m * ctas, dn.block_m * ctas
        t_gu, t_dn = build_tile_map(off, bm_gu), build_tile_map(off, bm_dn)
        m_gu, m_dn = max_m_tiles(rows, E_local, bm_gu), max_m_tiles(rows, E_local, bm_dn)
        progs = sms // ctas

        def step(ev):
            ev[0].record()
            grouped_swiglu_kernel[(progs,)](x, idx, w1, h, t_gu, off, rows, m_gu, H, I, E_local, 1, HAS_IDX=True,
                                            BM=bm_gu, BN=gu.block_n, BK=gu.block_k, BLOCK_E=16,
                                            INPUT_PRECISION="tf32", num_warps=gu.num_warps,
                                            num_stages=gu.num_stages, num_ctas=ctas)
            ev[1].record()
            grouped_down_kernel[(progs,)](h, w2, y, t_dn, off, rows, m_dn, I, H, E_local, 1, BM=bm_dn,
                                          BN=dn.block_n, BK=dn.block_k, BLOCK_E=16, INPUT_PRECISION="tf32",
                                          num_warps=dn.num_warps, num_stages=dn.num_stages, num_ctas=ctas)
            ev[2].record()
        return step

    a, pw1, pw2, ph, py, _ = tma_probe.layer_operands()
    E, R, BK = tma_probe.E, tma_probe.R, tma_probe.BK

    def probe(ctas: int):
        bm = tma_probe.BM * ctas
        n1, n2 = (E * R // bm) * (I // 128), (E * R // bm) * (H // 256)
        ad, w1d = TensorDescriptor.from_tensor(a, [bm, BK]), TensorDescriptor.from_tensor(pw1, [1, BK, 128])
        hd, w2d = TensorDescriptor.from_tensor(ph, [bm, BK]), TensorDescriptor.from_tensor(pw2, [1, BK, 256])

        def step(ev):
            ev[0].record()
            tma_probe.gate_up[(n1,)](a, ad, pw1, w1d, ph, H, I, n1, R, TMA_A=1, TMA_W=1, BM=bm, BN=128, BK=BK,
                                     num_warps=8, num_stages=4, num_ctas=ctas)
            ev[1].record()
            tma_probe.down[(n2,)](ph, hd, pw2, w2d, py, I, H, n2, R, TMA_A=1, TMA_W=1, BM=bm, BN=256, BK=BK,
                                  num_warps=8, num_stages=4, num_ctas=ctas)
            ev[2].record()
        return step

    sampler = board_sampler(props)
    print(f"# {props.name}, {sms} SMs, triton {triton.__version__}; library: {rows} rows gathered, 16 experts, "
          f"gate-up {gu}, down {dn}; probe: {E} x {R} contiguous rows, TMA loads; {args.seconds} s a window",
          flush=True)
    refs = {}
    for name, make, ctas, outs in (("library", library, 1, (h, y)), ("library", library, 2, (h, y)),
                                   ("TMA probe", probe, 1, (ph, py)), ("TMA probe", probe, 2, (ph, py)),
                                   ("library", library, 1, (h, y))):
        label = f"{name} num_ctas={ctas}"
        time.sleep(0.5)
        try:
            fn = make(ctas)
            run_window(fn, 0.3)  # compile
            times, t0, t1 = run_window(fn, args.seconds)
        except Exception as exc:  # a num_ctas the compiler rejects
            print(f"{label:24s}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        got = tuple(o.clone() for o in outs)
        ref = refs.setdefault(name, got)
        same = all(torch.equal(g_, r_) for g_, r_ in zip(got, ref))
        print_sustained(f"{label:24s}", times, t0, t1, sampler, fl_gu, fl_dn, f"; bitwise == num_ctas=1: {same}")
    sampler.stop()


if __name__ == "__main__":
    main()
