"""Grouped expert MLPs over expert-major rows (the MoE experts of one rank), forward and backward.

    z[r] = x_r @ W1[e] (+ b1[e]);  h[r] = act(gate) * up or act(z);  y[r] = h[r] @ W2[e] (+ b2[e])
    for expert_offsets[e] <= r < expert_offsets[e+1]

(experts.py: SwiGLU, GeGLU, GELU, GELU-tanh, ReLU, SiLU), where x_r = x[row_index[r]] (rows
gathered in place, e.g. from a receive buffer) or x[r]. Two persistent launches
(`grouped_gemm_kernels.py`): the first GEMM with the activation in its epilogue into h [rows, I]
(x's dtype), then the second. Neither reads anything back to the host, so the op can be
captured in a CUDA graph.

Gradients (`_GroupedUp`, `_GroupedDown`), three more launches, each output tile one fp32 dot over its whole
reduction in a fixed order (no atomics, no split): dh = dy @ W2^T with the activation's
backward fused (dz, and h recomputed from z), dx = dz @ W1^T, and per expert
grad_W1 = x^T dz, grad_W2 = h^T dy (+ the bias gradients as column sums), the expert's rows
in row order. The forward saves the pre-activation z (x's dtype, [rows, n*I]) unless
save_preactivation=False, which recomputes it in the backward with the first GEMM.
Gradients through `row_index` (gathered rows, e.g. a token-major dispatch's `handle.row_index`):
the backward gathers x[row_index] (what the forward read in place) and adds each x row's row
gradients in ascending row order in fp32 (`sum_rows_into`; one host read, so not in a CUDA graph).
"""
from __future__ import annotations

import torch
import triton
from torch.autograd.graph import increment_version

from ditron_ep.compiler.core_config import (EXPERT_GEMMS, PLAIN_UP_CUDA_HALF, SCALE_COLS, GemmTileConfig,
                                            default_expert_configs, default_gemm_configs, device_type_of)
from ditron_ep.compiler.plan import is_positive_int
from ditron_ep.compiler.tuner import tuned_choices
from ditron_ep.ops.moe_layer.experts import activation_code, check_activation, width_factor
from ditron_ep.ops.moe_layer.grouped_gemm_kernels import (
    act_grad_parts,
    build_tile_map,
    grouped_act_grad_kernel,
    grouped_dgrad_kernel,
    grouped_down_kernel,
    grouped_up_kernel,
    grouped_wgrad_kernel,
    max_m_tiles,
)
from ditron_ep.ops.moe_layer import hopper_path
from ditron_ep.ops.moe_layer.hopper_path import PATHS, default_hopper_configs, path_problem
from ditron_ep.runtime.errors import DitronConfigError
from ditron_ep.runtime.fast_launch import capturing, fast
from ditron_ep.runtime.input_checks import grad_needed
from ditron_ep.runtime.mode import gemm_dtype_problem, kernels_interpreted

__all__ = ["MAX_LOCAL_EXPERTS", "add_main_grad", "check_grad_dtype", "grouped_mlp", "launch_grouped_down",
           "launch_grouped_up", "main_grad_of"]

MAX_LOCAL_EXPERTS = 256  # the tile map's expert search is one vector of next_pow2(E_local) lanes
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_PRECISIONS = ("ieee", "tf32")
GRAD_DTYPES = (None, torch.float32)


def check_grad_dtype(grad_dtype: object) -> None:
    """DitronConfigError (a ValueError) unless grad_dtype is one of GRAD_DTYPES."""
    if grad_dtype not in GRAD_DTYPES:
        raise DitronConfigError(f"grad_dtype must be None (the weights' dtype) or torch.float32, got {grad_dtype!r}")


