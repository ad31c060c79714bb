"""The GEMM tuner's cache (round trip, misses, malformed files), the per-kernel path choice of
grouped_mlp (portable / hopper / auto) and the plan's record of the expert GEMMs' choices.

The search itself (`tune_grouped_mlp`) times kernels on a GPU: tests/gpu/test_hopper_gemm_gpu.py."""
from __future__ import annotations

import json

import pytest
import torch

from ditron_ep.compiler import tuner
from ditron_ep.compiler.core_config import GemmTileConfig, default_backward_configs, default_gemm_configs
from ditron_ep.compiler.lowering import lower
from ditron_ep.compiler.plan import MoESpec
from ditron_ep.compiler.tuner import CACHE_VERSION, TuneCache, TuneKey, choice_text, parse_choice, rows_bucket
from ditron_ep.ops.moe_layer import hopper_path
from ditron_ep.ops.moe_layer.grouped import grouped_mlp, kernel_choices
from ditron_ep.runtime.errors import DitronConfigError

C = GemmTileConfig


def _key(rows: int = 4096, device: str = "NVIDIA H100 80GB HBM3") -> TuneKey:
    return TuneKey("grouped_mlp.act0", (rows_bucket(rows), 7168, 2048, 32), "bfloat16", 2, device)


def test_rows_bucket_is_the_nearest_power_of_two():
    """A layer tuned at T*K = 32768 rows keeps its entry when a rank receives a few rows more or less."""
    rows = (0, 1, 128, 129, 4096, 5000, 5792, 5793, 32700, 32769, 46340, 46341)
    assert [rows_bucket(r) for r in rows] == [128, 128, 128, 128, 4096, 4096, 4096, 8192, 32768, 32768, 32768, 65536]


def test_key_and_choice_text_round_trip():
    key = _key()
    assert TuneKey.parse(key.text()) == key
    choice = ("hopper", C(128, 256, 64, 8, 4))
    assert parse_choice(choice_text(choice)) == choice
    with pytest.raises(ValueError, match="path"):
        parse_choice("fast:BM128-BN256-BK64-w8-s4")
    with pytest.raises(ValueError, match="op\\|"):
        TuneKey.parse("no-separators")


def test_cache_round_trip_miss_and_other_keys(tmp_path):
    path = tmp_path / "tuned.json"
    cache = TuneCache(path)
    assert cache.get(_key()) is None  # no file: a miss
    choices = {"up": ("hopper", C(128, 128, 64, 8, 4)), "wgrad": ("portable", C(128, 256, 64, 8, 3))}
    cache.put(_key(), choices, {"up": 1.25, "wgrad": 2.5})
    assert TuneCache(path).get(_key()) == choices  # a fresh reader sees the file
    assert cache.get(_key(rows=300)) is None       # another bucket
    assert cache.get(_key(device="NVIDIA H200")) is None
    data = json.loads(path.read_text())
    assert data["version"] == tuner.CACHE_VERSION
    assert data["entries"][_key().text()]["ms"] == {"up": 1.25, "wgrad": 2.5}
    cache.put(_key(rows=300), {"down": ("portable", C(64, 128, 64, 4, 4))})
    assert set(json.loads(path.read_text())["entries"]) == {_key().text(), _key(rows=300).text()}


@pytest.mark.parametrize("content, match", [
    ("{not json", "not valid JSON"),
    (json.dumps({"version": 99, "entries": {}}), "not a ditron_ep tune cache"),
    (json.dumps({"version": 1, "entries": {}}), "version 1 tune cache: its row buckets"),
    (json.dumps({"version": CACHE_VERSION, "entries": {"bad key": {}}}), "expected op"),
])
def test_malformed_cache_files_raise_saying_what_to_do(tmp_path, content, match):
    path = tmp_path / "tuned.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        TuneCache(path).get(_key())


def test_malformed_entry_raises(tmp_path):
    path = tmp_path / "tuned.json"
    entries = {_key().text(): {"choices": {"up": "hopper:BM3"}}}
    path.write_text(json.dumps({"version": CACHE_VERSION, "entries": entries}))
    with pytest.raises(ValueError, match="malformed"):
        TuneCache(path).get(_key())


def test_env_names_the_cache_file(tmp_path, monkeypatch):
    monkeypatch.setenv(tuner.CACHE_ENV, str(tmp_path / "x.json"))
    assert tuner.default_cache_path() == tmp_path / "x.json"


def test_hopper_candidates_fit_shared_memory():
    for kernel in tuner.KERNELS:
        cands = tuner.hopper_candidates(kernel)
        assert cands and all(c.block_k == 64 for c in cands)
        nj = 2 if kernel == "up" else 1
        assert all(c.num_stages * (c.block_m * 64 + nj * 64 * c.block_n) * 2 <= 220 * 1024 for c in cands)


