"""Registry entries "dispatch", "combine" and "dispatch_combine": `EPBuffer` against `all_to_all_single`.

Per token count T (tokens per rank): tokens and a routing from `ep_inputs.make_inputs`, one
`EPBuffer` sized for T (or for `--opt buffer_tokens=N`, built with the other EPBuffer options),
and the all_to_all_single baseline of the same routing (`alltoall.AllToAll`: NCCL on GPUs, gloo on
emulated ranks; only the exchange of pre-packed rows is timed). Implementations:
  layout              `_launch_layout`: the sender-side layout ops and the counts exchange;
  dispatch kernel     the data kernel of EPBuffer.dispatch alone, the layout computed beforehand;
  EPBuffer.dispatch   the public op (sync=True): layout (replayed from a CUDA graph from a
                      signature's second call, `graph_cache`), host read, allocations, data kernel
                      and the error-slot read (`check_errors`);
  combine kernel      combine's kernel alone, on the rows of one untimed dispatch;
  EPBuffer.dispatch token_major
                      dispatch(layout="token_major"): one row per (token, rank), checked through
                      handle.row_index against the expert-major rows;
  EPBuffer.dispatch fp8 [token_major [dequantize]]
                      (GPUs, bf16, hidden % 128 == 0) an FP8 EPBuffer (dispatch_dtype=float8_e4m3fn)
                      dispatching the tokens quantised in DeepEP's format (e4m3 + fp32 scale per 128
                      columns): e4m3 rows with their scales (both layouts), or dequantised to bf16 on
                      receipt; each also against our bf16 dispatch of its layout;
                      checked against the bf16 rows within e4m3's rounding (work: the bf16 bytes);
  EPBuffer.combine    the public op (the exact combine: one row per (token, k) returns);
  EPBuffer.combine expert_rank [fp32]
                      the rank-reduced combine (topk_sum="expert_rank"): one row per (token, rank)
                      returns, in the token dtype or fp32 (JSON details: rel_err_vs_float64 of every
                      combine row against the float64 oracle of identity experts);
  EPBuffer.combine caller
                      combine(topk_sum="caller") along a token-major dispatch: y is one row per
                      (token, rank), each already its rank's sum — DeepEP's combine input, the same
                      bytes; checked against x times the ranks the token reached (identity experts);
  DeepEP ...          (GPUs, eager) DeepEP v1's layout+dispatch and combine when deep_ep imports
                      (bench/deepep.py);
  graph: ...          (GPUs only, dispatch_combine's mode "graph") one CUDA graph each, timed as
                      replays: the layout; dispatch(sync=False) (layout + data kernel); combine;
                      dispatch+combine; and dispatch / combine with 0 tokens on every rank (the
                      fixed cost of a cross-rank launch under the timing rule: host skew after the
                      barrier, graph launch, entry barrier, counts exchange); the token-major
                      dispatch, the rank-reduced combine (dtype and fp32 partials), the combine of
                      token rows (topk_sum="caller") and, where the
                      FP8 rows run, the FP8 dispatch (checked bitwise against eager calls).
  HBM copy, peer copy (NVLink), floor: <mode>  (dispatch_combine) the bandwidths measured in the
                      run and each mode's floor from the bytes it must move (bench/ep_floors.py),
                      with the busiest rank's HBM and NVLink bytes; each row is also compared
                      with its mode's floor (graph rows with their eager mode's).
"dispatch" times the two dispatch rows against all_to_all_single, "combine" the two combine rows;
"dispatch_combine" times every row of its modes against the exchange of the same direction
(a2a dispatch, a2a combine, and both in one call for the round trip).
Checks, once per T before timing, on every rank: the layout's received row count equals the
baseline's; dispatch's rows equal the rows the baseline moved, placed in expert-major order, bit
for bit; combine's output (identity experts: y = recv_x) against the baseline's within the dtype's
rtol (max |diff| / max |ref| over every rank); graph replays equal the eager calls bit for bit.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping

import torch

from ditron_ep.bench.alltoall import AllToAll, gather_routing
from ditron_ep.bench.deepep import DEEPEP_COMBINE, DEEPEP_DISPATCH, measure_deepep
from ditron_ep.bench.ep_floors import floor_impls, floor_of, floor_rows
from ditron_ep.bench.ep_inputs import Inputs, make_inputs, ranks_reached, traffic_bytes
from ditron_ep.bench.ranks import Fatal, StageFailed, all_ranks, gather, guarded, relative_errors
from ditron_ep.bench.spec import (BenchContext, Benchmark, BenchRequest, Impl, Measurement, Option, Shape,
                                  boolean, failed, non_negative_int, one_of, positive_int, some_of,
                                  tolerance_check)
from ditron_ep.bench.timing import capture_graph
from ditron_ep.check.tolerances import TOLERANCES
from ditron_ep.ops import EPBuffer
from ditron_ep.ops.ep.buffer import quantize_fp8

BASELINE = "all_to_all_single"
A2A_DISPATCH, A2A_COMBINE, A2A_ROUND_TRIP = "a2a dispatch", "a2a combine", "a2a dispatch+combine"
WORK_RULE = ("bytes = tokens each rank receives from other ranks (one copy per (token, destination rank)) "
             "x hidden x element size, mean over ranks; combine: the same rows in reverse; dispatch+combine: "
             "both. GB/s = bytes / median time (1 GB = 1e9 B); local tokens are not counted. all_to_all_single "
             "moves exactly these bytes. JSON details: bytes_max (busiest rank), wire_bytes (combine returns "
             "one row per (token, k)).")

EP_OPTIONS = (
    Option("num_programs", "programs (SMs) of every EP kernel (default: all SMs)", positive_int),
    Option("block_rows", "EPBuffer block_rows: tokens per chunk (default: the tuner's entry, else 16)", positive_int),
    Option("block_hidden", "EPBuffer block_hidden: columns per copy step (default: the buffer's)", positive_int),
    Option("hidden_slices", "EPBuffer hidden_slices: column slices per chunk (default: the buffer's)",
           positive_int),
    Option("graph_cache", "EPBuffer graph_cache: dispatch signatures whose layout replays from a CUDA graph "
           "(0: off)", non_negative_int, 4),
    Option("check_errors", "EPBuffer check_errors: the public calls read the error slot (a host sync)",
           boolean, True),
    Option("buffer_tokens", "max_tokens_per_rank of the EPBuffer (default: each config's T; one size serves "
           "every T when given)", positive_int),
    Option("heap", "the EPBuffer's symmetric-heap backend on GPUs: torch (CUDA IPC) or nvshmem (nvshmem4py, "
           "the nvshmem extra)", one_of("torch", "nvshmem"), "torch"),
    Option("transport", "EPBuffer transport: pointer (stores through peer pointers) or put (NVSHMEM put-with-signal; "
           "heap=nvshmem)", one_of("pointer", "put"), "pointer"),
)
MODES = ("eager", "graph")
# the rank-reduced combine (topk_sum="expert_rank"), in the token dtype and with fp32 partials
RANK_REDUCED, RANK_REDUCED_FP32 = "EPBuffer.combine expert_rank", "EPBuffer.combine expert_rank fp32"
CALLER = "EPBuffer.combine caller"  # combine(topk_sum="caller") of token rows (DeepEP's combine input)
TOKEN_MAJOR = "EPBuffer.dispatch token_major"  # dispatch(layout="token_major")
TOKEN_MAJOR_KERNEL = "dispatch kernel token_major"
FP8_DISPATCH, FP8_DEQUANT = "EPBuffer.dispatch fp8", "EPBuffer.dispatch fp8 token_major dequantize"
FP8_TOKEN_MAJOR = "EPBuffer.dispatch fp8 token_major"
GRAPHS = ("graph: layout", "graph: dispatch", "graph: combine", "graph: dispatch+combine",
          "graph: dispatch, 0 tokens", "graph: combine, 0 tokens", "graph: dispatch token_major",
          "graph: combine expert_rank", "graph: combine expert_rank fp32", "graph: combine caller")
GRAPH_FP8 = "graph: dispatch fp8"  # on the FP8 buffer (measure_fp8)


# ============================================================================ one T: inputs, baseline, buffer
@dataclass
class EPCase:
    inp: Inputs
    a2a: AllToAll
    buf: EPBuffer
    w32: torch.Tensor                                   # fp32 [T, K] routing weights
    wants: dict[str, torch.Tensor] = field(default_factory=dict)

    def work(self, ctx: BenchContext, kind: str) -> tuple[float | None, dict[str, Any]]:
        """(bytes of one `kind` call by WORK_RULE, the JSON details of its traffic)."""
        by = traffic_bytes(ctx, self.inp, kind, ctx.shape.hidden)
        return by.rule, {"bytes_max": by.rule_max, "wire_bytes": by.wire}

    def want(self, ctx: BenchContext, what: str) -> torch.Tensor:
        """What ours must return, from the baseline's exchanges (run once, untimed): "dispatch"
        the expert-major rows, "combine" the fp32 output."""
        if what not in self.wants:
            def dispatch() -> torch.Tensor:
                self.a2a.dispatch()
                return self.a2a.expected_dispatch()

            def combine() -> torch.Tensor:
                self.a2a.dispatch()
                self.a2a.pack_combine()
                self.a2a.combine()
                return self.a2a.expected_combine()

            self.wants[what] = guarded(ctx, f"{BASELINE} {what} (check)", dispatch if what == "dispatch" else combine)
        return self.wants[what]


def make_buffer(ctx: BenchContext, tokens: int, dispatch_dtype: torch.dtype | None = None) -> EPBuffer:
    """The EPBuffer of one config, from the request's shape and the EP options."""
    s, o = ctx.shape, ctx.options
    return EPBuffer(ctx.group, s.experts, s.hidden, o.get("buffer_tokens") or tokens, s.topk, ctx.dtype,
                    num_programs=o.get("num_programs"), block_rows=o.get("block_rows"),
                    block_hidden=o.get("block_hidden"), hidden_slices=o.get("hidden_slices"),
                    check_errors=o.get("check_errors", True), graph_cache=o.get("graph_cache", 4),
                    dispatch_dtype=dispatch_dtype, backend=o.get("heap", "torch") if ctx.on_cuda else "auto",
                    transport=o.get("transport", "pointer"))