def grouped_mlp(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: str = "swiglu",
    row_index: torch.Tensor | None = None,
    config: tuple[GemmTileConfig, GemmTileConfig] | None = None,
    num_programs: int | None = None,
    input_precision: str | None = None,
    group_rows: int | None = None,
    out: torch.Tensor | None = None,
    check: bool | None = None,
    grad_dtype: torch.dtype | None = None,
    save_preactivation: bool = True,
    path: str = "auto",
    x_is_scratch: bool = False,
    x_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MLP of every local expert over its rows; returns y [rows, H] in x's dtype.

    Args:
        x: [N, H] bfloat16 / float16 / float32 activations, contiguous.
        expert_offsets: int32 [E_local + 1] on x's device, nondecreasing, expert_offsets[0] == 0:
            rows expert_offsets[e]:expert_offsets[e+1] belong to local expert e. The total
            expert_offsets[-1] may be below rows (a fixed-capacity buffer): rows past it are
            returned as zeros. Values are checked as `check` says.
        w1: [E_local, H, n*I] (n = 2 for gated activations: gate ‖ up), x's dtype, any strides
            (e.g. nn.Linear weights [E_local, n*I, H] stacked and transposed: a view, no copy).
        w2: [E_local, I, H], x's dtype, any strides.
        b1, b2: optional biases [E_local, n*I] and [E_local, H], x's dtype, contiguous.
        activation: one of experts.ACTIVATIONS ("swiglu", "geglu", "gelu", "gelu_tanh", "relu",
            "silu").
        row_index: optional int32 [rows] on x's device: row r reads x[row_index[r]], values in
            [0, N). Without it rows = N and row r reads x[r].
        config: (first GEMM, second GEMM) tile configs; default `default_gemm_configs(x.dtype, device)`
            (a plain activation's first GEMM on NVIDIA: see `kernel_choices`).
        num_programs: persistent grid size; default the SM count on a GPU, 1 under the
            interpreter. Results are bitwise identical for every grid size (no split-K).
        input_precision: float32 inputs only: "tf32" (GPU default) or "ieee" (interpreter
            default; needed for float32-exact results on a GPU).
        group_rows: tile order, M-tiles (row tiles) a group (`grouped_tile`): within a group each
            weight column block goes over the group's rows before the next. Default None: per
            kernel, 1 (M-tile major) unless its column tiles fill half the grid (`auto_group_rows`).
            Results are bitwise identical for every order.
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
        grad_dtype: None: the weight and bias gradients go to `.grad` in the weights' dtype.
            torch.float32 with bf16 / fp16 weights (frameworks that keep fp32 main gradients):
            they are computed in fp32 and added to each weight's `main_grad` (an fp32 tensor of
            its shape, created as zeros when missing), and `.grad` gets none (autograd would cast
            them to the weights' dtype). The weights must then be leaf tensors (Parameters).
        save_preactivation: with gradients, keep z for the backward (memory: rows * n*I
            elements) or recompute it there (one more first GEMM).
        x_is_scratch: with gradients and no row_index: x belongs to this call alone (e.g. rows a
            dispatch just received, read by nothing after the MLP), so the backward writes dx over
            it once dW1 has read it: one [rows, H] buffer less at a training step's peak (the same
            bits). A second backward through a retained graph then raises (autograd's version
            check) instead of reading dx as x.
        path: "portable" (the `tl` kernels), "hopper" (the Gluon wgmma/TMA kernels,
            `hopper_path.py`; DitronConfigError saying why when these inputs cannot take it) or
            "auto" (default): hopper where `hopper_path.path_problem` finds nothing against it,
            else portable. The two paths round differently (each deterministic, each bitwise
            equal to itself run to run and for every grid); config, num_programs and group_rows
            are the portable path's, the Hopper path's tiles come from the tuner
            (compiler/tuner.py) or `hopper_path.default_hopper_configs`.

        x_scales: FP8 rows, as an FP8 EP dispatch delivers them (`EPBuffer(dispatch_dtype=
            torch.float8_e4m3fn)`, `handle.recv_scales`): x float8_e4m3fn [N, H] and x_scales
            fp32 [N, H / 128] (H a multiple of 128), the weights bf16 / fp16 / fp32. The first
            GEMM dequantises in its A-load — x * scale in fp32, cast once to the weights' dtype,
            as dispatch(dequantize=True) writes — so y is bit for bit grouped_mlp of the
            dequantised rows on the portable path, without writing them. Forward only (no
            gradients), the portable path, a first-GEMM block_k dividing 128; y in the weights'
            dtype.

    Accumulation is fp32; the activation h is rounded to x's dtype before the second GEMM.
    """
    rows, hidden, inter, num_local = _validate(x, expert_offsets, w1, w2, row_index, activation, b1, b2, x_scales)
    if check not in (None, True, False):
        raise ValueError(f"check must be True, False or None, got {check!r}")
    check_grad_dtype(grad_dtype)
    if check or (check is None and x.device.type == "cpu"):
        _check_values(expert_offsets, row_index, rows, x.shape[0])
    elif check is None:
        expert_offsets, row_index = _made_valid(expert_offsets, row_index, rows, x.shape[0])
    params = (x, w1, w2, b1, b2)
    needs_grad = grad_needed(*params)
    dtype = w1.dtype  # the compute dtype (x's, except FP8 rows with scales)
    if x_scales is not None:
        if needs_grad:
            raise ValueError("grouped_mlp(x_scales=) runs forward only: FP8 rows carry no gradient and the weights' "
                             "gradients need the dequantised rows; for training dispatch with dequantize=True and "
                             "pass those rows, else call under torch.no_grad()")
        if path == "hopper":
            raise DitronConfigError("path='hopper' cannot run FP8 rows (x_scales): pass path='auto' or 'portable'")
        path = "portable"
    if needs_grad and row_index is not None and capturing(x.device):
        raise ValueError(_ROW_INDEX_CAPTURE)
    if needs_grad and out is not None:
        raise ValueError("grouped_mlp: out= cannot be used when gradients are needed; leave it None")
    device_type = device_type_of(x.device)
    user_tiles = config is not None
    if config is None:
        config = default_gemm_configs(dtype, device_type)
    if not isinstance(config, (tuple, list)) or len(config) != 2 \
            or not all(isinstance(cfg, GemmTileConfig) for cfg in config):
        raise ValueError(f"config must be a pair of GemmTileConfig (gate_up_cfg, down_cfg), or None for the "
                         f"defaults; got {config!r}")
    if x_scales is not None and SCALE_COLS % config[0].block_k:
        raise ValueError(f"grouped_mlp(x_scales=): the first GEMM's block_k must divide {SCALE_COLS} (one scale per "
                         f"row and K step), got {config[0].block_k}")
    if num_programs is None:
        num_programs = 1 if device_type == "cpu" else torch.cuda.get_device_properties(x.device).multi_processor_count
    elif not is_positive_int(num_programs):
        raise ValueError(f"num_programs must be a positive int, got {num_programs!r}")
    if group_rows is not None and not is_positive_int(group_rows):
        raise ValueError(f"group_rows must be None (chosen per kernel) or a positive int (row tiles a group of the "
                         f"tile order), got {group_rows!r}")
    if input_precision is None:
        input_precision = "ieee" if device_type == "cpu" else "tf32"
    elif input_precision not in _PRECISIONS:
        raise ValueError(f"input_precision must be one of {_PRECISIONS} or None, got {input_precision!r}")
    act = activation_code(activation)
    run = _Launches(kernel_choices(path, x, w1, w2, row_index, num_local, act, tuple(config),
                                   biases=b1 is not None or b2 is not None, user_tiles=user_tiles, dtype=dtype),
                    num_programs, input_precision, group_rows, act)
    if grad_dtype is not None and w1.dtype == grad_dtype:
        grad_dtype = None  # fp32 weights: their .grad is fp32 already
    if needs_grad and grad_dtype is not None:
        stray = [n for n, t in (("w1", w1), ("w2", w2), ("b1", b1), ("b2", b2))
                 if t is not None and t.requires_grad and not t.is_leaf]
        if stray:
            raise ValueError(f"grad_dtype=torch.float32 adds the gradients to the weights' .main_grad, so "
                             f"{', '.join(stray)} must be leaf tensors (Parameters), not results of other ops; "
                             f"pass the parameters themselves, or leave grad_dtype None")
    if needs_grad:
        z, h = _GroupedUp.apply(x, w1, b1, expert_offsets, run, grad_dtype, row_index, inter, x_is_scratch,
                                bool(save_preactivation))
        return _GroupedDown.apply(z, h, w2, b2, expert_offsets, run, grad_dtype,
                                  None if save_preactivation else (x, w1, b1, row_index))
    return run.forward(x, expert_offsets, w1, w2, b1, b2, row_index, out, x_scales)


def kernel_choices(path: str, x, w1, w2, row_index, num_local: int, act: int, config, *,
                   biases: bool = False, user_tiles: bool = False,
                   dtype: torch.dtype | None = None) -> dict[str, tuple[str, GemmTileConfig]]:
    """(path, tile) of each expert-MLP kernel (core_config.EXPERT_GEMMS) for this call; `path` as grouped_mlp's.

    "portable": the `tl` kernels, `config` (or the defaults; for a plain activation's first GEMM
    on NVIDIA in half precision with at least 256 rows an expert, core_config.PLAIN_UP_CUDA_HALF)
    for the forward, the backward's defaults. "hopper": every kernel on the Gluon path, its tuned tile when the tuner cache has
    one, else `hopper_path.default_hopper_configs`; DitronConfigError saying why if these inputs
    cannot take it. "auto": the tuner's choice per kernel when the cache has an entry for this
    shape (and the Hopper path can run it), else all portable: an untuned machine computes
    exactly what it computed before the tuner existed. user_tiles: `config` was the caller's
    (grouped_mlp's config=), so the forward GEMMs keep it on the portable path under "auto".
    """
    if path not in PATHS:
        raise DitronConfigError(f"path must be one of {PATHS}, got {path!r}")
    dtype = x.dtype if dtype is None else dtype  # the compute dtype (FP8 rows: the weights')
    portable = default_expert_configs(dtype, device_type_of(x.device), config)
    if (not user_tiles and w1.shape[2] == w2.shape[1] and device_type_of(x.device) == "cuda"
            and dtype in (torch.bfloat16, torch.float16) and x.shape[0] >= PLAIN_UP_CUDA_HALF.block_m * num_local):
        # a plain activation's first GEMM (core_config says why); not with fewer rows an expert
        # than the tile's 256 (decode, many small experts), where it would double the padding
        portable["up"] = PLAIN_UP_CUDA_HALF
    choices = {k: ("portable", cfg) for k, cfg in portable.items()}
    if path == "portable":
        return choices
    tuned = tuned_choices(x.dtype, x.device, rows=x.shape[0], hidden=w1.shape[1], inter=w2.shape[1],
                          num_local=num_local, activation_code=act)
    if path == "auto" and not tuned:
        return choices
    if tuned and user_tiles:  # the caller's forward tiles stand
        tuned = {k: v for k, v in tuned.items() if k not in ("up", "down")}
    hopper_tiles = {k: (t[1] if t is not None and t[0] == "hopper" else d)
                    for k, d in default_hopper_configs().items() for t in [(tuned or {}).get(k)]}
    problem = path_problem(x, w1, w2, row_index, hopper_tiles)
    if problem is None and biases:
        problem = "experts with biases run on the portable path"
    if path == "hopper":
        if problem:
            raise DitronConfigError(f"path='hopper' cannot run this call: {problem}; pass path='auto' to fall back "
                                    f"to the portable kernels")
        return {k: ("hopper", cfg) for k, cfg in hopper_tiles.items()}
    if problem or not tuned:
        return choices
    return {**choices, **tuned}


class _Launches:
    """The kernel launches of one grouped_mlp call on validated inputs (its settings bound).
    choices: kernel -> (path, tile), `kernel_choices`."""

    def __init__(self, choices, num_programs, input_precision, group_rows, act):
        self.choices, self.num_programs = choices, num_programs
        self.input_precision, self.group_rows, self.act = input_precision, group_rows, act
        self._tile_maps: dict[int, torch.Tensor] = {}  # block_m -> the call's tile map

    def _on_hopper(self, kernel: str) -> bool:
        return self.choices[kernel][0] == "hopper"

    def _cfg(self, kernel: str) -> GemmTileConfig:
        return self.choices[kernel][1]

    def _group(self, n_cols: int, block_n: int) -> int:
        """This call's group_rows, or for None `auto_group_rows` of a kernel with n_cols output columns."""
        return self.group_rows or auto_group_rows(triton.cdiv(n_cols, block_n), self.num_programs)

    def launch_up(self, x, w1, h, expert_offsets, row_index=None, b1=None, z=None, tile_start=None, scales=None):
        """The first GEMM with the activation, on its chosen path (scales: FP8 x, portable only)."""
        cfg = self._cfg("up")
        tiles = tile_start if tile_start is not None else self._maps(expert_offsets, "up")["up"]
        if self._on_hopper("up"):
            hopper_path.launch_up(x, w1, h, z, expert_offsets, tiles, cfg, self.num_programs, self.act)
        else:
            launch_grouped_up(x, row_index, w1, h, expert_offsets, tiles, cfg, self.num_programs,
                              self.input_precision, self._group(h.shape[1], cfg.block_n), act=self.act, b1=b1, z=z,
                              scales=scales)

    def _maps(self, expert_offsets, *kernels):
        """build_tile_map for the block_m of each kernel: one map per distinct block_m for the
        call (its forward and backward launches share them: one object per call, whose offsets
        do not change)."""
        for k in kernels:
            bm = self._cfg(k).block_m
            if bm not in self._tile_maps:
                self._tile_maps[bm] = build_tile_map(expert_offsets, bm)
        return {k: self._tile_maps[self._cfg(k).block_m] for k in kernels}

    def launch_down(self, h, w2, y, expert_offsets, tile_start, b2=None):
        """y = h @ W2[e] (+ b2[e]) per expert's rows, rows past the last expert zero."""
        cfg = self._cfg("down")
        if self._on_hopper("down"):
            hopper_path.launch_down(h, w2, y, expert_offsets, tile_start, cfg, self.num_programs)
        else:
            launch_grouped_down(h, w2, y, expert_offsets, tile_start, cfg, self.num_programs, self.input_precision,
                                self._group(y.shape[1], cfg.block_n), b2=b2)

    def launch_act_grad(self, dy, w2, z, dz, h, expert_offsets, tile_start):
        """dh = dy @ W2[e]^T with the activation's backward fused: dz, and h recomputed from z."""
        cfg = self._cfg("act_grad")
        if self._on_hopper("act_grad"):
            hopper_path.launch_act_grad(dy, w2, z, dz, h, expert_offsets, tile_start, cfg, self.num_programs, self.act)
            return
        rows, num_local, hidden, inter = dy.shape[0], w2.shape[0], w2.shape[2], w2.shape[1]
        m_cap = max_m_tiles(rows, num_local, cfg.block_m)
        fast(grouped_act_grad_kernel)[(min(self.num_programs, m_cap * triton.cdiv(inter, cfg.block_n)),)](
            dy, w2, z, dz, h, tile_start, expert_offsets, rows, m_cap, hidden, inter, num_local,
            min(self._group(inter, cfg.block_n), m_cap), *w2.stride(), BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
            BLOCK_E=triton.next_power_of_2(num_local), INPUT_PRECISION=self.input_precision, ACT=self.act,
            EPILOGUE_PARTS=act_grad_parts(cfg.block_n), **cfg.launch_options())

    def launch_dgrad(self, dz, w1, dx, expert_offsets, tile_start):
        """dx = dz @ W1[e]^T per expert's rows, rows past the last expert zero."""
        cfg = self._cfg("dgrad")
        if self._on_hopper("dgrad"):
            hopper_path.launch_dgrad(dz, w1, dx, expert_offsets, tile_start, cfg, self.num_programs)
            return
        rows, num_local, hidden, width = dz.shape[0], w1.shape[0], w1.shape[1], w1.shape[2]
        m_cap = max_m_tiles(rows, num_local, cfg.block_m)
        fast(grouped_dgrad_kernel)[(min(self.num_programs, m_cap * triton.cdiv(hidden, cfg.block_n)),)](
            dz, w1, dx, tile_start, expert_offsets, rows, m_cap, width, hidden, num_local,
            min(self._group(hidden, cfg.block_n), m_cap), *w1.stride(), BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
            BLOCK_E=triton.next_power_of_2(num_local), INPUT_PRECISION=self.input_precision, **cfg.launch_options())

    def launch_wgrad(self, a, b, g, gb, expert_offsets):
        """g[e] = a[R_e]^T @ b[R_e] per expert (gb: also the column sums of b[R_e], portable only:
        kernel_choices keeps calls with biases off the Hopper path)."""
        cfg = self._cfg("wgrad")
        if self._on_hopper("wgrad"):
            hopper_path.launch_wgrad(a, b, g, expert_offsets, cfg, self.num_programs)
            return
        rows, m_dim, n_dim, num_local = a.shape[0], a.shape[1], b.shape[1], g.shape[0]
        n_tiles = num_local * triton.cdiv(m_dim, cfg.block_m) * triton.cdiv(n_dim, cfg.block_n)
        fast(grouped_wgrad_kernel)[(min(self.num_programs, n_tiles),)](
            a, b, g, gb if gb is not None else g, expert_offsets, rows, m_dim, n_dim, num_local,
            BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, INPUT_PRECISION=self.input_precision,
            HAS_BIAS=gb is not None, **cfg.launch_options())

    def forward(self, x, expert_offsets, w1, w2, b1, b2, row_index, out, x_scales=None):
        """y [rows, H] in the weights' dtype (into `out` when given): the no-gradient path."""
        rows = x.shape[0] if row_index is None else row_index.shape[0]
        hidden, inter, dtype = x.shape[1], w2.shape[1], w1.dtype
        if out is None:
            out = torch.empty((rows, hidden), dtype=dtype, device=x.device)
        elif not isinstance(out, torch.Tensor) or out.shape != (rows, hidden) or out.dtype != dtype \
                or out.device != x.device or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {dtype} tensor of shape [rows={rows}, H={hidden}] on "
                             f"{x.device}, got {_describe(out)}")
        if rows == 0:
            return out
        h = torch.empty((rows, inter), dtype=dtype, device=x.device)
        maps = self._maps(expert_offsets, "up", "down")
        self.launch_up(x, w1, h, expert_offsets, row_index, b1, None, maps["up"], x_scales)
        self.launch_down(h, w2, out, expert_offsets, maps["down"], b2)
        return out

    def down_backward(self, dy, w2, z, expert_offsets, need_w2, need_b2, wdt):
        """(dz, dW2, db2) for dy [rows, H]: dz = the activation's backward of dy @ W2[e]^T at z (h
        recomputed from z on the way), dW2 = h^T dy per expert (None where not needed)."""
        rows, width = z.shape
        if rows == 0:
            return _empty_grads(dy.device, ((True, z.shape, z.dtype), (need_w2, w2.shape, wdt),
                                            (need_b2, (w2.shape[0], w2.shape[2]), wdt)))
        dy = dy.contiguous()
        dz = torch.empty((rows, width), dtype=z.dtype, device=z.device)
        h = torch.empty((rows, w2.shape[1]), dtype=z.dtype, device=z.device)
        self.launch_act_grad(dy, w2, z, dz, h, expert_offsets, self._maps(expert_offsets, "act_grad")["act_grad"])
        dw2, db2 = self._wgrad(h, dy, need_w2, need_b2, wdt, expert_offsets)
        return dz, dw2, db2

    def up_backward(self, x, dz, w1, expert_offsets, need_x, need_w1, need_b1, wdt, dx_into_x=False):
        """(dx, dW1, db1) for dz [rows, n*I]: dx = dz @ W1[e]^T, dW1 = x^T dz per expert.
        dx_into_x: dW1 first, then dx written over x (its last reader done; the same bits)."""
        if x.shape[0] == 0:
            return _empty_grads(x.device, ((need_x, x.shape, x.dtype), (need_w1, w1.shape, wdt),
                                           (need_b1, (w1.shape[0], w1.shape[2]), wdt)))
        dx = None
        if need_x and dx_into_x:
            dw1, db1 = self._wgrad(x, dz, need_w1, need_b1, wdt, expert_offsets)
            increment_version(x)  # a second backward through a retained graph raises, not reads dx
            self.launch_dgrad(dz, w1, x, expert_offsets, self._maps(expert_offsets, "dgrad")["dgrad"])
            return x, dw1, db1
        if need_x:
            dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            self.launch_dgrad(dz, w1, dx, expert_offsets, self._maps(expert_offsets, "dgrad")["dgrad"])
        dw1, db1 = self._wgrad(x, dz, need_w1, need_b1, wdt, expert_offsets)
        return dx, dw1, db1

    def _wgrad(self, a, b, need_g, need_gb, wdt, expert_offsets):
        """(g [E_local, a cols, b cols], gb [E_local, b cols]) per expert over its rows. Allocated
        with torch.empty: the kernels write every element (experts without rows get zeros), so no
        memset of the weight gradients (2.8 GB at the layer shape)."""
        if not (need_g or need_gb):
            return None, None
        num_local = expert_offsets.shape[0] - 1
        g = torch.empty((num_local, a.shape[1], b.shape[1]), dtype=wdt, device=a.device)
        gb = torch.empty((num_local, b.shape[1]), dtype=wdt, device=a.device) if need_gb else None
        self.launch_wgrad(a, b, g, gb, expert_offsets)
        return g if need_g else None, gb


def _empty_grads(device, specs):
    """Zeros of (shape, dtype) for each (needed, shape, dtype), None where not needed: the
    gradients of a call without rows."""
    return tuple(torch.zeros(shape, dtype=dt, device=device) if need else None for need, shape, dt in specs)


def auto_group_rows(n_col_tiles: int, num_programs: int) -> int:
    """The tile order of a standalone expert GEMM with n_col_tiles column tiles (group_rows=None):
    M-tile major (1) while a wave of num_programs tiles spans several M-tiles of every column
    block (the MoE layer's shapes, 16-32 column tiles: groups of 2-16 made gate-up up to 14 %
    and down 15-22 % slower on an H200, bench/results/tile_order_H200_20261122_s9.log); groups of
    8 M-tiles from half a grid of column tiles, where an M-tile-major wave holds one or two
    M-tiles and streams the expert's whole weight for each (a DeepSpeed block's I=16384 GEMMs,
    128 column tiles: up 2.87 -> 2.56 ms, act_grad 3.53 -> 2.92 ms on an H200;
    bench/results/tile_order_ds_H200x2_20261127_s23.log). Bits do not depend on the order."""
    return 8 if 2 * n_col_tiles >= num_programs else 1


def kernel_launcher(kernel: str, choice: tuple[str, GemmTileConfig], x, expert_offsets, w1, w2, bufs: dict,
                    num_programs: int, act: int, input_precision: str | None = None):
    """(fn, out): `fn()` runs one expert-MLP kernel (core_config.EXPERT_GEMMS) on `choice` = (path, tile) over
    the buffers of a forward + backward (bufs: z, h, y, dz, dx, dy, g1), `out` the tensor it
    writes. For the tuner and the expert_gemms / dense_gemm benchmarks (fp32 inputs: tf32 on a
    GPU, ieee under the interpreter; each kernel's default tile order, `auto_group_rows`)."""
    if input_precision is None:
        input_precision = "tf32" if x.is_cuda else "ieee"
    run = _Launches({k: choice for k in EXPERT_GEMMS}, num_programs,
                    input_precision, None, act)
    tiles = build_tile_map(expert_offsets, choice[1].block_m)
    b = bufs
    if kernel == "up":
        return (lambda: run.launch_up(x, w1, b["h"], expert_offsets, z=b["z"], tile_start=tiles)), b["h"]
    if kernel == "down":
        return (lambda: run.launch_down(b["h"], w2, b["y"], expert_offsets, tiles)), b["y"]
    if kernel == "act_grad":
        return (lambda: run.launch_act_grad(b["dy"], w2, b["z"], b["dz"], b["h"], expert_offsets, tiles)), b["dz"]
    if kernel == "dgrad":
        return (lambda: run.launch_dgrad(b["dz"], w1, b["dx"], expert_offsets, tiles)), b["dx"]
    if kernel == "wgrad":
        return (lambda: run.launch_wgrad(x, b["dz"], b["g1"], None, expert_offsets)), b["g1"]
    raise ValueError(f"unknown kernel {kernel!r}")


class _GroupedUp(torch.autograd.Function):
    """The first GEMM: (z, h) from x (h = act(z), rounded, non-differentiable: the second GEMM's
    input; `_GroupedDown` gives z its gradient). Backward: dx = dz @ W1^T and dW1 = x^T dz; with
    row_index on the gathered rows x[row_index], each x row's row gradients added in ascending row
    order in fp32 (`sum_rows_into`): deterministic, no atomics. Two autograd nodes rather than
    one: the engine frees dy (the output's gradient) when `_GroupedDown`'s backward returns, before
    dx and dW1 are allocated — the step's peak memory (-rows * H elements)."""

    @staticmethod
    def forward(ctx, x, w1, b1, expert_offsets, run, grad_dtype, row_index, inter, x_is_scratch, keep_z):
        rows = x.shape[0] if row_index is None else row_index.shape[0]
        z = torch.empty((rows, w1.shape[2]), dtype=x.dtype, device=x.device) if keep_z else None
        h = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
        if rows:
            run.launch_up(x, w1, h, expert_offsets, row_index, b1, z)
        if z is None:  # recomputed in the backward: only the autograd link, no memory
            z = x.new_zeros(()).expand(rows, w1.shape[2])
        ctx.mark_non_differentiable(h)
        # h's gradient is never computed: no [rows, I] zeros made for it at the backward's peak
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, w1, b1, expert_offsets)
        ctx.run, ctx.grad_dtype, ctx.row_index = run, grad_dtype, row_index
        ctx.dx_into_x = x_is_scratch and row_index is None and x.is_contiguous()
        ctx.params = (w1, b1) if grad_dtype is not None else None  # for their main_grad
        return z, h

    @staticmethod
    def backward(ctx, dz, _dh):
        if dz is None:
            return (None,) * 10
        x, w1, b1, expert_offsets = ctx.saved_tensors
        need_x, need_w1, need_b1 = ctx.needs_input_grad[:3]
        n_x, row_index = x.shape[0], ctx.row_index
        rows, row_index = gathered_rows(x, row_index, expert_offsets)
        dx, dw1, db1 = ctx.run.up_backward(rows, dz, w1, expert_offsets, need_x, need_w1, need_b1,
                                           ctx.grad_dtype or w1.dtype, ctx.dx_into_x)
        if row_index is not None and dx is not None:
            dx = sum_rows_into(dx, row_index, n_x)  # -1: no row
        return (dx, *_weight_grads(ctx.params, (dw1 if need_w1 else None, db1)), None, None, None, None, None,
                None, None)


