"""Decode throughput of the engine (no speculation) against transformers' `generate` on the
same checkpoint, side by side in one run, greedy, float32 (--dtype); with --compile, also the engine
with static steps compiled (model.compile), compiled before measuring (compile_s); with
--overlap, also each of them with overlap scheduling (scheduler.overlap); with --unpacked, also
each of them with model.pack_linears off (linears through F.linear, MKL, instead of oneDNN over
packed weights).

  .venv/bin/python benchmarks/bench_engine.py --model checkpoints/tiny-deepseek-v3 \
      --batch-sizes 1 16 --prompt-len 32 --max-tokens 64 [--compile] [--overlap] [--unpacked] [--profile] [--out docs/bench-engine.json]

Every side generates `max-tokens` tokens for the same prompts, after the same warm-up; the sides
take turns in each repeat and each reports the median, its speedup the median of the per-repeat
ratios. Tokens/s counts generated tokens over wall time of the whole call (prefill included, as
a user sees it). The engine's decode-step host share (scheduling, batch packing, attention
planning, sampling tensors, postprocess) comes from its per-phase timers; decode_hidden_share
is the share of host + device time that overlap hid (host work done while the device ran).

linears_ms_per_step is one pass over the linears a decode step runs, at the batch's rows, each
as the engine runs it (packed or not), timed alone. Every decode step runs each of them once, so
speedup_ceiling (transformers' time over max-tokens such passes) bounds every engine's speedup
over transformers from above, with prefill and everything but the linears taken as free (a MoE
model's routed experts are not linears: leaving them out only loosens the bound).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from moespec import LLM, SamplingParams
from moespec.config import resolve_path
from moespec.machine import run_info
from moespec.models.gguf import find_gguf


def load_hf(path: str, dtype: torch.dtype):
    """transformers' model of an HF directory, or of a GGUF file (dequantized by transformers)."""
    gguf = find_gguf(resolve_path(path, None))  # pkg://PACKAGE/FILE as in configs
    if gguf is None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype).eval()


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
    busy = max(delta["decode_host_s"] + delta["decode_device_s"], 1e-9)
    # with overlap the host works while the device runs: the step's wall time is less than both
    hidden = (busy - delta["decode_wall_s"]) / busy
    return elapsed, {"decode_steps": delta["decode_steps"], "decode_host_share": round(delta["decode_host_s"] / busy, 3),
                     "decode_hidden_share": round(hidden, 3),
                     "decode_step_ms": round(1e3 * delta["decode_wall_s"] / max(delta["decode_steps"], 1), 3)}


def decode_linears(llm: LLM, prompts: list[list[int]]) -> list[torch.nn.Linear]:
    """The linears of the engine's model that a decode step of `prompts` runs (a forward hook sees
    them take one row per request), in the order it runs them."""
    seen: dict[int, torch.nn.Linear] = {}

    def record(module, args) -> None:
        if args[0].shape[0] == len(prompts):
            seen.setdefault(id(module), module)

    handles = [m.register_forward_pre_hook(record) for m in llm.engine.model.modules()
               if isinstance(m, torch.nn.Linear)]
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    finally:
        for handle in handles:
            handle.remove()
    return list(seen.values())