def fp8_applies(hidden: int, dtype: str, on_gpu: bool, options: Mapping[str, Any]) -> bool:
    """Whether the FP8 dispatch rows run: GPUs, bf16 tokens, hidden a multiple of 128, and the
    pointer transport (FP8 dispatch has no put path)."""
    return on_gpu and dtype == "bf16" and hidden % 128 == 0 and options.get("transport") != "put"


def measure_fp8(ctx: BenchContext, case: EPCase, tokens: int, eager: bool = True,
                graph: bool = False) -> list[Measurement]:
    """FP8_DISPATCH and FP8_DEQUANT (eager) on an FP8 EPBuffer of the same shape: the received rows,
    dequantised, against the baseline's bf16 rows (e4m3's rounding: relative error <= 0.07); with
    `graph`, GRAPH_FP8: the FP8 dispatch as CUDA-graph replays, bitwise the eager call's rows and scales."""
    inp = case.inp
    work, details = case.work(ctx, "dispatch")
    want = case.want(ctx, "dispatch").to(torch.float32)
    names = (*((FP8_DISPATCH, FP8_TOKEN_MAJOR, FP8_DEQUANT) if eager else ()), *((GRAPH_FP8,) if graph else ()))
    try:
        buf = guarded(ctx, "FP8 EPBuffer", lambda: make_buffer(ctx, tokens, torch.float8_e4m3fn))
    except StageFailed as exc:
        return failed(names, str(exc), work)
    q, sc = quantize_fp8(inp.x)

    def fp8() -> tuple[torch.Tensor, object]:
        return buf.dispatch(q, inp.idx, inp.w, x_scales=sc)

    def fp8_tok() -> tuple[torch.Tensor, object]:
        return buf.dispatch(q, inp.idx, inp.w, x_scales=sc, layout="token_major")

    def dequant() -> tuple[torch.Tensor, object]:
        return buf.dispatch(q, inp.idx, inp.w, x_scales=sc, dequantize=True, layout="token_major")

    def fp8_rows() -> torch.Tensor:
        r, h = fp8()
        return r.to(torch.float32) * h.recv_scales.repeat_interleave(128, dim=1)

    def fp8_tok_rows() -> torch.Tensor:
        r, h = fp8_tok()
        pick = h.row_index.long()
        return r[pick].to(torch.float32) * h.recv_scales[pick].repeat_interleave(128, dim=1)

    def dequant_rows() -> torch.Tensor:
        r, h = dequant()
        return r[h.row_index.long()].to(torch.float32)

    out = []
    try:
        for impl, fn, rows in ((FP8_DISPATCH, fp8, fp8_rows), (FP8_TOKEN_MAJOR, fp8_tok, fp8_tok_rows),
                               (FP8_DEQUANT, dequant, dequant_rows)) if eager else ():
            try:
                got = guarded(ctx, f"{impl} (check)", rows, buf)
                err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item() if want.numel() else 0.0
                err = max(gather(ctx, err))
                ok = err <= 0.07
                out.append(ctx.measure(impl, fn, work, f"{'ok' if ok else 'FAIL'}: rel err {err:.1e} vs bf16 rows", ok,
                                       buf, {**details, "wire_bytes_note": "e4m3 rows: half the rule's bytes, plus "
                                                                           "4 bytes per 128 columns of scales"}))
            except StageFailed as exc:
                out.append(Measurement(impl, None, work, "", False, error=str(exc)))
        if graph:
            out.append(measure_fp8_graph(ctx, buf, lambda sync: buf.dispatch(q, inp.idx, inp.w, x_scales=sc, sync=sync),
                                         work, details))
    finally:
        buf.free()
    return out


