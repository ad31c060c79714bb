"""Benchmarks of ditron_ep against baselines measured in the same run (`python -m ditron_ep bench`).

* timing.py       — the timing rule (barrier, device sync, slowest rank per iteration), summaries;
* environment.py  — device, versions and commit of a run;
* ranks.py        — a rank's context; failures and checks agreed by every rank;
* ep_inputs.py    — tokens, routing and traffic of the EP benchmarks; the GB/s byte rule;
* alltoall.py     — the all_to_all_single baseline of dispatch/combine and the outputs it implies;
* torch_moe.py    — the torch-native EP MoE forward (the MoE layer's baseline);
* dispatch_combine.py, moe_layer.py — the registry entries "dispatch", "combine", "moe";
* spec.py, registry.py — what a benchmark is; the benchmarks by name;
* runner.py       — runs requests on every rank and turns measurements into rows;
* progress.py     — progress events from rank 0 to the bar;
* report.py       — JSON document (its schema), tables, plot, exit status.

The standalone scripts in the repository's bench/ (more stages, targets, sweeps) use these too.
"""
