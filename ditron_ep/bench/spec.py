"""What a benchmark is, what it is asked to run, and what it returns.

* `Benchmark` — a registry entry: name, description, its options, the metric (GB/s or TFLOP/s) and
  how its work is counted, default shapes and token counts per backend, `plan(request, tokens,
  options, on_gpu) -> [Impl]` (what one config measures) and `run(ctx, tokens) -> [Measurement]`,
  called on every rank alike.
* `Impl` — one row of a config: ours, a baseline (its median is what ours' speedups divide), or a
  reference (another figure of the same run: a GEMM alone, a memory copy, a derived floor).
* `Option` — an entry's `--opt KEY=VALUE` setting.
* `BenchRequest` — one benchmark with its shape, token counts, dtype, iterations and options;
  plain picklable data, sent to every rank.
* `BenchContext` — a rank's view while running one request: its RankContext, the parsed options,
  and `time()`, which times a call on every rank (agreed failures, progress on rank 0).
* `Measurement` — one implementation at one token count: per-iteration times (slowest rank) or a
  derived figure, the work of one call, the verdict of its result check, details for the JSON.
* `Row` — a Measurement summarised for the table and the JSON report.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from ditron_ep.bench.ranks import RankContext, StageFailed, guarded
from ditron_ep.bench.timing import summarize, time_fn
from ditron_ep.check import ROUTING_KINDS
from ditron_ep.runtime import DitronConfigError

if TYPE_CHECKING:
    from ditron_ep.ops import EPBuffer

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KINDS = ("ours", "baseline", "reference")


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
    options: tuple[tuple[str, str], ...] = ()   # (key, value) of every --opt this benchmark declares


@dataclass(frozen=True)
class Impl:
    """One row of a config. `against` (ours only): the rows its speedups are computed against —
    baselines, or reference rows such as a floor — the first being `speedup`'s; `timed=False`: a
    figure derived from other rows."""
    name: str
    kind: str = "ours"
    against: tuple[str, ...] = ()
    timed: bool = True


@dataclass(frozen=True)
class Option:
    """An entry's `--opt KEY=VALUE`. `parse` turns the text into the value (ValueError says why
    not); `repeat`: may be given several times, the value is then the tuple of them in order."""
    key: str
    help: str
    parse: Callable[[str], Any] = str
    default: Any = None
    repeat: bool = False


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"must be a non-negative integer, got {value}")
    return value


def boolean(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"must be 0 or 1 (or true / false), got {text!r}")


def one_of(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {text!r}")
        return text
    return parse


def some_of(*choices: str) -> Callable[[str], tuple[str, ...]]:
    """A comma-separated, non-empty subset of `choices` (in `choices` order)."""
    def parse(text: str) -> tuple[str, ...]:
        items = {p.strip() for p in text.split(",") if p.strip()}
        bad = sorted(items - set(choices))
        if not items or bad:
            raise ValueError(f"must be a comma-separated list of {', '.join(choices)}, got {text!r}")
        return tuple(c for c in choices if c in items)
    return parse


@dataclass
class Measurement:
    """One implementation at one token count. `times_us`: slowest rank per iteration; `value_us`: a
    figure derived instead of timed; `work`: bytes or FLOPs of one call (the metric's numerator);
    `check`: what the result check found, `ok` its verdict; `error`: why nothing was measured;
    `details`: more figures for the JSON (not in the table)."""
    impl: str
    times_us: list[float] | None = None
    work: float | None = None
    check: str = ""
    ok: bool = True
    error: str | None = None
    value_us: float | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Row:
    """One (bench, impl, tokens) of a run: the JSON report's `rows` entry (see report.py)."""
    bench: str
    impl: str
    kind: str                 # "ours" | "baseline" | "reference"
    tokens: int
    hidden: int
    experts: int
    topk: int
    inter: int | None
    dtype: str
    routing: str
    world_size: int
    iters: int
    median_us: float | None   # of the timed iterations, or the derived figure
    p20_us: float | None      # None for a derived figure
    p80_us: float | None
    metric: str               # "GB/s" | "TFLOP/s"
    metric_value: float | None
    baseline: str | None      # the baseline `speedup` is against (ours rows only)
    speedup: float | None     # baseline median / this median
    speedups: dict[str, float] = field(default_factory=dict)   # per baseline of `against` (ours rows only)
    check: str = ""
    ok: bool = True
    error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def median_us(m: Measurement) -> float | None:
    """The median the table reports for a timed row (None: not timed, or failed)."""
    return summarize(m.times_us)["median"] if m.times_us and m.error is None else None


def measure_bandwidth(ctx: "BenchContext", impl: str, fn: Callable[[], object], moved: int,
                      label: str) -> tuple[Measurement, float | None]:
    """`fn` (a copy moving `moved` bytes) timed as row `impl`; (the row, its bandwidth in bytes/s,
    None if not timed), the row's check reading "<GB/s> GB/s (<label>)"."""
    m = ctx.measure(impl, fn, None, "", True, details={"bytes": moved})
    med = median_us(m)
    if med is None:
        return m, None
    bandwidth = moved / (med * 1e-6)
    m.check = f"{bandwidth / 1e9:,.1f} GB/s ({label})"
    m.details["bytes_per_s"] = bandwidth
    return m, bandwidth


def tolerance_check(rel: float, rtol: float) -> tuple[str, bool]:
    """(check text, verdict) of a relative error (ranks.relative_errors) against `rtol`."""
    ok = rel <= rtol
    return f"{'ok' if ok else 'FAIL'}: {rel:.1e} {'<=' if ok else '>'} rtol {rtol:g}", ok


def bitwise_check(same: bool, what: str) -> tuple[str, bool]:
    """(check text, verdict) of an output that must equal `what` bit for bit."""
    return (f"ok: bitwise == {what}" if same else f"FAIL: differs from {what}"), same


@dataclass(kw_only=True)
class BenchContext(RankContext):
    """A rank's view of one request while it runs; `label` names the config in progress."""
    request: BenchRequest
    options: Mapping[str, Any] = field(default_factory=dict)   # Benchmark.parse_options(request.options)
    progress: Callable[[str, int], None] | None = None         # (description, iterations done): rank 0
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
                buf: "EPBuffer | None" = None, details: dict[str, Any] | None = None) -> Measurement:
        """`time` `impl` into a Measurement with its check verdict, or with the agreed error."""
        try:
            return Measurement(impl, self.time(impl, fn, buf), work, check, ok, details=details or {})
        except StageFailed as exc:
            return Measurement(impl, None, work, check, False, error=str(exc), details=details or {})


