"""The symmetric heap: one arena per rank, same layout everywhere, visible to every peer.

Arena layout (bytes): [control block | signals (int32) | named allocations...]. Kernels get the
arena base of every rank (`ptr_table`, int64 [W]) and of every rank's signals (`signal_table`),
and reach a named buffer on rank p as `ptr_table[p] + offset`.
"""
from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ditron_ep.runtime import control as C
from ditron_ep.runtime.agreement import agree, call_error
from ditron_ep.runtime.errors import DitronConfigError, DitronTimeoutError
from ditron_ep.runtime.fast_launch import current_stream
from ditron_ep.runtime.mode import resolve_backend

DEFAULT_SIZE_BYTES = {"emulated": 32 << 20, "torch": 1 << 30, "nvshmem": 1 << 30}
# Poll budgets of a bounded wait. Emulated: one poll costs ~0.25 ms under the interpreter on an
# idle core and ~0.5-1 ms when 4 ranks share 2 cores, so 60k polls is 15-60 s, far above any
# honest CPU-test wait (a peer's interpreted launch takes seconds) yet short of test timeouts.
# GPU: a system-scope poll costs ~1 µs, so 2^25 polls is ~30 s. nvshmem: twice that, since a first
# call's put-transport kernels link NVSHMEM's device library and compiled in 10-30 s each on 2xH200,
# so a rank compiling two variants its peer had cached outwaited 30 s at the call barrier.
DEFAULT_WAIT_BUDGET = {"emulated": 60_000, "torch": 1 << 25, "nvshmem": 1 << 26}
WAIT_BUDGET_ENV = "DITRON_WAIT_BUDGET"

# Stage codes recorded by kernels in the error slot -> readable names (kernels register theirs).
STAGE_NAMES: dict[int, str] = {0: "call barrier"}
# Stages where an opening launch meets its peers: the error slot's signal is the peer waited for
# and its expected value the call number.
OPENING_STAGES = {0, 2}


def register_stage(code: int, name: str) -> int:
    if STAGE_NAMES.get(code, name) != name:
        raise ValueError(f"stage code {code} already names {STAGE_NAMES[code]!r}")
    STAGE_NAMES[code] = name
    return code


@dataclass(frozen=True)
class SymmetricBuffer:
    """A named allocation: the same offset, shape and dtype on every rank."""

    name: str
    offset: int          # bytes from the arena base
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


# backward pass (graph task id) -> the heaps whose error slots its end-of-backward callback reads
# (check_error_later)
_END_OF_BACKWARD: dict[int, list] = {}


