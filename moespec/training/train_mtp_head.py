"""Train an MTP head for a frozen target, or fine-tune the target's own MTP layer.

Command: `moespec train-mtp-head --target DIR --out DIR [--arch eagle|rmsnorm|builtin] [--minutes N]
[--data DIR] [--draft-vocab N]`.

The training text is the project's corpus, or with `--data DIR` the token streams `moespec distill`
wrote there (the target's own answers: self-distillation). `--draft-vocab N` makes the head draft
over the N tokens most frequent in those answers (`answer_counts.npy`; without it, in the training
windows): the head is trained on the full vocabulary and its draft logits are then restricted to
those rows (models/mtp_head.py).

The target's final hidden states are precomputed once with the inference forward (`ModelRunner`
over the paged cache) and cached. The head sees, at position i, the embedding of token i+1 and
the target's hidden at i; its loss is KL(target's next-token distribution ‖ head's) plus
`--regression-weight` · smooth-L1 to the target's hidden at i+1. The target's embeddings and
lm_head are shared and stay frozen; only the head's parameters are optimized. `--unroll K` trains K
draft steps: steps after the first feed the head its own previous outputs as a draft chain does
(training-time test; see head_losses).

`--arch builtin` trains the target's own MTP layer (DeepSeek-V3's model.layers.{L}, MoE included)
the same way, starting from its weights: a layer trained jointly on the text's token i+2 learns to
imitate what the target predicts instead, which is what speculation accepts, and to hand its
output on as the next chain step's hidden state. `--out` then receives the whole model directory
(the trunk's tensors unchanged), and its logs are named mtp_finetune_log.json / mtp_finetune_curve.png
so that the model's own training log stays.

Shapes legend: N windows, B batch, W window length, T = B*(W-1) head positions, M hidden, V vocab.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from moespec.model_runner import ModelRunner
from moespec.models import load_model
from moespec.models.mtp_head import HEAD_ARCHITECTURES, MTPHead, MTPHeadConfig, load_mtp_head, save_mtp_head
from moespec.models.weights import read_hf_config
from moespec.training.checkpoint import copy_tokenizer, export_tensors
from moespec.training.corpus import CorpusSpec, cut_windows
from moespec.training.data import DEFAULT_TOKENIZER, cache_dir, load_streams
from moespec.training.evaluate import PAGE_SIZE, describe, evaluate, load_heldout, num_pages_for, target_forward
from moespec.training.plots import plot_losses
from moespec.training.train_model import (autocast_for, build_optimizer, dense_context, init_weights, lr_factor,
                                          seed_everything)

log = logging.getLogger(__name__)


@dataclass
class HeadTrainSettings:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    batch_size: int = 8
    regression_weight: float = 1.0
    unroll: int = 1  # draft steps trained per window (1: teacher-forced only)
    step_decay: float = 0.8  # loss weight of step j is step_decay**(j-1)
    max_steps: int = 100_000
    minutes: float | None = None
    precision: str = "bf16"
    seed: int = 0


# ---------------------------------------------------------------- target hidden states


@torch.inference_mode()
def precompute_hidden(target: nn.Module, windows: torch.Tensor, batch_size: int = 4) -> torch.Tensor:
    """The target's final hidden states [N, W, M] (bfloat16) from its paged inference forward."""
    runner = ModelRunner(target, num_pages_for(batch_size, windows.shape[1]), PAGE_SIZE)
    parts = [target_forward(runner, windows[s:s + batch_size])[0].to(torch.bfloat16)
             for s in tqdm(range(0, len(windows), batch_size), desc="target hidden states", unit="batch")]
    return torch.cat(parts)