class _GroupedDown(torch.autograd.Function):
    """The second GEMM: y = h @ W2 (+ b2) from the first's h. Backward: dz (the activation's
    backward fused into dy @ W2^T, at the saved pre-activation z) and dW2 = h^T dy. recompute
    (save_preactivation=False): (x, w1, b1, row_index) to recompute z from in the backward instead
    of keeping it."""

    @staticmethod
    def forward(ctx, z, h, w2, b2, expert_offsets, run, grad_dtype, recompute):
        y = torch.empty((h.shape[0], w2.shape[2]), dtype=h.dtype, device=h.device)
        if h.shape[0]:
            run.launch_down(h, w2, y, expert_offsets, run._maps(expert_offsets, "down")["down"], b2)
        # saved (not ctx attributes): freed when this backward has run, and version-checked (x may
        # have become dx under x_is_scratch: a second backward then raises)
        ctx.save_for_backward(None if recompute else z, w2, expert_offsets, *(recompute or (None,) * 4))
        ctx.run, ctx.grad_dtype, ctx.recompute, ctx.width = run, grad_dtype, recompute is not None, z.shape[1]
        ctx.params = (w2, b2) if grad_dtype is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        z, w2, expert_offsets, x, w1, b1, row_index = ctx.saved_tensors
        need_w2, need_b2 = ctx.needs_input_grad[2:4]
        if ctx.recompute:  # the first GEMM again, on the rows the forward read
            rows, _ = gathered_rows(x, row_index, expert_offsets)
            z = torch.empty((rows.shape[0], ctx.width), dtype=rows.dtype, device=rows.device)
            if rows.shape[0]:
                h = torch.empty((rows.shape[0], w2.shape[1]), dtype=rows.dtype, device=rows.device)
                ctx.run.launch_up(rows, w1, h, expert_offsets, b1=b1, z=z)
                del h
            del rows
        dz, dw2, db2 = ctx.run.down_backward(dy, w2, z, expert_offsets, need_w2, need_b2, ctx.grad_dtype or w2.dtype)
        return (dz, None, *_weight_grads(ctx.params, (dw2 if need_w2 else None, db2)), None, None, None, None)


