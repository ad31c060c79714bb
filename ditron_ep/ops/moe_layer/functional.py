"""`moe`: the EP MoE layer — dispatch, grouped expert MLPs, combine — forward and backward.

schedule="overlap" (default): the fused megakernel (ops/moe_layer/fused.py), communication and GEMM
tiles overlapped in one persistent launch. "sequential": the same binary and tiles run stage by
stage (stage barriers from the plan): bitwise equal to "overlap". "staged": dispatch, grouped
GEMM and combine as separate launches (the unfused building blocks).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ditron_ep.ops.ep.buffer import SUPPORTED_DTYPES
from ditron_ep.ops.ep.functional import BufferSlot
from ditron_ep.ops.moe_layer.experts import check_activation, width_factor
from ditron_ep.ops.moe_layer.fused import FusedMoE, validate_inputs
from ditron_ep.ops.moe_layer.grouped import check_grad_dtype
from ditron_ep.ops.moe_layer.staged import staged_moe
from ditron_ep.runtime.agreement import CallSlot, per_group
from ditron_ep.runtime.errors import DitronConfigError
from ditron_ep.runtime.input_checks import check_dims, grad_needed
from ditron_ep.runtime.mode import gemm_dtype_problem

SCHEDULES = ("overlap", "sequential", "staged")


class MoESlots:
    """What `moe` runs on: a FusedMoE per fused schedule and an EPBuffer for the staged launches,
    each built at first use and rebuilt when a call needs it (runtime/agreement.py). `moe` keeps
    one per process group; an `EPMoE` (or an integration's layer) keeps its own. (A layer per
    schedule: a caller alternating schedules does not rebuild; every rank must pass the same
    schedule, or the ranks wait in different layers until the bounded wait names the missing rank.)"""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.buffer = BufferSlot(group)
        self.layers: dict[str, CallSlot[FusedMoE]] = {
            s: CallSlot(group, "ditron_ep.ops.moe", self._build, FusedMoE.request) for s in ("overlap", "sequential")}

    def _build(self, f: dict, tokens: int) -> FusedMoE:
        return FusedMoE(self.group, f["num_experts"], f["hidden"], f["ffn_hidden"], tokens, f["topk"], f["dtype"],
                        schedule=f["schedule"], activation=f["activation"])

    def free(self) -> None:
        """Free them all (collective: call on every rank)."""
        for slot in self.layers.values():
            slot.free()
        self.buffer.free()


_GROUP_SLOTS: dict[object, MoESlots] = {}


def _group_slots(group: dist.ProcessGroup | None) -> MoESlots:
    return per_group(_GROUP_SLOTS, group, MoESlots)


def moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor,
        w2: torch.Tensor, *, b1: torch.Tensor | None = None, b2: torch.Tensor | None = None,
        activation: str = "swiglu", group: dist.ProcessGroup | None = None, schedule: str = "overlap",
        sync: bool = True, check_errors: bool = False, grad_dtype: torch.dtype | None = None,
        recompute: bool = False, max_recv_rows: int | None = None) -> torch.Tensor:
    """Expert-parallel MoE forward: out[t] = sum_k w[t,k] * MLP_{e(t,k)}(x[t]).

    Args:
        x: [T, H] tokens of this rank: bf16, fp16 or fp32 (bf16 is refused under the interpreter).
        topk_idx: [T, K] int global expert ids (-1 = dropped); rank r owns experts
            [r*E_local, (r+1)*E_local) with E_local = w1.shape[0].
        topk_weights: [T, K] float routing weights.
        w1: [E_local, H, n*I] this rank's first expert layer: gate ‖ up for gated activations
            (n = 2), else n = 1; w2: [E_local, I, H].
        b1, b2: optional biases [E_local, n*I] and [E_local, H].
        activation: the experts' activation (experts.ACTIVATIONS): "swiglu" (default), "geglu",
            "gelu", "gelu_tanh", "relu", "silu".
        group: EP process group (None = default).
        schedule: "overlap" | "sequential" | "staged" (see the module docstring).
        sync: fused schedules: True = one host read, of the layout's status (bad input raises
            on every rank and nothing moves; so does a timeout inside an earlier launch); the
            megakernel runs on asynchronously. False = no host synchronisation
            (CUDA-graph capturable; needs the cached layer to exist at a sufficient size: call
            once with sync=True). With gradients (recompute=False), False runs the staged
            launches in graph mode, forward and backward without a host read (capacity-sized
            rows; the cached buffer must exist: call once with sync=True).
        check_errors: fused schedules with sync=True: also wait for the megakernel and raise a
            timeout inside it in this call (a second host read) instead of at the next call.
        grad_dtype: None, or torch.float32 with bf16 / fp16 weights: their gradients are computed
            in fp32 and added to each weight's `main_grad` (created when missing) instead of
            `.grad` (`grouped_mlp`).
        max_recv_rows: graph-mode training (sync=False with gradients) keeps capacity-sized rows,
            W * T_max * K by default; this caps them (memory). Rows past it are dropped and a
            CapacityError is raised at the next sync call or `check()`.
        recompute: with gradients, what the forward keeps for the backward. False (default): the
            staged launches run the forward (under every schedule) and keep what their backward
            needs: the dispatched rows, the pre-activation, the expert outputs. True (activation
            checkpointing): the schedule's own forward (fused for "overlap" / "sequential") keeps
            only the inputs, and the backward recomputes the staged forward first (one more
            dispatch, MLP and combine). Measured on 2xH100 (H=7168, I=2048, E=64, top-8, T=4096,
            bf16): 26.1 ms a step without, 32.3 ms with (bench/results/HISTORY.md, session 16).
    Returns:
        [T, H] in x's dtype; top-k terms summed in k order in fp32, cast once.

    Gradients (for x, topk_weights, w1, w2, b1, b2): the staged schedule's autograd — dispatch's
    backward is a combine, the experts' the grouped MLP backward kernels (grouped.py),
    combine's a dispatch plus grad_w[t, k] = <grad_out[t], y(t, k)>; see `recompute`. The same
    inputs give the same gradient bits under every schedule and either `recompute`; with
    gradients the forward's output is the staged launches' unless recompute=True (the fused
    schedules' own bits, which the staged launches equal only to rounding). The fused schedules
    need sync=True when gradients are asked for.
    """
    return run_moe(_group_slots(group), x, topk_idx, topk_weights, w1, w2, b1=b1, b2=b2, activation=activation,
                   schedule=schedule, sync=sync, check_errors=check_errors, grad_dtype=grad_dtype, recompute=recompute,
                   max_recv_rows=max_recv_rows)


def run_moe(slots: MoESlots, x, topk_idx, topk_weights, w1, w2, *, b1=None, b2=None, activation: str = "swiglu",
            schedule: str = "overlap", sync: bool = True, check_errors: bool = False,
            grad_dtype: torch.dtype | None = None, recompute: bool = False, max_recv_rows: int | None = None,
            error: Exception | None = None) -> torch.Tensor:
    """`moe` on `slots` (its arguments). A rank whose arguments fail (or that passes the `error`
    it found itself) still joins the call, flagged, on the buffer or layer the call runs on, so
    every rank raises before anything moves."""
    needs_grad = grad_needed(x, topk_weights, w1, w2, b1, b2)
    staged = schedule == "staged" or (needs_grad and not recompute)
    try:
        if error is not None:
            raise error
        if schedule not in SCHEDULES:
            raise DitronConfigError(f"unknown schedule {schedule!r}; available: {SCHEDULES}")
        check_dims((("x", x, 2), ("topk_idx", topk_idx, 2), ("topk_weights", topk_weights, 2), ("w1", w1, 3),
                    ("w2", w2, 3)), "x [T, H], topk_idx and topk_weights [T, K], w1 [E_local, H, n*I], "
                    "w2 [E_local, I, H]", hints={"topk_weights": "for an unweighted sum pass torch.ones(T, K)"})
        check_activation(activation)
        check_grad_dtype(grad_dtype)
        if recompute and schedule == "staged":
            raise DitronConfigError("recompute=True recomputes the staged launches after a fused forward: use it "
                                    "with schedule='overlap' or 'sequential' (schedule='staged' keeps its activations)")
        if max_recv_rows is not None and not (staged and needs_grad and not sync):
            raise DitronConfigError("max_recv_rows sizes the rows graph-mode training keeps: give it with sync=False "
                                    "and gradients (recompute=False); other calls size their rows themselves")
        if needs_grad and recompute and not sync:
            raise NotImplementedError("recompute=True with sync=False: the backward's recomputation reads the host; "
                                      "capture with recompute=False (the default), or train with sync=True")
        _check_call(x, topk_idx, topk_weights, w1, w2, b1, b2, activation)
    except (DitronConfigError, NotImplementedError) as err:
        error = err
    world = dist.get_world_size(slots.group)
    num_experts = w1.shape[0] * world if isinstance(w1, torch.Tensor) and w1.ndim == 3 else 0
    T = x.shape[0] if error is None else 0
    if staged:
        if error is not None:  # joins the dispatch it would have made, flagged, and raises
            slots.buffer.dispatch(x, topk_idx, num_experts=num_experts, sync=sync, error=error)
        # with gradients, sync=False runs the staged launches in graph mode (forward and backward capturable)
        return staged_moe(x, topk_idx, topk_weights, w1, w2, b1, b2, slot=slots.buffer, num_experts=num_experts,
                          activation=activation, grad_dtype=grad_dtype, sync=sync or not needs_grad,
                          max_recv_rows=max_recv_rows)
    request = None if error is not None else {
        "num_experts": num_experts, "hidden": x.shape[1], "ffn_hidden": w2.shape[1], "topk": topk_idx.shape[1],
        "dtype": x.dtype, "activation": activation, "schedule": schedule}

    def call(layer: FusedMoE) -> torch.Tensor:
        layer.check_errors = check_errors
        return layer(x, topk_idx, topk_weights, w1, w2, b1, b2, sync=sync, grad_dtype=grad_dtype)

    slot = slots.layers.get(schedule, slots.layers["overlap"])  # (an unknown schedule is the error raised)
    return slot.run(request, T, error, sync, call, lambda layer, flags, f: layer.join_flagged(flags, f, T))


def _check_call(x, topk_idx, topk_weights, w1, w2, b1, b2, activation) -> None:
    """The layer's argument checks (`validate_inputs`), on this rank, before a cached layer or
    buffer is looked up by the arguments' shapes: a mistake the rank can see alone raises here at
    once, instead of keying a layer its peers do not have (and waiting in its sizing). The FFN
    width comes from w1 (gate ‖ up), so a w2 that does not match it is the one named."""
    problem = gemm_dtype_problem(x.dtype)
    if problem:
        raise DitronConfigError(problem)
    if x.dtype not in SUPPORTED_DTYPES:
        raise DitronConfigError(f"x has dtype {x.dtype}; use one of {SUPPORTED_DTYPES}")
    n = width_factor(activation)
    inter = w1.shape[2] // n if w1.shape[2] % n == 0 else w2.shape[1]
    validate_inputs(x, topk_idx, topk_weights, w1, w2, b1=b1, b2=b2, activation=activation, dtype=x.dtype,
                    hidden=x.shape[1], ffn_hidden=inter, num_local_experts=w1.shape[0], topk=topk_idx.shape[1],
                    device=x.device)


def clear_layers() -> None:
    """Free every group's cached layer and buffer of `moe` (collective: call on every rank)."""
    for slots in _GROUP_SLOTS.values():
        slots.free()
    _GROUP_SLOTS.clear()
