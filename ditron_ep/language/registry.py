"""Registry of the package's Triton kernels, read by the portability check (`tools/portability.py`).

Kernel modules declare, right below each kernel, the signatures CI compiles it with::

    @triton.jit
    def dispatch_kernel(x_ptr, table_ptr, n_tokens, BLOCK_H: tl.constexpr): ...

    register_kernel(dispatch_kernel, {"x_ptr": "*bf16", "table_ptr": "*i64", "n_tokens": "i32"},
                    {"BLOCK_H": 1024}, label="bf16")

and mark helpers that are only inlined into kernels (they have no signature of their own)::

    @register_device_function
    @triton.jit
    def wait_signal(...): ...

Registration only records data (no compile, no heavy import), with or without the interpreter.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Iterable

__all__ = ["KernelSignature", "is_registered", "qualified_name", "register_device_function", "register_kernel",
           "registered_device_functions", "registered_kernels"]

@dataclasses.dataclass(frozen=True)
class KernelSignature:
    """One compile configuration of a kernel: argument types, constexpr values, launch options."""

    fn: Any  # JITFunction / InterpretedFunction (or an Autotuner / Heuristics wrapping one)
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    label: str
    options: tuple[tuple[str, Any], ...]
    aligned: bool
    multiples_of_16: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()  # e.g. ("cuda:90",): compile only for these; () = every target

    def compiles_for(self, backend: str, arch: object) -> bool:
        return not self.targets or f"{backend}:{arch}" in self.targets or backend in self.targets

    @property
    def name(self) -> str:
        return qualified_name(self.fn)


_KERNELS: dict[Callable, list[KernelSignature]] = {}  # base python function -> signatures
_DEVICE_FUNCTIONS: dict[Callable, Any] = {}  # base python function -> jit object


def _jit_types() -> tuple[type, ...]:
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    return (JITFunction, InterpretedFunction, Autotuner, Heuristics)


def _is_jit(obj: Any) -> bool:
    return isinstance(obj, _jit_types())


def _base_function(fn: Any) -> Callable:
    """The user's python function under any jit / interpreter / autotune wrappers."""
    obj = fn
    while not inspect.isfunction(obj) and hasattr(obj, "fn"):
        obj = obj.fn
    if not inspect.isfunction(obj):
        raise TypeError(f"{fn!r} is not a @triton.jit function")
    return obj



def qualified_name(fn: Any) -> str:
    base = _base_function(fn)
    return f"{base.__module__}.{base.__qualname__}"


def register_kernel(fn: Any, signature: dict[str, str], constexprs: dict[str, object] | None = None, *,
                    label: str = "", options: dict[str, Any] | None = None, aligned: bool = True,
                    multiples_of_16: Iterable[str] = (), targets: Iterable[str] = ()) -> Any:
    """Record one compile signature of a ``@triton.jit`` kernel for the portability check.

    ``signature`` maps every non-constexpr argument to a Triton type string ("*bf16", "*i64",
    "i32", "fp32", ...); ``constexprs`` maps constexpr arguments to values (constexprs with
    defaults may be left out). ``options`` are compile options such as ``num_warps`` and
    ``num_stages``. ``aligned`` marks pointer arguments 16-byte aligned, as Triton specialises
    them for torch tensors at launch. ``multiples_of_16`` names integer arguments that real launches
    pass as multiples of 16 (hidden sizes, heap offsets): Triton specialises those at launch, and
    its vectorisation and pipelining depend on it, so the check compiles what really runs.
    ``targets`` limits the check to some targets ("cuda:90", "hip"): a kernel written for one
    architecture (the Gluon Hopper kernels) is not compiled for the others. Gluon kernels
    (``@gluon.jit``) are registered the same way, tensor descriptors typed as
    "tensordesc<bf16[128, 64],NVMMASharedLayout(...)>".
    Call once per configuration worth checking; returns ``fn``.
    """
    if not _is_jit(fn):
        raise TypeError(f"register_kernel expects a @triton.jit function, got {fn!r}")
    if not isinstance(signature, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in signature.items()):
        raise TypeError(f"signature of {qualified_name(fn)} must map argument names to Triton type strings, "
                        f"e.g. {{'x_ptr': '*bf16', 'n': 'i32'}}; got {signature!r}")
    entry = KernelSignature(
        fn=fn,
        signature=tuple(signature.items()),
        constexprs=tuple((constexprs or {}).items()),
        label=label,
        options=tuple(sorted((options or {}).items())),
        aligned=aligned,
        multiples_of_16=tuple(multiples_of_16),
        targets=tuple(targets),
    )
    not_ints = [n for n in entry.multiples_of_16 if signature.get(n) not in ("i32", "i64")]
    if not_ints:
        raise ValueError(f"multiples_of_16 of {qualified_name(fn)} names {not_ints}, which are not i32/i64 arguments")
    entries = _KERNELS.setdefault(_base_function(fn), [])
    if entry not in entries:  # re-importing a module registers the same data again
        entries.append(entry)
    return fn


def register_device_function(fn: Any) -> Any:
    """Mark a ``@triton.jit`` helper that is only inlined into kernels; returns ``fn`` unchanged.

    Usable as a decorator placed above ``@triton.jit``.
    """
    if not _is_jit(fn):
        raise TypeError(f"register_device_function expects a @triton.jit function (put it above "
                        f"@triton.jit), got {fn!r}")
    _DEVICE_FUNCTIONS[_base_function(fn)] = fn
    return fn


def registered_kernels() -> list[KernelSignature]:
    return [entry for entries in _KERNELS.values() for entry in entries]


def registered_device_functions() -> list[Any]:
    return list(_DEVICE_FUNCTIONS.values())


def is_registered(fn: Any) -> bool:
    base = _base_function(fn)
    return base in _KERNELS or base in _DEVICE_FUNCTIONS
