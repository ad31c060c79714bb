"""Plans of the tensor-parallel GEMM + collective kernels (the tile compiler's other op family).

`AGGemmPlan` is the overlapped AllGather+GEMM (`ops/tp/ag_gemm_kernels.py`) at three levels:
  Task   — which shard moves when: each rank sends its own shard first in its copy queue
           (destinations rank, rank+1, ...) and takes the GEMM M-tiles in shard order from its own;
  Device — the queue: copy tickets [0, n_copy) (chunk-major, then destination), GEMM tickets after
           them; comm_programs programs take the copies when > 0 (role split); signal family
           (source rank, chunk), one word each, stamped with the call number;
  Core   — the GEMM tile (block sizes, warps, stages), which must be the sequential schedule's
           (`gemm.matmul`'s): the plan's identity includes it, since it sets the result bits.
`lower_ag_gemm` builds one and `verify_ag_gemm` checks it: structurally, and concretely for every
rank by enumerating the queue with the kernel's own index formulas (every chunk of every source
lands on every rank exactly once, from a copy ticket that comes before any GEMM ticket; every GEMM
tile waits for exactly the chunks holding its rows; the tiles cover the output exactly once).
The launcher takes its chunk size, role split and tile from a verified plan.
"""
from __future__ import annotations

import dataclasses
import hashlib

from ditron_ep.compiler.core_config import GemmTileConfig, default_gemm_configs
from ditron_ep.compiler.plan import PlanError, cdiv, is_nonnegative_int, is_positive_int

__all__ = ["AGGemmPlan", "lower_ag_gemm", "verify_ag_gemm"]


@dataclasses.dataclass(frozen=True)
class AGGemmPlan:
    world_size: int
    rows: int                  # M, rows of a per rank
    k: int
    n: int
    dtype: str                 # "bfloat16" | "float16" | "float32"
    device_type: str           # "cuda" | "hip" | "cpu"
    chunk_rows: int            # Device: rows per copy task (one signal each)
    comm_programs: int         # Device: programs on the copy queue (0: no role split)
    tile: GemmTileConfig       # Core
    verified_digest: str = ""

    # ---- derived counts (the kernel computes the same)
    @property
    def n_chunks(self) -> int:
        return cdiv(self.rows, self.chunk_rows)

    @property
    def n_copy(self) -> int:
        return self.n_chunks * self.world_size

    @property
    def n_gemm(self) -> int:
        return cdiv(self.world_size * self.rows, self.tile.block_m) * cdiv(self.n, self.tile.block_n)

    def digest(self) -> str:
        fields = dataclasses.asdict(self)
        fields.pop("verified_digest")
        return hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:16]

    @property
    def verified(self) -> bool:
        return self.verified_digest == self.digest()

    # ---- the kernel's index formulas, in Python
    def copy_task(self, rank: int, t: int) -> tuple[int, int]:
        """Copy ticket t of `rank` -> (chunk, destination rank)."""
        return t // self.world_size, (rank + t % self.world_size) % self.world_size

    def gemm_task(self, rank: int, g: int) -> tuple[int, int]:
        """GEMM ticket g (0-based after the copies) of `rank` -> (M-tile, N-tile): M-tiles in shard
        order from rank's own shard (a tile belongs to the shard of its first row)."""
        n_n = cdiv(self.n, self.tile.block_n)
        i, bm, m = g // n_n, self.tile.block_m, self.rows
        before = 0
        for j in range(self.world_size):
            s = (rank + j) % self.world_size
            lo = cdiv(s * m, bm)
            count = cdiv((s + 1) * m, bm) - lo
            if before <= i < before + count:
                return lo + i - before, g % n_n
            before += count
        raise PlanError(f"GEMM ticket {g} of rank {rank} maps to no M-tile")

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
            f"Core level: GEMM tile {self.tile} (the sequential schedule's)",
        ])


def sequential_tile(dtype: str, device_type: str) -> GemmTileConfig:
    """The tile `gemm.matmul` uses (the sequential schedule's GEMM)."""
    import torch

    return default_gemm_configs(getattr(torch, dtype), device_type)[1]


def lower_ag_gemm(world_size: int, rows: int, k: int, n: int, dtype: str, device_type: str, *,
                  comm_programs: int = 0, chunk_rows: int | None = None) -> AGGemmPlan:
    """The verified AllGather+GEMM plan: chunks of one GEMM row tile, the sequential tile."""
    tile = sequential_tile(dtype, device_type)
    plan = AGGemmPlan(world_size, rows, k, n, dtype, device_type, chunk_rows or tile.block_m, comm_programs, tile)
    verify_ag_gemm(plan)
    return dataclasses.replace(plan, verified_digest=plan.digest())


def verify_ag_gemm(plan: AGGemmPlan) -> None:
    """PlanError naming what is wrong, unless the plan is sound (module docstring)."""
    for name in ("world_size", "rows", "k", "n", "chunk_rows"):
        if not is_positive_int(getattr(plan, name)):
            raise PlanError(f"AGGemmPlan.{name} must be a positive int, got {getattr(plan, name)!r}")
    if not is_nonnegative_int(plan.comm_programs):
        raise PlanError(f"AGGemmPlan.comm_programs must be an int >= 0, got {plan.comm_programs!r}")
    want = sequential_tile(plan.dtype, plan.device_type)
    if plan.tile != want:
        raise PlanError(f"core: the GEMM tile {plan.tile} is not the sequential schedule's {want}: the overlapped "
                        f"kernel would not be bitwise equal to it")
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
