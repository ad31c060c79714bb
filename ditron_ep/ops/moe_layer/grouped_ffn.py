"""Grouped SwiGLU expert FFN over expert-major rows (the MoE experts of one rank).

    y[r] = (silu(x_r @ W1[e][:, :I]) * (x_r @ W1[e][:, I:])) @ W2[e]    for expert_offsets[e] <= r < expert_offsets[e+1]

where x_r = x[row_index[r]] (rows gathered in place, e.g. from a receive buffer) or x[r]. Two
persistent launches (`ops/moe_layer/grouped_gemm_kernels.py`): gate-up GEMM with SwiGLU in its epilogue into
h [rows, I] (x's dtype), then the down GEMM. Neither launch reads anything back to the host, so
the op can be captured in a CUDA graph.

Gradients (`_GroupedSwiGLUFFN`): a staged backward in fp32 torch ops, one expert after another,
each GEMM over that expert's rows only (no atomics, no split of a reduction): dgrad and wgrad of
both GEMMs with the SwiGLU backward, recomputing the gate and up projections. Deterministic run to
run; not fused and not yet fast (issue "training": the fused backward comes with the GEMM core).
Gradients through `row_index` (gathered rows) are not supported yet.
"""
from __future__ import annotations

import torch
import triton

from ditron_ep.compiler.core_config import GemmTileConfig, default_gemm_configs
from ditron_ep.compiler.plan import is_positive_int
from ditron_ep.ops.moe_layer.grouped_gemm_kernels import (
    build_tile_map,
    grouped_down_kernel,
    grouped_swiglu_kernel,
    max_m_tiles,
)
from ditron_ep.runtime.mode import gemm_dtype_problem, kernels_interpreted

__all__ = ["MAX_LOCAL_EXPERTS", "grouped_swiglu_ffn", "grouped_swiglu_ffn_backward", "launch_grouped_down",
           "launch_grouped_swiglu"]

MAX_LOCAL_EXPERTS = 256  # the tile map's expert search is one vector of next_pow2(E_local) lanes
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_PRECISIONS = ("ieee", "tf32")


