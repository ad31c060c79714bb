"""What a benchmark is, what it is asked to run, and what it returns.

* `Benchmark` — a registry entry: name, description, our implementations and the baselines it
  times beside them, the metric (GB/s or TFLOP/s) and how its work is counted, default shapes
  per backend, and `run(ctx, tokens) -> [Measurement]`, called on every rank alike.
* `BenchRequest` — one benchmark with its shape, token counts, dtype and iterations; plain
  picklable data, sent to every rank.
* `BenchContext` — a rank's view while running one request: its RankContext plus `time()`,
  which times a call on every rank (agreed failures, progress on rank 0).
* `Measurement` — one implementation at one token count: per-iteration times (slowest rank),
  the work of one call, and the verdict of its result check.
* `Row` — a Measurement summarised for the table and the JSON report.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from ditron_ep.bench.ranks import RankContext, StageFailed, guarded
from ditron_ep.bench.timing import time_fn
from ditron_ep.runtime import DitronConfigError

if TYPE_CHECKING:
    from ditron_ep.ops import EPBuffer

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KINDS = ("ours", "baseline")
METRICS = ("GB/s", "TFLOP/s")


@dataclass(frozen=True)
class Shape:
    """Problem size beside the token count: hidden H, experts E in all, top-k K, FFN width I
    (None for benchmarks without experts' weights)."""
    hidden: int
    experts: int
    topk: int
    inter: int | None = None


@dataclass(frozen=True)
class BenchRequest:
    bench: str
    shape: Shape
    tokens: tuple[int, ...]   # per rank, one config each, in this order
    dtype: str                # a key of DTYPES
    iters: int
    warmup: int
    seed: int = 0
    routing: str = "uniform"


@dataclass
class Measurement:
    """One implementation at one token count. `times_us`: slowest rank per iteration; `work`:
    bytes or FLOPs of one call (the metric's numerator); `check`: what the result check found,
    `ok` its verdict; `error`: why nothing was measured."""
    impl: str
    times_us: list[float] | None = None
    work: float | None = None
    check: str = ""
    ok: bool = True
    error: str | None = None


@dataclass(frozen=True)
class Row:
    """One (bench, impl, tokens) of a run: the JSON report's `rows` entry (see report.py)."""
    bench: str
    impl: str
    kind: str                 # "ours" | "baseline"
    tokens: int
    hidden: int
    experts: int
    topk: int
    inter: int | None
    dtype: str
    routing: str
    world_size: int
    iters: int
    median_us: float | None
    p20_us: float | None
    p80_us: float | None
    metric: str               # "GB/s" | "TFLOP/s"
    metric_value: float | None
    baseline: str | None      # the baseline `speedup` is against (ours rows only)
    speedup: float | None     # baseline median / this median
    speedups: dict[str, float] = field(default_factory=dict)   # per baseline (ours rows only)
    check: str = ""
    ok: bool = True
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def tolerance_check(rel: float, rtol: float) -> tuple[str, bool]:
    """(check text, verdict) of a relative error (ranks.relative_errors) against `rtol`."""
    ok = rel <= rtol
    return f"{'ok' if ok else 'FAIL'}: {rel:.1e} {'<=' if ok else '>'} rtol {rtol:g}", ok


@dataclass(kw_only=True)
class BenchContext(RankContext):
    """A rank's view of one request while it runs; `label` names the config in progress."""
    request: BenchRequest
    progress: Callable[[str, int], None] | None = None   # (description, iterations done): rank 0
    label: str = ""

    @property
    def shape(self) -> Shape:
        return self.request.shape

    def time(self, impl: str, fn: Callable[[], object], buf: "EPBuffer | None" = None) -> list[float]:
        """Time `fn` on every rank (timing.time_fn under torch.no_grad); StageFailed on every rank
        if it failed on any (the EP heap `buf` is reset then)."""
        req = self.request

        def tick(i: int) -> None:
            if self.progress is not None:
                phase = (f"warm-up {i + 1}/{req.warmup}" if i < req.warmup
                         else f"timing {i - req.warmup + 1}/{req.iters}")
                self.progress(f"{self.label} · {impl} · {phase}", 1)

        def timed() -> list[float]:
            with torch.no_grad():
                return time_fn(fn, req.iters, req.warmup, self.group, self.device, on_iteration=tick)

        return guarded(self, impl, timed, buf)

    def measure(self, impl: str, fn: Callable[[], object], work: float | None, check: str, ok: bool,
                buf: "EPBuffer | None" = None) -> Measurement:
        """`time` `impl` into a Measurement with its check verdict, or with the agreed error."""
        try:
            return Measurement(impl, self.time(impl, fn, buf), work, check, ok)
        except StageFailed as exc:
            return Measurement(impl, None, work, check, False, error=str(exc))


@dataclass(frozen=True)
class Benchmark:
    """A registry entry. `run(ctx, tokens)` is called on every rank with the same arguments and
    returns one Measurement per name in `impls` (ours first, then the baselines); the first
    baseline is the one `speedup` is against. `dtypes`: backend -> the dtypes it can run in (an
    error for another suggests the first)."""
    name: str
    description: str
    ours: tuple[str, ...]
    baselines: tuple[str, ...]
    metric: str
    work_rule: str
    check_rule: str
    shapes: Mapping[str, Shape]                 # backend ("emulated" | "torch") -> default shape
    tokens: Mapping[str, tuple[int, ...]]       # backend -> default token counts
    run: Callable[[BenchContext, int], list[Measurement]]
    dtypes: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: {"emulated": tuple(DTYPES), "torch": tuple(DTYPES)})
    gpu_only: tuple[str, ...] = ()              # impls measured on GPUs only (e.g. CUDA-graph replays)

    @property
    def impls(self) -> tuple[str, ...]:
        return self.ours + self.baselines

    def impls_for(self, on_gpu: bool) -> tuple[str, ...]:
        """The impls a run on this kind of device measures (`run` returns exactly these)."""
        return self.impls if on_gpu else tuple(i for i in self.impls if i not in self.gpu_only)

    def kind_of(self, impl: str) -> str:
        return "ours" if impl in self.ours else "baseline"

    def check_request(self, shape: Shape, world_size: int, backend: str, dtype: str) -> None:
        """DitronConfigError unless this benchmark can run `shape` in `dtype` on `world_size`
        ranks of `backend`."""
        if shape.experts % world_size:
            raise DitronConfigError(f"{self.name}: --experts {shape.experts} is not a multiple of the "
                                    f"world size {world_size}; pass --experts k*{world_size}")
        if shape.topk > shape.experts:
            raise DitronConfigError(f"{self.name}: --topk {shape.topk} exceeds --experts {shape.experts}")
        allowed = self.dtypes[backend]
        if dtype not in allowed:
            raise DitronConfigError(f"{self.name} on {backend} ranks runs in {', '.join(allowed)} only, "
                                    f"not {dtype}; pass --dtype {allowed[0]} or leave {self.name} out of --bench")
