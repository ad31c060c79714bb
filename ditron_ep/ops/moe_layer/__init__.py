"""The expert-parallel MoE layer.

* `functional.py`  — `moe()` (overlap / sequential / staged) on `MoESlots`: one per process group, or a layer's own;
* `fused.py`       — `FusedMoE`: the fused megakernel's launcher (plan, heap, graph cache);
* `fused_kernels.py` — the persistent megakernel: dispatch, both expert GEMMs and combine as tasks;
* `experts.py`     — the expert MLPs (activations, gated or plain, biases) and their shapes;
* `grouped.py` and `grouped_gemm_kernels.py` — the grouped expert MLP on its own, forward and backward;
* `module.py`      — `EPMoE`: router plus local experts, an `nn.Module`;
* `naive.py`       — the sequential torch.distributed reference and the float64 oracle.
"""
from ditron_ep.ops.moe_layer.functional import clear_layers, moe
from ditron_ep.ops.moe_layer.fused import FusedMoE
from ditron_ep.ops.moe_layer.grouped import grouped_mlp
from ditron_ep.ops.moe_layer.module import EPMoE
from ditron_ep.ops.moe_layer.naive import ep_moe_oracle, ep_moe_reference

__all__ = ["EPMoE", "FusedMoE", "clear_layers", "ep_moe_oracle", "ep_moe_reference", "grouped_mlp", "moe"]
