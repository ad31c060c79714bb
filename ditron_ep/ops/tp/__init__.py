"""Tensor parallelism: GEMM + collective ops and the linear layers built on them.

* `functional.py` — all_gather_matmul, matmul_reduce_scatter, matmul_all_reduce (autograd): the
  sequential schedule (the collective and our GEMM as separate steps) or schedule="overlap";
* `fused.py`      — the overlapped schedule's launches on a symmetric heap: `ag_gemm_kernels.py`,
  `gemm_rs_kernels.py`, `gemm_ar_kernels.py` (one persistent kernel each, verified plans of
  compiler/tp_plan.py), bitwise equal to the sequential schedule;
* `gemm.py`       — the dense GEMM they use (the expert-MLP kernels with one expert);
* `modules.py`    — ColumnParallelLinear, RowParallelLinear (Megatron-style, sequence parallelism);
* `naive.py`      — float64 references on the gathered tensors.
"""
from ditron_ep.ops.tp.functional import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter
from ditron_ep.ops.tp.gemm import matmul
from ditron_ep.ops.tp.modules import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "all_gather_matmul", "matmul", "matmul_all_reduce",
           "matmul_reduce_scatter"]
