"""DeepEP v1 as a baseline of the EP benchmarks, measured in the same run when `deep_ep` imports.

DeepEP is not a dependency: build it on the GPU machine from the sources in the repository's
shared anchors (`bash build_deepep.sh deepep-v1-c5facf5-intranode.tar.gz /tmp/deepep`, about a
minute) and put it on PYTHONPATH; without it the rows say it is absent. Intranode (NVLink) only.

Rows, eager calls timed by the benchmark's rule like ours:
  DeepEP layout+dispatch  `get_dispatch_layout` then `dispatch` with `get_dispatch_config`
                          (what an eager `EPBuffer.dispatch`, which computes its layout, compares with);
  DeepEP combine          `combine` of the rows it received (identity experts) with `get_combine_config`.
Each at `Buffer.num_sms` 20, 24 and 32; the row is the fastest, the others are in its details.
Checks: the tokens DeepEP received == the tokens the all_to_all baseline moved to this rank (one
copy per (token, rank)); combine's output == x times the number of ranks the token went to,
within the dtype's rtol.

`DeepEPMoE`: the MoE layer a DeepEP user builds, for the layer benchmarks' "DeepEP + grouped_mm"
rows: layout + dispatch (one row per (token, rank), local expert ids, weights), a permutation of
the (row, k) pairs to expert-major order, torch._grouped_mm SwiGLU experts, the rows times their
weights added back per received token (index_add, as Megatron's unpermute), combine; autograd
through every step (dispatch's backward a combine of the row and weight gradients, combine's a
dispatch along the handle, as Megatron's DeepEP dispatcher does). At the largest SM budget.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ditron_ep.bench.ep_inputs import Inputs, ranks_reached
from ditron_ep.bench.ranks import RankContext, StageFailed, all_ranks, guarded
from ditron_ep.bench.spec import BenchContext, Measurement
from ditron_ep.check.tolerances import TOLERANCES

__all__ = ["DEEPEP_COMBINE", "DEEPEP_DISPATCH", "DeepEPMoE", "SM_BUDGETS", "deepep_absent", "measure_deepep"]

DEEPEP_DISPATCH, DEEPEP_COMBINE = "DeepEP layout+dispatch", "DeepEP combine"
SM_BUDGETS = (20, 24, 32)
_ABSENT = ("deep_ep does not import here ({}): build it on this machine with build_deepep.sh from the "
           "shared anchors and put it on PYTHONPATH")


def _deep_ep() -> Any:
    import deep_ep  # noqa: PLC0415 - optional, GPU-only
    return deep_ep


def deepep_absent() -> str | None:
    """Why DeepEP cannot be measured here, or None."""
    try:
        _deep_ep()
    except Exception as exc:  # noqa: BLE001 - any import failure means absent
        return _ABSENT.format(f"{type(exc).__name__}: {exc}")
    return None


def _fastest(ctx: BenchContext, impl: str, fns: dict[int, Callable[[], object]], work: float | None,
             check: str, ok: bool, details: dict[str, Any]) -> Measurement:
    """Time fns[sms] for each SM budget; the fastest median is the row, every median in its details."""
    rows = {sms: ctx.measure(impl, fn, work, check, ok, details=dict(details)) for sms, fn in fns.items()}
    timed = {s: m for s, m in rows.items() if m.times_us}
    if not timed:
        return next(iter(rows.values()))
    med = {s: sorted(m.times_us)[len(m.times_us) // 2] for s, m in timed.items()}
    best = min(med, key=med.get)
    row = timed[best]
    row.details.update({"num_sms": best, "median_us_by_num_sms": med})
    return row


def measure_deepep(ctx: BenchContext, inp: Inputs, experts: int, hidden: int,
                   work: dict[str, tuple[float | None, dict[str, Any]]]) -> list[Measurement]:
    """The two DeepEP rows for this config (`work`: the dispatch / combine work and details of ours)."""
    why = deepep_absent()
    if why is not None:
        return [Measurement(n, work=work[k][0], ok=False, error=why)
                for n, k in ((DEEPEP_DISPATCH, "dispatch"), (DEEPEP_COMBINE, "combine"))]
    deep_ep = _deep_ep()
    W = ctx.world
    group = ctx.group if ctx.group is not None else dist.group.WORLD
    hint = 0
    for sms in SM_BUDGETS:  # one buffer large enough for every budget's channels
        deep_ep.Buffer.set_num_sms(sms)
        hint = max(hint, deep_ep.Buffer.get_dispatch_config(W).get_nvl_buffer_size_hint(hidden * inp.x.element_size(), W),
                   deep_ep.Buffer.get_combine_config(W).get_nvl_buffer_size_hint(hidden * inp.x.element_size(), W))
    idx = inp.idx.to(torch.int64)
    w = inp.w.to(torch.float32)
    configs = {}
    for sms in SM_BUDGETS:
        deep_ep.Buffer.set_num_sms(sms)
        configs[sms] = (deep_ep.Buffer.get_dispatch_config(W), deep_ep.Buffer.get_combine_config(W))

    def dispatch(sms: int) -> Callable[[], tuple]:
        def call() -> tuple:
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
            return buf.dispatch(inp.x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, config=configs[sms][0])
        return call

    buf = None
    try:
        buf = guarded(ctx, "DeepEP Buffer", lambda: deep_ep.Buffer(group, hint, 0, explicitly_destroy=True))
        recv_x, _, _, _, handle, _ = guarded(ctx, "DeepEP dispatch (check)", dispatch(SM_BUDGETS[0]))
        tokens_in = sum(inp.tokens_sent[s][ctx.rank] for s in range(W))
        ok_d = all_ranks(ctx, recv_x.shape[0] == tokens_in)
        combined = guarded(ctx, "DeepEP combine (check)",
                           lambda: buf.combine(recv_x, handle, config=configs[SM_BUDGETS[0]][1])[0])
        want = inp.x.to(torch.float32) * ranks_reached(idx, experts, W)[:, None]
        err = ((combined.to(torch.float32) - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        ok_c = all_ranks(ctx, err <= TOLERANCES[ctx.dtype][0])
    except StageFailed as exc:
        if buf is not None:
            _destroy(ctx, buf)
        return [Measurement(n, work=work[k][0], ok=False, error=str(exc))
                for n, k in ((DEEPEP_DISPATCH, "dispatch"), (DEEPEP_COMBINE, "combine"))]
    # a handle's channels are its dispatch's SM budget: each combine budget combines a dispatch of its own
    handles = {s: guarded(ctx, "DeepEP dispatch (untimed)", dispatch(s)) for s in SM_BUDGETS}
    out = [
        _fastest(ctx, DEEPEP_DISPATCH, {s: dispatch(s) for s in SM_BUDGETS}, work["dispatch"][0],
                 "ok: received tokens == the baseline's" if ok_d else "FAIL: received tokens differ from the baseline's",
                 ok_d, work["dispatch"][1]),
        _fastest(ctx, DEEPEP_COMBINE,
                 {s: (lambda s=s: buf.combine(handles[s][0], handles[s][4], config=configs[s][1]))
                  for s in SM_BUDGETS},
                 work["combine"][0], f"{'ok' if ok_c else 'FAIL'}: rel err {err:.1e} vs x * ranks reached",
                 ok_c, work["combine"][1]),
    ]
    _destroy(ctx, buf)
    return out


def _destroy(ctx: RankContext, buf: Any) -> None:
    if ctx.on_cuda:
        torch.cuda.synchronize(ctx.device)
    dist.barrier(group=ctx.group)
    buf.destroy()


class DeepEPMoE:
    """out = DeepEPMoE(ctx, E, H)(x, idx, w, w1, w2): DeepEP v1 dispatch / combine around
    torch._grouped_mm SwiGLU experts (module docstring), differentiable. Collective to build and
    to `close()`; raises StageFailed when DeepEP is absent or its buffer cannot be made."""

    def __init__(self, ctx: RankContext, experts: int, hidden: int) -> None:
        why = deepep_absent()
        if why is not None:
            raise StageFailed(why)
        deep_ep = _deep_ep()
        W = ctx.world
        deep_ep.Buffer.set_num_sms(max(SM_BUDGETS))
        self.configs = (deep_ep.Buffer.get_dispatch_config(W), deep_ep.Buffer.get_combine_config(W))
        hint = max(c.get_nvl_buffer_size_hint(hidden * 2, W) for c in self.configs)  # bf16 rows
        group = ctx.group if ctx.group is not None else dist.group.WORLD
        self.ctx, self.experts = ctx, experts
        self.buf = guarded(ctx, "DeepEP Buffer (layer)", lambda: deep_ep.Buffer(group, hint, 0, explicitly_destroy=True))

    def __call__(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w1: torch.Tensor,
                 w2: torch.Tensor) -> torch.Tensor:
        from ditron_ep.bench.torch_moe import torch_experts  # noqa: PLC0415 - keeps this module light

        idx = idx.to(torch.int64)
        per_rank, _, per_expert, in_rank, _ = self.buf.get_dispatch_layout(idx, self.experts)
        state: dict[str, Any] = {}
        recv_x, recv_w = _DeepEPDispatch.apply(x, w.to(torch.float32), self, state, idx, per_rank, per_expert, in_rank)
        e_local, K = w1.shape[0], idx.shape[1]
        counts = state["counts"]  # host list: rows per local expert
        keys = state["recv_idx"].reshape(-1)
        keys = torch.where(keys >= 0, keys, e_local)                       # other ranks' k last
        pairs = torch.argsort(keys, stable=True)[:sum(counts)]             # (row, k) pairs, expert-major
        rows_of = pairs // K
        offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(x.device)
        y = torch_experts(recv_x.index_select(0, rows_of), offs, w1, w2, None)
        # a token's k rows weighted and added in fp32, cast once (bf16 products and sums put the
        # layer ~1.4e-2 off the float64 reference at T=4096, outside bf16's tolerance)
        y = y.float() * recv_w.reshape(-1).index_select(0, pairs)[:, None]
        tok = torch.index_add(y.new_zeros(recv_x.shape), 0, rows_of, y).to(recv_x.dtype)  # per received token
        return _DeepEPCombine.apply(tok, self, state)

    def stage_calls(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> tuple[Callable[[], object],
                                                                                      Callable[[], object]]:
        """The layer's communication alone, to be timed beside it (collective: runs one dispatch):
        (layout + dispatch of x with its weights, combine of the received rows along that
        dispatch's handle) — with the experts alone, the layer's glue-free sum."""
        idx, w32 = idx.to(torch.int64), w.to(torch.float32)

        def dispatch() -> tuple:
            per_rank, _, per_expert, in_rank, _ = self.buf.get_dispatch_layout(idx, self.experts)
            return self.buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                     num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w32,
                                     config=self.configs[0])
        recv_x, _, _, _, handle, _ = dispatch()
        return dispatch, lambda: self.buf.combine(recv_x, handle, config=self.configs[1])[0]

    def close(self) -> None:
        _destroy(self.ctx, self.buf)


class _DeepEPDispatch(torch.autograd.Function):
    """(recv_x, recv_w) = DeepEP dispatch of (x, w); state gets the handle, local expert ids and
    per-expert counts. Backward: combine of the rows' and the weights' gradients."""

    @staticmethod
    def forward(ctx, x, w, layer, state, idx, per_rank, per_expert, in_rank):
        recv_x, recv_idx, recv_w, counts, handle, _ = layer.buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=w, config=layer.configs[0])
        state.update(handle=handle, recv_idx=recv_idx, counts=counts)
        ctx.layer, ctx.handle = layer, handle
        return recv_x, recv_w

    @staticmethod
    def backward(ctx, grad_x, grad_w):
        gx, gw, _ = ctx.layer.buf.combine(grad_x.contiguous(), ctx.handle,
                                          topk_weights=None if grad_w is None else grad_w.contiguous(),
                                          config=ctx.layer.configs[1])
        return gx, gw, None, None, None, None, None, None


class _DeepEPCombine(torch.autograd.Function):
    """DeepEP combine of the per-token sums; backward: a dispatch of the gradient along the handle."""

    @staticmethod
    def forward(ctx, tok, layer, state):
        ctx.layer, ctx.handle = layer, state["handle"]
        return layer.buf.combine(tok, state["handle"], config=layer.configs[1])[0]

    @staticmethod
    def backward(ctx, grad_out):
        grad_tok = ctx.layer.buf.dispatch(grad_out.contiguous(), handle=ctx.handle, config=ctx.layer.configs[0])[0]
        return grad_tok, None, None
