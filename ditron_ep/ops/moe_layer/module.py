"""`EPMoE`: an expert-parallel MoE layer (router + top-k + `moe`) for DeepSpeed / Megatron models.

Layering: the router, top-k and load-balancing loss are plain torch (small [T, E] tensors); the
expert work is the public `moe` op (dispatch → grouped expert MLPs → combine). Every rank holds
a replica of the router and only its own E / W experts.

Training: `moe`'s backward gives the gradients of x, the experts and, through the top-k weights
and the aux loss, the router (a replica on every rank: average its gradient over the group, as
data parallelism does). With gradients the forward runs the staged launches and keeps their
activations, or with recompute=True the schedule's own forward and a recomputation in the
backward (see `moe`); every schedule gives the same gradient bits.
"""
from __future__ import annotations

import math
import numbers

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ditron_ep.ops.ep.buffer import SUPPORTED_DTYPES
from ditron_ep.ops.moe_layer.functional import SCHEDULES, MoESlots, run_moe
from ditron_ep.ops.moe_layer.experts import check_activation, width_factor
from ditron_ep.ops.moe_layer.grouped import MAX_LOCAL_EXPERTS, check_grad_dtype
from ditron_ep.runtime.errors import DitronConfigError

__all__ = ["EPMoE", "SCORE_FUNCS"]

