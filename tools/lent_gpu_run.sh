#!/usr/bin/env bash
# One device call on a lent GPU machine: install the carried wheels, optionally build DeepEP, run
# the named steps, and pack every log and JSON into one tarball under $OUT (a device call returns
# few files). Run from the repository root:
#
#   bash tools/lent_gpu_run.sh STEP...        e.g.  bench:moe_train:uniform  bench:deepspeed_moe  suite
#
# Steps (each under a timeout; the tarball is rewritten after every step, so a call cut short
# still returns what finished):
#   deepep                 build DeepEP v1 from .anchors/ (copy ../shared/anchors there) into /tmp/deepep
#   bench:NAME[:ROUTING]   torchrun -m ditron_ep bench --bench NAME [--routing ROUTING] $BENCH_ARGS
#   suite[:K]              tests/gpu/run_gpu_suite.sh [-k K]   (e.g. suite:"not nvshmem")
#   ab[:CASES[:PROGRAMS]]  tools/ab_compare.py --old-root .base [--cases CASES] [--programs P] (old tree: git archive
#                          OLD ditron_ep | tar -x -C .base)
#   host                   tools/host_profile.py (with .base when it exists) $HOST_ARGS
# Environment: NEW_COMMIT (the short hash sent: DITRON_COMMIT and file names; give the local `git rev-parse
# --short HEAD`: there the copy's git HEAD may be the last landed commit, not the tree sent), OUT (default
# /tmp/out), STEP_TIMEOUT_S (default 300; the suite step: SUITE_TIMEOUT_S, default 560), BENCH_ARGS
# (extra bench arguments, e.g. "--tokens 4096"). A device call runs at most 600 s: put the suite
# in a call of its own, or last.
# Wheels: .whl/*.whl (deepspeed, megatron-core, their pure-Python dependencies; see
# tests/gpu/run_gpu_suite.sh) and .nvwhl/*.whl (nvshmem4py) are installed with --no-deps into
# /tmp/site. Carry .whl, .nvwhl, .anchors and .base in the device call as needed.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export DITRON_COMMIT=${NEW_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}
RES=$(mktemp -d)
mkdir -p "$OUT"
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
N=$(nvidia-smi -L | wc -l)
DEV=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H200 && echo H200 || echo H100)
TAG=${DEV}x${N}_$(date +%Y%m%d)_${DITRON_COMMIT}
say "$N x $DEV; files tagged $TAG"

wheels=(); for w in .whl/*.whl .nvwhl/*.whl; do [[ -f $w ]] && wheels+=("$w"); done
if (( ${#wheels[@]} )); then
    pip install -q --no-index --no-deps --target /tmp/site "${wheels[@]}" > "$RES/pip.log" 2>&1 || tail -3 "$RES/pip.log"
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
run() { timeout "${STEP_TIMEOUT_S:-300}" "$@"; }
pack() { tar -czf "$OUT/results_$TAG.tgz" -C "$RES" . ; }

for step in "$@"; do
    IFS=: read -r kind arg1 arg2 <<< "$step"
    say "$step"
    case $kind in
    deepep)
        run bash .anchors/build_deepep.sh .anchors/deepep-v1-c5facf5-intranode.tar.gz /tmp/deepep \
            > "$RES/deepep_build.log" 2>&1 && export PYTHONPATH=$PYTHONPATH:/tmp/deepep
        tail -1 "$RES/deepep_build.log" ;;
    bench)
        name=${arg1}${arg2:+_$arg2}
        # shellcheck disable=SC2086
        run torchrun --nproc-per-node "$N" -m ditron_ep bench --backend torch --bench "$arg1" \
            ${arg2:+--routing $arg2} ${BENCH_ARGS:-} --json "$RES/${name}_$TAG.json" > "$RES/${name}_$TAG.log" 2>&1
        grep -E "^\s+[0-9]+\s|^(OK|FAIL)" "$RES/${name}_$TAG.log" | cut -c1-150 ;;
    suite)
        # the whole suite takes ~340-400 s cold on 2 GPUs: its own limit (SUITE_TIMEOUT_S, default 560)
        limit=${SUITE_TIMEOUT_S:-560}
        DITRON_GPU_SUITE_TIMEOUT_S=$(( limit - 20 )) timeout "$limit" bash tests/gpu/run_gpu_suite.sh \
            ${arg1:+-k "$arg1"} > "$RES/gpu_suite_$TAG.log" 2>&1
        tail -5 "$RES/gpu_suite_$TAG.log" ;;
    ab)
        name=ab${arg2:+_p$arg2}_$TAG
        run torchrun --nproc-per-node "$N" tools/ab_compare.py --old-root .base ${arg1:+--cases $arg1} \
            ${arg2:+--programs $arg2} --json "$RES/$name.json" > "$RES/$name.log" 2>&1
        grep -v "^W[0-9]" "$RES/$name.log" | tail -15 ;;
    host)
        old=(); [[ -d .base/ditron_ep ]] && old=(--old-root .base)
        # shellcheck disable=SC2086
        run torchrun --nproc-per-node "$N" tools/host_profile.py "${old[@]}" ${HOST_ARGS:-} --json "$RES/host_profile_$TAG.json" \
            > "$RES/host_profile_$TAG.log" 2>&1
        tail -14 "$RES/host_profile_$TAG.log" ;;
    *)
        say "unknown step $step" ;;
    esac
    pack
done
say "done: $OUT/results_$TAG.tgz"
