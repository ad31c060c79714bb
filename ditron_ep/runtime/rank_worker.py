"""Entry point of one emulated rank process (started by `EmulatedCluster`; not for users)."""
from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Client


def _die_with_parent() -> None:
    # Linux: SIGKILL this rank when the parent goes away, however it goes.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main() -> None:
    address, rank, world_size, store = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    _die_with_parent()
    conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(os.environ["DITRON_AUTHKEY"]))
    conn.send(rank)
    try:
        import torch.distributed as dist

        import ditron_ep.language  # noqa: F401  (fixes the interpreter mode: the launcher set TRITON_INTERPRET=1)

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=600))
        conn.send_bytes(pickle.dumps(("ok", None)))
    except BaseException as exc:  # report start-up failures to the parent, then exit
        conn.send_bytes(pickle.dumps(("err", type(exc).__name__, str(exc), traceback.format_exc())))
        return
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            fn, args, kwargs = pickle.loads(payload)
            reply = ("ok", fn(*args, **kwargs))
            data = pickle.dumps(reply)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
            data = pickle.dumps(("err", type(exc).__name__, str(exc), traceback.format_exc()))
        conn.send_bytes(data)


if __name__ == "__main__":
    main()
