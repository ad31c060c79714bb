"""What the ranks of a benchmark share: their context, and agreement on failures and checks.

Benchmarks run the same steps on every rank, and every step ends in collectives. So a step that
fails on one rank must fail on all of them together (`guarded` -> `StageFailed` everywhere) and a
result check must reach one verdict on all of them (`all_ranks`, `relative_errors`); otherwise
one rank would go on to a collective the others never join. `Fatal` means the process group
itself broke: nothing collective can follow.
"""
from __future__ import annotations

import math
import sys
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from ditron_ep.ops import EPBuffer


@dataclass(kw_only=True)
class RankContext:
    """This rank's place in the benchmark's process group, and its device and dtype."""
    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype
    seed: int = 0
    group: dist.ProcessGroup | None = None   # None: the default group

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def elt(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def coll_tensor(self, values: list[float], dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """A tensor on the device the process group's collectives need (NCCL: GPU, gloo: CPU)."""
        return torch.tensor(values, dtype=dtype, device=self.device if self.on_cuda else "cpu")


class StageFailed(Exception):
    """A stage failed on at least one rank; every rank raises it together."""


class Fatal(Exception):
    """The ranks can no longer agree (a collective failed): stop the run."""


def agree(ctx: RankContext, err: str | None) -> None:
    """Collective: raise StageFailed on every rank if `err` is set on any rank."""
    try:
        flag = ctx.coll_tensor([1.0 if err else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.group)
        if flag.item() == 0:
            return
        msgs: list[Any] = [None] * ctx.world
        dist.all_gather_object(msgs, err, group=ctx.group)
    except Exception as exc:  # the group itself is broken: nothing collective can follow
        raise Fatal(f"collective failed while agreeing on a stage result: {type(exc).__name__}: {exc}") from exc
    raise StageFailed("; ".join(f"rank {r}: {m}" for r, m in enumerate(msgs) if m))


def guarded(ctx: RankContext, what: str, body: Callable[[], Any], buf: "EPBuffer | None" = None) -> Any:
    """Run `body` on every rank; if it failed anywhere, reset the heap and raise StageFailed everywhere."""
    err, out = None, None
    try:
        out = body()
    except Exception as exc:  # noqa: BLE001 - recorded, agreed on, and re-raised as StageFailed
        err = f"{what}: {type(exc).__name__}: {str(exc)[:400]}"
        print(f"[rank {ctx.rank}] {what} failed:\n{traceback.format_exc(limit=6)}", file=sys.stderr, flush=True)
    try:
        agree(ctx, err)
    except StageFailed:
        if buf is not None:
            reset_heap(buf)
        raise
    return out


def checked_runs(ctx: RankContext, steps: Mapping[str, Callable[[], Any]], errors: dict[str, str]) -> dict[str, Any]:
    """impl -> its step's result, each run once on every rank (`guarded`, "<impl> (check)"), skipping
    the impls already in `errors`; a step that fails on any rank is recorded in `errors` instead."""
    results: dict[str, Any] = {}
    for impl, fn in steps.items():
        if impl in errors:
            continue
        try:
            results[impl] = guarded(ctx, f"{impl} (check)", fn)
        except StageFailed as exc:
            errors[impl] = str(exc)
    return results


def reset_heap(buf: "EPBuffer") -> None:
    """After a failed stage: clear signals, error slot and epochs on every rank (collective)."""
    try:
        buf.heap.reset()
        buf._pending_flags.zero_()
    except Exception as exc:
        raise Fatal(f"heap reset after a failed stage failed: {type(exc).__name__}: {exc}") from exc


def all_ranks(ctx: RankContext, flag: bool) -> bool:
    """Collective: whether `flag` holds on every rank."""
    t = ctx.coll_tensor([0.0 if flag else 1.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    return t.item() == 0


def relative_errors(ctx: RankContext, ref: torch.Tensor, outs: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Collective: max |out - ref| over every rank / max |ref| over every rank, per output.

    NaN or inf anywhere gives inf (never a pass against a tolerance).
    """
    ref32 = ref.float()
    names = list(outs)
    mine = [ref32.abs().max().item() if ref32.numel() else 0.0]
    mine += [(outs[n].float() - ref32).abs().max().item() if ref32.numel() else 0.0 for n in names]
    # NaN as inf: a MAX reduction may drop NaN, it never drops inf.
    vec = ctx.coll_tensor([v if math.isfinite(v) else math.inf for v in mine])
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=ctx.group)
    scale = max(vec[0].item(), 1e-30)
    return {n: v / scale for n, v in zip(names, vec[1:].tolist())}


def gather(ctx: RankContext, obj: Any) -> list[Any]:
    """Collective: every rank's picklable `obj`, in rank order."""
    out: list[Any] = [None] * ctx.world
    dist.all_gather_object(out, obj, group=ctx.group)
    return out
