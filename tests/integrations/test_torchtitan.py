"""DitronTokenDispatcher with torchtitan 0.3.0's dispatcher interface against a faithful copy of
its AllToAllTokenDispatcher (torchtitan 0.3.0 pins a torch nightly and does not import here):
the routed rows bit for bit in its order, the per-expert counts, the combined output and the
gradients of x and the scores, on emulated gloo ranks."""
from __future__ import annotations

import pytest

from tests.integrations import rank_fns_torchtitan as fns


@pytest.mark.parametrize("W,tokens,E,K", [(2, [12, 7], 4, 2), (3, [9, 0, 5], 6, 3)], ids=["W2", "W3-empty-rank"])
def test_matches_torchtitans_all_to_all_dispatcher(emulated_cluster, W, tokens, E, K):
    for rank, rep in enumerate(emulated_cluster(W).run(fns.dispatcher_case, tokens, E, K, 3)):
        assert rep["rows_equal"] and rep["counts_equal"], (rank, rep)
        for key in ("out_err", "x_grad_err", "score_grad_err"):
            assert rep[key] <= 1e-6, (rank, key, rep)


def test_local_dispatch_without_an_ep_mesh():
    import torch

    from ditron_ep.integrations.torchtitan import DitronTokenDispatcher

    disp = DitronTokenDispatcher(DitronTokenDispatcher.Config(num_experts=4, top_k=2))
    disp.wire_meshes(ep_mesh=None)
    x = torch.randn(5, 8)
    ids = torch.tensor([[0, 3], [1, 0], [2, 2 - 1], [3, 2], [0, 1]])
    scores = torch.rand(5, 2)
    routed, counts, meta = disp.dispatch(x, scores, ids, torch.bincount(ids.reshape(-1), minlength=4))
    assert counts.tolist() == [3, 3, 2, 2] and routed.shape == (10, 8)
    out = disp.combine(routed * 2, meta, x)
    assert torch.allclose(out, 2 * x * scores.sum(1, keepdim=True))
