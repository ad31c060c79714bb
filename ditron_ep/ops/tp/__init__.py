"""Tensor parallelism: GEMM + collective ops and the linear layers built on them.

* `functional.py` — all_gather_matmul, matmul_reduce_scatter, matmul_all_reduce (autograd), on
  their sequential schedule (the collective and our GEMM as separate steps; overlapped kernels
  are the GEMM + collective issue's next step);
* `gemm.py`       — the dense GEMM they use (the expert-MLP kernels with one expert);
* `modules.py`    — ColumnParallelLinear, RowParallelLinear (Megatron-style, sequence parallelism);
* `naive.py`      — float64 references on the gathered tensors.
"""
from ditron_ep.ops.tp.functional import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter
from ditron_ep.ops.tp.gemm import matmul
from ditron_ep.ops.tp.modules import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "all_gather_matmul", "matmul", "matmul_all_reduce",
           "matmul_reduce_scatter"]