def failed(impls: Sequence[str], error: str, work: float | None = None) -> list[Measurement]:
    """A Measurement carrying `error` for each of `impls` (a stage they all needed failed)."""
    return [Measurement(i, work=work, ok=False, error=error) for i in impls]


@dataclass(frozen=True)
class Benchmark:
    """A registry entry. `plan(request, tokens, options, on_gpu)` lists the rows of one config
    (ours, then baselines, then references); `run(ctx, tokens)` is called on every rank with the
    same arguments and returns a Measurement for each of them. `dtypes`: backend -> the dtypes
    it can run in (an error for another suggests the first); `routings`: the routing kinds it
    accepts; `ep`: the experts are spread over the ranks (E a multiple of the world size);
    `validate(request, options, world_size)`: why else the request cannot run, or None;
    `view(bench document, its rows)`: more renderables printed after its table."""
    name: str
    description: str
    metric: str
    work_rule: str
    check_rule: str
    shapes: Mapping[str, Shape]                 # backend ("emulated" | "torch") -> default shape
    tokens: Mapping[str, tuple[int, ...]]       # backend -> default token counts
    plan: Callable[[BenchRequest, int, Mapping[str, Any], bool], tuple[Impl, ...]]
    run: Callable[[BenchContext, int], list[Measurement]]
    options: tuple[Option, ...] = ()
    dtypes: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: {"emulated": tuple(DTYPES), "torch": tuple(DTYPES)})
    routings: tuple[str, ...] = ROUTING_KINDS
    ep: bool = True
    default: bool = True                        # run when --bench is not given
    validate: Callable[[BenchRequest, Mapping[str, Any], int], str | None] | None = None
    view: Callable[[Mapping[str, Any], Sequence[Mapping[str, Any]]], list[Any]] | None = None

    def parse_options(self, pairs: Sequence[tuple[str, str]]) -> dict[str, Any]:
        """Every declared option's value: its default, or parsed from `pairs` (a repeatable one
        as the tuple of its values). DitronConfigError for an undeclared key or a bad value."""
        declared = {o.key: o for o in self.options}
        values: dict[str, Any] = {o.key: (() if o.repeat else o.default) for o in self.options}
        for key, text in pairs:
            opt = declared.get(key)
            if opt is None:
                known = ", ".join(declared) or "none"
                raise DitronConfigError(f"{self.name} has no option {key!r} (its options: {known})")
            try:
                value = opt.parse(text)
            except ValueError as exc:
                raise DitronConfigError(f"{self.name}: --opt {key}={text}: {exc}") from None
            values[key] = (*values[key], value) if opt.repeat else value
        return values

    def impls_of(self, req: BenchRequest, on_gpu: bool) -> dict[str, tuple[str, ...]]:
        """kind -> the impls of that kind over every token count of `req` (first-seen order)."""
        out: dict[str, dict[str, None]] = {k: {} for k in KINDS}
        options = self.parse_options(req.options)
        for t in req.tokens:
            for impl in self.plan(req, t, options, on_gpu):
                out[impl.kind][impl.name] = None
        return {k: tuple(v) for k, v in out.items()}

    def check_request(self, req: BenchRequest, world_size: int, backend: str) -> None:
        """DitronConfigError unless this benchmark can run `req` on `world_size` ranks of `backend`."""
        shape, dtype = req.shape, req.dtype
        if self.ep and shape.experts % world_size:
            raise DitronConfigError(f"{self.name}: --experts {shape.experts} is not a multiple of the "
                                    f"world size {world_size}; pass --experts k*{world_size}")
        if shape.topk > shape.experts:
            raise DitronConfigError(f"{self.name}: --topk {shape.topk} exceeds --experts {shape.experts}")
        allowed = self.dtypes[backend]
        if dtype not in allowed:
            raise DitronConfigError(f"{self.name} on {backend} ranks runs in {', '.join(allowed)} only, "
                                    f"not {dtype}; pass --dtype {allowed[0]} or leave {self.name} out of --bench")
        if req.routing not in self.routings:
            raise DitronConfigError(f"{self.name} runs the routings {', '.join(self.routings)} only, not "
                                    f"{req.routing}")
        options = self.parse_options(req.options)
        problem = self.validate(req, options, world_size) if self.validate else None
        if problem:
            raise DitronConfigError(f"{self.name}: {problem}")
