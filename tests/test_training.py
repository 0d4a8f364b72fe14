"""Training pipeline on a small corpus slice with tiny configs: losses fall, checkpoints reload in
our loader and in transformers, resume continues, head training leaves the target untouched."""
import argparse
import json
from contextlib import nullcontext

import pytest
import torch
from safetensors import safe_open

from moespec.attention import DenseCausalAttention, ForwardContext
from moespec.models import load_model
from moespec.models.mtp_head import MTPHeadModel, load_mtp_head, save_mtp_head
from moespec.training import train_model
from moespec.training.evaluate import evaluate, mtp_forward, prefill_batch
from moespec.training.train_mtp_head import (BuiltinMTPLayer, HeadTrainSettings, build_head, head_losses,
                                             precompute_hidden, save_with_builtin_layer, start_from, train_head)
from moespec.training.train_model import Trainer, compute_losses, evaluate_windows

MAX_BYTES = 200_000
TINY_DEEPSEEK = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 4096, "hidden_size": 32,
    "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
    "v_head_dim": 8, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2,
    "topk_group": 1, "first_k_dense_replace": 1, "num_nextn_predict_layers": 1, "max_position_embeddings": 128,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "tie_word_embeddings": False,
}
TINY_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 4096, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 16, "max_position_embeddings": 128, "tie_word_embeddings": False,
}


