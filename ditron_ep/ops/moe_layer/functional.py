"""`moe`: the EP MoE layer — dispatch, grouped expert MLPs, combine — forward and backward.

schedule="overlap" (default): the fused megakernel (ops/moe_layer/fused.py), communication and GEMM
tiles overlapped in one persistent launch. "sequential": the same binary and tiles run stage by
stage (stage barriers from the plan): bitwise equal to "overlap". "staged": dispatch, grouped
GEMM and combine as separate launches (the unfused building blocks).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ditron_ep.ops.ep.buffer import SUPPORTED_DTYPES, CapacityError
from ditron_ep.ops.ep.functional import group_id, key_fields, refuse_cached, refuse_through_match
from ditron_ep.ops.moe_layer.experts import ACT_CODES, check_activation, width_factor
from ditron_ep.ops.moe_layer.fused import FusedMoE, validate_inputs
from ditron_ep.ops.moe_layer.grouped import check_grad_dtype
from ditron_ep.ops.moe_layer.staged import staged_moe
from ditron_ep.runtime.errors import DitronConfigError
from ditron_ep.runtime.input_checks import check_dims
from ditron_ep.runtime.mode import gemm_dtype_problem
from ditron_ep.runtime.sizing import agree_on_tokens

SCHEDULES = ("overlap", "sequential", "staged")
_LAYERS: dict[tuple, FusedMoE] = {}


def moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor,
        w2: torch.Tensor, *, b1: torch.Tensor | None = None, b2: torch.Tensor | None = None,
        activation: str = "swiglu", group: dist.ProcessGroup | None = None, schedule: str = "overlap",
        sync: bool = True, check_errors: bool = False, grad_dtype: torch.dtype | None = None,
        recompute: bool = False) -> torch.Tensor:
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
    if schedule not in SCHEDULES:
        raise DitronConfigError(f"unknown schedule {schedule!r}; available: {SCHEDULES}")
    try:
        # the cached layer is looked up by these shapes, so they are checked before any lookup
        check_dims((("x", x, 2), ("topk_idx", topk_idx, 2), ("topk_weights", topk_weights, 2), ("w1", w1, 3),
                    ("w2", w2, 3)), "x [T, H], topk_idx and topk_weights [T, K], w1 [E_local, H, n*I], "
                    "w2 [E_local, I, H]", hints={"topk_weights": "for an unweighted sum pass torch.ones(T, K)"})
        check_activation(activation)
        check_grad_dtype(grad_dtype)
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, topk_weights, w1, w2, b1, b2))
        if recompute and schedule == "staged":
            raise DitronConfigError("recompute=True recomputes the staged launches after a fused forward: use it "
                                    "with schedule='overlap' or 'sequential' (schedule='staged' keeps its activations)")
        if needs_grad and recompute and not sync:
            raise NotImplementedError("recompute=True with sync=False: the backward's recomputation reads the host; "
                                      "capture with recompute=False (the default), or train with sync=True")
        _check_call(x, topk_idx, topk_weights, w1, w2, b1, b2, activation)
    except (DitronConfigError, NotImplementedError) as err:
        if sync or schedule == "staged":  # the staged schedule's dispatch always runs in default mode
            # the peers raise at once too: through the layer (buffer) the arguments still key
            refuse_moe(group, schedule, reason=f"{type(err).__name__}: {err}",
                       **_moe_key_fields(x, topk_idx, topk_weights, w1, w2, group, activation))
        raise
    world = dist.get_world_size(group)
    num_experts = w1.shape[0] * world
    if schedule == "staged" or (needs_grad and not recompute):
        # with gradients, sync=False runs the staged launches in graph mode (forward and backward capturable)
        return staged_moe(x, topk_idx, topk_weights, w1, w2, b1, b2, group=group, num_experts=num_experts,
                          activation=activation, grad_dtype=grad_dtype, sync=sync or not needs_grad)
    return _fused(x, topk_idx, topk_weights, (w1, w2, b1, b2), group, schedule, sync, check_errors, num_experts,
                  activation, grad_dtype)


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


def _fused(x, topk_idx, topk_weights, experts, group, schedule, sync, check_errors, num_experts, activation,
           grad_dtype) -> torch.Tensor:
    """The cached FusedMoE for these shapes: sized at first use by one bounded exchange (largest
    T; runtime/sizing.py), regrown on every rank together when a call's layout reports more
    tokens than it holds."""
    w2 = experts[1]
    key = _layer_key(group, num_experts, x.shape[-1], w2.shape[1], topk_idx.shape[-1], x.dtype, schedule, activation)
    layer = _LAYERS.get(key)
    if layer is None:
        need = agree_on_tokens(group, "ditron_ep.ops.moe_layer.functional", {
            "num_experts": num_experts, "hidden": x.shape[-1], "ffn_hidden": w2.shape[1],
            "topk": topk_idx.shape[-1], "dtype": x.dtype, "schedule": schedule, "activation": activation},
            max(x.shape[0], 1))
        layer = _LAYERS[key] = FusedMoE(group, num_experts, x.shape[-1], w2.shape[1], need,
                                        topk_idx.shape[-1], x.dtype, schedule=schedule, activation=activation)
    layer.check_errors = check_errors
    try:
        return layer(x, topk_idx, topk_weights, *experts, sync=sync, grad_dtype=grad_dtype)
    except CapacityError as err:
        if not sync or err.pending:  # a graph-mode call's recorded problem is the user's to see
            raise
        layer.free()
        layer = _LAYERS[key] = FusedMoE(group, num_experts, x.shape[-1], w2.shape[1],
                                        max(err.needed, 2 * layer.max_tokens), topk_idx.shape[-1], x.dtype,
                                        schedule=schedule, activation=activation, check_errors=check_errors)
        return layer(x, topk_idx, topk_weights, *experts, sync=sync, grad_dtype=grad_dtype)


def _layer_key(group: dist.ProcessGroup | None, num_experts: int | None, hidden: int | None,
               ffn_hidden: int | None, topk: int | None, dtype: torch.dtype | None, schedule: str,
               activation: str | None) -> tuple:
    """A cached layer's key (None fields: unknown, for `refuse_through_match`)."""
    return (group_id(group), num_experts, hidden, ffn_hidden, topk, dtype, schedule, activation)


