"""The put transport's kernels compile for sm_90 with NVSHMEM's device library linked (CPU, no GPU).

The put path only runs on GPUs (tests/gpu/test_nvshmem_gpu.py); this compiles the PUTS
specialisations of the dispatch, both combine modes and the fused MoE megakernel against
`libnvshmem_device.bc` (the nvidia-nvshmem-cu13 wheel, a test dependency) in a TRITON_INTERPRET=0
subprocess, as the portability check does, and checks each module carries the NVSHMEM device
state `nvshmemx_cumodule_init` fills in. They are not
in the portability registry: that compiles for AMD too, and NVSHMEM is NVIDIA-only.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent('''
    import inspect, json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import ditron_ep  # noqa: F401
    from ditron_ep.ops.ep import combine_kernels as cb, dispatch_kernels as dk
    from ditron_ep.ops.moe_layer import fused_kernels as fk

    def source(fn, sig, cx):
        signature, cx = {}, dict(cx)
        for name, p in inspect.signature(fn.fn).parameters.items():
            if name in cx:
                signature[name] = "constexpr"
            elif name in sig:
                signature[name] = sig[name]
            else:
                cx[name], signature[name] = p.default, "constexpr"
        return ASTSource(fn=fn, signature=signature, constexprs=cx)

    common = {"K": 8, "HAS_WEIGHTS": True, "BLOCK_S": 16, "BLOCK_H": 512, "BLOCK_W": 8, "PUTS": True}
    cases = {
        "dispatch": (dk.ep_dispatch_kernel, dk._SIG, {**common, "SCALE_ROWS": False, "ENTRY_BARRIER": False}),
        "combine": (cb.ep_combine_kernel, cb._SIG, {**common, "BLOCK_T": 16}),
        "combine rank-reduced": (cb.ep_combine_kernel, cb._SIG, {**common, "BLOCK_T": 16, "RANK_REDUCED": True}),
        "fused layer": (fk.moe_fused_kernel, fk._SIG, {**fk._CONST, "TRACE": False, "PUTS": True}),
    }
    out = {}
    for name in sys.argv[2:]:
        fn, sig, cx = cases[name]
        try:
            k = triton.compile(source(fn, sig, cx), target=GPUTarget("cuda", 90, 32),
                               options={"extern_libs": (("libnvshmem_device", sys.argv[1]),), "num_warps": 8})
            out[name] = "nvshmemi_device_state" in k.asm["ptx"]
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
    print(json.dumps(out))
''')


def _device_library() -> str | None:
    """sm_90's bitcode of the nvidia-nvshmem-cu13 wheel (the test extra's): per architecture from
    NVSHMEM 3.5 on, one file before."""
    import nvidia.nvshmem as wheel

    lib = os.path.join(list(wheel.__path__)[0], "lib")
    for name in ("libnvshmem_device_sm_90.bc", "libnvshmem_device.bc"):
        if os.path.exists(os.path.join(lib, name)):
            return os.path.join(lib, name)
    return None


def test_put_transport_kernels_compile_for_sm90_with_nvshmem():
    lib = _device_library()
    assert lib, "the nvidia-nvshmem-cu13 wheel ships no device bitcode for sm_90"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    env.pop("DITRON_BACKEND", None)
    # two processes at once (the megakernel's compile takes about as long as the other three)
    groups = (["fused layer"], ["dispatch", "combine", "combine rank-reduced"])
    procs = [subprocess.Popen([sys.executable, "-c", _SCRIPT, lib, *names], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for names in groups]
    results = {}
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        results.update(json.loads(out.strip().splitlines()[-1]))
    assert results == {"dispatch": True, "combine": True, "combine rank-reduced": True, "fused layer": True}, results