def measure_fp8_graph(ctx: BenchContext, buf: EPBuffer, call: Callable[[bool], Any], work: Any,
                      details: dict) -> Measurement:
    """GRAPH_FP8: call(sync=False) captured once, replayed; its rows and scales bitwise the eager call's."""
    def build() -> tuple[Any, tuple[torch.Tensor, torch.Tensor]]:
        r, h = call(True)
        call(False)   # compiles the graph-mode variant outside the capture
        torch.cuda.synchronize(ctx.device)
        return capture_graph(lambda: call(False)), (r, h.recv_scales)

    def replay_matches(graph: Any, result: Any, want: tuple[torch.Tensor, torch.Tensor]) -> bool:
        graph.replay()
        r, h = result
        n = want[0].shape[0]
        return (int(h.expert_offsets[-1]) == n and torch.equal(r[:n], want[0])
                and torch.equal(h.recv_scales[:n], want[1]))

    try:
        (graph, result), want = guarded(ctx, f"{GRAPH_FP8} capture", build, buf)
        ok = all_ranks(ctx, bool(guarded(ctx, f"{GRAPH_FP8} (check)", lambda: replay_matches(graph, result, want),
                                         buf)))
    except StageFailed as exc:
        return Measurement(GRAPH_FP8, None, work, "", False, error=str(exc))
    text = "ok: bitwise == eager" if ok else "FAIL: differs from the eager call"
    return ctx.measure(GRAPH_FP8, graph.replay, work, text, ok, buf, details)


