"""Launch a compiled Triton kernel without `JITFunction.run`'s per-call Python work.

Why: an eager dispatch or combine at small T is bound by host time, and `kernel[grid](...)` of a
kernel with ~35 arguments cost 85-120 µs of host time per launch on a lent H200 host (Triton 3.6:
argument binding, the cache-key string, a check of every global the kernel reads, launch
metadata) against ~30 µs through the compiled launcher alone (bench/results/host_prof_*_s19*).

`fast(kernel)[grid](*args, **kwargs)` takes the same arguments as `kernel[grid](...)`. It keys
each call by what Triton specialises a compiled kernel on, made stricter so that a hit can never
pick a binary compiled for other arguments: per positional argument, a tensor's dtype and 16-byte
alignment; an int's "== 1", "multiple of 16" and 32-/64-bit/unsigned range; a bool's value; a
float; None; plus every keyword argument's value (constexprs and launch options), the device and
Triton's debug and instrumentation knobs.
The first call of a key runs the ordinary `kernel[grid](...)` (which compiles) and keeps the
compiled kernel; later calls of that key go straight to its launcher. Anything else — the
interpreter, an argument of another type, a keyword argument that is not a constexpr or a launch
option, a constexpr passed positionally, a callable grid, a launch hook set (a profiler) or a
pre-run hook — takes the ordinary path every time, so results are the same kernels on the same
arguments either way. Skipped: Triton's
check that no global the kernel reads changed since it compiled (the package's are constants).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["VARY", "BoundLaunch", "capturing", "current_stream", "fast"]

_I32_MIN, _I32_MAX, _U64_MIN = -(1 << 31), (1 << 31) - 1, 1 << 63


def _args_key(args: tuple) -> tuple:
    """What the binary may depend on, per positional argument; raises TypeError for a type the key
    does not cover: a tensor's dtype, 16-byte alignment and whether it is on a GPU; an int's == 1,
    multiple of 16, 32-bit range, unsigned 64-bit range; the rest in `_other_key`."""
    return _key_and_raw(args)[0]


def _key_and_raw(args: tuple) -> tuple[tuple, list]:
    """(`_args_key` of args, the arguments as the compiled launcher takes them: a CUDA tensor as
    its address). Plain tensors and ints inline (a function call per argument cost ~8 µs for 31
    arguments, a third of what the launcher saves). Triton's launcher turns each tensor
    argument into its address through a `data_ptr()` call and a `cuPointerGetAttribute` driver
    call; an int skips both (~2 µs of an EP data kernel's ~18-tensor launch on a lent H200 host,
    bench/results/host_profile_H200x1_20261129_s34_*). A CPU tensor stays a tensor, keyed
    apart from CUDA ones, so the launcher still refuses it as before (a host address would fault)."""
    Tensor = torch.Tensor
    key = []
    raw = list(args)
    for i, a in enumerate(args):
        t = type(a)
        if t is Tensor:
            p = a.data_ptr()
            cuda = a.is_cuda
            if cuda:
                raw[i] = p
            key.append((a.dtype, not p & 15, cuda))
        elif t is int:
            key.append((a == 1) + 2 * (not a & 15) + 4 * (_I32_MIN <= a <= _I32_MAX) + 8 * (a >= _U64_MIN))
        else:
            key.append(_other_key(a))
    return tuple(key), raw


def _other_key(a: Any) -> Any:
    """`_args_key` of an argument that is neither a plain tensor nor a plain int."""
    if isinstance(a, torch.Tensor):  # a subclass (nn.Parameter): passed as it is
        return (a.dtype, not a.data_ptr() & 15, a.is_cuda)
    t = type(a)
    if t is bool:
        return ("b", a)
    if t is float:
        return "f"
    if a is None:
        return "N"
    raise TypeError(t)


def _hooked(hook: Any) -> bool:
    """Whether a launch hook is set (Triton 3.6 keeps a HookChain, empty unless a profiler adds one)."""
    return hook is not None and bool(getattr(hook, "calls", True))


class FastLauncher:
    """`fast(kernel)`: see the module docstring."""

    def __init__(self, fn: Any, *, prepare: Callable[[Any], None] | None = None,
                 extern_libs: tuple[tuple[str, str], ...] | None = None) -> None:
        """prepare: called with each newly compiled kernel before its first launch (NVSHMEM's
        module initialisation); extern_libs: device libraries linked into every compile."""
        from triton import knobs
        from triton.runtime.jit import JITFunction
        self.fn = fn
        self.prepare = prepare
        self.extern_libs = extern_libs
        self._knobs = knobs
        # The interpreter (CPU) and wrappers (autotuners) always take the ordinary path.
        self.enabled = type(fn) is JITFunction
        self._compiled: dict[tuple, tuple[Any, tuple]] = {}
        if self.enabled:
            self._names = [p.name for p in fn.params]
            self._constexpr = {p.name for p in fn.params if p.is_constexpr}
            self._defaults = {p.name: p.default for p in fn.params if p.has_default}
            # a constexpr given positionally would be keyed by its class, not its value: such calls
            # take the ordinary path
            self._first_constexpr = min((i for i, p in enumerate(fn.params) if p.is_constexpr), default=len(fn.params))

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _ordinary(self, grid: Any, args: tuple, kwargs: dict) -> Any:
        """`kernel[grid](*args, **kwargs)`, compiled with `extern_libs` and `prepare`d first."""
        if not self.enabled or (self.extern_libs is None and self.prepare is None):
            return self.fn[grid](*args, **kwargs)
        if self.extern_libs is not None:
            kwargs = {**kwargs, "extern_libs": self.extern_libs}
        if self.prepare is not None:
            if callable(grid):
                raise TypeError("a launcher with `prepare` takes a tuple grid (the kernel is prepared before it runs)")
            self.prepare(self.fn.run(*args, grid=grid, warmup=True, **kwargs))  # compiles, does not launch
        return self.fn.run(*args, grid=grid, warmup=False, **kwargs)

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        if (not self.enabled or callable(grid) or self.fn.pre_run_hooks or len(args) > self._first_constexpr):
            self._ordinary(grid, args, kwargs)
            return
        knobs = self._knobs
        try:  # (the lookup hashes the key: a key is hashed once)
            keyed, raw = _key_and_raw(args)
            key = (torch._C._cuda_getDevice(), keyed, tuple(kwargs.items()), knobs.runtime.debug,
                   knobs.compilation.instrumentation_mode)
            entry = self._compiled.get(key)
        except TypeError:  # an argument of a type the key does not cover
            self._ordinary(grid, args, kwargs)
            return
        if entry is None or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
            kernel = self._ordinary(grid, args, kwargs)
            if entry is None and kernel is not None:
                self._remember(key, kernel, len(args), kwargs)
            return
        kernel, tail = entry
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(key[0])
        kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *raw, *tail)

    def _remember(self, key: tuple, kernel: Any, n_args: int, kwargs: dict,
                  into: dict[tuple, tuple[Any, tuple]] | None = None) -> None:
        """Keep `kernel` for `key` (in `into`, default this launcher's cache) with the values of
        the parameters after the positional ones, if each is a constexpr (its value is part of
        the key); else never fast-launch this key."""
        if hasattr(kernel, "result"):  # asynchronous compilation mode
            kernel = kernel.result()
        tail = []
        for name in self._names[n_args:]:
            if name not in self._constexpr or (name not in kwargs and name not in self._defaults):
                return
            tail.append(kwargs[name] if name in kwargs else self._defaults[name])
        (self._compiled if into is None else into)[key] = (kernel, tuple(tail))

    def bind(self, grid: tuple[int, ...], template: tuple, **kwargs: Any) -> BoundLaunch:
        """A launch of this kernel on `grid` whose positional arguments are `template`, with VARY
        in the places each call fills (`bound(*values)`, in order), and whose keyword arguments
        are `kwargs`. See BoundLaunch."""
        return BoundLaunch(self, grid, template, kwargs)


class _Vary:
    def __repr__(self) -> str:
        return "VARY"


VARY = _Vary()  # a place in a BoundLaunch template that each call fills


class BoundLaunch:
    """`fast(kernel).bind(grid, template, **kwargs)`: a launch whose grid, keyword arguments and
    positional arguments other than the VARY places are fixed when it is bound. A call passes
    only the VARY values and is keyed by them alone: the fixed part cannot change, so building
    the ~45 arguments of an EP copy kernel and keying every one of them (~25-30 µs of an eager
    call's host time on a lent H200 host, bench/results/launch_probe_*_s33*) happens once.
    Fixed tensors must keep their memory (no `set_`/`resize_`): their pointers are part of the
    binding. What takes the ordinary path (each call) is what `FastLauncher.launch` sends there:
    the interpreter, a callable grid, a kernel with pre-run hooks, a launch hook set, a VARY
    value of a type the key does not cover, or fixed arguments of such a type; results are the
    same kernels on the same arguments either way."""

    def __init__(self, launcher: FastLauncher, grid: tuple[int, ...], template: tuple, kwargs: dict) -> None:
        self.launcher, self.grid, self.kwargs = launcher, grid, kwargs
        self.template = list(template)
        # the fixed CUDA tensors as their addresses, as `_key_and_raw` passes them (self.template
        # keeps the tensors alive)
        self._raw_template = [a.data_ptr() if type(a) is torch.Tensor and a.is_cuda else a for a in template]
        self.slots = tuple(i for i, a in enumerate(template) if a is VARY)
        self._entries: dict[tuple, tuple[Any, tuple]] = {}
        self.enabled = (launcher.enabled and not callable(grid) and len(template) <= launcher._first_constexpr)
        if self.enabled:
            try:  # the fixed part is keyed by the binding itself: only check that a key could cover it
                hash((_args_key(tuple(a for a in template if a is not VARY)), tuple(kwargs.items())))
            except TypeError:
                self.enabled = False
        self._grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1) \
            if not callable(grid) else None

    def __call__(self, *values: Any) -> None:
        if len(values) != len(self.slots):
            raise TypeError(f"this bound launch of {self.launcher.fn} takes {len(self.slots)} values (its VARY "
                            f"places), got {len(values)}")
        launcher = self.launcher
        if not self.enabled or launcher.fn.pre_run_hooks:
            launcher._ordinary(self.grid, self._filled(self.template, values), self.kwargs)
            return
        knobs = launcher._knobs
        try:
            keyed, raw = _key_and_raw(values)
            key = (torch._C._cuda_getDevice(), keyed, knobs.runtime.debug, knobs.compilation.instrumentation_mode)
            entry = self._entries.get(key)
        except TypeError:  # a value of a type the key does not cover
            launcher._ordinary(self.grid, self._filled(self.template, values), self.kwargs)
            return
        if entry is None or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
            kernel = launcher._ordinary(self.grid, self._filled(self.template, values), self.kwargs)
            if entry is None and kernel is not None:
                launcher._remember(key, kernel, len(self.template), self.kwargs, into=self._entries)
            return
        kernel, tail = entry
        g0, g1, g2 = self._grid3
        kernel.run(g0, g1, g2, torch._C._cuda_getCurrentRawStream(key[0]), kernel.function, kernel.packed_metadata,
                   None, None, None, *self._filled(self._raw_template, raw), *tail)

    def _filled(self, template: list, values: Any) -> tuple:
        """template with its VARY places filled by values, in order."""
        args = template.copy()
        for i, v in zip(self.slots, values):
            args[i] = v
        return tuple(args)


_LAUNCHERS: dict[int, FastLauncher] = {}


def fast(fn: Any) -> FastLauncher:
    """The cached launcher of a @triton.jit kernel: `fast(kernel)[grid](*args, **kwargs)`."""
    launcher = _LAUNCHERS.get(id(fn))
    if launcher is None or launcher.fn is not fn:
        launcher = _LAUNCHERS[id(fn)] = FastLauncher(fn)
    return launcher


_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def current_stream(device_index: int | None = None) -> torch.cuda.Stream:
    """`torch.cuda.current_stream(device_index)` (default: the current device), cached per raw stream: the torch
    function builds a new Stream object through several Python calls (~20 µs on a lent host),
    which an eager call paid for each event it recorded. torch never destroys its pooled streams,
    and an external stream's id is its pointer, so a cached object names the same stream."""
    dev = torch._C._cuda_getDevice() if device_index is None else device_index
    key = (dev, torch._C._cuda_getCurrentRawStream(dev))
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.current_stream(dev)
    return stream


def capturing(device: torch.device) -> bool:
    """Whether this call is being captured into a CUDA graph (the current stream of a CUDA
    `device` is capturing): host reads, allocations that must persist and first compiles cannot
    happen now. False on the CPU."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
