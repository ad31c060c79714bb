"""Argument checks shared by the ops (EPBuffer, FusedMoE): one wording for every tensor problem,
raised as DitronConfigError before any launch, saying what is wrong and how to fix it."""
from __future__ import annotations

from typing import Sequence

import torch

from ditron_ep.runtime.errors import DitronConfigError

# A dimension of an expected shape: its size (None: any), or (name, size) to print the name.
Dim = int | None | tuple[str, int | None]


def _dim_text(d: Dim) -> str:
    if isinstance(d, tuple):
        name, size = d
        return name if size is None else f"{name}={size}"
    return "*" if d is None else str(d)


def _dim_size(d: Dim) -> int | None:
    return d[1] if isinstance(d, tuple) else d


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def check_tensor(name: str, t: object, *, shape: Sequence[Dim] | None = None,
                 dtypes: Sequence[torch.dtype] | None = None, dtype_hint: str = "",
                 device: torch.device | None = None, owner: str = "the buffer",
                 contiguous: bool = True) -> torch.Tensor:
    """Check tensor argument `name`; return it. shape: expected sizes (None = any size);
    dtypes: the allowed dtypes (dtype_hint is appended to that message); device: where it must
    be (owner names what lives there); contiguous: whether it must be."""
    if not isinstance(t, torch.Tensor):
        raise DitronConfigError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if shape is not None and (t.dim() != len(shape) or any(
            _dim_size(d) is not None and a != _dim_size(d) for a, d in zip(t.shape, shape))):
        raise DitronConfigError(f"{name} must have shape [{', '.join(_dim_text(d) for d in shape)}], "
                                f"got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise DitronConfigError(f"{name} must be {_dtype_names(dtypes)}, got {t.dtype}"
                                + (f"; {dtype_hint}" if dtype_hint else ""))
    if device is not None and t.device != device:
        raise DitronConfigError(f"{name} is on {t.device}, {owner} on {device}; move it there")
    if contiguous and not t.is_contiguous():
        raise DitronConfigError(f"{name} must be contiguous; call .contiguous() first")
    return t


def check_dims(named: Sequence[tuple[str, object, int]], shapes: str, hints: dict[str, str] | None = None) -> None:
    """Raise DitronConfigError unless every (name, t, dims) is a tensor with `dims` dimensions:
    the first check of an entry point that looks a cached buffer up by its arguments' shapes.
    shapes says what each should be; hints[name] is appended to that argument's message."""
    for name, t, dims in named:
        if not isinstance(t, torch.Tensor) or t.dim() != dims:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            hint = f"; {hints[name]}" if hints and name in hints else ""
            raise DitronConfigError(f"{name} must be a {dims}-D tensor, got {got} (shapes: {shapes}){hint}")


def grad_needed(*tensors: object) -> bool:
    """Whether autograd records a call on these arguments (None and non-tensors never require grad)."""
    return torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors)


INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