def gathered_rows(x: torch.Tensor, row_index: torch.Tensor | None, expert_offsets: torch.Tensor):
    """(the rows the forward read, row_index as sum_rows_into takes it): x itself, or x[row_index]
    gathered (rows past the experts' — a fixed-capacity buffer — may hold any index: they read
    row 0 and their zero gradients go nowhere, -1)."""
    if row_index is None:
        return x, None
    if capturing(x.device):
        raise ValueError(_ROW_INDEX_CAPTURE)
    n_x = x.shape[0]
    live = torch.arange(row_index.shape[0], device=x.device) < expert_offsets[-1]
    row_index = torch.where(live, row_index.long().clamp(0, max(n_x - 1, 0)), -1)
    rows = x[row_index.clamp_min(0)] if n_x else x.new_zeros((row_index.shape[0], x.shape[1]))
    return rows, row_index


def _weight_grads(params, grads):
    """The weight / bias gradients autograd returns: as computed, or (grad_dtype=fp32 with
    low-precision weights) added to each parameter's main_grad, None to autograd."""
    if params is None:
        return grads
    for param, g in zip(params, grads):
        if g is not None:
            add_main_grad(param, g)
    return (None,) * len(grads)


_ROW_INDEX_CAPTURE = ("grouped_mlp: gradients through row_index read the most rows any x row feeds on the host, "
                      "which a CUDA graph capture cannot; gather the rows first (x[row_index]) and pass no row_index "
                      "there")


