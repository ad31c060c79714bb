"""Autotuner over the plan's Core level: GEMM tile configs of the expert MLP's kernels and of the
tensor-parallel ops' dense GEMM.

A choice is searched on the GPU (`tune_grouped_mlp`: every candidate compiled, checked bitwise
against the default's output where the path's bits do not depend on the tile, and timed; the
fastest kept) and cached per key — op, shape bucket, dtype, world size, device name — in a JSON
file the user can ship with a model (`TuneCache`; `DITRON_TUNE_CACHE` names it, default
`~/.cache/ditron_ep/tuned_gemms.json`). A lookup that misses returns the deterministic defaults
(`hopper_path.default_hopper_configs`, `core_config.default_gemm_configs`), so an untuned machine
runs exactly what it ran before the tuner existed. The choice depends on nothing but the key, so
every rank that reads the same file makes the same choice; a tile that can change result bits
is therefore part of the plan's identity (`planned_expert_gemms` records it in `CorePlan.expert_gemms`,
with where it came from; `describe_choices` prints a call's choices).

The dense GEMM of the TP ops (`gemm.matmul` and the overlapped kernels, compiler/tp_plan.py) is
searched by `tune_tp_gemm` (op "tp_gemm", shape (rows bucket, K, N), world 1): only the tile's
column width, warps and stages vary, and a candidate is kept only if its output is bitwise equal
to the shape rule's tile (`tp_plan.sequential_tile`), whose rows per tile (the all-gather's chunk)
and K step (each output element's summation order) it keeps.

The EP copy kernels (dispatch and combine) are searched by `tune_ep_copy` (op "ep_copy", shape
(tokens bucket, H, K, programs), the job's world size): rows per chunk, columns per copy step and
warps (`EPCopyConfig`), on every rank together (the slowest rank's time decides, so every rank
chooses alike); none changes a result bit (checked). `EPBuffer` takes the entry when its caller
leaves all three unset and every rank found the same one.

Shape buckets: rows rounded up to a power of two (>= 128: the row count moves with routing, the
best tile does not move within a factor of two); H, I and the expert count exact (the weights).
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from ditron_ep.compiler.core_config import EXPERT_GEMMS, GemmTileConfig, default_expert_configs

__all__ = ["CACHE_ENV", "CACHE_VERSION", "EP_COPY_OP", "EPCopyConfig", "KERNELS", "TP_GEMM_OP", "TuneCache", "TuneKey",
           "choice_text", "default_cache_path", "describe_choices", "ep_copy_key", "hopper_candidates", "mlp_key",
           "parse_choice", "planned_expert_gemms", "rows_bucket", "tp_gemm_candidates", "tp_gemm_key", "tune_ep_copy",
           "tune_grouped_mlp", "tune_tp_gemm", "tuned_choices", "tuned_ep_copy", "tuned_tp_tile"]

CACHE_ENV = "DITRON_TUNE_CACHE"
CACHE_VERSION = 2  # 2: rows buckets are the nearest power of two (1: the next one up)


def default_cache_path() -> Path:
    """$DITRON_TUNE_CACHE, else ~/.cache/ditron_ep/tuned_gemms.json."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "ditron_ep" / "tuned_gemms.json"


def rows_bucket(rows: int) -> int:
    """The power of two nearest to rows on a log scale (at least 128) that a row count is tuned
    under: rows in [b/sqrt(2), b*sqrt(2)) share bucket b. Nearest, not the next one up: an EP
    layer tuned at T*K rows receives T*K rows give or take a few per rank, and with "the next
    power of two up" every rank that got one row more than T*K missed the entry."""
    rows = int(rows)
    if rows <= 128:
        return 128
    low = 1 << (rows.bit_length() - 1)
    return 2 * low if rows * rows >= 2 * low * low else low