def time_linears(linears: list[torch.nn.Linear], rows: int, repeats: int = 7, passes: int = 20) -> float:
    """Seconds of one pass over `linears` at `rows` rows, each run as the engine runs it (packed or
    not), weights in turn as a forward reads them: the median of `repeats`."""
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=m.weight.dtype) for m in linears}
    with torch.inference_mode():
        def run_pass() -> None:
            for m in linears:
                m(inputs[m.in_features])
        for _ in range(3):
            run_pass()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(passes):
                run_pass()
            times.append((time.perf_counter() - start) / passes)
    return statistics.median(times)


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
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats; the median per side")
    parser.add_argument("--compile", action="store_true",
                        help="also the engine with model.compile (static steps through torch.compile)")
    parser.add_argument("--overlap", action="store_true",
                        help="also every engine with scheduler.overlap (the host prepares the next step meanwhile)")
    parser.add_argument("--unpacked", action="store_true",
                        help="also every engine with model.pack_linears off (F.linear through MKL)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="every side's dtype")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the engine at the last batch size")
    parser.add_argument("--out", default=None, help="write results as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    hf = load_hf(args.model, getattr(torch, args.dtype))
    options = dict(model=args.model, dtype=args.dtype, page_size=16, num_kv_pages=512, max_num_seqs=max(args.batch_sizes))
    variants = {"eager": {}}
    if args.compile:  # static steps at exactly the measured batch sizes, compiled before measuring
        variants["compiled"] = {"compile": True, "compile_batch_sizes": args.batch_sizes}
    if args.overlap:
        variants.update({f"{name}+overlap" if name != "eager" else "overlap": {**opts, "overlap": True}
                         for name, opts in list(variants.items())})
    if args.unpacked:
        variants.update({f"{name}-unpacked": {**opts, "pack_linears": False} for name, opts in list(variants.items())})
    engines = {name: LLM(**options, **opts) for name, opts in variants.items()}
    compile_s = {name: round(llm.engine.warm_up(), 1) for name, llm in engines.items()}
    print(json.dumps({"compile_s": compile_s}), flush=True)
    vocab = engines["eager"].engine.vocab_size
    results = []
    for batch in args.batch_sizes:
        prompts = make_prompts(batch, args.prompt_len, vocab)
        time_hf(hf, prompts, 4)  # the same warm-up for every side
        for llm in engines.values():
            time_engine(llm, prompts, 4)
        seconds = {name: [] for name in ("hf", *engines)}
        info = {}
        for _ in range(args.repeats):  # interleaved: a slow phase of the machine hits every side
            seconds["hf"].append(time_hf(hf, prompts, args.max_tokens))
            for name, llm in engines.items():
                elapsed, info[name] = time_engine(llm, prompts, args.max_tokens)
                seconds[name].append(elapsed)
        tokens = batch * args.max_tokens
        row = {"batch": batch, "hf_tok_s": round(tokens / statistics.median(seconds["hf"]), 1)}
        # what no engine of these weights can beat: every decode step runs every linear once
        linears_s = time_linears(decode_linears(engines["eager"], prompts), batch)
        row["linears_ms_per_step"] = round(1e3 * linears_s, 3)
        row["speedup_ceiling"] = round(statistics.median(seconds["hf"]) / (args.max_tokens * linears_s), 2)
        for name in engines:
            row[f"{name}_tok_s"] = round(tokens / statistics.median(seconds[name]), 1)
            row[f"{name}_speedup"] = round(statistics.median(h / o for h, o in zip(seconds["hf"], seconds[name])), 2)
            row[f"{name}_decode"] = info[name]
            if name != "eager":
                row[f"{name}_over_eager"] = round(statistics.median(
                    e / c for e, c in zip(seconds["eager"], seconds[name])), 2)
            if f"{name}-unpacked" in engines:
                row[f"{name}_over_unpacked"] = round(statistics.median(
                    u / p for u, p in zip(seconds[f"{name}-unpacked"], seconds[name])), 2)
        results.append(row)
        print(json.dumps(row), flush=True)
    llm = engines["eager"]
    if args.profile:
        print(profile_decode(llm, make_prompts(args.batch_sizes[-1], args.prompt_len, vocab), args.max_tokens))
    if args.out:
        report = {**run_info(f"{platform.machine()}, {torch.get_num_threads()} threads"),
                  "torch": torch.__version__, "model": args.model, "dtype": args.dtype, "prompt_len": args.prompt_len,
                  "max_tokens": args.max_tokens, "repeats": args.repeats, "statistic": "median of interleaved repeats",
                  "compile_s": compile_s, "results": results}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