@contextmanager
def ep_case(ctx: BenchContext, tokens: int) -> Iterator[EPCase]:
    """Inputs, the baseline's exchange plan and an EPBuffer for `tokens`, on every rank; the
    buffer is freed afterwards (unless the group broke)."""
    s, routing = ctx.shape, ctx.request.routing

    def setup() -> tuple[Inputs, AllToAll]:
        inp = make_inputs(ctx, tokens, s.experts, s.topk, s.hidden, routing)
        idx_all, w_all = gather_routing(ctx, inp.idx, inp.w)
        return inp, AllToAll(ctx, inp.x, idx_all, w_all, s.experts)

    inp, a2a = guarded(ctx, "inputs", setup)
    buf = guarded(ctx, "EPBuffer", lambda: make_buffer(ctx, tokens))
    group_ok = True
    try:
        with torch.no_grad():
            yield EPCase(inp, a2a, buf, inp.w.to(torch.float32).contiguous())
    except Fatal:
        group_ok = False
        raise
    finally:
        if group_ok:
            buf.free()


# ============================================================================ eager rows
def layout_rows_check(ctx: BenchContext, case: EPCase, recv: Any) -> tuple[str, bool]:
    """The received row count a layout reports against the baseline's (agreed by all ranks)."""
    rows = case.buf._rows_from_status(recv, None)
    same = all_ranks(ctx, rows == case.inp.rows_received(ctx.rank))
    return ("ok: received rows == the baseline's" if same else "FAIL: received rows differ from the baseline's"), same


def measure_layout(ctx: BenchContext, case: EPCase) -> Measurement:
    def fn() -> object:
        return case.buf._launch_layout(case.inp.idx)

    try:
        check = guarded(ctx, "layout (check)", lambda: layout_rows_check(ctx, case, fn()[1]), case.buf)
    except StageFailed as exc:
        return Measurement("layout", error=str(exc), ok=False)
    return ctx.measure("layout", fn, None, *check, buf=case.buf)


def dispatch_kernel_call(buf: EPBuffer, x: torch.Tensor, idx: torch.Tensor, w32: torch.Tensor,
                         token_major: bool = False) -> tuple[Callable[[], None], Callable[[], torch.Tensor]]:
    """EPBuffer.dispatch's data kernel alone: mirrors `EPBuffer._dispatch_raw` up to the kernel
    (layout, host read, allocations done here, once). Returns the call and a function returning the
    expert-major rows it received (token-major: through the row index)."""
    send, recv = buf._launch_layout(idx)
    rows, tokens, _ = buf._rows_and_tokens(recv, None)
    dev = buf.device
    recv_x = torch.empty((tokens if token_major else rows, buf.hidden), dtype=buf.dtype, device=dev)
    row_index = torch.empty(rows, dtype=torch.int32, device=dev) if token_major else None
    recv_w = torch.empty(rows, dtype=torch.float32, device=dev)
    recv_rows = torch.empty((buf.world_size, buf.max_tokens, buf.topk), dtype=torch.int32, device=dev)
    recv_tok = torch.empty((buf.world_size, buf.max_tokens), dtype=torch.int32, device=dev)
    # replayed without its layout: the kernel keeps its entry barrier
    return (lambda: buf._launch_dispatch(x, w32, send, recv, rows, False, recv_x, recv_w, recv_rows,
                                         recv_tok, after_layout=False, row_index=row_index)), \
        (lambda: recv_x if row_index is None else recv_x[row_index.long()])


def measure_dispatch(ctx: BenchContext, case: EPCase, baseline: str) -> list[Measurement]:
    """"dispatch kernel" and "EPBuffer.dispatch", checked bit for bit against `baseline`'s rows."""
    inp, buf = case.inp, case.buf
    work, details = case.work(ctx, "dispatch")
    want = case.want(ctx, "dispatch")
    kernel, kernel_rows = guarded(ctx, "dispatch kernel setup",
                                  lambda: dispatch_kernel_call(buf, inp.x, inp.idx, case.w32), buf)
    kernel_tm, kernel_tm_rows = guarded(ctx, "dispatch kernel token_major setup",
                                        lambda: dispatch_kernel_call(buf, inp.x, inp.idx, case.w32, True), buf)

    def public() -> tuple[torch.Tensor, object]:
        return buf.dispatch(inp.x, inp.idx, inp.w)

    def token_major() -> tuple[torch.Tensor, object]:
        return buf.dispatch(inp.x, inp.idx, inp.w, layout="token_major")

    def token_major_rows() -> torch.Tensor:  # the expert-major rows through the row index
        tok, handle = token_major()
        return tok[handle.row_index.long()]

    # impl -> (the timed call, one call that returns the rows it received)
    ours: dict[str, tuple[Callable[[], object], Callable[[], torch.Tensor]]] = {
        "dispatch kernel": (kernel, lambda: (kernel(), kernel_rows())[1]),
        "EPBuffer.dispatch": (public, lambda: public()[0]),
        TOKEN_MAJOR_KERNEL: (kernel_tm, lambda: (kernel_tm(), kernel_tm_rows())[1]),
        TOKEN_MAJOR: (token_major, token_major_rows),
    }
    out = []
    for impl, (fn, once) in ours.items():
        try:
            got = guarded(ctx, f"{impl} (check)", once, buf)
            same = all_ranks(ctx, got.shape == want.shape and torch.equal(got, want))
            check = "ok: bit-exact" if same else f"FAIL: rows differ from those {baseline} moved"
            out.append(ctx.measure(impl, fn, work, check, same, buf, details))
        except StageFailed as exc:
            out.append(Measurement(impl, None, work, "", False, error=str(exc)))
    return out


