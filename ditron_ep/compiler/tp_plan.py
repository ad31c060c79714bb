"""Plans of the tensor-parallel GEMM + collective kernels (the tile compiler's other op family).

`AGGemmPlan` is the overlapped AllGather+GEMM (`ops/tp/ag_gemm_kernels.py`) at three levels:
  Task   — which shard moves when: each rank sends its own shard first in its copy queue
           (destinations rank, rank+1, ...) and takes the GEMM M-tiles in shard order from its own;
  Device — the queue: copy tickets [0, n_copy) (chunk-major, then destination), GEMM tickets after
           them; comm_programs programs take the copies when > 0 (role split); signal family
           (source rank, chunk), one word each, stamped with the call number;
  Core   — the GEMM tile (block sizes, warps, stages), the sequential schedule's (`gemm.matmul`'s,
           `planned_tile`: the tuner's or the shape rule's; a tuned tile keeps the rule's rows
           per tile and K step, so the bits): the plan's identity includes it and its source.
`lower_ag_gemm` builds one and `verify_ag_gemm` checks it: structurally, and concretely for every
rank by enumerating the queue with the kernel's own index formulas (every chunk of every source
lands on every rank exactly once, from a copy ticket that comes before any GEMM ticket; every GEMM
tile waits for exactly the chunks holding its rows; the tiles cover the output exactly once).
The launcher takes its chunk size, role split and tile from a verified plan.

`GemmRSPlan` is the overlapped GEMM+ReduceScatter (`ops/tp/gemm_rs_kernels.py`):
  Task   — each rank computes its fp32 partial a_r @ b_r tile by tile, the M-tiles in shard order
           from the next rank's shard (its own last), each tile's rows written straight into the
           landing buffer of the rank(s) whose shard they lie in, at [source rank, row];
  Device — the queue: GEMM tickets [0, n_gemm), then reduce tickets (the M-tiles meeting this
           rank's shard x N-tiles); signal family (source rank, M-tile, N-tile), one word each,
           stamped with the call number; a reduce ticket waits for its tile from every source;
  Core   — the GEMM tile, the sequential schedule's (as above); the reduce adds the W partials in
           rank order in fp32 and casts once, as `functional.sum_in_rank_order` does.
`verify_gemm_rs` checks that every rank computes every output tile of its partial once, in GEMM
tickets before any reduce ticket; that every row of a rank's shard lands from every source exactly
once, from the tile whose signal the reduce of those rows waits for; and that the reduce tickets
cover the rank's shard once.

`GemmARPlan` is the overlapped GEMM+AllReduce (`ops/tp/gemm_ar_kernels.py`):
  Task   — output tile t (M-tile-major) is owned by rank t % W; every rank computes its fp32
           partial of every tile and writes it into the tile owner's landing buffer at [source];
  Device — GEMM tickets (every tile), then reduce tickets (the own tiles: wait for every source's
           partial, add them in rank order in fp32, cast once, write the result into every
           rank's result rows and stamp it there), then copy-out tickets (every tile: wait for the
           owner's stamp, copy the result into this rank's output); signals (source, tile) and
           (tile);
  Core   — the GEMM tile, the sequential schedule's.
`verify_gemm_ar` checks that every rank computes every tile once, that each tile has one owner who
reduces it once after every source's partial, and that every rank copies every tile out once
after its owner's stamp.
"""
from __future__ import annotations

import dataclasses
import hashlib

from ditron_ep.compiler.core_config import GemmTileConfig, default_gemm_configs
from ditron_ep.compiler.plan import PlanError, cdiv, is_nonnegative_int, is_positive_int

__all__ = ["AGGemmPlan", "GemmARPlan", "GemmRSPlan", "TILE_SOURCES", "lower_ag_gemm", "lower_gemm_ar", "lower_gemm_rs", "verify_ag_gemm",
           "planned_tile", "sequential_tile", "verify_gemm_ar", "verify_gemm_rs"]


