"""Diagnostic (one GPU, not a benchmark): do the grouped SwiGLU GEMMs hold their speed under
sustained load, against torch._grouped_mm, and what do the SM clock and the power do meanwhile?

    python bench/diag/sustained_gemm.py [--seconds 3] [--rounds 2]
    python bench/diag/sustained_gemm.py --sweep [--seconds 2.5]   # tile configs, sustained

Why: on one idle H200 our two GEMMs took 96 % of torch._grouped_mm's time (bench/results/
tile_order_H200_20261122_s9.log, ws_probe_H200_20261123_s13_a1db7cf.log), but inside the 4×H200
layer benchmark, which runs for minutes, 83–86 %. A kernel that draws more power per FLOP loses
more clock when the board reaches its power limit; this diag shows whether that is the gap.

Each variant runs back to back for --seconds (no sync between calls), in rounds A B A B so that a
drift of the board's temperature shows up in both. Per window: the first 10 calls' median (the
"burst" figure short timings give), the median of the window's second half (sustained), and
nvidia-smi's SM clock, power and throttle reasons sampled every 100 ms.
Shape: the 4-rank layer's per-rank rows (T=4096, top-8 of E=64, 16 local experts, uniform),
H=7168, I=2048, bf16; ours gathers rows by index, torch gets them contiguous.

--sweep times candidate tile configs of one GEMM while the other keeps its default (the pair
runs, so the board's power state is the layer's), with the defaults and torch first and last.
A config that changes the block over K may change bits: the output's equality with the default
config's is printed, not required (the determinism contract holds within one Core config).
"""
import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from tile_order import H, I, rank_case  # noqa: E402

from ditron_ep.compiler.core_config import GemmTileConfig, default_gemm_configs  # noqa: E402
from ditron_ep.ops.moe_layer.grouped_ffn import launch_grouped_down, launch_grouped_swiglu  # noqa: E402
from ditron_ep.ops.moe_layer.grouped_gemm_kernels import build_tile_map  # noqa: E402

# (gate-up, down) candidates; gate-up's BN is half its tile's width (gate and up blocks).
SWEEP_GATE_UP = ("BM128-BN128-BK64-w8-s3", "BM128-BN64-BK64-w4-s4", "BM128-BN64-BK64-w8-s4",
                 "BM256-BN64-BK64-w8-s3", "BM64-BN128-BK64-w4-s4", "BM128-BN128-BK32-w8-s6")
SWEEP_DOWN = ("BM128-BN256-BK64-w8-s3", "BM128-BN128-BK64-w4-s4", "BM128-BN128-BK64-w8-s4",
              "BM256-BN128-BK64-w8-s3", "BM64-BN256-BK64-w4-s4", "BM128-BN256-BK128-w8-s2",
              "BM128-BN256-BK32-w8-s6")

_QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


