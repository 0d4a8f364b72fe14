"""Packed linears (model.pack_linears): CPU linears and the dense expert path run oneDNN's GEMM over
weights reordered once. Same results as the unpacked layers, in eager and compiled steps, and the
cases that must stay unpacked (few rows, autograd, small weights, a weight changed in place)."""
import pytest
import torch
import torch.nn.functional as F

import moespec.models.layers as layers
import moespec.static_step as static_step
from moespec import LLM, SamplingParams
from moespec.model_runner import ModelRunner
from moespec.models import load_model
from moespec.models.layers import Linear, PackedWeight, linear, pack_linears
from moespec.models.moe import LocalExperts
from tiny_models import save_tiny_deepseek, save_tiny_llama

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


@pytest.fixture
def packed_calls(monkeypatch):
    """Counts the calls that ran packed."""
    calls = []

    def counted(x, packed, bias=None):
        calls.append(tuple(x.shape))
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    monkeypatch.setattr(layers, "run_packed", counted)
    return calls


def make_linear(out_dim=512, in_dim=256, bias=False, dtype=torch.float32):
    torch.manual_seed(0)
    return Linear(in_dim, out_dim, bias=bias).to(dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(8, 256), (40, 256), (2, 6, 256)])
def test_packed_linear_matches_f_linear(packed_calls, dtype, tol, shape):
    """Packed in its own dtype, or bfloat16 as float32 where this CPU's oneDNN has no bfloat16."""
    layer = make_linear(bias=True, dtype=dtype)
    assert layer.pack()
    assert layer.packed.dtype == (dtype if layers.onednn_packs(dtype) else torch.float32)
    x = torch.randn(shape).to(dtype)
    with torch.inference_mode():
        out = layer(x)
    ref = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    assert out.dtype == dtype and out.shape == (*shape[:-1], 512)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    assert packed_calls == [shape]


def test_few_rows_autograd_and_small_weights_run_unpacked(packed_calls):
    layer = make_linear()
    assert layer.pack()
    x = torch.randn(7, 256)
    with torch.inference_mode():
        assert torch.equal(layer(x), linear(x, layer.weight))  # under 8 rows: the unpacked path, bit for bit
    x = torch.randn(16, 256, requires_grad=True)
    layer(x).sum().backward()  # autograd: the parameter, never the packed copy
    assert layer.weight.grad is not None and x.grad is not None
    assert packed_calls == []
    assert not make_linear(255, 256).pack()  # float32 under 64Ki elements: MKL's F.linear is faster
    assert not Linear(256, 512).to(torch.float64).pack()


def test_bfloat16_packs_every_size_and_row_count(packed_calls):
    """bfloat16's F.linear is oneDNN's too, reordering the weight each call: packed wins throughout.
    Where oneDNN has no bfloat16 this small weight is left unpacked (tests/test_cpu_capability.py)."""
    layer = make_linear(64, 32, dtype=torch.bfloat16)
    if not layers.onednn_packs(torch.bfloat16):
        assert not layer.pack() and layer.packed is None
        pytest.skip(f"this CPU's oneDNN has no bfloat16 linear (needs {layers.BF16_NEEDS}): packed as float32 "
                    "from 64Ki elements only")
    assert layer.pack()
    x = torch.randn(1, 32).bfloat16()
    with torch.inference_mode():
        out = layer(x)
    torch.testing.assert_close(out.float(), F.linear(x.float(), layer.weight.float()), atol=2e-2, rtol=2e-2)
    assert packed_calls == [(1, 32)]


def test_weight_changed_in_place_is_packed_again(packed_calls):
    layer = make_linear()
    assert layer.pack()
    x = torch.randn(16, 256)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(512, 256))  # as load_state_dict does
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-4, rtol=1e-5)
    assert len(packed_calls) == 1


