"""Where a benchmark ran: device, versions, and the commit of the code that ran."""
from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

import torch

# The folder that holds the `ditron_ep` package: a git checkout when run from source.
SOURCE_ROOT = Path(__file__).resolve().parents[2]


def fs_safe(name: str) -> str:
    """`name` reduced to [A-Za-z0-9_.-] (runs of anything else become one '_')."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "unknown"


def device_info(device: torch.device | str | None = None) -> dict[str, Any]:
    """Where the benchmark ran: device name (and a filesystem-safe form), counts, versions."""
    import triton

    device = torch.device(device) if device is not None else None
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
    }
    if device is not None and device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(kind="cuda", name=props.name, sm_count=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1))
    else:
        cpu = platform.processor() or platform.machine() or "cpu"
        info.update(kind="cpu", name=f"cpu-{cpu}", cpu_count=os.cpu_count())
    info["safe_name"] = fs_safe(info["name"])
    return info


def _git(args: list[str], repo: Path) -> str | None:
    """Output of `git <args>` in `repo`, or None if `repo` is no git checkout or git fails."""
    if not (repo / ".git").exists():  # an installed package: never report an enclosing repo's HEAD
        return None
    try:
        out = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def git_commit(repo: Path | str = SOURCE_ROOT) -> str:
    """$DITRON_COMMIT if set (the device machines get a copy of the tree without .git, so the
    launching command passes the hash); else `git rev-parse HEAD` of `repo`; else "unknown"."""
    env = os.environ.get("DITRON_COMMIT")
    if env:
        return env
    out = _git(["rev-parse", "HEAD"], Path(repo))
    return (out or "").strip() or "unknown"


def git_dirty(repo: Path | str = SOURCE_ROOT) -> bool | None:
    """Whether tracked files differ from HEAD (None when git cannot tell, or when $DITRON_COMMIT
    names the commit: then the tree is a copy whose own git state, if any, is not that commit's)."""
    if os.environ.get("DITRON_COMMIT"):
        return None
    out = _git(["status", "--porcelain", "--untracked-files=no"], Path(repo))
    return None if out is None else bool(out.strip())
