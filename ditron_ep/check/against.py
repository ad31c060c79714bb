"""Checks of an MoE forward function: ditron_ep's own `moe`, or the user's (`check --against`).

The function under test has the signature of `ditron_ep.ops.moe`:

    fn(x, topk_idx, topk_weights, w1, w2, *, group=None, schedule="overlap") -> out

    x            [T, H]          this rank's tokens (fp32 on emulated ranks, bf16 on GPUs)
    topk_idx     [T, K] int64    global expert ids, -1 = dropped slot; rank r owns experts
                                 [r * E_local, (r + 1) * E_local), E_local = w1.shape[0]
    topk_weights [T, K] float32  routing weights
    w1           [E_local, H, 2I] gate ‖ up of this rank's experts; w2 [E_local, I, H]
    group        the EP process group (the check passes None: the default group)
    schedule     "overlap" and "sequential" must return bitwise identical outputs
    out          [T, H] in x's dtype: out[t] = sum_k w[t,k] * FFN_{e(t,k)}(x[t])

It is called collectively (every rank at once, under torch.no_grad()) and checked three ways,
one report row each:

* overlap vs sequential — its schedule="overlap" output equals its schedule="sequential"
  output bit for bit, on every rank;
* run vs run — `repeats` calls of schedule="overlap" on the same inputs are bitwise identical;
* vs oracle — the first output matches the float64 oracle (`ep_moe_oracle`) within the
  tolerance of its dtype (`tolerances.TOLERANCES`).

With backward (`check --backward`; on by default for ditron_ep's own `moe`), the gradients of
x, topk_weights, w1 and w2 for a seeded upstream gradient (torch.autograd.grad, grad mode on)
are checked the same three ways: "backward: overlap vs sequential" and "backward: run vs run" bit
for bit (an order-dependent accumulation, as atomics give, shows there), "backward: vs oracle"
against float64 autograd (`ep_moe_oracle_grads`), norm-wise: max |err| <= 2 * rtol * max |ref| +
atol per gradient (a backward rounds about twice as often as a forward). ditron_ep's own `moe` is
called with recompute=True there, so that its overlap row runs the fused forward.

`MODULE:FN` is imported on every rank: MODULE must be importable from sys.path there (the
emulated launcher gives the ranks the parent's sys.path; under torchrun, the launched processes'
own path), FN a module-level attribute (dots allowed: `pkg.mod:Class.method`).
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist

from ditron_ep.check.report import CaseResult, bitwise, max_abs_err, relative
from ditron_ep.check.tolerances import TOLERANCES, assert_close_to_oracle
from ditron_ep.runtime.errors import DitronConfigError

DITRON_MOE = "ditron_ep.ops.moe_layer.functional:moe"
ROW_SCHEDULES, ROW_RERUN, ROW_ORACLE = "overlap vs sequential", "run vs run", "vs oracle"
ROWS = (ROW_SCHEDULES, ROW_RERUN, ROW_ORACLE)
BACKWARD_ROWS = tuple(f"backward: {row}" for row in ROWS)
GRAD_NAMES = ("x", "topk_weights", "w1", "w2")


def load_moe_fn(spec: str) -> Callable[..., torch.Tensor]:
    """Import `MODULE:FN` and check that FN takes (x, topk_idx, topk_weights, w1, w2, *,
    group, schedule); raise DitronConfigError naming what is wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise DitronConfigError(f"--against wants MODULE:FN (e.g. mypkg.layers:my_moe), got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise DitronConfigError(f"--against {spec}: cannot import module {module_name!r} ({exc}); "
                                f"it must be importable from sys.path (set PYTHONPATH)") from None
    except (Exception, SystemExit) as exc:  # the module's own code failed (or exited) while importing
        raise DitronConfigError(f"--against {spec}: importing module {module_name!r} raised "
                                f"{type(exc).__name__}: {exc}; fix the module so that it imports") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise DitronConfigError(f"--against {spec}: module {module_name!r} has no attribute "
                                    f"{attr!r}") from None
    if not callable(obj):
        raise DitronConfigError(f"--against {spec}: {attr!r} is not callable")
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):  # builtins / C functions: trust the caller
        return obj
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    missing = [n for n in ("group", "schedule") if n not in params and not var_kw]
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_pos = any(p.kind is p.VAR_POSITIONAL for p in params.values())
    if missing or (len(positional) < 5 and not var_pos):
        raise DitronConfigError(
            f"--against {spec}: expected fn(x, topk_idx, topk_weights, w1, w2, *, group=None, "
            f"schedule='overlap'), got {obj.__name__ if hasattr(obj, '__name__') else obj}"
            f"{inspect.signature(obj)}")
    return obj