class _Verified:
    """A plan's identity (every field but the digest it was verified under) and its check."""

    def digest(self) -> str:
        fields = dataclasses.asdict(self)
        fields.pop("verified_digest")
        return hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:16]

    @property
    def verified(self) -> bool:
        return self.verified_digest == self.digest()


def _check_basics(plan, positive: tuple[str, ...], nonnegative: tuple[str, ...] = ()) -> None:
    """PlanError unless the named fields are positive / non-negative ints and the GEMM tile is the
    sequential schedule's (whose bits every overlapped kernel must equal)."""
    kind = type(plan).__name__
    for name in positive:
        if not is_positive_int(getattr(plan, name)):
            raise PlanError(f"{kind}.{name} must be a positive int, got {getattr(plan, name)!r}")
    for name in nonnegative:
        if not is_nonnegative_int(getattr(plan, name)):
            raise PlanError(f"{kind}.{name} must be an int >= 0, got {getattr(plan, name)!r}")
    rule = sequential_tile(plan.dtype, plan.device_type, plan.gemm_rows, plan.n)
    if plan.tile_source not in TILE_SOURCES:
        raise PlanError(f"core: tile_source must be one of {TILE_SOURCES}, got {plan.tile_source!r}")
    if plan.tile_source == "rule" and plan.tile != rule:
        raise PlanError(f"core: the GEMM tile {plan.tile} is not the shape rule's {rule}: the overlapped kernel "
                        f"would not be bitwise equal to the sequential schedule")
    if (plan.tile.block_m, plan.tile.block_k) != (rule.block_m, rule.block_k):
        raise PlanError(f"core: the tuned GEMM tile {plan.tile} must keep the shape rule's rows per tile and K step "
                        f"({rule}): they set the chunking and every output element's summation order")


def _verified(plan, verify):
    """`plan` checked by `verify` and stamped with its digest."""
    verify(plan)
    return dataclasses.replace(plan, verified_digest=plan.digest())


def shard_order_tile(i: int, first: int, world: int, m: int, bm: int) -> int:
    """The i-th M-tile of the W*m rows in shard order from shard `first` (a tile belongs to the
    shard of its first row): the kernels' `shard_tile`."""
    before = 0
    for j in range(world):
        s = (first + j) % world
        lo = cdiv(s * m, bm)
        count = cdiv((s + 1) * m, bm) - lo
        if before <= i < before + count:
            return lo + i - before
        before += count
    raise PlanError(f"M-tile number {i} of {world} shards of {m} rows maps to no tile")


