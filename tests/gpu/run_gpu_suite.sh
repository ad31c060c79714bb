#!/usr/bin/env bash
# Run the GPU test suite (tests/gpu): one pytest per GPU under torchrun, NCCL process group.
#
# Usage (from anywhere; it runs in the repository root):
#     tests/gpu/run_gpu_suite.sh [extra pytest args...]
#     NPROC=2 tests/gpu/run_gpu_suite.sh -k exchange
# Extra arguments are appended to `pytest tests/gpu ...` on every rank (options such as -k or
# --timeout; a path would be collected in addition to tests/gpu).
#
# Environment:
#     NPROC                            ranks (default: GPUs listed by `nvidia-smi -L`)
#     PYTHON                           interpreter with torch, triton, pytest, ditron_ep, deepspeed==0.19.8 and
#                                      megatron-core 0.19.2 (test_megatron_gpu.py; its cp312 wheel is carried
#                                      in .whl too) importable (the test extra; where nothing can be installed,
#                                      carry its wheels and put them on PYTHONPATH: here
#                                      `DS_BUILD_OPS=0 pip wheel --no-deps deepspeed==0.19.8 -w .whl` and
#                                      `pip download --no-deps --only-binary=:all: --python-version 3.12
#                                      --platform manylinux2014_x86_64 -d .whl hjson pydantic pydantic_core
#                                      annotated-types typing-inspection`; there `pip install --no-index
#                                      --no-deps --target /tmp/site .whl/*.whl` and PYTHONPATH=/tmp/site;
#                                      nvshmem4py-cu13 0.4.x, the nvshmem extra, for test_nvshmem_gpu.py:
#                                      `pip download --no-deps --only-binary=:all: --python-version 3.12
#                                      --platform manylinux_2_34_x86_64 nvshmem4py-cu13==0.4.1`, installed
#                                      the same way; nvidia-nvshmem-cu13 and cuda-core are on the GPU images)
#                                      (default: python, else python3, on PATH)
#     DITRON_GPU_SUITE_TIMEOUT_S       limit for the whole torchrun job (default 540: the summary still
#                                      prints inside a 10-minute call)
#     DITRON_GPU_SUITE_TARGET_S        the time the suite should take on a cold 2xH100 machine, compiles
#                                      included (default 360); a longer run says so (it still passes)
#     DITRON_GPU_COLLECTIVE_TIMEOUT_S  NCCL / gloo collective timeout in each rank (default 300)
#     DITRON_GPU_FAULTHANDLER_S        a test running longer dumps every thread's stack (default 240)
#     DITRON_GPU_KEEP_LOGS=1           keep the per-rank log folder after a clean run
#
# Every rank runs the same tests in the same order (`pytest tests/gpu -x -q -rs --durations=15`); the conftest
# initialises NCCL from torchrun's environment and makes all ranks fail a test together when one
# rank fails it. Rank 0's pytest output goes to the console; ranks 1.. write to
# <log folder>/rank<R>.log, whose tail is printed when that rank did not pass cleanly. Each rank
# also writes rank<R>.json (counts, Triton compiles and their seconds), and the script ends with one
# summary line per rank and the wall time of the whole run ("GPU suite: PASSED on 2 ranks in 312 s"),
# which on a machine with an empty Triton cache (TRITON_CACHE_DIR) is mostly compilation. pytest's
# slowest tests (--durations) and the conftest's compile log close rank 0's output.
#
# It exports NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 (no NVLink
# multicast on the lent machines), PYTHONUNBUFFERED=1, and unsets TRITON_INTERPRET / DITRON_BACKEND.
#
# Exit status: 0 only if every rank reported, ran > 0 tests, and had 0 failed, 0 errors and
# 0 SKIPPED (a skip means the suite did not really run: no CUDA, not under torchrun, ...), all
# ranks passed the same number of tests, and torchrun itself exited 0. Otherwise 1
# (2: the script could not start).
set -uo pipefail

SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
REPO="$(cd "$(dirname "$SELF")/../.." && pwd)"
cd "$REPO" || exit 2

# ---------------------------------------------------------------- per-rank worker (torchrun runs this)
if [[ "${1:-}" == "--rank-worker" ]]; then
    shift
    : "${DITRON_GPU_RESULTS_DIR:?set by the launcher}" "${DITRON_GPU_PYTHON:?set by the launcher}"
    rank="${RANK:?not started by torchrun}"
    log="$DITRON_GPU_RESULTS_DIR/rank${rank}.log"
    args=(-m pytest tests/gpu -x -q -rs -p no:cacheprovider --durations=15
          -o "faulthandler_timeout=${DITRON_GPU_FAULTHANDLER_S:-240}" "$@")
    if [[ "$rank" == 0 ]]; then
        # exec: signals from torchrun reach pytest itself; tee keeps a copy of the console output.
        exec "$DITRON_GPU_PYTHON" "${args[@]}" > >(tee "$log") 2>&1
    fi
    exec "$DITRON_GPU_PYTHON" "${args[@]}" >"$log" 2>&1
fi

# ---------------------------------------------------------------- launcher
T_START=$(date +%s.%N)
PY="${PYTHON:-$(command -v python || command -v python3 || true)}"
if [[ -z "$PY" ]]; then
    echo "run_gpu_suite: no python on PATH; set PYTHON=/path/to/python" >&2
    exit 2
fi
if [[ -z "${NPROC:-}" ]]; then
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        echo "run_gpu_suite: nvidia-smi not found; set NPROC to the number of GPUs" >&2
        exit 2
    fi
    NPROC="$(nvidia-smi -L | grep -c '^GPU')"
fi
if ! [[ "$NPROC" =~ ^[0-9]+$ ]] || (( NPROC < 1 )); then
    echo "run_gpu_suite: NPROC='$NPROC' (no GPU found?); the GPU suite needs at least one GPU" >&2
    exit 2
fi

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# One node (--standalone): the gloo verdict group talks over loopback, whatever the hostname resolves to.
if [[ -z "${GLOO_SOCKET_IFNAME:-}" ]] && [[ -e /sys/class/net/lo ]]; then
    export GLOO_SOCKET_IFNAME=lo
fi
unset TRITON_INTERPRET DITRON_BACKEND  # the GPU suite runs compiled kernels
RESULTS="$(mktemp -d "${TMPDIR:-/tmp}/ditron_gpu_suite.XXXXXX")" || exit 2
export DITRON_GPU_RESULTS_DIR="$RESULTS" DITRON_GPU_PYTHON="$PY"

CACHE_DIR="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
CACHED=$(find "$CACHE_DIR" -type f 2>/dev/null | wc -l)
echo "run_gpu_suite: $NPROC ranks, python $PY, logs in $RESULTS"
echo "run_gpu_suite: Triton cache $CACHE_DIR holds $CACHED files$( ((CACHED == 0)) && echo ' (cold run: every kernel compiles)')"
timeout --signal=TERM --kill-after=30 "${DITRON_GPU_SUITE_TIMEOUT_S:-540}" \
    "$PY" -m torch.distributed.run --standalone --nproc-per-node="$NPROC" --no-python \
    bash "$SELF" --rank-worker "$@" 2>"$RESULTS/torchrun.err"
rc=$?
sleep 0.2  # let rank 0's tee flush
ELAPSED=$(awk -v a="$T_START" -v b="$(date +%s.%N)" 'BEGIN { printf "%.0f", b - a }')

"$PY" - "$RESULTS" "$NPROC" "$rc" "$ELAPSED" "${DITRON_GPU_SUITE_TARGET_S:-360}" <<'EOF'
import json
import sys
from pathlib import Path

