"""Kernel execution mode: compiled for a GPU, or run by the Triton interpreter on the CPU.

Triton fixes the mode when `@triton.jit` runs, i.e. when a kernel module is imported. The choice
is made once, the first time a ditron_ep kernel package is imported or the mode is queried —
never by `import ditron_ep` itself:

1. `use_interpreter(True/False)`, called before that moment, wins;
2. else `TRITON_INTERPRET` in the environment (Triton's own convention) is honoured as given;
3. else `DITRON_BACKEND=emulated` turns the interpreter on;
4. else the interpreter is on exactly when no CUDA/ROCm device is visible.

Every package of ditron_ep whose modules import triton fixes the mode in its `__init__`, before
triton is imported: Triton builds its own `@jit` helpers at import, in the mode of its environment
(see `_set_triton_mode`). The choice sets Triton's switch (`triton.knobs.runtime.interpret`) for
this process; os.environ is left as it was. `mode_source()` says which rule decided
(`python -m ditron_ep info` prints it). Everything else asks `kernels_interpreted()` and refuses a
backend that does not match.
"""
from __future__ import annotations

import os

BACKENDS = ("auto", "emulated", "torch")  # where kernels run (the CLI's --backend)
# symmetric-heap providers: the GPU ones are "torch" (CUDA IPC through torch symmetric memory) and
# "nvshmem" (NVSHMEM's symmetric heap through nvshmem4py, CUDA only)
HEAP_BACKENDS = BACKENDS + ("nvshmem",)

_decided: bool | None = None
_source: str = ""
_requested: bool | None = None


def _gpu_visible() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _env_flag(value: str) -> bool:
    return value.strip().lower() not in ("", "0", "false", "no", "off")


def use_interpreter(on: bool = True) -> None:
    """Choose the Triton interpreter (`on=True`) or compiled kernels before any kernel is imported.

    Raises `DitronConfigError` if the mode was already fixed the other way.
    """
    global _requested
    if _decided is not None:
        if _decided != bool(on):
            raise _config_error(
                f"the kernel mode is already fixed ({'interpreted' if _decided else 'compiled'}, by {_source}): "
                f"call ditron_ep.runtime.use_interpreter({bool(on)}) before importing ditron_ep.ops "
                f"or any other kernel module")
        return
    _requested = bool(on)


def decide_mode() -> bool:
    """Fix the mode (see the module docstring); return whether kernels will be interpreted."""
    global _decided, _source
    if _decided is not None:
        return _decided
    explicit = os.environ.get("TRITON_INTERPRET")
    if _requested is not None:
        decided, source = _requested, f"use_interpreter({_requested})"
    elif explicit is not None:
        decided, source = _env_flag(explicit), f"TRITON_INTERPRET={explicit} in the environment"
    elif os.environ.get("DITRON_BACKEND", "").strip().lower() == "emulated":
        decided, source = True, "DITRON_BACKEND=emulated in the environment"
    elif _gpu_visible():
        decided, source = False, "a GPU is visible"
    else:
        decided, source = True, "no GPU is visible"
    _set_triton_mode(decided, source)
    _decided, _source = decided, source
    return _decided


