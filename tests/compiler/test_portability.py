"""CI portability check: every Triton kernel of ditron_ep compiles for sm_90 and gfx942, on the CPU.

The compiles run in one TRITON_INTERPRET=0 subprocess per package scanned (triton.compile cannot
compile interpreted functions), with a fresh TRITON_CACHE_DIR so no earlier build is reused.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import triton
import triton.language as tl

from tools import portability
from tools.portability import (
    PORTABILITY_TARGETS,
    find_jit_functions,
    format_report_failures,
    register_device_function,
    register_kernel,
    run_portability_check,
    target_name,
)

TARGETS = [target_name(t) for t in PORTABILITY_TARGETS]
TIMEOUT_S = 300


# --------------------------------------------------------------------------------------------
# The package itself
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def package_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_portability_check("ditron_ep", cache_dir=tmp_path_factory.mktemp("triton_cache"), timeout=TIMEOUT_S)


def test_package_modules_import(package_report: dict) -> None:
    problems = format_report_failures(package_report, parts=("fatal", "imports"))
    if problems:
        pytest.fail(problems, pytrace=False)


def test_every_jit_function_is_registered(package_report: dict) -> None:
    problems = format_report_failures(package_report, parts=("fatal", "unregistered"))
    if problems:
        pytest.fail(problems, pytrace=False)


def test_kernels_live_in_kernel_modules() -> None:
    """One rule for where kernels live: beside their op in a `*kernels.py` module, or, when several
    ops share a device function, in `ditron_ep.language`."""
    names = [name for name, _ in find_jit_functions("ditron_ep")]
    assert len(names) > 10, f"the scan found only {names}"
    misplaced = [name for name in names
                 if not (name.startswith("ditron_ep.language.") or name.rsplit(".", 2)[-2].endswith("kernels"))]
    assert not misplaced, f"Triton kernels outside the kernel modules: {misplaced}"


@pytest.mark.parametrize("target", TARGETS)
def test_every_kernel_compiles(package_report: dict, target: str) -> None:
    assert not package_report.get("fatal"), package_report["fatal"]
    results = [r for r in package_report["results"] if r["target"] == target]
    assert results, "no kernel of ditron_ep is registered with register_kernel: the check would be vacuous"
    problems = format_report_failures(package_report, target=target, parts=("compile",))
    if problems:
        n_failed = sum(not r["ok"] for r in results)
        pytest.fail(f"{n_failed} of {len(results)} compiles for {target} failed:\n\n{problems}", pytrace=False)


# Kernels on the data path: every half-precision tile they move must be a vector access. A
# heap address built from an integer carries no alignment, so without the hint in
# `primitives.heap_ptr` these compiled to one 2-byte access per element (the fused MoE kernel
# ran 3-4x slower on H200s, combine about 4x).
DATA_PATH_KERNELS = ("ep_dispatch_kernel", "ep_combine_kernel", "moe_fused_kernel", "grouped_up_kernel",
                     "grouped_down_kernel")


def test_data_path_kernels_move_half_precision_in_vectors(package_report: dict) -> None:
    results = [r for r in package_report["results"]
               if r["target"].startswith("cuda") and r["kernel"].rsplit(".", 1)[-1] in DATA_PATH_KERNELS]
    assert {r["kernel"].rsplit(".", 1)[-1] for r in results} == set(DATA_PATH_KERNELS)
    narrow = [f"{r['kernel']} [{r['label']}]: {r['narrow_accesses']} scalar 8/16-bit global accesses"
              for r in results if r["narrow_accesses"] != 0]
    assert not narrow, "\n".join(narrow)


# The EP copy kernels' registered half-precision signatures are the ones EPBuffer launches on CUDA
# (1,024-column steps, 8 warps). The weighted rank-reduced combine's fp32 sum over such a step
# spilled 2,456 bytes of stack a thread and ran 4.5x slower than without (H100 pair); its sums now
# step through 512 columns. The exact combine's 272 bytes cost less than narrower steps did (2.5 %),
# the dispatch's 40 nothing measurable: the limit is the GEMM tiles' (test_grouped_mlp).
EP_COPY_KERNELS = ("ep_dispatch_kernel", "ep_combine_kernel")
EP_STACK_LIMIT = 512


def test_ep_copy_kernels_do_not_spill_on_sm90(package_report: dict) -> None:
    results = [r for r in package_report["results"]
               if r["target"].startswith("cuda") and r["kernel"].rsplit(".", 1)[-1] in EP_COPY_KERNELS]
    assert {r["kernel"].rsplit(".", 1)[-1] for r in results} == set(EP_COPY_KERNELS)
    assert all(r["spill_bytes"] is not None for r in results), "no stack bytes read (cuobjdump): the check would be vacuous"
    spilled = [f"{r['kernel']} [{r['label']}]: {r['spill_bytes']} bytes of stack a thread"
               for r in results if r["spill_bytes"] > EP_STACK_LIMIT]
    assert not spilled, "\n".join(spilled)


def test_no_kernel_has_a_loop_with_two_entries(package_report: dict) -> None:
    checked = [r for r in package_report["results"] if r["irreducible_edges"] is not None]
    assert checked, "no compile produced LLVM IR: the check would be vacuous"
    bad = [f"{r['kernel']} [{r['label']}] {r['target']}: {r['irreducible_edges']} irreducible loop edges"
           for r in checked if r["irreducible_edges"]]
    assert not bad, "\n".join(bad)


_IRREDUCIBLE_LL = """
define void @two_entries(i1 %c, i1 %d) {
  br i1 %c, label %a, label %b
a:                                                ; preds = %0, %b
  br i1 %d, label %b, label %done
b:                                                ; preds = %0, %a
  switch i32 0, label %a [
    i32 1, label %done
  ]
done:
  ret void
}
define void @one_entry(i1 %c) {
  br label %head
head:
  br i1 %c, label %body, label %exit
body:
  br label %head
exit:
  ret void
}
"""


def test_count_irreducible_edges_reads_llvm_ir() -> None:
    assert portability.count_irreducible_edges(_IRREDUCIBLE_LL) == 1
    assert portability.count_irreducible_edges(_IRREDUCIBLE_LL.split("define void @one_entry")[0]) == 1
    assert portability.count_irreducible_edges("define void @one_entry" +
                                               _IRREDUCIBLE_LL.split("define void @one_entry")[1]) == 0


def test_count_narrow_accesses_reads_ptx() -> None:
    ptx = """
        ld.global.b16 {%rs1}, [%rd1];
        ld.global.L1::evict_last.b16 {%rs2}, [%rd2];
        st.global.v4.b32 [%rd3], {%r1, %r2, %r3, %r4};
        ld.global.v2.b16 {%rs3, %rs4}, [%rd4];
        st.global.b32 [%rd5], %r5;
        @%p1 st.global.b16 [%rd6], %rs5;
    """
    assert portability.count_narrow_accesses(ptx) == 3


# --------------------------------------------------------------------------------------------
# The check cannot pass silently: a fixture package with broken and unregistered kernels
# --------------------------------------------------------------------------------------------

_GOOD = '''
import triton
import triton.language as tl
from tools.portability import register_device_function, register_kernel


@register_device_function
@triton.jit
def notify(p_sig, value):
    tl.atomic_xchg(p_sig, value, sem="release", scope="sys")


@register_device_function
@triton.jit
def wait_signal(p_sig, expected, max_iters):
    v = tl.atomic_add(p_sig, 0, sem="acquire", scope="sys")
    i = 0
    while v < expected and i < max_iters:
        v = tl.atomic_add(p_sig, 0, sem="acquire", scope="sys")
        i += 1
    return v >= expected


@triton.jit
def peer_copy_kernel(table_ptr, sig_ptr, out_ptr, rank, peer, n, BLOCK: tl.constexpr, MAX_ITERS: tl.constexpr = 1000):
    p_src = tl.load(table_ptr + peer).to(tl.pointer_type(tl.float32))
    o = tl.arange(0, BLOCK)
    x = tl.load(p_src + o, mask=o < n)  # [BLOCK]
    tl.store(out_ptr + o, x, mask=o < n)
    notify(sig_ptr + peer, 1)
    ok = wait_signal(sig_ptr + rank, 1, MAX_ITERS)
    tl.store(out_ptr, ok.to(tl.float32))


register_kernel(peer_copy_kernel, {"table_ptr": "*i64", "sig_ptr": "*i32", "out_ptr": "*fp32", "rank": "i32",
                                   "peer": "i32", "n": "i32"}, {"BLOCK": 1024})


@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, K, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    o_m = tl.arange(0, BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + o_m[:, None] * K + (k + o_k)[None, :])  # [BLOCK_M, BLOCK_K]
        b = tl.load(b_ptr + (k + o_k)[:, None] * N + o_n[None, :])  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, b)
    tl.store(c_ptr + o_m[:, None] * N + o_n[None, :], acc)


@triton.jit
def _ticket(ctrl, on_first, split_at):
    t = split_at
    if on_first:
        t = tl.atomic_add(ctrl, 1, sem="relaxed", scope="gpu")
    if t >= split_at:
        t = split_at + tl.atomic_add(ctrl + 1, 1, sem="relaxed", scope="gpu")
    return t, t < split_at


@triton.jit
def two_entry_loop_kernel(ctrl, out, n, split_at, first):
    # The same branchy ticket code before the loop and at its end: MLIR merges the copies and
    # the loop gets two entries (the shape that faulted with "illegal instruction" on H200).
    split = first > 0
    on_first = tl.program_id(0) < first
    if split:
        t, on_first = _ticket(ctrl, on_first, split_at)
    else:
        t = tl.atomic_add(ctrl + 2, 1, sem="relaxed", scope="gpu")
    while t < n:
        tl.store(out + t, t)
        if split:
            t, on_first = _ticket(ctrl, on_first, split_at)
        else:
            t = tl.atomic_add(ctrl + 2, 1, sem="relaxed", scope="gpu")


register_kernel(two_entry_loop_kernel, {"ctrl": "*i32", "out": "*i32", "n": "i32", "split_at": "i32",
                                        "first": "i32"}, {})
register_device_function(_ticket)

_MM = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32", "K": "i32", "N": "i32"}
register_kernel(matmul_kernel, _MM, {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}, label="small")
# 2 stages of 256x64 + 64x256 bf16 tiles need 256 KiB of shared memory: more than an H100 has.
register_kernel(matmul_kernel, _MM, {"BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 64}, label="too big",
                options={"num_warps": 8, "num_stages": 2})
'''

_BROKEN = '''
import triton
import triton.language as tl
from tools.portability import register_kernel


@triton.jit
def broken_kernel(x_ptr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(x_ptr + o, undefined_thing)


register_kernel(broken_kernel, {"x_ptr": "*fp32"}, {"BLOCK": 128}, label="undefined name")
'''

_UNREGISTERED = '''
import triton
import triton.language as tl
from .good import notify  # imported jit functions belong to their own module


@triton.jit
def forgotten_kernel(x_ptr):
    notify(x_ptr, 1)
'''


@pytest.fixture(scope="module")
def fixture_package(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("portability_fixture")
    name = f"portability_fixture_{uuid.uuid4().hex[:8]}"
    pkg = root / name
    (pkg / "nested").mkdir(parents=True)  # a folder without __init__.py must be scanned too
    (pkg / "__init__.py").write_text("")
    (pkg / "good.py").write_text(_GOOD)
    (pkg / "nested" / "broken.py").write_text(_BROKEN)
    (pkg / "unregistered.py").write_text(_UNREGISTERED)
    return root, name


@pytest.fixture(scope="module")
def fixture_report(fixture_package: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    root, name = fixture_package
    return run_portability_check(name, paths=[root], cache_dir=tmp_path_factory.mktemp("triton_cache"),
                                 timeout=TIMEOUT_S)


def _results(report: dict, kernel_suffix: str, label: str | None = None) -> list[dict]:
    return [r for r in report["results"] if r["kernel"].endswith(kernel_suffix) and label in (None, r["label"])]


def test_fixture_good_kernels_compile_on_both_targets(fixture_report: dict) -> None:
    assert not fixture_report.get("fatal"), fixture_report["fatal"]
    assert not fixture_report["import_errors"], fixture_report["import_errors"]
    for kernel, label in [(".good.peer_copy_kernel", "BLOCK=1024"), (".good.matmul_kernel", "small")]:
        results = _results(fixture_report, kernel, label)
        assert sorted(r["target"] for r in results) == sorted(TARGETS)
        assert all(r["ok"] for r in results), format_report_failures(fixture_report, parts=("compile",))
    copy = _results(fixture_report, ".good.peer_copy_kernel")[0]
    assert [n.rsplit(".", 1)[1] for n in copy["device_functions"]] == ["notify", "wait_signal"]


def test_fixture_two_entry_loop_is_flagged(fixture_report: dict) -> None:
    results = _results(fixture_report, ".good.two_entry_loop_kernel")
    assert sorted(r["target"] for r in results) == sorted(TARGETS) and all(r["ok"] for r in results)
    cuda = next(r for r in results if r["target"] == "cuda:90")
    assert cuda["irreducible_edges"] > 0, cuda
    assert all(r["irreducible_edges"] == 0 for r in _results(fixture_report, ".good.peer_copy_kernel"))


def test_fixture_broken_kernel_is_reported_failed(fixture_report: dict) -> None:
    results = _results(fixture_report, ".nested.broken.broken_kernel")
    assert sorted(r["target"] for r in results) == sorted(TARGETS)
    for r in results:
        assert not r["ok"] and "undefined_thing" in r["error"], r
    text = format_report_failures(fixture_report)
    assert "broken_kernel [undefined name] on cuda:90 failed" in text
    assert "broken_kernel [undefined name] on hip:gfx942 failed" in text
    assert fixture_report["returncode"] == 1


def test_fixture_shared_memory_overflow_is_reported_failed(fixture_report: dict) -> None:
    by_target = {r["target"]: r for r in _results(fixture_report, ".good.matmul_kernel", "too big")}
    cuda = by_target["cuda:90"]
    assert not cuda["ok"] and cuda["shared_bytes"] > 232448 and "OutOfResources" in cuda["error"], cuda


def test_fixture_unregistered_kernel_is_reported(fixture_report: dict) -> None:
    names = [fn["name"] for fn in fixture_report["unregistered"]]
    assert names == [f"{fixture_report['package']}.unregistered.forgotten_kernel"], names
    text = format_report_failures(fixture_report, parts=("unregistered",))
    assert "forgotten_kernel" in text and "register_kernel" in text and "register_device_function" in text


def test_worker_refuses_to_run_interpreted(fixture_package: tuple[Path, str], tmp_path: Path) -> None:
    root, name = fixture_package
    repo = Path(portability.__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(repo), str(root)]))
    proc = subprocess.run([sys.executable, "-m", "tools.compile_worker", "--package", name],
                          env=env, cwd=repo, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "TRITON_INTERPRET=0" in json.loads(proc.stdout)["fatal"]


# --------------------------------------------------------------------------------------------
# Registry and scan, in process (interpreter on or off)
# --------------------------------------------------------------------------------------------

def test_register_device_function_is_a_transparent_decorator() -> None:
    def helper(x):
        return x + 1

    jitted = triton.jit(helper)  # a JITFunction or an InterpretedFunction, as TRITON_INTERPRET says
    assert register_device_function(jitted) is jitted
    assert portability.is_registered(jitted)
    with pytest.raises(TypeError, match="above"):
        register_device_function(lambda x: x)


def test_register_kernel_records_jit_and_interpreted_functions() -> None:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def scale_kernel(x_ptr, n, BLOCK: tl.constexpr, SCALE: tl.constexpr = 2):
        o = tl.arange(0, BLOCK)
        tl.store(x_ptr + o, tl.load(x_ptr + o, mask=o < n) * SCALE, mask=o < n)

    for fn in (JITFunction(scale_kernel), InterpretedFunction(scale_kernel)):
        assert register_kernel(fn, {"x_ptr": "*fp32", "n": "i32"}, {"BLOCK": 64}) is fn
        source = portability._ast_source(portability._KERNELS[scale_kernel][-1])
        assert source.signature == {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr", "SCALE": "constexpr"}
        assert source.attrs == {(0,): [["tt.divisibility", 16]]}
    register_kernel(JITFunction(scale_kernel), {"x_ptr": "*fp32"}, {"BLOCK": 64})
    with pytest.raises(ValueError, match="'n'"):
        portability._ast_source(portability._KERNELS[scale_kernel][-1])
    with pytest.raises(TypeError):
        register_kernel(scale_kernel, {"x_ptr": "*fp32", "n": "i32"}, {"BLOCK": 64})


def test_find_jit_functions_scans_every_module(fixture_package: tuple[Path, str], monkeypatch: pytest.MonkeyPatch) -> None:
    root, name = fixture_package
    monkeypatch.syspath_prepend(str(root))
    try:
        found = dict(find_jit_functions(name))
    finally:
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]
    assert sorted(n.removeprefix(name + ".") for n in found) == [
        "good._ticket", "good.matmul_kernel", "good.notify", "good.peer_copy_kernel", "good.two_entry_loop_kernel",
        "good.wait_signal", "nested.broken.broken_kernel", "unregistered.forgotten_kernel"]
    assert [n for n, fn in found.items() if not portability.is_registered(fn)] == [f"{name}.unregistered.forgotten_kernel"]