@dataclasses.dataclass(frozen=True)
class TuneKey:
    """What a tuned choice is valid for."""

    op: str                 # e.g. "grouped_mlp.hopper.swiglu"
    shape: tuple[int, ...]  # bucketed: (rows bucket, H, I, E_local)
    dtype: str              # "bfloat16"
    world_size: int
    device: str             # torch.cuda.get_device_name()

    def text(self) -> str:
        return f"{self.op}|{'x'.join(map(str, self.shape))}|{self.dtype}|W{self.world_size}|{self.device}"

    @classmethod
    def parse(cls, text: str) -> TuneKey:
        try:
            op, shape, dtype, world, device = text.split("|", 4)
            if not world.startswith("W"):
                raise ValueError
            return cls(op, tuple(int(v) for v in shape.split("x")), dtype, int(world[1:]), device)
        except ValueError:
            raise ValueError(f"tune cache key {text!r}: expected op|d0xd1x...|dtype|W<world>|device") from None


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def mlp_key(op: str, dtype: torch.dtype, device: torch.device, *, rows: int, hidden: int, inter: int, num_local: int,
            world_size: int | None = None) -> TuneKey:
    """The key of a grouped-MLP kernel family at this shape."""
    return TuneKey(op, (rows_bucket(rows), hidden, inter, num_local), str(dtype).removeprefix("torch."),
                   _world_size() if world_size is None else world_size, _key_device(device))


