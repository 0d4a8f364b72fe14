"""Train a tiny target or draft model from an HF config preset on the corpus.

Command: `moespec train-model --preset tiny-deepseek-v3|tiny-llama|tiny-llama-draft|CONFIG.json
--out DIR [--minutes N] [--max-steps N] [--resume | --init-from DIR] [--teacher DIR]`.

DeepSeek models train their MTP layer jointly (loss = CE + λ·MTP CE, MTP input at i =
(embedding of token i+1, final hidden at i), target token i+2) and balance experts without an
auxiliary loss: after every step each router's e_score_correction_bias moves by ±γ towards
equal load. A `--teacher` adds KL(teacher ‖ student) to the loss (draft distillation).
`--init-from DIR` starts from the weights of a model trained earlier (e.g. a released checkpoint
without its training state) with a fresh optimizer and schedule.

Shapes legend: B batch, L window length, T = B*L tokens, M hidden, V vocab, E experts, A top-k.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from moespec.attention import DenseCausalAttention, ForwardContext
from moespec.models import ARCHITECTURES, build_model, load_model
from moespec.models.deepseek_v3 import TopkRouter
from moespec.models.moe import LocalExperts
from moespec.training.checkpoint import load_training_state, save_hf_model, save_training_state
from moespec.training.corpus import CorpusSpec
from moespec.training.data import DEFAULT_TOKENIZER, WindowSampler, heldout_windows, load_streams
from moespec.training.plots import plot_losses

log = logging.getLogger(__name__)

PRESETS_DIR = Path(__file__).parent / "presets"


# ---------------------------------------------------------------- model


def load_preset(name: str) -> dict:
    """A preset name (presets/<name>.json) or a path to an HF config.json."""
    path = PRESETS_DIR / f"{name}.json"
    if not path.is_file():
        path = Path(name)
    if not path.is_file():
        known = sorted(p.stem for p in PRESETS_DIR.glob("*.json"))
        raise FileNotFoundError(f"preset {name!r} is neither a known preset {known} nor a config file")
    return json.loads(path.read_text())


def build_from_preset(preset: dict, seed: int) -> nn.Module:
    config_cls = ARCHITECTURES[preset["model_type"]][0]
    torch.manual_seed(seed)
    model = build_model(config_cls.from_hf(preset))
    init_weights(model, std=preset.get("initializer_range", 0.02))
    return model


@torch.no_grad()
def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """As transformers does: normal(0, std) for linear, embedding, expert and router weights;
    norms 1, biases and the routers' e_score_correction_bias 0."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, LocalExperts):
            module.w13.normal_(0.0, std)
            module.w2.normal_(0.0, std)
        elif isinstance(module, TopkRouter):
            module.weight.normal_(0.0, std)
            module.e_score_correction_bias.zero_()


class RouterLoadBalancer:
    """Auxiliary-loss-free balancing (DeepSeek-V3): forward hooks record every router's top-k ids;
    `update()` then moves each bias by γ·sign(mean load − expert load)."""

    def __init__(self, model: nn.Module, gamma: float) -> None:
        self.gamma = gamma
        self.routers = [m for m in model.modules() if isinstance(m, TopkRouter)]
        self.counts: dict[int, torch.Tensor] = {}
        self.handles = [r.register_forward_hook(self.record) for r in self.routers]

    def record(self, router: nn.Module, inputs, output: tuple[torch.Tensor, torch.Tensor]) -> None:
        if not router.training:
            return
        topk_ids = output[0]  # [T, A]
        counts = torch.bincount(topk_ids.flatten(), minlength=router.e_score_correction_bias.numel())
        self.counts[id(router)] = self.counts.get(id(router), 0) + counts

    @torch.no_grad()
    def update(self) -> float:
        """Apply one bias step per router; returns the worst max/mean load ratio of this step."""
        worst = 0.0
        for router in self.routers:
            load = self.counts.get(id(router))
            if load is None:
                continue
            load = load.float()  # [E]
            router.e_score_correction_bias += self.gamma * torch.sign(load.mean() - load)
            worst = max(worst, float(load.max() / load.mean()))
        self.counts.clear()
        return worst


# ---------------------------------------------------------------- losses


@dataclass
class StepLosses:
    total: torch.Tensor
    parts: dict[str, float] = field(default_factory=dict)


def dense_context(batch: int) -> ForwardContext:
    return ForwardContext(DenseCausalAttention(batch), None)