def sum_rows_into(rows: torch.Tensor, row_index: torch.Tensor, n: int) -> torch.Tensor:
    """out [n, H] in rows' dtype: out[j] = the sum of rows[r] over r with row_index[r] == j, added in
    ascending r in fp32, cast once (0 where none; row_index -1: the row goes nowhere).
    Deterministic: a stable sort and one gather-add per rank of a row among its target's rows, no
    atomics. One host read (the most rows a target gets)."""
    out = torch.zeros((n + 1, rows.shape[1]), dtype=torch.float32, device=rows.device)  # row n: nowhere
    if rows.shape[0] == 0 or n == 0:
        return out[:n].to(rows.dtype)
    idx = torch.where(row_index.long() < 0, n, row_index.long())
    order = torch.argsort(idx, stable=True)
    target = idx[order]
    counts = torch.bincount(idx, minlength=n + 1)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(idx.shape[0], device=idx.device) - starts[target]  # r's place among its target's rows
    for j in range(int(counts[:n].max())):
        sel = (rank == j) & (target < n)  # each target at most once: a plain indexed add, in ascending r
        out[target[sel]] += rows[order[sel]].to(torch.float32)
    return out[:n].to(rows.dtype)


def main_grad_of(param: torch.Tensor) -> torch.Tensor:
    """param.main_grad: the fp32 gradient accumulator of a low-precision weight (Megatron's
    convention), created as zeros of param's shape when missing."""
    if getattr(param, "main_grad", None) is None:
        param.main_grad = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
    return param.main_grad


