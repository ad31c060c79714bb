"""Portability check: every Triton kernel of the package compiles for NVIDIA sm_90 and AMD gfx942.

Kernels declare their compile signatures through `ditron_ep.language.registry` (a few lines the
kernels import); this checker, with its subprocess compiles and PTX/LLVM analysis, stays outside
the package's import path. CI runs it from `tests/compiler/test_portability.py`.
The check itself must see real ``JITFunction`` objects, so it runs in a subprocess with
``TRITON_INTERPRET=0`` (see ``run_portability_check``). It needs no GPU and no ROCm: Triton 3.6
compiles CUDA down to a cubin with the ptxas shipped in its wheel, and HIP down to a hsaco with
the LLVM AMDGPU backend and lld linked into libtriton.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from triton.backends.compiler import GPUTarget

from ditron_ep.language.registry import (
    _DEVICE_FUNCTIONS,
    _KERNELS,
    KernelSignature,
    _base_function,
    _is_jit,
    is_registered,
    qualified_name,
    register_device_function,
    register_kernel,
    registered_device_functions,
    registered_kernels,
)

__all__ = [
    "DEFAULT_SKIP_MODULES",
    "PORTABILITY_TARGETS",
    "CompileResult",
    "count_irreducible_edges",
    "count_narrow_accesses",
    "KernelSignature",
    "check",
    "compile_registered",
    "find_jit_functions",
    "format_report_failures",
    "is_registered",
    "parse_target",
    "qualified_name",
    "register_device_function",
    "register_kernel",
    "registered_device_functions",
    "registered_kernels",
    "run_portability_check",
    "target_name",
]

PORTABILITY_TARGETS: tuple[GPUTarget, ...] = (
    GPUTarget("cuda", 90, 32),  # H100 / H200
    GPUTarget("hip", "gfx942", 64),  # MI300X
)

# Shared memory (LDS) one program may use: a kernel that compiles but needs more fails at launch
# (OutOfResources), so the check treats it as a compile failure. sm_90: 227 KiB opt-in per block;
# gfx942: 64 KiB LDS per workgroup.
_MAX_SHARED_BYTES: dict[tuple[str, str], int] = {
    ("cuda", "90"): 232448,
    ("hip", "gfx942"): 65536,
}

# Modules never imported by the scan: running them has side effects.
DEFAULT_SKIP_MODULES: tuple[str, ...] = ("__main__",)

_REPO_ROOT = Path(__file__).resolve().parents[1]
_ERROR_TAIL_CHARS = 4000


def _compilable(fn: Any) -> Any:
    """The JITFunction (or InterpretedFunction) under Autotuner / Heuristics wrappers."""
    from triton.runtime.autotuner import Autotuner, Heuristics
    obj = fn
    while isinstance(obj, (Autotuner, Heuristics)):
        obj = obj.fn
    return obj


# --------------------------------------------------------------------------------------------
# Module scan
# --------------------------------------------------------------------------------------------

def iter_module_names(package: str, skip: Iterable[str] = DEFAULT_SKIP_MODULES) -> list[str]:
    """``package`` and every module below it, namespace sub-packages (no ``__init__.py``) included.

    ``pkgutil.walk_packages`` skips folders without ``__init__.py``, which would silently hide
    their kernels from the check, so the folders are walked directly.
    """
    skip = tuple(skip)

    def skipped(name: str) -> bool:
        return any(name == s or name.endswith("." + s) or name.startswith(s + ".") for s in skip)

    pkg = importlib.import_module(package)
    names = [package]
    if not hasattr(pkg, "__path__"):
        return names

    def walk(directory: Path, prefix: str) -> None:
        for entry in sorted(directory.iterdir()):
            if entry.is_dir():
                if entry.name.isidentifier() and entry.name != "__pycache__":
                    name = f"{prefix}.{entry.name}"
                    if not skipped(name):
                        names.append(name)
                        walk(entry, name)
            elif entry.suffix == ".py" and entry.stem.isidentifier() and entry.stem != "__init__":
                name = f"{prefix}.{entry.stem}"
                if not skipped(name):
                    names.append(name)

    for path in dict.fromkeys(pkg.__path__):
        walk(Path(path), package)
    return list(dict.fromkeys(names))


def import_module_or_file(name: str) -> Any:
    """Import a module by dotted name, or a ``.py`` file by path (named after its stem)."""
    if name.endswith(".py"):
        path = Path(name).resolve()
        if path.stem in sys.modules:
            return sys.modules[path.stem]
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[path.stem]
            raise
        return module
    return importlib.import_module(name)


def _module_jit_functions(module: Any) -> list[tuple[str, Any]]:
    found = []
    for attr, obj in vars(module).items():
        if _is_jit(obj):
            base = _base_function(obj)
            if base.__module__ == module.__name__:  # defined here, not imported from elsewhere
                found.append((qualified_name(obj), obj))
    return found


def find_jit_functions(package: str = "ditron_ep", *, extra_modules: Sequence[str] = (),
                       skip: Iterable[str] = DEFAULT_SKIP_MODULES,
                       errors: list[tuple[str, str]] | None = None) -> list[tuple[str, Any]]:
    """Import every module of ``package`` (and ``extra_modules``) and return its module-level
    jit functions as ``(qualified_name, fn)``, each once.

    A module that fails to import raises, unless ``errors`` is given: then ``(module, traceback)``
    is appended to it and the scan goes on.
    """
    import traceback

    def load(name: str) -> Any:
        try:
            return import_module_or_file(name)
        except BaseException as exc:  # SystemExit from a stray CLI module too
            if errors is None:
                raise ImportError(f"portability scan could not import {name}: {exc!r}") from exc
            errors.append((name, traceback.format_exc()))
            return None

    try:
        names = iter_module_names(package, skip) if package else []
    except BaseException as exc:
        if errors is None:
            raise
        errors.append((package, f"{type(exc).__name__}: {exc}"))
        names = []
    found: dict[Callable, tuple[str, Any]] = {}
    for name in [*names, *extra_modules]:
        module = load(name)
        if module is not None:
            for qualname, fn in _module_jit_functions(module):
                found.setdefault(_base_function(fn), (qualname, fn))
    return list(found.values())


# --------------------------------------------------------------------------------------------
# Compile
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CompileResult:
    kernel: str
    label: str
    target: str
    ok: bool
    error: str | None
    seconds: float
    shared_bytes: int | None
    device_functions: tuple[str, ...]  # device functions inlined into this kernel
    # NVIDIA only: scalar 8/16-bit global loads and stores in the PTX. Half-precision tiles that
    # Triton cannot prove 16-byte aligned compile to these, one per element: several times slower.
    narrow_accesses: int | None = None
    # Loops with more than one entry in the kernel's LLVM IR. A kernel whose task loop got two
    # entries (identical branchy ticket code before the loop and at its end, merged by MLIR)
    # died with "illegal instruction" on H200 (bench/results/rolesplit_diag_H200x4_20261122.log).
    irreducible_edges: int | None = None
    # NVIDIA only: bytes of stack a thread uses (register spills; `cuobjdump -res-usage`). A
    # 128 x 256 act_grad tile spilled 3,776 bytes and ran 2x slower than its own GEMM.
    spill_bytes: int | None = None


def target_name(target: GPUTarget) -> str:
    return f"{target.backend}:{target.arch}"


def parse_target(text: str) -> GPUTarget:
    """``cuda:90``, ``hip:gfx942`` or ``hip:gfx1100:32`` (backend:arch[:warp_size])."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or parts[0] not in ("cuda", "hip"):
        raise ValueError(f"target must look like cuda:90 or hip:gfx942[:64], got {text!r}")
    backend, arch = parts[0], parts[1]
    warp = int(parts[2]) if len(parts) == 3 else (32 if backend == "cuda" else 64)
    return GPUTarget(backend, int(arch) if backend == "cuda" else arch, warp)


