"""Self-check of an installation: symmetric heap, signals, and the reference against the oracle.

`python -m ditron_ep check` runs these cases on emulated CPU ranks or on GPU ranks launched by
torchrun. Each case has a rank side and a driver side:

* rank functions (`rank_*`, module level so the emulated launcher can send them by name) run on
  every rank of the default process group and return plain data (numbers, CPU tensors);
* `run_case` gives a rank function to a `RankRunner` — anything that runs `fn(*args)` on every
  rank and returns the results in rank order (`EmulatedCluster.run`, or `local_runner` under
  torchrun) — and turns the per-rank results into one `CaseResult`.

Report rows and their verdict are in `report.py`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ditron_ep.check.against import BACKWARD_ROWS, DITRON_MOE, ROWS, check_moe_rows
from ditron_ep.check.kernels import exchange_tiles, read_peer_bytes
from ditron_ep.check.report import CaseResult, CheckReport, bitwise, max_abs_err, relative
from ditron_ep.check.routing import make_routing
from ditron_ep.check.tolerances import TOLERANCES, assert_close_to_oracle
from ditron_ep.ops.ep.naive import naive_combine, naive_dispatch
from ditron_ep.ops.moe_layer.naive import ep_moe_oracle, ep_moe_oracle_grads, ep_moe_reference
from ditron_ep.runtime import control as C
from ditron_ep.runtime.errors import DitronTimeoutError
from ditron_ep.runtime.heap import SymmetricHeap

KINDS = ("heap", "signal", "reference", "dispatch", "moe", "against")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HEAP_BYTES = 4 << 20  # every check fits in 4 MiB per rank, on either backend
# Poll budget of the timeout probe: ~0.6 s of polls under the interpreter (~0.25 ms a poll),
# ~20 ms on an H200 (measured). Far longer than a call barrier among live ranks takes.
PROBE_BUDGET = {"emulated": 2000, "torch": 1 << 16}

RankRunner = Callable[..., list]


# ============================================================================ case plan
@dataclass(frozen=True)
class CheckCase:
    """One row to run: `driver(case, runner, backend, world_size, seed, **params)` returns its
    CaseResult; `kind` is the row's kind (one of KINDS)."""

    name: str
    kind: str
    driver: Callable[..., CaseResult]
    params: dict[str, Any] = field(default_factory=dict)
    # A case that yields several report rows (one rank run judged several ways) names them here;
    # its driver then returns one CaseResult per name, in this order. Empty: one row, `name`.
    rows: tuple[str, ...] = ()

    @property
    def row_names(self) -> tuple[str, ...]:
        return self.rows or (self.name,)


# name -> (routing kind, drop probability, last rank has no tokens, topk)
REFERENCE_ROUTINGS: dict[str, tuple[str, float, bool, int]] = {
    "uniform": ("uniform", 0.0, False, 2),
    "zipf": ("zipf", 0.0, False, 4),
    "one_expert": ("one_expert", 0.0, False, 2),
    "drops": ("uniform", 0.3, False, 3),
    "empty_rank": ("zipf", 0.1, True, 3),
}
QUICK_REFERENCE = (("uniform", "fp32"), ("zipf", "bf16"), ("drops", "fp32"), ("empty_rank", "bf16"))


# Routings of the dispatch / moe / against cases (names of REFERENCE_ROUTINGS; K from the shape).
CASE_ROUTINGS = ("uniform", "zipf", "one_expert", "drops")
# T, H, I, E, K of the dispatch / moe / against cases: tiny, for the interpreter.
DEFAULT_SHAPE = (16, 32, 16, 8, 2)


def default_dtypes(backend: str) -> tuple[str, ...]:
    """MoE math under the Triton interpreter is right in fp32 only; GPUs run bf16."""
    return ("bf16",) if backend == "torch" else ("fp32",)


def moe_dtypes(backend: str, dtypes: Sequence[str]) -> tuple[str, ...]:
    """The dtypes of `dtypes` that moe / against cases run in on `backend`."""
    return tuple(d for d in dtypes if backend == "torch" or d == "fp32")


