"""The FlashInfer backend's own code on the CPU, through tests/fake_flashinfer.py (FlashInfer's
wrapper contract in plain torch): eager attention equals the torch backend, and captured steps
(model.cuda_graph) plan FlashInfer's CUDA-graph wrappers before every replay, so they equal
eager steps with one graph per batch shape at every KV length. FlashInfer itself runs only in
tests/test_gpu.py."""
import pytest
import torch

import fake_flashinfer
from moespec import LLM, SamplingParams
from moespec.attention import TorchPagedAttention, create_backend
from moespec.attention.flashinfer_backend import INT_WORKSPACE_BYTES, WORKSPACE_BYTES, FlashInferAttention
from moespec.batch import Span, pack_spans
from moespec.model_runner import ModelRunner
from moespec.models import load_model
from moespec.models.weights import KVSpec
from moespec.plan import plan_memory
from moespec.static_step import StaticSpec
from test_capture import decode_steps
from test_gpu import SHAPES, attention_run
from test_static_step import prompts


@pytest.fixture
def flashinfer(monkeypatch):
    return fake_flashinfer.install(monkeypatch)


@pytest.fixture(scope="module")
def llama64(tmp_path_factory):
    """Tiny Llama targets with FlashInfer's smallest head dim, 64: a target and a draft."""
    from tiny_models import save_tiny_llama
    target, draft = tmp_path_factory.mktemp("fi-target"), tmp_path_factory.mktemp("fi-draft")
    save_tiny_llama(target, layers=2, hidden=256)
    save_tiny_llama(draft, seed=1, layers=1, hidden=256)
    return str(target), str(draft)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("mode,q_len", SHAPES)
def test_eager_flashinfer_equals_torch_attention(flashinfer, kind, mode, q_len):
    spec, heads = ((KVSpec(num_kv_heads=2, k_dim=128, v_dim=128), 8) if kind == "gqa" else
                   (KVSpec(num_kv_heads=1, k_dim=576, v_dim=512, separate_v=False), 16))
    want = attention_run(TorchPagedAttention(), spec, mode, q_len, heads, device="cpu")
    got = attention_run(create_backend("flashinfer", "cpu"), spec, mode, q_len, heads, device="cpu")
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert fake_flashinfer.FakeWrapper.runs == {"graph": 0, "eager": 1}


def test_captured_steps_plan_flashinfers_graph_wrappers_before_each_replay(flashinfer, llama64, monkeypatch):
    """Three requests padded to four at KV lengths 6, 7 and 9 (past a page boundary): one
    captured step serves all three, its wrappers in CUDA-graph mode over buffers for 64 positions
    per request, and gives eager's hidden states and logits. Not planned again before a replay, it
    would read the first batch's pages and lengths."""
    model = load_model(llama64[0], dtype="bfloat16", show_progress=False)
    eager = decode_steps(ModelRunner(model, 16, 4, attention_backend="flashinfer"))
    spec = StaticSpec((1, 4), compile=False, capture=True, kv_capacity=64, smallest_kv_length=4)
    runner = ModelRunner(model, 16, 4, attention_backend="flashinfer", static=spec)
    assert runner.static.kv_lengths == (64,)
    for (h0, l0), (h1, l1) in zip(eager, decode_steps(runner)):
        torch.testing.assert_close(h1, h0, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(l1, l0, rtol=1e-2, atol=1e-2)
    (shape, step), = runner.static.captured.items()
    assert shape == (4, 4, 4, 64) and step.graph.replays == 3
    assert fake_flashinfer.FakeWrapper.runs["graph"] > 0
    wrapper = step.backend.wrappers["paged"]
    assert wrapper.use_cuda_graph and wrapper.buffers["kv_indices"].numel() == 4 * 64 // 4
    torch_logits = decode_steps(ModelRunner(model, 16, 4))[-1][1]  # and the torch backend, in bfloat16
    torch.testing.assert_close(eager[-1][1], torch_logits, rtol=5e-2, atol=5e-2)

    monkeypatch.setattr(FlashInferAttention, "load_plan", lambda self, other: self.slots.copy_(other.slots))
    stale = decode_steps(ModelRunner(model, 16, 4, attention_backend="flashinfer", static=spec))
    assert not torch.allclose(stale[-1][1], eager[-1][1], atol=1e-2)


@pytest.mark.parametrize("mode", ["none", "draft"])
def test_greedy_identical_with_cuda_graph_on_flashinfer(flashinfer, llama64, mode):
    """Through the engine in bfloat16, with chunked prefill: the same tokens with captured steps
    as with eager ones, both on the FlashInfer backend, the draft model's decode captured too."""
    spec = {"mode": "draft", "draft_model": llama64[1], "num_speculative_tokens": 2} if mode == "draft" else None
    batch = prompts([5, 23, 9, 17, 30, 2], seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 7, 1, 10, 12, 3)]
    options = dict(model=llama64[0], dtype="bfloat16", attention_backend="flashinfer", page_size=4, num_kv_pages=128,
                   max_num_seqs=8, max_num_batched_tokens=16, speculation=spec)
    ref = [o.token_ids for o in LLM(**options).generate(batch, params, use_tqdm=False)]
    llm = LLM(**options, cuda_graph=True, compile_batch_sizes=[2, 8])
    assert [o.token_ids for o in llm.generate(batch, params, use_tqdm=False)] == ref
    static = llm.engine.runner.static
    assert static.kv_lengths == (128,)  # one length: max_model_len, the model's 128 positions
    assert sum(step.graph.replays for step in static.captured.values()) > len(static.captured)
    assert fake_flashinfer.FakeWrapper.runs["graph"] > 0
    if mode == "draft":
        assert llm.engine.speculator.runner.static.captured