def grouped_swiglu_ffn(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    row_index: torch.Tensor | None = None,
    config: tuple[GemmTileConfig, GemmTileConfig] | None = None,
    num_programs: int | None = None,
    input_precision: str | None = None,
    group_rows: int = 1,
    out: torch.Tensor | None = None,
    check: bool | None = None,
) -> torch.Tensor:
    """SwiGLU FFN of every local expert over its rows; returns y [rows, H] in x's dtype.

    Args:
        x: [N, H] bfloat16 / float16 / float32 activations, contiguous.
        expert_offsets: int32 [E_local + 1] on x's device, nondecreasing, expert_offsets[0] == 0:
            rows expert_offsets[e]:expert_offsets[e+1] belong to local expert e. The total
            expert_offsets[-1] may be below rows (a fixed-capacity buffer): rows past it are
            returned as zeros. Values are checked as `check` says.
        w1: [E_local, H, 2I] gate ‖ up, x's dtype, contiguous.
        w2: [E_local, I, H], x's dtype, contiguous.
        row_index: optional int32 [rows] on x's device: row r reads x[row_index[r]], values in
            [0, N). Without it rows = N and row r reads x[r].
        config: (gate_up, down) tile configs; default `default_gemm_configs(x.dtype, device)`.
        num_programs: persistent grid size; default the SM count on a GPU, 1 under the
            interpreter. Results are bitwise identical for every grid size (no split-K).
        input_precision: float32 inputs only: "tf32" (GPU default) or "ieee" (interpreter
            default; needed for float32-exact results on a GPU).
        group_rows: tile order, M-tiles (row tiles) a group (`grouped_tile`): within a group each
            weight column block goes over the group's rows before the next. Default 1, M-tile
            major: on this op's fixed program-to-tile grid it was the fastest on an H200 at the
            MoE layer's shapes (groups of 2-16: gate-up up to 14 % slower, down 15-22 %;
            bench/results/tile_order_H200_20261122_s9.log). Results are bitwise identical for
            every order.
        out: optional [rows, H] contiguous output buffer in x's dtype (written and returned).
        check: how the VALUES of expert_offsets and row_index are checked (their shapes and dtypes
            always are). True: on the host, ValueError if wrong (a device sync on a GPU). None
            (default): on the host under the interpreter (no sync there); on a GPU, no sync:
            the offsets are made valid on the device (clamped to [0, rows], nondecreasing, first
            0) and row_index clamped to [0, N), so wrong values give wrong rows, each written
            once — never stray reads or writes, never unwritten memory. Valid values pass
            unchanged. False: used as given, for callers that built them (the library's own
            dispatch handles); rows stay clamped to [0, rows), but a row_index value out of
            [0, N) reads out of bounds.

    Accumulation is fp32; the SwiGLU activation h is rounded to x's dtype before the down GEMM.
    """
    rows, hidden, inter, num_local = _validate(x, expert_offsets, w1, w2, row_index)
    if check not in (None, True, False):
        raise ValueError(f"check must be True, False or None, got {check!r}")
    if check or (check is None and x.device.type == "cpu"):
        _check_values(expert_offsets, row_index, rows, x.shape[0])
    elif check is None:
        expert_offsets, row_index = _made_valid(expert_offsets, row_index, rows, x.shape[0])
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, w1, w2))
    if needs_grad and row_index is not None:
        raise NotImplementedError("grouped_swiglu_ffn: gradients through row_index (gathered rows) are not "
                                  "implemented yet; gather the rows first (x[row_index]) and pass no row_index")
    if needs_grad and out is not None:
        raise ValueError("grouped_swiglu_ffn: out= cannot be used when gradients are needed; leave it None")
    device_type = _device_type(x.device)
    if config is None:
        config = default_gemm_configs(x.dtype, device_type)
    if not isinstance(config, (tuple, list)) or len(config) != 2 \
            or not all(isinstance(cfg, GemmTileConfig) for cfg in config):
        raise ValueError(f"config must be a pair of GemmTileConfig (gate_up_cfg, down_cfg), or None for the "
                         f"defaults; got {config!r}")
    gate_up_cfg, down_cfg = config
    if num_programs is None:
        num_programs = 1 if device_type == "cpu" else torch.cuda.get_device_properties(x.device).multi_processor_count
    elif not is_positive_int(num_programs):
        raise ValueError(f"num_programs must be a positive int, got {num_programs!r}")
    if not is_positive_int(group_rows):
        raise ValueError(f"group_rows must be a positive int (row tiles a group of the tile order), got {group_rows!r}")
    if input_precision is None:
        input_precision = "ieee" if device_type == "cpu" else "tf32"
    elif input_precision not in _PRECISIONS:
        raise ValueError(f"input_precision must be one of {_PRECISIONS} or None, got {input_precision!r}")

    if needs_grad:
        return _GroupedSwiGLUFFN.apply(x, w1, w2, expert_offsets, (gate_up_cfg, down_cfg), num_programs,
                                       input_precision, group_rows)
    return _forward(x, expert_offsets, w1, w2, row_index, gate_up_cfg, down_cfg, num_programs, input_precision,
                    group_rows, out)