def plan_cases(world_size: int, *, quick: bool = False, routings: Sequence[str] | None = None,
               dtypes: Sequence[str] | None = None, repeats: int = 2,
               shape: tuple[int, int, int, int, int] = DEFAULT_SHAPE, against: str | None = None,
               backend: str = "emulated", backward: bool | None = None) -> list[CheckCase]:
    """The cases of one check run, in running order.

    Without `against`: heap, signal and reference cases, then dispatch/combine and MoE-layer
    cases for every routing in `routings` (default CASE_ROUTINGS; quick: uniform) and dtype in
    `dtypes` (default `default_dtypes(backend)`; MoE cases on emulated ranks in fp32 only).
    With `against` ("MODULE:FN"): only that function's cases, one per routing and dtype.
    backward: the MoE cases also check gradients (against.BACKWARD_ROWS); default: on for
    ditron_ep's own `moe`, off for `against` (the user's function may have no backward).
    """
    if routings is None:
        routings = ("uniform",) if quick else CASE_ROUTINGS
    dtypes = tuple(dtypes) if dtypes is not None else default_dtypes(backend)
    params = dict(repeats=repeats, shape=tuple(shape), backward=against is None if backward is None else backward)
    if against is not None:
        return [_moe_case(f"{against} {routing} {dtype}", "against", against, routing, dtype, params)
                for routing in routings for dtype in moe_dtypes(backend, dtypes)]
    cases = _plan_base(world_size, quick=quick)
    dispatch_params = {k: v for k, v in params.items() if k != "backward"}
    for routing in routings:
        for dtype in dtypes:
            name = f"dispatch {routing} {dtype}"
            cases.append(CheckCase(name, "dispatch", _check_dispatch, dict(routing=routing, dtype=dtype,
                                                                              **dispatch_params),
                                   rows=tuple(f"{name}: {row}" for row in DISPATCH_ROWS)))
    for routing in routings:
        for dtype in moe_dtypes(backend, dtypes):
            cases.append(_moe_case(f"moe {routing} {dtype}", "moe", None, routing, dtype, params))
    return cases


DISPATCH_ROWS = ("rows vs permutation", "combine vs oracle", "run vs run")


def _moe_case(name: str, kind: str, spec: str | None, routing: str, dtype: str,
              params: dict[str, Any]) -> CheckCase:
    rows = ROWS + (BACKWARD_ROWS if params["backward"] else ())
    return CheckCase(name, kind, _check_moe, dict(spec=spec or DITRON_MOE, routing=routing, dtype=dtype, **params),
                     rows=tuple(f"{name}: {row}" for row in rows))


def _plan_base(world_size: int, *, quick: bool) -> list[CheckCase]:
    """Heap, signal and reference cases."""
    cases = [CheckCase("heap: alloc + peer visibility", "heap", _check_heap)]
    exchanges = [("exchange fp32 16x64", 16, 64, "fp32", 2, None),
                 ("exchange bf16 ragged 37x130", 37, 130, "bf16", 2, 3)]
    if not quick:
        exchanges.append(("exchange fp16 empty 0x8", 0, 8, "fp16", 2, None))
    # One program runs the whole task queue: the cheapest launch under the interpreter.
    calls = 10 if quick else 50
    exchanges.append((f"exchange x{calls} back-to-back", 4, 32, "fp32", calls, 1))
    for name, rows, cols, dtype, n_calls, programs in exchanges:
        cases.append(CheckCase(name, "signal", _check_exchange,
                               dict(rows=rows, cols=cols, dtype=dtype, n_calls=n_calls,
                                    num_programs=programs)))
    if world_size > 1:  # a lone rank has no peer to miss
        cases.append(CheckCase("timeout probe (rank 0 alone)", "signal", _check_timeout))
    pairs = QUICK_REFERENCE if quick else [(r, d) for r in REFERENCE_ROUTINGS for d in ("fp32", "bf16")]
    for routing, dtype in pairs:
        cases.append(CheckCase(f"reference {routing} {dtype}", "reference", _check_reference,
                               dict(routing=routing, dtype=dtype)))
    return cases


# ============================================================================ drivers
def run_check(runner: RankRunner, backend: str, world_size: int, cases: Sequence[CheckCase], *,
              seed: int = 0, on_case_start: Callable[[CheckCase], None] | None = None,
              on_case_done: Callable[[CaseResult], None] | None = None) -> CheckReport:
    """Run `cases` through `runner` in order; an exception in a case fails that case only."""
    start = time.perf_counter()
    results = []
    for case in cases:
        if on_case_start is not None:
            on_case_start(case)
        for result in run_case_rows(case, runner, backend, world_size, seed=seed):
            results.append(result)
            if on_case_done is not None:
                on_case_done(result)
    return CheckReport(backend, world_size, seed, tuple(results), time.perf_counter() - start)


