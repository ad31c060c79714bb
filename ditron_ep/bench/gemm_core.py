"""Registry entries "expert_gemms" and "dense_gemm": the GEMM core (issue 24), each kernel on both
paths (portable `tl`, Hopper Gluon) against torch on the same shapes, on each rank's own GPU.

expert_gemms: the six GEMMs of one expert-MLP forward + backward at a layer's per-rank rows (T
tokens per rank, E experts over `--opt ranks=R` ranks, top-K, the request's routing; rows
contiguous, expert-major): up (gate-up with SwiGLU), down, act_grad (dy @ W2^T with the SwiGLU
backward), dgrad (dz @ W1^T), wgrad W1 (x^T dz per expert), wgrad W2 (h^T dy). Ours:
`grouped.kernel_launcher` with the portable default tile and the Hopper default tile (or, with
`--opt tuned=1`, each path's tuned tile from the tuner cache). Baselines: torch._grouped_mm on
the same operands, with the elementwise SwiGLU ops ours fuses done in torch (up: silu(g) * u;
act_grad: dz and h from dh and z), wgrad in the ragged-K form.

dense_gemm: C = A @ B, A [M, K], B [K, N] row-major, M = the token count, (K, N) from `--opt
kn=KxN` (default: every pair of 3584, 8192, 14336). Ours: the grouped kernels with one expert
(portable and Hopper). Baseline: torch.mm (cuBLAS).

`--opt sustain=S` (seconds) also times every row sustained: back-to-back calls for at least S
seconds (the board is power-capped: the clock drops under a sustained load), figures per batch of
calls, and the SM clock and power read from nvidia-smi at the end, in the row's details.
Checks: each of ours against torch's output within the dtype's rtol (max |diff| / max |ref|).
"""
from __future__ import annotations

import subprocess
import time
from typing import Any, Callable, Mapping

import torch

from ditron_ep.bench.grouped_gemm import make_case
from ditron_ep.bench.moe_layer import LAYER_DTYPES, LAYER_ROUTINGS, LAYER_SHAPES
from ditron_ep.bench.ranks import StageFailed, guarded, relative_errors
from ditron_ep.bench.spec import (BenchContext, Benchmark, BenchRequest, Impl, Measurement, Option, Shape, boolean,
                                  positive_int, tolerance_check)
from ditron_ep.check.tolerances import TOLERANCES
from ditron_ep.compiler.core_config import default_expert_configs, default_gemm_configs

KERNELS = ("up", "down", "act_grad", "dgrad", "wgrad W1", "wgrad W2")
PATHS = ("portable", "hopper")
DENSE_KN = tuple((k, n) for k in (3584, 8192, 14336) for n in (3584, 8192, 14336))


def _parse_seconds(text: str) -> float:
    v = float(text)
    if not 0 <= v <= 60:
        raise ValueError(f"sustain must be seconds in [0, 60], got {text!r}")
    return v


def _parse_kn(text: str) -> tuple[int, int]:
    k, sep, n = text.lower().partition("x")
    if not sep or not k.isdigit() or not n.isdigit() or int(k) % 64 or int(n) % 8:
        raise ValueError(f"kn must be KxN with K a multiple of 64 and N of 8, e.g. 8192x3584; got {text!r}")
    return int(k), int(n)


def sm_clock(device: torch.device) -> dict[str, float | str]:
    """The SM clock (MHz) and board power (W) of `device` now, from nvidia-smi ({} if unreadable)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--id={device.index or 0}", "--query-gpu=clocks.sm,power.draw",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10).stdout
        mhz, watts = (float(v) for v in out.strip().split(","))
        return {"sm_clock_mhz": mhz, "power_w": watts}
    except (OSError, ValueError, subprocess.SubprocessError):
        return {}


def sustained_times(fn: Callable[[], object], seconds: float, device: torch.device, batch: int = 10) -> list[float]:
    """µs per call of `fn`, one figure per batch of `batch` back-to-back calls, for >= `seconds`."""
    fn()
    torch.cuda.synchronize(device)
    out, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(out) < 3:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(batch):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1000.0 / batch)
    return out


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm on the GPU (the baseline); a per-group loop on the CPU (emulated runs,
    where _grouped_mm's stride rules refuse these operands). b 3-D: rows of a split by offs;
    b 2-D: the ragged-K form, [groups, a rows, b cols]."""
    if a.is_cuda:
        return torch._grouped_mm(a, b, offs=offs)
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    if b.dim() == 3:
        return torch.cat([a[lo:hi] @ b[g] for g, (lo, hi) in enumerate(zip(starts, ends))])
    return torch.stack([a[:, lo:hi] @ b[lo:hi] for lo, hi in zip(starts, ends)])


