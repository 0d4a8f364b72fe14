"""Packing on a CPU whose oneDNN has no bfloat16 linear (no AVX-512 BW/VL/DQ, no AVX-NE-CONVERT,
as on an AVX2-only EPYC): bfloat16 weights get float32 packed copies, the plan counts those, and
the engine loads and gives the greedy tokens it gives where bfloat16 packs. Forced here by
replacing the one capability query, layers.onednn_packs; against oneDNN itself, in a subprocess
with ONEDNN_MAX_CPU_ISA=AVX2 (the variable README's "Tests" runs the whole suite under)."""
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import moespec.models.layers as layers
import moespec.static_step as static_step
from moespec import LLM, SamplingParams
from moespec.config import build_config
from moespec.models.layers import Linear, PackedWeight
from moespec.plan import plan_memory

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


@pytest.fixture
def no_bf16(monkeypatch):
    """The answer of a CPU whose oneDNN runs float32 linears only."""
    monkeypatch.setattr(layers, "onednn_packs", lambda dtype: dtype == torch.float32)
    layers.log_float32_fallback.cache_clear()


@pytest.fixture
def packed_dtypes(monkeypatch):
    """The input dtype of every call that ran packed."""
    calls = []

    def counted(x, packed, bias=None):
        calls.append(x.dtype)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    monkeypatch.setattr(layers, "run_packed", counted)
    return calls


def test_capability_query_agrees_with_onednn():
    """onednn_packs(bfloat16) is True exactly where oneDNN reorders a bfloat16 weight."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(64, 32, dtype=torch.bfloat16), 16)
        reorders = True
    except RuntimeError as error:
        assert "avx512bw" in str(error)
        reorders = False
    assert layers.onednn_packs(torch.bfloat16) == reorders
    assert layers.onednn_packs(torch.float32) and not layers.onednn_packs(torch.float64)


def test_bfloat16_weights_pack_as_float32(no_bf16, packed_dtypes, caplog):
    torch.manual_seed(0)
    layer = Linear(256, 512, bias=True).bfloat16()
    with caplog.at_level(logging.INFO, logger="moespec.models"):
        assert layer.pack() and Linear(512, 256).bfloat16().pack()
    assert layer.packed.dtype == torch.float32 and layer.packed.packed.dtype == torch.float32
    assert layer.packed.nbytes == 512 * 256 * 4
    fallback = [r.message for r in caplog.records if "float32 packed copies" in r.message]
    assert len(fallback) == 1 and "AVX-512 BW, VL and DQ" in fallback[0]  # once, with the reason
    x = torch.randn(16, 256).bfloat16()
    with torch.inference_mode():
        out = layer(x)
        few = layer(x[:7])
    ref = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    assert packed_dtypes == [torch.float32]  # 16 rows packed, in float32; 7 rows not
    assert torch.equal(few, F.linear(x[:7], layer.weight, layer.bias))
    assert not Linear(32, 64).bfloat16().pack()  # under float32's size floor: no copy at all


def test_plan_counts_the_float32_copies(no_bf16, tmp_path):
    """tiny-llama in bfloat16: the plan's "packed weights" are the float32 copies the engine makes."""
    options = {"model": str(ROOT / "checkpoints" / "tiny-llama"), "dtype": "bfloat16", "page_size": 16,
               "num_kv_pages": 64}
    packed = {c.name: c.bytes for c in plan_memory(build_config({}, options)).components}["packed weights"]
    made = [v for m in LLM(**options).engine.model.modules() for v in vars(m).values() if isinstance(v, PackedWeight)]
    assert made and {p.dtype for p in made} == {torch.float32}
    assert packed == sum(p.nbytes for p in made) == sum(2 * p.source.numel() * p.source.element_size() for p in made)


@pytest.mark.parametrize("model,dtype,compiled", [
    ("tiny-llama", "bfloat16", False), ("tiny-llama", "bfloat16", True), ("tiny-llama", "float32", False),
    ("tiny-deepseek-v3", "bfloat16", False),
    pytest.param("tiny-deepseek-v3", "bfloat16", True, marks=pytest.mark.slow)])  # 50 s here
def test_engine_greedy_identical_without_bfloat16_packing(model, dtype, compiled, monkeypatch, packed_dtypes):
    """The trained tiny models, 12 requests at a time: the greedy tokens where this CPU packs, and
    again with the answer of a CPU without bfloat16 (bfloat16 linears as float32 from 8 rows)."""
    monkeypatch.setattr(static_step, "COMPILE_BACKEND", "eager")
    gen = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (5, 9, 3, 12, 7, 4, 10, 6, 8, 2, 11, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    options = dict(model=str(ROOT / "checkpoints" / model), dtype=dtype, page_size=4, num_kv_pages=256,
                   max_num_seqs=12, compile=compiled)
    outputs = []
    for forced in (False, True):
        if forced:
            monkeypatch.setattr(layers, "onednn_packs", lambda dtype: dtype == torch.float32)
        torch._dynamo.reset()
        outputs.append([o.token_ids for o in LLM(**options).generate(batch, params, use_tqdm=False)])
        if forced:
            assert packed_dtypes and set(packed_dtypes) == {torch.float32}
        packed_dtypes.clear()
    torch._dynamo.reset()
    assert outputs[1] == outputs[0]


def test_onednn_without_avx512_loads_a_bfloat16_model():
    """oneDNN limited to AVX2 (ONEDNN_MAX_CPU_ISA) refuses to pack bfloat16, the query says so, and
    a bfloat16 layer packs as float32 and runs."""
    script = """
import torch
from moespec.models.layers import Linear, onednn_packs
assert not torch.ops.mkldnn._is_mkldnn_bf16_supported()
try:
    torch.ops.mkldnn._reorder_linear_weight(torch.ones(64, 32, dtype=torch.bfloat16), 16)
    raise SystemExit("oneDNN packed bfloat16 under ONEDNN_MAX_CPU_ISA=AVX2")
except RuntimeError as error:
    assert "avx512bw" in str(error), error
assert not onednn_packs(torch.bfloat16) and onednn_packs(torch.float32)
layer = Linear(256, 512).bfloat16()
assert layer.pack() and layer.packed.dtype == torch.float32
with torch.inference_mode():
    assert layer(torch.randn(16, 256).bfloat16()).dtype == torch.bfloat16
print("ok")
"""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
