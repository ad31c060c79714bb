"""torchtitan's MoE token dispatcher on ditron_ep's dispatch and combine: `DitronTokenDispatcher`.

It has the interface of torchtitan 0.3.0's dispatchers (`torchtitan/models/common/token_dispatcher.py`:
`wire_meshes(ep_mesh=)`, `init_buffer()`, `dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK,
num_local_tokens_per_expert_E) -> (routed_input_RD, num_tokens_per_local_expert_e, metadata)`,
`combine(routed_output_RD, metadata, x_TD) -> out_TD`) and returns what its
`AllToAllTokenDispatcher` returns: this rank's experts' rows, expert-major, each expert's rows by
(source rank, source token) — the same order — and their counts; `combine` applies the routing
scores to the expert outputs and adds each token's terms (in top-k slot order, fp32, cast once:
deterministic; torchtitan's rounds each scored term to the activations' dtype first). Gradients
reach x and the scores. torchtitan 0.3.0 pins a torch nightly and does not import beside the
torch this project tests with, so the class does not subclass torchtitan's base: it is built by
`DitronTokenDispatcher(DitronTokenDispatcher.Config(num_experts=E, top_k=K))` (the same fields
as torchtitan's `Config`) and plugged where a model builds its token dispatcher. Without an EP
mesh (`ep_mesh=None`: EP = 1) it reorders locally, as torchtitan's does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ditron_ep.runtime.errors import DitronConfigError

__all__ = ["DitronTokenDispatcher", "TorchtitanDispatchMetadata"]


@dataclass(frozen=True)
class TorchtitanDispatchMetadata:
    """What combine needs: the dispatch handle (None without EP) and the scores."""

    handle: object | None
    topk_scores_TK: torch.Tensor
    order_N: torch.Tensor | None = None   # EP = 1: the local reorder (token*K + k, expert-sorted)


class DitronTokenDispatcher:
    """torchtitan token dispatcher on ditron_ep (see the module docstring)."""

    @dataclass(kw_only=True)
    class Config:
        num_experts: int
        top_k: int

    def __init__(self, config: Config) -> None:
        if config.num_experts < 1 or not 1 <= config.top_k <= config.num_experts:
            raise DitronConfigError(f"num_experts must be >= 1 and 1 <= top_k <= num_experts, got {config}")
        self.num_experts, self.top_k = config.num_experts, config.top_k
        self.ep_mesh = None
        self.group = None
        self.slot = None  # this dispatcher's own EP buffer (ops.ep.functional.BufferSlot)

    def wire_meshes(self, *, ep_mesh=None) -> None:
        """Install the EP mesh (a 1-D DeviceMesh; None: EP = 1)."""
        self.ep_mesh = ep_mesh
        self.group = None if ep_mesh is None else ep_mesh.get_group()
        if ep_mesh is not None and self.num_experts % ep_mesh.size():
            raise DitronConfigError(f"num_experts={self.num_experts} is not a multiple of the EP size {ep_mesh.size()}")
        self.init_buffer()

    def init_buffer(self) -> None:
        """ditron_ep sizes this dispatcher's buffer at its first dispatch (and regrows it on every
        rank together)."""
        from ditron_ep.ops.ep.functional import BufferSlot

        if self.ep_mesh is not None and self.slot is None:
            self.slot = BufferSlot(self.group)

    def dispatch(self, x_TD: torch.Tensor, topk_scores_TK: torch.Tensor, topk_expert_ids_TK: torch.Tensor,
                 num_local_tokens_per_expert_E: torch.Tensor):
        del num_local_tokens_per_expert_E  # ditron_ep's layout counts the routes itself
        if self.ep_mesh is None:
            order = torch.argsort(topk_expert_ids_TK.reshape(-1), stable=True)
            counts = torch.bincount(topk_expert_ids_TK.reshape(-1), minlength=self.num_experts)
            return x_TD[order // self.top_k], counts, TorchtitanDispatchMetadata(None, topk_scores_TK, order)
        recv_x, handle = self.slot.dispatch(x_TD.contiguous(), topk_expert_ids_TK.contiguous(),
                                            num_experts=self.num_experts)
        counts = handle.num_recv_per_expert.to(torch.int64)
        return recv_x, counts, TorchtitanDispatchMetadata(handle, topk_scores_TK)

    def combine(self, routed_output_RD: torch.Tensor, metadata: TorchtitanDispatchMetadata,
                x_TD: torch.Tensor, **_unused) -> torch.Tensor:
        if metadata.handle is None:  # EP = 1: score and add each token's terms in slot order
            terms = torch.empty_like(routed_output_RD, dtype=torch.float32).index_copy_(
                0, metadata.order_N, routed_output_RD.to(torch.float32))
            terms = terms.view(x_TD.shape[0], self.top_k, -1) * metadata.topk_scores_TK.to(torch.float32)[..., None]
            out = terms[:, 0]
            for k in range(1, self.top_k):
                out = out + terms[:, k]
            return out.to(x_TD.dtype)
        out = self.slot.combine(routed_output_RD.contiguous(), metadata.handle, metadata.topk_scores_TK)
        return out.to(x_TD.dtype)
