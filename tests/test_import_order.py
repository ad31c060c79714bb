"""Every layer of the package imports first in a fresh interpreter: the runtime, the compiler and
the ops import one another, and a cycle shows only when the first import of a process enters it
from the wrong side (session 29: `import ditron_ep.compiler` first failed once the agreement
imported the CUDA-graph helpers)."""
from __future__ import annotations

import subprocess
import sys

import pytest

FIRST_IMPORTS = ("ditron_ep.compiler.tuner", "ditron_ep.runtime.agreement", "ditron_ep.ops.tp.fused",
                 "ditron_ep.bench.registry")


@pytest.mark.parametrize("module", FIRST_IMPORTS)
def test_module_imports_first_in_a_fresh_interpreter(module):
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