def add_main_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """param.main_grad += grad."""
    main_grad_of(param).add_(grad)


def launch_grouped_up(x: torch.Tensor, row_index: torch.Tensor | None, w1: torch.Tensor, h: torch.Tensor,
                      expert_offsets: torch.Tensor, tile_start: torch.Tensor, cfg: GemmTileConfig,
                      num_programs: int, input_precision: str, group_rows: int, *, act: int = 0,
                      b1: torch.Tensor | None = None, z: torch.Tensor | None = None,
                      scales: torch.Tensor | None = None) -> None:
    """h[r] = act(x_r @ W1[e] (+ b1[e])) (gated: act(gate) * up) for the rows of every expert
    (`grouped_up_kernel`), tiles in groups of group_rows M-tiles (`grouped_tile`); z: also write
    the pre-activation [rows, n*I] there; scales: x is FP8 with these fp32 [N, H / 128] scales.

    h: [rows, I]; rows of no expert are not written. tile_start = build_tile_map(expert_offsets,
    cfg.block_m). Inputs as validated by `grouped_mlp`; this launcher checks nothing.
    """
    rows, inter = h.shape
    num_local, hidden = w1.shape[0], w1.shape[1]
    m_cap = max_m_tiles(rows, num_local, cfg.block_m)
    grid = (min(num_programs, m_cap * triton.cdiv(inter, cfg.block_n)),)
    fast(grouped_up_kernel)[grid](
        x, row_index if row_index is not None else expert_offsets, w1, b1 if b1 is not None else w1, h,
        z if z is not None else h, scales if scales is not None else h, tile_start, expert_offsets,
        rows, m_cap, hidden, inter, num_local, min(group_rows, m_cap),  # no int32 overflow of group * N-tiles
        *w1.stride(), HAS_IDX=row_index is not None, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
        BLOCK_E=triton.next_power_of_2(num_local), INPUT_PRECISION=input_precision, ACT=act,
        HAS_B1=b1 is not None, SAVE_Z=z is not None, A_SCALES=scales is not None, **cfg.launch_options())