def _display_labels(entries: Sequence[KernelSignature]) -> list[str]:
    labels = [e.label or ", ".join(f"{k}={v}" for k, v in e.constexprs) or "default" for e in entries]
    counts: dict[str, int] = {}
    out = []
    for label in labels:
        n = counts[label] = counts.get(label, 0) + 1
        out.append(label if labels.count(label) == 1 else f"{label} #{n}")
    return out


def _ast_source(entry: KernelSignature):
    """Build the ASTSource, checking that every argument has a type or a constexpr value."""
    from triton.compiler import ASTSource
    fn = _compilable(entry.fn)
    params = inspect.signature(_base_function(fn)).parameters
    given_types = dict(entry.signature)
    constexprs = dict(entry.constexprs)
    unknown = [k for k in [*given_types, *constexprs] if k not in params]
    if unknown:
        raise ValueError(f"register_kernel names {unknown} which are not arguments of {entry.name}"
                         f" (arguments: {list(params)})")
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for i, (name, param) in enumerate(params.items()):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in given_types and given_types[name] != "constexpr":
            ty = given_types[name]
            signature[name] = ty
            if (entry.aligned and ty.startswith("*")) or name in entry.multiples_of_16:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif param.default is not inspect.Parameter.empty:
            constexprs[name] = param.default
            signature[name] = "constexpr"
        else:
            raise ValueError(f"argument {name!r} of {entry.name} has neither a type in the signature nor "
                             f"a constexpr value: pass it to register_kernel")
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource
        return GluonASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