def measure_combine(ctx: BenchContext, case: EPCase) -> tuple[list[Measurement], torch.Tensor | None]:
    """"combine kernel" and "EPBuffer.combine" against the baseline's output within the dtype's
    rtol; also returns EPBuffer.combine's output (None if it failed)."""
    inp, buf = case.inp, case.buf
    work, details = case.work(ctx, "combine")
    want = case.want(ctx, "combine")
    y, handle = guarded(ctx, "dispatch (untimed)", lambda: buf.dispatch(inp.x, inp.idx, inp.w), buf)
    ours: dict[str, Callable[[], torch.Tensor]] = {
        "combine kernel": lambda: buf._launch_combine(y, case.w32, handle),
        "EPBuffer.combine": lambda: buf.combine(y, handle, inp.w),
        RANK_REDUCED: lambda: buf.combine(y, handle, topk_sum="expert_rank"),
        RANK_REDUCED_FP32: lambda: buf.combine(y, handle, topk_sum="expert_rank", partial_dtype=torch.float32),
    }
    # identity experts: out[t] = x[t] * sum of t's routed weights; the error of each mode against it
    routed_w = torch.where(inp.idx >= 0, inp.w.to(torch.float64), 0.0).sum(1)
    oracle = inp.x.to(torch.float64) * routed_w[:, None]
    rtol = TOLERANCES[ctx.dtype][0]
    outs: dict[str, torch.Tensor] = {}
    errors: dict[str, str] = {}
    for impl, fn in ours.items():
        try:
            outs[impl] = guarded(ctx, f"{impl} (check)", fn, buf)
        except StageFailed as exc:
            errors[impl] = str(exc)
    rel = relative_errors(ctx, want, outs)
    out = []
    for impl, fn in ours.items():
        if impl in errors:
            out.append(Measurement(impl, None, work, "", False, error=errors[impl]))
            continue
        err = ((outs[impl].to(torch.float64) - oracle).abs().max() / oracle.abs().max().clamp_min(1e-300)).item() \
            if oracle.numel() else 0.0
        err = max(gather(ctx, err))
        out.append(ctx.measure(impl, fn, work, *tolerance_check(rel[impl], rtol), buf=buf,
                               details={**details, "rel_err_vs_float64": err}))
    return out, outs.get("EPBuffer.combine")


def measure_caller_combine(ctx: BenchContext, case: EPCase) -> Measurement:
    """CALLER: combine(topk_sum="caller") of the token-major rows as they arrived (identity
    experts, each rank's row already its sum): out[t] = x[t] * the ranks t reached."""
    inp, buf = case.inp, case.buf
    work, details = case.work(ctx, "combine")
    try:
        y, handle = guarded(ctx, "token-major dispatch (untimed)",
                            lambda: buf.dispatch(inp.x, inp.idx, inp.w, layout="token_major"), buf)
        fn = lambda: buf.combine(y, handle, topk_sum="caller")  # noqa: E731
        got = guarded(ctx, f"{CALLER} (check)", fn, buf)
    except StageFailed as exc:
        return Measurement(CALLER, None, work, "", False, error=str(exc))
    oracle = inp.x.to(torch.float64) * ranks_reached(inp.idx, ctx.shape.experts, ctx.world).to(torch.float64)[:, None]
    rel = relative_errors(ctx, oracle, {CALLER: got})[CALLER]
    return ctx.measure(CALLER, fn, work, *tolerance_check(rel, TOLERANCES[ctx.dtype][0]), buf=buf,
                       details={**details, "rel_err_vs_float64": rel})


def measure_a2a(ctx: BenchContext, case: EPCase, impl: str, kind: str) -> Measurement:
    """The baseline's exchange of `kind`: "dispatch", "combine" or "roundtrip" (both in one call)."""
    a2a = case.a2a
    case.want(ctx, "combine")   # the rows combine sends back are packed (untimed)
    fns: dict[str, Callable[[], object]] = {
        "dispatch": a2a.dispatch, "combine": a2a.combine, "roundtrip": lambda: (a2a.dispatch(), a2a.combine())}
    work, details = case.work(ctx, kind)
    return ctx.measure(impl, fns[kind], work, "reference", True, details=details)