def rank_moe_runs(backend: str, spec: str, inputs: Any, repeats: int, backward: bool = False) -> dict[str, Any]:
    """Rank side: `repeats` calls with schedule="overlap", one with "sequential" (CPU results);
    with `backward`, the same calls again in grad mode and their gradients (GRAD_NAMES order)."""
    from ditron_ep.ops import clear_cache, clear_layers

    fn = load_moe_fn(spec)
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "torch" else torch.device("cpu")
    args = [t[rank].to(device) for t in (inputs.xs, inputs.topk_idxs, inputs.topk_weights,
                                         inputs.w1s, inputs.w2s)]
    extra = {"recompute": True} if spec == DITRON_MOE else {}

    def grads(schedule: str) -> list[torch.Tensor]:
        with torch.enable_grad():
            leaves = [t.detach().clone().requires_grad_() for t in (args[0], args[2], args[3], args[4])]
            out = fn(leaves[0], args[1], leaves[1], leaves[2], leaves[3], group=None, schedule=schedule, **extra)
            got = torch.autograd.grad(out, leaves, inputs.grad_outs[rank].to(device), allow_unused=True)
        return [torch.zeros_like(leaf).cpu() if g is None else g.detach().cpu() for g, leaf in zip(got, leaves)]

    try:
        with torch.no_grad():
            overlap = [fn(*args, group=None, schedule="overlap").cpu() for _ in range(repeats)]
            sequential = fn(*args, group=None, schedule="sequential").cpu()
        result = {"overlap": overlap, "sequential": sequential}
        if backward:
            result["grad_overlap"] = [grads("overlap") for _ in range(repeats)]
            result["grad_sequential"] = grads("sequential")
    finally:  # free ditron_ep's cached heaps: the ranks live on for the next case
        clear_cache()
        clear_layers()
    return result


def check_moe_rows(names: tuple[str, ...], kind: str, runner: Callable[..., list], backend: str,
                   spec: str, inputs: Any, dtype: torch.dtype, repeats: int, backward: bool = False) -> list:
    """Driver side: run `spec` on every rank and judge it; three CaseResults (ROWS order), then
    three more with `backward` (BACKWARD_ROWS)."""
    per_rank = runner(rank_moe_runs, backend, spec, inputs, repeats, backward)
    expected = inputs.oracle()
    max_ref = max((float(e.abs().max()) for e in expected if e.numel()), default=0.0)

    def diff(pairs: list[tuple[int, torch.Tensor, torch.Tensor]]) -> tuple[float, list[str]]:
        worst, problems = 0.0, []
        for rank, got, want in pairs:
            if got.shape != want.shape or got.dtype != want.dtype:
                problems.append(f"rank {rank}: {got.dtype} {tuple(got.shape)} vs {want.dtype} "
                                f"{tuple(want.shape)}")
                continue
            if not bitwise(got, want):
                n = int((got != want).sum()) if got.numel() else 0
                err = max_abs_err(got, want)
                worst = max(worst, err)
                problems.append(f"rank {rank}: {n}/{got.numel()} elements differ (max {err:.3g})")
        return worst, problems

    # overlap vs sequential
    err, problems = diff([(r, res["overlap"][0], res["sequential"]) for r, res in enumerate(per_rank)])
    rows = [CaseResult(names[0], kind, err, relative(err, max_ref), not problems, not problems,
                       "; ".join(problems[:3]) if problems else
                       f"overlap == sequential bit for bit, {len(per_rank)} ranks")]
    # run vs run
    err, problems = diff([(r, again, res["overlap"][0]) for r, res in enumerate(per_rank)
                          for again in res["overlap"][1:]])
    rows.append(CaseResult(names[1], kind, err, relative(err, max_ref), not problems, not problems,
                           "; ".join(problems[:3]) if problems else
                           f"{repeats} runs bitwise equal, {len(per_rank)} ranks"))
    # vs oracle
    max_abs, problems = 0.0, []
    for rank, (res, want) in enumerate(zip(per_rank, expected)):
        got = res["overlap"][0]
        if got.dtype != dtype or got.shape != want.shape:
            problems.append(f"rank {rank}: got {got.dtype} {tuple(got.shape)}, expected {dtype} "
                            f"{tuple(want.shape)}")
            continue
        max_abs = max(max_abs, max_abs_err(got, want))
        try:
            assert_close_to_oracle(got, want, dtype, f"rank {rank} output")
        except AssertionError as exc:
            problems.append(str(exc))
    rtol, atol = TOLERANCES[dtype]
    rows.append(CaseResult(names[2], kind, max_abs, relative(max_abs, max_ref), None, not problems,
                           "; ".join(problems[:2]) if problems else
                           f"{_shape_text(inputs)}; rtol={rtol:g} atol={atol:g}"))
    if backward:
        rows += _backward_rows(names[3:], kind, per_rank, inputs, repeats, diff)
    return rows