class _CaptureStderr:
    """Capture file descriptor 2: LLVM and ptxas write diagnostics there, not to sys.stderr."""

    def __enter__(self) -> "_CaptureStderr":
        sys.stderr.flush()
        self._file = tempfile.TemporaryFile()
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        self.text = ""
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        self.text = self._file.read().decode(errors="replace")
        self._file.close()


def _error_text(exc: BaseException, stderr: str) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    if stderr.strip():
        text += "\n--- stderr ---\n" + stderr.strip()
    return text if len(text) <= _ERROR_TAIL_CHARS else "..." + text[-_ERROR_TAIL_CHARS:]


_GLOBAL_ACCESS = re.compile(r"\b(?:ld|st)\.global((?:\.[\w:]+)+)")


def stack_bytes(cubin: bytes) -> int | None:
    """Per-thread stack bytes of a compiled NVIDIA kernel (spilled registers), from the cuobjdump
    Triton ships; None where it is absent."""
    import subprocess
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"\bSTACK:(\d+)", out)
    return int(m.group(1)) if m else None


def count_narrow_accesses(ptx: str) -> int:
    """Scalar (not vector) 8/16-bit global loads and stores in a PTX listing."""
    n = 0
    for m in _GLOBAL_ACCESS.finditer(ptx):
        parts = m.group(1).split(".")[1:]
        if parts[-1] in ("b8", "u8", "s8", "b16", "u16", "s16", "f16", "bf16") and \
                not any(re.fullmatch(r"v\d+", q) for q in parts):
            n += 1
    return n


_LLVM_LABEL = re.compile(r"^([\w.$-]+):")
_LLVM_TARGETS = re.compile(r"label %([\w.$-]+)")


def _llvm_cfgs(llir: str) -> list[tuple[str, dict[str, list[str]]]]:
    """(entry block, successors) of every function defined in an LLVM IR listing."""
    cfgs = []
    for body in re.findall(r"^define [^\n]*\{\n(.*?)^\}", llir, flags=re.M | re.S):
        entry = cur = "%entry"
        succ: dict[str, list[str]] = {cur: []}
        in_switch = False
        for line in body.splitlines():
            m = _LLVM_LABEL.match(line)
            if m:
                cur = m.group(1)
                succ[cur] = []
                continue
            text = line.split(";", 1)[0].strip()
            if text.startswith(("br ", "switch ", "indirectbr ")) or in_switch:
                succ[cur] += _LLVM_TARGETS.findall(text)
                in_switch = (text.startswith("switch ") or in_switch) and "]" not in text
        cfgs.append((entry, succ))
    return cfgs


