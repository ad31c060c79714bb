"""The benchmarks `python -m ditron_ep bench` runs, by name. A new benchmark is a `Benchmark`
(spec.py) in a module of its own, listed here."""
from __future__ import annotations

from ditron_ep.bench.deepspeed_moe import DEEPSPEED_MOE
from ditron_ep.bench.dispatch_combine import COMBINE, DISPATCH, DISPATCH_COMBINE
from ditron_ep.bench.gemm_collectives import GEMM_COLLECTIVES
from ditron_ep.bench.gemm_core import DENSE_GEMM, EXPERT_GEMMS
from ditron_ep.bench.megatron_dispatch import MEGATRON_DISPATCH
from ditron_ep.bench.grouped_gemm import GROUPED_GEMM
from ditron_ep.bench.moe_layer import MOE
from ditron_ep.bench.moe_timeline import MOE_TIMELINE
from ditron_ep.bench.moe_train import MOE_TRAIN
from ditron_ep.bench.spec import Benchmark
from ditron_ep.bench.torchtitan_dispatch import TORCHTITAN_DISPATCH
from ditron_ep.bench.tp_mlp import TP_MLP

BENCHMARKS: dict[str, Benchmark] = {
    b.name: b for b in (DISPATCH, COMBINE, MOE, MOE_TRAIN, DISPATCH_COMBINE, MOE_TIMELINE, GROUPED_GEMM,
                       EXPERT_GEMMS, DENSE_GEMM, GEMM_COLLECTIVES, DEEPSPEED_MOE, MEGATRON_DISPATCH, TORCHTITAN_DISPATCH,
                       TP_MLP)}