# ============================================================================ graph rows
def measure_graphs(ctx: BenchContext, case: EPCase) -> list[Measurement]:
    """The GRAPHS rows: each call captured once in a CUDA graph, replayed once to check it, then
    timed as replays (after the same warm-up as every row)."""
    buf, inp = case.buf, case.inp
    x, idx, w = inp.x, inp.idx, inp.w
    x0, idx0, w0 = x[:0], idx[:0], w[:0]
    graphs: dict[str, tuple[torch.cuda.CUDAGraph, Any]] = {}
    eager: dict[str, torch.Tensor] = {}

    def build() -> None:
        recv, handle = buf.dispatch(x, idx, w)
        eager["roundtrip"] = buf.combine(recv, handle, w)   # what every graph must reproduce bit for bit
        for xs, ids, ws in ((x, idx, w), (x0, idx0, w0)):   # eager warm-up compiles the graph-mode variants
            r, h = buf.dispatch(xs, ids, ws, sync=False)
            buf.combine(r, h, ws)
        torch.cuda.synchronize(ctx.device)
        graphs["graph: layout"] = capture_graph(lambda: buf._launch_layout(idx))
        graphs["graph: dispatch"] = capture_graph(lambda: buf.dispatch(x, idx, w, sync=False))
        recv_g, h_g = graphs["graph: dispatch"][1]
        graphs["graph: combine"] = capture_graph(lambda: buf.combine(recv_g, h_g, w))

        def both() -> torch.Tensor:
            r2, h2 = buf.dispatch(x, idx, w, sync=False)
            return buf.combine(r2, h2, w)

        graphs["graph: dispatch+combine"] = capture_graph(both)
        graphs["graph: dispatch, 0 tokens"] = capture_graph(lambda: buf.dispatch(x0, idx0, w0, sync=False))
        recv_0, h_0 = graphs["graph: dispatch, 0 tokens"][1]
        graphs["graph: combine, 0 tokens"] = capture_graph(lambda: buf.combine(recv_0, h_0, w0))
        # the new layouts as graphs: token-major rows; the rank-reduced combine of the graph's rows
        tok, h_tm = buf.dispatch(x, idx, w, layout="token_major")
        eager["token_major"] = tok
        r3, h3 = buf.dispatch(x, idx, w, sync=False)
        eager["expert_rank"] = buf.combine(r3, h3, topk_sum="expert_rank")
        eager["expert_rank_fp32"] = buf.combine(r3, h3, topk_sum="expert_rank", partial_dtype=torch.float32)
        buf.dispatch(x, idx, w, sync=False, layout="token_major")   # compiles the graph-mode variant
        torch.cuda.synchronize(ctx.device)
        graphs["graph: dispatch token_major"] = capture_graph(
            lambda: buf.dispatch(x, idx, w, sync=False, layout="token_major"))
        graphs["graph: combine expert_rank"] = capture_graph(lambda: buf.combine(recv_g, h_g, topk_sum="expert_rank"))
        graphs["graph: combine expert_rank fp32"] = capture_graph(
            lambda: buf.combine(recv_g, h_g, topk_sum="expert_rank", partial_dtype=torch.float32))
        # token rows as they arrived (identity experts), through a token-major graph's handle
        tok_g, h_tok = graphs["graph: dispatch token_major"][1]
        eager["caller"] = buf.combine(tok, h_tm, topk_sum="caller")
        graphs["graph: combine caller"] = capture_graph(lambda: buf.combine(tok_g, h_tok, topk_sum="caller"))

    def dispatched(out: Any, want: torch.Tensor) -> bool:
        recv, handle = out
        rows = int(handle.expert_offsets[-1])
        return rows == want.shape[0] and torch.equal(recv[:rows], want)

    want = case.want(ctx, "dispatch")
    rows = ("ok: received rows == the baseline's", "FAIL: received rows differ from the baseline's")
    bitwise = ("ok: bitwise == eager", "FAIL: differs from the eager call")
    # name -> (kind of traffic or None, (check text if ok, if not), whether one replay's output passes)
    checks: dict[str, tuple[str | None, tuple[str, str], Callable[[Any], bool]]] = {
        "graph: layout": (None, rows, lambda out: buf._rows_from_status(out[1], None) == inp.rows_received(ctx.rank)),
        "graph: dispatch": ("dispatch", ("ok: bit-exact", "FAIL: rows differ from those the baseline moved"),
                            lambda out: dispatched(out, want)),
        "graph: combine": ("combine", bitwise, lambda out: torch.equal(out, eager["roundtrip"])),
        "graph: dispatch+combine": ("roundtrip", bitwise, lambda out: torch.equal(out, eager["roundtrip"])),
        "graph: dispatch, 0 tokens": (None, ("ok: 0 rows", "FAIL: rows received"),
                                      lambda out: int(out[1].expert_offsets[-1]) == 0),
        "graph: combine, 0 tokens": (None, ("ok: 0 tokens out", "FAIL: tokens out"),
                                     lambda out: out.shape == (0, x.shape[1])),
        "graph: dispatch token_major": ("dispatch", bitwise, lambda out: torch.equal(
            out[0][:eager["token_major"].shape[0]], eager["token_major"])),
        "graph: combine expert_rank": ("combine", bitwise, lambda out: torch.equal(out, eager["expert_rank"])),
        "graph: combine expert_rank fp32": ("combine", bitwise,
                                            lambda out: torch.equal(out, eager["expert_rank_fp32"])),
        "graph: combine caller": ("combine", bitwise, lambda out: torch.equal(out, eager["caller"])),
    }
    try:
        guarded(ctx, "graph capture", build, buf)
    except StageFailed as exc:
        return failed(GRAPHS, str(exc))
    done: dict[str, Measurement] = {}
    try:
        for name in GRAPHS:
            kind, texts, passes = checks[name]
            work, details = case.work(ctx, kind) if kind else (None, {})
            if name.startswith("graph: combine") and "0 tokens" not in name and not done["graph: dispatch"].ok:
                # The combine graph reads the dispatch graph's outputs: only valid after a good replay.
                done[name] = Measurement(name, work=work, ok=False,
                                         error="not run: the dispatch graph it reads from failed")
                continue
            graph, result = graphs[name]
            try:
                mine = guarded(ctx, f"{name} (check)", lambda: (graph.replay(), passes(result))[1], buf)
            except StageFailed as exc:
                done[name] = Measurement(name, work=work, ok=False, error=str(exc))
                continue
            ok = all_ranks(ctx, bool(mine))
            done[name] = ctx.measure(name, graph.replay, work, texts[0] if ok else texts[1], ok, buf, details)
    finally:
        graphs.clear()
    return list(done.values())