def count_irreducible_edges(llir: str) -> int:
    """Back edges of an LLVM IR listing whose target does not dominate their source: each one is a
    loop with a second entry (0 for structured code: Triton's loops have one entry)."""
    n = 0
    for entry, succ in _llvm_cfgs(llir):
        # depth-first postorder, iteratively; then reverse postorder positions
        post, seen, stack = [], {entry}, [(entry, iter(succ[entry]))]
        while stack:
            node, it = stack[-1]
            nxt = next((s for s in it if s in succ and s not in seen), None)
            if nxt is None:
                post.append(node)
                stack.pop()
            else:
                seen.add(nxt)
                stack.append((nxt, iter(succ[nxt])))
        rpo = post[::-1]
        pos = {b: i for i, b in enumerate(rpo)}
        preds: dict[str, list[str]] = {b: [] for b in rpo}
        for b in rpo:
            for s in succ[b]:
                if s in pos:
                    preds[s].append(b)
        idom = {entry: entry}  # Cooper, Harvey, Kennedy: iterate to a fixed point in RPO

        def meet(a: str, b: str) -> str:
            while a != b:
                while pos[a] > pos[b]:
                    a = idom[a]
                while pos[b] > pos[a]:
                    b = idom[b]
            return a
        changed = True
        while changed:
            changed = False
            for b in rpo[1:]:
                done = [p for p in preds[b] if p in idom]
                new = done[0]
                for p in done[1:]:
                    new = meet(p, new)
                if idom.get(b) != new:
                    idom[b], changed = new, True

        def dominates(a: str, b: str) -> bool:
            while a != b and b != entry:
                b = idom[b]
            return a == b
        n += sum(1 for b in rpo for s in succ[b] if s in pos and pos[s] <= pos[b] and not dominates(s, b))
    return n


def _called_device_functions(ttir_source: str) -> tuple[str, ...]:
    # Device functions appear in the un-inlined TTIR as `tt.func private @"module.qualname__<mangling>"`.
    names = re.findall(r'tt\.func\s+private\s+@"?([\w.]+?)__', ttir_source)
    return tuple(sorted(n for n in set(names) if not n.startswith("triton.")))


def compile_registered(targets: Sequence[GPUTarget] = PORTABILITY_TARGETS, *,
                       modules: Iterable[str] | None = None) -> list[CompileResult]:
    """Compile every registered kernel signature for every target, one result per
    (kernel, label, target). ``modules`` restricts the kernels to those defined in these modules.

    Needs real JITFunctions: call it in a process started with ``TRITON_INTERPRET=0``.
    """
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    wanted = set(modules) if modules is not None else None
    results = []
    for base, entries in _KERNELS.items():
        if wanted is not None and base.__module__ not in wanted:
            continue
        if isinstance(_compilable(entries[0].fn), InterpretedFunction):
            raise RuntimeError("compile_registered needs real JITFunctions but the Triton interpreter is on; "
                               "use run_portability_check(), which compiles in a TRITON_INTERPRET=0 subprocess")
        for entry, label in zip(entries, _display_labels(entries)):
            for target in targets:
                if not entry.compiles_for(target.backend, target.arch):
                    continue
                start = time.perf_counter()
                error, shared, called, narrow, irreducible, spills = None, None, (), None, None, None
                with _CaptureStderr() as captured:
                    try:
                        compiled = triton.compile(_ast_source(entry), target=target, options=dict(entry.options))
                        shared = int(compiled.metadata.shared)
                        called = _called_device_functions(compiled.asm.get("source", ""))
                        if "ptx" in compiled.asm:
                            narrow = count_narrow_accesses(compiled.asm["ptx"])
                        if "llir" in compiled.asm:
                            irreducible = count_irreducible_edges(compiled.asm["llir"])
                        if "cubin" in compiled.asm:
                            spills = stack_bytes(compiled.asm["cubin"])
                    except Exception as exc:
                        failure = exc
                    else:
                        failure = None
                if failure is not None:
                    error = _error_text(failure, captured.text)
                else:
                    limit = _MAX_SHARED_BYTES.get((target.backend, str(target.arch)))
                    if limit is not None and shared > limit:
                        error = (f"OutOfResources: needs {shared} bytes of shared memory, {target_name(target)} "
                                 f"has {limit}: reduce the block sizes or num_stages of this configuration")
                results.append(CompileResult(
                    kernel=entry.name, label=label, target=target_name(target), ok=error is None, error=error,
                    seconds=round(time.perf_counter() - start, 3), shared_bytes=shared, device_functions=called,
                    narrow_accesses=narrow, irreducible_edges=irreducible, spill_bytes=spills))
    return results


