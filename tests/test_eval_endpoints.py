"""Evaluation endpoints over HTTP: /v1/completions with echo (the prompt and its logprobs, the
first token's null), max_tokens 0, vLLM's prompt_logprobs; each prompt logprob equal to
transformers' float32 log-probability of the same token (within 1e-4). Served by a tiny
DeepSeek-V3 with MTP (k=2) over the project tokenizer."""
import json

import httpx
import pytest
import torch

from moespec.config import build_config
from moespec.engine import Engine
from moespec.server import create_app
from test_server import TOKENIZER_DIR, RunningServer
from tiny_models import save_tiny_deepseek

MODEL = "tiny-eval"
TOLERANCE = 1e-4
PROMPT = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(running server, transformers model in float32, tokenizer)."""
    import shutil
    path = tmp_path_factory.mktemp("tiny-eval")
    hf_model = save_tiny_deepseek(path, mtp=True, vocab_size=4096, layers=2).float()
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy(f, path / f.name)
    config = build_config({}, {"model": str(path), "dtype": "float32", "served_model_name": MODEL, "page_size": 4,
                               "num_kv_pages": 256, "max_num_batched_tokens": 8,
                               "speculation": {"mode": "mtp", "num_speculative_tokens": 2, "adaptive": False}})
    engine = Engine(config)
    app = create_app(engine, MODEL)
    with RunningServer(engine, app) as running:
        yield running, hf_model, engine.tokenizer


def complete(server, **body) -> dict:
    response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def reference(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' float32 log-probabilities [L, V]; row p scores token p + 1."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_echo_with_max_tokens_zero_scores_the_prompt(served):
    server, hf_model, tokenizer = served
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    out = complete(server, prompt=ids, max_tokens=0, echo=True, logprobs=2)
    choice, ref = out["choices"][0], reference(hf_model, ids)
    assert choice["text"] == tokenizer.decode(ids) and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) == len(lp["token_logprobs"]) == len(lp["text_offset"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]
    for p in range(1, len(ids)):
        assert abs(lp["token_logprobs"][p] - ref[p - 1, ids[p]].item()) < TOLERANCE, p
        top = ref[p - 1].topk(2)
        assert list(lp["top_logprobs"][p].values()) == pytest.approx(top.values.tolist(), abs=TOLERANCE)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == len(ids)


def test_echo_returns_the_prompt_then_the_completion(served):
    """A text prompt: its text, then the greedy completion, with one logprob per token of both;
    streamed, the same text and logprobs."""
    server, hf_model, tokenizer = served
    body = dict(prompt=PROMPT, max_tokens=4, echo=True, logprobs=1, temperature=0.0, ignore_eos=True)
    choice = complete(server, **body)["choices"][0]
    plain = complete(server, **{**body, "echo": False})["choices"][0]
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert choice["text"] == PROMPT + plain["text"]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 4
    assert lp["token_logprobs"][len(ids):] == plain["logprobs"]["token_logprobs"]
    assert lp["text_offset"][len(ids)] == len(PROMPT)
    ref = reference(hf_model, ids)
    for p in range(1, len(ids)):
        assert abs(lp["token_logprobs"][p] - ref[p - 1, ids[p]].item()) < TOLERANCE, p
    streamed_text, streamed_logprobs = "", []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={"model": MODEL, "stream": True, **body},
                      timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed_text += c["text"]
                    streamed_logprobs += c["logprobs"]["token_logprobs"]
    assert streamed_text == choice["text"] and streamed_logprobs == lp["token_logprobs"]


def test_prompt_logprobs_in_vllm_shape(served):
    """prompt_logprobs: n gives, per prompt token after the first, the token and its top n by
    token id, each with logprob, rank and decoded_token; n = 2 completions both carry it."""
    server, hf_model, tokenizer = served
    ids = tokenizer.encode("import os\nimport sys\n", add_special_tokens=False)
    out = complete(server, prompt=ids, max_tokens=2, prompt_logprobs=3, n=2, temperature=1.0, seed=1)
    ref = reference(hf_model, ids)
    for choice in out["choices"]:
        scored = choice["prompt_logprobs"]
        assert len(scored) == len(ids) and scored[0] is None and choice["logprobs"] is None
        for p in range(1, len(ids)):
            entry, row = scored[p], ref[p - 1]
            chosen = entry[str(ids[p])]
            assert abs(chosen["logprob"] - row[ids[p]].item()) < TOLERANCE
            assert chosen["rank"] == int((row > row[ids[p]]).sum()) + 1
            assert chosen["decoded_token"] == tokenizer.decode([ids[p]])
            assert set(map(int, entry)) == set(row.topk(3).indices.tolist()) | {ids[p]}


@pytest.mark.parametrize("body,param", [
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "a", "echo": True, "logprobs": 21}, "logprobs"),
])
def test_bounds_name_the_field(served, body, param):
    response = httpx.post(f"{served[0].url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_tokenize_detokenize_and_tokenizer_info(served):
    """vLLM's shapes: /tokenize of a prompt (special tokens added by default) and of messages
    (rendered through the chat template, with or without the generation prompt), /detokenize
    back to text, /tokenizer_info with the EOS token and the chat template."""
    server, _, tokenizer = served
    out = post(server, "/tokenize", {"model": MODEL, "prompt": PROMPT, "return_token_strs": True}).json()
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    assert out == {"count": len(ids), "max_model_len": 128, "tokens": ids,
                   "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    plain = post(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False) and plain["token_strs"] is None
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    for generation_prompt in (True, False):
        chat = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": generation_prompt}).json()
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        assert chat["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    opened = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False,
                                        "continue_final_message": True}).json()
    assert len(opened["tokens"]) < chat["count"]  # the assistant's message left open: no end-of-turn tokens
    assert post(server, "/detokenize", {"model": MODEL, "tokens": plain["tokens"]}).json() == {"prompt": PROMPT}
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=60).json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
    assert info["max_model_len"] == 128 and info["vocab_size"] == 4096


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {}, 400, None),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": "x" * 10_000_000}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "a"}]}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/detokenize", {"tokens": [4096]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1] * 129}, 400, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
])
def test_token_endpoints_are_bounded(served, path, body, status, param):
    response = post(served[0], path, body)
    assert response.status_code == status, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param, response.text
