"""Evaluation through the inference code: the target runs through `ModelRunner` over the paged
KV cache (`TorchPagedAttention`), the head (or DeepSeek's built-in MTP layer) through
`forward_mtp` over its own paged cache, all on models as `load_model` / `load_mtp_head` build them.

Command: `moespec eval-head --target DIR [--head DIR | --builtin-mtp | --draft DIR] [--windows N]
[--engine-prompts N] [--json]`.

Metrics on held-out windows: the target's mean next-token loss and accuracy, and the head's top-1
agreement with the target's greedy next-next token (head at position i, fed the text's token
i+1 and the target's hidden at i, against argmax of the target's logits at i+1). A draft model's
agreement is its argmax at position i against the target's argmax at i (both read the text up
to i).

Shapes legend: N windows, W window length, T = N*W tokens, M hidden, V vocab.
"""
from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from moespec.attention import ForwardContext, TorchPagedAttention
from moespec.batch import Batch
from moespec.kv_cache import KVCache
from moespec.model_runner import ModelRunner
from moespec.models import load_model
from moespec.models.mtp_head import load_mtp_head
from moespec.training.corpus import CorpusSpec
from moespec.training.data import DEFAULT_TOKENIZER, heldout_windows, load_streams

log = logging.getLogger(__name__)

PAGE_SIZE = 16


@dataclass
class EvalResult:
    tokens: int
    target_loss: float
    target_accuracy: float
    head_agreement: float | None = None
    head_tokens: int = 0
    draft_agreement: float | None = None  # a separate draft model's top-1 agreement with the target
    transformers_max_diff: float | None = None  # max |logit difference| vs transformers, when checked
    engine_accept_length: float | None = None  # measured by the engine speculating greedily
    engine_acceptance_by_position: list[float] | None = None