# --------------------------------------------------------------------------------------------
# The whole check (worker side and parent side)
# --------------------------------------------------------------------------------------------

def check(package: str = "ditron_ep", *, extra_modules: Sequence[str] = (),
          skip: Iterable[str] = DEFAULT_SKIP_MODULES,
          targets: Sequence[GPUTarget] = PORTABILITY_TARGETS) -> dict[str, Any]:
    """Scan, verify registration and compile, in this process; returns the JSON-able report.

    Run by ``_compile_worker`` in a ``TRITON_INTERPRET=0`` subprocess.
    """
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    start = time.perf_counter()
    import_errors: list[tuple[str, str]] = []
    functions = find_jit_functions(package, extra_modules=extra_modules, skip=skip, errors=import_errors)
    scanned_modules = {_base_function(fn).__module__ for _, fn in functions}
    scanned_modules |= {m for m in sys.modules if package and (m == package or m.startswith(package + "."))}
    scanned_modules |= {Path(m).stem if m.endswith(".py") else m for m in extra_modules}
    interpreted = [name for name, fn in functions if isinstance(_compilable(fn), InterpretedFunction)]
    if interpreted:
        raise RuntimeError(f"the Triton interpreter is on in the compile worker ({interpreted[0]} is an "
                           f"InterpretedFunction): start it with TRITON_INTERPRET=0 in its environment")
    unregistered = []
    for name, fn in functions:
        if not is_registered(fn):
            base = _base_function(fn)
            unregistered.append({"name": name, "file": inspect.getsourcefile(base) or "",
                                 "line": base.__code__.co_firstlineno})
    results = compile_registered(targets, modules=scanned_modules)
    called = {name for r in results for name in r.device_functions}
    uncompiled = sorted(qualified_name(fn) for fn in _DEVICE_FUNCTIONS.values()
                        if _base_function(fn).__module__ in scanned_modules and qualified_name(fn) not in called)
    return {
        "package": package,
        "extra_modules": list(extra_modules),
        "triton_version": triton.__version__,
        "targets": [target_name(t) for t in targets],
        "import_errors": [{"module": m, "error": e} for m, e in import_errors],
        "jit_functions": [name for name, _ in functions],
        "unregistered": unregistered,
        "device_functions_not_compiled": uncompiled,  # registered, but no registered kernel calls them
        "results": [dataclasses.asdict(r) for r in results],
        "seconds": round(time.perf_counter() - start, 2),
    }


