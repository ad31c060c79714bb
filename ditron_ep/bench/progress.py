"""Progress of a benchmark run, from rank 0 to the process that draws the bar.

Under torchrun rank 0 draws the bar itself. Emulated ranks are processes of their own, so rank 0
appends one JSON line per event to a file (`FileSink`) that the launching process follows while
the ranks run (`follow`). An event is (description, iterations done since the last event).
"""
from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

ProgressFn = Callable[[str, int], None]


class FileSink:
    """A ProgressFn that appends its events to `path` (picklable: sent to emulated rank 0)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)

    def __call__(self, description: str, done: int) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps([description, done]) + "\n")


@contextmanager
def follow(path: str | Path, on_event: ProgressFn, poll_s: float = 0.1) -> Iterator[None]:
    """Call `on_event` for every event FileSink appends to `path` while the block runs (from a
    thread; rich's Progress is thread-safe). Events written before the block ends are all seen."""
    path = Path(path)
    path.touch()
    stop = threading.Event()

    def loop() -> None:
        offset = 0
        while True:
            last = stop.is_set()  # read before the file: nothing written before the stop is missed
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1   # complete lines only; a partial one waits for the next poll
            offset += end
            for line in chunk[:end].splitlines():
                description, done = json.loads(line)
                on_event(description, done)
            if last:
                return
            stop.wait(poll_s)

    thread = threading.Thread(target=loop, name="ditron-bench-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