def count_rows(cases: Sequence[CheckCase]) -> int:
    """Report rows that `cases` produce (the progress bar's total)."""
    return sum(len(c.row_names) for c in cases)


def run_case(case: CheckCase, runner: RankRunner, backend: str, world_size: int, *,
             seed: int = 0) -> CaseResult:
    """The (first) row of `case`; see run_case_rows."""
    return run_case_rows(case, runner, backend, world_size, seed=seed)[0]


def run_case_rows(case: CheckCase, runner: RankRunner, backend: str, world_size: int, *,
                  seed: int = 0) -> list[CaseResult]:
    """Every row of `case`; an exception fails each of them with its first line."""
    try:
        result = case.driver(case, runner, backend, world_size, seed, **case.params)
        rows = [result] if isinstance(result, CaseResult) else list(result)
        if len(rows) != len(case.row_names):
            raise RuntimeError(f"driver returned {len(rows)} rows for {len(case.row_names)} names")
        return rows
    except Exception as exc:  # noqa: BLE001 - a crashed case is a failed row, not a crashed CLI
        first_line = (str(exc).strip().splitlines() or [""])[0]
        return [CaseResult(name, case.kind, None, None, None, False,
                           f"{type(exc).__name__}: {first_line}") for name in case.row_names]


def local_runner(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
    """`RankRunner` for ranks that are already running (torchrun): run `fn` here, all-gather.

    Every rank calls it with the same `fn` and arguments. A rank whose `fn` raised re-raises
    on every rank (after the gather, so no rank is left waiting in it).
    """
    try:
        mine: tuple = ("ok", fn(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        mine = ("err", f"{type(exc).__name__}: {exc}")
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    failed = [r for r, res in enumerate(gathered) if res[0] == "err"]
    if failed:
        raise RuntimeError(f"rank {failed[0]} raised {gathered[failed[0]][1]}")
    return [res[1] for res in gathered]


def _check_heap(case: CheckCase, runner: RankRunner, backend: str, world_size: int,
                seed: int) -> CaseResult:
    per_rank = runner(rank_heap_selftest, backend, seed)
    problems = []
    offsets = [r["offsets"] for r in per_rank]
    if any(o != offsets[0] for o in offsets):
        problems.append(f"offsets differ across ranks: {offsets}")
    for rank, res in enumerate(per_rank):
        problems += [f"rank {rank}: {p}" for p in res["problems"]]
    names = ", ".join(per_rank[0]["dtypes"])
    detail = (f"{len(offsets[0])} buffers ({names}); every rank read every peer through the "
              f"pointer table") if not problems else "; ".join(problems[:3])
    return CaseResult(case.name, "heap", None, None, not problems, not problems, detail)


def _check_exchange(case: CheckCase, runner: RankRunner, backend: str, world_size: int, seed: int,
                    *, rows: int, cols: int, dtype: str, n_calls: int,
                    num_programs: int | None) -> CaseResult:
    per_rank = runner(rank_exchange_selftest, backend, rows, cols, dtype, n_calls, num_programs, seed)
    max_abs = max(r["max_abs"] for r in per_rank)
    bitwise = all(r["bitwise"] for r in per_rank)
    bad = [(rank, r["bad"]) for rank, r in enumerate(per_rank) if r["bad"]]
    call_numbers = {r["calls"] for r in per_rank}
    ok = bitwise and not bad and call_numbers == {n_calls}
    if ok:
        detail = f"{n_calls} calls, every received tile element-exact"
    elif bad:
        rank, wrong = bad[0]
        detail = f"rank {rank}: wrong tiles (call, source) {wrong[:4]}"
    else:
        detail = f"call numbers after {n_calls} calls: {sorted(call_numbers)}"
    return CaseResult(case.name, "signal", max_abs, relative(max_abs, max(r["max_ref"] for r in per_rank)),
                      bitwise, ok, detail)


def _check_timeout(case: CheckCase, runner: RankRunner, backend: str, world_size: int,
                   seed: int) -> CaseResult:
    per_rank = runner(rank_timeout_probe, backend, PROBE_BUDGET[backend])
    probe = per_rank[0]
    message = probe["raised"] or ""
    problems = []
    if not message:
        problems.append("rank 0's lone launch did not raise DitronTimeoutError")
    elif not (probe["rank"] == 0 and probe["stage"] == "call barrier"
              and "rank 0" in message and "call barrier" in message):
        problems.append(f"timeout error does not name rank 0 / 'call barrier': {message}")
    recovered = [r["after_reset_ok"] for r in per_rank]
    if not all(recovered):
        problems.append(f"exchange after heap.reset() wrong on ranks "
                        f"{[r for r, ok in enumerate(recovered) if not ok]}")
    detail = (f"DitronTimeoutError on rank 0 in 'call barrier' after {probe['seconds']:.2f} s; "
              f"exchange exact after reset()") if not problems else "; ".join(problems)
    return CaseResult(case.name, "signal", None, None, None, not problems, detail)


def _check_reference(case: CheckCase, runner: RankRunner, backend: str, world_size: int, seed: int,
                     *, routing: str, dtype: str) -> CaseResult:
    inputs = make_moe_inputs(world_size, routing, DTYPES[dtype], seed=seed)
    per_rank = runner(rank_reference, backend, inputs, 2)
    expected = inputs.oracle()
    bitwise = all(torch.equal(first, second) for first, second in per_rank)
    max_abs, max_ref, problems = 0.0, 0.0, []
    for rank, ((first, _), want) in enumerate(zip(per_rank, expected)):
        if first.dtype != DTYPES[dtype] or first.shape != want.shape:
            problems.append(f"rank {rank}: got {first.dtype} {tuple(first.shape)}, expected "
                            f"{DTYPES[dtype]} {tuple(want.shape)}")
            continue
        max_abs = max(max_abs, max_abs_err(first, want))
        max_ref = max(max_ref, float(want.abs().max()) if want.numel() else 0.0)
        try:
            assert_close_to_oracle(first, want, DTYPES[dtype], f"rank {rank} output")
        except AssertionError as exc:
            problems.append(str(exc))
    if not bitwise:
        problems.append("two runs of the reference differ bitwise")
    rtol, atol = TOLERANCES[DTYPES[dtype]]
    tokens = ",".join(str(x.shape[0]) for x in inputs.xs)
    detail = "; ".join(problems) if problems else (
        f"T={tokens} H={inputs.xs[0].shape[1]} E={inputs.num_experts} "
        f"K={inputs.topk_idxs[0].shape[1]}; rtol={rtol:g} atol={atol:g}")
    return CaseResult(case.name, "reference", max_abs, relative(max_abs, max_ref), bitwise,
                      not problems, detail)


def _case_inputs(world_size: int, routing: str, dtype: str, seed: int,
                 shape: tuple[int, int, int, int, int]) -> MoEInputs:
    T, H, I, E, K = shape
    return make_moe_inputs(world_size, routing, DTYPES[dtype], seed=seed, num_tokens=T, hidden=H,
                           inter=I, num_experts=E, topk=K)


def _check_moe(case: CheckCase, runner: RankRunner, backend: str, world_size: int, seed: int, *,
               spec: str, routing: str, dtype: str, repeats: int,
               shape: tuple[int, int, int, int, int], backward: bool = False) -> list[CaseResult]:
    inputs = _case_inputs(world_size, routing, dtype, seed, shape)
    return check_moe_rows(case.row_names, case.kind, runner, backend, spec, inputs, DTYPES[dtype], repeats,
                          backward)


def expert_scale(expert: int) -> float:
    """The dispatch case's stand-in expert: y = x * (1 + e/8), different for every expert."""
    return 1.0 + expert / 8.0


def _scaled_rows(rows: torch.Tensor, experts: list[int], dtype: torch.dtype) -> torch.Tensor:
    scale = torch.tensor([expert_scale(e) for e in experts], dtype=torch.float32)
    return (rows.to(torch.float32) * scale[:, None]).to(dtype)


def _check_dispatch(case: CheckCase, runner: RankRunner, backend: str, world_size: int, seed: int, *,
                    routing: str, dtype: str, repeats: int,
                    shape: tuple[int, int, int, int, int]) -> list[CaseResult]:
    inputs = _case_inputs(world_size, routing, dtype, seed, shape)
    torch_dtype = DTYPES[dtype]
    per_rank = runner(rank_dispatch, backend, inputs, repeats)
    # rows vs the reference permutation
    perm_problems, ys = [], []
    for rank, runs in enumerate(per_rank):
        want, offsets, order = naive_dispatch(inputs.xs, inputs.topk_idxs, rank, inputs.num_experts)
        experts = [int(inputs.topk_idxs[s][t, k]) for s, t, k in order]
        recv_x, got_offsets, _ = runs[0]
        if got_offsets != offsets:
            perm_problems.append(f"rank {rank}: expert offsets {got_offsets}, expected {offsets}")
        elif not bitwise(recv_x, want):
            bad = [i for i in range(len(order)) if not bitwise(recv_x[i], want[i])]
            perm_problems.append(f"rank {rank}: {len(bad)}/{len(order)} rows differ (first row {bad[:1]})")
        ys.append((order, _scaled_rows(want, experts, torch_dtype)))
    rows_total = sum(len(o) for o, _ in ys)
    rows = [CaseResult(case.row_names[0], "dispatch", None, None, not perm_problems, not perm_problems,
                       "; ".join(perm_problems[:3]) if perm_problems else
                       f"{rows_total} rows on {world_size} ranks element-exact, in reference order")]
    # combine vs the float64 oracle of the expert rows
    expected = naive_combine([y for _, y in ys], [o for o, _ in ys], inputs.topk_weights,
                             [x.shape[0] for x in inputs.xs])
    max_abs, max_ref, problems = 0.0, 0.0, []
    for rank, (runs, want) in enumerate(zip(per_rank, expected)):
        out = runs[0][2]
        if out.dtype != torch_dtype or out.shape != want.shape:
            problems.append(f"rank {rank}: combine gave {out.dtype} {tuple(out.shape)}")
            continue
        max_abs = max(max_abs, max_abs_err(out, want))
        max_ref = max(max_ref, float(want.abs().max()) if want.numel() else 0.0)
        try:
            assert_close_to_oracle(out, want, torch_dtype, f"rank {rank} combine")
        except AssertionError as exc:
            problems.append(str(exc))
    rtol, atol = TOLERANCES[torch_dtype]
    rows.append(CaseResult(case.row_names[1], "dispatch", max_abs, relative(max_abs, max_ref), None,
                           not problems, "; ".join(problems[:2]) if problems else
                           f"expert y = x·(1+e/8); rtol={rtol:g} atol={atol:g}"))
    # run vs run
    problems = []
    for rank, runs in enumerate(per_rank):
        first = runs[0]
        for i, run in enumerate(runs[1:], 1):
            what = [name for name, same in (("received rows", bitwise(run[0], first[0])),
                                            ("offsets", run[1] == first[1]),
                                            ("combine", bitwise(run[2], first[2]))) if not same]
            if what:
                problems.append(f"rank {rank}: run {i} differs from run 0 in {' and '.join(what)}")
    rows.append(CaseResult(case.row_names[2], "dispatch", None, None, not problems, not problems,
                           "; ".join(problems[:3]) if problems else
                           f"{repeats} runs: rows and combine bitwise equal"))
    return rows


# ============================================================================ inputs
@dataclass(frozen=True)
class MoEInputs:
    """Every rank's MoE inputs; index r of each list belongs to rank r (CPU tensors)."""

    xs: list[torch.Tensor]
    topk_idxs: list[torch.Tensor]
    topk_weights: list[torch.Tensor]
    w1s: list[torch.Tensor]
    w2s: list[torch.Tensor]
    num_experts: int
    grad_outs: list[torch.Tensor]   # upstream gradient of every rank's output (backward checks)

    def oracle(self) -> list[torch.Tensor]:
        """float64 output of every rank (the independent single-process oracle)."""
        return ep_moe_oracle(self.xs, self.topk_idxs, self.topk_weights, self.w1s, self.w2s)

    def oracle_grads(self) -> list[tuple[torch.Tensor, ...]]:
        """float64 (x, topk_weights, w1, w2) gradients of every rank for `grad_outs`."""
        return ep_moe_oracle_grads(self.xs, self.topk_idxs, self.topk_weights, self.w1s, self.w2s,
                                   self.grad_outs)


def make_moe_inputs(world_size: int, routing: str, dtype: torch.dtype, *, seed: int = 0,
                    num_tokens: int = 24, hidden: int = 64, inter: int = 32,
                    num_experts: int | None = None, topk: int | None = None) -> MoEInputs:
    """Seeded inputs of the reference cases, scaled so outputs are of order 1.

    Rank r holds max(1, num_tokens - 3r) tokens (uneven on purpose); `routing` names an entry
    of REFERENCE_ROUTINGS (topk: that entry's unless given). E = `num_experts` (default 8)
    rounded up to a multiple of the world size.
    """
    kind, drop_prob, last_rank_empty, routing_topk = REFERENCE_ROUTINGS[routing]
    topk = topk or routing_topk
    num_experts = world_size * math.ceil((num_experts or 8) / world_size)
    num_local = num_experts // world_size
    tokens = [max(1, num_tokens - 3 * r) for r in range(world_size)]
    if last_rank_empty:
        tokens[-1] = 0
    gen = torch.Generator().manual_seed(seed * 7919 + sorted(REFERENCE_ROUTINGS).index(routing))
    xs, idxs, weights, w1s, w2s = [], [], [], [], []
    for n in tokens:
        xs.append(torch.randn(n, hidden, generator=gen).to(dtype))
        idx, w = make_routing(n, num_experts, topk, kind, generator=gen, drop_prob=drop_prob,
                              num_ranks=world_size)
        idxs.append(idx)
        weights.append(w)
        w1s.append((torch.randn(num_local, hidden, 2 * inter, generator=gen) / hidden ** 0.5).to(dtype))
        w2s.append((torch.randn(num_local, inter, hidden, generator=gen) / inter ** 0.5).to(dtype))
    grad_outs = [torch.randn(n, hidden, generator=gen).to(dtype) for n in tokens]
    return MoEInputs(xs, idxs, weights, w1s, w2s, num_experts, grad_outs)


def _tile(seed: int, src: int, call: int, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    # Random values, different per source rank and per call: a stale or misplaced tile shows.
    gen = torch.Generator().manual_seed(seed * 1_000_003 + src * 10_007 + call)
    return torch.randn(rows, cols, generator=gen).to(dtype)


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "torch" else torch.device("cpu")


# ============================================================================ rank functions
# (shape, dtype) of the heap self-test's buffers: odd sizes so allocations need realignment.
_HEAP_BUFFERS = (((1000,), torch.float32), ((7, 33), torch.bfloat16), ((5, 3), torch.int32),
                 ((3,), torch.uint8))


def _heap_fill(seed: int, rank: int, i: int) -> torch.Tensor:
    """Contents of buffer `i` on `rank`: random bits, so a read of the wrong rank shows."""
    shape, dtype = _HEAP_BUFFERS[i]
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + i)
    n_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n_bytes,), dtype=torch.uint8, generator=gen).view(dtype).view(shape)


def rank_heap_selftest(backend: str, seed: int) -> dict[str, Any]:
    """Allocate buffers, fill this rank's copies, read every peer's copy through the pointer
    table with a kernel (what every ditron_ep kernel does) and compare bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device(backend)
    problems = []
    with SymmetricHeap(backend=backend, size_bytes=HEAP_BYTES) as heap:
        for i, (shape, dtype) in enumerate(_HEAP_BUFFERS):
            view = heap.alloc(f"selfcheck/heap{i}", shape, dtype)
            if tuple(view.shape) != shape or view.dtype != dtype or view.device.type != device.type:
                problems.append(f"buffer {i}: view is {view.dtype} {tuple(view.shape)} on {view.device}")
            view.copy_(_heap_fill(seed, rank, i))
        offsets = [heap.offset_of(f"selfcheck/heap{i}") for i in range(len(_HEAP_BUFFERS))]
        problems += [f"offset {o} not {C.ALIGN}-byte aligned" for o in offsets if o % C.ALIGN]
        heap.barrier()
        for i, (shape, dtype) in enumerate(_HEAP_BUFFERS):
            n_bytes = heap.buffer(f"selfcheck/heap{i}").nbytes
            got = read_peer_bytes(heap, offsets[i], n_bytes).cpu()
            for peer in range(world):
                if not torch.equal(got[peer], _heap_fill(seed, peer, i).reshape(-1).view(torch.uint8)):
                    problems.append(f"buffer {i} ({dtype}) of rank {peer} reads wrong")
        heap.barrier()
    return {"offsets": offsets, "problems": problems,
            "dtypes": [str(dtype).removeprefix("torch.") for _, dtype in _HEAP_BUFFERS]}


def rank_exchange_selftest(backend: str, rows: int, cols: int, dtype: str, n_calls: int,
                           num_programs: int | None, seed: int) -> dict[str, Any]:
    """`n_calls` back-to-back tile exchanges; every received tile compared element-exact."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device, torch_dtype = _device(backend), DTYPES[dtype]
    bad, max_abs, max_ref, bitwise = [], 0.0, 0.0, True
    with SymmetricHeap(backend=backend, size_bytes=HEAP_BYTES) as heap:
        for call in range(n_calls):
            out = exchange_tiles(heap, _tile(seed, rank, call, rows, cols, torch_dtype).to(device),
                                 num_programs=num_programs).cpu()
            for src in range(world):
                want = _tile(seed, src, call, rows, cols, torch_dtype)
                if not torch.equal(out[src].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
                    bitwise = False
                    bad.append((call, src))
                max_abs = max(max_abs, max_abs_err(out[src], want))
                max_ref = max(max_ref, float(want.abs().max()) if want.numel() else 0.0)
        calls = heap.call_number
    return {"bad": bad[:8], "max_abs": max_abs, "max_ref": max_ref, "bitwise": bitwise, "calls": calls}


def rank_timeout_probe(backend: str, budget: int) -> dict[str, Any]:
    """All ranks exchange once; then rank 0 alone launches with a `budget`-poll wait budget and
    must get DitronTimeoutError; after `heap.reset()` an exchange must be exact again."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device(backend)
    result: dict[str, Any] = {"raised": None}
    with SymmetricHeap(backend=backend, size_bytes=HEAP_BYTES) as heap:
        exchange_tiles(heap, torch.ones(4, 8, device=device))  # allocates on every rank
        if rank == 0:
            default_budget, heap.wait_budget = heap.wait_budget, budget
            start = time.perf_counter()
            try:
                exchange_tiles(heap, torch.ones(4, 8, device=device))
            except DitronTimeoutError as err:
                result.update(raised=str(err), rank=err.rank, stage=err.stage)
            finally:
                heap.wait_budget = default_budget
            result["seconds"] = time.perf_counter() - start
        heap.reset()
        out = exchange_tiles(heap, torch.full((4, 8), float(rank), device=device)).cpu()
        result["after_reset_ok"] = all(torch.equal(out[s], torch.full((4, 8), float(s)))
                                       for s in range(world))
    return result


def rank_reference(backend: str, inputs: MoEInputs, repeats: int) -> list[torch.Tensor]:
    """`repeats` runs of the sequential reference on this rank's inputs (CPU results)."""
    rank = dist.get_rank()
    device = _device(backend)
    args = [t[rank].to(device) for t in (inputs.xs, inputs.topk_idxs, inputs.topk_weights,
                                         inputs.w1s, inputs.w2s)]
    return [ep_moe_reference(*args, num_experts=inputs.num_experts).cpu() for _ in range(repeats)]


def rank_dispatch(backend: str, inputs: MoEInputs, repeats: int) -> list[tuple]:
    """`repeats` dispatch -> y = x * (1 + e/8) -> combine rounds on a fresh EPBuffer; per round
    (received rows, expert offsets, combined output), CPU."""
    from ditron_ep.ops.ep.buffer import EPBuffer

    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device(backend)
    x, idx, w = (t[rank].to(device) for t in (inputs.xs, inputs.topk_idxs, inputs.topk_weights))
    e_local = inputs.num_experts // world
    max_tokens = max(1, max(t.shape[0] for t in inputs.xs))
    buf = EPBuffer(None, inputs.num_experts, x.shape[1], max_tokens, idx.shape[1], x.dtype, backend=backend)
    runs = []
    try:
        for _ in range(repeats):
            recv_x, handle = buf.dispatch(x, idx, w)
            offsets = handle.expert_offsets.tolist()
            experts = [rank * e_local + i for i in range(e_local) for _ in range(offsets[i + 1] - offsets[i])]
            y = _scaled_rows(recv_x.cpu(), experts, x.dtype).to(device)
            out = buf.combine(y, handle, w)
            runs.append((recv_x.cpu(), offsets, out.cpu()))
    finally:
        buf.free()
    return runs
