"""`FusedMoE`: owns the heap and the verified plan of the fused EP MoE megakernel.

Per call: the sender-side layout (one Triton launch for T <= 16, else three), the counts exchange,
which also builds the row-tile map (one launch), then ONE persistent launch of `moe_fused_kernel` that runs
dispatch, both expert GEMMs and combine, overlapped at tile granularity (schedule "overlap") or
stage by stage (schedule "sequential": same binary, same tiles, stage barriers from the plan).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton

from ditron_ep.compiler.lowering import lower
from ditron_ep.compiler.plan import MoEPlan, MoESpec
from ditron_ep.ops.ep.buffer import (
    read_layout_status,
    record_fields,
    SUPPORTED_DTYPES,
    layout_status_numel,
    layout_status_words,
    raise_layout_status,
    raise_pending_flags,
)
from ditron_ep.ops.ep.functional import BufferSlot
from ditron_ep.ops.ep.layout_kernels import build_send_layout, exchange_layout, layout_landing_shape
from ditron_ep.ops.ep.layout_replay import layout_rows, padded_routing, route_nowhere_past
from ditron_ep.ops.moe_layer.experts import activation_code, check_activation, width_factor
from ditron_ep.ops.moe_layer.grouped import check_grad_dtype
from ditron_ep.ops.moe_layer.staged import FusedForwardStagedBackward
from ditron_ep.language.nvshmem import nvshmem_launcher
from ditron_ep.ops.moe_layer.fused_kernels import TIMER_CUDA, TIMER_HIP, TIMER_NONE, moe_fused_kernel
from ditron_ep.runtime import control as C
from ditron_ep.runtime.agreement import agree
from ditron_ep.runtime.call_graphs import CallGraphCache, graph_capture
from ditron_ep.runtime.errors import DitronConfigError
from ditron_ep.runtime.fast_launch import capturing, current_stream, fast
from ditron_ep.runtime.heap import SymmetricHeap
from ditron_ep.runtime.transport import put_peer_mask, put_signal_words, transport_problem
from ditron_ep.runtime.input_checks import FLOAT_DTYPES, INDEX_DTYPES, check_tensor, grad_needed
from ditron_ep.runtime.mode import gemm_dtype_problem

STAGES = ("dispatch_send", "dispatch_recv", "gemm_gate_up", "gemm_down", "combine_reduce")


def validate_inputs(x, topk_idx, topk_weights, w1, w2, *, dtype: torch.dtype, hidden: int, ffn_hidden: int,
                    num_local_experts: int, topk: int, device: torch.device, activation: str = "swiglu",
                    b1: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> None:
    """FusedMoE's argument checks: raise DitronConfigError saying what is wrong and how to fix it."""
    H, I, El, K, n = hidden, ffn_hidden, num_local_experts, topk, width_factor(activation)
    if not _inputs_pass(x, topk_idx, topk_weights, w1, w2, dtype, H, K, (El, H, n * I), (El, I, H), device):
        _check_inputs(x, topk_idx, topk_weights, w1, w2, dtype, H, I, El, K, device, n)
    layer = {"device": device, "owner": "the layer"}
    for name, t, shape in (("b1", b1, (("E_local", El), _width_dim(n, I))),
                           ("b2", b2, (("E_local", El), ("hidden", H)))):
        if t is not None:
            check_tensor(name, t, shape=shape, dtypes=(dtype,), dtype_hint="cast the biases to the layer's dtype",
                         **layer)


def _check_inputs(x, topk_idx, topk_weights, w1, w2, dtype, H, I, El, K, device, n) -> None:
    """The generic checks of validate_inputs, one message per problem."""
    layer = {"device": device, "owner": "the layer"}
    check_tensor("x", x, shape=(("T", None), ("hidden", H)), dtypes=(dtype,),
                 dtype_hint=f"cast it or build the layer with dtype={getattr(x, 'dtype', None)}", **layer)
    T = x.shape[0]
    check_tensor("topk_idx", topk_idx, shape=(("T", T), ("topk", K)), dtypes=INDEX_DTYPES, **layer)
    check_tensor("topk_weights", topk_weights, shape=(("T", T), ("topk", K)), dtypes=FLOAT_DTYPES, **layer)
    for name, t, shape in (("w1", w1, (("E_local", El), ("hidden", H), _width_dim(n, I))),
                           ("w2", w2, (("E_local", El), ("ffn_hidden", I), ("hidden", H)))):
        check_tensor(name, t, shape=shape, dtypes=(dtype,), dtype_hint="cast the weights to the layer's dtype",
                     contiguous=False, **layer)  # weights: any strides