def test_a_draft_chain_waits_for_each_plans_staged_copy(flashinfer, llama64, monkeypatch, no_leaked_pages):
    """A draft chain plans the draft's eager wrapper once per drafted token within one step, and
    FlashInfer stages each plan's schedule in that wrapper's one pinned host buffer, copied to the
    device asynchronously: each plan waits for an event recorded after the last one (on CUDA,
    torch.cuda.Event) before it overwrites the buffer. The tokens are those without the fence."""
    batch = prompts([5, 23, 9], seed=4)
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 3
    spec = {"mode": "draft", "draft_model": llama64[1], "num_speculative_tokens": 3}
    options = dict(model=llama64[0], dtype="bfloat16", attention_backend="flashinfer", page_size=4, num_kv_pages=128,
                   max_num_seqs=4, speculation=spec)
    ref = [o.token_ids for o in LLM(**options).generate(batch, params, use_tqdm=False)]
    fake_flashinfer.FakeWrapper.async_staging = True
    monkeypatch.setattr(FlashInferAttention, "__init__", with_fake_events(FlashInferAttention.__init__))
    assert [o.token_ids for o in LLM(**options).generate(batch, params, use_tqdm=False)] == ref
    monkeypatch.setattr(FlashInferAttention, "wait_staged", lambda self, kind: None)
    with pytest.raises(RuntimeError, match="staged schedule"):
        LLM(**options).generate(batch, params, use_tqdm=False)
    no_leaked_pages.pop()  # that engine stopped mid-step, on purpose


def with_fake_events(init):
    def build(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.new_event = fake_flashinfer.FakeEvent
    return build


def test_compiled_steps_refuse_flashinfer_whose_plan_cannot_be_traced(flashinfer):
    """FlashInfer plans its wrappers at a step's first attention layer (it needs the head layout),
    which a compiled step would trace ("The plan method cannot be used in Cuda Graph or in
    torch.compile"; traced, a step ran on an older step's pages): model.compile refuses the
    backend by name, and the stand-in refuses a plan inside torch.compile."""
    from moespec.config import ConfigError, EngineConfig, ModelSection
    with pytest.raises(ConfigError, match="model.compile .*flashinfer"):
        EngineConfig(model=ModelSection(path="m", compile=True, attention_backend="flashinfer"))
    EngineConfig(model=ModelSection(path="m", cuda_graph=True, attention_backend="flashinfer"))
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(8, dtype=torch.uint8))
    one = torch.tensor([0, 1], dtype=torch.int32)

    def plan():
        wrapper.plan(one, one, torch.zeros(1, dtype=torch.int32), one[1:], 1, 1, 64, 4, causal=True)
        return torch.ones(1)

    with pytest.raises(Exception, match="cannot run inside torch.compile"):
        torch.compile(plan, backend="eager", fullgraph=True)()