def test_packed_experts_match_the_dense_path(packed_calls):
    torch.manual_seed(0)
    experts = LocalExperts(8, 256, 80)
    x = torch.randn(16, 256)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(16)])  # [T, A]
    weights = torch.rand(16, 2)
    with torch.inference_mode():
        ref = experts.forward_dense(x, ids, weights)
        assert experts.pack()
        torch.testing.assert_close(experts(x, ids, weights), ref, atol=1e-6, rtol=1e-5)
        assert len(packed_calls) == 2  # gate/up and down, each over every local expert
        small = experts(x[:4], ids[:4], weights[:4])  # under 8 rows: unpacked
    torch.testing.assert_close(small, ref[:4], atol=1e-6, rtol=1e-5)
    assert len(packed_calls) == 2


def test_compiled_graph_keeps_the_packed_op(packed_calls):
    """In a compiled graph each packed linear is one opaque op (`moespec::packed_linear`)."""
    torch.manual_seed(0)
    layer, experts = make_linear(bias=True), LocalExperts(8, 256, 80)
    assert layer.pack() and experts.pack()

    def step(x, ids, weights):
        return experts(layer(x)[:, :256], ids, weights)

    x, ids, weights = torch.randn(16, 256), torch.randint(0, 8, (16, 2)), torch.rand(16, 2)
    with torch.inference_mode():
        eager = step(x, ids, weights)
        packed_calls.clear()
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(x, ids, weights)
    assert torch.equal(compiled, eager)
    assert len(packed_calls) == 3  # the op ran oneDNN's linear at run time


def test_model_runner_packs_on_request(tmp_path):
    save_tiny_llama(tmp_path, hidden=256)
    model = load_model(str(tmp_path), "float32", "cpu")
    ModelRunner(model, 4, 16)
    assert not any(isinstance(m, Linear) and m.packed is not None for m in model.modules())
    ModelRunner(model, 4, 16, pack=True)
    packed = [name for name, m in model.named_modules() if isinstance(m, Linear) and m.packed is not None]
    assert "model.layers.0.self_attn.o_proj" in packed and "model.layers.0.mlp.gate_up_proj" in packed
    assert "lm_head" not in packed  # 120 x 256: under the size floor
    assert pack_linears(torch.nn.Linear(256, 512)) == 0  # torch's own modules are left alone


@pytest.fixture(scope="module", params=["deepseek_v3", "llama"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_deepseek(path, mtp=True) if request.param == "deepseek_v3" else save_tiny_llama(path)
    return str(path)


@pytest.mark.parametrize("mode", ["eager", "compiled", "speculative"])
def test_engine_greedy_identical_with_and_without_packing(tiny, mode, monkeypatch, packed_calls):
    """Every linear and expert layer of the tiny models packed (the size floor lifted): greedy
    tokens equal the unpacked engine's, with 12 requests at a time (decode rows past 8).
    Speculative: MTP k = 2 on DeepSeek, the model as its own draft (k = 2) on Llama."""
    monkeypatch.setattr(layers, "PACKED_MIN_ELEMENTS", 0)
    monkeypatch.setattr(static_step, "COMPILE_BACKEND", "eager")
    options = {"compile": True} if mode == "compiled" else {}
    if mode == "speculative":
        draft = {"mode": "mtp"} if "deepseek" in tiny else {"mode": "draft", "draft_model": tiny}
        options["speculation"] = {**draft, "num_speculative_tokens": 2, "adaptive": False}
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, 120, (n,), generator=gen).tolist() for n in (5, 9, 3, 12, 7, 4, 10, 6, 8, 2, 11, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = {}
    for pack in (False, True):
        llm = LLM(model=tiny, page_size=4, num_kv_pages=256, max_num_seqs=12, pack_linears=pack, **options)
        outputs[pack] = [o.token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    torch._dynamo.reset()
    assert outputs[True] == outputs[False]
    assert packed_calls  # the packed engine ran packed linears
    assert any(isinstance(m, PackedWeight) for m in vars(llm.engine.runner.model.lm_head).values())