def swiglu_backward(dh: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dz, h) of SwiGLU from dh and the pre-activation z = [gate | up], in torch (what a torch
    pipeline runs after its dh GEMM; ours fuses it into the GEMM's epilogue)."""
    inter = dh.shape[1]
    gate, up = z[:, :inter].float(), z[:, inter:].float()
    sig = torch.sigmoid(gate)
    silu = gate * sig
    dhf = dh.float()
    dz = torch.cat([dhf * up * sig * (1 + gate * (1 - sig)), dhf * silu], dim=1).to(dh.dtype)
    return dz, (silu * up).to(dh.dtype)


def sustained_name(impl: str) -> str:
    return f"{impl} (sustained)"


def _measure_both(ctx: BenchContext, impl: str, fn: Callable[[], object], work: float, check: str, ok: bool,
                  details: dict[str, Any]) -> list[Measurement]:
    """The burst measurement (the framework's timing rule), plus the sustained one when asked."""
    out = [ctx.measure(impl, fn, work, check, ok, details=details)]
    seconds = ctx.options.get("sustain", 0.0)
    if seconds and ctx.on_cuda:
        try:
            times = sustained_times(fn, seconds, ctx.device)
            out.append(Measurement(sustained_name(impl), times, work, check, ok,
                                   details={**details, **sm_clock(ctx.device), "seconds": seconds}))
        except Exception as exc:  # noqa: BLE001 - reported in the row
            out.append(Measurement(sustained_name(impl), work=work, ok=False, error=f"{type(exc).__name__}: {exc}"))
    return out


def _checked(ctx: BenchContext, impl: str, fn: Callable[[], object], out: torch.Tensor, want: torch.Tensor,
             work: float, details: dict[str, Any]) -> list[Measurement]:
    try:
        guarded(ctx, f"{impl} (check)", lambda: (out.fill_(float("nan")), fn()))
    except StageFailed as exc:
        return [Measurement(impl, work=work, ok=False, error=str(exc))]
    rel = relative_errors(ctx, want, {impl: out})[impl]
    return _measure_both(ctx, impl, fn, work, *tolerance_check(rel, TOLERANCES[ctx.dtype][0]), details)


# ---- expert_gemms

def ours_name(kernel: str, path: str) -> str:
    return f"{kernel} {path}"


def torch_name(kernel: str) -> str:
    return f"torch {kernel}"


def _choices(ctx: BenchContext, case, num_local: int) -> dict[str, dict[str, tuple[str, Any]]]:
    """path -> kernel -> (path, tile): the defaults, or with --opt tuned=1 each path's tuned tile."""
    from ditron_ep.compiler.tuner import tuned_choices
    from ditron_ep.ops.moe_layer.hopper_path import default_hopper_configs

    portable = default_expert_configs(ctx.dtype, "cuda" if ctx.on_cuda else "cpu")
    paths = {"portable": {k: ("portable", c) for k, c in portable.items()},
             "hopper": {k: ("hopper", c) for k, c in default_hopper_configs().items()}}
    if ctx.options.get("tuned", False):
        s = ctx.shape
        tuned = tuned_choices(ctx.dtype, ctx.device, rows=case.x_rows.shape[0], hidden=s.hidden, inter=s.inter,
                              num_local=num_local) or {}
        for k, (p, cfg) in tuned.items():
            paths[p][k] = (p, cfg)
    return paths


def run_expert_gemms(ctx: BenchContext, tokens: int) -> list[Measurement]:
    from ditron_ep.ops.moe_layer.grouped import kernel_launcher
    from ditron_ep.ops.moe_layer.hopper_path import path_problem, default_hopper_configs

    s = ctx.shape
    hidden, inter = s.hidden, s.inter
    case = guarded(ctx, "inputs", lambda: make_case(ctx, tokens))
    x, off, w1, w2 = case.x_rows.contiguous(), case.offsets, case.wts.w1.contiguous(), case.wts.w2.contiguous()
    rows, num_local = x.shape[0], w1.shape[0]
    offs = off[1:]
    dev, dt = ctx.device, ctx.dtype
    fl_up, fl_dn = 2.0 * rows * hidden * 2 * inter, 2.0 * rows * inter * hidden
    work = {"up": fl_up, "down": fl_dn, "act_grad": fl_dn, "dgrad": fl_up, "wgrad W1": fl_up, "wgrad W2": fl_dn}
    details = {"rows": rows, "rows_per_expert": case.sizes}
    g = torch.Generator(device=dev).manual_seed(ctx.seed * 1000 + 77 + ctx.rank)
    bufs = {"z": torch.empty(rows, 2 * inter, dtype=dt, device=dev), "h": torch.empty(rows, inter, dtype=dt, device=dev),
            "y": torch.empty(rows, hidden, dtype=dt, device=dev),
            "dz": (torch.randn(rows, 2 * inter, generator=g, device=dev) * 0.1).to(dt),
            "dx": torch.empty_like(x), "dy": (torch.randn(rows, hidden, generator=g, device=dev) * 0.1).to(dt),
            "g1": torch.empty(w1.shape, dtype=dt, device=dev)}
    g2 = torch.empty(w2.shape, dtype=dt, device=dev)
    dz_out = torch.empty_like(bufs["dz"])

    def silu_mul(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(t[:, :inter]) * t[:, inter:]

    with torch.no_grad():
        # references (torch) on the same operands; h and z from torch's forward
        z_ref = guarded(ctx, "torch up (check)", lambda: grouped_mm(x, w1, offs))
        h_ref = silu_mul(z_ref)
        bufs["z"].copy_(z_ref)
        bufs["h"].copy_(h_ref)
        refs = {
            "up": (lambda: silu_mul(grouped_mm(x, w1, offs)), h_ref),
            "down": (lambda: grouped_mm(bufs["h"], w2, offs), None),
            "act_grad": (lambda: swiglu_backward(grouped_mm(bufs["dy"], w2.transpose(-2, -1), offs), bufs["z"]), None),
            "dgrad": (lambda: grouped_mm(bufs["dz"], w1.transpose(-2, -1), offs), None),
            "wgrad W1": (lambda: grouped_mm(x.t(), bufs["dz"], offs), None),
            "wgrad W2": (lambda: grouped_mm(bufs["h"].t(), bufs["dy"], offs), None),
        }
        want = {k: (r if r is not None else fn()) for k, (fn, r) in refs.items()}
        want["act_grad"] = want["act_grad"][0]  # dz (ours writes dz and h; the check reads dz)
        out: list[Measurement] = []
        for kernel in KERNELS:
            out += _measure_both(ctx, torch_name(kernel), refs[kernel][0], work[kernel], "reference", True, details)
        hopper_problem = path_problem(x, w1, w2, None, default_hopper_configs()) if ctx.on_cuda else "no GPU"
        for path, choices in _choices(ctx, case, num_local).items():
            if path == "hopper" and not ctx.on_cuda:
                continue
            for kernel in KERNELS:
                impl = ours_name(kernel, path)
                if path == "hopper" and hopper_problem:
                    out.append(Measurement(impl, work=work[kernel], ok=False, error=hopper_problem))
                    continue
                base = kernel.split(" ")[0]
                choice = choices[base]
                if kernel == "wgrad W2":  # h^T dy into g2 (kernel_launcher's wgrad is x^T dz into g1)
                    run = kernel_launcher("wgrad", choice, bufs["h"], off, w1, w2, {**bufs, "dz": bufs["dy"], "g1": g2},
                                          _sms(ctx), 0)
                elif kernel == "act_grad":  # writes dz: into its own buffer (dgrad and wgrad read bufs["dz"])
                    run = kernel_launcher(base, choice, x, off, w1, w2, {**bufs, "dz": dz_out}, _sms(ctx), 0)
                else:
                    run = kernel_launcher(base, choice, x, off, w1, w2, bufs, _sms(ctx), 0)
                fn, result = run
                if kernel in ("down", "act_grad"):  # they read h / z: restore torch's before the check
                    bufs["h"].copy_(h_ref)
                    bufs["z"].copy_(z_ref)
                out += _checked(ctx, impl, fn, result, want[kernel], work[kernel],
                                {**details, "tile": f"{choice[0]}:{choice[1]}"})
                if kernel == "act_grad":
                    bufs["h"].copy_(h_ref)
    return out


def _sms(ctx: BenchContext) -> int:
    return torch.cuda.get_device_properties(ctx.device).multi_processor_count if ctx.on_cuda else 1


def with_sustained(impl: Impl, sustain: bool) -> list[Impl]:
    """`impl`, and with `sustain` its sustained row (against the baselines' sustained rows)."""
    if not sustain:
        return [impl]
    return [impl, Impl(sustained_name(impl.name), impl.kind, tuple(sustained_name(a) for a in impl.against))]


def plan_expert_gemms(req: BenchRequest, tokens: int, options: Mapping[str, Any], on_gpu: bool) -> tuple[Impl, ...]:
    sus = bool(options.get("sustain", 0.0)) and on_gpu
    ours, base = [], []
    for kernel in KERNELS:
        for path in (PATHS if on_gpu else ("portable",)):
            ours += with_sustained(Impl(ours_name(kernel, path), against=(torch_name(kernel),)), sus)
        base += with_sustained(Impl(torch_name(kernel), "baseline"), sus)
    return (*ours, *base)


def validate_expert_gemms(req: BenchRequest, options: Mapping[str, Any], world_size: int) -> str | None:
    ranks = options.get("ranks", 2)
    if req.shape.experts % ranks:
        return f"--experts {req.shape.experts} is not a multiple of --opt ranks={ranks}"
    return None


EXPERT_GEMMS = Benchmark(
    name="expert_gemms",
    description="the expert MLP's six GEMMs (forward, act-grad, dgrad, wgrad), portable and Hopper paths, vs "
                "torch._grouped_mm, at a layer's per-rank rows, on each rank's own GPU",
    metric="TFLOP/s", work_rule="FLOPs = 2*rows*K*N of the kernel's GEMM (elementwise epilogues not counted)",
    check_rule="output vs torch._grouped_mm's on the same operands within the dtype's rtol",
    shapes={"emulated": Shape(hidden=64, experts=8, topk=2, inter=32), "torch": LAYER_SHAPES["torch"]},
    tokens={"emulated": (8,), "torch": (128, 1024, 4096)},
    plan=plan_expert_gemms, run=run_expert_gemms, default=False, ep=False, validate=validate_expert_gemms,
    options=(Option("ranks", "EP ranks of the layer whose per-rank rows are timed (E/ranks local experts)",
                    positive_int, 2),
             Option("sustain", "also time every row sustained for this many seconds (SM clock and power in the "
                               "details)", _parse_seconds, 0.0),
             Option("tuned", "use each path's tuned tiles from the tuner cache where it has them", boolean, False)),
    dtypes=LAYER_DTYPES, routings=LAYER_ROUTINGS)


# ---- dense_gemm

def dense_name(kind: str, k: int, n: int) -> str:
    return f"{kind} K={k} N={n}"


def _kns(options: Mapping[str, Any], on_gpu: bool = True) -> tuple[tuple[int, int], ...]:
    """The (K, N) pairs: --opt kn, else the GEMM+collective shapes (two small ones on the CPU)."""
    return tuple(options.get("kn") or (DENSE_KN if on_gpu else ((64, 48), (96, 32))))


def run_dense_gemm(ctx: BenchContext, tokens: int) -> list[Measurement]:
    from ditron_ep.ops.moe_layer.grouped import kernel_launcher
    from ditron_ep.ops.moe_layer.hopper_path import default_hopper_configs, device_problem

    m, dev, dt = tokens, ctx.device, ctx.dtype
    up, down = default_gemm_configs(dt, "cuda" if ctx.on_cuda else "cpu")
    choices = {"portable": ("portable", down), "hopper": ("hopper", default_hopper_configs()["down"])}
    problem = device_problem(dev) if ctx.on_cuda else "no GPU"
    off = torch.tensor([0, m], dtype=torch.int32, device=dev)
    out: list[Measurement] = []
    g = torch.Generator(device=dev).manual_seed(ctx.seed * 1000 + 31 + ctx.rank)
    with torch.no_grad():
        for k, n in _kns(ctx.options, ctx.on_cuda):
            a = torch.randn(m, k, generator=g, device=dev).to(dt)
            b = (torch.randn(k, n, generator=g, device=dev) / k ** 0.5).to(dt)
            c = torch.empty(m, n, dtype=dt, device=dev)
            work = 2.0 * m * n * k
            want = torch.mm(a, b)
            out += _measure_both(ctx, dense_name("cuBLAS", k, n), lambda a=a, b=b: torch.mm(a, b), work,
                                 "reference", True, {"m": m, "k": k, "n": n})
            for path, choice in choices.items():
                if path == "hopper" and not ctx.on_cuda:
                    continue
                impl = dense_name(f"ours {path}", k, n)
                if path == "hopper" and problem:
                    out.append(Measurement(impl, work=work, ok=False, error=problem))
                    continue
                fn, result = kernel_launcher("down", choice, a, off, b[None], b[None], {"h": a, "y": c}, _sms(ctx), 0)
                out += _checked(ctx, impl, fn, result, want, work, {"m": m, "k": k, "n": n,
                                                                   "tile": f"{choice[0]}:{choice[1]}"})
            del a, b, c, want
    return out


def plan_dense_gemm(req: BenchRequest, tokens: int, options: Mapping[str, Any], on_gpu: bool) -> tuple[Impl, ...]:
    sus = bool(options.get("sustain", 0.0)) and on_gpu
    ours, base = [], []
    for k, n in _kns(options, on_gpu):
        blas = dense_name("cuBLAS", k, n)
        for path in (PATHS if on_gpu else ("portable",)):
            ours += with_sustained(Impl(dense_name(f"ours {path}", k, n), against=(blas,)), sus)
        base += with_sustained(Impl(blas, "baseline"), sus)
    return (*ours, *base)


DENSE_GEMM = Benchmark(
    name="dense_gemm",
    description="dense C = A @ B (the GEMM+collective kernels' compute): the grouped kernels with one expert, "
                "portable and Hopper paths, vs cuBLAS (torch.mm); M = the token count",
    metric="TFLOP/s", work_rule="FLOPs = 2*M*N*K",
    check_rule="output vs torch.mm's within the dtype's rtol",
    shapes={"emulated": Shape(hidden=0, experts=1, topk=1), "torch": Shape(hidden=0, experts=1, topk=1)},
    tokens={"emulated": (16,), "torch": (128, 1024, 8192)},
    plan=plan_dense_gemm, run=run_dense_gemm, default=False, ep=False,
    options=(Option("kn", "a (K, N) pair KxN to time (repeatable; default every pair of 3584, 8192, 14336)",
                    _parse_kn, None, repeat=True),
             Option("sustain", "also time every row sustained for this many seconds", _parse_seconds, 0.0)),
    dtypes=LAYER_DTYPES, routings=("uniform",))
