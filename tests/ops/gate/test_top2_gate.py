"""`top2_capacity_gate` (kernels, under the Triton interpreter) against its torch reference in
float64: routes and counts equal, gates, l_aux and the logits' gradient within fp32 rounding;
ragged token counts, prime expert counts, every token to one expert, capacity 0 and unbounded,
the Gumbel noise; bitwise run to run; bad arguments raise."""
from __future__ import annotations

import pytest
import torch

from ditron_ep.ops.gate import top2_capacity_gate
from ditron_ep.ops.gate.naive import top2_capacity_gate_reference
from ditron_ep.runtime.errors import DitronConfigError

CASES = [  # (S, E, capacity, kind)
    (37, 5, 9, "random"),        # S off every block, prime E, drops
    (300, 16, 40, "random"),     # several token blocks (BLOCK_S = 256 at E = 16), drops
    (64, 16, 10 ** 6, "random"),  # no drops
    (50, 8, 0, "random"),        # every route dropped: gates 0
    (45, 6, 20, "one_expert"),   # every token's first choice is expert 3
    (1, 2, 1, "random"),         # one token, two experts
    (33, 3, 7, "noise"),         # Gumbel noise on the second choice
]


def _logits(S: int, E: int, kind: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = torch.randn(S, E, generator=gen) * 2
    if kind == "one_expert":
        logits[:, 3] += 20
    noise = -torch.log(-torch.log(torch.rand(S, E, generator=gen))) if kind == "noise" else None
    return logits, noise


def _run(fn, logits, capacity, noise, d_gates, d_l_aux):
    leaf = logits.clone().requires_grad_()
    l_aux, idx, gates, counts = fn(leaf, capacity, noise)
    (grad,) = torch.autograd.grad((gates * d_gates).sum() + l_aux * d_l_aux, [leaf])
    return l_aux.detach(), idx, gates.detach(), counts, grad


@pytest.mark.parametrize("S, E, capacity, kind", CASES, ids=[f"S{c[0]}-E{c[1]}-cap{c[2]}-{c[3]}" for c in CASES])
def test_top2_gate_matches_the_float64_reference(S, E, capacity, kind):
    gen = torch.Generator().manual_seed(S * 100 + E)
    logits, noise = _logits(S, E, kind, gen)
    d_gates, d_l_aux = torch.randn(S, 2, generator=gen), float(torch.randn((), generator=gen))
    got = _run(top2_capacity_gate, logits, capacity, noise, d_gates, d_l_aux)
    want = _run(top2_capacity_gate_reference, logits.double(), capacity,
                None if noise is None else noise.double(), d_gates.double(), d_l_aux)
    l_aux, idx, gates, counts, grad = got
    assert idx.dtype == torch.int32 and counts.dtype == torch.int64 and gates.dtype == grad.dtype == torch.float32
    assert torch.equal(idx, want[1]) and torch.equal(counts, want[3])
    assert torch.isfinite(gates).all() and torch.isfinite(grad).all() and torch.isfinite(l_aux)
    torch.testing.assert_close(gates.double(), want[2], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(l_aux.double(), want[0], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(grad.double(), want[4], rtol=1e-5, atol=1e-6)
    if capacity == 0:
        assert (idx == -1).all() and (gates == 0).all()
    if capacity >= 2 * S:
        assert (idx >= 0).all()
    else:
        assert (idx == -1).any() or capacity >= S, "no route was dropped: the capacity went untested"
    again = _run(top2_capacity_gate, logits, capacity, noise, d_gates, d_l_aux)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "two runs differ"


def test_top2_gate_rejects_bad_arguments():
    logits = torch.randn(4, 3)
    for args, message in [((logits.double(), 2), "logits must be an fp32"), ((logits[:, :1], 2), "at least 2 experts"),
                          ((logits, -1), "capacity must be an int >= 0"), ((logits, 2.5), "capacity must be an int"),
                          ((logits, 2, torch.randn(4, 2)), "noise must be fp32")]:
        with pytest.raises(DitronConfigError, match=message):
            top2_capacity_gate(*args)
