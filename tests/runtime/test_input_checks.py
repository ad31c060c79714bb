"""The shared tensor-argument checks: each problem gets its own message, naming the argument,
what was expected and how to fix it."""
from __future__ import annotations

import pytest
import torch

from ditron_ep.runtime import DitronConfigError
from ditron_ep.runtime.input_checks import INDEX_DTYPES, check_tensor


@pytest.mark.parametrize("value,kwargs,message", [
    ([1, 2], {}, r"x must be a torch.Tensor, got list"),
    (torch.zeros(3, 5), {"shape": (("rows", None), ("hidden", 4))}, r"x must have shape \[rows, hidden=4\], got \(3, 5\)"),
    (torch.zeros(3), {"shape": (None, 4)}, r"x must have shape \[\*, 4\], got \(3,\)"),
    (torch.zeros(2, 2), {"dtypes": INDEX_DTYPES}, r"x must be int32 or int64, got torch.float32"),
    (torch.zeros(2, 2), {"dtypes": (torch.float16,), "dtype_hint": "cast it"}, r"x must be float16, got torch.float32; cast it"),
    (torch.zeros(2, 2, device="meta"), {"device": torch.device("cpu"), "owner": "the layer"},
     r"x is on meta, the layer on cpu; move it there"),
    (torch.zeros(4, 3).t(), {}, r"x must be contiguous; call .contiguous\(\) first"),
])
def test_check_tensor_messages(value, kwargs, message):
    with pytest.raises(DitronConfigError, match=message):
        check_tensor("x", value, **kwargs)


def test_check_tensor_accepts_and_returns():
    t = torch.zeros(3, 4, dtype=torch.int64)
    assert check_tensor("x", t, shape=(3, ("k", 4)), dtypes=INDEX_DTYPES, device=torch.device("cpu")) is t
    assert check_tensor("x", t.t(), contiguous=False) is not None


def _moe_inputs():
    T, H, I, El, K = 5, 16, 8, 3, 2
    return dict(x=torch.zeros(T, H, dtype=torch.bfloat16), topk_idx=torch.zeros(T, K, dtype=torch.int64),
                topk_weights=torch.zeros(T, K), w1=torch.zeros(El, H, 2 * I, dtype=torch.bfloat16),
                w2=torch.zeros(El, I, H, dtype=torch.bfloat16))


_MOE_SPEC = dict(dtype=torch.bfloat16, hidden=16, ffn_hidden=8, num_local_experts=3, topk=2, device=torch.device("cpu"))
_BREAKS = {  # one problem per case, on each argument
    "not a tensor": lambda t: t.tolist(),
    "dtype": lambda t: t.to(torch.int32 if t.is_floating_point() else torch.float32),
    "int16 / float64 dtype": lambda t: t.to(torch.int16 if not t.is_floating_point() else torch.float64),
    "one more row": lambda t: torch.cat([t, t[:1]]),
    "one less column": lambda t: t[..., :-1].contiguous(),
    "extra dim": lambda t: t.unsqueeze(0),
    "not contiguous": lambda t: t.transpose(0, 1).contiguous().transpose(0, 1) if t.dim() > 1 else t,
    "other device": lambda t: t.to("meta"),
}


@pytest.mark.parametrize("arg", ["x", "topk_idx", "topk_weights", "w1", "w2"])
@pytest.mark.parametrize("problem", list(_BREAKS))
def test_fused_moe_fast_input_check_agrees_with_the_generic_checks(arg, problem):
    """FusedMoE's one-line fast path accepts exactly the inputs the generic checks accept: it may
    never let through what they would reject (the generic checks then word the error)."""
    from ditron_ep.ops.moe_layer.fused import _check_inputs, _inputs_pass, validate_inputs

    args = _moe_inputs()
    args[arg] = _BREAKS[problem](args[arg])
    s = _MOE_SPEC
    fast = _inputs_pass(*args.values(), s["dtype"], s["hidden"], s["topk"], (3, 16, 16), (3, 8, 16), s["device"])
    try:
        _check_inputs(*args.values(), s["dtype"], 16, 8, 3, 2, s["device"], 2)
        generic = True
    except DitronConfigError:
        generic = False
    assert fast == generic
    if not generic:
        with pytest.raises(DitronConfigError):
            validate_inputs(*args.values(), **s)
    good = _moe_inputs()
    assert _inputs_pass(*good.values(), s["dtype"], s["hidden"], s["topk"], (3, 16, 16), (3, 8, 16), s["device"])
    validate_inputs(*good.values(), **s)