def train_args(preset_path, out, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train_model.add_arguments(parser)
    return parser.parse_args(["--preset", str(preset_path), "--out", str(out), "--max-bytes", str(MAX_BYTES),
                              "--seq-len", "32", "--batch-size", "4", "--lr", "1e-2", "--warmup-steps", "2",
                              "--eval-windows", "4", "--eval-every", "1000", *extra])


def write_preset(tmp_path, preset: dict):
    path = tmp_path / f"{preset['model_type']}.json"
    path.write_text(json.dumps(preset))
    return path


def train(tmp_path, preset: dict, steps: int, *extra: str) -> Trainer:
    trainer = Trainer(train_args(write_preset(tmp_path, preset), tmp_path / "out", "--max-steps", str(steps), *extra))
    trainer.run()
    return trainer


def dense_logits(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits [T, V], MTP logits [T-1, V] or None) of one sequence with the dense path."""
    T = ids.numel()
    with torch.no_grad():
        hidden = model(ids, torch.arange(T), ForwardContext(DenseCausalAttention(1), None))
        mtp = None
        if getattr(model, "num_mtp_layers", 0):
            mtp_hidden = model.forward_mtp(0, ids[1:], hidden[:-1], torch.arange(T - 1),
                                           ForwardContext(DenseCausalAttention(1), None))
            mtp = model.compute_mtp_logits(0, mtp_hidden)
        return model.compute_logits(hidden), mtp


def round_to_bf16(model) -> None:
    """Round every saved tensor as the bfloat16 checkpoint does (rotary inv_freq is not saved)."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.copy_(tensor.to(torch.bfloat16).float())


@pytest.fixture(scope="module")
def trained_deepseek(tmp_path_factory):
    return train(tmp_path_factory.mktemp("deepseek"), TINY_DEEPSEEK, 20)


@pytest.fixture(scope="module")
def trained_llama(tmp_path_factory):
    return train(tmp_path_factory.mktemp("llama"), TINY_LLAMA, 20)


def mean_loss(history: list[dict], key: str, steps: slice) -> float:
    values = [r[key] for r in history[steps]]
    return sum(values) / len(values)


def test_deepseek_training_reduces_main_and_mtp_loss_and_balances(trained_deepseek):
    history = trained_deepseek.state.history
    for key in ("ce", "mtp_ce"):
        assert mean_loss(history, key, slice(-3, None)) < mean_loss(history, key, slice(0, 3)) - 0.5, key
    biases = [r.e_score_correction_bias for r in trained_deepseek.balancer.routers]
    assert len(biases) == 2  # the MoE layer and the MTP layer
    assert all(b.abs().sum() > 0 and b.abs().max() <= 20 * 1e-3 + 1e-6 for b in biases)


def test_llama_training_reduces_loss(trained_llama):
    history = trained_llama.state.history
    assert mean_loss(history, "ce", slice(-3, None)) < mean_loss(history, "ce", slice(0, 3)) - 0.5
    out = trained_llama.out
    assert (out / "loss_curve.png").is_file()
    assert json.loads((out / "train_log.json").read_text())["steps"] == 20


@pytest.mark.parametrize("fixture", ["trained_deepseek", "trained_llama"])
def test_checkpoint_reloads_with_our_loader(fixture, request):
    trainer = request.getfixturevalue(fixture)
    model = trainer.model.eval()
    round_to_bf16(model)  # the checkpoint stores bfloat16
    loaded = load_model(trainer.out, show_progress=False)
    ids = trainer.heldout[0]
    ours, ours_mtp = dense_logits(loaded, ids)
    expected, expected_mtp = dense_logits(model, ids)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    if expected_mtp is not None:
        assert ours_mtp is not None
        torch.testing.assert_close(ours_mtp, expected_mtp, atol=1e-4, rtol=1e-4)
        # the MTP layer in the released naming; its embedding and head are the target's, not stored twice
        names = set(safe_open(str(trainer.out / "model.safetensors"), "pt").keys())
        L = loaded.config.num_hidden_layers
        assert {f"model.layers.{L}.{n}.weight" for n in ("enorm", "hnorm", "eh_proj", "shared_head.norm")} <= names
        assert f"model.layers.{L}.embed_tokens.weight" not in names
        assert loaded.mtp_embeds[0] is loaded.model.embed_tokens and loaded.mtp_heads[0] is loaded.lm_head
    config = json.loads((trainer.out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["eos_token_id"] == 1


@pytest.mark.parametrize("fixture", ["trained_deepseek", "trained_llama"])
def test_checkpoint_reloads_with_transformers(fixture, request):
    from transformers import AutoModelForCausalLM

    trainer = request.getfixturevalue(fixture)
    loaded = load_model(trainer.out, show_progress=False)
    hf = AutoModelForCausalLM.from_pretrained(trainer.out, dtype=torch.float32).eval()
    ids = trainer.heldout[0]
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(dense_logits(loaded, ids)[0], theirs, atol=1e-4, rtol=1e-4)


def test_resume_continues_from_saved_step(tmp_path):
    path = write_preset(tmp_path, TINY_LLAMA)
    straight = Trainer(train_args(path, tmp_path / "straight", "--max-steps", "6"))
    straight.run()
    Trainer(train_args(path, tmp_path / "split", "--max-steps", "6", "--stop-at-step", "4")).run()
    resumed = Trainer(train_args(path, tmp_path / "split", "--max-steps", "6", "--resume"))
    assert resumed.state.step == 4
    resumed.run()
    assert resumed.state.step == 6 and len(resumed.state.history) == 6
    losses = [r["loss"] for r in resumed.state.history]
    assert losses == pytest.approx([r["loss"] for r in straight.state.history], rel=1e-3)


def test_distillation_alone_lowers_kl_to_the_teacher(trained_llama, tmp_path):
    teacher = load_model(trained_llama.out, show_progress=False)
    with torch.no_grad():
        losses = compute_losses(teacher, trained_llama.heldout[:2], 0.0, teacher, distill_weight=1.0)
    assert losses.parts["kl"] == pytest.approx(0.0, abs=1e-4)  # a model against itself
    assert evaluate_windows(teacher, trained_llama.heldout, 4, nullcontext, teacher)["teacher_agreement"] == 1.0
    student = train(tmp_path, TINY_LLAMA, 12, "--teacher", str(trained_llama.out), "--ce-weight", "0")
    history = student.state.history
    assert history[-1]["loss"] == pytest.approx(history[-1]["kl"], rel=1e-5)  # the CE is weighted out
    assert mean_loss(history, "kl", slice(-3, None)) < mean_loss(history, "kl", slice(0, 3)) - 0.3
    logged = student.state.evals[-1]["teacher_agreement"]  # logged with every evaluation
    assert logged == evaluate_windows(student.model, student.heldout, 4, student.autocast, teacher)["teacher_agreement"]
    with pytest.raises(ValueError, match="nothing to train"):
        Trainer(train_args(write_preset(tmp_path, TINY_LLAMA), tmp_path / "none", "--ce-weight", "0"))


def test_init_from_starts_from_a_saved_model(trained_llama, tmp_path):
    path = write_preset(tmp_path, TINY_LLAMA)
    warm = Trainer(train_args(path, tmp_path / "warm", "--max-steps", "3", "--init-from", str(trained_llama.out)))
    saved = load_model(trained_llama.out, show_progress=False).state_dict()
    for name, tensor in warm.model.state_dict().items():
        torch.testing.assert_close(tensor, saved[name], msg=name)
    warm.run()
    cold = Trainer(train_args(path, tmp_path / "cold", "--max-steps", "3"))
    cold.run()
    # the warm start begins at the trained model's loss, far below a fresh model's
    assert warm.state.history[0]["ce"] < cold.state.history[0]["ce"] - 1.0
    with pytest.raises(ValueError, match="exclude"):
        Trainer(train_args(path, tmp_path / "warm", "--init-from", str(trained_llama.out), "--resume"))
    (tmp_path / "wider").mkdir()
    wider = write_preset(tmp_path / "wider", {**TINY_LLAMA, "hidden_size": 48})
    with pytest.raises(ValueError, match="does not match preset"):
        Trainer(train_args(wider, tmp_path / "bad", "--init-from", str(trained_llama.out)))


@pytest.mark.parametrize("arch", ["eagle", "rmsnorm"])
@pytest.mark.parametrize("fixture", ["trained_llama", "trained_deepseek"])
def test_head_training_changes_only_the_head(arch, fixture, request, tmp_path):
    trainer = request.getfixturevalue(fixture)
    target = load_model(trainer.out, show_progress=False)
    frozen = {name: t.clone() for name, t in target.state_dict().items()}
    windows = trainer.heldout[:4, :24]  # [N, W]
    hidden = precompute_hidden(target, windows)
    head = build_head(trainer.out, arch, seed=0)
    before = {name: p.detach().clone() for name, p in head.named_parameters()}
    history = train_head(target, head, windows, hidden, HeadTrainSettings(max_steps=4, batch_size=2, warmup_steps=1))
    assert len(history) == 4
    assert all(torch.equal(t, frozen[name]) for name, t in target.state_dict().items())
    assert all(not torch.equal(p, before[name]) for name, p in head.named_parameters())

    save_mtp_head(head, tmp_path / "head")
    assert not any("embed" in n or "lm_head" in n for n in load_mtp_head(target, tmp_path / "head").head.state_dict())
    round_to_bf16(head)
    reloaded = load_mtp_head(target, tmp_path / "head")
    torch.testing.assert_close(mtp_forward(reloaded, windows, hidden.float()),
                               mtp_forward(MTPHeadModel(target, head), windows, hidden.float()), atol=1e-4, rtol=1e-4)
    result = evaluate(target, windows, reloaded, batch_size=2)
    assert 0.0 <= result.head_agreement <= 1.0 and result.head_tokens == 4 * 23


def teacher_forced_loss(target, head, rows, hidden, regression_weight):
    """The one-step loss as train-mtp-head computed it before --unroll."""
    B, W, M = hidden.shape
    hidden = hidden.float()
    embeds = target.embed(rows[:, 1:].reshape(-1))
    out = head(embeds, hidden[:, :-1].reshape(-1, M), torch.arange(W - 1).repeat(B), train_model.dense_context(B))
    next_hidden = hidden[:, 1:].reshape(-1, M)
    target_logp = torch.log_softmax(target.compute_logits(next_hidden).float(), dim=-1)
    kl = torch.nn.functional.kl_div(torch.log_softmax(target.compute_logits(out).float(), dim=-1), target_logp,
                                    log_target=True, reduction="batchmean")
    return kl + regression_weight * torch.nn.functional.smooth_l1_loss(out.float(), next_hidden)


def second_step_kl(target, head, rows, hidden, fed):
    """KL of a second draft step at positions 1..W-2 given the hidden states `fed` [B, W-2, M] there."""
    B, W, M = hidden.shape
    embeds = target.embed(rows[:, 2:].reshape(-1))  # tokens i+1 at positions i = 1..W-2
    out = head(embeds, fed.reshape(-1, M), torch.arange(1, W - 1).repeat(B), train_model.dense_context(B))
    target_logp = torch.log_softmax(target.compute_logits(hidden.float()[:, 2:].reshape(-1, M)).float(), dim=-1)
    return torch.nn.functional.kl_div(torch.log_softmax(target.compute_logits(out).float(), dim=-1), target_logp,
                                      log_target=True, reduction="batchmean").item()


def test_unrolled_head_training_adds_draft_steps_fed_their_own_outputs(tmp_path):
    """--unroll 1 is the teacher-forced loss exactly; --unroll 2 adds a second draft step, fed the
    head's own first-step outputs, whose loss falls with training."""
    target = load_model("checkpoints/tiny-llama", show_progress=False).requires_grad_(False)
    windows = torch.randint(3, 4096, (2, 24), generator=torch.Generator().manual_seed(0))  # [N, W]
    hidden = precompute_hidden(target, windows)
    head = build_head("checkpoints/tiny-llama", "rmsnorm", seed=0)
    one, parts = head_losses(target, head, windows, hidden, 0.5)
    assert one.item() == teacher_forced_loss(target, head, windows, hidden, 0.5).item()
    assert set(parts) == {"kl", "regression", "agreement"}
    two, parts = head_losses(target, head, windows, hidden, 0.5, unroll=2, step_decay=0.5)
    assert {"kl_2", "regression_2", "agreement_2"} <= set(parts)
    step_two = two.item() - one.item()
    assert step_two > 0 and step_two == pytest.approx(0.5 * (parts["kl_2"] + 0.5 * parts["regression_2"]), rel=1e-4)
    B, W, M = hidden.shape  # step 2 at position i is fed the head's own step-1 output at i-1, not the target's
    first = head(target.embed(windows[:, 1:].reshape(-1)), hidden.float()[:, :-1].reshape(-1, M),
                 torch.arange(W - 1).repeat(B), train_model.dense_context(B)).view(B, W - 1, M)
    own = second_step_kl(target, head, windows, hidden, first[:, :-1])
    teacher = second_step_kl(target, head, windows, hidden, hidden.float()[:, 1:-1])
    assert parts["kl_2"] == pytest.approx(own, rel=1e-4) and abs(own - teacher) > 1e-3 * own
    history = train_head(target, head, windows, hidden, HeadTrainSettings(max_steps=12, batch_size=2, warmup_steps=1,
                                                                          unroll=2))
    assert history[-1]["kl_2"] < history[0]["kl_2"] and history[-1]["kl"] < history[0]["kl"]


def test_init_from_starts_a_head_from_a_saved_one_keeping_its_draft_vocab(tmp_path):
    target = load_model("checkpoints/tiny-llama", show_progress=False)
    saved = build_head("checkpoints/tiny-llama", "rmsnorm", seed=1, draft_vocab=torch.arange(64))
    save_mtp_head(saved, tmp_path / "head", dtype=torch.float32)
    head = build_head("checkpoints/tiny-llama", "rmsnorm", seed=0, draft_vocab=torch.arange(100, 164))
    start_from(head, target, tmp_path / "head")
    assert torch.equal(head.draft_vocab, torch.arange(100, 164))
    assert all(torch.equal(t, saved.state_dict()[name]) for name, t in head.state_dict().items() if name != "draft_vocab")
    with pytest.raises(ValueError, match="layout"):
        start_from(build_head("checkpoints/tiny-llama", "eagle", seed=0), target, tmp_path / "head")


@pytest.mark.parametrize("flags, message", [(["--arch", "builtin", "--init-from", "h"], "--init-from"),
                                           (["--unroll", "0"], "--unroll"),
                                           (["--unroll", "15", "--window-len", "16"], "--unroll")])
def test_train_mtp_head_refuses_flags_that_cannot_apply_before_loading(flags, message, tmp_path):
    from moespec.training import train_mtp_head

    parser = argparse.ArgumentParser()
    train_mtp_head.add_arguments(parser)
    args = parser.parse_args(["--target", str(tmp_path / "absent"), "--out", str(tmp_path / "out"), *flags])
    with pytest.raises(ValueError, match=message):  # before the (absent) target is read
        train_mtp_head.run(args)


def test_builtin_mtp_finetune_changes_only_the_mtp_layer(trained_deepseek, trained_llama, tmp_path):
    """--arch builtin: the target's own MTP layer (experts and router included) is trained on the
    frozen trunk and saved back into a whole model directory whose trunk tensors are unchanged."""
    target = load_model(trained_deepseek.out, show_progress=False)
    before = {name: t.clone() for name, t in target.state_dict().items()}
    windows = trained_deepseek.heldout[:4, :24]  # [N, W]
    hidden = precompute_hidden(target, windows)
    head = BuiltinMTPLayer(target)
    history = train_head(target, head, windows, hidden, HeadTrainSettings(max_steps=4, batch_size=2, warmup_steps=1))
    assert len(history) == 4
    changed = {name for name, t in target.state_dict().items() if not torch.equal(t, before[name])}
    assert changed and all(name.startswith("mtp.0.") for name in changed)
    assert {"mtp.0.mlp.experts.w13", "mtp.0.eh_proj.weight", "mtp.0.mlp.gate.weight"} <= changed

    save_with_builtin_layer(target, trained_deepseek.out, tmp_path / "model")
    assert (tmp_path / "model" / "config.json").read_text() == (trained_deepseek.out / "config.json").read_text()
    L = target.config.num_hidden_layers
    with safe_open(trained_deepseek.out / "model.safetensors", "pt") as old, \
            safe_open(tmp_path / "model" / "model.safetensors", "pt") as new:
        assert set(old.keys()) == set(new.keys())
        trunk = [k for k in old.keys() if not k.startswith(f"model.layers.{L}.")]
        assert all(torch.equal(old.get_tensor(k), new.get_tensor(k)) for k in trunk)
        assert not torch.equal(old.get_tensor(f"model.layers.{L}.eh_proj.weight"),
                               new.get_tensor(f"model.layers.{L}.eh_proj.weight"))
    round_to_bf16(target)
    reloaded = load_model(tmp_path / "model", show_progress=False)
    torch.testing.assert_close(mtp_forward(reloaded, windows, hidden.float()),
                               mtp_forward(target, windows, hidden.float()), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="no MTP layer"):
        BuiltinMTPLayer(load_model(trained_llama.out, show_progress=False))


def test_paged_eval_matches_dense_forward(trained_deepseek):
    """The evaluation's paged prefill batch gives the same logits as the dense training path."""
    from moespec.model_runner import ModelRunner
    from moespec.training.evaluate import target_forward

    model = load_model(trained_deepseek.out, show_progress=False)
    windows = trained_deepseek.heldout[:2]
    runner = ModelRunner(model, 2 * -(-windows.shape[1] // 16), 16)
    _, logits = target_forward(runner, windows)
    assert prefill_batch(windows).num_tokens == windows.numel()
    torch.testing.assert_close(logits[1], dense_logits(model, windows[1])[0], atol=1e-4, rtol=1e-4)


def test_draft_agreement_through_the_inference_code(trained_llama, trained_deepseek):
    """A draft model's agreement is its greedy token against the target's at the same position."""
    target = load_model(trained_deepseek.out, show_progress=False)
    draft = load_model(trained_llama.out, show_progress=False)
    windows = trained_deepseek.heldout[:2, :40]
    assert evaluate(target, windows, draft=target, batch_size=2).draft_agreement == 1.0
    expected = torch.cat([(dense_logits(draft, w)[0][:-1].argmax(-1) == dense_logits(target, w)[0][:-1].argmax(-1))
                          for w in windows]).float().mean().item()
    assert evaluate(target, windows, draft=draft, batch_size=2).draft_agreement == pytest.approx(expected, abs=0.02)
