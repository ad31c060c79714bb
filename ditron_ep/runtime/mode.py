"""Kernel execution mode: compiled for a GPU, or run by the Triton interpreter on the CPU.

Triton fixes the mode when `@triton.jit` runs, i.e. when a kernel module is imported. So the
choice is made once, at `import ditron_ep`, before any kernel module loads:

* `TRITON_INTERPRET` set in the environment (to anything) is honoured as given;
* otherwise `DITRON_BACKEND=emulated`, or no CUDA/ROCm device visible, turns the interpreter on.

Everything else asks `kernels_interpreted()` and refuses a backend that does not match, with an
error that says which variable to set before importing ditron_ep.
"""
from __future__ import annotations

import os

BACKENDS = ("auto", "emulated", "torch")

_decided: bool | None = None


def _gpu_visible() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def decide_mode() -> bool:
    """Set `TRITON_INTERPRET` if the user has not; return whether kernels will be interpreted."""
    global _decided
    if _decided is not None:
        return _decided
    explicit = os.environ.get("TRITON_INTERPRET")
    if explicit is not None:
        _decided = explicit.strip().lower() not in ("", "0", "false", "no", "off")
    else:
        want_emulated = os.environ.get("DITRON_BACKEND", "").strip().lower() == "emulated"
        _decided = want_emulated or not _gpu_visible()
        # Set before any ditron_ep kernel module runs `triton.jit` (the only moment it matters).
        os.environ["TRITON_INTERPRET"] = "1" if _decided else "0"
    return _decided


def kernels_interpreted() -> bool:
    """Whether ditron_ep's kernels run under the Triton interpreter in this process."""
    return decide_mode()


def gemm_dtype_problem(dtype) -> str | None:
    """Why the expert GEMMs cannot run in `dtype` in this process (None: they can): the Triton
    interpreter computes bf16 tl.dot wrongly (results off by orders of magnitude, no error)."""
    import torch

    if kernels_interpreted() and dtype == torch.bfloat16:
        return ("bfloat16 is not supported under the Triton interpreter (it computes bf16 tl.dot wrongly); "
                "use float32 or float16 on the CPU")
    return None


def resolve_backend(backend: str) -> str:
    """Map `backend` ('auto' | 'emulated' | 'torch') to a concrete backend valid in this process."""
    if backend not in BACKENDS:
        raise _config_error(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    interpreted = kernels_interpreted()
    if backend == "auto":
        return "emulated" if interpreted else "torch"
    if backend == "emulated" and not interpreted:
        raise _config_error(
            "backend 'emulated' needs kernels under the Triton interpreter, but ditron_ep was "
            "imported in compiled (GPU) mode. Set TRITON_INTERPRET=1 (or DITRON_BACKEND=emulated) "
            "in the environment before importing ditron_ep.")
    if backend == "torch":
        if interpreted:
            raise _config_error(
                "backend 'torch' runs compiled kernels on CUDA/ROCm, but ditron_ep was imported "
                "with the Triton interpreter on (TRITON_INTERPRET=1, DITRON_BACKEND=emulated, or "
                "no GPU visible). Unset those and import ditron_ep on a machine with a GPU.")
        if not _gpu_visible():
            raise _config_error("backend 'torch' needs a CUDA or ROCm device; none is visible")
    return backend


def _config_error(msg: str) -> Exception:
    from .errors import DitronConfigError

    return DitronConfigError(msg)
