"""Megatron-core's MoE token dispatcher on ditron_ep's dispatch and combine: `DitronTokenDispatcher`.

It implements `megatron.core.transformer.moe.token_dispatcher.MoETokenDispatcher` (the interface
`MoELayer` calls: dispatch_preprocess → token_dispatch → dispatch_postprocess → experts →
combine_preprocess → token_combine → combine_postprocess) with `ditron_ep.ops.dispatch` /
`combine`, and returns what Megatron's all-to-all dispatcher returns: the tokens of this rank's
experts, expert-major, each expert's rows ordered by (source rank, source token) — the same
order — the rows per local expert (a CPU int64 tensor) and each row's routing probability (the
experts scale their rows by it, so it carries gradients back to the router:
`ops.ep.recv_weights.dispatched_weights`). The combine adds each token's expert rows in top-k
slot order (slots sorted by expert id, as routing_map gives them) in fp32: deterministic.

    from ditron_ep.integrations.megatron import use_ditron_dispatcher
    n = use_ditron_dispatcher(model)   # every MoELayer in model; returns how many

Supported: expert parallelism over `pg_collection.ep` (any size), dropless routing or a
capacity factor without padding. Not supported (raise DitronConfigError): expert tensor
parallelism (expt_tp size > 1), `moe_pad_expert_input_to_capacity`, shared-expert overlap
(`moe_shared_expert_overlap`: run shared experts outside the dispatcher), router padding for
quantization, CUDA-graph capture of the MoE layer (`cuda_graph_scope` with moe parts).
"""
from __future__ import annotations

import functools

import torch

from ditron_ep.integrations import import_framework
from ditron_ep.runtime.errors import DitronConfigError

__all__ = ["SUPPORTED_VERSIONS", "DitronTokenDispatcher", "use_ditron_dispatcher"]

SUPPORTED_VERSIONS = ("0.16.1", "0.19.2")


def _megatron():
    import_framework("megatron.core", "megatron-core", "megatron", SUPPORTED_VERSIONS)
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

    return MoETokenDispatcher