class SymmetricHeap:
    """Symmetric memory over a process group, for ditron_ep kernels.

    Args:
        group: process group (default: the default group). Any group works: torchrun + NCCL,
            or `init_process_group("gloo")` for CPU ranks.
        backend: "auto" (torch on CUDA, emulated on CPU), "emulated", "torch" (torch symmetric
            memory) or "nvshmem" (NVSHMEM's symmetric heap through nvshmem4py; CUDA, the extra
            `ditron_ep[nvshmem]`; NVSHMEM is initialised once per process for one group).
        size_bytes: arena size per rank (same on every rank).
        num_signals: int32 signal words per rank.
        wait_budget: polls a bounded wait may spend before it records a timeout
            (default per backend; env DITRON_WAIT_BUDGET overrides).
        expected_world_size: if given, the group must have exactly this many ranks.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, backend: str = "auto",
                 size_bytes: int | None = None, num_signals: int = 1024,
                 wait_budget: int | None = None, expected_world_size: int | None = None,
                 device: torch.device | str | None = None) -> None:
        if not dist.is_initialized():
            raise DitronConfigError(
                "SymmetricHeap needs torch.distributed initialised: call "
                "dist.init_process_group(...) first (or use ditron_ep.runtime.EmulatedCluster)")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        problem = None
        try:
            self._check_arguments(backend, size_bytes, num_signals, wait_budget, expected_world_size, device)
        except (DitronConfigError, ValueError, TypeError) as err:
            problem = str(err)
        # a rank that raised alone would leave its peers in the collectives below
        agree(self.group, "SymmetricHeap", problem)
        self.check_same_everywhere("heap configuration",
                                    (self.backend, self.size_bytes, self.num_signals))

        if self.backend == "torch":
            from ditron_ep.runtime.backends.torch_symm import create_arena

            self._arena = create_arena(self.size_bytes, self.group, self.rank, self.world_size, self.device)
        elif self.backend == "nvshmem":
            from ditron_ep.runtime.backends.nvshmem import create_arena

            self._arena = create_arena(self.size_bytes, self.group, self.rank, self.world_size, self.device)
        else:
            from ditron_ep.runtime.backends.emulated import create_arena

            self._arena = create_arena(self.size_bytes, self.group, self.rank, self.world_size)
        misaligned = [b for b in self._arena.peer_bases if b % C.ARENA_ALIGN]
        if misaligned:  # kernels are compiled assuming aligned bases (primitives.arena_base)
            self._arena.release()
            raise DitronConfigError(f"the {self.backend} backend returned arena bases {misaligned} that are not "
                                    f"{C.ARENA_ALIGN}-byte aligned; this is a backend bug, please report it")
        self.ptr_table = torch.tensor(self._arena.peer_bases, dtype=torch.int64, device=self.device)
        self.signal_table = self.ptr_table + self.signal_offset
        self._ctrl = self._arena.local[:C.CTRL_BYTES].view(torch.int32)
        self.signals = self._arena.local[self.signal_offset:self.signal_offset + 4 * self.num_signals].view(torch.int32)
        self._next = self.data_offset
        self._buffers: dict[str, SymmetricBuffer] = {}
        self._signal_ranges: dict[str, tuple[int, int]] = {}
        self._next_signal = 0
        self._freed = False
        self._host_words: torch.Tensor | None = None  # pinned copy of the host words (`host_words`)
        self._host_words_lock = threading.Lock()  # (an end-of-backward read may run on autograd's thread)

    # ------------------------------------------------------------------ allocation
    def alloc(self, name: str, shape: tuple[int, ...] | list[int] | int, dtype: torch.dtype) -> torch.Tensor:
        """Allocate a named symmetric tensor (collective: every rank, same order, same args).

        Returns this rank's view; kernels reach rank p's copy at `ptr_table[p] + offset_of(name)`.
        """
        self._check_alive()
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if name in self._buffers:
            raise DitronConfigError(f"symmetric buffer {name!r} already exists; free the heap or pick another name")
        if any(s < 0 for s in shape):
            raise DitronConfigError(f"negative dimension in shape {shape} for buffer {name!r}")
        if not isinstance(dtype, torch.dtype):
            raise DitronConfigError(f"dtype must be a torch.dtype, got {dtype!r}")
        self.check_same_everywhere(f"allocation of {name!r}", (name, shape, str(dtype), self._next))
        buf = SymmetricBuffer(name, self._next, shape, dtype)
        end = buf.offset + buf.nbytes
        if end > self.size_bytes:
            raise DitronConfigError(
                f"symmetric heap full: {name!r} needs {buf.nbytes} bytes at offset {buf.offset}, "
                f"arena has {self.size_bytes}; create the heap with a larger size_bytes")
        self._buffers[name] = buf
        self._next = C.align_up(end)
        return self.local_view(name)

    def alloc_signals(self, name: str, count: int) -> int:
        """Reserve `count` signal words under `name` (collective); returns the first index."""
        self._check_alive()
        if name in self._signal_ranges:
            first, n = self._signal_ranges[name]
            if n != count:
                raise DitronConfigError(f"signal range {name!r} exists with {n} words, asked for {count}")
            return first
        if count <= 0:
            raise DitronConfigError(f"signal count must be positive, got {count}")
        if self._next_signal + count > self.num_signals:
            raise DitronConfigError(
                f"out of signals: {name!r} needs {count}, {self.num_signals - self._next_signal} of "
                f"{self.num_signals} left; create the heap with a larger num_signals")
        self.check_same_everywhere(f"signal range {name!r}", (name, count, self._next_signal))
        first = self._next_signal
        self._signal_ranges[name] = (first, count)
        self._next_signal += count
        return first

    def has_buffer(self, name: str) -> bool:
        return name in self._buffers

    def buffer(self, name: str) -> SymmetricBuffer:
        try:
            return self._buffers[name]
        except KeyError:
            raise KeyError(f"no symmetric buffer named {name!r}; allocated: {sorted(self._buffers)}") from None

    def offset_of(self, name: str) -> int:
        return self.buffer(name).offset

    def local_view(self, name: str) -> torch.Tensor:
        buf = self.buffer(name)
        raw = self._arena.local[buf.offset:buf.offset + buf.nbytes]
        return raw.view(buf.dtype).view(buf.shape)

    def peer_view(self, name: str, peer: int) -> torch.Tensor:
        """Host view of `name` on rank `peer` (emulated backend only: for tests and debugging)."""
        if self.backend != "emulated":
            raise DitronConfigError("peer_view is available on the emulated backend only")
        if not 0 <= peer < self.world_size:
            raise DitronConfigError(f"peer {peer} out of range for world size {self.world_size}")
        buf = self.buffer(name)
        raw = self._arena.peer_views[peer][buf.offset:buf.offset + buf.nbytes]
        return raw.view(buf.dtype).view(buf.shape)

    # ------------------------------------------------------------------ control
    @property
    def ctrl_ptr(self) -> int:
        """Address of this rank's control block (kernels write their error slot there)."""
        return self._arena.peer_bases[self.rank]

    @property
    def error_words(self) -> torch.Tensor:
        """int32 view of this rank's error words [ERR_FLAG, HOST_WORDS): non-zero ERR_FLAG after a
        timed-out wait, non-zero FAIL_CALL after a barrier-opened call that did not go."""
        return self._ctrl[C.ERR_FLAG:C.HOST_WORDS]

    @property
    def call_number(self) -> int:
        """This rank's call number on the heap: the last call an opening launch began."""
        return int(self._ctrl[C.CALL].item())

    def barrier(self) -> None:
        """Host barrier: all device work of this rank done, then a group barrier."""
        self._check_alive()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)

    def read_error(self) -> Exception | None:
        """The error a kernel recorded on this rank, or None (one host read); reading consumes it.

        A bounded wait that timed out (DitronTimeoutError), else a barrier-opened call (combine,
        a backward's replay) that did not go because a peer was out of step
        (DitronOutOfStepError) or rejected its own arguments (DitronConfigError). Nothing needs
        resetting after either: later calls wait for later call numbers."""
        words = self.host_words()
        if words[C.ERR_FLAG]:  # (a stopped call's finding is that timeout too: both are cleared)
            self._ctrl[C.ERR_FLAG] = 0
            self._ctrl[C.FAIL_FLAGS:C.FAIL_PEER_CALL + 1] = 0
            return self._timeout(words)
        if words[C.FAIL_CALL]:
            self._ctrl[C.FAIL_FLAGS:C.FAIL_PEER_CALL + 1] = 0
            return call_error(words[C.FAIL_FLAGS], [words[C.FAIL_RANK] - 1], self.rank, words[C.FAIL_CALL],
                              {words[C.FAIL_RANK] - 1: words[C.FAIL_PEER_CALL]})
        return None

    def _timeout(self, words: list[int]) -> DitronTimeoutError:
        stage_code = int(words[C.ERR_STAGE])
        stage = STAGE_NAMES.get(stage_code, f"stage {stage_code}")
        rank, signal = int(words[C.ERR_RANK]), int(words[C.ERR_SIGNAL])
        observed, expected = int(words[C.ERR_OBSERVED]), int(words[C.ERR_EXPECTED])
        if stage_code in OPENING_STAGES:
            msg = (f"rank {rank} waited {self.wait_budget} polls for rank {signal} to arrive at call {expected} "
                   f"('{stage}') and gave up; the last call rank {signal} signalled there was {observed}: it did "
                   f"not make this call, or is far slower. No data moved in this call, and nothing needs resetting: the next call of every "
                   f"rank meets again (a rank arriving late at this call raises DitronOutOfStepError)")
        else:
            msg = (f"rank {rank}: bounded wait timed out in stage '{stage}' on signal {signal} (saw {observed}, "
                   f"waited for call {expected}) after {self.wait_budget} polls: a peer stopped in the middle of "
                   f"the call (it failed or was killed). This call's output is incomplete; the next call of every "
                   f"rank starts afresh")
        return DitronTimeoutError(msg, rank=rank, stage=stage, signal=signal, observed=observed, expected=expected)

    def host_words(self) -> list[int]:
        """The host words [0, HOST_WORDS) once the current stream's work is done (a stream sync on
        CUDA). Copied through a pinned buffer of the heap, which spares `.tolist()`'s host tensor
        and pageable staging copy (a few µs of an eager combine on a lent H200 host), under a lock
        (one buffer per heap). An eager dispatch whose kernel ran before its status read reads
        its layout's status and these in this one wait (EPBuffer._dispatch_raw)."""
        if not self._ctrl.is_cuda:
            return self._ctrl[:C.HOST_WORDS].tolist()  # a copy (emulated ranks)
        with self._host_words_lock:
            if self._host_words is None:
                self._host_words = torch.empty(C.HOST_WORDS, dtype=torch.int32, pin_memory=True)
            self._host_words.copy_(self._ctrl[:C.HOST_WORDS], non_blocking=True)
            current_stream(self.device.index).synchronize()
            return self._host_words.tolist()

    def check_error(self, words: list[int] | None = None) -> None:
        """Raise the recorded error, if any (synchronises with the device; see read_error).
        words: what `host_words` read after the call's launches: when they show no
        error nothing more is read; else the slot is read again, and consumed, as without them."""
        if words is not None and not (words[C.ERR_FLAG] or words[C.FAIL_CALL]):
            return
        err = self.read_error()
        if err is not None:
            raise err

    def check_error_later(self) -> None:
        """`check_error` for a call made under autograd, without its host sync: reading the slot
        right after the launch leaves the GPU idle while the host then issues what follows (the
        expert GEMMs' launches, the autograd engine's own work), ~0.2-1 ms per call in a training
        step. Inside a backward pass the slot is read once when that pass ends (one callback of
        autograd's engine per pass reads the heaps its calls used, in order, and raises the first
        error from `backward()` / `autograd.grad`; the gradients already written are not to be used); a
        forward's error stays in the slot for that read (its backward calls this heap again) or
        for the next dispatch's layout read, which reads the error words with the counts. A held
        error stops this rank's next calls at once (`call_begin`), so deferring the read never
        makes a call wait for a peer that is gone."""
        task = torch._C._current_graph_task_id()
        if task < 0:
            return
        heaps = _END_OF_BACKWARD.get(task)
        if heaps is None:
            heaps = _END_OF_BACKWARD[task] = []

            def check() -> None:
                for ref in _END_OF_BACKWARD.pop(task, []):  # the first error raises; a later heap's
                    h = ref()                                # stays held for its next read
                    if h is not None and not h._freed:
                        h.check_error()

            torch.autograd.Variable._execution_engine.queue_callback(check)
        # weak: a pass that fails before its callbacks run leaves its entry, not its heaps, behind
        if all(ref() is not self for ref in heaps):
            heaps.append(weakref.ref(self))

    def reset(self, call: int = 0) -> None:
        """Collective: clear signals, error slot and call records, and set the call number (not
        needed after errors: for tests of wrap-around and after a rank was killed mid-call)."""
        self.barrier()
        c = C.to_int32(call)
        self.signals.fill_(c)  # a stamp no later call's wait takes for its own
        self._ctrl.zero_()
        self._ctrl[C.CALL] = c
        self._ctrl[C.GO] = c
        self._ctrl[C.BARRIER:C.BARRIER + self.world_size] = c
        self.barrier()

    def free(self) -> None:
        """Collective: release the arena. Views handed out before become invalid."""
        if self._freed:
            return
        self.barrier()
        self._freed = True
        self._buffers.clear()
        self._signal_ranges.clear()
        self._ctrl = self.signals = None  # type: ignore[assignment]
        self.ptr_table = self.signal_table = None  # type: ignore[assignment]
        self._arena.release()
        self._arena = None  # type: ignore[assignment]  (drop the last reference to the memory)

    def __enter__(self) -> "SymmetricHeap":
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    # ------------------------------------------------------------------ helpers
    def _check_arguments(self, backend, size_bytes, num_signals, wait_budget, expected_world_size, device) -> None:
        """This rank's checks of the constructor's arguments (no collective); sets the fields they decide."""
        self.backend = resolve_backend(backend)
        if expected_world_size is not None and expected_world_size != self.world_size:
            raise DitronConfigError(
                f"world-size mismatch: expected {expected_world_size} ranks but the process group "
                f"has {self.world_size}; launch {expected_world_size} ranks or pass the right group")
        if self.world_size > C.MAX_WORLD:
            raise DitronConfigError(f"world size {self.world_size} exceeds the supported {C.MAX_WORLD}")
        size_bytes = DEFAULT_SIZE_BYTES[self.backend] if size_bytes is None else int(size_bytes)
        if num_signals <= 0:
            raise DitronConfigError(f"num_signals must be positive, got {num_signals}")
        self.num_signals = int(num_signals)
        self.signal_offset = C.CTRL_BYTES
        self.data_offset = C.align_up(self.signal_offset + 4 * self.num_signals)
        if size_bytes < self.data_offset:
            raise DitronConfigError(
                f"size_bytes={size_bytes} cannot hold the control block and {num_signals} signals "
                f"({self.data_offset} bytes); pass a larger size_bytes")
        self.size_bytes = size_bytes
        budget = wait_budget if wait_budget is not None else os.environ.get(WAIT_BUDGET_ENV)
        self.wait_budget = int(budget) if budget is not None else DEFAULT_WAIT_BUDGET[self.backend]
        if not 0 < self.wait_budget < 2**31:
            raise DitronConfigError(f"wait_budget must be in [1, 2^31), got {self.wait_budget}")

        if self.backend in ("torch", "nvshmem"):
            self.device = torch.device(device) if device is not None else torch.device(
                "cuda", torch.cuda.current_device())
            if self.device.type != "cuda":
                raise DitronConfigError(f"the {self.backend} backend lives on a CUDA/ROCm device; got device={device}")
            if self.backend == "nvshmem":  # importable, supported, and its one instance usable for this group
                from ditron_ep.runtime.backends.nvshmem import preflight

                preflight(self.group, self.rank, self.world_size)
        else:
            self.device = torch.device("cpu")
            if device is not None and torch.device(device).type != "cpu":
                raise DitronConfigError(f"the emulated backend lives on the CPU; got device={device}")

    @property
    def freed(self) -> bool:
        """Whether `free()` has released this heap (every later use raises)."""
        return self._freed

    def _check_alive(self) -> None:
        if self._freed:
            raise DitronConfigError("this SymmetricHeap was freed; create a new one")

    def check_same_everywhere(self, what: str, value: object) -> None:
        """Collective: raise DitronConfigError on every rank unless `value` is equal on all ranks."""
        values: list[object] = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.group)
        if any(v != values[0] for v in values):
            detail = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise DitronConfigError(
                f"{what} differs across ranks ({detail}); every rank must make the same heap "
                f"calls with the same arguments in the same order")