def launch_grouped_down(h: torch.Tensor, w2: torch.Tensor, y: torch.Tensor, expert_offsets: torch.Tensor,
                        tile_start: torch.Tensor, cfg: GemmTileConfig, num_programs: int,
                        input_precision: str, group_rows: int, *, b2: torch.Tensor | None = None) -> None:
    """y[r] = h[r] @ W2[e] (+ b2[e]) for the rows of every expert, zeros in rows of no expert past
    the last (`grouped_down_kernel`). y: [rows, H]; tile_start = build_tile_map(expert_offsets,
    cfg.block_m); tiles in groups of group_rows M-tiles (`grouped_tile`)."""
    rows, hidden = y.shape
    num_local, inter = w2.shape[0], w2.shape[1]
    m_cap = max_m_tiles(rows, num_local, cfg.block_m)
    grid = (min(num_programs, m_cap * triton.cdiv(hidden, cfg.block_n)),)
    fast(grouped_down_kernel)[grid](
        h, w2, b2 if b2 is not None else w2, y, tile_start, expert_offsets, rows, m_cap, inter, hidden, num_local,
        min(group_rows, m_cap), *w2.stride(), BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
        BLOCK_E=triton.next_power_of_2(num_local), INPUT_PRECISION=input_precision, HAS_B2=b2 is not None,
        **cfg.launch_options())