@functools.lru_cache(maxsize=None)
def _dispatcher_class():
    base = _megatron()

    class DitronTokenDispatcher(base):
        """MoETokenDispatcher on ditron_ep (see the module docstring)."""

        def __init__(self, num_local_experts: int, local_expert_indices: list[int], config,
                     pg_collection=None) -> None:
            super().__init__(config=config, pg_collection=pg_collection)
            problems = []
            if self.tp_size > 1:
                problems.append("expert tensor parallelism (expt_tp size > 1)")
            if getattr(config, "moe_pad_expert_input_to_capacity", False):
                problems.append("moe_pad_expert_input_to_capacity")
            if getattr(config, "moe_router_padding_for_quantization", False):
                problems.append("moe_router_padding_for_quantization")
            if getattr(config, "moe_shared_expert_overlap", False):
                # MoELayer hands its shared experts to the dispatcher then: they would be skipped
                problems.append("moe_shared_expert_overlap (run the shared experts outside the dispatcher)")
            if getattr(config, "cuda_graph_impl", "none") != "none" and _graphs_moe(config):
                problems.append("CUDA-graph capture of the MoE layer, router or preprocessing (cuda_graph_scope)")
            if problems:
                raise DitronConfigError(f"DitronTokenDispatcher does not support {', '.join(problems)}")
            self.num_local_experts, self.local_expert_indices = num_local_experts, list(local_expert_indices)
            self.num_experts, self.topk = config.num_moe_experts, config.moe_router_topk
            if self.num_experts != num_local_experts * self.ep_size or \
                    self.local_expert_indices[0] != num_local_experts * torch.distributed.get_rank(self.ep_group):
                raise DitronConfigError("DitronTokenDispatcher: rank r of the expert-parallel group must own experts "
                                        "[r * num_local_experts, (r + 1) * num_local_experts)")

        def set_shared_experts(self, shared_experts):
            raise DitronConfigError("DitronTokenDispatcher does not overlap shared experts "
                                    "(moe_shared_expert_overlap=True); turn that off")

        def dispatch_preprocess(self, tokens, routing_map, probs):
            """routing_map [T, E] bool, probs [T, E] -> top-k expert ids (the first K experts of
            each token in id order, -1 for slots the capacity dropped) and their probabilities."""
            self.hidden_shape = tokens.shape
            x = tokens.reshape(-1, self.hidden_shape[-1])
            order = torch.argsort((~routing_map).to(torch.int8), dim=1, stable=True)[:, :self.topk]  # True first
            kept = routing_map.gather(1, order)
            self.topk_idx = torch.where(kept, order, torch.full_like(order, -1)).contiguous()
            self.topk_probs = (probs.gather(1, order) * kept).contiguous()
            return x, self.topk_probs

        def token_dispatch(self, hidden_states, probs):
            from ditron_ep.ops.ep.functional import BufferSlot
            from ditron_ep.ops.ep.recv_weights import dispatched_weights

            if getattr(self, "_ditron_slot", None) is None:  # this layer's own buffer, built at first use
                self._ditron_slot = BufferSlot(self.ep_group)
            recv_x, self.handle = self._ditron_slot.dispatch(hidden_states.contiguous(), self.topk_idx, probs,
                                                             num_experts=self.num_experts)
            return recv_x, dispatched_weights(probs, self.handle, self.ep_group).to(probs.dtype)

        def dispatch_postprocess(self, hidden_states, probs):
            # read with the dispatch's row count (default mode): no sync for the data kernel
            tokens_per_expert = torch.tensor(self.handle.recv_counts, dtype=torch.int64)
            return hidden_states, tokens_per_expert, probs

        def combine_preprocess(self, hidden_states):
            return hidden_states

        def token_combine(self, hidden_states, async_finish: bool = True, allocate_on_comm_stream: bool = True):
            # the experts scaled their rows by the probabilities: an unweighted sum of each token's rows
            return self._ditron_slot.combine(hidden_states.contiguous(), self.handle, None)

        def combine_postprocess(self, hidden_states):
            self.handle = None
            return hidden_states.view(self.hidden_shape)

        def free(self) -> None:
            """Free this dispatcher's buffer (collective: call on every rank of its group, with no
            backward of its calls pending); a later dispatch builds a new one."""
            if getattr(self, "_ditron_slot", None) is not None:
                self._ditron_slot.free()
                self._ditron_slot = None

    return DitronTokenDispatcher


def __getattr__(name: str):
    if name == "DitronTokenDispatcher":  # built on first use: importing this module imports no framework
        return _dispatcher_class()
    raise AttributeError(name)


def _graphs_moe(config) -> bool:
    """Whether the config's CUDA graphs capture any part of the MoE layer (a replay would reuse
    the routing the dispatcher kept from the captured call): megatron-core 0.19 names the captured
    modules in cuda_graph_modules (empty: the whole layer; its __post_init__ moves a
    cuda_graph_scope there and clears it), 0.16 in cuda_graph_scope."""
    modules = getattr(config, "cuda_graph_modules", None)
    scope = modules if modules is not None else config.cuda_graph_scope
    scopes = scope if isinstance(scope, (list, tuple)) else [scope]
    names = [getattr(s, "name", str(s)) for s in scopes]
    return not names or any(n in ("full", "full_iteration") or n.startswith("moe") for n in names)


def use_ditron_dispatcher(model: torch.nn.Module) -> int:
    """Give every megatron.core MoELayer in `model` a DitronTokenDispatcher (same groups and
    config as its current one); returns how many. Raises DitronConfigError, changing nothing,
    where a layer's settings are unsupported."""
    cls = _dispatcher_class()
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    made = []
    for layer in layers:
        old = layer.token_dispatcher
        pg = ProcessGroupCollection(ep=old.ep_group, expt_tp=old.tp_group, tp_ep=old.tp_ep_group)
        made.append(cls(layer.num_local_experts, layer.local_expert_indices, layer.config, pg_collection=pg))
    for layer, dispatcher in zip(layers, made):
        layer.token_dispatcher = dispatcher
    return len(made)