results, nproc, rc = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
elapsed, target = int(sys.argv[4]), int(sys.argv[5])
lines, bad, missing, passed_counts, recs = [], [], [], set(), {}
for r in range(nproc):
    f = results / f"rank{r}.json"
    try:
        rec = json.loads(f.read_text())
    except (OSError, ValueError) as err:
        lines.append(f"rank {r}: FAIL  no report ({type(err).__name__}): crashed, killed or hung")
        bad.append(r)
        missing.append(r)
        continue
    recs[r] = rec
    problems = []
    if rec["passed"] == 0:
        problems.append("no test passed")
    for key in ("failed", "errors", "skipped", "xfailed", "xpassed"):
        if rec.get(key, 0):
            problems.append(f"{rec[key]} {key}")
    if rec["exitstatus"] != 0:
        problems.append(f"pytest exit {rec['exitstatus']}")
    passed_counts.add(rec["passed"])
    counts = " ".join(f"{k}={rec.get(k, 0)}" for k in ("passed", "failed", "errors", "skipped"))
    compiles = f"  {rec['compiles']} Triton compiles, {rec['compile_s']:.0f} s" if "compiles" in rec else ""
    lines.append(f"rank {r}: {'FAIL' if problems else 'ok  '}  {counts}{compiles}"
                 + (f"  ({'; '.join(problems)})" if problems else ""))
    for key in ("failed_ids", "errors_ids", "skipped_ids"):
        ids = rec.get(key, [])
        if ids:
            more = f"  (+{rec[key[:-4]] - 1} more)" if rec[key[:-4]] > 1 else ""
            lines.append(f"          {key[:-4]}: {ids[0]}{more}")
    if problems:
        bad.append(r)
if len(passed_counts) > 1:
    lines.append(f"ranks passed different numbers of tests {sorted(passed_counts)}: they did not run the same tests")
if rc != 0:
    lines.append(f"torchrun exited {rc}" + (" (suite timeout)" if rc in (124, 137) else ""))
failed = bool(bad) or len(passed_counts) > 1 or rc != 0

# Tails of the logs of ranks 1.. that went wrong (rank 0's output is already on the console, and
# its failure report quotes the other ranks' messages: a rank that failed exactly the tests rank 0
# failed adds little, so its log is only named).
def outcome(r):
    rec = recs.get(r)
    return None if rec is None else tuple(rec.get(k) for k in ("failed_ids", "errors_ids", "skipped_ids"))


show = [r for r in range(1, nproc) if r in bad and (r in missing or 0 in missing or outcome(r) != outcome(0))]
if failed and not bad:
    show = list(range(1, nproc))
for r in show:
    log = results / f"rank{r}.log"
    text = log.read_text(errors="replace").splitlines() if log.exists() else ["(no log)"]
    print(f"\n===== rank {r}: last {min(len(text), 80)} of {len(text)} lines of {log} =====")
    print("\n".join(text[-80:]))
err = results / "torchrun.err"
if rc != 0 and (missing or not bad) and err.exists():  # torchrun's own words add something
    text = err.read_text(errors="replace").splitlines()
    print(f"\n===== torchrun: last {min(len(text), 40)} lines of {err} =====")
    print("\n".join(text[-40:]))
print("\n===== GPU suite summary =====")
print("\n".join(lines))
if bad and len(show) < len([r for r in bad if r]):
    print(f"(full output of every rank: {results}/rank<R>.log)")
if elapsed > target:
    print(f"GPU suite: {elapsed} s is over the {target} s target for a cold run (DITRON_GPU_SUITE_TARGET_S); "
          f"the compile log above says which tests and kernels spent it")
print(f"GPU suite: {'FAILED' if failed else 'PASSED'} on {nproc} ranks in {elapsed} s")
sys.exit(1 if failed else 0)
EOF
status=$?
if (( status == 0 )) && [[ -z "${DITRON_GPU_KEEP_LOGS:-}" ]]; then
    rm -rf "$RESULTS"
else
    echo "per-rank logs and reports: $RESULTS"
fi
exit "$status"