@dataclasses.dataclass(frozen=True)
class AGGemmPlan(_Verified):
    world_size: int
    rows: int                  # M, rows of a per rank
    k: int
    n: int
    dtype: str                 # "bfloat16" | "float16" | "float32"
    device_type: str           # "cuda" | "hip" | "cpu"
    chunk_rows: int            # Device: rows per copy task (one signal each)
    comm_programs: int         # Device: programs on the copy queue (0: no role split)
    tile: GemmTileConfig       # Core
    tile_source: str = "rule"  # Core: "rule" (sequential_tile) or "tuned" (planned_tile)
    verified_digest: str = ""

    # ---- derived counts (the kernel computes the same)
    @property
    def gemm_rows(self) -> int:
        return self.world_size * self.rows

    @property
    def n_chunks(self) -> int:
        return cdiv(self.rows, self.chunk_rows)

    @property
    def n_copy(self) -> int:
        return self.n_chunks * self.world_size

    @property
    def n_gemm(self) -> int:
        return cdiv(self.world_size * self.rows, self.tile.block_m) * cdiv(self.n, self.tile.block_n)

    # ---- the kernel's index formulas, in Python
    def copy_task(self, rank: int, t: int) -> tuple[int, int]:
        """Copy ticket t of `rank` -> (chunk, destination rank)."""
        return t // self.world_size, (rank + t % self.world_size) % self.world_size

    def gemm_task(self, rank: int, g: int) -> tuple[int, int]:
        """GEMM ticket g (0-based after the copies) of `rank` -> (M-tile, N-tile): M-tiles in shard
        order from rank's own shard (a tile belongs to the shard of its first row)."""
        n_n = cdiv(self.n, self.tile.block_n)
        return shard_order_tile(g // n_n, rank, self.world_size, self.rows, self.tile.block_m), g % n_n

    def waits(self, t_m: int) -> list[tuple[int, int]]:
        """The (source rank, chunk) signals M-tile t_m waits for: every chunk holding one of its rows."""
        bm, m, cr = self.tile.block_m, self.rows, self.chunk_rows
        row0 = t_m * bm
        n_rows = min(bm, self.world_size * m - row0)
        out = []
        for s in range(row0 // m, (row0 + n_rows - 1) // m + 1):
            lo = max(row0 - s * m, 0) // cr
            hi = (min(row0 + n_rows - s * m, m) - 1) // cr
            out += [(s, c) for c in range(lo, hi + 1)]
        return out

    def describe(self) -> str:
        return "\n".join([
            f"AllGather+GEMM plan  W={self.world_size}  M={self.rows}/rank  K={self.k}  N={self.n}  {self.dtype}  "
            f"{'verified' if self.verified else 'NOT verified'} ({self.digest()})",
            "Task level: copies own shard first (destinations rank, rank+1, ...); GEMM M-tiles in shard order from "
            "the own shard",
            f"Device level: {self.n_copy} copy tickets ({self.n_chunks} chunks of {self.chunk_rows} rows x "
            f"{self.world_size} destinations) then {self.n_gemm} GEMM tickets; comm_programs={self.comm_programs}; "
            f"signals (source, chunk): {self.world_size * self.n_chunks}",
            f"Core level: GEMM tile {self.tile} ({self.tile_source}; the sequential schedule's)",
        ])


# A GEMM with fewer output tiles than this leaves SMs idle (132 on H100/H200): smaller tiles first.
MIN_GEMM_TILES = 128


def sequential_tile(dtype: str, device_type: str, rows: int, n: int) -> GemmTileConfig:
    """The tile `gemm.matmul` uses for a [rows, K] @ [K, n] product (the sequential schedule's
    GEMM, so the overlapped kernels' too). On a GPU the default down tile (128 x 256) narrows for
    small products until there are at least MIN_GEMM_TILES tiles: BN halves down to 64. BM stays,
    since every M-tile reads all of b and a small-M product is bound by those bytes (M=128, K=N=8192:
    one M-tile reads b's 128 MB once, two would read it twice); it is 64 only for rows <= 64 (one
    M-tile either way, half the padding). BM depends on the rows alone: the all-gather's chunk is
    one M-tile and must be the same on every rank, whose N may differ. BK and the stages stay: each
    output element is still one fp32 sum over K in BK steps. Under the interpreter the default tile
    (small, ragged in every dimension) is kept."""
    import torch

    tile = default_gemm_configs(getattr(torch, dtype), device_type)[1]
    if device_type == "cpu":
        return tile
    bm = tile.block_m if rows > 64 else min(tile.block_m, 64)
    bn = tile.block_n
    while bn > 64 and cdiv(rows, bm) * cdiv(n, bn) < MIN_GEMM_TILES:
        bn //= 2
    if (bm, bn) == (tile.block_m, tile.block_n):
        return tile
    return GemmTileConfig(bm, bn, tile.block_k, 8 if bm * bn >= 128 * 128 else 4, tile.num_stages)


TILE_SOURCES = ("rule", "tuned")


def planned_tile(dtype: str, device_type: str, rows: int, k: int, n: int) -> tuple[GemmTileConfig, str]:
    """(tile, source) of the TP dense GEMM [rows, k] @ [k, n]: on NVIDIA the tuner's tile when this
    machine's cache has one for the shape (compiler/tuner.py: searched with the rule's rows per
    tile and K step, kept only if bitwise equal to the rule's output), else `sequential_tile`'s.
    An entry whose rows per tile or K step is not the rule's at these rows (a neighbouring row
    count in the same bucket) is not used."""
    rule = sequential_tile(dtype, device_type, rows, n)
    if device_type != "cuda":
        return rule, "rule"
    import torch

    from ditron_ep.compiler.tuner import tuned_tp_tile

    tuned = tuned_tp_tile(getattr(torch, dtype), rows=rows, k=k, n=n)
    if tuned is not None and tuned != rule and (tuned.block_m, tuned.block_k) == (rule.block_m, rule.block_k):
        return tuned, "tuned"
    return rule, "rule"


def _tile_of(dtype: str, device_type: str, rows: int, k: int, n: int,
             tile: tuple[GemmTileConfig, str] | None) -> tuple[GemmTileConfig, str]:
    return tile if tile is not None else planned_tile(dtype, device_type, rows, k, n)


def lower_ag_gemm(world_size: int, rows: int, k: int, n: int, dtype: str, device_type: str, *,
                  comm_programs: int = 0, chunk_rows: int | None = None,
                  tile: tuple[GemmTileConfig, str] | None = None) -> AGGemmPlan:
    """The verified AllGather+GEMM plan: chunks of one GEMM row tile; tile: (tile, source), default
    `planned_tile` of the gathered product."""
    cfg, source = _tile_of(dtype, device_type, world_size * rows, k, n, tile)
    return _verified(AGGemmPlan(world_size, rows, k, n, dtype, device_type, chunk_rows or cfg.block_m, comm_programs,
                                cfg, source), verify_ag_gemm)


def verify_ag_gemm(plan: AGGemmPlan) -> None:
    """PlanError naming what is wrong, unless the plan is sound (module docstring)."""
    # N is each rank's own: a rank with none only gathers
    _check_basics(plan, ("world_size", "rows", "k", "chunk_rows"), ("n", "comm_programs"))
    w, m, bm = plan.world_size, plan.rows, plan.tile.block_m
    n_n = cdiv(plan.n, plan.tile.block_n)
    for rank in range(w):
        landed: dict[tuple[int, int], int] = {}  # (source, chunk) landing on `rank` -> copy ticket on the source
        for src in range(w):
            for t in range(plan.n_copy):
                c, d = plan.copy_task(src, t)
                if not 0 <= c < plan.n_chunks:
                    raise PlanError(f"device: copy ticket {t} of rank {src} names chunk {c} of {plan.n_chunks}")
                if d == rank:
                    if (src, c) in landed:
                        raise PlanError(f"device: chunk {c} of rank {src} lands on rank {rank} twice")
                    landed[(src, c)] = t
        missing = [(s, c) for s in range(w) for c in range(plan.n_chunks) if (s, c) not in landed]
        if missing:
            raise PlanError(f"device: chunks {missing[:4]} never land on rank {rank}")
        # every copy ticket precedes every GEMM ticket (tickets [0, n_copy) are the copies)
        covered = [[0] * n_n for _ in range(cdiv(w * m, bm))]
        checked: set[int] = set()
        for g in range(plan.n_gemm):
            t_m, t_n = plan.gemm_task(rank, g)
            covered[t_m][t_n] += 1
            if t_m in checked:
                continue
            checked.add(t_m)
            row0, row_end = t_m * bm, min(t_m * bm + bm, w * m)
            rows_needed = {(r // m, (r % m) // plan.chunk_rows) for r in range(row0, row_end)}  # row by row
            got = set(plan.waits(t_m))
            if got != rows_needed:
                raise PlanError(f"device: GEMM tile {t_m} of rank {rank} waits for {sorted(got)[:4]}, its rows lie "
                                f"in {sorted(rows_needed)[:4]}")
        bad = [(i, j, v) for i, row in enumerate(covered) for j, v in enumerate(row) if v != 1]
        if bad:
            raise PlanError(f"device: output tiles computed other than once on rank {rank}: {bad[:4]} "
                            f"(M-tile, N-tile, times)")


@dataclasses.dataclass(frozen=True)
class GemmRSPlan(_Verified):
    world_size: int
    rows: int                  # M: output rows per rank (a has W*M rows)
    k: int
    n: int
    dtype: str
    device_type: str
    tile: GemmTileConfig       # Core: the sequential schedule's
    tile_source: str = "rule"  # Core: "rule" (sequential_tile) or "tuned" (planned_tile)
    verified_digest: str = ""

    @property
    def n_m(self) -> int:
        return cdiv(self.world_size * self.rows, self.tile.block_m)

    @property
    def gemm_rows(self) -> int:
        return self.world_size * self.rows

    @property
    def n_n(self) -> int:
        return cdiv(self.n, self.tile.block_n)

    @property
    def n_gemm(self) -> int:
        return self.n_m * self.n_n

    def shard_tiles(self, rank: int) -> range:
        """The M-tiles holding rows of `rank`'s shard."""
        bm, m = self.tile.block_m, self.rows
        return range(rank * m // bm, ((rank + 1) * m - 1) // bm + 1)

    def n_reduce(self, rank: int) -> int:
        return len(self.shard_tiles(rank)) * self.n_n

    @property
    def num_signals(self) -> int:
        return self.world_size * self.n_gemm

    # ---- the kernel's index formulas, in Python
    def gemm_task(self, rank: int, g: int) -> tuple[int, int]:
        """GEMM ticket g -> (M-tile, N-tile): M-tiles in shard order from shard rank + 1."""
        w = self.world_size
        return shard_order_tile(g // self.n_n, (rank + 1) % w, w, self.rows, self.tile.block_m), g % self.n_n

    def destinations(self, t_m: int) -> list[tuple[int, int, int]]:
        """(destination rank, first row, end row) of M-tile t_m's rows by shard (local rows)."""
        bm, m = self.tile.block_m, self.rows
        row0, end = t_m * bm, min(t_m * bm + bm, self.world_size * m)
        return [(d, max(row0, d * m) - d * m, min(end, (d + 1) * m) - d * m) for d in range(row0 // m, (end - 1) // m + 1)]

    def signal(self, src: int, t_m: int, t_n: int) -> int:
        return (src * self.n_m + t_m) * self.n_n + t_n

    def reduce_task(self, rank: int, j: int) -> tuple[int, int]:
        """Reduce ticket j (0-based after the GEMM tickets) -> (M-tile, N-tile)."""
        return self.shard_tiles(rank)[j // self.n_n], j % self.n_n

    def reduce_waits(self, rank: int, t_m: int, t_n: int) -> list[int]:
        return [self.signal(s, t_m, t_n) for s in range(self.world_size)]

    def describe(self) -> str:
        return "\n".join([
            f"GEMM+ReduceScatter plan  W={self.world_size}  M={self.rows}/rank out  K={self.k}  N={self.n}  "
            f"{self.dtype}  {'verified' if self.verified else 'NOT verified'} ({self.digest()})",
            "Task level: each rank's fp32 partial tile by tile, M-tiles in shard order from the next rank's shard (own "
            "last), rows written into their shard owner's landing buffer at [source, row]",
            f"Device level: {self.n_gemm} GEMM tickets then the reduce tickets of the own shard; signals (source, "
            f"M-tile, N-tile): {self.num_signals}",
            f"Core level: GEMM tile {self.tile} ({self.tile_source}; the sequential schedule's); partials added in "
            f"rank order in fp32, cast once",
        ])


def lower_gemm_rs(world_size: int, rows: int, k: int, n: int, dtype: str, device_type: str, *,
                  tile: tuple[GemmTileConfig, str] | None = None) -> GemmRSPlan:
    """The verified GEMM+ReduceScatter plan; tile: (tile, source), the same on every rank (default
    `planned_tile` of the product)."""
    cfg, source = _tile_of(dtype, device_type, world_size * rows, k, n, tile)
    return _verified(GemmRSPlan(world_size, rows, k, n, dtype, device_type, cfg, source), verify_gemm_rs)


def verify_gemm_rs(plan: GemmRSPlan) -> None:
    """PlanError naming what is wrong, unless the plan is sound (module docstring)."""
    _check_basics(plan, ("world_size", "rows", "k", "n"))
    w, m = plan.world_size, plan.rows
    landed: list[dict[tuple[int, int], int]] = [{} for _ in range(w)]  # per destination: (source, row) -> signal
    for src in range(w):
        covered: dict[tuple[int, int], int] = {}
        for g in range(plan.n_gemm):
            t_m, t_n = plan.gemm_task(src, g)
            covered[(t_m, t_n)] = covered.get((t_m, t_n), 0) + 1
            if t_n == 0:
                for d, lo, hi in plan.destinations(t_m):
                    for r in range(lo, hi):
                        if (src, r) in landed[d]:
                            raise PlanError(f"task: row {r} of rank {d}'s shard lands from rank {src} twice")
                        landed[d][(src, r)] = t_m
        bad = [k for k in ((i, j) for i in range(plan.n_m) for j in range(plan.n_n)) if covered.get(k) != 1]
        if bad:
            raise PlanError(f"device: output tiles of rank {src}'s partial computed other than once: {bad[:4]} "
                            f"(M-tile, N-tile)")
    for d in range(w):
        missing = [(s, r) for s in range(w) for r in range(m) if (s, r) not in landed[d]]
        if missing:
            raise PlanError(f"task: rows {missing[:4]} (source, row) never land on rank {d}")
        reduced: dict[tuple[int, int], int] = {}
        for j in range(plan.n_reduce(d)):
            t_m, t_n = plan.reduce_task(d, j)
            waits = set(plan.reduce_waits(d, t_m, t_n))
            for dd, lo, hi in plan.destinations(t_m):
                if dd != d:
                    continue
                for r in range(lo, hi):
                    reduced[(r, t_n)] = reduced.get((r, t_n), 0) + 1
                    need = {plan.signal(s, landed[d][(s, r)], t_n) for s in range(w)}
                    if not need <= waits:
                        raise PlanError(f"device: the reduce of rank {d}'s row {r}, N-tile {t_n} waits for signals "
                                        f"{sorted(waits)[:4]}, its partials are stamped on {sorted(need)[:4]}")
        bad = [(r, t) for r in range(m) for t in range(plan.n_n) if reduced.get((r, t)) != 1]
        if bad:
            raise PlanError(f"device: rows of rank {d}'s shard reduced other than once: {bad[:4]} (row, N-tile)")


@dataclasses.dataclass(frozen=True)
class GemmARPlan(_Verified):
    world_size: int
    rows: int                  # M (every rank's a and the result)
    k: int                     # this rank's K (its shard of the reduction: may differ between ranks)
    n: int
    dtype: str
    device_type: str
    tile: GemmTileConfig
    tile_source: str = "rule"  # Core: "rule" (sequential_tile) or "tuned" (planned_tile)
    verified_digest: str = ""

    @property
    def gemm_rows(self) -> int:
        return self.rows

    @property
    def n_tiles(self) -> int:
        return cdiv(self.rows, self.tile.block_m) * cdiv(self.n, self.tile.block_n)

    def owner(self, t: int) -> int:
        return t % self.world_size

    def n_owned(self, rank: int) -> int:
        return len(range(rank, self.n_tiles, self.world_size))

    @property
    def num_signals(self) -> int:
        return (self.world_size + 1) * self.n_tiles

    # ---- the kernel's index formulas, in Python
    def gemm_task(self, rank: int, g: int) -> int:
        """GEMM ticket g -> tile: from the next rank's tiles on (tile g + rank + 1, wrapping)."""
        return (g + rank + 1) % self.n_tiles

    def reduce_task(self, rank: int, j: int) -> int:
        return rank + j * self.world_size

    def partial_signal(self, src: int, t: int) -> int:
        return src * self.n_tiles + t

    def result_signal(self, t: int) -> int:
        return self.world_size * self.n_tiles + t

    def copy_task(self, rank: int, j: int) -> int:
        return j

    def reduce_waits(self, t: int) -> list[int]:
        """The signals tile t's reduce waits for: every source's partial."""
        return [self.partial_signal(s, t) for s in range(self.world_size)]

    def result_destinations(self, t: int) -> range:
        """The ranks the owner of tile t writes its sum to (and stamps result_signal(t) on)."""
        return range(self.world_size)

    def copy_waits(self, t: int) -> list[int]:
        """The signals rank's copy-out of tile t waits for: the owner's stamp of the tile."""
        return [self.result_signal(t)]

    def describe(self) -> str:
        return "\n".join([
            f"GEMM+AllReduce plan  W={self.world_size}  M={self.rows}  K={self.k} (this rank)  N={self.n}  "
            f"{self.dtype}  {'verified' if self.verified else 'NOT verified'} ({self.digest()})",
            "Task level: tile t owned by rank t % W; every rank's fp32 partial of a tile lands in its owner's buffer; "
            "the owner's sum goes to every rank",
            f"Device level: {self.n_tiles} GEMM tickets, the owned tiles' reduce tickets, {self.n_tiles} copy-out "
            f"tickets; signals (source, tile) and (tile): {self.num_signals}",
            f"Core level: GEMM tile {self.tile} ({self.tile_source}; the sequential schedule's); partials added in "
            f"rank order in fp32, cast once",
        ])


def lower_gemm_ar(world_size: int, rows: int, k: int, n: int, dtype: str, device_type: str, *,
                  tile: tuple[GemmTileConfig, str] | None = None) -> GemmARPlan:
    """The verified GEMM+AllReduce plan; tile: (tile, source), the same on every rank (default
    `planned_tile` of this rank's product)."""
    cfg, source = _tile_of(dtype, device_type, rows, k, n, tile)
    return _verified(GemmARPlan(world_size, rows, k, n, dtype, device_type, cfg, source), verify_gemm_ar)


def verify_gemm_ar(plan: GemmARPlan) -> None:
    """PlanError naming what is wrong, unless the plan is sound (module docstring)."""
    _check_basics(plan, ("world_size", "rows", "n"), ("k",))  # a rank's shard of the reduction may be empty
    w, n_t = plan.world_size, plan.n_tiles
    stamped: set[int] = set()  # partial signals some GEMM ticket stamps
    for src in range(w):
        tiles = [plan.gemm_task(src, g) for g in range(n_t)]
        if sorted(tiles) != list(range(n_t)):
            raise PlanError(f"device: rank {src}'s GEMM tickets compute tiles other than once each")
        stamped |= {plan.partial_signal(src, t) for t in tiles}
    reduced: dict[int, int] = {}
    results: set[tuple[int, int]] = set()  # (rank, result signal) an owner's reduce stamps
    for rank in range(w):
        for j in range(plan.n_owned(rank)):
            t = plan.reduce_task(rank, j)
            if not 0 <= t < n_t or plan.owner(t) != rank:
                raise PlanError(f"task: reduce ticket {j} of rank {rank} names tile {t}, which it does not own")
            reduced[t] = reduced.get(t, 0) + 1
            waits = set(plan.reduce_waits(t))
            need = {plan.partial_signal(s, t) for s in range(w)}
            if waits != need or not need <= stamped:
                raise PlanError(f"device: tile {t}'s reduce waits for {sorted(waits)[:4]}, its partials are stamped "
                                f"on {sorted(need)[:4]}")
            results |= {(d, plan.result_signal(t)) for d in plan.result_destinations(t)}
    bad = [t for t in range(n_t) if reduced.get(t) != 1]
    if bad:
        raise PlanError(f"task: tiles {bad[:4]} reduced other than once")
    for rank in range(w):
        copied = sorted(plan.copy_task(rank, j) for j in range(n_t))
        if copied != list(range(n_t)):
            raise PlanError(f"device: rank {rank} copies tiles out other than once each")
        for t in range(n_t):
            if not any((rank, sig) in results for sig in plan.copy_waits(t)) or \
                    plan.result_signal(t) not in plan.copy_waits(t):
                raise PlanError(f"device: rank {rank}'s copy-out of tile {t} waits for {plan.copy_waits(t)}, not "
                                f"for its owner's stamp of the sum on this rank")
