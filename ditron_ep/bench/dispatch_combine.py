"""Registry entries "dispatch" and "combine": `EPBuffer` against `all_to_all_single`.

Per token count T (tokens per rank): tokens and a uniform routing from `ep_inputs.make_inputs`,
one `EPBuffer` sized for T, and the all_to_all_single baseline of the same routing
(`alltoall.AllToAll`: NCCL on GPUs, gloo on emulated ranks). Implementations:
  dispatch kernel     the data kernel of EPBuffer.dispatch alone, the layout computed beforehand;
  EPBuffer.dispatch   the public op (sync=True): layout, host read, allocations, data kernel and
                      the error-slot read;
  combine kernel      combine's kernel alone, on the rows of one untimed dispatch;
  EPBuffer.combine    the public op;
  all_to_all_single   the baseline's exchange of pre-packed rows (packing not timed).
Check, once per T before timing, on every rank: dispatch's rows equal the rows the baseline moved,
placed in expert-major order, bit for bit; combine's output (identity experts: y = recv_x) against
the baseline's within the dtype's rtol (max |diff| / max |ref| over every rank).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ditron_ep.bench.alltoall import AllToAll, gather_routing
from ditron_ep.bench.ep_inputs import Inputs, make_inputs, traffic_bytes
from ditron_ep.bench.ranks import Fatal, StageFailed, all_ranks, guarded, relative_errors
from ditron_ep.bench.spec import BenchContext, Benchmark, Measurement, Shape, tolerance_check
from ditron_ep.check.tolerances import TOLERANCES
from ditron_ep.ops import EPBuffer

BASELINE = "all_to_all_single"
WORK_RULE = ("bytes = tokens each rank receives from other ranks (one copy per (token, destination rank)) "
             "x hidden x element size, mean over ranks; combine: the same rows in reverse. GB/s = bytes / "
             "median time (1 GB = 1e9 B); local tokens are not counted. all_to_all_single moves exactly "
             "these bytes.")


def dispatch_kernel_call(buf: EPBuffer, x: torch.Tensor, idx: torch.Tensor,
                         w32: torch.Tensor) -> tuple[Callable[[], None], torch.Tensor]:
    """EPBuffer.dispatch's data kernel alone: mirrors `EPBuffer._dispatch_raw` up to the kernel
    (layout, host read, allocations done here, once). Returns the call and the recv_x it fills."""
    send, recv = buf._launch_layout(idx)
    rows = buf._rows_from_status(recv, None)
    dev = buf.device
    recv_x = torch.empty((rows, buf.hidden), dtype=buf.dtype, device=dev)
    recv_w = torch.empty(rows, dtype=torch.float32, device=dev)
    recv_rows = torch.empty((buf.world_size, buf.max_tokens, buf.topk), dtype=torch.int32, device=dev)
    recv_tok = torch.empty((buf.world_size, buf.max_tokens), dtype=torch.int32, device=dev)
    # replayed without its layout: the kernel keeps its entry barrier
    return (lambda: buf._launch_dispatch(x, w32, send, recv, rows, False, recv_x, recv_w, recv_rows,
                                         recv_tok, after_layout=False)), recv_x


@dataclass
class EPCase:
    inp: Inputs
    a2a: AllToAll
    buf: EPBuffer
    bytes: float | None   # of one dispatch (or combine) by WORK_RULE


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
    buf = guarded(ctx, "EPBuffer", lambda: EPBuffer(ctx.group, s.experts, s.hidden, tokens, s.topk, ctx.dtype))
    group_ok = True
    try:
        yield EPCase(inp, a2a, buf, traffic_bytes(ctx, inp, "dispatch", s.hidden).rule)
    except Fatal:
        group_ok = False
        raise
    finally:
        if group_ok:
            buf.free()


def run_dispatch(ctx: BenchContext, tokens: int) -> list[Measurement]:
    with ep_case(ctx, tokens) as case, torch.no_grad():
        inp, a2a, buf = case.inp, case.a2a, case.buf
        w32 = inp.w.to(torch.float32).contiguous()
        guarded(ctx, f"{BASELINE} (check)", a2a.dispatch)
        want = a2a.expected_dispatch()
        kernel, kernel_rows = guarded(ctx, "dispatch kernel setup",
                                      lambda: dispatch_kernel_call(buf, inp.x, inp.idx, w32), buf)

        def kernel_once() -> torch.Tensor:
            kernel()
            return kernel_rows

        def public() -> tuple[torch.Tensor, object]:
            return buf.dispatch(inp.x, inp.idx, inp.w)

        # impl -> (the timed call, one call that returns the rows it received)
        ours: dict[str, tuple[Callable[[], object], Callable[[], torch.Tensor]]] = {
            "dispatch kernel": (kernel, kernel_once),
            "EPBuffer.dispatch": (public, lambda: public()[0]),
        }
        out = []
        for impl, (fn, once) in ours.items():
            try:
                got = guarded(ctx, f"{impl} (check)", once, buf)
                same = all_ranks(ctx, got.shape == want.shape and torch.equal(got, want))
                check = "ok: bit-exact" if same else f"FAIL: rows differ from those {BASELINE} moved"
                out.append(ctx.measure(impl, fn, case.bytes, check, same, buf))
            except StageFailed as exc:
                out.append(Measurement(impl, None, case.bytes, "", False, error=str(exc)))
        out.append(ctx.measure(BASELINE, a2a.dispatch, case.bytes, "reference", True))
        return out


def run_combine(ctx: BenchContext, tokens: int) -> list[Measurement]:
    with ep_case(ctx, tokens) as case, torch.no_grad():
        inp, a2a, buf = case.inp, case.a2a, case.buf
        w32 = inp.w.to(torch.float32).contiguous()

        def baseline_once() -> torch.Tensor:
            a2a.dispatch()
            a2a.pack_combine()
            a2a.combine()
            return a2a.expected_combine()

        want = guarded(ctx, f"{BASELINE} (check)", baseline_once)
        y, handle = guarded(ctx, "dispatch (untimed)", lambda: buf.dispatch(inp.x, inp.idx, inp.w), buf)
        ours: dict[str, Callable[[], torch.Tensor]] = {
            "combine kernel": lambda: buf._launch_combine(y, w32, handle),
            "EPBuffer.combine": lambda: buf.combine(y, handle, inp.w),
        }
        rtol = TOLERANCES[ctx.dtype][0]
        outs: dict[str, torch.Tensor] = {}
        failed: dict[str, str] = {}
        for impl, fn in ours.items():
            try:
                outs[impl] = guarded(ctx, f"{impl} (check)", fn, buf)
            except StageFailed as exc:
                failed[impl] = str(exc)
        rel = relative_errors(ctx, want, outs)
        out = []
        for impl, fn in ours.items():
            if impl in failed:
                out.append(Measurement(impl, None, case.bytes, "", False, error=failed[impl]))
                continue
            out.append(ctx.measure(impl, fn, case.bytes, *tolerance_check(rel[impl], rtol), buf=buf))
        out.append(ctx.measure(BASELINE, a2a.combine, case.bytes, "reference", True))
        return out


_SHAPES = {"emulated": Shape(hidden=64, experts=8, topk=2), "torch": Shape(hidden=7168, experts=256, topk=8)}
_TOKENS = {"emulated": (8, 32), "torch": (128, 4096)}
_DTYPES = {"emulated": ("fp32", "bf16", "fp16"), "torch": ("bf16", "fp16", "fp32")}

DISPATCH = Benchmark(
    name="dispatch",
    description="EP dispatch: every token to the ranks of its top-k experts, expert-major rows "
                "ordered by (source rank, token)",
    ours=("dispatch kernel", "EPBuffer.dispatch"), baselines=(BASELINE,), metric="GB/s", work_rule=WORK_RULE,
    check_rule=f"received rows == the rows {BASELINE} moved, placed in expert-major order, bit for bit",
    shapes=_SHAPES, tokens=_TOKENS, run=run_dispatch, dtypes=_DTYPES)

COMBINE = Benchmark(
    name="combine",
    description="EP combine: expert outputs back to their tokens, out[t] = sum_k w[t,k] * y(t,k) "
                "in fixed k order (fp32)",
    ours=("combine kernel", "EPBuffer.combine"), baselines=(BASELINE,), metric="GB/s", work_rule=WORK_RULE,
    check_rule=f"output (identity experts) vs {BASELINE}'s (rows pre-reduced per rank): max |diff| / "
               f"max |ref| over every rank within the dtype's rtol",
    shapes=_SHAPES, tokens=_TOKENS, run=run_combine, dtypes=_DTYPES)