def prefill_batch(windows: torch.Tensor, page_size: int = PAGE_SIZE) -> Batch:
    """One prefill request per window [N, W]; request n owns pages n*P..(n+1)*P-1; every row sampled."""
    N, W = windows.shape
    pages = -(-W // page_size)
    arange = lambda n: torch.arange(n, dtype=torch.int64)  # noqa: E731
    return Batch(mode="prefill", input_ids=windows.reshape(-1), positions=arange(W).repeat(N),
                 qo_indptr=arange(N + 1) * W, kv_indptr=arange(N + 1) * pages, kv_indices=arange(N * pages),
                 kv_last_page_len=torch.full((N,), W - (pages - 1) * page_size, dtype=torch.int64),
                 sample_indices=arange(N * W), page_size=page_size)


def num_pages_for(batch_size: int, window: int, page_size: int = PAGE_SIZE) -> int:
    return batch_size * -(-window // page_size)


@torch.inference_mode()
def target_forward(runner: ModelRunner, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged prefill of windows [N, W] -> (final hidden [N, W, M], logits [N, W, V] float32)."""
    N, W = windows.shape
    batch = prefill_batch(windows)
    hidden, logits = runner.forward(batch, runner.plan(batch))
    return hidden.view(N, W, -1), logits.view(N, W, -1)


@torch.inference_mode()
def mtp_forward(drafter: nn.Module, windows: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Head logits [N, W-1, V] at positions 0..W-2, fed (token i+1, target hidden at i), over the
    drafter's own paged cache."""
    N, W = windows.shape
    dtype = hidden.dtype
    cache = KVCache(drafter.kv_cache_spec(), num_pages_for(N, W - 1), PAGE_SIZE, dtype)
    batch = prefill_batch(windows[:, 1:])
    backend = TorchPagedAttention()
    backend.plan(batch.attention_metadata())
    ctx = ForwardContext(backend, cache.layers)
    mtp_hidden = drafter.forward_mtp(0, batch.input_ids, hidden[:, :-1].reshape(N * (W - 1), -1),
                                     batch.positions, ctx)
    return drafter.compute_mtp_logits(0, mtp_hidden).float().view(N, W - 1, -1)


def evaluate(target: nn.Module, windows: torch.Tensor, drafter: nn.Module | None = None,
             batch_size: int = 4, draft: nn.Module | None = None) -> EvalResult:
    """Held-out windows [N, W]: target loss/accuracy and, with a drafter (MTP head or layer) or a
    draft model, its top-1 agreement with the target's greedy tokens."""
    runner = ModelRunner(target, num_pages_for(batch_size, windows.shape[1]), PAGE_SIZE)
    draft_runner = (ModelRunner(draft, num_pages_for(batch_size, windows.shape[1]), PAGE_SIZE)
                    if draft is not None else None)
    loss_sum, correct, agree, head_count, draft_agree = 0.0, 0, 0, 0, 0
    for start in range(0, len(windows), batch_size):
        rows = windows[start:start + batch_size]  # [n, W]
        hidden, logits = target_forward(runner, rows)
        targets = rows[:, 1:]
        loss_sum += F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                    reduction="sum").item()
        correct += int((logits[:, :-1].argmax(-1) == targets).sum())
        if drafter is not None:
            head_logits = mtp_forward(drafter, rows, hidden)  # [n, W-1, V]
            agree += int((head_logits.argmax(-1) == logits[:, 1:].argmax(-1)).sum())
            head_count += head_logits.shape[0] * head_logits.shape[1]
        if draft_runner is not None:
            _, draft_logits = target_forward(draft_runner, rows)  # [n, W, V]
            draft_agree += int((draft_logits[:, :-1].argmax(-1) == logits[:, :-1].argmax(-1)).sum())
    tokens = windows.shape[0] * (windows.shape[1] - 1)
    return EvalResult(tokens, loss_sum / tokens, correct / tokens,
                      agree / head_count if drafter is not None else None, head_count,
                      draft_agreement=draft_agree / tokens if draft is not None else None)


@torch.inference_mode()
def compare_with_transformers(model_dir: Path, window: torch.Tensor) -> float:
    """Max |logit difference| between our loader and transformers' AutoModelForCausalLM on one
    window [W] (both in float32 from the same bfloat16 checkpoint)."""
    from transformers import AutoModelForCausalLM

    ours = load_model(model_dir, show_progress=False)
    runner = ModelRunner(ours, num_pages_for(1, window.numel()), PAGE_SIZE)
    _, logits = target_forward(runner, window[None])
    theirs = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return float((logits[0] - theirs(window[None]).logits[0].float()).abs().max())


def load_heldout(windows: int, window_len: int, tokenizer: Path = DEFAULT_TOKENIZER,
                 max_bytes: int | None = None, data: Path | None = None) -> torch.Tensor:
    """Held-out windows [N, W] of the project corpus, or of `moespec distill`'s data in `data`."""
    if data is not None:
        return heldout_windows(np.load(Path(data) / "heldout.npy"), window_len, windows)
    _, heldout = load_streams(CorpusSpec(max_bytes=max_bytes), tokenizer)
    return heldout_windows(heldout, window_len, windows)


def load_drafter(target: nn.Module, head: Path | None, builtin_mtp: bool) -> nn.Module | None:
    if head is not None:
        return load_mtp_head(target, head)
    if builtin_mtp:
        if getattr(target, "num_mtp_layers", 0) < 1:
            raise ValueError("--builtin-mtp: the target has no MTP layer; pass --head DIR instead")
        return target
    return None


# ---------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, type=Path, help="target model directory")
    parser.add_argument("--head", type=Path, default=None, help="MTP head directory (model_type mtp_head)")
    parser.add_argument("--builtin-mtp", action="store_true", help="evaluate the target's own MTP layer")
    parser.add_argument("--draft", type=Path, default=None, help="draft model directory (draft-target speculation)")
    parser.add_argument("--windows", type=int, default=48, help="held-out windows to evaluate")
    parser.add_argument("--window-len", type=int, default=512)
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--max-bytes", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--check-transformers", action="store_true",
                        help="also compare our logits with transformers' on the first held-out window")
    parser.add_argument("--engine-prompts", type=int, default=0,
                        help="also speculate with the engine on this many held-out prompts and report acceptance")
    parser.add_argument("--num-speculative-tokens", type=int, default=1, help="k for --engine-prompts")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    target = load_model(args.target, show_progress=False)
    drafter = load_drafter(target, args.head, args.builtin_mtp)
    draft = load_model(args.draft, show_progress=False) if args.draft is not None else None
    windows = load_heldout(args.windows, args.window_len, args.tokenizer, args.max_bytes)
    result = evaluate(target, windows, drafter, draft=draft)
    if args.check_transformers:
        result.transformers_max_diff = compare_with_transformers(args.target, windows[0])
    if args.engine_prompts and (drafter is not None or draft is not None):
        measure_engine_acceptance(result, args, windows[: args.engine_prompts, :64].tolist())
    if args.json:
        print(json.dumps(asdict(result)))
    else:
        print(describe(result))


def measure_engine_acceptance(result: EvalResult, args: argparse.Namespace, prompts: list[list[int]]) -> None:
    """Greedy generation with MTP (or draft-model) speculation through the engine: accept length
    and per-position acceptance as the serving path sees them."""
    from moespec.llm import LLM
    from moespec.sampling import SamplingParams

    mode = "draft" if args.draft is not None else "mtp"
    speculation = {"mode": mode, "num_speculative_tokens": args.num_speculative_tokens, "adaptive": False}
    if args.head is not None:
        speculation["mtp_head"] = str(args.head)
    if args.draft is not None:
        speculation["draft_model"] = str(args.draft)
    llm = LLM(model=str(args.target), speculation=speculation, page_size=PAGE_SIZE, num_kv_pages=4096)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.spec_stats
    result.engine_accept_length = stats.accept_length
    result.engine_acceptance_by_position = stats.acceptance_by_position()


def describe(result: EvalResult) -> str:
    text = (f"{result.tokens} held-out tokens: target loss {result.target_loss:.3f}, "
            f"next-token accuracy {result.target_accuracy:.1%}")
    if result.head_agreement is not None:
        text += f"; head top-1 agreement {result.head_agreement:.1%} over {result.head_tokens} positions"
    if result.draft_agreement is not None:
        text += f"; draft top-1 agreement {result.draft_agreement:.1%}"
    if result.transformers_max_diff is not None:
        text += f"; transformers reload max |logit diff| {result.transformers_max_diff:.2e}"
    if result.engine_accept_length is not None:
        by_position = ", ".join(f"{a:.1%}" for a in result.engine_acceptance_by_position)
        text += f"; engine accept length {result.engine_accept_length:.2f} (acceptance by position: {by_position})"
    return text


def main(argv: list[str] | None = None) -> None:
    from moespec.arguments import run_standalone

    run_standalone("moespec eval-head", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    main()
