"""The expert MLPs the MoE layer runs: which activations, gated or plain, and their shapes.

An expert is `Linear(H, n*I) -> act -> Linear(I, H)`, every local expert's weights stacked:

    w1 [E_local, H, n*I], b1 [E_local, n*I] (optional), w2 [E_local, I, H], b2 [E_local, H] (optional)

gated (n = 2: SwiGLU, GeGLU): z = x @ w1 + b1 is gate ‖ up, h = act(gate) * up;
plain (n = 1: GELU, GELU-tanh, ReLU, SiLU): h = act(z). Then y = h @ w2 + b2.
SwiGLU is Llama / Mixtral / DeepSeek's, GeGLU uses the exact (erf) GELU, as Megatron's and
PyTorch's default GELU do; "gelu_tanh" is the tanh approximation (GPT-2's, `approximate="tanh"`).
The kernels pick the activation by its code (a constexpr): `ACT_CODES` is the one numbering.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ditron_ep.runtime.errors import DitronConfigError

__all__ = ["ACTIVATIONS", "ACT_CODES", "GATED", "activation_code", "check_activation", "expert_activation",
           "width_factor"]

ACTIVATIONS = ("swiglu", "geglu", "gelu", "gelu_tanh", "relu", "silu")
ACT_CODES = {name: code for code, name in enumerate(ACTIVATIONS)}
GATED = frozenset({"swiglu", "geglu"})


def check_activation(activation: object) -> str:
    """The activation's name, or DitronConfigError naming the supported ones."""
    if activation not in ACT_CODES:
        raise DitronConfigError(f"activation={activation!r} is not supported; supported: {ACTIVATIONS} (gated: "
                                f"swiglu, geglu with w1 [E_local, H, 2I]; plain: gelu, gelu_tanh, relu, silu with "
                                f"w1 [E_local, H, I])")
    return activation


def activation_code(activation: str) -> int:
    return ACT_CODES[check_activation(activation)]


def width_factor(activation: str) -> int:
    """n: w1 has n*I columns (2 for gated activations: gate ‖ up)."""
    return 2 if check_activation(activation) in GATED else 1


def expert_activation(z: torch.Tensor, activation: str) -> torch.Tensor:
    """h from the pre-activation z [..., n*I] in torch (any dtype, differentiable): the references'
    definition of each activation (the kernels compute the same functions in fp32)."""
    if activation in GATED:
        gate, up = z.chunk(2, dim=-1)
        return (F.silu(gate) if activation == "swiglu" else F.gelu(gate)) * up
    if activation == "gelu":
        return F.gelu(z)
    if activation == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if activation == "relu":
        return F.relu(z)
    if activation == "silu":
        return F.silu(z)
    raise DitronConfigError(f"unknown activation {activation!r}")