class SmiSampler:
    """nvidia-smi samples of one GPU, each stamped with time.time() on arrival."""

    def __init__(self, gpu_uuid: str, period_ms: int = 100):
        self.samples: list[tuple[float, float, float, float, int]] = []
        self.proc = subprocess.Popen(
            ["nvidia-smi", "-i", gpu_uuid, f"--query-gpu={_QUERY}", "--format=csv,noheader,nounits",
             f"-lms={period_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                clk, pw, temp, reasons = (v.strip() for v in line.split(","))
                self.samples.append((time.time(), float(clk), float(pw), float(temp),
                                     int(reasons, 16) if reasons.startswith("0x") else 0))
            except ValueError:
                continue

    def window(self, t0: float, t1: float) -> str:
        s = [x for x in self.samples if t0 <= x[0] <= t1]
        if not s:
            return "no nvidia-smi samples"
        clk = sorted(x[1] for x in s)
        pw = sorted(x[2] for x in s)
        reasons = 0
        for x in s:
            reasons |= x[4]
        return (f"SM clock MHz median {clk[len(clk) // 2]:.0f} (min {clk[0]:.0f}), power W median "
                f"{pw[len(pw) // 2]:.0f} (max {pw[-1]:.0f}), temp max {max(x[3] for x in s):.0f} C, "
                f"throttle reasons OR 0x{reasons:x}, {len(s)} samples")

    def stop(self) -> None:
        self.proc.terminate()


def run_window(step, seconds: float):
    """Call step() back to back for `seconds`; returns per-call [gate-up, down, total] in µs and
    the wall-clock window. Events are recorded on the stream; the host syncs every 50 calls only
    to bound the queue."""
    calls = []
    torch.cuda.synchronize()
    t0 = time.time()
    while time.time() - t0 < seconds:
        for _ in range(50):
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            step(ev)
            calls.append(ev)
        calls[-1][2].synchronize()
    t1 = time.time()
    times = [(a.elapsed_time(b) * 1e3, b.elapsed_time(c) * 1e3, a.elapsed_time(c) * 1e3) for a, b, c in calls]
    return times, t0, t1


def med(v):
    v = sorted(v)
    return v[len(v) // 2]


def board_sampler(props) -> SmiSampler:
    """The nvidia-smi sampler of the GPU `props` describes (by UUID: CUDA_VISIBLE_DEVICES renumbers)."""
    uuid = str(props.uuid)
    return SmiSampler(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")


def print_sustained(label: str, times, t0: float, t1: float, sampler: SmiSampler, fl_gu: float, fl_dn: float,
                    note: str = "") -> None:
    """A window's line: medians over its second half (total, gate-up, down with TF/s) and `note`,
    then nvidia-smi over that half."""
    half = times[len(times) // 2:]
    gu, dn, tot = (med([t[i] for t in half]) for i in range(3))
    print(f"{label}: sustained {tot:6.0f} us = gate-up {gu:6.0f} ({fl_gu / gu / 1e6:4.0f} TF/s) + down "
          f"{dn:6.0f} ({fl_dn / dn / 1e6:4.0f} TF/s){note}", flush=True)
    print(f"    2nd half: {sampler.window((t0 + t1) / 2, t1)}", flush=True)


def sweep(args, ours, native, pair, gu_cfg, dn_cfg, sampler, h, y, fl_gu, fl_dn) -> None:
    """Each candidate config of one GEMM, the other at its default; defaults and torch first and last."""
    run_window(ours, 0.3)
    torch.cuda.synchronize()
    ref_h, ref_y = h.clone(), y.clone()
    cases = [("default pair", ours), ("torch", native)]
    cases += [(f"gate-up {c}", pair(GemmTileConfig.parse(c), dn_cfg)) for c in SWEEP_GATE_UP]
    cases += [(f"down {c}", pair(gu_cfg, GemmTileConfig.parse(c))) for c in SWEEP_DOWN]
    cases += [("default pair", ours), ("torch", native)]
    for name, fn in cases:
        time.sleep(0.5)
        try:
            run_window(fn, 0.2)  # compile
            times, t0, t1 = run_window(fn, args.seconds)
        except Exception as exc:  # a config that does not fit (shared memory, registers)
            print(f"{name:34s}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        same = "" if name == "torch" else (f"; h == default: {torch.equal(h, ref_h)}, y == default: "
                                           f"{torch.equal(y, ref_y)}")
        print_sustained(f"{name:34s}", times, t0, t1, sampler, fl_gu, fl_dn, same)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sweep", action="store_true", help="time candidate tile configs (SWEEP_*), sustained")
    args = ap.parse_args()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    sms = props.multi_processor_count
    gu_cfg, dn_cfg = default_gemm_configs(torch.bfloat16, "cuda")
    x, idx, off, w1, w2 = rank_case(dev, 4, 16)
    rows = int(off[-1])
    tile_maps = {bm: build_tile_map(off, bm) for bm in (64, 128, 256)}
    h = torch.empty(rows, I, dtype=torch.bfloat16, device=dev)
    y = torch.empty(rows, H, dtype=torch.bfloat16, device=dev)
    xc = x.index_select(0, idx.long())  # torch's rows, contiguous (an all_to_all delivers them so)
    offs_end = off[1:].contiguous()

    def pair(gu: GemmTileConfig, dn: GemmTileConfig):
        def step(ev):
            ev[0].record()
            launch_grouped_swiglu(x, idx, w1, h, off, tile_maps[gu.block_m], gu, sms, "tf32", 1)
            ev[1].record()
            launch_grouped_down(h, w2, y, off, tile_maps[dn.block_m], dn, sms, "tf32", 1)
            ev[2].record()
        return step

    ours = pair(gu_cfg, dn_cfg)

    def native(ev):
        ev[0].record()
        gu = torch._grouped_mm(xc, w1, offs=offs_end)
        hh = F.silu(gu[:, :I]) * gu[:, I:]
        ev[1].record()
        torch._grouped_mm(hh, w2, offs=offs_end)
        ev[2].record()

    sampler = board_sampler(props)
    fl_gu, fl_dn = 4.0 * rows * H * I, 2.0 * rows * I * H
    print(f"# {props.name}, {sms} SMs, triton {triton.__version__}, torch {torch.__version__}; {rows} rows, "
          f"16 experts, H={H} I={I} bf16; ours gate-up {gu_cfg}, down {dn_cfg}, {sms} programs, tiles M-major; "
          f"torch: _grouped_mm + silu*mul + _grouped_mm; {args.seconds:.1f} s a window", flush=True)
    for fn in (ours, native):  # compile and warm up
        run_window(fn, 0.3)
    if args.sweep:
        sweep(args, ours, native, pair, gu_cfg, dn_cfg, sampler, h, y, fl_gu, fl_dn)
        sampler.stop()
        return
    ref = None
    for rnd in range(args.rounds):
        for name, fn in (("ours", ours), ("torch", native)):
            time.sleep(1.0)  # a short idle gap, as between a benchmark's cases
            times, t0, t1 = run_window(fn, args.seconds)
            half = times[len(times) // 2:]
            burst = med([t[2] for t in times[:10]])
            gu, dn, tot = (med([t[i] for t in half]) for i in range(3))
            print(f"round {rnd} {name:5s}: {len(times)} calls; burst (first 10) {burst:7.0f} us; sustained (2nd half) "
                  f"{tot:7.0f} us = gate-up {gu:6.0f} ({fl_gu / gu / 1e6:4.0f} TF/s) + down {dn:6.0f} "
                  f"({fl_dn / dn / 1e6:4.0f} TF/s); p20-p80 {sorted(t[2] for t in half)[len(half) // 5]:.0f}-"
                  f"{sorted(t[2] for t in half)[4 * len(half) // 5]:.0f}", flush=True)
            print(f"    first half: {sampler.window(t0, (t0 + t1) / 2)}", flush=True)
            print(f"    2nd half:   {sampler.window((t0 + t1) / 2, t1)}", flush=True)
            if name == "ours":
                if ref is None:
                    ref = y.clone()
                elif not torch.equal(ref, y):
                    print("    !! ours: output differs from round 0's", flush=True)
    sampler.stop()


if __name__ == "__main__":
    main()
