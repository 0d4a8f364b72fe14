"""Captured steps (model.cuda_graph) off CUDA: each replay re-runs the step and is checked
against the capture (moespec.capture.CheckedReplay), so what a CUDA graph would replay wrongly
fails here: an input passed anew instead of copied into the captured buffer, a Python branch on
a value, a device value read on the host. Through the engine, greedy output is the same with
capture on and off."""
import contextlib

import pytest
import torch

import moespec.static_step as static_step
from moespec import LLM, SamplingParams
from moespec.attention import TorchPagedAttention
from moespec.batch import Span, pack_spans
from moespec.capture import CaptureError, CheckedReplay
from moespec.config import ConfigError, build_config
from moespec.model_runner import ModelRunner
from moespec.models import load_model
from moespec.static_step import StaticSpec
from test_static_step import BATCH, GREEDY, generate, prompts, speculation


def test_a_replay_that_differs_from_its_capture_is_caught():
    buffer, state = torch.arange(4.0), {"scale": 2.0}
    replay = CheckedReplay(lambda: (buffer * state["scale"],))
    out = replay.outputs[0]
    buffer.copy_(torch.arange(4.0) + 1)  # refilled in place: what a graph replays correctly
    assert replay.replay()[0] is out and out.tolist() == [2.0, 4.0, 6.0, 8.0]
    state["scale"] = 3.0  # a host value the graph froze at capture
    with pytest.raises(CaptureError, match="op 0"):
        replay.replay()
    state["scale"] = 2.0
    replay.replay()
    moved = {"x": buffer.clone()}
    replay = CheckedReplay(lambda: (moved["x"] + 1,))
    moved["x"] = moved["x"].clone()  # a new tensor where the graph reads the captured one
    with pytest.raises(CaptureError, match="differs at replay"):
        replay.replay()
    with pytest.raises(CaptureError, match="reads a device value on the host"):
        CheckedReplay(lambda: (buffer[: int(buffer.sum()) % 3 + 1],))


