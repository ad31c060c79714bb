"""The kernel mode: importing ditron_ep has no side effects; the rules that fix the mode, in order.

Each case runs in a fresh interpreter: the mode is fixed once per process.
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Prints what the environment looked like around the imports, the mode, who chose it, and what
# Triton's own switch says (what `@triton.jit` follows).
_PROBE = """
import json, os, sys
before = dict(os.environ)
import ditron_ep
after_package = dict(os.environ)
if sys.argv[1] == "request":
    from ditron_ep.runtime import use_interpreter
    use_interpreter(True)
import ditron_ep.ops
from ditron_ep.ops.ep import dispatch_kernels
from ditron_ep.runtime import kernels_interpreted, mode_source
import triton
print(json.dumps({
    "package_env_unchanged": before == after_package,
    "env_unchanged": before == dict(os.environ),
    "interpreted": kernels_interpreted(),
    "source": mode_source(),
    "triton_switch": bool(triton.knobs.runtime.interpret),
    "kernel_type": type(dispatch_kernels.ep_dispatch_kernel).__name__,
}))
"""


def _probe(env_updates: dict[str, str | None], arg: str = "") -> dict:
    env = dict(os.environ)
    for key in ("TRITON_INTERPRET", "DITRON_BACKEND"):
        env.pop(key, None)
    for key, value in env_updates.items():
        if value is not None:
            env[key] = value
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _PROBE, arg], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("env, arg, source", [
    ({}, "", "no GPU is visible"),
    ({"TRITON_INTERPRET": "1"}, "", "TRITON_INTERPRET=1 in the environment"),
    ({"DITRON_BACKEND": "emulated"}, "", "DITRON_BACKEND=emulated in the environment"),
    ({}, "request", "use_interpreter(True)"),
], ids=["no-gpu", "triton-interpret", "ditron-backend", "use-interpreter"])
def test_import_leaves_the_environment_alone_and_names_who_chose(env, arg, source):
    got = _probe(env, arg)
    assert got["package_env_unchanged"], "import ditron_ep changed os.environ"
    assert got["env_unchanged"], "importing the kernels changed os.environ"
    assert got["interpreted"] and got["triton_switch"]
    assert got["kernel_type"] == "InterpretedFunction"
    assert got["source"] == source


def test_use_interpreter_after_the_mode_is_fixed_names_the_rule():
    from ditron_ep.runtime import DitronConfigError, kernels_interpreted, use_interpreter

    interpreted = kernels_interpreted()  # fixed in this process by the CPU suite already
    use_interpreter(interpreted)  # agreeing with the fixed mode is fine
    with pytest.raises(DitronConfigError, match="already fixed"):
        use_interpreter(not interpreted)


def test_triton_imported_first_in_the_other_mode_is_named_not_left_to_break_kernels():
    # On this CPU machine, with no TRITON_INTERPRET, a triton imported before ditron_ep builds its
    # own jit helpers for compiling; interpreted kernels calling them would fail obscurely.
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DITRON_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", "import triton\nimport ditron_ep.ops"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "DitronConfigError" in proc.stderr and "TRITON_INTERPRET=1" in proc.stderr, proc.stderr[-2000:]


_INTERPRETER_PROBE = """
import json
import ditron_ep.ops  # fixes the mode: interpreted (TRITON_INTERPRET=1)
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

@triton.jit
def _twice(x):
    return x * 2

@triton.jit
def _kernel(x_ptr, out_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    v = _twice(tl.load(x_ptr + o))             # a device function of ours
    tl.store(out_ptr + o, tl.cumsum(v, 0))     # ... and triton's own (its module imports `core`)
    tl.store(out_ptr + N, tl.sum(v, axis=0))

x = torch.arange(8, dtype=torch.float32)
outs = []
for _ in range(2):
    out = torch.zeros(9)
    _kernel[(1,)](x, out, N=8)
    outs.append(out.tolist())
print(json.dumps({
    "found_once": getattr(interpreter._patch_builtin, "found_once", False),
    "outs": outs,
    # (triton.language.core's stay patched after a device call from Triton's standard library:
    # the interpreter's own behaviour, with or without the cache)
    "restored": bool(getattr(tl.load, "__triton_builtin__", False)),
}))
"""


def _interpreted_probe(probe: str) -> dict:
    """Run `probe` in a fresh interpreter with kernels interpreted; its last stdout line as JSON."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DITRON_BACKEND")}
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_interpreter_finds_builtins_once_and_runs_kernels_the_same():
    """mode._builtins_found_once: the interpreter's per-launch and per-device-call lookup of
    triton.language's builtins is done once; kernels calling device functions (ours and Triton's
    standard library) give the same results on every launch, and a launch leaves the builtins as
    they were."""
    rep = _interpreted_probe(_INTERPRETER_PROBE)
    want = list(itertools.accumulate(2.0 * i for i in range(8))) + [56.0]
    assert rep["found_once"], "the interpreter's builtin lookup is not the cached one"
    assert rep["outs"] == [want, want], rep["outs"]
    assert rep["restored"], "a launch left triton.language's builtins patched"


# An int32 add that overflows (2^31 - 1 + 1) in an interpreted kernel, and whether the
# interpreter still runs its overflow check (which it could only assert with `debug` on).
_OVERFLOW_PROBE = """
import json
import torch
import ditron_ep.ops  # fixes the mode
import triton
import triton.language as tl
from triton.runtime import interpreter

@triton.jit
def add_kernel(x_ptr, out_ptr):
    tl.store(out_ptr, tl.load(x_ptr) + 1)

x = torch.tensor([2**31 - 1], dtype=torch.int32)
out = torch.zeros(1, dtype=torch.int32)
add_kernel[(1,)](x, out)
opts = interpreter.interpreter_builder.options
print(json.dumps({"out": int(out[0]), "sanitize": opts.sanitize_overflow, "debug": opts.debug}))
"""


def test_interpreter_skips_overflow_checks_it_cannot_assert():
    """mode._no_dead_overflow_checks: without `debug` the interpreter's int32 overflow check
    asserts nothing, so it is off; an overflowing add wraps, as it did with the check and as a
    compiled kernel does."""
    rep = _interpreted_probe(_OVERFLOW_PROBE)
    assert rep == {"out": -(2**31), "sanitize": False, "debug": False}, rep
