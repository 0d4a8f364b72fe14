"""Decode throughput of the engine (no speculation) against transformers' `generate` on the
same checkpoint, side by side in one run, greedy, float32.

  .venv/bin/python benchmarks/bench_engine.py --model checkpoints/tiny-deepseek-v3 \
      --batch-sizes 1 16 --prompt-len 32 --max-tokens 64 [--profile] [--out docs/bench-engine.json]

Both sides generate `max-tokens` tokens for the same prompts; tokens/s counts generated tokens
over wall time of the whole call (prefill included, as a user sees it). The engine's decode-step
host share (scheduling, batch packing, attention planning, sampling tensors, postprocess) comes
from its per-phase timers.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import time
from datetime import date

import torch
from transformers import AutoModelForCausalLM

from moespec import LLM, SamplingParams


def make_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=gen).tolist() for _ in range(batch)]


def time_hf(hf, prompts: list[list[int]], max_tokens: int) -> float:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                    do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def time_engine(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, dict]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    stats = llm.engine.stats
    before = dict(vars(stats))
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    delta = {k: getattr(stats, k) - before[k] for k in before}
    host = delta["decode_host_s"] / max(delta["decode_host_s"] + delta["decode_device_s"], 1e-9)
    return elapsed, {"decode_steps": delta["decode_steps"], "decode_host_share": round(host, 3),
                     "decode_step_ms": round(1e3 * (delta["decode_host_s"] + delta["decode_device_s"])
                                             / max(delta["decode_steps"], 1), 3)}


def profile_decode(llm: LLM, prompts: list[list[int]], max_tokens: int, top: int = 25) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="best of N per side")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the engine at the last batch size")
    parser.add_argument("--out", default=None, help="write results as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    llm = LLM(model=args.model, dtype="float32", page_size=16, num_kv_pages=512, max_num_seqs=64)
    vocab = llm.engine.vocab_size
    results = []
    for batch in args.batch_sizes:
        prompts = make_prompts(batch, args.prompt_len, vocab)
        time_engine(llm, prompts, 4)  # warm-up both sides
        time_hf(hf, prompts, 4)
        hf_s = min(time_hf(hf, prompts, args.max_tokens) for _ in range(args.repeats))
        runs = [time_engine(llm, prompts, args.max_tokens) for _ in range(args.repeats)]
        ours_s, info = min(runs, key=lambda r: r[0])
        tokens = batch * args.max_tokens
        row = {"batch": batch, "ours_tok_s": round(tokens / ours_s, 1), "hf_tok_s": round(tokens / hf_s, 1),
               "speedup": round(hf_s / ours_s, 2), **info}
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.profile:
        print(profile_decode(llm, make_prompts(args.batch_sizes[-1], args.prompt_len, vocab), args.max_tokens))
    if args.out:
        report = {"date": str(date.today()), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
                  "torch": torch.__version__, "model": args.model, "prompt_len": args.prompt_len,
                  "max_tokens": args.max_tokens, "results": results}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
