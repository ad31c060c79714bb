"""The standalone benchmark scripts (bench/*.py) run end to end on the CPU: each one's --smoke
mode under the interpreter, two emulated ranks for the distributed ones (torchrun), exit code 0,
a JSON result that parses; moe_timeline.py with two plan variants reports equal bits."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str], tmp_path: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1"}
    env.pop("DITRON_BACKEND", None)
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def _torchrun(script: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(REPO / "bench" / script), *args]


@pytest.mark.parametrize("command", [
    ["dispatch_combine.py"], ["moe_layer.py"], ["grouped_gemm.py"]], ids=lambda c: c[0])
def test_script_smoke_run_writes_json(command, tmp_path):
    out = tmp_path / "result.json"
    script = command[0]
    args = (_torchrun(script, "--smoke", "--json", str(out)) if script != "grouped_gemm.py"
            else [sys.executable, str(REPO / "bench" / script), "--smoke", "--json", str(out)])
    proc = _run(args, tmp_path)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    data = json.loads(out.read_text())
    assert data, f"{script} wrote an empty JSON"


def test_moe_timeline_variants_keep_bits(tmp_path):
    proc = _run(_torchrun("moe_timeline.py", "--smoke", "--schedules", "overlap", "--variant", "",
                          "--variant", "comm_programs=0,recv_lag=0", "--iters", "1"), tmp_path)
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = [line for line in proc.stdout.splitlines() if "bitwise == first variant" in line]
    assert len(lines) == 4 and all(line.endswith("True") for line in lines), proc.stdout  # 2 ranks x 2 variants
    assert "comm_programs=0 recv_lag=0" in proc.stdout
    assert proc.stdout.count("median") == 4


def test_moe_timeline_rejects_a_malformed_variant(tmp_path):
    proc = _run([sys.executable, str(REPO / "bench" / "moe_timeline.py"), "--smoke", "--variant", "comm_programs"],
                tmp_path, timeout=120)
    assert proc.returncode == 2 and "expected FIELD=VALUE" in proc.stderr, proc.stderr
