"""Diagnostic (one GPU, not a benchmark): do gate-up tiles run slower when the persistent
programs are out of step, as when the fused kernel's communication programs join the GEMM
stage late?

    python bench/diag/desync_probe.py

The library's gate-up tile (`swiglu_tile`, default config) over the `layer` rows of
bench/diag/gate_up_variants.py, on a persistent grid of one program per SM, with every tile's
start and end stamped from the device timer. Variant "late": the first LATE (33, a quarter of
the grid) programs spin DELAY_US (430 µs, the dispatch's length on 2xH200) before taking tiles,
as the fused kernel's communication programs do. Printed: kernel time, and the median tile
duration of tiles started before and after the late programs joined (+100 µs). If tiles after
the join are slower than in the "together" run, being out of step costs on its own.
"""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from gate_up_variants import E, H, I, layer_case  # noqa: E402  (the script beside this one)
from triton.language.extra.cuda import globaltimer  # noqa: E402

from ditron_ep.compiler.core_config import default_gemm_configs  # noqa: E402
from ditron_ep.ops.moe_layer.grouped_gemm_kernels import build_tile_map, max_m_tiles, swiglu_tile, tile_coords  # noqa: E402

LATE, DELAY_US = 33, 430


@triton.jit
def stamped_gate_up(a_ptr, a_idx_ptr, w1_ptr, h_ptr, tile_start_ptr, expert_off_ptr, stamp_ptr, rows_cap, m_tiles_cap,
                    H, I, E_local, late, delay_ns,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    if pid < late:
        t_in = globaltimer()
        while globaltimer() < t_in + delay_ns:
            pass
    n_n = tl.cdiv(I, BN)
    n_m = tl.minimum(tl.load(tile_start_ptr + E_local), m_tiles_cap)
    # a ticket counter, as the fused kernel hands out tiles: late programs take the next ones
    t = tl.atomic_add(stamp_ptr, 1, sem="relaxed", scope="gpu").to(tl.int32)
    while t < n_m * n_n:
        tl.store(stamp_ptr + 2 + t * 2, globaltimer())
        e, row0, n_rows = tile_coords(tile_start_ptr, expert_off_ptr, t // n_n, E_local, rows_cap, BM, BLOCK_E)
        swiglu_tile(a_ptr, a_idx_ptr, w1_ptr, h_ptr, e, row0, n_rows, (t % n_n) * BN, H, I,
                    True, BM, BN, BK, "tf32")
        tl.store(stamp_ptr + 3 + t * 2, globaltimer())
        t = tl.atomic_add(stamp_ptr, 1, sem="relaxed", scope="gpu").to(tl.int32)


def main():
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    x, row_index, _, offsets, w1, _ = layer_case(dev, with_down=False)
    rows = int(offsets[-1])
    cfg, _ = default_gemm_configs(torch.bfloat16, "cuda")
    tile_start = build_tile_map(offsets, cfg.block_m)
    m_cap = max_m_tiles(rows, E, cfg.block_m)
    n_tiles = m_cap * triton.cdiv(I, cfg.block_n)
    h = torch.empty((rows, I), device=dev, dtype=torch.bfloat16)
    stamps = torch.zeros(2 + 2 * n_tiles, dtype=torch.int64, device=dev)
    print(f"# {torch.cuda.get_device_name(dev)}, {sms} programs, {cfg}, rows={rows}; late programs: {LATE}, "
          f"delay {DELAY_US} us", flush=True)
    for rep in range(3):
        for name, late in (("together", 0), ("late", LATE)):
            stamps.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            stamped_gate_up[(sms,)](x, row_index, w1, h, tile_start, offsets, stamps, rows, m_cap, H, I, E, late,
                                    DELAY_US * 1000, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, BLOCK_E=16,
                                    num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            b.record()
            torch.cuda.synchronize()
            st = stamps[2:].view(-1, 2).cpu().double() / 1e3
            st = st[st[:, 0] > 0]
            t0 = float(st[:, 0].min())
            start, dur = st[:, 0] - t0, (st[:, 1] - st[:, 0]).tolist()
            cut = DELAY_US + 100 if late else 0
            before = [d for s, d in zip(start.tolist(), dur) if s < cut]
            after = [d for s, d in zip(start.tolist(), dur) if s >= cut]
            med = lambda v: f"{statistics.median(v):.1f}" if v else "-"  # noqa: E731
            print(f"rep {rep} {name:8s}: kernel {a.elapsed_time(b) * 1e3:7.0f} us; tiles {len(st)}; median tile "
                  f"before the join {med(before)} us ({len(before)}), after {med(after)} us ({len(after)})",
                  flush=True)


if __name__ == "__main__":
    main()
