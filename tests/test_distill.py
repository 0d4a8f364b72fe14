"""Self-distillation data (`moespec distill`) and an MTP head trained on it over a reduced draft
vocabulary (`moespec train-mtp-head --data DIR --draft-vocab N`)."""
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pydoc_data.topics
import torch
from safetensors.torch import load_file

from moespec.training.distill import KINDS, build_prompts, is_held_out

ROOT = Path(__file__).resolve().parent.parent


def test_prompts_come_in_four_kinds_from_text_on_this_machine():
    prompts = build_prompts(80, seed=0)
    assert [p["kind"] for p in prompts[:8]] == list(KINDS) * 2
    assert build_prompts(80, seed=0) == prompts and build_prompts(80, seed=1) != prompts
    installed = {d.metadata.get("Name") for d in importlib.metadata.distributions()}
    reference = " ".join(" ".join(text.split()) for text in pydoc_data.topics.topics.values())
    for p in prompts:
        if p["kind"] == "chat":
            assert p["content"].split("package ", 1)[1].split(" ")[0] in installed
        elif p["kind"] == "explanation":
            assert p["content"].split("\n\n", 1)[1] in reference
        elif p["kind"] == "code":
            assert "def " in p["content"] and p["content"].endswith("```")
    held = [i for i in range(len(prompts)) if is_held_out(i)]
    assert len(held) == 8 and {prompts[i]["kind"] for i in held} == set(KINDS)  # a tenth, every kind


def test_sources_used_again_come_with_another_question():
    prompts = build_prompts(2000, seed=0)  # more than there are packages, functions or passages
    assert len({p["content"] for p in prompts}) == len(prompts)
    chat = [p["content"] for p in prompts if p["kind"] == "chat"]
    assert len({c.split("package ", 1)[1].split(" ")[0] for c in chat}) < len(chat)  # packages repeat


def test_distilled_data_trains_a_head_over_its_most_frequent_answer_tokens(tmp_path):
    data, head = tmp_path / "data", tmp_path / "head"
    run = subprocess.run([sys.executable, "-m", "moespec", "distill", "--config", "configs/tiny-llama-draft.yaml",
                          "--set", "speculation.mode=none", "--out", str(data), "--prompts", "40",
                          "--max-tokens", "12"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    info = json.loads((data / "info.json").read_text())
    counts = np.load(data / "answer_counts.npy")
    assert info["heldout_prompts"] == 4 and 0 < counts.sum() == info["train_answer_tokens"] <= 36 * 12
    assert len(np.load(data / "train.npy")) == info["train_tokens"] > counts.sum()
    held = [json.loads(line) for line in (data / "heldout_prompts.jsonl").read_text().splitlines()]
    assert {h["kind"] for h in held} == set(KINDS)
    run = subprocess.run([sys.executable, "-m", "moespec", "train-mtp-head", "--target", "checkpoints/tiny-llama",
                          "--out", str(head), "--data", str(data), "--draft-vocab", "64", "--max-steps", "2",
                          "--train-windows", "4", "--window-len", "32", "--eval-windows", "2", "--batch-size", "2"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    config = json.loads((head / "config.json").read_text())
    ids = load_file(head / "model.safetensors")["draft_vocab"]
    assert config["draft_vocab_size"] == 64 and ids.dtype == torch.int64
    assert set(ids.tolist()) == set(torch.from_numpy(counts).topk(64).indices.tolist())
