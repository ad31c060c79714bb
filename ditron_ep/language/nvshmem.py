"""NVSHMEM device calls for Triton kernels: the `put` transport of the nvshmem heap backend.

Not part of the portable kernel path: a kernel calls these only under a constexpr that selects the
put transport, and such a kernel is launched through `nvshmem_launcher(kernel)`, which links
NVSHMEM's device library (`libnvshmem_device.bc`, found by nvshmem4py) through Triton's
`extern_libs` and initialises each compiled module for NVSHMEM (`nvshmemx_cumodule_init`) before
its first launch. Kernels compiled without the put transport never reference these symbols, so
the same source still compiles for AMD and runs under the interpreter.

Addresses are passed as int64 (a symmetric address: this rank's own arena base + offset; NVSHMEM
translates it for the target PE). Signals are uint64 words on the symmetric heap. Every call
below is issued by every thread of the program (Triton scalars are uniform), as the `_block`
variants require; `signal_op` by every thread is idempotent for SIGNAL_SET.

NVSHMEM's own waits (`signal_wait_until`) never give up, so kernels wait with the package's
bounded `primitives.wait` on the signal word's low 32 bits instead (little-endian: a SIGNAL_SET
of a zero-extended int32 call number leaves it there); `signal_wait_until` is declared for
completeness and for tests.
"""
from __future__ import annotations

import re
from typing import Any

import triton
import triton.language as tl
from triton.language import core

from ditron_ep.language.registry import register_device_function

# nvshmemi_amo_t / nvshmemi_cmp_type (nvshmem_types.h)
SIGNAL_SET = tl.constexpr(9)
SIGNAL_ADD = tl.constexpr(10)
CMP_EQ, CMP_NE, CMP_GT, CMP_LE, CMP_LT, CMP_GE = (tl.constexpr(v) for v in range(6))

_I32, _I64, _U64 = core.dtype("int32"), core.dtype("int64"), core.dtype("uint64")


def _call(name: str, args: list, types: tuple, _semantic: Any):
    # The device functions return void; Triton's extern calls need a result type, and an unused
    # int32 result of a void function is what PyTorch's NVSHMEM Triton bindings declare too.
    return core.extern_elementwise("", "", args, {types: (name, _I32)}, is_pure=False, _semantic=_semantic)


@core.extern
def putmem_nbi_block(dest, source, nbytes, pe, _semantic=None):
    """Start copying `nbytes` from local `source` to symmetric `dest` on PE `pe` (all threads of
    the program; returns before delivery: order with `fence`, complete with `quiet`)."""
    return _call("nvshmemx_putmem_nbi_block", [dest, source, nbytes, pe], (_I64, _I64, _I64, _I32), _semantic)


@core.extern
def putmem_signal_nbi_block(dest, source, nbytes, sig_addr, signal, sig_op, pe, _semantic=None):
    """`putmem_nbi_block`, then `sig_op(signal)` on the uint64 word `sig_addr` of PE `pe`, delivered
    after the data."""
    return _call("nvshmemx_putmem_signal_nbi_block", [dest, source, nbytes, sig_addr, signal, sig_op, pe],
                 (_I64, _I64, _I64, _I64, _U64, _I32, _I32), _semantic)


@core.extern
def signal_op(sig_addr, signal, sig_op, pe, _semantic=None):
    """`sig_op(signal)` on the uint64 word `sig_addr` of PE `pe` (SIGNAL_SET / SIGNAL_ADD)."""
    return _call("nvshmemx_signal_op", [sig_addr, signal, sig_op, pe], (_I64, _U64, _I32, _I32), _semantic)


@core.extern
def signal_wait_until(sig_addr, cmp, value, _semantic=None):
    """Wait (unbounded) until the local uint64 signal compares `cmp` to `value`."""
    return core.extern_elementwise("", "", [sig_addr, cmp, value],
                                   {(_I64, _I32, _U64): ("nvshmem_signal_wait_until", _U64)},
                                   is_pure=False, _semantic=_semantic)


@core.extern
def fence(_semantic=None):
    """Order this thread's earlier puts and signals to each PE before its later ones."""
    return core.extern_elementwise("", "", [], {(): ("nvshmem_fence", _I32)}, is_pure=False, _semantic=_semantic)


@core.extern
def quiet(_semantic=None):
    """Wait until every put and signal this thread issued is delivered."""
    return core.extern_elementwise("", "", [], {(): ("nvshmem_quiet", _I32)}, is_pure=False, _semantic=_semantic)


@core.extern
def my_pe(_semantic=None):
    return core.extern_elementwise("", "", [], {(): ("nvshmem_my_pe", _I32)}, is_pure=True, _semantic=_semantic)


@register_device_function
@triton.jit
def put_signal_word(sig_table_ptr, rank, sig_word, value):
    """(symmetric address of the uint64 signal at int32 index `sig_word` (even) of the signal area,
    the int32 `value` zero-extended): what a put's SIGNAL_SET names."""
    return (tl.load(sig_table_ptr + rank) + tl.cast(sig_word, tl.int64) * 4,
            tl.cast(tl.cast(value, tl.uint32, bitcast=True), tl.uint64))