def _forward(x, expert_offsets, w1, w2, row_index, gate_up_cfg, down_cfg, num_programs, input_precision,
             group_rows, out):
    """The two launches on validated inputs; returns y [rows, H]."""
    rows = x.shape[0] if row_index is None else row_index.shape[0]
    hidden, inter = x.shape[1], w2.shape[1]
    if out is None:
        out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    elif not isinstance(out, torch.Tensor) or out.shape != (rows, hidden) or out.dtype != x.dtype \
            or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape [rows={rows}, H={hidden}] on "
                         f"{x.device}, got {_describe(out)}")
    if rows == 0:
        return out
    h = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    # one map per distinct block_m (the default configs share it)
    tile_maps = {bm: build_tile_map(expert_offsets, bm) for bm in {gate_up_cfg.block_m, down_cfg.block_m}}
    launch_grouped_swiglu(x, row_index, w1, h, expert_offsets, tile_maps[gate_up_cfg.block_m], gate_up_cfg,
                          num_programs, input_precision, group_rows)
    launch_grouped_down(h, w2, out, expert_offsets, tile_maps[down_cfg.block_m], down_cfg, num_programs,
                        input_precision, group_rows)
    return out


class _GroupedSwiGLUFFN(torch.autograd.Function):
    """Forward: the grouped FFN launches. Backward: `grouped_swiglu_ffn_backward`."""

    @staticmethod
    def forward(ctx, x, w1, w2, expert_offsets, config, num_programs, input_precision, group_rows):
        ctx.save_for_backward(x, w1, w2, expert_offsets)
        return _forward(x, expert_offsets, w1, w2, None, *config, num_programs, input_precision, group_rows, None)

    @staticmethod
    def backward(ctx, grad_y):
        x, w1, w2, expert_offsets = ctx.saved_tensors
        need_x, need_w1, need_w2 = ctx.needs_input_grad[:3]
        grad_x, grad_w1, grad_w2 = grouped_swiglu_ffn_backward(x, expert_offsets, w1, w2, grad_y,
                                                               need_x=need_x, need_w=need_w1 or need_w2)
        return grad_x, grad_w1, grad_w2, None, None, None, None, None


