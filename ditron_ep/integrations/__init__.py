"""Drop-in integrations with training frameworks, one module per framework.

Importing `ditron_ep` never imports a framework: import the module of the one you use
(`ditron_ep.integrations.deepspeed`, `.megatron`), which imports it then and checks its version.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from ditron_ep.runtime.errors import DitronConfigError


def import_framework(module: str, name: str, extra: str, supported: tuple[str, ...]) -> ModuleType:
    """Import `module` (a framework's package, `name` in messages) and check its __version__ is one
    of `supported`; DitronConfigError naming the install command (`extra`) or the versions."""
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise DitronConfigError(f"this integration needs {name}: pip install 'ditron_ep[{extra}]' ({name} "
                                f"{' or '.join(supported)})") from exc
    if mod.__version__.split("+")[0] not in supported:  # a local suffix (+<git hash>) is the same release
        raise DitronConfigError(f"{name} {mod.__version__} is not supported by ditron_ep.integrations.{extra}; "
                                f"supported: {', '.join(supported)}")
    return mod
