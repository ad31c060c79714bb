"""Diagnostic (one GPU, not a benchmark): do TMA descriptor loads lower the power the grouped
GEMM tiles draw, so that they keep a higher clock under the board's power limit?

    python bench/diag/tma_sustained.py [--seconds 2.5]

Why: in short timings TMA loads did not speed the tiles up (tma_probe_H200_20261122_s4.log), but
sustained, our GEMMs run power-capped at ~1,440 MHz against torch._grouped_mm's ~1,550 MHz
(sustained_gemm_*_s14_*.log). tma_probe's kernels (uniform 16 x 2048 contiguous rows, H=7168,
I=2048, bf16, two-dot gate-up) with loads by pointer or by TMA, one tile a program, timed with
sustained_gemm's harness: per variant, the second half of a back-to-back window, with nvidia-smi's
SM clock and power.
"""
import argparse
import time

import torch
from sustained_gemm import board_sampler, print_sustained, run_window
from tma_probe import BK, BM, FL_DN, FL_GU, E, H, I, R, down, gate_up, layer_operands
from triton.tools.tensor_descriptor import TensorDescriptor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=2.5)
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    a, w1, w2, h, y, offs = layer_operands()
    bn1, bn2, warps, stages = 128, 256, 8, 4
    n1, n2 = (E * R // BM) * (I // bn1), (E * R // BM) * (H // bn2)
    ad, w1d = TensorDescriptor.from_tensor(a, [BM, BK]), TensorDescriptor.from_tensor(w1, [1, BK, bn1])
    hd, w2d = TensorDescriptor.from_tensor(h, [BM, BK]), TensorDescriptor.from_tensor(w2, [1, BK, bn2])

    def probe(tma_a: int, tma_w: int):
        def step(ev):
            ev[0].record()
            gate_up[(n1,)](a, ad, w1, w1d, h, H, I, n1, R, TMA_A=tma_a, TMA_W=tma_w, BM=BM, BN=bn1, BK=BK,
                           num_warps=warps, num_stages=stages)
            ev[1].record()
            down[(n2,)](h, hd, w2, w2d, y, I, H, n2, R, TMA_A=tma_a, TMA_W=tma_w, BM=BM, BN=bn2, BK=BK,
                        num_warps=warps, num_stages=stages)
            ev[2].record()
        return step

    def native(ev):
        ev[0].record()
        torch._grouped_mm(a, w1, offs=offs)
        ev[1].record()
        torch._grouped_mm(h, w2, offs=offs)
        ev[2].record()

    sampler = board_sampler(props)
    print(f"# {props.name}; tma_probe kernels, one tile a program, BM{BM} BK{BK}, gate-up BN{bn1}, down BN{bn2}, "
          f"w{warps} s{stages}; torch = two _grouped_mm (no silu); {args.seconds} s a window", flush=True)
    cases = [("torch", native), ("pointer", probe(0, 0)), ("TMA weights", probe(0, 1)), ("TMA both", probe(1, 1))]
    cases += cases
    ref = None
    for name, fn in cases:
        time.sleep(0.5)
        run_window(fn, 0.3)
        times, t0, t1 = run_window(fn, args.seconds)
        same = ""
        if name != "torch":
            if ref is None:
                ref = (h.clone(), y.clone())
            same = f"; bitwise == pointer: {torch.equal(h, ref[0]) and torch.equal(y, ref[1])}"
        print_sustained(f"{name:12s}", times, t0, t1, sampler, FL_GU, FL_DN, same)
    sampler.stop()


if __name__ == "__main__":
    main()