def _backward_rows(names, kind, per_rank, inputs, repeats, diff) -> list:
    """The three backward rows (BACKWARD_ROWS) from the ranks' gradients."""
    def pairs(runs, against):  # (rank label, got, want) per gradient of every run
        return [(f"{r} grad {g}", a, b) for r, res in enumerate(per_rank) for run in runs(res)
                for g, a, b in zip(GRAD_NAMES, run, against(res))]

    expected = inputs.oracle_grads()
    max_ref = max((float(t.abs().max()) for ts in expected for t in ts if t.numel()), default=0.0)
    err, problems = diff(pairs(lambda res: res["grad_overlap"][:1], lambda res: res["grad_sequential"]))
    rows = [CaseResult(names[0], kind, err, relative(err, max_ref), not problems, not problems,
                       "; ".join(problems[:3]) if problems else
                       f"every gradient of overlap == sequential bit for bit, {len(per_rank)} ranks")]
    err, problems = diff(pairs(lambda res: res["grad_overlap"][1:], lambda res: res["grad_overlap"][0]))
    rows.append(CaseResult(names[1], kind, err, relative(err, max_ref), not problems, not problems,
                           "; ".join(problems[:3]) if problems else
                           f"{repeats} backward passes bitwise equal, {len(per_rank)} ranks"))
    dtype = inputs.xs[0].dtype
    rtol, atol = TOLERANCES[dtype]
    worst, problems = 0.0, []
    for rank, (res, want) in enumerate(zip(per_rank, expected)):
        for name, got, ref in zip(GRAD_NAMES, res["grad_overlap"][0], want):
            if got.shape != ref.shape:
                problems.append(f"rank {rank} grad {name}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
                continue
            if not got.numel():
                continue
            err = max_abs_err(got, ref)
            scale = float(ref.abs().max())
            worst = max(worst, err)
            if not err <= 2 * rtol * scale + atol:  # NaN fails
                problems.append(f"rank {rank} grad {name}: max |err| {err:.3g} > 2*rtol*max|ref| + atol = "
                                f"{2 * rtol * scale + atol:.3g}")
    rows.append(CaseResult(names[2], kind, worst, relative(worst, max_ref), None, not problems,
                           "; ".join(problems[:2]) if problems else
                           f"x, topk_weights, w1, w2 vs float64 autograd; norm-wise 2*rtol={2 * rtol:g} atol={atol:g}"))
    return rows


def _shape_text(inputs: Any) -> str:
    tokens = ",".join(str(x.shape[0]) for x in inputs.xs)
    return (f"T={tokens} H={inputs.xs[0].shape[1]} I={inputs.w2s[0].shape[1]} E={inputs.num_experts} "
            f"K={inputs.topk_idxs[0].shape[1]}")