def run_portability_check(package: str = "ditron_ep", *, paths: Sequence[str | os.PathLike] = (),
                          extra_modules: Sequence[str] = (), skip: Sequence[str] = (),
                          targets: Sequence[GPUTarget] = PORTABILITY_TARGETS,
                          cache_dir: str | os.PathLike | None = None, timeout: float = 600,
                          env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the check in fresh ``TRITON_INTERPRET=0`` subprocesses, one per target at once (the
    compiles dominate: two targets on two cores take the time of one), and return the merged report.

    ``paths`` are prepended to the workers' ``sys.path``; ``cache_dir`` becomes their
    ``TRITON_CACHE_DIR`` (a fresh temporary folder when None, so no earlier build is reused).
    The report gains ``returncode`` (the worst) and ``stderr`` (each worker's tail). Raises
    RuntimeError when a worker wrote no report.
    """
    with tempfile.TemporaryDirectory(prefix="ditron_portability_") as tmp:
        child_env = dict(os.environ if env is None else env)
        child_env["TRITON_INTERPRET"] = "0"  # explicit "0": unset would let the package pick the interpreter
        child_env.pop("TRITON_ALLOW_NON_CONSTEXPR_GLOBALS", None)  # users' launches do not set it either
        child_env["TRITON_CACHE_DIR"] = str(cache_dir if cache_dir is not None else Path(tmp) / "triton_cache")
        child_env["PYTHONPATH"] = os.pathsep.join(
            [str(_REPO_ROOT), *map(str, paths), *filter(None, [child_env.get("PYTHONPATH")])])
        workers = []
        for i, target in enumerate(targets):
            report_path = Path(tmp) / f"report{i}.json"
            cmd = [sys.executable, "-m", "tools.compile_worker", "--package", package, "--json", str(report_path),
                   "--target", f"{target.backend}:{target.arch}:{target.warp_size}"]
            for path in paths:
                cmd += ["--path", str(path)]
            for module in extra_modules:
                cmd += ["--module", str(module)]
            for name in skip:
                cmd += ["--skip", name]
            proc = subprocess.Popen(cmd, env=child_env, cwd=str(_REPO_ROOT), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            workers.append((proc, report_path))
        reports, stderrs, codes = [], [], []
        for proc, report_path in workers:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            if not report_path.exists():
                for other, _ in workers:
                    other.kill()
                raise RuntimeError(f"portability worker exited with {proc.returncode} and no report:\n"
                                   f"{out[-_ERROR_TAIL_CHARS:]}\n{err[-_ERROR_TAIL_CHARS:]}")
            reports.append(json.loads(report_path.read_text()))
            stderrs.append(err[-_ERROR_TAIL_CHARS:])
            codes.append(proc.returncode)
    report = _merge_reports(reports)
    report["returncode"] = max(codes, default=0)
    report["stderr"] = "\n".join(stderrs)
    return report


def _merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report of several workers' (one target each): results and targets concatenated, the
    scan's findings (the same in every worker) taken once; a device function counts as compiled
    if any target compiled a kernel calling it."""
    merged = dict(reports[0])
    for key in ("targets", "results"):
        merged[key] = [item for r in reports for item in r.get(key, [])]
    fatal = [r["fatal"] for r in reports if r.get("fatal")]
    if fatal:
        merged["fatal"] = "\n".join(fatal)
    uncompiled = [set(r.get("device_functions_not_compiled", [])) for r in reports]
    merged["device_functions_not_compiled"] = sorted(set.intersection(*uncompiled)) if uncompiled else []
    merged["seconds"] = max(r.get("seconds", 0) for r in reports)
    return merged


_REPORT_PARTS = ("fatal", "imports", "unregistered", "compile")


def format_report_failures(report: dict[str, Any], target: str | None = None,
                           parts: Sequence[str] = _REPORT_PARTS) -> str:
    """Human-readable list of everything that makes ``report`` fail ('' when it passes).

    ``parts`` picks among "fatal", "imports", "unregistered" and "compile"; ``target`` restricts
    the compile failures to one target (e.g. "hip:gfx942").
    """
    unknown = set(parts) - set(_REPORT_PARTS)
    if unknown:
        raise ValueError(f"unknown report parts {sorted(unknown)}; choose from {_REPORT_PARTS}")
    lines = []
    if "fatal" in parts and report.get("fatal"):
        lines.append(f"worker failed: {report['fatal']}")
    if "imports" in parts:
        for err in report.get("import_errors", []):
            lines.append(f"cannot import {err['module']}:\n{err['error'].rstrip()}")
    if "unregistered" in parts:
        for fn in report.get("unregistered", []):
            lines.append(f"{fn['name']} ({fn['file']}:{fn['line']}) is a @triton.jit function with no compile "
                         f"signature: call tools.portability.register_kernel(fn, signature, "
                         f"constexprs) below a kernel, or decorate an inlined helper with "
                         f"@register_device_function (above @triton.jit)")
    if "compile" in parts:
        for r in report.get("results", []):
            if not r["ok"] and (target is None or r["target"] == target):
                lines.append(f"{r['kernel']} [{r['label']}] on {r['target']} failed:\n{r['error']}")
    return "\n\n".join(lines)