def cached_hidden(target_dir: Path, target: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """precompute_hidden, cached by the target's weights and the windows."""
    digest = hashlib.sha1()
    source = Path(target_dir)
    files = [source] if source.is_file() else sorted(source.glob("*.safetensors")) + sorted(source.glob("*.gguf"))
    for file in files:
        digest.update(file.read_bytes())
    digest.update(windows.numpy().tobytes())
    path = cache_dir().parent / "hidden" / f"{digest.hexdigest()[:16]}.pt"
    if path.is_file():
        return torch.load(path)
    hidden = precompute_hidden(target, windows)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(hidden, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)  # atomic: a concurrent run never reads half a file
    return hidden


def train_windows(count: int, window: int, seed: int, tokenizer: Path, max_bytes: int | None,
                  data: Path | None = None) -> torch.Tensor:
    train, _ = read_streams(tokenizer, max_bytes, data)
    rows = cut_windows(train, window, seed=seed)[:count]  # [N, W]
    return torch.from_numpy(rows.astype("int64"))


def read_streams(tokenizer: Path, max_bytes: int | None, data: Path | None) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) token streams: `moespec distill`'s in `data`, or the project corpus's."""
    if data is None:
        return load_streams(CorpusSpec(max_bytes=max_bytes), tokenizer)
    return np.load(Path(data) / "train.npy"), np.load(Path(data) / "heldout.npy")


def most_frequent_tokens(count: int, windows: torch.Tensor, vocab_size: int, data: Path | None) -> torch.Tensor:
    """The `count` token ids most frequent in the distilled answers (`answer_counts.npy` in
    `data`) or else in the training windows, ascending -> [N] int64."""
    if count > vocab_size:
        raise ValueError(f"--draft-vocab {count} is more than the target's vocabulary of {vocab_size}")
    counts_file = Path(data) / "answer_counts.npy" if data is not None else None
    if counts_file is not None and counts_file.is_file():
        counts = torch.from_numpy(np.load(counts_file))
    else:
        counts = torch.bincount(windows.flatten(), minlength=vocab_size)
    return counts.topk(count).indices.sort().values


# ---------------------------------------------------------------- training


def head_losses(target: nn.Module, head: MTPHead, rows: torch.Tensor, hidden: torch.Tensor,
                regression_weight: float, unroll: int = 1,
                step_decay: float = 0.8) -> tuple[torch.Tensor, dict[str, float]]:
    """rows [B, W], target hidden [B, W, M] -> KL + w·smooth-L1 of the head at positions 0..W-2,
    and with `unroll` K > 1 of the head fed its own outputs for K-1 further draft steps.

    Step 1 is teacher-forced: at position i the head sees the target's hidden at i and the
    embedding of token i+1 and is trained towards the target at i+1. Step j > 1 runs the head over
    the window again with, at position i, its own step j-1 output at i-1 in place of the target's
    hidden (as a draft chain feeds it) and the same embedding and targets; so step j at i is the
    j-th draft from position i-j+1. Its loss is weighted step_decay**(j-1). This is a full-window
    causal approximation of training-time test (EAGLE-3, HASS): at inference a chain step attends
    to the teacher-forced keys of earlier positions, here to the same step's keys.
    """
    B, W, M = hidden.shape
    hidden = hidden.float()
    embeds = target.embed(rows[:, 1:].reshape(-1))  # [T, M] frozen embeddings of tokens i+1
    inputs = hidden[:, :-1].reshape(-1, M)  # [T, M] step 1: the target's hidden at i
    next_hidden = hidden[:, 1:].reshape(-1, M)  # [T, M] target's hidden at i+1
    with torch.no_grad():
        target_logp = F.log_softmax(target.compute_logits(next_hidden).float(), dim=-1)  # [T, V]
    total, parts = 0.0, {}
    for j in range(unroll):
        L = W - 1 - j  # positions j..W-2 have a step j+1 draft
        keep = torch.arange(j, W - 1).repeat(B) + torch.arange(B).repeat_interleave(L) * (W - 1)  # [B*L] of [T]
        out = head(embeds[keep], inputs, torch.arange(j, W - 1).repeat(B), dense_context(B))  # [B*L, M]
        loss, step_parts = step_loss(target, out, next_hidden[keep], target_logp[keep], regression_weight)
        total = total + step_decay ** j * loss
        parts.update({(name if j == 0 else f"{name}_{j + 1}"): v for name, v in step_parts.items()})
        inputs = out.view(B, L, M)[:, :-1].reshape(-1, M)  # output at i feeds position i+1
    return total, parts


def step_loss(target: nn.Module, out: torch.Tensor, next_hidden: torch.Tensor, target_logp: torch.Tensor,
              regression_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    """head output [T, M] against the target's hidden [T, M] and log-probabilities [T, V]."""
    logits = target.compute_logits(out).float()  # [T, V] through the frozen lm_head
    kl = F.kl_div(F.log_softmax(logits, dim=-1), target_logp, log_target=True, reduction="batchmean")
    regression = F.smooth_l1_loss(out.float(), next_hidden)
    agreement = (logits.argmax(-1) == target_logp.argmax(-1)).float().mean()
    parts = {"kl": kl.item(), "regression": regression.item(), "agreement": agreement.item()}
    return kl + regression_weight * regression, parts