def _key_device(device: torch.device) -> str:
    """The device field of a key: the GPU's name (torch.cuda.get_device_name), else the device type."""
    return _device_name(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else device.type


Choice = tuple  # (path, GemmTileConfig): path "portable" or "hopper"
PATH_NAMES = ("portable", "hopper")


def choice_text(choice: Choice) -> str:
    return f"{choice[0]}:{choice[1]}"


def parse_choice(text: str) -> Choice:
    """ "hopper:BM128-BN256-BK64-w8-s4" -> ("hopper", GemmTileConfig(128, 256, 64, 8, 4))."""
    path, sep, cfg = text.partition(":")
    if not sep or path not in PATH_NAMES:
        raise ValueError(f"kernel choice {text!r}: expected <path>:<tile> with path in {PATH_NAMES}")
    return path, GemmTileConfig.parse(cfg)


class TuneCache:
    """The JSON file of tuned choices: {"version": 2, "entries": {key text: {"choices": {kernel:
    "path:BM..-BN..-BK..-w..-s.."}, "ms": {kernel: median ms}, "measured": ISO time}}}. Read once
    per process and file version (mtime); written atomically (temp file + rename)."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else default_cache_path()
        self._entries: dict[str, dict] | None = None
        self._mtime: float | None = None

    def entries(self) -> dict[str, dict]:
        try:
            mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            self._entries, self._mtime = {}, None
            return self._entries
        if self._entries is None or mtime != self._mtime:
            try:
                data = json.loads(self.path.read_text())
            except ValueError as exc:
                raise ValueError(f"{self.path} is not valid JSON ({exc}): delete it or point {CACHE_ENV} "
                                 f"elsewhere") from None
            if isinstance(data, dict) and data.get("version") == 1:
                raise ValueError(f"{self.path} is a version 1 tune cache: its row buckets were the next power of "
                                 f"two up, now they are the nearest; tune again (python -m ditron_ep tune) into a new "
                                 f"file, or delete it")
            if not isinstance(data, dict) or data.get("version") != CACHE_VERSION \
                    or not isinstance(data.get("entries"), dict):
                raise ValueError(f"{self.path} is not a ditron_ep tune cache (version {CACHE_VERSION}): "
                                 f"delete it or point {CACHE_ENV} elsewhere")
            for text in data["entries"]:
                TuneKey.parse(text)
            self._entries, self._mtime = data["entries"], mtime
        return self._entries

    def get(self, key: TuneKey) -> dict[str, Choice] | None:
        """The tuned choices of `key` (kernel -> (path, tile)), or None (a miss)."""
        texts = self.get_text(key)
        if texts is None:
            return None
        try:
            return {k: parse_choice(v) for k, v in texts.items()}
        except (TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"{self.path}: entry {key.text()!r} is malformed ({exc}); delete it or re-tune") from None

    def get_text(self, key: TuneKey) -> dict[str, str] | None:
        """The raw choice strings of `key` (kernel -> text), or None (a miss)."""
        entry = self.entries().get(key.text())
        if entry is None:
            return None
        if not isinstance(entry, dict) or not isinstance(entry.get("choices"), dict):
            raise ValueError(f"{self.path}: entry {key.text()!r} is malformed; delete it or re-tune")
        return dict(entry["choices"])

    def put(self, key: TuneKey, choices: dict[str, Choice], ms: dict[str, float] | None = None) -> None:
        """Record `choices` for `key` and write the file."""
        self.put_text(key, {k: choice_text(v) for k, v in choices.items()}, ms)

    def put_text(self, key: TuneKey, choices: dict[str, str], ms: dict[str, float] | None = None) -> None:
        """Record raw choice strings (kernel -> text) for `key` and write the file."""
        entries = dict(self.entries())
        entries[key.text()] = {"choices": dict(choices),
                               "ms": {k: round(v, 5) for k, v in (ms or {}).items()},
                               "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tune-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)
        self._entries, self._mtime = entries, self.path.stat().st_mtime


_CACHES: dict[Path, TuneCache] = {}


def _cache(path: str | os.PathLike | None = None) -> TuneCache:
    p = Path(path) if path is not None else default_cache_path()
    if p not in _CACHES:
        _CACHES[p] = TuneCache(p)
    return _CACHES[p]


KERNELS = EXPERT_GEMMS


def mlp_op(activation_code: int) -> str:
    return f"grouped_mlp.act{activation_code}"


def tuned_choices(dtype: torch.dtype, device: torch.device, *, rows: int, hidden: int, inter: int, num_local: int,
                  activation_code: int = 0, cache: TuneCache | None = None) -> dict[str, Choice] | None:
    """The tuned (path, tile) of each expert-MLP kernel at this shape, or None when the cache has
    no entry (the caller's deterministic defaults apply)."""
    if device.type != "cuda":
        return None
    key = mlp_key(mlp_op(activation_code), dtype, device, rows=rows, hidden=hidden, inter=inter, num_local=num_local)
    return (cache or _cache()).get(key)


def describe_choices(choices: dict[str, Choice], tuned: dict[str, Choice] | None) -> str:
    """One line per kernel: its path and tile, and whether the tuner chose it."""
    return "\n".join(f"  {k}: {p} {cfg} ({'tuned' if tuned and tuned.get(k) == (p, cfg) else 'default'})"
                     for k, (p, cfg) in choices.items())


def planned_expert_gemms(spec) -> tuple[tuple[str, str], ...]:
    """(kernel, "path:tile (tuned|default)") of the expert GEMMs a plan's staged schedule and
    backward run (grouped_mlp on the layer's received rows, SwiGLU), for CorePlan: the tuned
    choice when this machine's cache has one for the spec's shape, else the portable defaults
    (core_config.default_expert_configs)."""
    dtype = getattr(torch, spec.dtype)
    choices = {k: ("portable", cfg) for k, cfg in default_expert_configs(dtype, spec.device_type).items()}
    tuned = None
    if spec.device_type == "cuda" and torch.cuda.is_available() and torch.version.hip is None:
        tuned = tuned_choices(dtype, torch.device("cuda", torch.cuda.current_device()),
                              rows=spec.max_tokens * spec.topk, hidden=spec.hidden, inter=spec.ffn_hidden,
                              num_local=spec.num_experts // spec.world_size)
        choices.update(tuned or {})
    return tuple((k, f"{choice_text(c)} ({'tuned' if tuned and k in tuned else 'default'})")
                 for k, c in choices.items())


def hopper_candidates(kernel: str) -> list[GemmTileConfig]:
    """Tiles the search tries for one Hopper kernel: 128 rows over two warpgroups (or 256 rows,
    two row blocks a warpgroup), BN 128 / 256 (the gated first GEMM: 64 / 128 a half), BK 64
    (128-byte rows: the 128-byte swizzle), 3 or 4 stages where they fit 220 KiB."""
    nj = 2 if kernel == "up" else 1
    out = []
    for bm, bns in ((128, (64, 128) if kernel in ("up", "act_grad") else (128, 256)), (256, (128,))):
        for bn in bns:
            stage_bytes = (bm * 64 + nj * 64 * bn) * 2
            for stages in (3, 4):
                if stages * stage_bytes <= 220 * 1024:
                    out.append(GemmTileConfig(bm, bn, 64, 8, stages))
    return out


def _median_ms(fn: Callable[[], None], reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def tune_grouped_mlp(x: torch.Tensor, expert_offsets: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *,
                     activation: str = "swiglu", reps: int = 10, cache: TuneCache | None = None,
                     log: Callable[[str], None] | None = None, world_size: int | None = None) -> dict[str, Choice]:
    """Search the (path, tile) of each expert-MLP kernel at this shape on the GPU and record the
    fastest in the cache; returns the choices. Candidates: the portable default tile and the
    Hopper tiles of `hopper_candidates` (when the Hopper path can run these inputs). Every
    candidate's output must be finite and within 2 % of the portable default's largest value
    (the paths round differently); one that fails or does not compile is skipped and logged.
    Kernels are searched in data-flow order, each reading the chosen previous one's output.
    world_size: the job's, for the key (default this process's torch.distributed world, or 1)."""
    from ditron_ep.compiler.core_config import default_gemm_configs
    from ditron_ep.ops.moe_layer import hopper_path
    from ditron_ep.ops.moe_layer.experts import activation_code, width_factor
    from ditron_ep.ops.moe_layer.grouped import kernel_choices, kernel_launcher

    act = activation_code(activation)
    rows, hidden = x.shape
    inter, width, num_local = w2.shape[1], w1.shape[2], w1.shape[0]
    if x.device.type != "cuda" or width != width_factor(activation) * inter:
        raise ValueError(f"tune_grouped_mlp needs CUDA inputs and w1 of width {width_factor(activation)} * I = "
                         f"{width_factor(activation) * inter}, got {x.device} and {width}")
    dev, dt = x.device, x.dtype
    programs = torch.cuda.get_device_properties(dev).multi_processor_count
    chosen = kernel_choices("portable", x, w1, w2, None, num_local, act, default_gemm_configs(dt, "cuda"))
    hopper_ok = hopper_path.path_problem(x, w1, w2, None, hopper_path.default_hopper_configs()) is None
    bufs = {"z": torch.empty((rows, width), dtype=dt, device=dev), "h": torch.empty((rows, inter), dtype=dt, device=dev),
            "y": torch.empty((rows, hidden), dtype=dt, device=dev), "dz": torch.empty((rows, width), dtype=dt, device=dev),
            "dx": torch.empty_like(x), "dy": torch.randn((rows, hidden), dtype=dt, device=dev) * 0.1,
            "g1": torch.empty(w1.shape, dtype=dt, device=dev)}
    best_ms: dict[str, float] = {}
    for kernel in KERNELS:
        candidates = [chosen[kernel]] + ([("hopper", c) for c in hopper_candidates(kernel)] if hopper_ok else [])
        ref = None
        best = (float("inf"), chosen[kernel])
        for choice in candidates:
            try:
                fn, out = kernel_launcher(kernel, choice, x, expert_offsets, w1, w2, bufs, programs, act)
                out.fill_(float("nan"))
                fn()
                got = out.float()
                if ref is None:
                    ref, scale = got.clone(), got.abs().max().item() or 1.0
                err = (got - ref).abs().max().item()
                if not err <= 0.02 * scale:
                    raise ValueError(f"output differs from the portable default's by {err:.3g} (scale {scale:.3g})")
                ms = _median_ms(fn, reps)
            except Exception as exc:  # noqa: BLE001 - a candidate that fails is skipped, not fatal
                if log:
                    log(f"{kernel} {choice_text(choice)}: skipped ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:120] if str(exc) else ''})")
                continue
            if log:
                log(f"{kernel} {choice_text(choice)}: {ms:.4f} ms")
            if ms < best[0]:
                best = (ms, choice)
        chosen[kernel], best_ms[kernel] = best[1], best[0]
        fn, _ = kernel_launcher(kernel, best[1], x, expert_offsets, w1, w2, bufs, programs, act)
        fn()  # the chosen kernel's output feeds the next kernel's search
    key = mlp_key(mlp_op(act), dt, dev, rows=rows, hidden=hidden, inter=inter, num_local=num_local,
                  world_size=world_size)
    (cache or _cache()).put(key, chosen, best_ms)
    return chosen


# ---------------------------------------------------------------- the TP ops' dense GEMM
TP_GEMM_OP = "tp_gemm"


def tp_gemm_key(dtype: torch.dtype, device: torch.device, *, rows: int, k: int, n: int) -> TuneKey:
    """The key of the TP ops' dense GEMM [rows, k] @ [k, n]: world size 1 (a GEMM on one rank's
    operands; which ranks share the tile is settled where it matters, tp/functional.py)."""
    return TuneKey(TP_GEMM_OP, (rows_bucket(rows), k, n), str(dtype).removeprefix("torch."), 1, _key_device(device))


def tuned_tp_tile(dtype: torch.dtype, *, rows: int, k: int, n: int,
                  cache: TuneCache | None = None) -> GemmTileConfig | None:
    """The tuned tile of the TP dense GEMM at this shape on this process's GPU, or None (a miss, or
    no GPU: the shape rule applies)."""
    if not torch.cuda.is_available():
        return None
    got = (cache or _cache()).get(tp_gemm_key(dtype, torch.device("cuda", torch.cuda.current_device()),
                                              rows=rows, k=k, n=n))
    return got["gemm"][1] if got and "gemm" in got else None


SMEM_LIMIT = 220 * 1024  # bytes of shared memory a candidate's pipeline may take (H100/H200: 227 KiB)


def tp_gemm_candidates(rule: GemmTileConfig, element_size: int) -> list[GemmTileConfig]:
    """Tiles the TP GEMM search tries besides `rule`: the rule's rows per tile and K step (the
    all-gather's chunk and the summation order), 64 / 128 / 256 columns, 8 warps, or 4 up to
    128 x 128 outputs (one warpgroup's accumulator of a larger tile spills), 3-5 stages that fit
    SMEM_LIMIT."""
    out = []
    for bn in (64, 128, 256):
        for warps in (4, 8):
            if warps == 4 and rule.block_m * bn > 128 * 128:
                continue
            for stages in (3, 4, 5):
                if (rule.block_m + bn) * rule.block_k * element_size * stages > SMEM_LIMIT:
                    continue
                cfg = GemmTileConfig(rule.block_m, bn, rule.block_k, warps, stages)
                if cfg != rule:
                    out.append(cfg)
    return out


def tune_tp_gemm(rows: int, k: int, n: int, dtype: torch.dtype = torch.bfloat16, *, reps: int = 10,
                 cache: TuneCache | None = None, log: Callable[[str], None] | None = None) -> GemmTileConfig:
    """Search the TP dense GEMM's tile at [rows, k] @ [k, n] on this process's GPU and record the
    fastest in the cache; returns it. b is read as an nn.Linear weight's transpose (the TP
    modules' layout). The shape rule's tile (`tp_plan.sequential_tile`) is the reference: a
    candidate whose output is not bitwise equal to it, or that fails to compile, is skipped and
    logged, so a tuned tile never changes a result bit (nor the overlapped kernels' equality with
    the sequential schedule)."""
    from ditron_ep.compiler.tp_plan import sequential_tile
    from ditron_ep.ops.tp.gemm import matmul_with_tile

    if not torch.cuda.is_available():
        raise ValueError("tune_tp_gemm times kernels on a CUDA GPU and none is visible")
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(rows, k, generator=gen, device=dev).to(dtype)
    b = (torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).to(dtype).t()
    rule = sequential_tile(str(dtype).removeprefix("torch."), "cuda", rows, n)
    out = torch.empty((rows, n), dtype=dtype, device=dev)
    ref = matmul_with_tile(a, b, rule)
    best = (_median_ms(lambda: matmul_with_tile(a, b, rule, out=out), reps), rule)
    if log:
        log(f"{rule} (shape rule): {best[0]:.4f} ms")
    for cfg in tp_gemm_candidates(rule, a.element_size()):
        try:
            out.fill_(float("nan"))
            matmul_with_tile(a, b, cfg, out=out)
            if not torch.equal(out, ref):
                raise ValueError("output bits differ from the shape rule's tile")
            ms = _median_ms(lambda: matmul_with_tile(a, b, cfg, out=out), reps)
        except Exception as exc:  # noqa: BLE001 - a candidate that fails is skipped, not fatal
            if log:
                log(f"{cfg}: skipped ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})")
            continue
        if log:
            log(f"{cfg}: {ms:.4f} ms")
        if ms < best[0]:
            best = (ms, cfg)
    (cache or _cache()).put(tp_gemm_key(dtype, dev, rows=rows, k=k, n=n), {"gemm": ("portable", best[1])},
                            {"gemm": best[0]})
    return best[1]


# ---------------------------------------------------------------- the EP copy kernels
EP_COPY_OP = "ep_copy"


@dataclasses.dataclass(frozen=True)
class EPCopyConfig:
    """The EP copy kernels' tiling: tokens per signalled chunk, columns per copy step, warps."""

    block_rows: int
    block_hidden: int
    num_warps: int

    def __str__(self) -> str:
        return f"rows{self.block_rows}-cols{self.block_hidden}-w{self.num_warps}"

    @classmethod
    def parse(cls, text: str) -> EPCopyConfig:
        m = re.fullmatch(r"rows(\d+)-cols(\d+)-w(\d+)", text.strip())
        if m is None:
            raise ValueError(f"EP copy config {text!r}: expected rows<R>-cols<C>-w<warps>, e.g. rows16-cols1024-w16")
        return cls(*(int(g) for g in m.groups()))

    def word(self) -> int:
        """One int for the ranks' agreement (0 stands for "none"): log2 sizes and warps."""
        return self.block_rows.bit_length() | self.block_hidden.bit_length() << 5 | self.num_warps.bit_length() << 10


def ep_copy_key(dtype: torch.dtype, device: torch.device, *, max_tokens: int, hidden: int, topk: int,
                world_size: int, num_programs: int) -> TuneKey:
    """The key of the EP copy kernels for a buffer of this shape, SM budget and job size."""
    return TuneKey(EP_COPY_OP, (rows_bucket(max_tokens), hidden, topk, num_programs),
                   str(dtype).removeprefix("torch."), world_size, _key_device(device))


def tuned_ep_copy(key: TuneKey, cache: TuneCache | None = None) -> EPCopyConfig | None:
    """The tuned EP copy config of `key`, or None (a miss: EPBuffer's defaults apply)."""
    cache = cache or _cache()
    got = cache.get_text(key)
    if not got or "copy" not in got:
        return None
    try:
        return EPCopyConfig.parse(got["copy"])
    except ValueError as exc:
        raise ValueError(f"{cache.path}: entry {key.text()!r}: {exc}; delete it or re-tune") from None


# rows per chunk, columns per step and warps around the defaults (16, 2,048 bytes, 16 warps on
# NVIDIA): at 24 of 132 SMs, 32 rows and 16 warps took the dispatch 801 -> 686 µs on 2xH200
# (bench/results/ep_sm_budget_graph_H200x2_20261128_s29.log)
EP_COPY_CANDIDATES = tuple(EPCopyConfig(r, h, w) for r in (16, 32) for w in (8, 16) for h in (512, 1024, 2048))


def tune_ep_copy(group, num_experts: int, hidden: int, max_tokens: int, topk: int, dtype: torch.dtype = torch.bfloat16,
                 *, num_programs: int | None = None, candidates: tuple[EPCopyConfig, ...] | None = None,
                 reps: int = 10, cache: TuneCache | None = None,
                 log: Callable[[str], None] | None = None) -> EPCopyConfig:
    """Collective (every rank of `group`): search the EP copy config of a buffer of this shape on
    this machine and record the fastest in every rank's cache; returns it (the same on every rank).

    Each candidate builds an EPBuffer and runs a round of dispatch, exact combine and rank-reduced
    combine on uniform top-k routing; a candidate whose received rows or outputs differ from the
    first candidate's (bit for bit, on any rank) or that fails on any rank is skipped. Timed: the
    round as CUDA-graph replays on GPUs (no host time: the configs differ in the kernels only),
    else as eager calls; each rank's median, the slowest rank's decides."""
    import torch.distributed as dist

    from ditron_ep.ops.ep.buffer import EPBuffer

    cands = list(candidates or EP_COPY_CANDIDATES)
    rank = dist.get_rank(group)
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")

    def slowest(value: float) -> float:  # every rank's value, the largest (collective)
        t = torch.tensor([value], dtype=torch.float64, device=on)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.item()

    ref: list[torch.Tensor] | None = None
    best: tuple[float, EPCopyConfig] | None = None
    key = None
    for cfg in cands:
        buf = None
        same = False
        try:  # EPBuffer raises alike on every rank (its agreement); a kernel fails alike too
            buf = EPBuffer(group, num_experts, hidden, max_tokens, topk, dtype, num_programs=num_programs,
                           block_rows=cfg.block_rows, block_hidden=cfg.block_hidden, num_warps=cfg.num_warps,
                           graph_cache=0)
            gen = torch.Generator().manual_seed(1234 + rank)
            x = torch.randn(max_tokens, hidden, generator=gen).to(dtype).to(buf.device)
            w, idx = torch.rand(max_tokens, num_experts, generator=gen).topk(topk, dim=1)
            idx, w = idx.to(buf.device), (w / w.sum(1, keepdim=True)).to(buf.device)
            r, h = buf.dispatch(x, idx, w)
            got = [r, buf.combine(r, h, w), buf.combine(r, h, topk_sum="expert_rank")]
            same = ref is None or all(torch.equal(a, b) for a, b in zip(got, ref))
        except Exception as exc:  # noqa: BLE001 - a candidate that fails is skipped, not fatal
            if log:
                log(f"{cfg}: failed on rank {rank} ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
        good = slowest(0.0 if same else 1.0) == 0.0   # every rank checked it (the ranks time together)
        ms = slowest(_ep_round_ms(buf, x, idx, w, reps, group)) if good else float("inf")
        if good and ref is None:
            ref = [t.clone() for t in got]
        if good and key is None:
            key = ep_copy_key(dtype, buf.device, max_tokens=max_tokens, hidden=hidden, topk=topk,
                              world_size=dist.get_world_size(group), num_programs=buf.num_programs)
        if buf is not None and not buf.freed:
            buf.free()
        if log:
            log(f"{cfg}: {ms:.4f} ms" if good else f"{cfg}: skipped (its bits differ from the first candidate's, "
                                                   f"or it failed)")
        if good and (best is None or ms < best[0]):
            best = (ms, cfg)
    if best is None or key is None:
        raise ValueError("tune_ep_copy: every candidate failed or differed; nothing recorded")
    (cache or _cache()).put_text(key, {"copy": str(best[1])}, {"copy": best[0]})
    return best[1]


def _ep_round_ms(buf, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, reps: int, group) -> float:
    """This rank's median ms of a dispatch + exact combine + rank-reduced combine round (the
    caller takes the slowest rank's): CUDA-graph replays on GPUs, eager calls elsewhere."""
    import torch.distributed as dist

    def graph_round():
        r, h = buf.dispatch(x, idx, w, sync=False)
        buf.combine(r, h, w)
        buf.combine(r, h, topk_sum="expert_rank")

    times = []
    if buf.device.type == "cuda":
        graph_round()  # compiles the graph-mode variants outside the capture
        torch.cuda.synchronize(buf.device)
        dist.barrier(group)
        graph = torch.cuda.CUDAGraph()
        gc.disable()  # a symmetric arena freed by a collection during capture would synchronise the device
        try:
            with torch.cuda.graph(graph):
                graph_round()
        finally:
            gc.enable()
        for _ in range(reps):
            dist.barrier(group)
            torch.cuda.synchronize(buf.device)
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        del graph
    else:
        for _ in range(reps):
            dist.barrier(group)
            t0 = time.perf_counter()
            r, h = buf.dispatch(x, idx, w)
            buf.combine(r, h, w)
            buf.combine(r, h, topk_sum="expert_rank")
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
