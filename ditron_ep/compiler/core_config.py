"""Core level of the plan: the tile program of one GEMM (block shape, warps, pipeline stages).

A `GemmTileConfig` is plain frozen data: printable, hashable (a cache key), easy to sweep
(`python -m ditron_ep bench --bench grouped_gemm --opt sweep=1` times several). `default_gemm_configs` gives the starting points of the grouped SwiGLU FFN:

* NVIDIA (sm_90), bf16/fp16: gate-up BM=128 BN=128 BK=64 (gate and up column blocks of BN
  each, one dot of width 2*BN: a tile covers 256 columns of W1), 8 warps, 4 stages; down
  BM=128 BN=256 BK=64, 8 warps, 4 stages — the tile that reached 649 TFLOP/s on an H200
  (7168→4096, rows gathered; measured when the project started).
  Shared memory per stage: gate-up (BM·BK + 2·BK·BN)·2 B, down (BM·BK + BK·BN)·2 B, 48 KiB each;
  192 KiB for 4 stages (sm_90 allows 227 KiB); 255 registers a thread, no spills (ptxas).
* AMD (gfx942) has 64 KiB of LDS per workgroup: the same tiles with 2 stages (48 KiB). Untuned:
  no AMD GPU has run them yet.
* The CPU (Triton interpreter) gets 16/32 tiles: tests use tiny shapes and want ragged edges.

Shared-memory figures are Triton 3.6's, compiled with H and I divisible by 16 (as real launches
are specialised; without that Triton does not pipeline the K-loop at all).
"""
from __future__ import annotations

import dataclasses
import re

import torch

__all__ = ["DEVICE_TYPES", "device_type_of", "EXPERT_GEMMS", "GemmTileConfig", "default_backward_configs", "default_expert_configs",
           "default_gemm_configs"]

# The expert MLP's GEMM kernels, each with its own (path, tile) in grouped_mlp: the first GEMM with
# the activation, the second, the activation-gradient GEMM, dgrad and wgrad.
EXPERT_GEMMS = ("up", "down", "act_grad", "dgrad", "wgrad")

DEVICE_TYPES = ("cpu", "cuda", "hip")


def device_type_of(device: torch.device) -> str:
    """The DEVICE_TYPES key of a tensor's device: "cpu" (interpreter), "cuda" (NVIDIA) or "hip"
    (ROCm, whose devices torch also calls "cuda")."""
    if device.type == "cpu":
        return "cpu"
    return "hip" if torch.version.hip else "cuda"

_MIN_BLOCK = 16  # tl.dot needs every dimension >= 16
_MAX_BLOCK = 512


def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


@dataclasses.dataclass(frozen=True)
class GemmTileConfig:
    """One GEMM tile program: a [block_m, block_n] output tile, K consumed block_k at a time.

    block_m / block_n / block_k: powers of two in [16, 512]; num_warps: 1, 2, 4, 8 or 16;
    num_stages: software-pipeline depth, 1..8.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps", "num_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"GemmTileConfig.{name} must be an int, got {v!r}")
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if not (_is_pow2(v) and _MIN_BLOCK <= v <= _MAX_BLOCK):
                raise ValueError(f"GemmTileConfig.{name} must be a power of two in [{_MIN_BLOCK}, {_MAX_BLOCK}] "
                                 f"(tl.dot needs >= 16), got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GemmTileConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"GemmTileConfig.num_stages must be in [1, 8], got {self.num_stages}")

    def launch_options(self) -> dict[str, int]:
        """The Triton launch / compile options of this tile: num_warps and num_stages."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}

    def __str__(self) -> str:
        return (f"BM{self.block_m}-BN{self.block_n}-BK{self.block_k}-"
                f"w{self.num_warps}-s{self.num_stages}")

    @classmethod
    def parse(cls, text: str) -> GemmTileConfig:
        """The inverse of str(): "BM128-BN256-BK64-w8-s4" -> GemmTileConfig(128, 256, 64, 8, 4)."""
        m = re.fullmatch(r"BM(\d+)-BN(\d+)-BK(\d+)-w(\d+)-s(\d+)", text.strip())
        if m is None:
            raise ValueError(f"GEMM tile config {text!r}: expected BM<m>-BN<n>-BK<k>-w<warps>-s<stages>, "
                             f"e.g. BM128-BN256-BK64-w8-s4")
        return cls(*(int(g) for g in m.groups()))


_FP32 = torch.float32
_HALF = (torch.bfloat16, torch.float16)

