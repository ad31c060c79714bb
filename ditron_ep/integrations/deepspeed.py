"""DeepSpeed's MoE layer with ditron_ep's data path: `replace_moe(model)`.

`deepspeed.moe.layer.MoE` keeps everything DeepSpeed owns — its gate (`TopKGate`: logits, top-k,
capacity drops, `l_aux`, `exp_counts`), its process groups, its expert modules and their
parameters (the same `Parameter` objects, names and tags, so `state_dict` keys, optimizer groups,
ZeRO partitioning and checkpoints do not change). What `replace_moe` replaces is the forward of
its `MOELayer` (`moe.deepspeed_moe`): instead of scattering tokens into an [E, capacity, H]
buffer, two all-to-alls and a per-expert loop, the gate's routes (`ops.gate.top2_capacity_gate`)
go to our dispatch, then each expert module's own forward on its received rows (cuBLAS through
nn.Linear for the usual experts; any expert module), then our weighted combine — or, with
`replace_moe(model, experts="kernels")`, to `ditron_ep.ops.moe` (dispatch, grouped expert MLP,
combine; autograd through all of it, deterministic).

    import deepspeed
    from ditron_ep.integrations.deepspeed import replace_moe
    model = MyModel(...)                 # with deepspeed.moe.layer.MoE blocks
    replace_moe(model)                   # before or after deepspeed.initialize
    engine, *_ = deepspeed.initialize(model=model, ...)

experts="kernels": ditron_ep's grouped GEMM kernels read every expert's weights. Supported
experts (each one is checked against its own forward on random input when replaced, on every
rank, in fp32; anything else raises DitronConfigError naming the module):
* `nn.Sequential(Linear(H, I), act, Linear(I, H))` with act one of nn.GELU (exact or tanh),
  nn.ReLU, nn.SiLU, biases or not (DeepSpeed's examples);
* a module whose only children are Linear `gate_proj`, `up_proj` (H -> I) and `down_proj`
  (I -> H), computing down(silu(gate(x)) * up(x)) (Llama / Mixtral style SwiGLU).
experts="modules" (default): any expert module (dropout, custom forward, other activations), one
call per local expert on that expert's rows — 2-D [rows, H], rows may be 0, no capacity padding
(DeepSpeed's loop hands each expert a zero-padded [ep_size, capacity, H] chunk), so the
expert GEMMs are torch's (cuBLAS) and the rest — gate routes, dispatch, combine — is ours.
Not supported (raise): Tutel, tensor-parallel experts. Any gate setting is (DeepSpeed's own top-2
gate's routes are computed here — the same routes, gates within fp32 rounding — by
`ops.gate.top2_capacity_gate`; every other gate runs itself).

experts="kernels": expert weights are read in place on every call (`_stacked`): weights that own
their storage are moved into one buffer per layer when replaced, ZeRO's flat buffers are read where
they are, and anything else is stacked (a copy with autograd); the kernels read nn.Linear's layout transposed.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ditron_ep.integrations import import_framework
from ditron_ep.ops.moe_layer.experts import expert_activation
from ditron_ep.runtime.errors import DitronConfigError

__all__ = ["SUPPORTED_VERSIONS", "replace_moe"]

SUPPORTED_VERSIONS = ("0.19.8",)


def _deepspeed():
    return import_framework("deepspeed", "DeepSpeed", "deepspeed", SUPPORTED_VERSIONS)


def _activation_of(act: nn.Module) -> str | None:
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    if isinstance(act, nn.ReLU):
        return "relu"
    if isinstance(act, nn.SiLU):
        return "silu"
    return None


def expert_layout(expert: nn.Module) -> tuple[str, list[nn.Linear]]:
    """(activation, [first Linear(s)..., last Linear]) of a supported expert, else DitronConfigError.
    Plain: [fc1, fc2]; gated (swiglu): [gate_proj, up_proj, down_proj]."""
    children = dict(expert.named_children())
    if isinstance(expert, nn.Sequential) and len(expert) == 3 and isinstance(expert[0], nn.Linear) \
            and isinstance(expert[2], nn.Linear) and _activation_of(expert[1]) is not None:
        return _activation_of(expert[1]), [expert[0], expert[2]]
    if set(children) == {"gate_proj", "up_proj", "down_proj"} and all(
            isinstance(m, nn.Linear) for m in children.values()):
        return "swiglu", [children["gate_proj"], children["up_proj"], children["down_proj"]]
    raise DitronConfigError(
        f"expert {type(expert).__name__} is not supported by replace_moe: use nn.Sequential(nn.Linear(H, I), "
        f"nn.GELU() | nn.ReLU() | nn.SiLU(), nn.Linear(I, H)) or a module of Linear gate_proj, up_proj, down_proj "
        f"(SwiGLU); got children {list(children)}")


class _SpacedView(torch.autograd.Function):
    """apply(E, step, *blocks): the E * n weight blocks ([r, c], contiguous; n per expert) that
    lie in one storage, n back to back per expert and experts `step` elements apart (ZeRO's flat
    buffers place an expert layer's parameters so), as one [E, n*r, c] view of it: the kernels
    read the weights where they are, no copy. The backward hands each block its slice."""

    @staticmethod
    def forward(ctx, num_experts, step, *blocks):
        b0 = blocks[0]
        ctx.n, (ctx.r, c) = len(blocks) // num_experts, b0.shape
        return b0.detach().as_strided((num_experts, ctx.n * ctx.r, c), (step, c, 1), b0.storage_offset())

    @staticmethod
    def backward(ctx, grad):
        r = ctx.r
        return (None, None, *(grad[e, j * r:(j + 1) * r] for e in range(grad.shape[0]) for j in range(ctx.n)))


def _spaced_step(blocks: list[torch.Tensor], num_experts: int) -> int | None:
    """The storage step between experts when `blocks` ((expert, j) order) can be read in place
    (`_SpacedView`), else None."""
    b0 = blocks[0]
    n, size = len(blocks) // num_experts, b0.numel()
    if num_experts < 2 or not all(b.is_contiguous() and b.shape == b0.shape and b.dtype == b0.dtype and
                                  b.untyped_storage().data_ptr() == b0.untyped_storage().data_ptr() for b in blocks):
        return None
    step = blocks[n].storage_offset() - b0.storage_offset()
    if step < n * size or any(b.storage_offset() - b0.storage_offset() != (i // n) * step + (i % n) * size
                              for i, b in enumerate(blocks)):
        return None
    return step


def _expert_weights(blocks: list[torch.Tensor], num_experts: int) -> tuple[torch.Tensor, bool]:
    """[E, n*r, c] of the experts' weight blocks: read in place when they allow it, else a stacked
    copy; and whether it was in place."""
    step = _spaced_step(blocks, num_experts)
    if step is not None:
        return _SpacedView.apply(num_experts, step, *blocks), True
    n = len(blocks) // num_experts
    return torch.stack([torch.cat(blocks[e * n:(e + 1) * n]) for e in range(num_experts)]), False


@torch.no_grad()
def _colocate(blocks: list[torch.Tensor]) -> None:
    """Move weight blocks that each own their storage (no flat buffer holds them: ZeRO stage 0,
    plain torch) into one buffer, back to back in (expert, j) order, so `_expert_weights` reads them
    in place. Blocks another owner has placed (ZeRO's flat buffers) are left where they are."""
    if not all(b.is_contiguous() and b.storage_offset() == 0 and
               b.untyped_storage().nbytes() == b.numel() * b.element_size() for b in blocks):
        return
    flat = torch.empty((len(blocks), *blocks[0].shape), dtype=blocks[0].dtype, device=blocks[0].device)
    for i, b in enumerate(blocks):
        flat[i].copy_(b)
        b.data = flat[i]


def _stacked(layers: list[list[nn.Linear]]) -> tuple[torch.Tensor, ...]:
    """(w1 [E_local, H, n*I], w2 [E_local, I, H], b1 or None, b2 or None, in place), differentiable,
    from every expert's Linear layers (`expert_layout`). The Linear weights ([out, in]) are read
    where they are when they lie evenly spaced in one storage (under ZeRO's flat buffers), else
    stacked as they are (a contiguous copy), and handed over as transposed views: the kernels read
    any strides, so no transposing copy is made."""
    E, first = len(layers), layers[0][:-1]
    w1, in_place1 = _expert_weights([lin.weight for ls in layers for lin in ls[:-1]], E)
    w2, in_place2 = _expert_weights([ls[-1].weight for ls in layers], E)
    # one stack each ([E * n, I] -> [E, n * I]: an expert's n biases back to back), not a cat per expert
    b1 = None if first[0].bias is None else torch.stack([lin.bias for ls in layers for lin in ls[:-1]]).view(E, -1)
    b2 = None if layers[0][-1].bias is None else torch.stack([ls[-1].bias for ls in layers])
    return w1.transpose(1, 2), w2.transpose(1, 2), b1, b2, in_place1 and in_place2


def _verify(expert: nn.Module, activation: str, name: str) -> None:
    """The expert's own forward against the stacked formula on random fp32 input (torch only)."""
    hidden = expert_layout(expert)[1][0].in_features
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(7, hidden, generator=gen)
    with torch.no_grad():
        copy = _fp32_copy(expert)
        want = copy(x)
        if isinstance(want, tuple):
            want = want[0]
        w1, w2, b1, b2, _ = _stacked([expert_layout(copy)[1]])
        z = x @ w1[0] + (0 if b1 is None else b1[0])
        got = expert_activation(z, activation) @ w2[0] + (0 if b2 is None else b2[0])
    if want.shape != got.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise DitronConfigError(f"replace_moe: expert {name} ({type(expert).__name__}) does not compute "
                                f"{activation} MLP of its Linear layers (a custom forward, dropout or extra "
                                f"layers?): its output differs from the formula on random input")


def _fp32_copy(module: nn.Module) -> nn.Module:
    import copy

    clone = copy.deepcopy(module).to("cpu", torch.float32)
    clone.eval()
    return clone


def _top2_routes(gate, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """DeepSpeed 0.19.8's TopKGate forward for k = 2 with capacity drops and no noisy gating, sparse
    routes, in `ops.gate.top2_capacity_gate` (one launch forward, one backward; DeepSpeed's ~40
    torch ops kept the GPU idle ~1.7 ms a step): (l_aux, topk_idx [S, 2] int32 (-1: dropped by the capacity),
    topk_weights [S, 2] fp32, exp_counts) — the routes and counts `gate(tokens, None, True)` gives,
    gates and gradients within fp32 rounding (tested against it)."""
    from deepspeed.moe.sharded_moe import _capacity, gumbel_rsample

    from ditron_ep.ops.gate import top2_capacity_gate

    # fp32 as DeepSpeed's gate computes them (.float() again: under autocast linear returns its dtype)
    logits = nn.functional.linear(tokens.float(), weight=gate.wg.weight.float(), bias=None).float()
    noise = None
    if gate.top2_2nd_expert_sampling:  # DeepSpeed's Gumbel draw: the same random numbers
        noise = gumbel_rsample(logits.shape, device=logits.device)
    factor = gate.capacity_factor if gate.training else gate.eval_capacity_factor
    capacity = int(_capacity(logits, torch.tensor(factor * 2), torch.tensor(gate.min_capacity)))  # CPU tensors
    return top2_capacity_gate(logits, capacity, noise)


def _gate_routes(gate, tokens: torch.Tensor, used_token: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """(l_aux, topk_idx [S, k] int32 with -1 for a route the capacity dropped, topk_weights [S, k]
    fp32, exp_counts) of the layer's DeepSpeed gate: `_top2_routes` for DeepSpeed's own top-2 gate
    with drops and no noise, else the gate itself."""
    from deepspeed.moe.sharded_moe import TopKGate

    if (type(gate) is TopKGate and gate.k == 2 and gate.drop_tokens and gate.noisy_gate_policy is None
            and not gate.wall_clock_breakdown and used_token is None):
        return _top2_routes(gate, tokens)
    l_aux, _capacity, _num_experts, indices, _locations, gates, exp_counts = gate(tokens, used_token, True, False)
    return l_aux, indices.t().contiguous(), gates.t().to(torch.float32).contiguous(), exp_counts


def _ditron_moe_forward(self, *inputs: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """MOELayer.forward with ditron_ep's dispatch, experts and combine (DeepSpeed's gate kept)."""
    from ditron_ep.ops.moe_layer.functional import MoESlots, run_moe

    x = inputs[0]
    used_token = inputs[1] if len(inputs) > 1 else None
    d_model = x.shape[-1]
    tokens = x.reshape(-1, d_model)
    # routes [S, k], -1 where the capacity dropped one
    self.l_aux, topk_idx, topk_weights, self.exp_counts = _gate_routes(self.gate, tokens, used_token)
    if self._ditron_experts == "modules":
        return _modules_path(self, tokens, topk_idx, topk_weights).reshape(x.shape)
    w1, w2, b1, b2, self._ditron_in_place = _stacked(self._ditron_layers)
    if getattr(self, "_ditron_slots", None) is None:  # the layer's own buffers (ep_group is set by then)
        self._ditron_slots = MoESlots(self.ep_group)
    out = run_moe(self._ditron_slots, tokens.contiguous(), topk_idx, topk_weights, w1, w2, b1=b1, b2=b2,
                  activation=self._ditron_activation, schedule=self._ditron_schedule)
    return out.reshape(x.shape)


def _modules_path(self, tokens: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """experts="modules": our dispatch (expert-major rows, each expert's in (source rank, token)
    order), every local expert module on its rows, our combine weighted by the gates in k order
    in fp32 (gradients to the rows and to the gates)."""
    from ditron_ep.ops.ep.functional import BufferSlot

    if getattr(self, "_ditron_slots", None) is None:  # the layer's own buffer (ep_group is set by then)
        self._ditron_slots = BufferSlot(self.ep_group)
    slot = self._ditron_slots
    recv, handle = slot.dispatch(tokens.contiguous(), topk_idx, num_experts=self.num_local_experts * self.ep_size)
    outs = []
    try:  # (default mode: the rows per expert came with the dispatch's one host read)
        for expert, rows in zip(self.experts.deepspeed_experts, recv.split(handle.recv_counts)):
            out = expert(rows)
            outs.append(out[0] if isinstance(out, tuple) else out)  # as DeepSpeed's Experts takes it
        y = torch.cat(outs) if outs else recv
        if y.shape != recv.shape:
            raise DitronConfigError(f"replace_moe(experts='modules'): the experts returned {tuple(y.shape)} for their "
                                    f"rows {tuple(recv.shape)}; an expert must map [rows, H] to [rows, H]")
    except Exception:
        slot.buffer._refuse_combine()  # the peers are entering the combine: they raise instead of waiting
        raise
    return slot.combine(y.to(recv.dtype), handle, topk_weights)  # (autocast experts return its dtype)


def replace_moe(model: nn.Module, *, experts: str = "modules", schedule: str = "overlap") -> int:
    """Give every `deepspeed.moe.layer.MoE` in `model` (the model itself included) ditron_ep's
    data path; returns how many were replaced. experts="kernels" only: experts' weights that each
    own their storage are moved into one buffer per layer (values and parameters unchanged), so
    every call reads them in place; under ZeRO they are read where its flat buffers put them.
    Collective only in the sense that every rank must make the same call (no communication here). Raises DitronConfigError, naming the layer, for
    an unsupported expert or option; nothing is changed then.

    experts: "modules" (default): each expert module's own forward on its received rows (any
    expert; the expert GEMMs are torch's, cuBLAS: on the drop-in benchmark's block, 2xH100, 13.3
    ms a step against 17.9 for "kernels" and 16.0 for DeepSpeed's own). "kernels": ditron_ep's
    grouped expert kernels (supported experts listed in the module docstring; `schedule` picks
    the fused or staged layer)."""
    _deepspeed()  # installed, and a supported version
    if experts not in ("kernels", "modules"):
        raise DitronConfigError(f"experts must be 'kernels' (ditron_ep's grouped expert kernels) or 'modules' (each "
                                f"expert module's own forward on its rows), got {experts!r}")
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.sharded_moe import MOELayer

    found = [(name or type(model).__name__, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    plans = []
    for name, layer in found:
        inner = layer.deepspeed_moe
        if not isinstance(inner, MOELayer):
            raise DitronConfigError(f"{name}: deepspeed_moe is a {type(inner).__name__}, not DeepSpeed's MOELayer")
        if inner.use_tutel:
            raise DitronConfigError(f"{name}: use_tutel=True is not supported by replace_moe; build the MoE "
                                    f"without Tutel")
        if layer.enable_expert_tensor_parallelism:
            raise DitronConfigError(f"{name}: tensor-parallel experts are not supported by replace_moe")
        activation, layers = None, []
        for i, expert in enumerate(inner.experts.deepspeed_experts if experts == "kernels" else ()):
            try:
                act, linears = expert_layout(expert)
            except DitronConfigError as exc:
                raise DitronConfigError(f"{name}.deepspeed_moe.experts.deepspeed_experts.{i}: {exc}") from None
            if activation not in (None, act):
                raise DitronConfigError(f"{name}: experts mix activations ({activation}, {act})")
            activation = act
            layers.append(linears)
            _verify(expert, act, f"{name}.deepspeed_moe.experts.deepspeed_experts.{i}")
        plans.append((inner, activation, layers))
    for inner, activation, layers in plans:
        if layers and len({lin.weight.shape for ls in layers for lin in ls[:-1]}) == 1:  # (gate and up alike)
            _colocate([lin.weight for ls in layers for lin in ls[:-1]])
            _colocate([ls[-1].weight for ls in layers])
        # the expert modules are fixed; their weights are read on every call (ZeRO may re-point them)
        inner._ditron_activation, inner._ditron_layers = activation, layers
        inner._ditron_schedule, inner._ditron_slots, inner._ditron_experts = schedule, None, experts
        inner.forward = _ditron_moe_forward.__get__(inner, type(inner))
    return len(plans)