def compute_losses(model: nn.Module, rows: torch.Tensor, mtp_weight: float, teacher: nn.Module | None = None,
                   distill_weight: float = 0.0, ce_weight: float = 1.0) -> StepLosses:
    """rows [B, L+1] -> ce_weight·CE of next tokens (+ λ·MTP CE of next-next tokens, + distillation KL)."""
    B, L = rows.shape[0], rows.shape[1] - 1
    inputs, targets = rows[:, :-1].reshape(-1), rows[:, 1:].reshape(-1)  # [T], [T]
    positions = torch.arange(L).repeat(B)  # [T]
    hidden = model(inputs, positions, dense_context(B))  # [T, M]
    logits = model.compute_logits(hidden).float()  # [T, V]
    ce = F.cross_entropy(logits, targets)
    total, parts = ce_weight * ce, {"ce": ce.item()}
    if mtp_weight > 0 and getattr(model, "num_mtp_layers", 0) > 0:
        mtp_ce = compute_mtp_loss(model, rows, hidden.view(B, L, -1))
        total = total + mtp_weight * mtp_ce
        parts["mtp_ce"] = mtp_ce.item()
    if teacher is not None and distill_weight > 0:
        kl = compute_distill_loss(teacher, inputs, positions, B, logits)
        total = total + distill_weight * kl
        parts["kl"] = kl.item()
    return StepLosses(total, parts)