# ============================================================================ the entries
def run_dispatch(ctx: BenchContext, tokens: int) -> list[Measurement]:
    with ep_case(ctx, tokens) as case:
        out = measure_dispatch(ctx, case, BASELINE)
        return [*out, measure_a2a(ctx, case, BASELINE, "dispatch")]


def run_combine(ctx: BenchContext, tokens: int) -> list[Measurement]:
    with ep_case(ctx, tokens) as case:
        out, _ = measure_combine(ctx, case)
        return [*out, measure_a2a(ctx, case, BASELINE, "combine")]


def run_dispatch_combine(ctx: BenchContext, tokens: int) -> list[Measurement]:
    modes = ctx.options["mode"]
    with ep_case(ctx, tokens) as case:
        out = []
        if "eager" in modes:
            out += [measure_layout(ctx, case), *measure_dispatch(ctx, case, A2A_DISPATCH)]
            if fp8_applies(ctx.shape.hidden, ctx.request.dtype, ctx.on_cuda, ctx.options):
                out += measure_fp8(ctx, case, tokens, graph="graph" in modes and ctx.on_cuda)
            out += [*measure_combine(ctx, case)[0], measure_caller_combine(ctx, case)]
            if ctx.on_cuda:
                out += measure_deepep(ctx, case.inp, ctx.shape.experts, ctx.shape.hidden,
                                      {k: case.work(ctx, k) for k in ("dispatch", "combine")})
        if "graph" in modes and ctx.on_cuda:
            out += measure_graphs(ctx, case)
            if "eager" not in modes and fp8_applies(ctx.shape.hidden, ctx.request.dtype, ctx.on_cuda, ctx.options):
                out += measure_fp8(ctx, case, tokens, eager=False, graph=True)
        out += floor_rows(ctx, [tokens] * ctx.world, case.inp.tokens_sent, case.inp.pairs_sent,
                          lambda kind: case.work(ctx, kind),
                          fp8_applies(ctx.shape.hidden, ctx.request.dtype, ctx.on_cuda, ctx.options))
        return [*out, *(measure_a2a(ctx, case, name, kind) for name, kind in
                        ((A2A_DISPATCH, "dispatch"), (A2A_COMBINE, "combine"), (A2A_ROUND_TRIP, "roundtrip")))]


def _plan(*ours: Impl, baselines: tuple[str, ...]) -> tuple[Impl, ...]:
    return (*ours, *(Impl(b, "baseline") for b in baselines))


def plan_dispatch(req: BenchRequest, tokens: int, options: Mapping[str, Any], on_gpu: bool) -> tuple[Impl, ...]:
    return _plan(*(Impl(n, against=(BASELINE,)) for n in ("dispatch kernel", "EPBuffer.dispatch", TOKEN_MAJOR_KERNEL,
                                                         TOKEN_MAJOR)),
                 baselines=(BASELINE,))


def plan_combine(req: BenchRequest, tokens: int, options: Mapping[str, Any], on_gpu: bool) -> tuple[Impl, ...]:
    return _plan(*(Impl(n, against=(BASELINE,)) for n in ("combine kernel", "EPBuffer.combine", RANK_REDUCED,
                                                         RANK_REDUCED_FP32)),
                 baselines=(BASELINE,))


