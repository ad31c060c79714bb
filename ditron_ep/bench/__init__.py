"""Benchmarks of ditron_ep against baselines measured in the same run (`python -m ditron_ep bench`).

* timing.py       — the timing rule (barrier, device sync, slowest rank per iteration), summaries;
* environment.py  — device, versions and commit of a run;
* ranks.py        — a rank's context; failures and checks agreed by every rank;
* ep_inputs.py    — tokens, routing, experts' weights and the traffic of the EP benchmarks;
* alltoall.py     — the all_to_all_single baseline of dispatch/combine and the outputs it implies;
* torch_moe.py    — the torch-native EP MoE forward (the MoE layer's baseline);
* the registry entries: dispatch_combine.py ("dispatch", "combine", "dispatch_combine"),
  moe_layer.py ("moe"), moe_timeline.py ("moe_timeline"), grouped_gemm.py ("grouped_gemm");
* spec.py, registry.py — what a benchmark is (its rows, options, checks); the benchmarks by name;
* runner.py       — runs requests on every rank and turns measurements into rows;
* progress.py     — progress events from rank 0 to the bar;
* report.py       — JSON document (its schema), tables, plot, exit status.

Every benchmark of the project is an entry here; bench/results/ keeps the GPU runs' JSON and logs.
"""
from ditron_ep.runtime.mode import decide_mode

decide_mode()  # before any module below imports triton (see ditron_ep.runtime.mode)