@register_device_function
@triton.jit
def put_signal(table_ptr, sig_table_ptr, rank, peer, dst_offset, src_ptr, n_elems, sig_word, value):
    """Put `n_elems` contiguous elements from local `src_ptr` to byte `dst_offset` of rank `peer`'s
    arena, then SET the uint64 signal at int32 index `sig_word` (even) of `peer`'s signal area to
    the int32 `value` zero-extended; NVSHMEM delivers the signal after the data. Every thread of
    the program calls it (a block-scoped put: the threads copy together)."""
    ELT: tl.constexpr = src_ptr.dtype.element_ty.primitive_bitwidth // 8
    dest = tl.load(table_ptr + rank) + dst_offset         # symmetric address: own base + offset
    sig, signal = put_signal_word(sig_table_ptr, rank, sig_word, value)
    putmem_signal_nbi_block(dest, tl.cast(src_ptr, tl.int64), tl.cast(n_elems, tl.int64) * ELT, sig, signal,
                            SIGNAL_SET, peer)


@register_device_function
@triton.jit
def put_row_block(dst, src, n_rows, h_lo, h_hi, H, ELT: tl.constexpr, peer):
    """Put columns [h_lo, h_hi) of rows [0, n_rows) of a row-major block (H columns of ELT bytes)
    from this rank's symmetric address `src` to `dst` on `peer` (each the block's first row): one
    block-scoped put when the columns are whole rows (the block is contiguous), else one per row."""
    if (h_lo == 0) & (h_hi == H):
        putmem_nbi_block(dst, src, tl.cast(n_rows, tl.int64) * H * ELT, peer)
    else:
        for j in range(0, n_rows):
            off = (tl.cast(j, tl.int64) * H + h_lo) * ELT
            putmem_nbi_block(dst + off, src + off, tl.cast(h_hi - h_lo, tl.int64) * ELT, peer)


@register_device_function
@triton.jit
def signal_after_puts(sig_table_ptr, rank, peer, sig_word, value):
    """After this program's puts to `peer`: a CTA barrier (every thread's puts issued), a fence,
    then SET the signal at `sig_word` of `peer` to `value` (as `put_signal`), delivered after them."""
    tl.debug_barrier()
    fence()
    sig, signal = put_signal_word(sig_table_ptr, rank, sig_word, value)
    signal_op(sig, signal, SIGNAL_SET, peer)


# ---------------------------------------------------------------------------------------- host side
_modules: dict[int, Any] = {}  # module handle -> the compiled kernel initialised for NVSHMEM
_launchers: dict[int, Any] = {}


def device_library() -> str:
    """Path of NVSHMEM's LLVM bitcode device library: nvshmem4py's finder (the per-arch file where
    the nvidia-nvshmem wheel ships one), else `libnvshmem_device.bc` of that wheel."""
    import os

    from ditron_ep.runtime.backends.nvshmem import import_nvshmem
    from ditron_ep.runtime.errors import DitronConfigError

    core = import_nvshmem()
    try:
        return core.find_device_bitcode_library()
    except Exception as err:  # an older cuda.pathfinder may not know NVSHMEM's headers
        try:
            import nvidia.nvshmem as wheel

            import torch

            major, minor = torch.cuda.get_device_capability()
            lib = os.path.join(list(wheel.__path__)[0], "lib")
            # per architecture from NVSHMEM 3.5 on, one file before
            for name in (f"libnvshmem_device_sm_{major}{minor}.bc", "libnvshmem_device.bc"):
                if os.path.exists(os.path.join(lib, name)):
                    return os.path.join(lib, name)
        except ImportError:
            pass
        raise DitronConfigError(f"NVSHMEM's device library (libnvshmem_device.bc) was not found ({err}); "
                                f"install nvidia-nvshmem-cu13 (a dependency of the nvshmem extra)") from err


def init_module(kernel: Any) -> None:
    """Initialise a compiled kernel's CUDA module for NVSHMEM once (before its first launch)."""
    import torch

    from ditron_ep.runtime.errors import DitronConfigError

    kernel._init_handles()
    handle = int(kernel.module)
    if _modules.get(handle) is kernel:
        return
    if torch.cuda.is_current_stream_capturing():
        raise DitronConfigError(
            f"kernel {kernel.name} meets NVSHMEM for the first time inside a CUDA graph capture, and initialising "
            f"its module for NVSHMEM copies from the host, which a capture forbids: make one call of this "
            f"shape outside the capture first")
    from nvshmem import bindings

    status = bindings.cumodule_init(handle)
    # A specialisation whose put branch compiled away has no NVSHMEM device state for the call to
    # fill in, and the call fails on it ('named symbol not found'): nothing to initialise then.
    ptx = kernel.asm.get("ptx")
    if status not in (None, 0) and (ptx is None or re.search(r"nvshmemi?_device\w*state", ptx)):
        raise RuntimeError(f"nvshmemx_cumodule_init failed with status {status} for kernel {kernel.name}")
    _modules[handle] = kernel  # held: a module stays loaded (its handle unique) while its kernel lives


def nvshmem_launcher(fn: Any):
    """`nvshmem_launcher(kernel)[grid](*args, **kwargs)`: `fast(kernel)` with NVSHMEM's device
    library linked and every newly compiled module initialised for NVSHMEM before it runs."""
    from ditron_ep.runtime.fast_launch import FastLauncher

    launcher = _launchers.get(id(fn))
    if launcher is None or launcher.fn is not fn:
        launcher = _launchers[id(fn)] = FastLauncher(fn, prepare=init_module,
                                                     extern_libs=(("libnvshmem_device", device_library()),))
    return launcher