def grouped_swiglu_ffn_backward(x: torch.Tensor, expert_offsets: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                                grad_y: torch.Tensor, *, need_x: bool = True, need_w: bool = True
                                ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of `grouped_swiglu_ffn` (no row_index) for grad_y [rows, H].

    Per local expert e, on its rows R (fp32 throughout, recomputing gate and up):
        g, u = x_R @ W1[e] split; a = silu(g); h = a * u
        grad_W2[e] = h^T @ grad_y_R;  dh = grad_y_R @ W2[e]^T
        du = dh * a;  dg = dh * u * sigmoid(g) * (1 + g * (1 - sigmoid(g)))
        grad_W1[e] = x_R^T @ [dg | du];  grad_x_R = [dg | du] @ W1[e]^T
    Each sum runs over one expert's rows in one GEMM, experts one after another: deterministic.
    Rows of no expert get zero gradient; experts without rows zero weight gradients. The forward
    rounds h to x's dtype before the down GEMM; this backward does not (its error is that rounding).
    Returns (grad_x, grad_w1, grad_w2) in the inputs' dtypes (None where not needed).
    """
    offsets = expert_offsets.tolist()  # one host read: the staged backward walks the experts on the host
    inter = w2.shape[1]
    f32 = torch.float32
    grad_x = torch.zeros(x.shape, dtype=f32, device=x.device) if need_x else None
    grad_w1 = torch.zeros(w1.shape, dtype=f32, device=w1.device) if need_w else None
    grad_w2 = torch.zeros(w2.shape, dtype=f32, device=w2.device) if need_w else None
    for e in range(w1.shape[0]):
        lo, hi = offsets[e], offsets[e + 1]
        if hi <= lo:
            continue
        x_e, w1_e = x[lo:hi].to(f32), w1[e].to(f32)
        gate_up = x_e @ w1_e  # [n, 2I]
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        sig = torch.sigmoid(gate)
        act = gate * sig
        dy = grad_y[lo:hi].to(f32)
        dh = dy @ w2[e].to(f32).T  # [n, I]
        d_gate_up = torch.cat([dh * up * sig * (1 + gate * (1 - sig)), dh * act], dim=1)
        if need_w:
            grad_w2[e] = (act * up).T @ dy
            grad_w1[e] = x_e.T @ d_gate_up
        if need_x:
            grad_x[lo:hi] = d_gate_up @ w1_e.T
    cast = (lambda t, like: None if t is None else t.to(like.dtype))
    return cast(grad_x, x), cast(grad_w1, w1), cast(grad_w2, w2)


def launch_grouped_swiglu(x: torch.Tensor, row_index: torch.Tensor | None, w1: torch.Tensor, h: torch.Tensor,
                          expert_offsets: torch.Tensor, tile_start: torch.Tensor, cfg: GemmTileConfig,
                          num_programs: int, input_precision: str, group_rows: int) -> None:
    """h[r] = silu(x_r @ gate) * (x_r @ up) for the rows of every expert (`grouped_swiglu_kernel`),
    tiles in groups of group_rows M-tiles (`grouped_tile`).

    h: [rows, I]; rows of no expert are not written. tile_start = build_tile_map(expert_offsets,
    cfg.block_m). Inputs as validated by `grouped_swiglu_ffn`; this launcher checks nothing.
    """
    rows, inter = h.shape
    num_local, hidden = w1.shape[0], w1.shape[1]
    m_cap = max_m_tiles(rows, num_local, cfg.block_m)
    grid = (min(num_programs, m_cap * triton.cdiv(inter, cfg.block_n)),)
    grouped_swiglu_kernel[grid](
        x, row_index if row_index is not None else expert_offsets, w1, h, tile_start, expert_offsets,
        rows, m_cap, hidden, inter, num_local, min(group_rows, m_cap),  # no int32 overflow of group * N-tiles
        HAS_IDX=row_index is not None, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
        BLOCK_E=triton.next_power_of_2(num_local), INPUT_PRECISION=input_precision, **cfg.launch_options())


def launch_grouped_down(h: torch.Tensor, w2: torch.Tensor, y: torch.Tensor, expert_offsets: torch.Tensor,
                        tile_start: torch.Tensor, cfg: GemmTileConfig, num_programs: int,
                        input_precision: str, group_rows: int) -> None:
    """y[r] = h[r] @ W2[e] for the rows of every expert, zeros in rows of no expert past the last
    (`grouped_down_kernel`). y: [rows, H]; tile_start = build_tile_map(expert_offsets, cfg.block_m);
    tiles in groups of group_rows M-tiles (`grouped_tile`)."""
    rows, hidden = y.shape
    num_local, inter = w2.shape[0], w2.shape[1]
    m_cap = max_m_tiles(rows, num_local, cfg.block_m)
    grid = (min(num_programs, m_cap * triton.cdiv(hidden, cfg.block_n)),)
    grouped_down_kernel[grid](
        h, w2, y, tile_start, expert_offsets, rows, m_cap, inter, hidden, num_local, min(group_rows, m_cap),
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, BLOCK_E=triton.next_power_of_2(num_local),
        INPUT_PRECISION=input_precision, **cfg.launch_options())


def _describe(t: object) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ' (not contiguous)'}"


def _device_type(device: torch.device) -> str:
    """'cpu' (interpreter), 'cuda' or 'hip': the key of default_gemm_configs."""
    if device.type == "cpu":
        return "cpu"
    return "hip" if torch.version.hip else "cuda"


def _check_values(expert_offsets: torch.Tensor, row_index: torch.Tensor | None, rows: int, n: int) -> None:
    """ValueError unless expert_offsets starts at 0, never decreases and ends <= rows, and every
    row_index value is in [0, n). Reads both to the host."""
    off = expert_offsets.tolist()
    if off[0] != 0 or any(b < a for a, b in zip(off, off[1:])) or off[-1] > rows:
        raise ValueError(f"expert_offsets must start at 0, never decrease and end at most at rows={rows}, got "
                         f"{off if len(off) <= 20 else off[:20] + ['...']}")
    if row_index is not None and row_index.numel():
        lo, hi = int(row_index.min()), int(row_index.max())
        if lo < 0 or hi >= n:
            raise ValueError(f"row_index values must be in [0, N={n}) (rows of x), got values from {lo} to {hi}")


def _made_valid(expert_offsets: torch.Tensor, row_index: torch.Tensor | None, rows: int,
                n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Device ops only (no host sync): offsets clamped to [0, rows], first 0, nondecreasing;
    row_index clamped to [0, n). Valid inputs come back equal (so results do not change)."""
    off = expert_offsets.clamp(0, rows)
    off[0] = 0
    off = torch.cummax(off, dim=0).values.to(torch.int32)
    if row_index is not None:
        row_index = row_index.clamp(0, max(n - 1, 0))
    return off, row_index


def _validate(x: torch.Tensor, expert_offsets: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              row_index: torch.Tensor | None) -> tuple[int, int, int, int]:
    """Raise ValueError saying what to fix; return (rows, H, I, E_local)."""
    named = [("x", x), ("expert_offsets", expert_offsets), ("w1", w1), ("w2", w2)]
    if row_index is not None:
        named.append(("row_index", row_index))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}; cast it with x.to(...)")
    for name, t in (("w1", w1), ("w2", w2)):
        if t.dtype != x.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but x has {x.dtype}; cast {name} to {x.dtype}")
    for name, t in named[1:]:
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}; put every input on one device")
    interpreted = kernels_interpreted()
    if interpreted != (x.device.type == "cpu"):
        raise ValueError(
            f"x is on {x.device} but ditron_ep's kernels are {'interpreted' if interpreted else 'compiled'}: "
            f"CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before importing ditron_ep), "
            f"GPU tensors compiled kernels (leave TRITON_INTERPRET unset on a GPU machine)")
    problem = gemm_dtype_problem(x.dtype)
    if problem:
        raise ValueError(problem)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [N, H], got shape {tuple(x.shape)}")
    hidden = x.shape[1]
    if hidden == 0:
        raise ValueError("x has hidden size 0")
    if w1.ndim != 3 or w1.shape[1] != hidden or w1.shape[2] == 0 or w1.shape[2] % 2:
        raise ValueError(f"w1 must have shape [E_local, H={hidden}, 2I] with 2I even and > 0 (gate ‖ up), "
                         f"got {tuple(w1.shape)}")
    num_local, inter = w1.shape[0], w1.shape[2] // 2
    if not 1 <= num_local <= MAX_LOCAL_EXPERTS:
        raise ValueError(f"w1 holds {num_local} local experts; supported: 1..{MAX_LOCAL_EXPERTS}")
    if tuple(w2.shape) != (num_local, inter, hidden):
        raise ValueError(f"w2 must have shape [E_local={num_local}, I={inter}, H={hidden}] to match w1 "
                         f"{tuple(w1.shape)}, got {tuple(w2.shape)}")
    if expert_offsets.dtype != torch.int32 or expert_offsets.ndim != 1:
        raise ValueError(f"expert_offsets must be a 1-D int32 tensor [E_local + 1], got {expert_offsets.dtype} "
                         f"of shape {tuple(expert_offsets.shape)}")
    if expert_offsets.shape[0] != num_local + 1:
        raise ValueError(f"expert_offsets has {expert_offsets.shape[0]} entries but w1 holds E_local={num_local} "
                         f"experts: it needs E_local + 1 = {num_local + 1} (first row of each expert, then the end)")
    if row_index is None:
        rows = x.shape[0]
    else:
        if row_index.dtype != torch.int32 or row_index.ndim != 1:
            raise ValueError(f"row_index must be a 1-D int32 tensor [rows], got {row_index.dtype} of shape "
                             f"{tuple(row_index.shape)}")
        rows = row_index.shape[0]
        if rows and x.shape[0] == 0:
            raise ValueError(f"row_index has {rows} rows to gather but x has none; pass an x with rows")
    for name, t in named:
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous; pass {name}.contiguous()")
    return rows, hidden, inter, num_local