def test_captured_plans_share_their_backends_one_workspace(flashinfer, llama64):
    """Three captured steps (batches of 1, 2 and 4 requests) and the eager steps: two workspaces in
    all, the runner's (eager) and its static steps' (every captured plan), however many shapes are
    captured. (A plan copied before its backend's workspace existed made one per captured step.)"""
    model = load_model(llama64[0], dtype="bfloat16", show_progress=False)
    spec = StaticSpec((1, 2, 4), compile=False, capture=True, kv_capacity=64, smallest_kv_length=4)
    runner = ModelRunner(model, 16, 4, attention_backend="flashinfer", static=spec)
    for requests in (1, 2, 3):
        spans = [Span([3 * b, 3 * b + 1, 3 * b + 2], 6, [10 + b]) for b in range(requests)]
        batch = pack_spans(spans, 4, "decode", sampled=[True] * requests)
        runner.forward(batch, runner.plan(batch))
    batch = pack_spans([Span([0, 1, 2], 4, [5, 6])], 4, "prefill", sampled=[True])  # eager
    runner.forward(batch, runner.plan(batch))
    steps = runner.static.captured
    assert len(steps) == 3
    graph_wrappers = [w for step in steps.values() for w in step.backend.wrappers.values()]
    assert all(w.use_cuda_graph for w in graph_wrappers) and len(graph_wrappers) == 3
    assert {id(w.workspace) for w in graph_wrappers} == {id(runner.static.backend.workspace)}
    assert {id(w.workspace) for w in runner.backend.wrappers.values()} == {id(runner.backend.workspace)}
    assert len(fake_flashinfer.FakeWrapper.workspaces) == 2


def test_plan_counts_one_workspace_per_flashinfer_backend():
    """`moespec plan` counts a FlashInfer workspace per backend: the target's and its speculator's
    runners, and each one's static steps when steps are compiled or captured; and each wrapper's
    own 8 MiB int workspace: one per runner, and one per step shape that may be captured (a
    captured step's wrappers are its own, and one serves every KV length): 11 batch buckets
    (max_num_seqs 64) for decode, and with a draft model for verify and the draft's steps too."""
    from pathlib import Path

    from moespec.config import build_config
    tiny = Path(__file__).resolve().parent.parent / "checkpoints"
    model = {"path": str(tiny / "tiny-llama"), "device": "cpu", "attention_backend": "flashinfer"}
    draft = {"mode": "draft", "draft_model": str(tiny / "tiny-llama-draft"), "num_speculative_tokens": 2}

    def workspaces(model: dict, speculation: dict | None = None, name: str = "FlashInfer workspaces") -> int | None:
        config = build_config({"model": model, **({"speculation": speculation} if speculation else {})})
        named = {c.name: c.bytes for c in plan_memory(config, 24 * 2**30).components}
        return named.get(name)

    assert workspaces(model) == WORKSPACE_BYTES
    assert workspaces({**model, "cuda_graph": True}) == 2 * WORKSPACE_BYTES
    assert workspaces({**model, "cuda_graph": True}, draft) == 4 * WORKSPACE_BYTES
    assert workspaces({**model, "attention_backend": "torch"}) is None
    ints = "FlashInfer int workspaces"
    assert workspaces(model, name=ints) == INT_WORKSPACE_BYTES
    assert workspaces({**model, "cuda_graph": True}, name=ints) == (1 + 11) * INT_WORKSPACE_BYTES
    assert workspaces({**model, "cuda_graph": True}, draft, name=ints) == (2 + 11 * 3) * INT_WORKSPACE_BYTES


def test_flashinfer_planning_reads_nothing_on_the_device(flashinfer):
    """The batch on `meta` (no values: any read of one on the host raises), its host copy beside
    it, as on a GPU: planning the written slots and the wrapper must not touch the device values.
    (repeat_interleave without output_size sizes its output by reading the counts.)"""
    spans = [Span([3 * b, 3 * b + 1], 5 + b, [7] * (1 + b)) for b in range(3)]
    batch = pack_spans(spans, 4, "verify").to("meta")
    backend = FlashInferAttention("meta")
    backend.plan(batch.attention_metadata())
    assert backend.slots.device.type == "meta" and backend.slots.shape == (6,)
    backend.plan_wrapper((8, 2, 128, 128, 0.1, False, torch.bfloat16, torch.bfloat16))
    assert backend.wrappers["paged"].buffers["qo_indptr"].tolist() == [0, 1, 3, 6]