def decode_steps(runner, lengths=(6, 7, 9)):
    """Decode steps of three requests, each at position L (L tokens of KV already there)."""
    outputs = []
    for L in lengths:
        spans = [Span([3 * b, 3 * b + 1, 3 * b + 2], L, [10 + b + L]) for b in range(3)]
        batch = pack_spans(spans, 4, "decode", sampled=[True] * 3)
        outputs.append(runner.forward(batch, runner.plan(batch)))
    return outputs


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_captured_steps_match_eager_across_kv_lengths(llama_pair, deepseek_mtp, family):
    """Three requests padded to four, at KV lengths 7, 8 and 10: the first two replay the step
    captured over 8 KV positions, the third the one over 16 (lengths double from the page
    size); the same hidden states and logits as eager, every replay checked."""
    model = load_model(llama_pair[0] if family == "llama" else deepseek_mtp, show_progress=False)
    eager = ModelRunner(model, 16, 4)
    spec = StaticSpec((1, 4), compile=False, capture=True, kv_capacity=64, smallest_kv_length=4)
    captured = ModelRunner(model, 16, 4, static=spec)
    assert captured.static.kv_lengths == (4, 8, 16, 32, 64)
    for (h0, l0), (h1, l1) in zip(decode_steps(eager), decode_steps(captured)):
        torch.testing.assert_close(h1, h0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    steps = captured.static.captured
    assert {shape: step.graph.replays for shape, step in steps.items()} == {(4, 4, 4, 8): 2, (4, 4, 4, 16): 1}


def test_a_plan_passed_anew_or_a_host_read_fails_the_capture(llama_pair, monkeypatch):
    """What the captured step relies on, broken: the plan bound instead of copied into the
    captured tensors, then a host read inside the forward."""
    model = load_model(llama_pair[0], show_progress=False)
    spec = StaticSpec((4,), compile=False, capture=True, kv_capacity=64)
    with monkeypatch.context() as patch:
        patch.setattr(TorchPagedAttention, "load_plan", lambda self, other: self.__dict__.update(other.__dict__))
        with pytest.raises(CaptureError, match="differs at replay"):
            decode_steps(ModelRunner(model, 16, 4, static=spec))
    norm = type(model.model.norm)
    forward = norm.forward
    monkeypatch.setattr(norm, "forward", lambda self, x: forward(self, x) * (1 + 0 * float(x.sum())))
    with pytest.raises(CaptureError, match="host"):
        decode_steps(ModelRunner(model, 16, 4, static=spec))


def test_kv_longer_than_the_captured_plans_runs_eager(llama_pair):
    model = load_model(llama_pair[0], show_progress=False)
    runner = ModelRunner(model, 16, 4, static=StaticSpec((4,), compile=False, capture=True, kv_capacity=8,
                                                         smallest_kv_length=8))
    batch = pack_spans([Span([0, 1], 7, [5])], 4, "decode", sampled=[True])  # position 7: inside
    assert runner.plan(batch).static.kv_length == 8
    batch = pack_spans([Span([0, 1, 2], 8, [5])], 4, "decode", sampled=[True])  # position 8: past it
    assert runner.plan(batch).static is None


@pytest.mark.parametrize("mode", ["none", "mtp", "draft", "mtp-head"])
def test_greedy_identical_with_cuda_graph(deepseek_mtp, llama_pair, tmp_path, mode):
    """Every speculation mode, mixed lengths and chunked prefill: the same tokens with captured
    steps, which replayed across several batch sizes (the MTP layer's re-run and chain steps and
    the draft's decode too)."""
    path, spec = deepseek_mtp if mode == "mtp" else llama_pair[0], speculation(mode, llama_pair, tmp_path)
    ref, _ = generate(path, BATCH, GREEDY, speculation=spec, max_num_batched_tokens=16)
    got, llm = generate(path, BATCH, GREEDY, speculation=spec, max_num_batched_tokens=16, cuda_graph=True,
                        compile_batch_sizes=[2, 8])
    assert got == ref
    static = llm.engine.runner.static
    assert len({s[0] for s in static.shapes}) > 1 and not static.compiled
    assert sum(step.graph.replays for step in static.captured.values()) > len(static.captured)
    if mode == "draft":
        assert llm.engine.speculator.runner.static.captured  # the draft model's decode too
    if mode in ("mtp", "mtp-head"):
        assert any(s[1] > s[0] == s[2] for s in llm.engine.speculator.static.captured)  # the verify re-run
    if spec is not None:
        assert llm.engine.spec_stats.steps > 0 and any(s[1] > s[0] for s in static.captured)


@pytest.mark.parametrize("overlap", [pytest.param(False, marks=pytest.mark.slow), True])  # overlap on covers both paths
def test_cuda_graph_under_preemption_and_overlap(deepseek_mtp, overlap, monkeypatch):
    """MTP k = 2 with overlap scheduling (verify plans shifted on the device before their
    replay) and a cache small enough to preempt: the same tokens as eager, and requests moving
    from one captured KV length to the next (lengths from 8 here, not 256)."""
    monkeypatch.setattr(static_step, "SMALLEST_KV_LENGTH", 8)
    spec = {"mode": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    batch = prompts([7, 13, 21, 4, 11, 16], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref, _ = generate(deepseek_mtp, batch, params, speculation=spec)
    llm = LLM(model=deepseek_mtp, page_size=4, num_kv_pages=16, max_num_batched_tokens=32, max_num_seqs=8,
              speculation=spec, cuda_graph=True, compile_batch_sizes=[2, 8], overlap=overlap)
    assert llm.engine.warm_up() > 0
    captured = set(llm.engine.runner.static.captured)
    outs = llm.generate(batch, params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == ref
    static = llm.engine.runner.static
    assert set(static.captured) == captured  # the warm-up captured every shape served
    replayed = {shape[3] for shape, step in static.captured.items() if step.graph.replays}
    assert len(replayed) > 1  # at several KV lengths
    if overlap:
        assert llm.engine.stats.shifted_steps > 0


def test_config_checks():
    assert build_config({}, {"model": "m", "cuda_graph": True, "attention_backend": "flashinfer"}).model.cuda_graph
    with pytest.raises(ConfigError, match="parallel.moe_exchange: fixed"):
        build_config({}, {"model": "m", "cuda_graph": True, "parallel": {"ep_size": 2, "moe_exchange": "uneven"}})
    for key in ("microbatch", "two_batch_overlap"):  # captured steps split inside their MoE layers
        assert build_config({}, {"model": "m", "cuda_graph": True,
                                 "parallel": {"ep_size": 2, "moe_exchange": "fixed", key: True}}).model.cuda_graph
    assert build_config({}, {"model": "m", "cuda_graph": True, "parallel": {"ep_size": 2, "moe_backend": "deepep"}})
    assert build_config({}, {"model": "m", "cuda_graph": True}).model.cuda_graph


def test_cuda_graphs_capture_on_the_models_device(monkeypatch):
    """torch.cuda.graph captures on a stream of the current device by default: for a model on
    cuda:1 in a process whose current device is cuda:0, it would record none of the model's
    kernels and every replay would return stale outputs. Warm-up and capture run with the model's
    device current, the capture on a stream of that device (torch.cuda mocked: no GPU here)."""
    from contextlib import contextmanager

    from moespec.capture import CudaGraphs
    current, seen = ["cuda:0"], []

    class Stream:
        def __init__(self, device=None):
            self.device = str(device)

        def wait_stream(self, other):
            pass

    @contextmanager
    def on_device(device):
        saved, current[0] = current[0], str(device)
        yield
        current[0] = saved

    @contextmanager
    def capturing(graph, pool=None, stream=None, capture_error_mode="global"):
        seen.append(("capture stream", stream.device if stream is not None else current[0]))
        yield

    for name, value in {"graph_pool_handle": lambda: object(), "Stream": Stream, "device": on_device,
                        "current_stream": lambda device=None: Stream(device or current[0]),
                        "stream": lambda s: contextlib.nullcontext(), "CUDAGraph": lambda: object(),
                        "graph": capturing}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    CudaGraphs(torch.device("cuda", 1)).capture(lambda: seen.append(("run on", current[0])) or ())
    assert set(seen) == {("run on", "cuda:1"), ("capture stream", "cuda:1")}
