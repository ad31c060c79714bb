"""Floors of the EP dispatch and combine rows (registry entry "dispatch_combine"): the least time
any implementation needs for the bytes a mode must move, at bandwidths measured in the same run.

    floor = max over ranks of max(HBM bytes of the rank / HBM bandwidth,
                                  NVLink bytes of the rank / peer-copy bandwidth)

Bandwidths: `HBM copy` — a device-to-device copy on each rank (bytes read + written / time);
`peer copy` — every rank at once copying into the next rank's memory through its peer mapping
(GPUs: torch symmetric memory's view of the peer's allocation, a copy-engine copy over NVLink;
bytes / time, one direction — every rank also receives as much).

Bytes of one call, per rank r, with T_r its tokens, tok[s][d] the tokens rank s sends to rank d
(one per (token, destination rank)), pairs[s][d] its (token, k) pairs to rank d, and a row of
b = H x element size bytes (FP8: H + 4 H / 128, the e4m3 row and its fp32 scales):
  dispatch           HBM: T_r rows read + the rows landing in r (expert-major: Σ_s pairs[s][r];
                     token-major: Σ_s tok[s][r]); NVLink: max(out, in) of the tokens crossing
                     (Σ_{d≠r} tok[r][d], Σ_{s≠r} tok[s][r]) — one crossing per (token, rank), the
                     copies per expert made where they land;
  combine (exact)    HBM: the expert rows r holds (Σ_s pairs[s][r]) read + T_r output rows written;
                     NVLink: max(out, in) of the pairs crossing (each (token, k) term reaches its
                     token's rank, which adds them in k order);
  combine, rank-reduced (topk_sum="expert_rank")  HBM as exact; NVLink: the (token, rank) rows
                     crossing, in the token dtype or fp32 (partial_dtype=torch.float32);
  combine of token rows (topk_sum="caller")  HBM: the (token, rank) rows r holds (Σ_s tok[s][r])
                     read + T_r output rows written; NVLink as rank-reduced.
A floor is a bound, not a schedule: it counts each byte once, where every real kernel reads or
writes some twice (a landing buffer, a local copy).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ditron_ep.bench.ranks import StageFailed, guarded
from ditron_ep.bench.spec import BenchContext, Impl, Measurement, failed, measure_bandwidth

HBM_COPY, PEER_COPY = "HBM copy", "peer copy (NVLink)"


@dataclass(frozen=True)
class FloorMode:
    row: str            # the floor row's name
    of: str             # the row it is the floor of
    kind: str           # "dispatch" | "combine": the traffic rule of case.work
    landing: str        # dispatch: "pairs" | "tok" landing rows; combine: what crosses ("pairs" | "tok")
    row_bytes: Callable[[int, int], float]   # (hidden, element size) -> bytes of one crossing row
    reads: str = "pairs"  # combine: the expert-side rows read, one per (token, k) or per (token, rank) ("tok")


def _plain(h: int, elt: int) -> float:
    return float(h * elt)


def _fp8(h: int, elt: int) -> float:
    return float(h + 4 * (h // 128))


def _fp32(h: int, elt: int) -> float:
    return float(4 * h)


DISPATCH_FLOOR = FloorMode("floor: dispatch", "EPBuffer.dispatch", "dispatch", "pairs", _plain)
TOKEN_MAJOR_FLOOR = FloorMode("floor: dispatch token_major", "EPBuffer.dispatch token_major", "dispatch", "tok",
                              _plain)
FP8_FLOOR = FloorMode("floor: dispatch fp8", "EPBuffer.dispatch fp8", "dispatch", "pairs", _fp8)
FP8_TOKEN_MAJOR_FLOOR = FloorMode("floor: dispatch fp8 token_major", "EPBuffer.dispatch fp8 token_major", "dispatch",
                                  "tok", _fp8)
COMBINE_FLOOR = FloorMode("floor: combine", "EPBuffer.combine", "combine", "pairs", _plain)
RANK_REDUCED_FLOOR = FloorMode("floor: combine expert_rank", "EPBuffer.combine expert_rank", "combine", "tok",
                               _plain)
RANK_REDUCED_FP32_FLOOR = FloorMode("floor: combine expert_rank fp32", "EPBuffer.combine expert_rank fp32",
                                    "combine", "tok", _fp32)
CALLER_FLOOR = FloorMode("floor: combine caller", "EPBuffer.combine caller", "combine", "tok", _plain, reads="tok")


def floor_modes(fp8: bool) -> tuple[FloorMode, ...]:
    return (DISPATCH_FLOOR, TOKEN_MAJOR_FLOOR, *((FP8_FLOOR, FP8_TOKEN_MAJOR_FLOOR) if fp8 else ()), COMBINE_FLOOR,
            RANK_REDUCED_FLOOR, RANK_REDUCED_FP32_FLOOR, CALLER_FLOOR)


def floor_of(row: str, fp8: bool = True) -> str | None:
    """The floor row of a timed row (graph rows share their eager mode's floor), or None."""
    base = row.removeprefix("graph: ")
    base = {"dispatch": "EPBuffer.dispatch", "combine": "EPBuffer.combine",
            "dispatch token_major": "EPBuffer.dispatch token_major",
            "combine expert_rank": "EPBuffer.combine expert_rank",
            "combine expert_rank fp32": "EPBuffer.combine expert_rank fp32",
            "combine caller": "EPBuffer.combine caller", "dispatch fp8": "EPBuffer.dispatch fp8"}.get(base, base) if row.startswith("graph: ") else base
    return next((m.row for m in floor_modes(fp8) if m.of == base), None)


def rank_bytes(mode: FloorMode, tokens: list[int], tok: list[list[int]], pairs: list[list[int]], r: int,
               hidden: int, elt: int) -> tuple[float, float]:
    """(HBM bytes, NVLink bytes) of rank r for one call of `mode` (module docstring)."""
    W = len(tokens)
    b = mode.row_bytes(hidden, elt)
    crossing = pairs if mode.landing == "pairs" else tok
    if mode.kind == "dispatch":
        hbm = tokens[r] * b + sum(crossing[s][r] for s in range(W)) * b
        out = sum(tok[r][d] for d in range(W) if d != r) * b
        inn = sum(tok[s][r] for s in range(W) if s != r) * b
    else:
        row = _plain(hidden, elt)   # the expert rows read and the output written: the token dtype
        held = pairs if mode.reads == "pairs" else tok
        hbm = sum(held[s][r] for s in range(W)) * row + tokens[r] * row
        out = sum(crossing[d][r] for d in range(W) if d != r) * b    # r's expert results going home
        inn = sum(crossing[r][s] for s in range(W) if s != r) * b    # r's tokens' terms coming back
    return hbm, max(out, inn)


def _peer_target(ctx: BenchContext, n: int) -> tuple[torch.Tensor, Callable[[], None]]:
    """A uint8 [n] tensor in the next rank's memory that this rank writes, and what releases it
    (collective). GPUs: a torch symmetric-memory allocation and the peer's view of it (CUDA IPC);
    emulated ranks: a SymmetricHeap's host view of the peer's arena."""
    nxt = (ctx.rank + 1) % ctx.world
    if ctx.on_cuda:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        group = ctx.group if ctx.group is not None else dist.group.WORLD
        local = symm_mem.empty(n, dtype=torch.uint8, device=ctx.device)
        handle = symm_mem.rendezvous(local, group)
        # the tensor may start inside torch's pooled allocation, at an offset that differs per rank
        offsets: list[int] = [0] * ctx.world
        dist.all_gather_object(offsets, local.data_ptr() - int(handle.buffer_ptrs[ctx.rank]), group=group)
        peer = handle.get_buffer(nxt, (n,), torch.uint8, storage_offset=offsets[nxt])
        holder = [local, handle, peer]
        return peer, holder.clear
    from ditron_ep.runtime import control as C
    from ditron_ep.runtime.heap import SymmetricHeap

    heap = SymmetricHeap(ctx.group, size_bytes=C.align_up(C.CTRL_BYTES + 4) + C.align_up(n), num_signals=1)
    heap.alloc("floor/peer", (n,), torch.uint8)
    return heap.peer_view("floor/peer", nxt), heap.free


def measure_bandwidths(ctx: BenchContext) -> tuple[list[Measurement], float | None, float | None]:
    """The HBM_COPY and PEER_COPY rows and their bandwidths in bytes/s (None where not measured)."""
    n = (256 if ctx.on_cuda else 4) * 2**20
    try:
        src, dst = guarded(ctx, "floor buffers", lambda: (torch.ones(n, dtype=torch.uint8, device=ctx.device),
                                                          torch.empty(n, dtype=torch.uint8, device=ctx.device)))
        peer, release = guarded(ctx, "peer-copy buffer", lambda: _peer_target(ctx, n))
    except StageFailed as exc:
        return [*failed((HBM_COPY, PEER_COPY), str(exc))], None, None
    mib = n // 2**20
    try:
        hbm, hbm_bw = measure_bandwidth(ctx, HBM_COPY, lambda: dst.copy_(src), 2 * n, f"{mib} MiB read + written")
        nvl, peer_bw = measure_bandwidth(ctx, PEER_COPY, lambda: peer.copy_(src), n,
                                         f"{mib} MiB to the next rank, every rank at once")
    finally:
        peer = None  # no view of the peer's memory outlives its release
        release()
    return [hbm, nvl], hbm_bw, peer_bw


def floor_rows(ctx: BenchContext, tokens: list[int], tok: list[list[int]], pairs: list[list[int]],
               work: Callable[[str], tuple[float | None, dict]], fp8: bool) -> list[Measurement]:
    """The bandwidth rows, then one derived floor row per mode (module docstring), each naming the
    busiest rank's bytes and the bandwidths it used."""
    rows, hbm_bw, peer_bw = measure_bandwidths(ctx)
    modes = floor_modes(fp8)
    if not hbm_bw or not peer_bw:
        return [*rows, *failed(tuple(m.row for m in modes), "not derived: a bandwidth was not measured")]
    elt = torch.empty((), dtype=ctx.dtype).element_size()
    for mode in modes:
        per_rank = [rank_bytes(mode, tokens, tok, pairs, r, ctx.shape.hidden, elt) for r in range(len(tokens))]
        times = [max(h / hbm_bw, v / peer_bw) * 1e6 for h, v in per_rank]
        busiest = max(range(len(times)), key=times.__getitem__)
        hbm, nvl = per_rank[busiest]
        bound = "HBM" if hbm / hbm_bw >= nvl / peer_bw else "NVLink"
        w, _ = work(mode.kind)
        rows.append(Measurement(
            mode.row, work=w, value_us=times[busiest], ok=True,
            details={"hbm_bytes": hbm, "nvlink_bytes": nvl, "rank": busiest, "hbm_bytes_per_s": hbm_bw,
                     "peer_bytes_per_s": peer_bw},
            check=f"{bound}-bound: rank {busiest} HBM {_size(hbm)}, NVLink {_size(nvl)}"))
    return rows


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.1f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:,.1f} kB"


def floor_impls(fp8: bool) -> tuple[Impl, ...]:
    return (Impl(HBM_COPY, "reference"), Impl(PEER_COPY, "reference"),
            *(Impl(m.row, "reference", timed=False) for m in floor_modes(fp8)))
