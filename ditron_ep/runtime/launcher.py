"""Emulated ranks: N CPU processes with torch.distributed (gloo) initialised.

`EmulatedCluster` owns a pool of rank processes that run submitted functions in lock step, so
tests and the CLI pay the process start-up once. Any rank's exception, crash, kill or a host
timeout becomes one `RankError` in the parent; after a crash or timeout the pool is torn down
(every process killed, every /dev/shm segment of the pool swept) and restarted on the next run.
"""
from __future__ import annotations

import atexit
import os
import pickle
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from multiprocessing.connection import Connection, Listener, wait
from typing import Any, Callable

from ditron_ep.runtime.backends.emulated import SHM_PREFIX_ENV, leftover_segments, sweep_segments
from ditron_ep.runtime.errors import DitronConfigError, RankError

_LIVE_CLUSTERS: "weakref.WeakSet[EmulatedCluster]" = weakref.WeakSet()
# After one rank has failed, how long the others may still take before the pool is killed.
ERROR_GRACE_S = 30.0


class EmulatedCluster:
    """A pool of `world_size` CPU rank processes (gloo), each running ditron_ep kernels under
    the Triton interpreter on the emulated backend.

    Example::

        with EmulatedCluster(4) as cluster:
            outs = cluster.run(my_fn, arg)   # my_fn(arg) on every rank; list in rank order
    """

    def __init__(self, world_size: int, *, timeout_s: float = 300.0, start_timeout_s: float = 180.0) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise DitronConfigError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.shm_prefix = f"ditron_{os.getpid()}_{secrets.token_hex(4)}"
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._tmpdir: str | None = None
        _LIVE_CLUSTERS.add(self)

    # ------------------------------------------------------------------ lifecycle
    @property
    def started(self) -> bool:
        return bool(self._procs)

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def start(self) -> None:
        if self._procs:
            return
        self._tmpdir = tempfile.mkdtemp(prefix="ditron_cluster_")
        address = os.path.join(self._tmpdir, "ctl.sock")
        authkey = secrets.token_bytes(16)
        listener = Listener(address, family="AF_UNIX", authkey=authkey)
        env = dict(os.environ)
        env.update({
            # Ranks are emulated: kernels must be interpreted, whatever the parent runs.
            "TRITON_INTERPRET": "1",
            "DITRON_BACKEND": "emulated",
            SHM_PREFIX_ENV: self.shm_prefix,
            # 2 cores shared by N ranks: more intra-op threads only thrash.
            "OMP_NUM_THREADS": env.get("DITRON_RANK_THREADS", "1"),
            "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo"),
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
            "DITRON_AUTHKEY": authkey.hex(),
        })
        try:
            for rank in range(self.world_size):
                cmd = [sys.executable, "-m", "ditron_ep.runtime.rank_worker", address, str(rank),
                       str(self.world_size), os.path.join(self._tmpdir, "store")]
                self._procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))
            conns: dict[int, Connection] = {}
            deadline = time.monotonic() + self.start_timeout_s
            listener._listener._socket.settimeout(1.0)  # type: ignore[attr-defined]
            while len(conns) < self.world_size:
                self._raise_if_dead("starting")
                if time.monotonic() > deadline:
                    raise RankError(f"emulated ranks did not start within {self.start_timeout_s:.0f} s")
                try:
                    conn = listener.accept()
                except (TimeoutError, OSError):
                    continue
                conns[conn.recv()] = conn
            self._conns = [conns[r] for r in range(self.world_size)]
            self._collect("starting", time.monotonic() + self.start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        finally:
            listener.close()

    def shutdown(self) -> None:
        """Kill every rank process and sweep this pool's /dev/shm segments (idempotent)."""
        for conn in self._conns:
            try:
                conn.close()
            except OSError:
                pass
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._procs, self._conns = [], []
        sweep_segments(self.shm_prefix)
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def leftover_segments(self) -> list[str]:
        return leftover_segments(self.shm_prefix)

    def __enter__(self) -> "EmulatedCluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ running
    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; return the results in rank order.

        `fn` must be importable by name (module level). An exception on any rank raises
        `RankError` here (the pool stays usable if every rank answered); a crash, kill or
        timeout tears the pool down first (the next run starts a fresh one).
        """
        if not self._procs:
            self.start()
        payload = pickle.dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send_bytes(payload)
        limit = self.timeout_s if timeout_s is None else timeout_s
        return self._collect(getattr(fn, "__qualname__", repr(fn)), time.monotonic() + limit, limit)

    def _collect(self, what: str, deadline: float, limit: float | None = None) -> list[Any]:
        results: dict[int, tuple] = {}
        pending = dict(enumerate(self._conns))
        first_error_at: float | None = None
        while pending:
            remaining = deadline - time.monotonic()
            if first_error_at is not None and time.monotonic() - first_error_at > ERROR_GRACE_S:
                # One rank failed and the others are stuck (typically in a collective it never
                # joined): report the failure instead of waiting for the host timeout.
                for r in pending:
                    results[r] = ("stuck",)
                pending = {}
                self.shutdown()
                break
            if remaining <= 0:
                self.shutdown()
                late = sorted(pending)
                raise RankError(f"{what}: ranks {late} did not finish within {limit or self.start_timeout_s:.0f} s "
                                f"(host timeout); the pool was killed and will restart on the next run",
                                rank=late[0])
            for conn in wait(list(pending.values()), timeout=min(remaining, 1.0)):
                rank = next(r for r, c in pending.items() if c is conn)
                try:
                    results[rank] = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    results[rank] = ("died",)
                del pending[rank]
                if first_error_at is None and results[rank][0] != "ok":
                    first_error_at = time.monotonic()
            dead = [r for r in pending if self._procs[r].poll() is not None]
            for r in dead:
                results[r] = ("died",)
                del pending[r]
            if any(res[0] == "died" for res in results.values()) and pending:
                # A dead rank leaves the others stuck in collectives: give them a moment, then kill.
                grace = time.monotonic() + 2.0
                while pending and time.monotonic() < grace:
                    for conn in wait(list(pending.values()), timeout=0.2):
                        rank = next(r for r, c in pending.items() if c is conn)
                        try:
                            results[rank] = pickle.loads(conn.recv_bytes())
                        except (EOFError, OSError):
                            results[rank] = ("died",)
                        del pending[rank]
                for r in pending:
                    results[r] = ("stuck",)
                pending = {}
        died = sorted(r for r, res in results.items() if res[0] == "died")
        if died:
            codes = {r: self._procs[r].poll() for r in died}
            self.shutdown()
            detail = ", ".join(f"rank {r} exit code {c}" for r, c in codes.items())
            raise RankError(f"{what}: emulated rank process died ({detail}); the pool was killed "
                            f"and its shared memory swept", rank=died[0])
        failed = sorted(r for r, res in results.items() if res[0] == "err")
        if failed:
            _, etype, emsg, tb = results[failed[0]]
            others = f" (ranks {failed} failed)" if len(failed) > 1 else ""
            stuck = sorted(r for r, res in results.items() if res[0] == "stuck")
            if stuck:
                others += (f"; ranks {stuck} were still blocked {ERROR_GRACE_S:.0f} s later, so the pool "
                           f"was killed")
            raise RankError(f"{what}: rank {failed[0]} raised {etype}: {emsg}{others}\n--- remote traceback ---\n{tb}",
                            rank=failed[0], remote_type=etype, remote_traceback=tb)
        return [results[r][1] for r in range(self.world_size)]

    def _raise_if_dead(self, what: str) -> None:
        for rank, proc in enumerate(self._procs):
            if proc.poll() is not None:
                raise RankError(f"{what}: emulated rank {rank} exited with code {proc.returncode}", rank=rank)


def run_emulated(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0, **kwargs: Any) -> list[Any]:
    """One-shot: start `world_size` emulated ranks, run `fn` on each, tear them down."""
    with EmulatedCluster(world_size, timeout_s=timeout_s) as cluster:
        return cluster.run(fn, *args, **kwargs)


@atexit.register
def _shutdown_all() -> None:
    for cluster in list(_LIVE_CLUSTERS):
        cluster.shutdown()
