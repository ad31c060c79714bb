"""The registry entries that replaced the standalone benchmark scripts (bench/*.py, now gone): what
each plans to measure on CPUs and GPUs under its settings (`--opt`), and how the settings parse.
No ranks: tests/test_cli_bench.py runs every entry once on emulated ranks."""
from __future__ import annotations

from pathlib import Path

import pytest

from ditron_ep.bench.dispatch_combine import GRAPH_FP8, GRAPHS
from ditron_ep.bench.grouped_gemm import DOWN_CONFIGS, GATE_UP_CONFIGS, INTERPRETER_CONFIGS
from ditron_ep.bench.moe_timeline import parse_variant
from ditron_ep.bench.registry import BENCHMARKS
from ditron_ep.bench.spec import BenchRequest, Shape
from ditron_ep.compiler.core_config import GemmTileConfig
from ditron_ep.runtime import DitronConfigError

REPO = Path(__file__).resolve().parents[1]


def plan(name: str, *options: tuple[str, str], on_gpu: bool = False, tokens: tuple[int, ...] = (128, 4096),
         at: int | None = None) -> dict[str, object]:
    """impl -> Impl of `name`'s config at `at` (default the first of `tokens`)."""
    bench = BENCHMARKS[name]
    req = BenchRequest(name, bench.shapes["torch"], tokens, "bf16", 20, 5, options=options)
    impls = bench.plan(req, tokens[0] if at is None else at, bench.parse_options(req.options), on_gpu)
    return {i.name: i for i in impls}


def test_bench_keeps_no_scripts() -> None:
    """Every benchmark is a registry entry; bench/ holds the GPU runs' results only."""
    assert sorted(p.name for p in (REPO / "bench").iterdir() if p.name != "__pycache__") == ["results"]


def test_dispatch_combine_plans_eager_and_graph_rows() -> None:
    cpu, gpu = plan("dispatch_combine"), plan("dispatch_combine", on_gpu=True)
    eager = ["layout", "dispatch kernel", "EPBuffer.dispatch", "dispatch kernel token_major",
             "EPBuffer.dispatch token_major", "combine kernel", "EPBuffer.combine", "EPBuffer.combine expert_rank",
             "EPBuffer.combine expert_rank fp32", "EPBuffer.combine caller"]
    baselines = ["a2a dispatch", "a2a combine", "a2a dispatch+combine"]
    deepep = ["DeepEP layout+dispatch", "DeepEP combine"]  # GPUs, eager (absent rows say why when it does not import)
    # FP8 dispatch rows: GPUs, bf16, hidden a multiple of 128 (the GPU default shape: H = 7168)
    fp8 = ["EPBuffer.dispatch fp8", "EPBuffer.dispatch fp8 token_major", "EPBuffer.dispatch fp8 token_major dequantize"]
    eager_gpu = eager[:5] + fp8 + eager[5:]
    # the measured bandwidths and each mode's floor (bench/ep_floors.py), derived
    floors = ["floor: dispatch", "floor: dispatch token_major", "floor: combine", "floor: combine expert_rank",
              "floor: combine expert_rank fp32", "floor: combine caller"]
    floors_gpu = floors[:2] + ["floor: dispatch fp8", "floor: dispatch fp8 token_major"] + floors[2:]
    tail, tail_gpu = ["HBM copy", "peer copy (NVLink)", *floors], ["HBM copy", "peer copy (NVLink)", *floors_gpu]
    assert list(cpu) == eager + baselines + tail
    graphs = [*GRAPHS, GRAPH_FP8]  # the FP8 dispatch's graph where its eager rows run
    assert list(gpu) == eager_gpu + graphs + baselines + deepep + tail_gpu
    assert not any(gpu[f].timed for f in floors_gpu) and cpu["HBM copy"].timed
    assert [gpu[g].against for g in graphs] == [
        (), ("a2a dispatch", "floor: dispatch"), ("a2a combine", "floor: combine"), ("a2a dispatch+combine",), (), (),
        ("a2a dispatch", "floor: dispatch token_major"), ("a2a combine", "floor: combine expert_rank"),
        ("a2a combine", "floor: combine expert_rank fp32"), ("a2a combine", "floor: combine caller"),
        ("a2a dispatch", "floor: dispatch fp8")]
    # DeepEP's combine input is token rows: the caller combine against it too
    assert gpu["EPBuffer.combine caller"].against == ("a2a combine", "DeepEP combine", "floor: combine caller")
    assert gpu["EPBuffer.dispatch"].against == ("a2a dispatch", "DeepEP layout+dispatch", "floor: dispatch")
    # FP8 also against our bf16 dispatch of the same layout (the FP8 target: <= 0.6x of it)
    assert gpu["EPBuffer.dispatch fp8"].against == ("a2a dispatch", "EPBuffer.dispatch", "floor: dispatch fp8")
    assert gpu["EPBuffer.dispatch fp8 token_major"].against == (
        "a2a dispatch", "EPBuffer.dispatch token_major", "floor: dispatch fp8 token_major")
    assert gpu["EPBuffer.combine expert_rank"].against == ("a2a combine", "DeepEP combine", "floor: combine expert_rank")
    assert cpu["dispatch kernel"].against == ("a2a dispatch",)   # kernels alone: no floor
    assert list(plan("dispatch_combine", ("mode", "graph"), on_gpu=True)) == [*graphs, *baselines, *tail_gpu]
    assert list(plan("dispatch_combine", ("mode", "eager"), on_gpu=True)) == eager_gpu + baselines + deepep + tail_gpu
    assert [i.kind for i in plan("dispatch", on_gpu=True).values()] == ["ours"] * 4 + ["baseline"]
    assert [i.kind for i in plan("combine", on_gpu=True).values()] == ["ours"] * 4 + ["baseline"]


