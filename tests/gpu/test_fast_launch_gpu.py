"""The fast launcher on a GPU (runtime/fast_launch.py): a cached binary launches only for arguments
it was compiled for, with the ordinary launch's results, bit for bit. Local to each rank (no
collective). Run with tests/gpu/run_gpu_suite.sh."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import ditron_ep  # noqa: F401  (decides compiled vs interpreted before the triton.jit below)
from ditron_ep.runtime.fast_launch import VARY, FastLauncher, current_stream


@triton.jit
def _scaled_add(x_ptr, y_ptr, out_ptr, n, a, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(out_ptr + o, tl.load(x_ptr + o, mask=m) * a + tl.load(y_ptr + o, mask=m), mask=m)


def _call(launch, x, y, a, n, block=64):
    out = torch.full_like(x, float("nan"))
    launch[(triton.cdiv(n, block),)](x, y, out, n, a, BLOCK=block)
    return out


def test_cached_launches_equal_ordinary_launches():
    fl = FastLauncher(_scaled_add)  # its own cache: the test sees every entry it makes
    assert fl.enabled
    dev = torch.device("cuda", torch.cuda.current_device())
    base_x = torch.randn(4096 + 7, device=dev)
    base_y = torch.randn(4096 + 7, device=dev)
    cases = [  # (x, y, n): aligned, aligned again (a hit), misaligned views, n == 1, n % 16 == 0, odd n
        (base_x[:1000], base_y[:1000], 1000), (base_x[4:1004], base_y[4:1004], 1000),
        (base_x[1:1001], base_y[3:1003], 1000), (base_x[:1], base_y[:1], 1), (base_x[:4096], base_y[:4096], 4096),
        (base_x[:333], base_y[:333], 333), (base_x[:1000].half(), base_y[:1000].half(), 1000)]
    for x, y, n in cases:
        for _ in range(2):  # first call of a key: compile and remember; second: the cached launch
            got = _call(fl, x, y, 1.5, n)
            want = _call(_scaled_add, x, y, 1.5, n)
            assert torch.equal(got, want), (x.dtype, x.data_ptr() % 16, n)
    keys = list(fl._compiled)
    assert len(keys) == len(set(keys))
    # aligned 1000, misaligned, n == 1, multiple of 16, half: 5 binaries (333 shares 1000's)
    assert len(keys) == 5, keys


def test_bound_launches_equal_ordinary_launches():
    """A bound launch (x and n fixed, y, out and a filled per call) keys its cache by the filled
    values only, and launches what the ordinary path launches, bit for bit."""
    dev = torch.device("cuda", torch.cuda.current_device())
    base_x = torch.randn(1000 + 8, device=dev)
    base_y = torch.randn(1000 + 8, device=dev)
    for x in (base_x[:1000], base_x[1:1001]):  # an aligned and a misaligned fixed tensor
        bound = FastLauncher(_scaled_add).bind((triton.cdiv(1000, 64),), (x, VARY, VARY, 1000, VARY), BLOCK=64)
        assert bound.enabled
        for y, a in ((base_y[:1000], 1.5), (base_y[8:1008], -2.0), (base_y[3:1003], 0.5)):
            for _ in range(2):
                out = torch.full_like(x, float("nan"))
                bound(y, out, a)
                want = torch.full_like(x, float("nan"))
                _scaled_add[(triton.cdiv(1000, 64),)](x, y, want, 1000, a, BLOCK=64)
                assert torch.equal(out, want), (x.data_ptr() % 16, y.data_ptr() % 16, a)
        # aligned y twice (offsets 0 and 8 floats), misaligned y: two binaries
        assert len(bound._entries) == 2, list(bound._entries)


def test_a_cpu_tensor_after_cached_cuda_launches_is_refused_not_launched():
    """Cached launches pass CUDA tensors as addresses (fast_launch._key_and_raw); a CPU tensor of the
    same dtype and alignment is keyed apart, so Triton's launcher still refuses it (ValueError)
    instead of a kernel faulting on a host address; the context stays usable."""
    import pytest

    dev = torch.device("cuda", torch.cuda.current_device())
    x, y = torch.randn(256, device=dev), torch.randn(256, device=dev)
    fl = FastLauncher(_scaled_add)
    bound = FastLauncher(_scaled_add).bind((4,), (VARY, y, VARY, 256, 1.5), BLOCK=64)
    for _ in range(2):  # compile, then the cached launches
        out = torch.empty_like(x)
        bound(x, out)
        assert torch.equal(out, _call(fl, x, y, 1.5, 256))
    with pytest.raises(ValueError, match="cpu tensor"):
        _call(fl, x.cpu(), y, 1.5, 256)
    with pytest.raises(ValueError, match="cpu tensor"):
        bound(x.cpu(), torch.empty_like(x))
    assert torch.equal(_call(fl, x, y, 1.5, 256), _call(_scaled_add, x, y, 1.5, 256))


def test_non_constexpr_keyword_or_positional_constexpr_is_never_cached():
    fl = FastLauncher(_scaled_add)
    dev = torch.device("cuda", torch.cuda.current_device())
    x, y = torch.randn(100, device=dev), torch.randn(100, device=dev)
    for a in (1.5, 2.5):  # `a` by keyword: its value would be frozen in a cached entry
        out, want = torch.empty_like(x), torch.empty_like(x)
        fl[(2,)](x, y, out, 100, a=a, BLOCK=64)
        _scaled_add[(2,)](x, y, want, 100, a=a, BLOCK=64)  # (compiled: a fused multiply-add, not torch's x * a + y)
        assert torch.equal(out, want), a
    assert not fl._compiled
    for block in (64, 32):  # a constexpr given positionally: keyed by class only, so never cached
        out, want = torch.empty_like(x), torch.empty_like(x)
        fl[(triton.cdiv(100, block),)](x, y, out, 100, 1.5, block)
        _scaled_add[(triton.cdiv(100, block),)](x, y, want, 100, 1.5, BLOCK=block)
        assert torch.equal(out, want), block
    assert not fl._compiled


def test_current_stream_follows_the_stream_context():
    side = torch.cuda.Stream()
    assert current_stream() == torch.cuda.current_stream()
    with torch.cuda.stream(side):
        assert current_stream() == side
    assert current_stream() == torch.cuda.current_stream()