def _set_triton_mode(interpret: bool, source: str) -> None:
    """Put Triton in the mode, leaving os.environ as it was.

    `import triton` builds triton.language's own `@jit` helpers (`tl.zeros`, ...) in the mode its
    environment says, so Triton is imported here under the chosen TRITON_INTERPRET, which is then
    taken back; `triton.knobs.runtime.interpret` keeps the mode for the kernels decorated later.
    """
    import sys

    saved = os.environ.get("TRITON_INTERPRET")
    try:
        if "triton" not in sys.modules:
            os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
        import triton

        built_interpreted = _triton_language_interpreted()
        if built_interpreted is not None and built_interpreted != interpret:
            raise _config_error(
                f"triton was imported before ditron_ep fixed the kernel mode, and built "
                f"{'for the interpreter' if built_interpreted else 'for compiling'}, but ditron_ep needs "
                f"{'the interpreter' if interpret else 'compiled kernels'} ({source}). Set TRITON_INTERPRET="
                f"{int(interpret)} in the environment before Python starts, or import ditron_ep.ops before triton.")
        triton.knobs.runtime.interpret = interpret  # its setter exports TRITON_INTERPRET: restored below
        if interpret:
            _builtins_found_once()
            _no_dead_overflow_checks()
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def _no_dead_overflow_checks() -> None:
    """Triton's interpreter redoes every int32 add, sub and mul in int64 and range-checks the
    result (`sanitize_overflow`), then drops the check: its `device_assert` does nothing unless the
    builder's `debug` option is on, which the interpreter never sets (Triton 3.6). That dead work
    was half of an emulated fused-layer test's CPU time (cProfile: 35 of 70 s). Sanitize exactly
    when the assert could fire; kernels compute the same values either way."""
    import dataclasses

    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is not None and getattr(options, "sanitize_overflow", False) and not getattr(options, "debug", True):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def _builtins_found_once() -> None:
    """The Triton interpreter patches triton.language's builtins at every launch and at every
    device-function call, finding them each time with `inspect.getmembers` (dir, sort, a getattr
    per name; ~15 % of an emulated dispatch/combine's CPU time, cProfile). A module's builtins do
    not change: find them once. A module whose builtins are patched already (the launch patched
    them, or an earlier device call that never restores) has none left to patch, as with
    getmembers (a patched member is no builtin): it is patched all at once, so its first member
    tells. Left alone when this Triton's interpreter has no `_patch_builtin`."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch_attr, original = getattr(interpreter, "_patch_attr", None), getattr(interpreter, "_patch_builtin", None)
    if patch_attr is None or original is None or getattr(original, "found_once", False):
        return
    found: dict = {}

    def _patch_builtin(pkg, builder, scope) -> None:
        members = found.get(pkg)
        if members is None:
            members = found[pkg] = [(n, m) for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
        if members and getattr(pkg, members[0][0], None) is not members[0][1]:
            return  # patched already
        for name, member in members:
            patch_attr(pkg, name, member, builder, scope)

    _patch_builtin.found_once = True
    interpreter._patch_builtin = _patch_builtin


def _triton_language_interpreted() -> bool | None:
    """Whether triton.language's own jit helpers were built for the interpreter (None: none found)."""
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for value in vars(standard).values():
        if isinstance(value, (InterpretedFunction, JITFunction)):
            return isinstance(value, InterpretedFunction)
    return None


def mode_source() -> str:
    """Which rule fixed the mode, e.g. 'TRITON_INTERPRET=1 in the environment' (fixes it if not yet)."""
    decide_mode()
    return _source


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
    """Map `backend` ('auto' | 'emulated' | 'torch' | 'nvshmem') to a concrete backend valid in this process."""
    if backend not in HEAP_BACKENDS:
        raise _config_error(f"unknown backend {backend!r}; choose one of {', '.join(HEAP_BACKENDS)}")
    interpreted = kernels_interpreted()
    if backend == "auto":
        return "emulated" if interpreted else "torch"
    if backend == "emulated" and not interpreted:
        raise _config_error(
            "backend 'emulated' needs kernels under the Triton interpreter, but ditron_ep was "
            "imported in compiled (GPU) mode. Set TRITON_INTERPRET=1 (or DITRON_BACKEND=emulated) "
            "in the environment (or call ditron_ep.runtime.use_interpreter()) before importing ditron_ep.ops.")
    if backend in ("torch", "nvshmem"):
        if interpreted:
            raise _config_error(
                f"backend {backend!r} runs compiled kernels on a GPU, but ditron_ep was imported "
                f"with the Triton interpreter on ({_source}). Unset that and import ditron_ep.ops on a machine with a GPU.")
        if not _gpu_visible():
            raise _config_error(f"backend {backend!r} needs a {'CUDA or ROCm' if backend == 'torch' else 'CUDA'} "
                                "device; none is visible")
        import torch

        if backend == "nvshmem" and torch.version.hip:
            raise _config_error("backend 'nvshmem' is NVIDIA-only (NVSHMEM); on ROCm use backend='torch'")
    return backend


def _config_error(msg: str) -> Exception:
    from ditron_ep.runtime.errors import DitronConfigError

    return DitronConfigError(msg)
