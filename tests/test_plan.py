"""`moespec plan` and the KV sizing the engine shares with it: the released DeepSeek-V3
architecture (config.json only, FP8) under EP=16 and EP=8 on H200s, checked against the bytes
the architecture's numbers give by hand; deployments that do not fit are refused before any
weight is read, naming the component."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from moespec import LLM
from moespec.config import ConfigError, build_config, load_config
from moespec.plan import GiB, parse_bytes, plan_memory

ROOT = Path(__file__).resolve().parent.parent
DEEPSEEK = ROOT / "configs" / "deepseek-v3.yaml"
H200 = parse_bytes("141GB")


def expected_weight_bytes(hf: dict, ep_size: int) -> int:
    """One rank's weights from the architecture's numbers: FP8 projections of every decoder layer
    (MTP layer included) with float32 128x128 scales, this rank's 1/ep of the routed experts,
    bf16 embeddings, lm_head, kv_b_proj, eh_proj and norms, float32 routers."""
    M, V, H = hf["hidden_size"], hf["vocab_size"], hf["num_attention_heads"]
    qr, kr, dn, dr, dv = hf["q_lora_rank"], hf["kv_lora_rank"], hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], \
        hf["v_head_dim"]
    I, Im, E = hf["intermediate_size"], hf["moe_intermediate_size"], hf["n_routed_experts"]
    layers = hf["num_hidden_layers"] + hf["num_nextn_predict_layers"]
    moe_layers = layers - hf["first_k_dense_replace"]

    def fp8(n, k):  # weight bytes + float32 block scales
        return n * k + 4 * -(-n // 128) * -(-k // 128)
    attention = fp8(qr, M) + fp8(H * (dn + dr), qr) + fp8(kr + dr, M) + fp8(M, H * dv) + 2 * H * (dn + dv) * kr
    attention += 2 * (qr + kr + 2 * M)  # q_a/kv_a/input/post norms
    dense = fp8(2 * I, M) + fp8(M, I)
    shared = fp8(2 * Im, M) + fp8(M, Im)
    routed = E // ep_size * (fp8(2 * Im, M) + fp8(M, Im))
    router = 4 * (E * M + E)
    mtp_extra = 2 * (2 * M * M) + 2 * 3 * M
    total = layers * attention + hf["first_k_dense_replace"] * dense + moe_layers * (shared + routed + router)
    return total + 2 * 2 * V * M + 2 * M + mtp_extra


def deepseek_config(**overrides):
    return load_config(DEEPSEEK, overrides)


def test_deepseek_v3_on_16_h200s_fits_with_40gb_of_kv():
    plan = plan_memory(deepseek_config(), H200)
    hf = json.loads((ROOT / "configs" / "deepseek-v3" / "config.json").read_text())
    weights = sum(plan.weights_by_dtype.values())
    assert abs(weights - expected_weight_bytes(hf, 16)) / weights < 0.05, (weights, expected_weight_bytes(hf, 16))
    assert set(plan.weights_by_dtype) == {"float8_e4m3fn", "bfloat16", "float32"}
    assert plan.fits and plan.kv_bytes >= 40e9, plan.as_dict()
    assert plan.fixed_bytes + plan.kv_bytes <= plan.budget
    names = [c.name for c in plan.components]
    assert {"MTP state", "DeepEP low-latency buffer", "activations", "reserve"} <= set(names)
    penalties = {c.name: c.bytes for c in plan.components}["penalty counts"]  # a bool and a float per token id
    assert penalties == deepseek_config().scheduler.max_num_seqs * 5 * hf["vocab_size"]


def test_deepseek_v3_on_8_h200s_says_whether_it_fits_and_why():
    plan = plan_memory(deepseek_config(**{"parallel.ep_size": 8}), H200)
    hf = json.loads((ROOT / "configs" / "deepseek-v3" / "config.json").read_text())
    weights = sum(plan.weights_by_dtype.values())
    assert abs(weights - expected_weight_bytes(hf, 8)) / weights < 0.05
    assert plan.fits and plan.kv_bytes < 20 * GiB  # the experts leave little room for KV
    four = plan_memory(deepseek_config(**{"parallel.ep_size": 4}), H200)
    assert not four.fits and four.problem.startswith("weights (float8_e4m3fn)") and "crosses the budget" in four.problem


def test_the_deepep_buffer_is_planned_for_the_capacity_the_runtime_rounds_to():
    """The runtime rounds DeepEP's C up so that each expert's G*C rows are whole 128-row tiles
    of DeepGEMM's masked GEMM (`aligned_capacity`): 33 requests x (1 + k + 1) = 99 tokens per rank
    at EP 2 become 128, and the plan counts the buffer for 128."""
    from moespec.models.weights import read_hf_config
    from moespec.plan import deepep_components, deepep_low_latency_bytes
    from moespec.models.deepseek_v3 import DeepseekV3Config
    config = deepseek_config(**{"parallel.ep_size": 2, "scheduler.max_num_seqs": 33,
                                "speculation.mode": "mtp", "speculation.num_speculative_tokens": 1})
    model_config = DeepseekV3Config.from_hf(read_hf_config(config.model.path))
    buffer = {c.name: c.bytes for c in deepep_components(config, model_config)}["DeepEP low-latency buffer"]
    M, E = model_config.hidden_size, model_config.n_routed_experts
    assert buffer == deepep_low_latency_bytes(128, M, E) > deepep_low_latency_bytes(99, M, E)


def test_deepep_normal_buffers_are_deepeps_size_hints():
    """DeepEP's normal-mode buffers by its own hint formulas (config.hpp) at its default configs,
    worked out for DeepSeek-V3 (bf16 rows of 7168): at EP 8 one node, NVLink only; at EP 16 the
    dispatch's 288 NVLink slots and the dispatch's RDMA slots (128 aligned up to 20 send tokens:
    140) per channel; the plan's normal-mode line adds the RDMA beyond the low-latency area."""
    from moespec.plan import deepep_normal_bytes
    per_slot = 2 * 7168 + 8 + 128 * 16  # row, source meta, 128 top-k ids (int64), weights, scales
    one_node = 10 * 8 * (5 * 4 + 256 * per_slot)
    assert deepep_normal_bytes(7168, 8) == (-(-one_node // 128) * 128, 0)
    nvl = 10 * 8 * (7 * 4 + 288 * per_slot)
    rdma = 10 * 2 * 2 * (18 * 4 + 140 * (per_slot + 16))
    assert deepep_normal_bytes(7168, 16) == (-(-nvl // 128) * 128, -(-rdma // 128) * 128)


def test_deepep_low_latency_buffer_is_deepeps_size_hint():
    """`get_low_latency_rdma_size_hint` (config.hpp LowLatencyLayout) for DeepSeek-V3 at 384 tokens
    per rank: two send and two receive buffers, each E x C of the larger message (a combine's: 56
    scale pairs and the bf16 row, against a dispatch's 16-byte header and bf16 row), two
    signaling areas of E ints aligned to 128, and DeepEP's rounding, which adds 128 to a total
    already aligned."""
    from moespec.plan import deepep_low_latency_bytes
    C, M, E = 384, 7168, 256
    combine = 4 * (M // 128) + 2 * M
    total = 4 * (E * C * combine) + 2 * 1024
    assert deepep_low_latency_bytes(C, M, E) == (total + 128) // 128 * 128


def test_plan_cli_json():
    run = subprocess.run([sys.executable, "-m", "moespec", "plan", "--config", str(DEEPSEEK), "--set",
                          "parallel.ep_size=16", "--gpu-memory", "141GB", "--json"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["fits"] and report["kv_cache"]["tokens"] > 500_000
    assert {c["name"] for c in report["components"]} >= {"weights (float8_e4m3fn)", "DeepEP low-latency buffer"}
    tight = subprocess.run([sys.executable, "-m", "moespec", "plan", "--config", str(DEEPSEEK), "--set",
                            "parallel.ep_size=4", "--gpu-memory", "141GB"], capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
    assert tight.returncode == 3 and "does not fit: weights (float8_e4m3fn)" in tight.stdout


def test_plan_of_a_cuda_config_without_a_gpu_asks_for_gpu_memory(monkeypatch):
    """Planning a GPU deployment on a machine without CUDA: a ConfigError naming --gpu-memory,
    not torch's "not compiled with CUDA" assertion."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = load_config(str(DEEPSEEK), {"parallel": {"ep_size": 16}})
    with pytest.raises(ConfigError, match=r"model.device is 'cuda' .* --gpu-memory"):
        plan_memory(config)


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    from tiny_models import save_tiny_deepseek
    path = tmp_path_factory.mktemp("plan-tiny")
    save_tiny_deepseek(path, mtp=True)
    return str(path)


def test_engine_sizes_auto_kv_pages_with_the_plan(tiny_deepseek):
    from moespec.engine import Engine
    options = {"model": tiny_deepseek, "page_size": 4, "num_kv_pages": "auto", "speculation": {"mode": "mtp"}}
    whole = plan_memory(build_config({}, {**options, "memory_fraction": 1.0}))
    fraction = (whole.fixed_bytes + 32 * 2**20) / whole.device_bytes  # about 32 MiB left for the KV cache
    config = build_config({}, {**options, "memory_fraction": fraction})
    plan = plan_memory(config)
    assert 28 * 2**20 < plan.kv_bytes <= 32 * 2**20
    engine = Engine(config)
    assert engine.allocator.num_pages == plan.num_kv_pages > 0
    assert engine.runner.cache.layers[0].k.shape[0] == plan.num_kv_pages


def test_a_deployment_that_does_not_fit_is_refused_before_reading_weights(tiny_deepseek, monkeypatch):
    from moespec.engine import Engine
    from moespec.models import weights
    opened = []
    monkeypatch.setattr(weights.WeightLoader, "__init__", lambda self, *a, **k: opened.append(a))
    config = build_config({}, {"model": tiny_deepseek, "page_size": 4, "num_kv_pages": 10**9})
    with pytest.raises(ConfigError, match=r"does not fit on cpu: the KV cache: cache.num_kv_pages 1000000000 needs"):
        Engine(config)
    tiny_budget = build_config({}, {"model": tiny_deepseek, "page_size": 4, "num_kv_pages": 8,
                                    "memory_fraction": 1e-9})
    with pytest.raises(ConfigError, match=r"weights \(float32\) .* crosses the budget"):
        Engine(tiny_budget)
    assert opened == []


def test_plan_counts_the_packed_copy_of_cpu_linears():
    """model.pack_linears on the CPU: the plan's "packed weights" equal what the engine packs."""
    import torch

    from moespec.models.layers import PackedWeight
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    tiny_llama = str(ROOT / "checkpoints" / "tiny-llama")
    options = {"model": tiny_llama, "page_size": 16, "num_kv_pages": 64}
    plan = plan_memory(build_config({}, options))
    packed = {c.name: c.bytes for c in plan.components}.get("packed weights")
    engine = LLM(**options).engine
    made = [v for m in engine.model.modules() for v in vars(m).values() if isinstance(v, PackedWeight)]
    assert made and packed == sum(p.source.numel() * p.source.element_size() for p in made)
    unpacked = plan_memory(build_config({}, {**options, "pack_linears": False}))
    assert "packed weights" not in {c.name for c in unpacked.components}
    assert unpacked.fixed_bytes == plan.fixed_bytes - packed
    # bfloat16 linears are packed at any size: DeepSeek-V3 on the CPU (its FP8 matrices are not)
    cpu = plan_memory(deepseek_config(**{"model.device": "cpu", "parallel.ep_size": 16}), H200)
    assert {c.name: c.bytes for c in cpu.components}["packed weights"] > 2 * GiB