def plan_dispatch_combine(req: BenchRequest, tokens: int, options: Mapping[str, Any],
                          on_gpu: bool) -> tuple[Impl, ...]:
    d, c, rt = (A2A_DISPATCH,), (A2A_COMBINE,), (A2A_ROUND_TRIP,)
    eager = "eager" in options["mode"]
    deepep = (DEEPEP_DISPATCH, DEEPEP_COMBINE) if eager and on_gpu else ()
    ours: list[Impl] = []
    if eager:
        ours += [Impl("layout"), Impl("dispatch kernel", against=d),
                 Impl("EPBuffer.dispatch", against=(*d, *deepep[:1])), Impl(TOKEN_MAJOR_KERNEL, against=d),
                 Impl(TOKEN_MAJOR, against=(*d, *deepep[:1])),
                 # FP8 against our bf16 dispatch of the same layout too (the FP8 target)
                 *((Impl(FP8_DISPATCH, against=(*d, "EPBuffer.dispatch")),
                    Impl(FP8_TOKEN_MAJOR, against=(*d, TOKEN_MAJOR)), Impl(FP8_DEQUANT, against=(*d, TOKEN_MAJOR)))
                   if fp8_applies(req.shape.hidden, req.dtype, on_gpu, options) else ()),
                 Impl("combine kernel", against=c), Impl("EPBuffer.combine", against=(*c, *deepep[1:])),
                 Impl(RANK_REDUCED, against=(*c, *deepep[1:])), Impl(RANK_REDUCED_FP32, against=(*c, *deepep[1:])),
                 Impl(CALLER, against=(*c, *deepep[1:]))]
    if "graph" in options["mode"] and on_gpu:
        ours += [Impl("graph: layout"), Impl("graph: dispatch", against=d), Impl("graph: combine", against=c),
                 Impl("graph: dispatch+combine", against=rt), Impl("graph: dispatch, 0 tokens"),
                 Impl("graph: combine, 0 tokens"), Impl("graph: dispatch token_major", against=d),
                 Impl("graph: combine expert_rank", against=c), Impl("graph: combine expert_rank fp32", against=c),
                 Impl("graph: combine caller", against=c),
                 *((Impl(GRAPH_FP8, against=d),) if fp8_applies(req.shape.hidden, req.dtype, on_gpu, options) else ())]
    # each mode also against its floor (ep_floors: the bytes it must move at the measured bandwidths)
    fp8 = fp8_applies(req.shape.hidden, req.dtype, on_gpu, options)
    ours = [replace(i, against=(*i.against, f)) if i.against and (f := floor_of(i.name, fp8)) else i
            for i in ours]
    return (*_plan(*ours, baselines=(*d, *c, *rt, *deepep)), *floor_impls(fp8))


def validate_ep(req: BenchRequest, options: Mapping[str, Any], world_size: int) -> str | None:
    if options.get("transport") == "put" and options.get("heap") != "nvshmem":
        return "--opt transport=put (NVSHMEM put-with-signal) needs --opt heap=nvshmem"
    cap = options.get("buffer_tokens")
    if cap is not None and cap < max(req.tokens):
        return f"--opt buffer_tokens={cap} is below the largest --tokens {max(req.tokens)}"
    return None


_SHAPES = {"emulated": Shape(hidden=64, experts=8, topk=2), "torch": Shape(hidden=7168, experts=256, topk=8)}
_TOKENS = {"emulated": (8, 32), "torch": (128, 4096)}
_DTYPES = {"emulated": ("fp32", "bf16", "fp16"), "torch": ("bf16", "fp16", "fp32")}
_COMMON = dict(metric="GB/s", work_rule=WORK_RULE, shapes=_SHAPES, tokens=_TOKENS, dtypes=_DTYPES,
               options=EP_OPTIONS, validate=validate_ep)

DISPATCH = Benchmark(
    name="dispatch",
    description="EP dispatch: every token to the ranks of its top-k experts, expert-major rows "
                "ordered by (source rank, token)",
    check_rule=f"received rows == the rows {BASELINE} moved, placed in expert-major order, bit for bit",
    plan=plan_dispatch, run=run_dispatch, **_COMMON)

COMBINE = Benchmark(
    name="combine",
    description="EP combine: expert outputs back to their tokens, out[t] = sum_k w[t,k] * y(t,k) "
                "in fixed k order (fp32)",
    check_rule=f"output (identity experts) vs {BASELINE}'s (rows pre-reduced per rank): max |diff| / "
               f"max |ref| over every rank within the dtype's rtol",
    plan=plan_combine, run=run_combine, **_COMMON)

DISPATCH_COMBINE = Benchmark(
    name="dispatch_combine",
    description="EP dispatch and combine stage by stage, eager and as CUDA-graph replays (GPUs), with the "
                "0-token fixed cost, against all_to_all_single of the same direction",
    check_rule="layout: received row count == the baseline's; dispatch: rows == the rows the baseline moved, "
               "bit for bit; combine: vs the baseline's output within the dtype's rtol; graph replays == the "
               "eager calls bit for bit",
    plan=plan_dispatch_combine, run=run_dispatch_combine, default=False,
    **{**_COMMON, "options": (Option("mode", "eager, graph or eager,graph (graph rows on GPUs only)",
                                     some_of(*MODES), MODES), *EP_OPTIONS)})
