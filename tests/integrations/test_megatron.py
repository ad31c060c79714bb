"""DitronTokenDispatcher (megatron-core's MoETokenDispatcher interface) on emulated gloo ranks with
the real package: the dispatched tokens, tokens_per_expert and probabilities follow the all-to-all
dispatcher's contract, and the combined output and the gradients of the tokens and of the router
logits (through the probabilities the experts apply) match float64 autograd. MoELayer itself needs
CUDA (its dispatchers and router), so layer-level tests are for the GPU suite."""
from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from tests.integrations import rank_fns_megatron as fns  # noqa: E402


@pytest.mark.parametrize("W,tokens,E,K,drop", [(2, [13, 9], 4, 2, 0.0), (3, [11, 0, 7], 6, 3, 0.2)],
                         ids=["W2-dropless", "W3-drops-empty-rank"])
def test_dispatcher_contract_output_and_gradients(emulated_cluster, W, tokens, E, K, drop):
    for rank, rep in enumerate(emulated_cluster(W).run(fns.dispatcher_case, tokens, E, K, drop, 4)):
        assert rep["rows_equal"], (rank, "dispatched rows are not in the all-to-all dispatcher's order")
        assert rep["counts"] == rep["want_counts"] and rep["counts_dtype"] == "torch.int64", (rank, rep)
        assert rep["counts_device"] == "cpu", rep
        for key in ("probs_err", "out_err", "x_grad_err", "logits_grad_err"):
            assert rep[key] <= 1e-5, (rank, key, rep[key])


def test_unsupported_settings_and_versions_raise(monkeypatch):
    import megatron.core as mcore

    from ditron_ep.integrations import megatron as integration
    from ditron_ep.runtime.errors import DitronConfigError

    integration._dispatcher_class.cache_clear()
    monkeypatch.setattr(mcore, "__version__", "0.9.0")
    with pytest.raises(DitronConfigError, match="megatron-core 0.9.0 is not supported.*0.16.1"):
        integration.DitronTokenDispatcher  # noqa: B018
    integration._dispatcher_class.cache_clear()
    monkeypatch.setattr(mcore, "__version__", "0.16.1+0123abc")  # a local build of a supported release
    assert integration.DitronTokenDispatcher is not None
    integration._dispatcher_class.cache_clear()


def test_cuda_graph_guard_reads_both_config_schemas():
    """The dispatcher refuses CUDA graphs over the MoE layer: megatron-core 0.19 names the captured
    modules in cuda_graph_modules (empty = the whole layer), 0.16 in cuda_graph_scope."""
    from enum import Enum
    from types import SimpleNamespace

    from ditron_ep.integrations.megatron import _graphs_moe

    Module = Enum("Module", "attn mlp moe moe_router")
    new = lambda modules: SimpleNamespace(cuda_graph_modules=modules, cuda_graph_scope=None)  # noqa: E731
    assert _graphs_moe(new([])) and _graphs_moe(new([Module.moe_router])) and _graphs_moe(new([Module.attn, Module.moe]))
    assert not _graphs_moe(new([Module.attn])) and not _graphs_moe(new([Module.attn, Module.mlp]))
    old = SimpleNamespace  # 0.16: no cuda_graph_modules field
    assert _graphs_moe(old(cuda_graph_scope="full")) and _graphs_moe(old(cuda_graph_scope=[Module.moe_router]))
    assert not _graphs_moe(old(cuda_graph_scope=[Module.attn]))