def _moe_key_fields(x: object, topk_idx: object, topk_weights: object, w1: object, w2: object,
                    group: dist.ProcessGroup | None, activation: object = "swiglu") -> dict:
    """The layer-key fields the arguments still give: from tensors whose number of dimensions is
    right, and only where the arguments agree on the field. When they disagree (x in fp16 with
    fp32 weights, a w2 that does not match w1, ...) the rejected argument may be the one that
    names the layer, so the field stays unknown rather than keying some other cached layer."""
    fields = key_fields(x=x, topk_idx=topk_idx)
    w1_ok = isinstance(w1, torch.Tensor) and w1.ndim == 3
    w2_ok = isinstance(w2, torch.Tensor) and w2.ndim == 3
    if w1_ok:
        fields["num_experts"] = w1.shape[0] * dist.get_world_size(group)
    if w2_ok:
        fields["ffn_hidden"] = w2.shape[1]
    weights = [w for w, ok in ((w1, w1_ok), (w2, w2_ok)) if ok]
    if "dtype" in fields and any(w.dtype != fields["dtype"] for w in weights):
        del fields["dtype"]
    hidden = fields.get("hidden")
    if (w1_ok and w1.shape[1] != hidden) or (w2_ok and w2.shape[2] != hidden):
        fields.pop("hidden", None)
    n = width_factor(activation) if activation in ACT_CODES else None
    if n is not None:
        fields["activation"] = activation
    if w1_ok and w2_ok and (w1.shape[0] != w2.shape[0] or n is None or w1.shape[2] != n * w2.shape[1]):
        fields.pop("num_experts", None)
        fields.pop("ffn_hidden", None)
    if (isinstance(topk_weights, torch.Tensor) and topk_weights.ndim == 2
            and topk_weights.shape[-1] != fields.get("topk")):
        fields.pop("topk", None)
    return fields


def refuse_moe(group: dist.ProcessGroup | None, schedule: str, *, num_experts: int | None = None,
               hidden: int | None = None, ffn_hidden: int | None = None, topk: int | None = None,
               dtype: torch.dtype | None = None, activation: str | None = None, reason: str = "",
               trusted_key: bool = False) -> None:
    """This rank rejected arguments that cannot all key a cached layer (their number of
    dimensions), asked for gradients, or failed a module's own checks (`reason`: its error): join
    the peers' call flagged through the cached layer these fields key when all are given, else
    through the group's only cached layer if it matches the fields given (None: unknown;
    staged: the same rule over the dispatch buffers); where the peers must be sizing a new
    layer instead (the group has none yet, or `trusted_key` and the exact key is not cached:
    `refuse_through_match`), refuse that sizing. So the peers raise at once instead of waiting
    for this rank until they time out. Anything else would be a guess that could put an
    unrelated layer out of step."""
    if schedule == "staged":
        refuse_cached(group, num_experts=num_experts, hidden=hidden, topk=topk, dtype=dtype, reason=reason,
                      trusted_key=trusted_key)
        return
    refuse_through_match(_LAYERS, _layer_key(group, num_experts, hidden, ffn_hidden, topk, dtype, schedule,
                                             activation), group, reason, trusted_key)


def clear_layers() -> None:
    """Free every cached fused layer (collective: call on every rank)."""
    for layer in _LAYERS.values():
        layer.free()
    _LAYERS.clear()