def train_head(target: nn.Module, head: MTPHead, windows: torch.Tensor, hidden: torch.Tensor,
               settings: HeadTrainSettings) -> list[dict]:
    """Optimize only the head's parameters; returns the per-step history."""
    target.requires_grad_(False)
    head.requires_grad_(True)  # a built-in layer's parameters belong to the target
    head.train()
    optimizer = build_optimizer(head, settings.lr, settings.weight_decay)
    autocast = autocast_for(settings.precision)
    generator = torch.Generator().manual_seed(settings.seed)
    budget = settings.minutes * 60 if settings.minutes else float("inf")
    history: list[dict] = []
    elapsed, step, tokens = 0.0, 0, 0
    bar = tqdm(total=None if settings.minutes else settings.max_steps, desc="train head", unit="step",
               dynamic_ncols=True)
    order = torch.randperm(len(windows), generator=generator)
    while step < settings.max_steps and elapsed < budget:
        start = time.perf_counter()
        picks, order = next_batch(order, settings.batch_size, len(windows), generator)
        factor = lr_factor(step, max(step / settings.max_steps, elapsed / budget), settings.warmup_steps,
                           settings.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * factor
        with autocast():
            loss, parts = head_losses(target, head, windows[picks], hidden[picks], settings.regression_weight,
                                      settings.unroll, settings.step_decay)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), settings.grad_clip)
        optimizer.step()
        took = time.perf_counter() - start
        step, elapsed = step + 1, elapsed + took
        tokens += len(picks) * (windows.shape[1] - 1)
        history.append({"step": step, "loss": loss.item(), **parts, "tokens": tokens, "elapsed": round(elapsed, 2),
                        "tokens_per_s": len(picks) * (windows.shape[1] - 1) / took})
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", agree=f"{parts['agreement']:.1%}")
    bar.close()
    head.eval()
    return history


