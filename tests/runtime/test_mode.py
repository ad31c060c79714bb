"""The kernel mode: importing ditron_ep has no side effects; the rules that fix the mode, in order.

Each case runs in a fresh interpreter: the mode is fixed once per process.
"""
from __future__ import annotations

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