def _inputs(dtype=torch.float32, rows=20, hidden=32, inter=16, num_local=3):
    x = torch.randn(rows, hidden, dtype=dtype)
    off = torch.tensor([0, 5, 5, rows], dtype=torch.int32)
    w1 = torch.randn(num_local, hidden, 2 * inter, dtype=dtype)
    w2 = torch.randn(num_local, inter, hidden, dtype=dtype)
    return x, off, w1, w2


def test_kernel_choices_portable_and_auto_on_the_cpu_are_the_defaults():
    x, off, w1, w2 = _inputs()
    config = default_gemm_configs(torch.float32, "cpu")
    want = {"up": ("portable", config[0]), "down": ("portable", config[1]),
            **{k: ("portable", c) for k, c in default_backward_configs(torch.float32, "cpu").items()}}
    for path in ("portable", "auto"):
        assert kernel_choices(path, x, w1, w2, None, 3, 0, config) == want


def test_path_hopper_says_why_it_cannot_run_and_bad_paths_raise():
    x, off, w1, w2 = _inputs()
    with pytest.raises(DitronConfigError, match="path='hopper' cannot run this call: the Hopper path needs a CUDA"):
        grouped_mlp(x, off, w1, w2, path="hopper")
    with pytest.raises(DitronConfigError, match="path must be one of"):
        grouped_mlp(x, off, w1, w2, path="gluon")
    y = grouped_mlp(x, off, w1, w2, path="auto")
    assert torch.equal(y, grouped_mlp(x, off, w1, w2, path="portable"))


def test_weight_problem_names_the_layouts_tma_cannot_read():
    w = torch.randn(4, 64, 32)
    assert hopper_path.weight_problem("w1", w) is None
    assert hopper_path.weight_problem("w1", w[:2]) is None            # a slice of stacked experts
    assert "not contiguous" in hopper_path.weight_problem("w1", w.transpose(1, 2))
    spaced = torch.randn(4, 80, 32)[:, :64]                            # experts 80 rows apart
    assert "not back to back" in hopper_path.weight_problem("w1", spaced)
    odd = torch.randn(2, 8, 7)                                          # 28-byte rows
    assert "16-byte aligned" in hopper_path.weight_problem("w1", odd)


def test_plan_records_the_expert_gemm_choices():
    plan = lower(MoESpec(world_size=2, num_experts=8, topk=2, hidden=64, ffn_hidden=32, max_tokens=16,
                         dtype="float32", device_type="cpu"))
    record = dict(plan.core.expert_gemms)
    assert set(record) == set(tuner.KERNELS)
    assert all(v.startswith("portable:") and v.endswith("(default)") for v in record.values())
    assert "staged / backward expert GEMMs: up=portable:" in plan.describe()
    assert plan.verified


def test_describe_choices_marks_tuned_ones():
    a, b = ("portable", C(16, 16, 32, 4, 1)), ("hopper", C(128, 128, 64, 8, 4))
    text = tuner.describe_choices({"up": a, "down": b}, {"down": b})
    assert "up: portable BM16-BN16-BK32-w4-s1 (default)" in text
    assert "down: hopper BM128-BN128-BK64-w8-s4 (tuned)" in text


def test_auto_follows_a_tuned_entry_unless_the_caller_chose_the_forward_tiles(monkeypatch):
    """kernel_choices with a cache entry (faked: the CPU has no device name to key it by)."""
    from ditron_ep.ops.moe_layer import grouped

    x, off, w1, w2 = _inputs()
    config = default_gemm_configs(torch.float32, "cpu")
    tuned = {"up": ("hopper", C(128, 128, 64, 8, 3)), "down": ("portable", C(64, 128, 64, 4, 4)),
             "dgrad": ("hopper", C(256, 128, 64, 8, 4))}
    monkeypatch.setattr(grouped, "tuned_choices", lambda *a, **k: dict(tuned))
    monkeypatch.setattr(grouped, "path_problem", lambda *a, **k: None)
    got = kernel_choices("auto", x, w1, w2, None, 3, 0, config)
    assert got["up"] == tuned["up"] and got["down"] == tuned["down"] and got["dgrad"] == tuned["dgrad"]
    assert got["wgrad"][0] == "portable"
    mine = kernel_choices("auto", x, w1, w2, None, 3, 0, config, user_tiles=True)
    assert mine["up"] == ("portable", config[0]) and mine["down"] == ("portable", config[1])
    assert mine["dgrad"] == tuned["dgrad"]
    # path="hopper": every kernel on the Hopper path, tuned Hopper tiles where the entry has them
    forced = kernel_choices("hopper", x, w1, w2, None, 3, 0, config)
    assert all(p == "hopper" for p, _ in forced.values())
    assert forced["up"] == tuned["up"] and forced["down"] == ("hopper", hopper_path.default_hopper_configs()["down"])
    # biases keep a call off the Hopper path: "auto" falls back to portable, "hopper" raises
    assert all(p == "portable" for p, _ in kernel_choices("auto", x, w1, w2, None, 3, 0, config,
                                                           biases=True).values())
    with pytest.raises(DitronConfigError, match="biases"):
        kernel_choices("hopper", x, w1, w2, None, 3, 0, config, biases=True)