def compute_mtp_loss(model: nn.Module, rows: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """MTP at position i (0..L-2): input (embedding of token i+1, hidden [B, L, M] at i), target token i+2."""
    B, L, M = hidden.shape
    next_ids = rows[:, 1:L].reshape(-1)  # [B*(L-1)]
    positions = torch.arange(L - 1).repeat(B)
    mtp_hidden = model.forward_mtp(0, next_ids, hidden[:, :-1].reshape(-1, M), positions, dense_context(B))
    mtp_logits = model.compute_mtp_logits(0, mtp_hidden).float()  # [B*(L-1), V]
    return F.cross_entropy(mtp_logits, rows[:, 2:].reshape(-1))


def compute_distill_loss(teacher: nn.Module, inputs: torch.Tensor, positions: torch.Tensor, batch: int,
                         logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher ‖ student) per token, averaged; the teacher runs frozen in inference mode."""
    with torch.inference_mode():
        teacher_logits = teacher.compute_logits(teacher(inputs, positions, dense_context(batch)))  # [T, V]
        teacher_logp = F.log_softmax(teacher_logits.float(), dim=-1)
    teacher_logp = teacher_logp.clone()  # leave inference mode: usable in autograd as a constant
    return F.kl_div(F.log_softmax(logits, -1), teacher_logp, log_target=True, reduction="batchmean")


@torch.no_grad()
def evaluate_windows(model: nn.Module, windows: torch.Tensor, batch_size: int, autocast,
                     teacher: nn.Module | None = None) -> dict:
    """Held-out windows [N, L+1] through the training forward -> mean CE, next-token accuracy and,
    with a teacher, top-1 agreement with the teacher's next token (what a draft is for)."""
    model.eval()
    loss, correct, agree, count = 0.0, 0, 0, 0
    for start in range(0, len(windows), batch_size):
        rows = windows[start:start + batch_size]
        B, L = rows.shape[0], rows.shape[1] - 1
        inputs, positions, targets = rows[:, :-1].reshape(-1), torch.arange(L).repeat(B), rows[:, 1:].reshape(-1)
        with autocast():
            logits = model.compute_logits(model(inputs, positions, dense_context(B))).float()  # [T, V]
            if teacher is not None:
                teacher_logits = teacher.compute_logits(teacher(inputs, positions, dense_context(B)))  # [T, V]
                agree += int((logits.argmax(-1) == teacher_logits.argmax(-1)).sum())
        loss += F.cross_entropy(logits, targets, reduction="sum").item()
        correct += int((logits.argmax(-1) == targets).sum())
        count += targets.numel()
    model.train()
    result = {"heldout_loss": loss / count, "heldout_accuracy": correct / count}
    if teacher is not None:
        result["teacher_agreement"] = agree / count
    return result


# ---------------------------------------------------------------- optimization


def build_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (incl. embeddings), none on norms and biases."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def lr_factor(step: int, progress: float, warmup_steps: int, min_ratio: float) -> float:
    """Linear warmup over `warmup_steps`, then cosine from 1 to `min_ratio` as progress goes 0 -> 1."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return min_ratio + (1 - min_ratio) * cosine


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def autocast_for(precision: str):
    if precision == "bf16":
        return lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    return nullcontext


# ---------------------------------------------------------------- loop


@dataclass
class TrainState:
    step: int = 0
    elapsed: float = 0.0  # training seconds so far, over all resumed runs
    tokens: int = 0
    history: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse combinations that cannot train, before loading anything."""
    if args.ce_weight < 0 or args.distill_weight < 0:
        raise ValueError("--ce-weight and --distill-weight must be >= 0")
    if args.ce_weight == 0 and not (args.teacher and args.distill_weight > 0):
        raise ValueError("--ce-weight 0 leaves nothing to train without --teacher and --distill-weight > 0")
    if args.resume and args.init_from:
        raise ValueError("--resume and --init-from exclude each other: --resume continues OUT's own run")


class Trainer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        check_arguments(args)
        self.out = Path(args.out)
        self.preset = load_preset(args.preset)
        seed_everything(args.seed)
        self.model = build_from_preset(self.preset, args.seed).train()
        self.optimizer = build_optimizer(self.model, args.lr, args.weight_decay)
        self.balancer = RouterLoadBalancer(self.model, args.bias_update)
        self.teacher = load_model(args.teacher, show_progress=False) if args.teacher else None
        train, heldout = load_streams(CorpusSpec(max_bytes=args.max_bytes), args.tokenizer)
        self.sampler = WindowSampler(train, args.seq_len + 1, args.batch_size, seed=args.seed)
        self.heldout = heldout_windows(heldout, args.seq_len + 1, args.eval_windows)
        self.autocast = autocast_for(args.precision)
        self.state = TrainState()
        if args.resume:
            self.restore()
        elif args.init_from:
            self.initialize_from(args.init_from)

    @property
    def budget_s(self) -> float:
        return self.args.minutes * 60 if self.args.minutes else math.inf

    def progress(self) -> float:
        return max(self.state.step / self.args.max_steps, self.state.elapsed / self.budget_s)

    def restore(self) -> None:
        saved = load_training_state(self.out)
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.state = TrainState(**saved["train_state"])
        torch.set_rng_state(saved["torch_rng"])
        log.info("resumed %s at step %d (%.1f min trained)", self.out, self.state.step, self.state.elapsed / 60)

    def initialize_from(self, model_dir: Path) -> None:
        """Warm start: copy every weight of an HF model dir built from the same preset."""
        try:
            self.model.load_state_dict(load_model(model_dir, show_progress=False).state_dict())
        except RuntimeError as error:  # torch lists the missing, unexpected and mis-shaped tensors
            raise ValueError(f"--init-from {model_dir} does not match preset {self.args.preset!r}: {error}") from None
        log.info("initialized %s from %s", self.out, model_dir)

    def train_step(self) -> dict:
        rows = self.sampler.batch(self.state.step)  # [B, L+1]
        factor = lr_factor(self.state.step, self.progress(), self.args.warmup_steps, self.args.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = self.args.lr * factor
        with self.autocast():
            losses = compute_losses(self.model, rows, self.args.mtp_weight, self.teacher, self.args.distill_weight,
                                    self.args.ce_weight)
        self.optimizer.zero_grad(set_to_none=True)
        losses.total.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.grad_clip)
        self.optimizer.step()
        max_load = self.balancer.update()
        record = {"step": self.state.step, "loss": losses.total.item(), **losses.parts,
                  "lr": self.args.lr * factor, "grad_norm": float(norm)}
        if self.balancer.routers:
            record["max_load_ratio"] = max_load
        return record

    def run(self) -> TrainState:
        args = self.args
        bar = tqdm(total=None if args.minutes else args.max_steps, initial=self.state.step,
                   desc=f"train {self.out.name}", unit="step", dynamic_ncols=True)
        last_save = time.perf_counter()
        stop = min(args.max_steps, args.stop_at_step or args.max_steps)
        while self.state.step < stop and self.state.elapsed < self.budget_s:
            record = self.timed_step()
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{self.recent_speed():.0f}")
            if self.state.step % args.eval_every == 0:
                self.evaluate()
            if time.perf_counter() - last_save > args.save_minutes * 60:
                self.save()
                last_save = time.perf_counter()
        bar.close()
        self.evaluate()
        self.save()
        return self.state

    def timed_step(self) -> dict:
        """One optimizer step, counted into step, tokens, clock and history."""
        start = time.perf_counter()
        record = self.train_step()
        took = time.perf_counter() - start
        s, tokens = self.state, self.args.batch_size * self.args.seq_len
        s.step, s.tokens, s.elapsed = s.step + 1, s.tokens + tokens, s.elapsed + took
        record.update(tokens=s.tokens, elapsed=round(s.elapsed, 2), step_s=round(took, 4),
                      tokens_per_s=round(tokens / took, 1))
        s.history.append(record)
        return record

    def recent_speed(self, window: int = 20) -> float:
        """Tokens per second over the last `window` steps."""
        recent = self.state.history[-window:]
        return len(recent) * self.args.batch_size * self.args.seq_len / sum(r["step_s"] for r in recent)

    def evaluate(self) -> None:
        metrics = evaluate_windows(self.model, self.heldout, self.args.batch_size, self.autocast, self.teacher)
        self.state.evals.append({"step": self.state.step, "tokens": self.state.tokens, **metrics})
        agreement = f", agreement with the teacher {metrics['teacher_agreement']:.1%}" if self.teacher else ""
        tqdm.write(f"step {self.state.step}: held-out loss {metrics['heldout_loss']:.3f}, "
                   f"next-token accuracy {metrics['heldout_accuracy']:.1%}{agreement}")

    def save(self) -> None:
        """HF model dir (bf16), train_log.json, loss curve and the resumable state."""
        save_hf_model(self.model, self.preset, self.out, Path(self.args.tokenizer))
        save_training_state(self.out, {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                                       "train_state": vars(self.state), "torch_rng": torch.get_rng_state()})
        (self.out / ".gitignore").write_text("training_state.pt\ntraining_state.pt.tmp\n")
        self.write_log()
        plot_losses(self.state.history, self.state.evals, self.out / "loss_curve.png", title=self.out.name)

    def write_log(self) -> None:
        s = self.state
        n_params = sum(p.numel() for p in self.model.parameters())
        summary = {"date": time.strftime("%Y-%m-%d"), "preset": self.args.preset, "parameters": n_params,
                   "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(self.args).items()
                            if not callable(v)},  # the CLI stores its handler in args
                   "steps": s.step, "tokens": s.tokens, "train_minutes": round(s.elapsed / 60, 2),
                   "tokens_per_s": round(s.tokens / max(s.elapsed, 1e-9), 1),
                   "torch_threads": torch.get_num_threads(), "final_eval": s.evals[-1] if s.evals else None,
                   "evals": s.evals, "history": s.history}
        (self.out / "train_log.json").write_text(json.dumps(summary, indent=1) + "\n")