# (device_type, half precision?) -> (gate-up, down)
_DEFAULTS: dict[tuple[str, bool], tuple[GemmTileConfig, GemmTileConfig]] = {
    ("cuda", True): (GemmTileConfig(128, 128, 64, 8, 4), GemmTileConfig(128, 256, 64, 8, 4)),
    # fp32 elements take twice the bytes: BK=32 and half-width gate-up tiles, 32 KiB a stage, 3 stages.
    ("cuda", False): (GemmTileConfig(128, 64, 32, 8, 3), GemmTileConfig(128, 128, 32, 8, 3)),
    # gfx942's stream pipeliner keeps num_stages - 1 K-blocks in LDS: 48 KiB for these two.
    ("hip", True): (GemmTileConfig(128, 128, 64, 8, 2), GemmTileConfig(128, 256, 64, 8, 2)),
    ("hip", False): (GemmTileConfig(64, 64, 32, 4, 2), GemmTileConfig(64, 128, 32, 4, 2)),
    # Interpreter: BK=32 with BN=16 / BK=16 with BN=32 so that small test shapes are ragged in every dim.
    ("cpu", True): (GemmTileConfig(16, 16, 32, 4, 1), GemmTileConfig(16, 32, 16, 4, 1)),
    ("cpu", False): (GemmTileConfig(16, 16, 32, 4, 1), GemmTileConfig(16, 32, 16, 4, 1)),
}


def default_gemm_configs(dtype: torch.dtype, device_type: str) -> tuple[GemmTileConfig, GemmTileConfig]:
    """(gate_up_cfg, down_cfg) for the grouped SwiGLU FFN.

    Args:
        dtype: activation / weight dtype (bfloat16, float16 or float32).
        device_type: "cuda" (NVIDIA), "hip" (AMD ROCm) or "cpu" (Triton interpreter).
    """
    if dtype not in (_FP32, *_HALF):
        raise ValueError(f"no GEMM config for {dtype}; use bfloat16, float16 or float32")
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type must be one of {DEVICE_TYPES}, got {device_type!r} "
                         f"(ROCm devices report torch device type 'cuda': pass 'hip' for them)")
    return _DEFAULTS[(device_type, dtype in _HALF)]


# The first GEMM of a plain (non-gated) expert MLP on NVIDIA in half precision: its tile holds one
# accumulator where a gated tile holds two (gate and up, sharing the A tile), so the gated
# default's 128 x 128 does half the MMA work per A load here. 256 x 128, 3 stages: a DeepSpeed
# block's up GEMM 2.39 -> 2.11 ms (460 -> 522 TFLOP/s; H200, 8 experts x 1,024 rows, H=4096,
# I=16384, GELU; 128 x 256: 2.27 ms), same bits (bench/results/up_tile_ds_H200x2_20261127_s23.log).
PLAIN_UP_CUDA_HALF = GemmTileConfig(256, 128, 64, 8, 3)

# FP8 rows (DeepEP's format): one fp32 scale per row and SCALE_COLS columns — what the EP
# dispatch carries and the grouped GEMM's A-load applies (its kernels write 128 as a literal)
SCALE_COLS = 128


def default_backward_configs(dtype: torch.dtype, device_type: str) -> dict[str, GemmTileConfig]:
    """Tile configs of the expert MLP's backward kernels (grouped_gemm_kernels.py), by kernel:
    "act_grad" (dh = dy @ W2^T, [rows, I] tiles over K = H, activation backward in the epilogue),
    "dgrad" (dx = dz @ W1^T, [rows, H] tiles over K = n*I) and "wgrad" (per expert a^T @ b,
    [a cols, b cols] tiles over the expert's rows). Elsewhere act_grad and wgrad take the (gated)
    first GEMM's tile and dgrad the second's. On NVIDIA in half precision, wgrad is 128 x 256 with
    3 stages (a whole forward + backward at the layer shape 19.1 -> 18.3 ms on an H200, rows=32768,
    E_local=32, H=7168, I=2048; bench/results/backward_tiles_H200_20261126_s16.log), and so is
    act_grad, its epilogue run on a quarter of the columns at a time (grouped_gemm_kernels.act_grad_parts:
    the whole tile's dh, gate and up in fp32 at once spilled registers): 2,665 -> 1,838 us at the
    layer shape on an H100 against the 128 x 128 tile, bitwise equal
    (bench/results/act_grad_parts_H100_20261127_s24_96260f9.log). dgrad keeps the second GEMM's
    tile (others were slower in session 16)."""
    up, down = default_gemm_configs(dtype, device_type)
    if (device_type, dtype in _HALF) == ("cuda", True):
        wide = GemmTileConfig(128, 256, 64, 8, 3)
        return {"act_grad": wide, "dgrad": down, "wgrad": wide}
    return {"act_grad": up, "dgrad": down, "wgrad": up}


def default_expert_configs(dtype: torch.dtype, device_type: str,
                           forward: tuple[GemmTileConfig, GemmTileConfig] | None = None) -> dict[str, GemmTileConfig]:
    """The portable tile of each of EXPERT_GEMMS: `forward` (gate-up, down), else
    default_gemm_configs, and default_backward_configs."""
    up, down = forward if forward is not None else default_gemm_configs(dtype, device_type)
    return {"up": up, "down": down, **default_backward_configs(dtype, device_type)}