def _describe(t: object) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ' (not contiguous)'}"


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
              row_index: torch.Tensor | None, activation: str, b1: torch.Tensor | None,
              b2: torch.Tensor | None, x_scales: torch.Tensor | None = None) -> tuple[int, int, int, int]:
    """Raise ValueError saying what to fix; return (rows, H, I, E_local)."""
    n = width_factor(check_activation(activation))
    named = [("x", x), ("expert_offsets", expert_offsets), ("w1", w1), ("w2", w2)]
    for name, t in (("row_index", row_index), ("b1", b1), ("b2", b2), ("x_scales", x_scales)):
        if t is not None:
            named.append((name, t))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dtype = x.dtype
    if x_scales is not None:
        if x.dtype != torch.float8_e4m3fn:
            raise ValueError(f"x_scales is for FP8 rows: x must be float8_e4m3fn, got {x.dtype} (drop x_scales for "
                             f"{x.dtype} rows)")
        dtype = w1.dtype
        if dtype not in _DTYPES:
            raise ValueError(f"with FP8 rows the weights set the compute dtype: w1 must be bfloat16, float16 or "
                             f"float32, got {dtype}")
        n_sc = x.shape[1] // SCALE_COLS if x.ndim == 2 else 0
        if x.ndim != 2 or x.shape[1] % SCALE_COLS or x_scales.dtype != torch.float32 \
                or tuple(x_scales.shape) != (x.shape[0], n_sc):
            raise ValueError(f"FP8 rows need H a multiple of {SCALE_COLS} and x_scales fp32 [N, H / {SCALE_COLS}] "
                             f"(one scale per row and {SCALE_COLS} columns); got x {tuple(x.shape)} and x_scales "
                             f"{x_scales.dtype} {tuple(x_scales.shape)}")
    elif x.dtype not in _DTYPES:
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}; cast it with x.to(...)"
                         + (" (FP8 rows: pass their x_scales)" if x.dtype == torch.float8_e4m3fn else ""))
    for name, t in named[2:]:
        if name not in ("row_index", "x_scales") and t.dtype != dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but x has {dtype}; cast {name} to {dtype}")
    for name, t in named[1:]:
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}; put every input on one device")
    interpreted = kernels_interpreted()
    if interpreted != (x.device.type == "cpu"):
        raise ValueError(
            f"x is on {x.device} but ditron_ep's kernels are {'interpreted' if interpreted else 'compiled'}: "
            f"CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before importing ditron_ep), "
            f"GPU tensors compiled kernels (leave TRITON_INTERPRET unset on a GPU machine)")
    problem = gemm_dtype_problem(dtype)
    if problem:
        raise ValueError(problem)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [N, H], got shape {tuple(x.shape)}")
    hidden = x.shape[1]
    if hidden == 0:
        raise ValueError("x has hidden size 0")
    cols = "2I (gate ‖ up)" if n == 2 else "I"
    if w1.ndim != 3 or w1.shape[1] != hidden or w1.shape[2] == 0 or w1.shape[2] % n:
        raise ValueError(f"w1 must have shape [E_local, H={hidden}, {cols}] with I > 0 for activation="
                         f"{activation!r}, got {tuple(w1.shape)}")
    num_local, inter = w1.shape[0], w1.shape[2] // n
    if not 1 <= num_local <= MAX_LOCAL_EXPERTS:
        raise ValueError(f"w1 holds {num_local} local experts; supported: 1..{MAX_LOCAL_EXPERTS}")
    if tuple(w2.shape) != (num_local, inter, hidden):
        raise ValueError(f"w2 must have shape [E_local={num_local}, I={inter}, H={hidden}] to match w1 "
                         f"{tuple(w1.shape)}, got {tuple(w2.shape)}")
    for name, t, shape in (("b1", b1, (num_local, n * inter)), ("b2", b2, (num_local, hidden))):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape [E_local, {'n*I' if name == 'b1' else 'H'}] = {list(shape)}, "
                             f"got {tuple(t.shape)}")
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
        if name not in ("w1", "w2") and not t.is_contiguous():  # weights: any strides (a transposed view too)
            raise ValueError(f"{name} must be contiguous; pass {name}.contiguous()")
    return rows, hidden, inter, num_local