def test_moe_plans_layers_references_and_floor() -> None:
    small, big = plan("moe", on_gpu=True), plan("moe", on_gpu=True, at=4096)
    assert "FusedMoE sized for T=4096" in small and "FusedMoE sized for T=4096" not in big
    assert {"moe overlap, CUDA graph", "FusedMoE, graph cache off"} <= set(big)
    # DeepEP + grouped_mm: GPUs, bf16 (a row saying why where deep_ep does not import)
    assert [n for n, i in big.items() if i.kind == "baseline"] == [
        "torch-native", "DeepEP + grouped_mm", "DeepEP + grouped_mm, glue-free sum", "grouped GEMM alone"]
    assert big["moe overlap"].against == ("torch-native", "grouped GEMM alone", "DeepEP + grouped_mm",
                                          "DeepEP + grouped_mm, glue-free sum")
    # its parts timed alone (the experts: torch._grouped_mm's), the sum derived from them
    assert {"DeepEP layout+dispatch (layer)", "DeepEP combine (layer)", "grouped_mm experts alone"} <= {
        n for n, i in big.items() if i.kind == "reference"} and not big["DeepEP + grouped_mm, glue-free sum"].timed
    assert "DeepEP + grouped_mm" not in plan("moe", at=4096)
    train = plan("moe_train", on_gpu=True)
    assert train["moe overlap, fwd+bwd"].against == ("torch-native, fwd+bwd", "DeepEP + grouped_mm, fwd+bwd")
    assert "DeepEP + grouped_mm, fwd+bwd" not in plan("moe_train")
    refs = [n for n, i in big.items() if i.kind == "reference" and "DeepEP" not in n and "grouped_mm" not in n]
    assert len(refs) == 8 and refs[-1].startswith("floor") and not big[refs[-1]].timed
    assert not [i for i in plan("moe", ("refs", "0")).values() if i.kind == "reference"]
    assert "FusedMoE sized for T=8192" in plan("moe", ("layer_tokens", "8192"), at=4096)


def test_grouped_gemm_sweep_is_an_option() -> None:
    plain = plan("grouped_gemm", on_gpu=True)
    assert [n for n, i in plain.items() if i.kind == "ours"] == ["gate-up+SwiGLU", "down", "FFN"]
    assert plain["down"].against == ("torch down, W row-major", "torch down, W col-major")
    for on_gpu, (gate_up, down) in ((True, (GATE_UP_CONFIGS, DOWN_CONFIGS)), (False, INTERPRETER_CONFIGS)):
        swept = plan("grouped_gemm", ("sweep", "yes"), on_gpu=on_gpu)
        ours = [n for n, i in swept.items() if i.kind == "ours"]
        assert len(ours) == 3 + 2 * (len(gate_up) + len(down)) + 1 and ours[-1] == "FFN, best swept pair"
        assert f"gate-up+SwiGLU {gate_up[0]} one-tile" in swept and f"down {down[-1]} persistent" in swept


def test_moe_timeline_variants() -> None:
    rows = plan("moe_timeline", ("variant", "comm_programs=0,recv_lag=1024"),
                ("variant", "gate_up_config=BM128-BN128-BK64-w8-s3"))
    assert list(rows) == ["overlap", "overlap comm_programs=0,recv_lag=1024",
                          "overlap gate_up_config=BM128-BN128-BK64-w8-s3", "sequential"]
    assert all(rows[n].against == ("sequential",) for n in list(rows)[:3])
    assert parse_variant(" comm_programs=0, source_order=reverse_ring,down_config=BM64-BN64-BK64-w4-s2") == (
        ("comm_programs", 0), ("source_order", "reverse_ring"), ("down_config", GemmTileConfig(64, 64, 64, 4, 2)))
    for bad in ("", "comm_programs", "=3"):
        with pytest.raises(ValueError):
            parse_variant(bad)


