"""The fast launcher's key (what a cached binary may depend on) and its interpreter path (CPU).
Its compiled path is tested on a GPU: tests/gpu/test_fast_launch_gpu.py."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from ditron_ep.runtime.fast_launch import VARY, _args_key, _key_and_raw, fast


@triton.jit
def _scaled_add(x_ptr, y_ptr, out_ptr, n, a, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(out_ptr + o, tl.load(x_ptr + o, mask=m) * a + tl.load(y_ptr + o, mask=m), mask=m)


def _arg_key(a):
    return _args_key((a,))[0]


def test_key_separates_what_triton_specialises_on():
    buf = torch.zeros(64, dtype=torch.float32)
    # a tensor: dtype and 16-byte alignment
    assert _arg_key(buf) != _arg_key(buf[1:])
    assert _arg_key(buf) == _arg_key(buf[4:])
    assert _arg_key(buf) != _arg_key(buf.to(torch.float16))
    # an int: == 1, a multiple of 16, 32-bit, unsigned 64-bit range
    assert len({_arg_key(v) for v in (1, 16, 17, 2**31, 2**63)}) == 5
    assert _arg_key(32) == _arg_key(48) and _arg_key(3) == _arg_key(5)
    assert _arg_key(True) != _arg_key(False) != _arg_key(0)
    assert _arg_key(2.0) == _arg_key(0.5) and _arg_key(None) == "N"
    assert _arg_key(torch.nn.Parameter(buf)) == _arg_key(buf)
    with pytest.raises(TypeError):
        _arg_key((1, 2))


def test_the_launcher_gets_cuda_tensors_as_addresses_and_anything_else_as_it_is():
    """What a cached launch passes to Triton's launcher: a CUDA tensor's address (its data_ptr), a
    CPU tensor, a Parameter and every non-tensor unchanged (the launcher validates those), each
    keyed as `_args_key` keys it."""
    cpu, p = torch.zeros(8), torch.nn.Parameter(torch.zeros(8))
    args = (cpu, p, 7, 2.5, None, True)
    key, raw = _key_and_raw(args)
    assert key == _args_key(args) and all(r is a for r, a in zip(raw, args))
    assert key[0][2] is False  # keyed apart from a CUDA tensor of the same dtype and alignment
    if torch.cuda.is_available():
        gpu = torch.zeros(8, device="cuda")
        key, raw = _key_and_raw((gpu, cpu))
        assert raw == [gpu.data_ptr(), cpu] and key[0][:2] == _arg_key(cpu)[:2] and key[0] != _arg_key(cpu)


def test_interpreter_takes_the_ordinary_path():
    launcher = fast(_scaled_add)
    assert fast(_scaled_add) is launcher and not launcher.enabled  # interpreted kernels are not JITFunctions
    x, y = torch.randn(100), torch.randn(100)
    out = torch.full((100,), float("nan"))
    launcher[(triton.cdiv(100, 32),)](x, y, out, 100, 2.0, BLOCK=32)
    torch.testing.assert_close(out, x * 2.0 + y, rtol=0, atol=0)


def test_bound_launch_fills_its_places_in_order():
    """A bound launch's VARY places take each call's values in order; the rest stays as bound
    (on the CPU every call takes the ordinary path, with the filled-in arguments)."""
    x, y = torch.randn(100), torch.randn(100)
    bound = fast(_scaled_add).bind((triton.cdiv(100, 32),), (VARY, y, VARY, 100, VARY), BLOCK=32)
    assert bound.slots == (0, 2, 4) and not bound.enabled
    for a in (2.0, -0.5):
        out = torch.full((100,), float("nan"))
        bound(x, out, a)
        torch.testing.assert_close(out, x * a + y, rtol=0, atol=0)
    with pytest.raises(TypeError, match="takes 3 values"):
        bound(x, out)
