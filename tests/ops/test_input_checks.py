"""The shared tensor-argument checks: each problem gets its own message, naming the argument,
what was expected and how to fix it."""
from __future__ import annotations

import pytest
import torch

from ditron_ep.ops.input_checks import INDEX_DTYPES, check_tensor
from ditron_ep.runtime import DitronConfigError


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
