"""Device-side building blocks every op's kernels are written with: heap pointers, bounded
signal waits and notifies, call bracketing (`primitives`), the ordered task queue (`task_queue`),
and the kernel registry the portability check reads (`registry`). Op kernels live beside their
op (`ditron_ep/ops/<op>/*_kernels.py`); only what several ops share lives here."""
from ditron_ep.runtime.mode import decide_mode

decide_mode()  # before any module below imports triton (see ditron_ep.runtime.mode)