# ---------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", required=True,
                        help="tiny-deepseek-v3 | tiny-llama | tiny-llama-draft, or an HF config.json path")
    parser.add_argument("--out", required=True, type=Path, help="model directory to write")
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--max-bytes", type=int, default=None, help="cap each corpus split (quick runs)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--minutes", type=float, default=None, help="training time budget; ends cleanly and saves")
    parser.add_argument("--stop-at-step", type=int, default=None,
                        help="end this run (and save) at this step without changing the schedule; --resume continues")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                        help="bf16 autocast (faster on this CPU) or plain float32")
    parser.add_argument("--mtp-weight", type=float, default=0.3, help="λ of the MTP loss (DeepSeek)")
    parser.add_argument("--bias-update", type=float, default=1e-3, help="γ of the router bias update (DeepSeek)")
    parser.add_argument("--teacher", type=Path, default=None, help="target model dir to distill from")
    parser.add_argument("--distill-weight", type=float, default=1.0, help="weight of KL(teacher ‖ model)")
    parser.add_argument("--ce-weight", type=float, default=1.0,
                        help="weight of the next-token CE on the corpus (0 with --teacher: distillation alone)")
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--eval-windows", type=int, default=32)
    parser.add_argument("--save-minutes", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--resume", action="store_true", help="continue from OUT/training_state.pt")
    parser.add_argument("--init-from", type=Path, default=None,
                        help="start from this model dir's weights (same preset), fresh optimizer and schedule")


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    state = Trainer(args).run()
    log.info("trained %d steps, %d tokens in %.1f min (%.0f tokens/s); saved %s", state.step, state.tokens,
             state.elapsed / 60, state.tokens / max(state.elapsed, 1e-9), args.out)


def main(argv: list[str] | None = None) -> None:
    from moespec.arguments import run_standalone

    run_standalone("moespec train-model", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    main()