def next_batch(order: torch.Tensor, batch_size: int, count: int,
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Take the next `batch_size` window ids from a shuffled order, reshuffling when it runs out."""
    if len(order) < batch_size:
        order = torch.cat([order, torch.randperm(count, generator=generator)])
    return order[:batch_size], order[batch_size:]


class BuiltinMTPLayer(nn.Module):
    """The target's own MTP layer `index`, called as an MTPHead is: head(embeds, hidden, positions,
    ctx) -> hidden. Its parameters are the target's; embeddings and lm_head stay the trunk's."""

    def __init__(self, target: nn.Module, index: int = 0) -> None:
        super().__init__()
        if getattr(target, "num_mtp_layers", 0) <= index:
            raise ValueError("--arch builtin: the target has no MTP layer; train a head with --arch rmsnorm")
        if target.mtp_embeds[index] is not target.model.embed_tokens or target.mtp_heads[index] is not target.lm_head:
            raise ValueError(f"--arch builtin: MTP layer {index} stores its own embed_tokens or shared_head.head; "
                             "fine-tuning needs them shared with the target")
        self.layer = target.mtp[index]
        self.rotary = [target.model.rotary_emb]  # a list, so the trunk's rotary tables are not ours

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        rope = self.rotary[0]
        return self.layer(embeds, hidden, rope, rope(positions, hidden.dtype), ctx)


def save_with_builtin_layer(target: nn.Module, target_dir: Path, out: Path) -> None:
    """The target as an HF model directory at `out`: config and tokenizer copied, every tensor
    (the fine-tuned MTP layer's included) exported in the released names."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(export_tensors(target), str(out / "model.safetensors"), metadata={"format": "pt"})
    if Path(target_dir).resolve() != out.resolve():
        shutil.copy(Path(target_dir) / "config.json", out / "config.json")
        copy_tokenizer(target_dir, out)


def build_head(target_dir: Path, architecture: str, seed: int, draft_vocab: torch.Tensor | None = None) -> MTPHead:
    """A fresh head; with draft_vocab [N] (token ids) drafting over those tokens alone."""
    torch.manual_seed(seed)
    size = 0 if draft_vocab is None else draft_vocab.numel()
    head = MTPHead(MTPHeadConfig.for_target(read_hf_config(target_dir), architecture, size))
    init_weights(head)
    if draft_vocab is not None:
        head.draft_vocab.copy_(draft_vocab)
    return head


def start_from(head: MTPHead, target: nn.Module, head_dir: Path) -> None:
    """Copy a saved head's layer weights (same layout) into `head`; its draft vocabulary stays its own."""
    saved = {name: t for name, t in load_mtp_head(target, head_dir).head.state_dict().items() if name != "draft_vocab"}
    missing, unexpected = head.load_state_dict(saved, strict=False)
    if unexpected or set(missing) - {"draft_vocab"}:
        raise ValueError(f"--init-from {head_dir}: not this head's layout (missing {missing}, unexpected {unexpected})")


# ---------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, type=Path, help="frozen target model directory")
    parser.add_argument("--out", required=True, type=Path,
                        help="head directory to write (with --arch builtin: the whole model directory)")
    parser.add_argument("--arch", choices=(*HEAD_ARCHITECTURES, "builtin"), default="rmsnorm",
                        help="eagle: EAGLE-1 layout without norms; rmsnorm: DeepSeek MTP layout with norms; "
                             "builtin: fine-tune the target's own MTP layer (--out gets the whole model)")
    parser.add_argument("--train-windows", type=int, default=600, help="training windows of target hidden states")
    parser.add_argument("--window-len", type=int, default=512)
    parser.add_argument("--eval-windows", type=int, default=48)
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--max-bytes", type=int, default=None)
    parser.add_argument("--data", type=Path, default=None,
                        help="train on `moespec distill`'s token streams in this directory instead of the corpus")
    parser.add_argument("--draft-vocab", type=int, default=0,
                        help="draft over the N most frequent answer tokens (0: the whole vocabulary)")
    parser.add_argument("--init-from", type=Path, default=None,
                        help="start from this saved head's weights (same --arch; the draft vocabulary is this run's)")
    parser.add_argument("--minutes", type=float, default=None, help="training time budget")
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--regression-weight", type=float, default=1.0)
    parser.add_argument("--unroll", type=int, default=1,
                        help="draft steps trained per window: step j>1 feeds the head its own step j-1 outputs "
                             "(training-time test); 1: teacher-forced only")
    parser.add_argument("--step-decay", type=float, default=0.8, help="loss weight of step j is step_decay**(j-1)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    builtin = args.arch == "builtin"
    if builtin and (args.draft_vocab or args.init_from):
        raise ValueError("--draft-vocab and --init-from apply to a trained head, not to --arch builtin")
    if not 1 <= args.unroll < args.window_len - 1:
        raise ValueError(f"--unroll must be at least 1 and below --window-len - 1, got {args.unroll}")
    target = load_model(args.target, show_progress=False)
    windows = train_windows(args.train_windows, args.window_len, args.seed + 1, args.tokenizer, args.max_bytes,
                            args.data)
    hidden = cached_hidden(args.target, target, windows)
    draft_vocab = (most_frequent_tokens(args.draft_vocab, windows, target.config.vocab_size, args.data)
                   if args.draft_vocab else None)
    head = BuiltinMTPLayer(target) if builtin else build_head(args.target, args.arch, args.seed, draft_vocab)
    if args.init_from:
        start_from(head, target, args.init_from)
    settings = HeadTrainSettings(lr=args.lr, batch_size=args.batch_size, regression_weight=args.regression_weight,
                                 unroll=args.unroll, step_decay=args.step_decay,
                                 max_steps=args.max_steps, minutes=args.minutes, precision=args.precision,
                                 seed=args.seed)
    history = train_head(target, head, windows, hidden, settings)
    heldout = load_heldout(args.eval_windows, args.window_len, args.tokenizer, args.max_bytes, args.data)
    if builtin:
        save_with_builtin_layer(target, args.target, args.out)
        model = load_model(args.out, show_progress=False)
        result = evaluate(model, heldout, model)
    else:
        save_mtp_head(head, args.out)
        result = evaluate(target, heldout, load_mtp_head(target, args.out))
    print(describe(result))
    names = ("mtp_finetune_log.json", "mtp_finetune_curve.png") if builtin else ("train_log.json", "loss_curve.png")
    write_head_log(args, settings, history, asdict(result), names)


def write_head_log(args: argparse.Namespace, settings: HeadTrainSettings, history: list[dict], result: dict,
                   names: tuple[str, str] = ("train_log.json", "loss_curve.png")) -> dict:
    """The run's summary and history as JSON and its loss curve, under `names` in --out."""
    elapsed = history[-1]["elapsed"] if history else 0.0
    tokens = history[-1]["tokens"] if history else 0
    summary = {"date": time.strftime("%Y-%m-%d"), "target": str(args.target), "head_architecture": args.arch,
               "settings": asdict(settings), "train_windows": args.train_windows, "window_len": args.window_len,
               "steps": len(history), "tokens": tokens, "train_minutes": round(elapsed / 60, 2),
               "tokens_per_s": round(tokens / max(elapsed, 1e-9), 1), "eval": result, "history": history}
    (args.out / names[0]).write_text(json.dumps(summary, indent=1) + "\n")
    plot_losses(history, [], args.out / names[1], title=f"{args.out.name} ({args.arch})")
    return summary


def main(argv: list[str] | None = None) -> None:
    from moespec.arguments import run_standalone

    run_standalone("moespec train-mtp-head", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    main()