def _inputs_pass(x, topk_idx, topk_weights, w1, w2, dtype, hidden, topk, w1_shape, w2_shape, device) -> bool:
    """True when every check of validate_inputs would pass, decided in a few Python operations: the
    generic checks (which word the errors) took 16-29 µs of host time per call on a lent H200
    host, and at T=128 the GPU waits for the host. False: the generic checks run and raise."""
    ts = (x, topk_idx, topk_weights, w1, w2)
    if not all(isinstance(t, torch.Tensor) for t in ts):
        return False
    return (x.dtype == dtype and w1.dtype == dtype and w2.dtype == dtype and topk_idx.dtype in INDEX_DTYPES
            and topk_weights.dtype in FLOAT_DTYPES and x.dim() == 2 and x.shape[1] == hidden
            and topk_idx.shape == (x.shape[0], topk) and topk_weights.shape == topk_idx.shape
            and w1.shape == w1_shape and w2.shape == w2_shape
            and all(t.device == device for t in ts) and all(t.is_contiguous() for t in ts[:3]))


def _width_dim(n: int, inter: int) -> tuple[str, int]:
    """The (name, size) of w1's and b1's last dimension: n * ffn_hidden (n = 2 when gated)."""
    return (f"{n}*ffn_hidden" if n > 1 else "ffn_hidden", n * inter)


def _strides3(w: torch.Tensor) -> tuple[int, int, int]:
    """A weight's (expert, row, column) strides; the 1-D placeholders of a refused call: (0, 0, 1)."""
    return tuple(w.stride()) if w.dim() == 3 else (0, 0, 1)


def _ran_tasks(tm: torch.Tensor, t0: float, stage) -> torch.Tensor:
    """Rows of the µs timer `tm` for `stage`'s tasks that ran (the timer buffer starts zeroed: a
    task that never ran keeps 0), relative to t0."""
    seg = tm[stage.first_task:stage.first_task + stage.num_tasks]
    return seg[seg[:, 0] != 0] - t0


# x of at least this many bytes is copied into a replay's static buffer on a side stream, beside
# the layout graph: the copy takes ~28 µs at T=4096 (58 MiB) on an H200, while at T=128 (1.8 MiB)
# it takes ~2 µs and the side stream's own host calls (~15 µs) would delay a host-bound call.
_SIDE_COPY_BYTES = 16 << 20


@dataclass
class _CapturedCall:
    """One call signature's launches as CUDA graphs, with the static tensors they read and write."""

    x: torch.Tensor             # static inputs: each replay copies the call's inputs in
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    layout: torch.cuda.CUDAGraph  # layout launches + copy of the status words into `status`
    kernel: torch.cuda.CUDAGraph  # the megakernel, writing `out`
    ready: torch.cuda.Event       # recorded between the two replays: the layout (and status) is done
    inputs_in: torch.cuda.Event   # recorded after the small inputs' copies: x may be copied on the side
    x_in: torch.cuda.Event        # x is in the static buffer (the side stream's copy)
    copy_stream: torch.cuda.Stream  # copies x while the layout graph runs
    status: torch.Tensor          # pinned host copy of the layout status
    out: torch.Tensor | None = None  # allocated inside the capture, in the graphs' memory pool
    routed: int = -1              # rows of `topk_idx` that may hold a call's routing (-1: all)