SCORE_FUNCS = ("softmax", "sigmoid")
ROUTER_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class EPMoE(nn.Module):
    """Top-k routed MoE over an expert-parallel process group; experts are SwiGLU MLPs by default,
    or any of experts.ACTIVATIONS, with optional biases.

    forward(x [..., H]) -> (out [..., H] in x's dtype, aux_loss: 0-dim tensor in router_dtype):

    1. tokens = x.reshape(T, H); logits = tokens @ router_weight.T, both cast to `router_dtype`.
    2. scores = softmax(logits) or sigmoid(logits) over the E experts, [T, E].
    3. top-k: the K highest scores per token, ties broken towards the lower expert id (a stable
       descending sort; torch.topk does not document its tie order). Weights = the selected
       scores, divided by their sum when `renormalize` (Mixtral / DeepSeek-V3 style).
    4. aux_loss = aux_loss_coef * E * sum_e f_e * P_e (Switch / GShard), with f_e the fraction of
       this rank's T*K (token, slot) assignments that went to expert e and P_e the mean over this
       rank's tokens of the router probability of e (softmax scores; for sigmoid, the scores
       normalised to sum 1 per token). It is LOCAL-batch: not all-reduced over the group (no
       extra collective); average it across ranks yourself if you want the global statistic.
       0 on a rank with no tokens. 1.0 (times the coefficient) at perfect balance.
    5. out = moe(tokens, topk_idx, weights (fp32), w1, w2, b1, b2, activation): the experts'
       outputs summed with the weights, in x's dtype.

    Parameters (initialised by `reset_parameters` from the global torch RNG; fan-in scaled
    normals, so unit-variance inputs give order-1 pre-activations; each expert from its own
    generator seeded by its global id, so the experts do not depend on the group size):
        router_weight: [E, H] in router_dtype, N(0, 1/H). Replicated: it MUST be identical on
            every rank — seed every rank alike before construction, or call `sync_router_(src)`
            once after construction (and after loading a checkpoint that differs per rank).
        w1: [E_local, H, n*I] in dtype, N(0, 1/H): gate ‖ up of this rank's experts for gated
            activations (n = 2), else n = 1.
        w2: [E_local, I, H] in dtype, N(0, 1/I). Rank r owns global experts
            [r * E_local, (r + 1) * E_local). Seeded alike, the ranks hold distinct experts
            (each drawn from its global id), the same ones as any other group size would.
        b1: [E_local, n*I], b2: [E_local, H] in dtype, zeros (only with bias=True).

    Args:
        hidden: H, the model width.
        ffn_hidden: I, each expert's intermediate width.
        num_experts: E, experts in the whole group; a multiple of the group size W.
        topk: K, experts per token, 1 <= K <= E.
        group: expert-parallel process group (None = the default group); torch.distributed must
            be initialised before construction.
        score_func: "softmax" or "sigmoid".
        renormalize: divide the K selected scores by their sum.
        aux_loss_coef: >= 0, scales the load-balancing loss (0 gives a zero loss).
        router_dtype: dtype in which routing is computed, and of the router weight as built
            (float16, bfloat16, float32 or float64). Casting the layer (`.to(torch.bfloat16)`,
            `.half()`) casts the router weight too, but routing stays in router_dtype.
        dtype: expert weight dtype (bfloat16, float16, float32); default torch.get_default_dtype().
            x must have this dtype in forward.
        device: device of the parameters.
        schedule: `moe` schedule: "overlap" (fused megakernel), "sequential" (same bits, stage by
            stage) or "staged" (separate dispatch / grouped GEMM / combine launches). "overlap"
            is the fastest on 4xH200 (H=7168, I=2048, E=64, top-8: 6.6 ms vs 7.8 ms "staged" at
            T=4096, 1.3 vs 1.9 ms at T=128; bench/results/bench_H200x4_20261122.*).
        activation: the experts' activation, one of experts.ACTIVATIONS ("swiglu", "geglu",
            "gelu", "gelu_tanh", "relu", "silu").
        bias: give both expert layers a bias (b1, b2).
        grad_dtype: None, or torch.float32 for bf16 / fp16 experts: their gradients are computed
            in fp32 and added to `w1.main_grad` etc. (created when missing), not to `.grad`.
        recompute: `moe`'s: with gradients, keep only the inputs and recompute the expert work in
            the backward (activation checkpointing; slower), or keep the activations (default).
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, topk: int,
                 group: dist.ProcessGroup | None = None, *, score_func: str = "softmax",
                 renormalize: bool = True, aux_loss_coef: float = 0.0,
                 router_dtype: torch.dtype = torch.float32, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, schedule: str = "overlap", activation: str = "swiglu",
                 bias: bool = False, grad_dtype: torch.dtype | None = None, recompute: bool = False) -> None:
        super().__init__()
        for name, value in (("hidden", hidden), ("ffn_hidden", ffn_hidden), ("num_experts", num_experts),
                            ("topk", topk)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise DitronConfigError(f"{name} must be a positive int, got {value!r}")
        if topk > num_experts:
            raise DitronConfigError(f"topk={topk} exceeds num_experts={num_experts}; pick topk <= num_experts")
        if score_func not in SCORE_FUNCS:
            raise DitronConfigError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
        if not isinstance(renormalize, bool):
            raise DitronConfigError(f"renormalize must be a bool, got {renormalize!r}")
        if not isinstance(aux_loss_coef, numbers.Real) or isinstance(aux_loss_coef, bool) \
                or not math.isfinite(aux_loss_coef) or aux_loss_coef < 0:
            raise DitronConfigError(f"aux_loss_coef must be a finite number >= 0, got {aux_loss_coef!r}")
        if router_dtype not in ROUTER_DTYPES:
            raise DitronConfigError(f"router_dtype must be one of {ROUTER_DTYPES}, got {router_dtype!r}")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in SUPPORTED_DTYPES:
            raise DitronConfigError(f"dtype must be one of {SUPPORTED_DTYPES} (the experts' dtype), got {dtype!r}")
        if schedule not in SCHEDULES:
            raise DitronConfigError(f"unknown schedule {schedule!r}; available: {SCHEDULES}")
        check_activation(activation)
        if not isinstance(bias, bool):
            raise DitronConfigError(f"bias must be a bool, got {bias!r}")
        check_grad_dtype(grad_dtype)
        if not dist.is_available() or not dist.is_initialized():
            raise DitronConfigError("EPMoE needs torch.distributed initialised: call dist.init_process_group "
                                    "before building the layer")
        # dist.new_group returns a sentinel (not a group) on the ranks it leaves out
        if group is dist.GroupMember.NON_GROUP_MEMBER or (
                isinstance(group, dist.ProcessGroup) and dist.get_rank(group) < 0):
            raise DitronConfigError(f"this rank (global rank {dist.get_rank()}) is not a member of `group`; build EPMoE "
                             f"only on the ranks of its expert-parallel group")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise DitronConfigError(f"group must be a torch.distributed.ProcessGroup (e.g. from dist.new_group) or None "
                             f"for the default group, got {type(group).__name__}")
        world = dist.get_world_size(group)
        if num_experts % world:
            raise DitronConfigError(f"num_experts={num_experts} is not a multiple of the expert-parallel group size "
                             f"{world}; every rank must own the same number of experts")
        if num_experts // world > MAX_LOCAL_EXPERTS:
            raise DitronConfigError(f"{num_experts // world} experts per rank exceed the supported "
                             f"{MAX_LOCAL_EXPERTS}; use a larger group or fewer experts")

        self.hidden, self.ffn_hidden, self.num_experts, self.topk = hidden, ffn_hidden, num_experts, topk
        self.group = group
        self.world_size, self.rank = world, dist.get_rank(group)
        self.num_local_experts = num_experts // world
        self.score_func, self.renormalize, self.aux_loss_coef = score_func, renormalize, float(aux_loss_coef)
        self.router_dtype, self.schedule = router_dtype, schedule
        if not isinstance(recompute, bool):
            raise DitronConfigError(f"recompute must be a bool, got {recompute!r}")
        self.activation, self.grad_dtype, self.recompute = activation, grad_dtype, recompute
        self._slots = MoESlots(group)  # this layer's own FusedMoE and EPBuffer, built at its first call
        e_local, width = self.num_local_experts, width_factor(activation) * ffn_hidden
        self.router_weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=router_dtype, device=device))
        self.w1 = nn.Parameter(torch.empty(e_local, hidden, width, dtype=dtype, device=device))
        self.w2 = nn.Parameter(torch.empty(e_local, ffn_hidden, hidden, dtype=dtype, device=device))
        if bias:
            self.b1 = nn.Parameter(torch.empty(e_local, width, dtype=dtype, device=device))
            self.b2 = nn.Parameter(torch.empty(e_local, hidden, dtype=dtype, device=device))
        else:
            self.register_parameter("b1", None)
            self.register_parameter("b2", None)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Fan-in scaled normals: router and w1 N(0, 1/H), w2 N(0, 1/I); biases zero.

        The router comes from the global RNG (rank-local: seed alike on every rank or call
        `sync_router_` after). Each expert's weights come from a generator seeded with one draw
        of the global RNG plus the expert's GLOBAL id: seeded alike, the ranks hold distinct
        experts, and a model has the same experts whatever the group size."""
        device = self.w1.device
        if device.type == "meta":  # nothing to draw (deferred initialisation: to_empty, then call this)
            return
        nn.init.normal_(self.router_weight, std=self.hidden ** -0.5)
        # one draw of the global CPU RNG (explicitly: a default-device context must not move it)
        base = int(torch.randint(0, 2**62, (), dtype=torch.int64, device="cpu"))
        first = self.rank * self.num_local_experts
        for e in range(self.num_local_experts):
            gen = torch.Generator(device=device).manual_seed(base + first + e)  # drawn where the weights live
            for w, fan_in in ((self.w1, self.hidden), (self.w2, self.ffn_hidden)):
                w[e].normal_(0.0, fan_in ** -0.5, generator=gen)
        for b in (self.b1, self.b2):
            if b is not None:
                b.zero_()

    def free_buffers(self) -> None:
        """Free the layer's communication buffers (collective: call on every rank); the next
        forward builds them again."""
        self._slots.free()

    @torch.no_grad()
    def sync_router_(self, src: int = 0) -> EPMoE:
        """Broadcast the router weight from group rank `src` to every rank (collective: call on
        every rank of the group). Returns self."""
        if not isinstance(src, int) or isinstance(src, bool) or not 0 <= src < self.world_size:
            raise DitronConfigError(f"src must be a rank of the group, 0..{self.world_size - 1}, got {src!r}")
        group = self.group if self.group is not None else dist.group.WORLD
        dist.broadcast(self.router_weight.data, src=dist.get_global_rank(group, src), group=self.group)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., H] (dtype of w1) -> (out [..., H] in x's dtype, aux_loss 0-dim in router_dtype).
        Collective: every rank of the group must call it (T may differ per rank, and may be 0)."""
        problem = None
        if not isinstance(x, torch.Tensor) or x.ndim < 1 or x.shape[-1] != self.hidden:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            problem = f"x must be [..., hidden={self.hidden}], got {got}"
        elif x.dtype != self.w1.dtype:
            fix = f"cast x to {self.w1.dtype}"
            if x.dtype in SUPPORTED_DTYPES:
                fix += f", or build the layer with dtype={x.dtype} (or call .to({x.dtype}))"
            problem = f"x has dtype {x.dtype} but the experts are {self.w1.dtype}; {fix}"
        if problem:  # the peers' call on this layer raises at once too (it joins it flagged)
            # routing weights as the peers' router gives them (its gradient picks their path)
            weights = torch.empty((0, self.topk), requires_grad=self.router_weight.requires_grad)
            run_moe(self._slots, x, None, weights, self.w1, self.w2, b1=self.b1, b2=self.b2, activation=self.activation,
                    schedule=self.schedule, grad_dtype=self.grad_dtype, recompute=self.recompute,
                    error=DitronConfigError(problem))
        tokens = x.reshape(-1, self.hidden).contiguous()  # [T, H]
        logits = F.linear(tokens.to(self.router_dtype), self.router_weight.to(self.router_dtype))  # [T, E]
        topk_idx, topk_weights, probs = _route(logits, self.topk, self.score_func, self.renormalize)
        aux_loss = self.aux_loss_coef * _load_balancing_loss(probs, topk_idx, self.num_experts)
        out = run_moe(self._slots, tokens, topk_idx, topk_weights.to(torch.float32), self.w1, self.w2, b1=self.b1,
                      b2=self.b2, activation=self.activation, schedule=self.schedule, grad_dtype=self.grad_dtype,
                      recompute=self.recompute)
        return out.reshape(x.shape), aux_loss

    def extra_repr(self) -> str:
        first = self.rank * self.num_local_experts
        return (f"hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, num_experts={self.num_experts}, "
                f"topk={self.topk}, rank={self.rank}/{self.world_size} "
                f"(experts {first}..{first + self.num_local_experts - 1}), score_func={self.score_func!r}, "
                f"renormalize={self.renormalize}, aux_loss_coef={self.aux_loss_coef}, "
                f"router_dtype={self.router_dtype}"
                + ("" if self.router_weight.dtype == self.router_dtype else f" (weight {self.router_weight.dtype})")
                + f", dtype={self.w1.dtype}, schedule={self.schedule!r}, activation={self.activation!r}, "
                f"bias={self.b1 is not None}")


def _route(logits: torch.Tensor, topk: int, score_func: str,
           renormalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, E] -> topk_idx int64 [T, K], topk_weights [T, K] (logits' dtype), probs [T, E]:
    the per-token distribution the aux loss averages (softmax; sigmoid scores normalised to 1)."""
    scores = logits.softmax(dim=-1) if score_func == "softmax" else logits.sigmoid()
    # A stable descending sort keeps equal scores in expert order, so ties go to the lower id on
    # every device; torch.topk leaves the tie order unspecified. E is small, the sort is cheap.
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    topk_idx, topk_weights = order[:, :topk].contiguous(), sorted_scores[:, :topk]
    if renormalize:
        # clamp: sigmoid scores can all underflow to 0 for extreme logits
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True).clamp_min(
            torch.finfo(topk_weights.dtype).tiny)
    probs = scores if score_func == "softmax" else scores / scores.sum(dim=-1, keepdim=True).clamp_min(
        torch.finfo(scores.dtype).tiny)
    return topk_idx, topk_weights.contiguous(), probs


def _load_balancing_loss(probs: torch.Tensor, topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """E * sum_e f_e * P_e over this rank's tokens (0-dim, probs' dtype; 0 when T = 0).
    f_e = share of the T*K assignments to expert e (no gradient), P_e = mean_t probs[t, e]."""
    num_tokens = probs.shape[0]
    if num_tokens == 0:
        return probs.sum() * 0.0  # keeps the graph to the router, no 0/0
    counts = torch.bincount(topk_idx.reshape(-1), minlength=num_experts)  # [E], exact integer counts
    frac = counts.to(probs.dtype) / topk_idx.numel()
    return num_experts * (frac * probs.mean(dim=0)).sum()