def test_options_parse_with_defaults() -> None:
    dc = BENCHMARKS["dispatch_combine"]
    assert dc.parse_options(()) == {"mode": ("eager", "graph"), "num_programs": None, "block_rows": None,
                                    "block_hidden": None, "hidden_slices": None, "graph_cache": 4,
                                    "check_errors": True, "buffer_tokens": None, "heap": "torch",
                                    "transport": "pointer"}
    got = dc.parse_options((("mode", "graph,eager"), ("check_errors", "off"), ("graph_cache", "0")))
    assert (got["mode"], got["check_errors"], got["graph_cache"]) == (("eager", "graph"), False, 0)
    assert BENCHMARKS["moe_timeline"].parse_options(())["variant"] == ()
    with pytest.raises(DitronConfigError, match="has no option 'sweep'"):
        dc.parse_options((("sweep", "1"),))
    with pytest.raises(DitronConfigError, match="block_rows=0: must be a positive integer"):
        dc.parse_options((("block_rows", "0"),))


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_gpu_defaults(name: str) -> None:
    """The shapes a GPU run gets without flags (README, DESIGN.md's figures)."""
    b = BENCHMARKS[name]
    if name == "deepspeed_moe":  # the drop-in issue's DeepSpeed block: H=4096, I=4H, E=16, top-2, T=4096
        assert b.shapes["torch"] == Shape(4096, 16, 2, 16384) and b.tokens["torch"] == (4096,)
        return
    if name == "tp_mlp":  # the GEMM+collective issue's TP MLP block (a Llama-70B-sized FFN)
        assert b.shapes["torch"] == Shape(8192, 1, 1, 28672) and b.tokens["torch"] == (1024, 4096)
        return
    if name in ("megatron_dispatch", "torchtitan_dispatch"):  # the drop-in issue's dispatcher runs: top-8 of 64, T=4096
        assert b.shapes["torch"] == Shape(7168, 64, 8) and b.tokens["torch"] == (4096,)
        return
    if name == "gemm_collectives":  # the GEMM+collective issue's M per rank (its (op, K, N) table)
        assert b.tokens["torch"] == (128, 1024, 4096, 8192)
        return
    if name == "dense_gemm":  # the GEMM+collective issue's M (K, N: --opt kn, default every pair)
        assert b.tokens["torch"] == (128, 1024, 8192)
        return
    if name == "expert_gemms":  # the GEMM-core issue's T at the layer shape
        assert b.shapes["torch"] == Shape(7168, 64, 8, 2048) and b.tokens["torch"] == (128, 1024, 4096)
        return
    ep = name in ("dispatch", "combine", "dispatch_combine")
    assert b.shapes["torch"] == (Shape(7168, 256, 8) if ep else Shape(7168, 64, 8, 2048))
    # training is timed at the training issue's token counts
    assert b.tokens["torch"] == ((1024, 4096) if name == "moe_train" else (128, 4096)) and b.dtypes["torch"][0] == "bf16"


def test_torchtitan_dispatch_times_torchtitans_alltoall_everywhere():
    """torchtitan's all-to-all dispatcher (written from its source) runs on CPU ranks too."""
    for on_gpu in (False, True):
        rows = plan("torchtitan_dispatch", on_gpu=on_gpu)
        assert list(rows) == ["ditron dispatcher (torchtitan), fwd+bwd", "torchtitan all-to-all dispatcher, fwd+bwd"]
        assert rows["ditron dispatcher (torchtitan), fwd+bwd"].against == ("torchtitan all-to-all dispatcher, fwd+bwd",)


def test_megatron_dispatch_plans_megatrons_dispatchers_on_gpus():
    """Megatron's own dispatchers need CUDA: CPU ranks time ours alone."""
    assert list(plan("megatron_dispatch")) == ["ditron dispatcher, fwd+bwd"]
    gpu = plan("megatron_dispatch", on_gpu=True)
    assert list(gpu) == ["ditron dispatcher, fwd+bwd", "alltoall dispatcher, fwd+bwd", "flex dispatcher (DeepEP), fwd+bwd"]
    assert gpu["ditron dispatcher, fwd+bwd"].against == ("alltoall dispatcher, fwd+bwd",
                                                        "flex dispatcher (DeepEP), fwd+bwd")