def _padded_call(rows: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
    """(x, topk_idx, topk_weights) of a call as `rows` tokens, the tokens past the call's routed
    nowhere (their x and weight rows are never read)."""
    T = x.shape[0]
    xp = x.new_empty((rows, x.shape[1]))
    xp[:T].copy_(x)
    wp = topk_weights.new_zeros((rows, topk_weights.shape[1]))
    wp[:T].copy_(topk_weights)
    return xp, padded_routing(topk_idx, rows), wp


def _verified_plan(world, num_experts, hidden, ffn_hidden, max_tokens, topk, dtype, schedule, backend,
                   plan: MoEPlan | None, plan_overrides: dict) -> MoEPlan:
    """The layer's plan (lowered here unless given) after every check that needs no peer."""
    if dtype not in SUPPORTED_DTYPES:
        raise DitronConfigError(f"dtype {dtype} unsupported; use one of {SUPPORTED_DTYPES}")
    if num_experts % world:
        raise DitronConfigError(f"num_experts={num_experts} is not a multiple of the world size {world}")
    device_type = "cuda" if torch.cuda.is_available() and backend != "emulated" else "cpu"
    problem = gemm_dtype_problem(dtype)
    if problem:
        raise DitronConfigError(problem)
    if device_type == "cuda" and plan is None:
        # one program per SM of this device (the plan's default assumes an H100/H200's 132)
        plan_overrides.setdefault("num_programs", torch.cuda.get_device_properties(
            torch.cuda.current_device()).multi_processor_count)
    if plan is None:
        plan = lower(MoESpec(world_size=world, num_experts=num_experts, topk=topk, hidden=hidden,
                             ffn_hidden=ffn_hidden, max_tokens=max_tokens, dtype=str(dtype).removeprefix("torch."),
                             device_type=device_type, schedule=schedule, **plan_overrides))
    plan.require_verified()  # kernels refuse an unverified plan (e.g. one edited by hand)
    r = plan.routing
    if (r.world_size, r.num_experts, r.topk, r.hidden, r.ffn_hidden, r.max_tokens) != (
            world, num_experts, topk, hidden, ffn_hidden, max_tokens):
        raise DitronConfigError("the plan was lowered for another shape; lower it for this layer's shape")
    if not plan.device.combine_fused:
        raise DitronConfigError("combine_fused=False is a plan variant the megakernel does not implement; "
                                "leave combine_fused at its default")
    return plan


class FusedMoE:
    """Fused EP MoE forward over `group`: out = combine(experts(dispatch(x))) in one launch.

    Args mirror `EPBuffer`, plus ffn_hidden (I), the schedule, the experts' activation
    (experts.ACTIVATIONS: w1 is [E_local, H, 2I] for gated ones, [E_local, H, I] for plain ones;
    biases are per call, optional) and Device-level plan overrides
    (num_programs, chunk_rows, source_order, gemm_tile_order, gemm_group_rows, block_t, tile configs): any of
    them changes which program runs what and when (the trace) but not one bit of the result.
    `plan`: a plan lowered or edited elsewhere (by hand, say); it must be verified.
    check_errors: default mode only: also read the device error slot after the megakernel (a
    second host read, which waits for the whole layer) so that a timeout inside it raises in the
    same call rather than at the next call's read. Off by default: the output's shape needs no
    host read, and waiting for the layer kept the GPU idle while the host issued the next call.
    graph_cache (CUDA, default mode): how many call signatures (tokens: T rounded up to a power
    of two from 16, at most max_tokens_per_rank, the rows past a call's routed nowhere
    (layout_replay.layout_rows); index / weight dtypes; weight addresses) keep their launches as
    CUDA graphs, captured on a signature's
    second call and replayed after (runtime/call_graphs.py): the same kernels and arguments, so the
    same bits, for about 100 µs of host time (input copies, the replays, the output clone, the
    status read) instead of 350-650 µs. Each costs graph memory of about
    2*rows*H activations plus the layout buffers; 0 launches every call directly.
    transport (runtime/transport.py, as in `EPBuffer`): "auto" / "pointer" store through peer
    pointers; "put" (backend "nvshmem") moves the dispatch's tokens and the down GEMM's rows to
    every peer by NVSHMEM put-with-signal instead — a chunk staged in a symmetric send area and
    put as one block; a row put whole, with its (token, k) counter's add, once its row tile's last
    column tile is done — with the same bits. The layout exchange and the call barriers use peer
    pointers on every transport.
    Every call reuses the layer's heap, signals and captured graphs, so calls run in the order of
    the CUDA stream they are issued on: issue them on one stream (or order the streams yourself).
    """

    def __init__(self, group: dist.ProcessGroup | None, num_experts: int, hidden: int, ffn_hidden: int,
                 max_tokens_per_rank: int, topk: int, dtype: torch.dtype = torch.bfloat16, *,
                 schedule: str = "overlap", activation: str = "swiglu", backend: str = "auto",
                 wait_budget: int | None = None, check_errors: bool = False, graph_cache: int = 4,
                 transport: str = "auto", plan: MoEPlan | None = None, **plan_overrides) -> None:
        if not dist.is_initialized():
            raise DitronConfigError("FusedMoE needs torch.distributed initialised (init_process_group first)")
        world = dist.get_world_size(group)
        problem = None
        try:
            transport_error = transport_problem(transport, backend, world)
            if transport_error is not None:
                raise DitronConfigError(transport_error)
            self.activation = check_activation(activation)
            self.plan: MoEPlan = _verified_plan(world, num_experts, hidden, ffn_hidden, max_tokens_per_rank, topk,
                                                dtype, schedule, backend, plan, plan_overrides)
            self._graphs: CallGraphCache[_CapturedCall] = CallGraphCache(graph_cache)
            self._padded_keys: set[tuple] = set()  # call signatures whose kernels compiled on padded rows
        except Exception as err:  # noqa: BLE001 - DitronConfigError, PlanError, bad overrides, device queries
            problem = f"{err}" if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"
        # every rank raises alike before the heap's set-up (a lone raise would leave peers waiting)
        agree(group, "FusedMoE", problem, same={
            "num_experts": num_experts, "hidden": hidden, "ffn_hidden": ffn_hidden,
            "max_tokens_per_rank": max_tokens_per_rank, "topk": topk, "dtype": dtype, "schedule": schedule,
            "activation": activation, "transport": transport})
        self.num_experts, self.hidden, self.ffn_hidden, self.topk, self.dtype = num_experts, hidden, ffn_hidden, topk, dtype
        self.check_errors = bool(check_errors)
        self.group = group
        self.max_tokens, self.world_size, self.num_local_experts = max_tokens_per_rank, world, num_experts // world
        dev = self.plan.device
        landing = layout_landing_shape(world, self.num_local_experts)
        layout_bytes = triton.cdiv(math.prod(landing) * 4, 256) * 256
        # the put transport's send areas (tokens and metadata by destination, down rows by GEMM row)
        # and its uint64 flag and land signals (plus a local counter per row tile), after the plan's
        puts = transport == "put"
        rows = next(b.shape[0] for b in dev.buffers if b.name == "gemm/rows")
        K, H, T = topk, hidden, max_tokens_per_rank
        put_specs = [("moe/send_x", (world, T, H), dtype), ("moe/send_meta", (world, T, 1 + 2 * K), torch.int32),
                     ("moe/send_land", (rows, H), dtype)] if puts else []
        put_bytes = sum(triton.cdiv(math.prod(sh) * torch.empty((), dtype=dt).element_size(), 256) * 256
                        for _, sh, dt in put_specs)
        n_flags, n_land = world * self.plan.routing.n_chunks, T * K
        put_signals = (2 * n_flags + 1) + (2 * n_land + 1) + dev.n_row_tiles_max if puts else 0
        self.heap = SymmetricHeap(group, backend=backend,
                                  size_bytes=dev.heap_bytes + 256 + layout_bytes + 4 * world + put_bytes + 4 * put_signals,
                                  num_signals=dev.num_signals + world + put_signals, wait_budget=wait_budget)
        for fam in dev.signals:  # plan order: the heap hands out the same words
            if self.heap.alloc_signals(fam.name, fam.count) != fam.first:
                raise DitronConfigError(f"signal family {fam.name!r} does not land where the plan put it")
        self._sig_layout = self.heap.alloc_signals("moe/layout", world)
        for b in dev.buffers:
            self.heap.alloc(b.name, b.shape, getattr(torch, b.dtype))
            if self.heap.offset_of(b.name) - self.heap.data_offset != b.offset - dev.data_offset:
                raise DitronConfigError(f"buffer {b.name!r} does not land where the plan put it")
        self.heap.alloc("moe/layout", landing, torch.int32)
        self.transport = transport
        self._put_peers = put_peer_mask(self.heap, transport)
        for name, sh, dt in put_specs:
            self.heap.alloc(name, sh, dt)
        if puts:
            self._put_flag = put_signal_words(self.heap, "moe/put_flag", n_flags)
            self._put_land = put_signal_words(self.heap, "moe/put_land", n_land)
            self._put_tiles = self.heap.alloc_signals("moe/put_tiles", dev.n_row_tiles_max)
        self.device = self.heap.device
        self._pending_flags = torch.zeros(1, dtype=torch.int32, device=self.device)
        # Local counters the kernel expects at zero ("reset: layout launch" in the plan).
        self._zero_ranges: list[tuple[int, int]] = []  # adjacent families merged: one fill each
        for f in sorted((f for f in dev.signals if f.kind == "counter" and f.scope == "local"), key=lambda f: f.first):
            if self._zero_ranges and self._zero_ranges[-1][1] == f.first:
                self._zero_ranges[-1] = (self._zero_ranges[-1][0], f.first + f.count)
            else:
                self._zero_ranges.append((f.first, f.first + f.count))
        if puts:  # local counters the kernel resets itself; zeroed per call too, like the plan's
            self._zero_ranges.append((self._put_tiles, self._put_tiles + dev.n_row_tiles_max))
        self._clock = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.last_trace: torch.Tensor | None = None
        self.last_timer: torch.Tensor | None = None
        self._timer_dummy = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._timer_ns_per_tick = 1.0
        self._status_host: torch.Tensor | None = None  # pinned copy of the layout status (GPU)
        self._status_event: torch.cuda.Event | None = None
        self._build_launch_args()
        self._fields = record_fields(self.request(), self.device)  # the call record of every valid call
        self.staged_slot = BufferSlot(group)  # what the backward's staged recomputation dispatches on

    def request(self) -> dict:
        """The request fields this layer serves (a call record's shared arguments)."""
        return {"num_experts": self.num_experts, "hidden": self.hidden, "ffn_hidden": self.ffn_hidden,
                "topk": self.topk, "dtype": self.dtype, "activation": self.activation,
                "schedule": self.plan.device.schedule}

    @property
    def freed(self) -> bool:
        return self.heap.freed

    def _build_launch_args(self) -> None:
        """The megakernel's arguments that are fixed for the layer's life, built once: the eager
        path is bound by host time at small T (bench/results/HISTORY.md: host_overhead)."""
        plan, dev, core, h = self.plan, self.plan.device, self.plan.core, self.heap
        st = {s.name: s for s in dev.stages}
        seq = dev.schedule == "sequential"
        word = (lambda name: dev.signal(name).first) if seq else (lambda name: 0)
        self._tiles = h.local_view("gemm/tiles")
        self._ring_step = -1 if dev.source_order == "reverse_ring" else 1
        self._plan_args = (  # comm_programs .. sequential-only words
            dev.comm_programs, dev.recv_lag, dev.gemm_group_rows, h.ptr_table, h.signal_table,
            *(h.offset_of(n) for n in ("dispatch/x", "dispatch/meta", "gemm/tiles", "gemm/rows", "gemm/h",
                                       "combine/land")),
            # the put transport's flag and land families are uint64 words of their own (PUTS)
            self._put_flag if self._put_peers else dev.signal("dispatch_flag").first,
            dev.signal("rows_ready").first, dev.signal("gate_up_done").first,
            self._put_land if self._put_peers else dev.signal("land").first,
            word("stage_done.dispatch_send"), word("stage_done.dispatch_recv"), word("stage_done.gemm_gate_up"),
            word("stage_done.gemm_down"), word("stage_barrier.dispatch_recv"), word("stage_barrier.gemm_down"))
        self._shape_args = (  # H .. NT
            self.hidden, self.ffn_hidden, h.rank, self.world_size, self.num_local_experts, self.max_tokens,
            plan.routing.n_chunks, dev.n_row_tiles_max, dev.n_tiles1, dev.n_tiles2,
            *(st[n].first_task for n in STAGES[1:]), dev.num_tasks)
        interp = self.device.type != "cuda"
        self._constexprs = dict(
            K=self.topk, BLOCK_K=triton.next_power_of_2(self.topk), BM=core.gate_up.block_m, BN1=core.gate_up.block_n,
            BK1=core.gate_up.block_k, BN2=core.down.block_n, BK2=core.down.block_k, BLOCK_S=core.block_rows,
            BLOCK_H=core.block_h, BLOCK_T=dev.block_t, SEQUENTIAL=seq,
            REVERSE_RING=dev.source_order == "reverse_ring", BLOCK_W=triton.next_power_of_2(self.world_size),
            INPUT_PRECISION="ieee" if (interp or self.dtype == torch.float32) else "tf32",
            ACT=activation_code(self.activation),
            num_warps=core.gate_up.num_warps, num_stages=core.gate_up.num_stages, PUTS=bool(self._put_peers))
        self._put_args = (self._put_peers, *(h.offset_of(n) if self._put_peers else 0 for n in
                                             ("moe/send_x", "moe/send_meta", "moe/send_land")),
                          self._put_tiles if self._put_peers else 0)
        self._launcher = nvshmem_launcher if self._put_peers else fast

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor,
                w2: torch.Tensor, b1: torch.Tensor | None = None, b2: torch.Tensor | None = None, *,
                sync: bool = True, trace: bool = False, grad_dtype: torch.dtype | None = None) -> torch.Tensor:
        """out [T, H] = sum_k w[t,k] * MLP_{e(t,k)}(x[t]) with the layer's activation; shapes as
        in `ditron_ep.ops.moe` (b1 [E_local, n*I], b2 [E_local, H]: optional expert biases).

        sync=True: one device-to-host read, of the layout's status (the host waits for the layout
        launches, not for the megakernel, which runs on asynchronously): bad input on any rank
        makes every rank's megakernel refuse all work (no token moves) and raises here on every
        rank (a rank that rejects its own arguments runs the call flagged, with no tokens, so its
        peers raise too); so does a timeout recorded by an earlier launch. A timeout inside this call's
        megakernel raises at the next call's read (or `check()`), and the rank's launches refuse
        all work until then; check_errors=True waits for the megakernel and raises it here.
        On CUDA, from a call signature's second call on, these launches are replayed from CUDA
        graphs captured for it (`graph_cache`), with the same checks and results.
        sync=False: no host sync (CUDA-graph capturable); input problems are recorded for
        `check()`.
        trace=True records the logical start/end clock of every task in `last_trace` [NT, 2]
        and, on a GPU, the device timer in `last_timer` (see `timeline`).
        Gradients (x, topk_weights, w1, w2, b1, b2; sync=True): the backward recomputes the staged
        layer on the saved inputs and takes its autograd (staged.py); grad_dtype as in `moe`
        (torch.float32 with bf16 / fp16 weights: fp32 gradients into their `main_grad`).
        """
        if self.heap.freed:
            raise DitronConfigError("this FusedMoE was freed (free() was called); build a new one")
        try:
            self._validate(x, topk_idx, topk_weights, w1, w2, b1, b2)
            check_grad_dtype(grad_dtype)
            needs_grad = grad_needed(x, topk_weights, w1, w2, b1, b2)
            if needs_grad and (not sync or trace):
                raise NotImplementedError("FusedMoE with gradients needs sync=True and trace=False (its backward "
                                          "recomputes the layer with the staged schedule, which reads the host)")
        except (DitronConfigError, NotImplementedError):
            self.join_flagged(C.FLAG_REFUSED, None)
            raise
        if needs_grad:
            return FusedForwardStagedBackward.apply(self, x, topk_idx, topk_weights, w1, w2, b1, b2, grad_dtype)
        return self._forward(x, topk_idx, topk_weights, (w1, w2, b1, b2), sync, trace)

    def _forward(self, x, topk_idx, topk_weights, experts, sync, trace) -> torch.Tensor:
        """forward on validated inputs; experts = (w1, w2, b1, b2)."""
        if sync and not trace and x.device.type == "cuda" and not capturing(x.device):
            # one capture serves the calls of up to `rows` tokens, the rows past a call's routed
            # nowhere (layout_replay.layout_rows: the same bits; calls of changing T replay)
            T = x.shape[0]
            rows = layout_rows(T, self.max_tokens) if T <= self.max_tokens else T
            key = (rows, topk_idx.dtype, topk_weights.dtype, self.heap.wait_budget,
                   *((t.data_ptr(), t.stride()) if t is not None else None for t in experts))  # launches bake both in
            captured = self._graphs.lookup_or_give_up(
                key, lambda: self._capture_call(rows, x, topk_idx, topk_weights, experts), "FusedMoE")
            if captured is not None:
                return self._replay(captured, x, topk_idx, topk_weights)
            if rows != T and self._graphs.capacity and key not in self._padded_keys:
                # a signature's first direct call runs on the capture's rows: the kernels a later
                # capture replays compile now, outside it (later direct calls need not); a fresh
                # output (a view of the padded one would be a view under autograd)
                self._padded_keys.add(key)
                return self._direct(*_padded_call(rows, x, topk_idx, topk_weights), experts, sync, trace)[:T].clone()
        return self._direct(x, topk_idx, topk_weights, experts, sync, trace)

    def _direct(self, x, topk_idx, topk_weights, experts, sync, trace) -> torch.Tensor:
        """`_forward`'s launches issued directly (no CUDA graph)."""
        h = self.heap
        send, recv, weights = self._launch_layout(topk_idx, topk_weights, record_pending=not sync)
        if sync:
            # Default mode's one host read is of the layout's status, copied out before the
            # megakernel is launched and read after: the launch queues right behind the layout
            # (no idle GPU while the host reads) and the host waits for the layout alone, not
            # for the whole layer. Flagged input makes every rank's megakernel refuse all work
            # (every rank sees every rank's flags), so no token moves, and raises below.
            status = self._status_snapshot(layout_status_words(h, recv, self._pending_flags))
        out = torch.empty((x.shape[0], self.hidden), dtype=x.dtype, device=x.device)
        self._launch_kernel(x, send, recv, weights, experts, out, refuse_flagged=sync, trace=trace)
        if sync:
            if status[1] is not None:
                status[1].synchronize()
            self._raise_status(status[0])
        return out

    def join_flagged(self, flags: int, fields: dict | None, tokens: int = 0) -> None:
        """This rank cannot run its call (FLAG_REFUSED: its arguments failed; FLAG_REBUILD: its
        request needs another layer): join the call's counts exchange with no tokens and `flags`
        in its record. Every rank's megakernel then runs no task (no token moves) and every rank
        raises alike; FLAG_REBUILD reads the records back and raises here (EPBuffer.join_flagged).
        Not inside a CUDA graph capture (the raise ends the capture, and nothing ran)."""
        if capturing(self.device):
            return
        K = self.topk
        recv = self._launch_layout(torch.empty((0, K), dtype=torch.int32, device=self.device),
                                   torch.empty((0, K), dtype=torch.float32, device=self.device), flags=flags,
                                   fields=record_fields(fields, self.device), tokens=tokens)[1]
        if flags & C.FLAG_REBUILD:
            read_layout_status(self.heap, recv, self._pending_flags, self)

    def _launch_layout(self, topk_idx: torch.Tensor, topk_weights: torch.Tensor, record_pending: bool = False,
                       flags: int = 0, fields: torch.Tensor | None = None, tokens: int | None = None):
        """The launches before the megakernel (sender layout, counts exchange and row-tile map,
        counter resets); returns (send layout, receive layout, fp32 weights). No host sync.
        record_pending (graph mode): the exchange keeps every rank's input flags for `check()`;
        flags, fields, tokens: this rank's call record when it joins flagged (`join_flagged`)."""
        h = self.heap
        send = build_send_layout(topk_idx, self.num_experts, self.world_size, self.max_tokens)
        if flags:
            send.flags.fill_(flags)
        # the counts exchange also builds the GEMM row-tile map (tile_start, "gemm/tiles")
        recv = exchange_layout(h, send, self.num_experts, "moe/layout", self._sig_layout,
                               self._fields if fields is None else fields,
                               tile_rows=self.plan.core.gate_up.block_m, tiles=self._tiles, ring_step=self._ring_step,
                               pending=self._pending_flags, record_pending=record_pending, tokens=tokens)
        for lo, hi in self._zero_ranges:
            h.signals[lo:hi].zero_()
        return send, recv, topk_weights.to(torch.float32).contiguous()

    def _launch_kernel(self, x, send, recv, weights, experts, out, *, refuse_flagged: bool, trace: bool) -> None:
        """The megakernel launch itself (see `moe_fused_kernel` for its arguments); experts =
        (w1, w2, b1, b2), biases None when absent."""
        w1, w2, b1, b2 = experts
        dev, nt = self.plan.device, self.plan.device.num_tasks
        if trace:
            self._clock.zero_()
        trace_buf = torch.full((nt, 2), -1, dtype=torch.int32, device=self.device) if trace else self._clock
        timer = TIMER_NONE if not trace or self.device.type != "cuda" else (
            TIMER_HIP if torch.version.hip else TIMER_CUDA)
        timer_buf = torch.zeros((nt + 1, 2), dtype=torch.int64, device=self.device) if timer else self._timer_dummy
        self._launcher(moe_fused_kernel)[(dev.num_programs,)](
            x, send.topk_idx, send.pos, weights, send.send_idx, send.tokens_to,
            recv.expert_off, recv.src_off, recv.tokens_from, recv.tile_start, w1, w2,
            b1 if b1 is not None else w1, b2 if b2 is not None else w2, out, trace_buf, timer_buf,
            self._clock, recv.src_info, int(refuse_flagged), *self._plan_args, x.shape[0], *self._shape_args,
            self.heap.wait_budget, *_strides3(w1), *_strides3(w2), *self._put_args, TRACE=trace, DEVICE_TIMER=timer,
            HAS_B1=b1 is not None, HAS_B2=b2 is not None, **self._constexprs)
        if trace:
            self.last_trace = trace_buf
            self.last_timer = timer_buf if timer else None
            self._timer_ns_per_tick = 10.0 if timer == TIMER_HIP else 1.0  # gfx942 realtime: 100 MHz

    def _raise_status(self, words: torch.Tensor) -> None:
        """Default mode's checks on the layout status read back (see `forward`)."""
        raise_layout_status(words.tolist(), self.heap, self._pending_flags, self)
        if self.check_errors:
            self.heap.check_error()

    # ------------------------------------------------------------------ CUDA-graph replay
    def _capture_call(self, rows, x, topk_idx, topk_weights, experts) -> _CapturedCall:
        """Capture this call signature's launches as two graphs (runtime/call_graphs.py says when):
        `layout` (layout launches + the status copy to pinned memory) and `kernel` (the
        megakernel), replayed with an event between them so the host can wait for the layout
        alone, exactly as the direct path does. Inputs are copied into static buffers of `rows`
        tokens before a replay; the output is cloned out of the graph's buffer after it."""
        K = self.topk
        with torch.inference_mode(False):  # statics a later call outside inference mode can update
            c = _CapturedCall(x=x.new_empty((rows, self.hidden)), topk_idx=topk_idx.new_empty((rows, K)),
                              topk_weights=topk_weights.new_empty((rows, K)), layout=torch.cuda.CUDAGraph(),
                              kernel=torch.cuda.CUDAGraph(), ready=torch.cuda.Event(), inputs_in=torch.cuda.Event(),
                              x_in=torch.cuda.Event(),
                              # high priority: the copy is on the call's critical path (and the
                              # high-priority pool is less likely to share a stream with NCCL's)
                              copy_stream=torch.cuda.Stream(x.device, priority=-1),
                              status=self._pinned_status())
            with graph_capture(c.layout):
                send, recv, weights = self._launch_layout(c.topk_idx, c.topk_weights)
                c.status.copy_(layout_status_words(self.heap, recv, self._pending_flags), non_blocking=True)
            with graph_capture(c.kernel, pool=c.layout.pool()):
                c.out = torch.empty((rows, self.hidden), dtype=x.dtype, device=x.device)
                self._launch_kernel(c.x, send, recv, weights, experts, c.out, refuse_flagged=True, trace=False)
        return c

    def _replay(self, c: _CapturedCall, x, topk_idx, topk_weights) -> torch.Tensor:
        side = x.numel() * x.element_size() >= _SIDE_COPY_BYTES
        stream = current_stream(x.device.index)
        T, rows = x.shape[0], c.x.shape[0]
        statics = (c.x, c.topk_idx, c.topk_weights) if T == rows else (c.x[:T], c.topk_idx[:T], c.topk_weights[:T])
        c.routed = route_nowhere_past(c.topk_idx, T, c.routed)
        # one host call for the input copies: each copy_ took ~8-14 µs of host time on a lent H200
        # host, and at T=128 the GPU waits for the host (bench/results/HISTORY.md: replay_steps)
        if side:
            torch._foreach_copy_(list(statics[1:]), [topk_idx, topk_weights])
            # A large x is copied on a side stream while the layout graph, which does not read it,
            # runs. The side stream starts after everything queued so far on this one (x's
            # producer, and the previous replay's megakernel, which reads the static buffer); the
            # megakernel waits for the copy.
            c.inputs_in.record(stream)
        else:
            torch._foreach_copy_(list(statics), [x, topk_idx, topk_weights])
        c.layout.replay()
        if side:
            c.copy_stream.wait_event(c.inputs_in)
            with torch.cuda.stream(c.copy_stream):
                statics[0].copy_(x)
                c.x_in.record(c.copy_stream)
        c.ready.record(stream)
        if side:
            stream.wait_event(c.x_in)
        c.kernel.replay()
        out = (c.out if T == rows else c.out[:T]).clone()  # the graph's buffer is rewritten by the next replay
        c.ready.synchronize()
        self._raise_status(c.status)
        return out

    __call__ = forward

    def overlap_report(self) -> dict[str, int]:
        """From `last_trace` (host read): how many GEMM tiles started before the last remote
        dispatch chunk was placed (logical clock of task starts and ends on this rank)."""
        if self.last_trace is None:
            raise DitronConfigError("call forward(..., trace=True) first")
        tr = self.last_trace.cpu()
        st = {s.name: s for s in self.plan.device.stages}
        recv, gu = st["dispatch_recv"], st["gemm_gate_up"]
        rank, n_chunks = self.heap.rank, self.plan.routing.n_chunks
        remote = [recv.first_task + q for q in range(recv.num_tasks)
                  if self.plan.source_of(rank, q // n_chunks) != rank]
        last_remote = max((int(tr[t, 1]) for t in remote), default=-1)
        n_rows = self.heap.local_view("gemm/tiles")[:, 2].cpu()
        started = worked = 0
        for q in range(gu.num_tasks):
            i_m = gu.coords(q)["row_tile"]  # a position of the tile table; past it: a grouped grid's padding
            if i_m < len(n_rows) and int(n_rows[i_m]) > 0:
                worked += 1
                started += int(int(tr[gu.first_task + q, 0]) < last_remote)
        return {"gate_up_tiles": worked, "started_before_last_remote_chunk": started,
                "last_remote_chunk_clock": last_remote}

    def _timer_us(self) -> tuple[torch.Tensor, float]:
        """`last_timer` in µs (float64 [NT + 1, 2]) and program 0's entry (its last row)."""
        if self.last_timer is None:
            raise DitronConfigError("call forward(..., trace=True) on a GPU first (the interpreter has no device timer)")
        tm = self.last_timer.cpu().double() * self._timer_ns_per_tick / 1e3
        return tm, float(tm[-1, 0])

    def task_times(self, stage: str) -> torch.Tensor:
        """From `last_timer`: float64 [n, 2], start and end (µs after program 0 entered the kernel)
        of each task of `stage` that ran, in the plan's task order (see `timeline`)."""
        return _ran_tasks(*self._timer_us(), self.plan.device.stage(stage))

    def timeline(self) -> list[dict[str, float | int | str]]:
        """From `last_timer` (a traced GPU launch): per stage, when its first task started and its
        last ended (µs after program 0 entered the kernel), and how busy it kept the grid (sum of
        its task durations / programs, µs) and the spread of its task durations (task_min_us,
        task_p50_us, task_p90_us, task_max_us: nearest-rank percentiles, e.g. p50 of 4 tasks is the
        2nd shortest), over the tasks that ran ("tasks": GEMM tasks of row
        tiles without rows, and dispatch tasks of chunks past the call's largest T, are not
        ticketed). The first row, "call_barrier", is program 0's time in `call_begin`: since
        session 10 no wait for the other ranks (the layout exchange before the launch orders
        them), so near zero."""
        tm, t0 = self._timer_us()
        rows = [{"stage": "call_barrier", "tasks": 1, "first_start_us": 0.0, "last_end_us": float(tm[-1, 1]) - t0,
                 "busy_us_per_program": float(tm[-1, 1]) - t0}]
        for s in self.plan.device.stages:
            if not s.num_tasks:
                continue
            seg = _ran_tasks(tm, t0, s)
            if not len(seg):
                continue
            dur = (seg[:, 1] - seg[:, 0]).sort().values
            rows.append({"stage": s.name, "tasks": len(seg), "first_start_us": float(seg[:, 0].min()),
                         "last_end_us": float(seg[:, 1].max()),
                         "busy_us_per_program": float(dur.sum()) / self.plan.device.num_programs,
                         **{f"task_{name}_us": float(dur[max(math.ceil(q * len(dur)) - 1, 0)])  # nearest rank
                            for name, q in (("min", 0.0), ("p50", 0.5), ("p90", 0.9), ("max", 1.0))}})
        return rows

    def _status_snapshot(self, words: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """(host tensor, event): on a GPU an asynchronous copy into pinned memory and the event
        after it (wait on it before reading); elsewhere the words themselves (kernels run
        synchronously there)."""
        if words.device.type != "cuda":
            return words, None
        if self._status_host is None:
            self._status_host = self._pinned_status()
            self._status_event = torch.cuda.Event()
        self._status_host.copy_(words, non_blocking=True)
        self._status_event.record(current_stream())
        return self._status_host, self._status_event

    def _pinned_status(self) -> torch.Tensor:
        """A pinned host buffer for this layer's `layout_status_words` (their count is fixed)."""
        return torch.empty(layout_status_numel(self.world_size, self.num_local_experts), dtype=torch.int32,
                           pin_memory=True)

    def check(self) -> None:
        """Raise an error recorded by any launch, then problems recorded by sync=False calls (one
        host read each)."""
        self.heap.check_error()
        raise_pending_flags(self._pending_flags, self)

    def free(self) -> None:
        self._graphs.clear()  # the graphs point into the heap
        self.staged_slot.free()
        self.heap.free()

    # ------------------------------------------------------------------ helpers
    def _validate(self, x, topk_idx, topk_weights, w1, w2, b1=None, b2=None) -> None:
        validate_inputs(x, topk_idx, topk_weights, w1, w2, b1=b1, b2=b2, activation=self.activation,
                        dtype=self.dtype, hidden=self.hidden,
                        ffn_hidden=self.ffn_hidden, num_local_experts=self.num_local_experts, topk=self.topk,
                        device=self.device)

