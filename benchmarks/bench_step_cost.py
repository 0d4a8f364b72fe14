"""What one step of each model costs at batch 1, measured side by side in one process.

  .venv/bin/python benchmarks/bench_step_cost.py --target checkpoints/tiny-llama \
      --draft checkpoints/tiny-llama-draft --head checkpoints/tiny-llama-mtp-head [--threads 2]
  .venv/bin/python benchmarks/bench_step_cost.py --target checkpoints/tiny-deepseek-v3 --builtin-mtp

Reported (median over rounds, models interleaved within each round):
- `engine_decode_ms`: a whole engine decode step without speculation (scheduling, planning,
  forward, sampling, postprocess): generate N tokens at batch 1, wall time / N. This is the
  "decode step" of a model as a user of the engine sees it; the draft/target ratio of it is
  what the draft must keep small.
- `forward_ms[q]`: the target's ModelRunner plan + forward + logits over q query tokens of one
  request at a context of `--context` tokens: q = 1 is plain decode, q = 1 + k is verification.
- `mtp_ms[q]`: the MTP layer (built-in or head) over q tokens with the target's plan, as in the
  verify re-run, plus its logits at one row; run back to back, so its weights stay in cache.
- `mtp_after_verify_ms[q]`: the same, each call right after the target's forward over those q
  tokens, as in the engine's speculative step (the target's forward evicts the MTP weights).
- `mixed_ms`: the target over a mixed batch, `--mixed D,C`: D decode requests at the context
  plus one new request's C-token prefill chunk, as when a request joins a full batch;
  `decodes_ms` and `chunk_ms` are the two parts alone.

Shapes legend: q query tokens of one request.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from moespec import LLM, SamplingParams
from moespec.attention import ForwardContext
from moespec.batch import Span, pack_spans
from moespec.kv_cache import KVCache
from moespec.machine import run_info
from moespec.model_runner import ModelRunner
from moespec.models import load_model
from moespec.models.mtp_head import load_mtp_head

PAGE = 16


def time_engine_decode(llm: LLM, tokens: int) -> float:
    """ms per generated token at batch 1 (prefill of a 32-token prompt included, amortized)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([list(range(10, 42))], params, use_tqdm=False)
    return 1e3 * (time.perf_counter() - start) / tokens


def make_span(context: int, q: int) -> Span:
    """One request whose last q tokens (of context + q) are this step's queries."""
    pages = list(range(-(-(context + q) // PAGE)))
    return Span(pages, context, [(7 * i) % 1000 + 10 for i in range(q)])


def prefill_cache(runner: ModelRunner, context: int) -> None:
    span = Span(list(range(-(-context // PAGE) + 1)), 0, [(3 * i) % 1000 + 10 for i in range(context)])
    batch = pack_spans([span], PAGE, "prefill", sampled=[True])
    runner.forward(batch, runner.plan(batch))


def time_call(fn, repeats: int) -> float:
    """ms per call of `fn` (after one untimed call); a (setup, fn) pair runs setup once first."""
    if isinstance(fn, tuple):
        setup, fn = fn
        setup()
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1e3 * (time.perf_counter() - start) / repeats


def target_forward(runner: ModelRunner, context: int, q: int):
    batch = pack_spans([make_span(context, q)], PAGE, "verify" if q > 1 else "decode")
    return lambda: runner.forward(batch, runner.plan(batch))


def mixed_forwards(runner: ModelRunner, context: int, decodes: int, chunk: int) -> dict:
    """Timers for D decode requests + one C-token prefill chunk in one batch, and each part alone.
    The decode requests read the same cached context (only the timing matters here)."""
    decode_spans = [make_span(context, 1)] * decodes
    first_page = -(-(context + 1) // PAGE)
    chunk_pages = list(range(first_page, first_page + -(-chunk // PAGE)))
    chunk_span = Span(chunk_pages, 0, [(5 * i) % 1000 + 10 for i in range(chunk)])

    def timer(spans, sampled):
        batch = pack_spans(spans, PAGE, "mixed", sampled=sampled)
        return lambda: runner.forward(batch, runner.plan(batch))
    return {"mixed_ms": timer(decode_spans + [chunk_span], [True] * (decodes + 1)),
            "decodes_ms": timer(decode_spans, [True] * decodes), "chunk_ms": timer([chunk_span], [True])}


def mtp_forward(runner: ModelRunner, mtp, mtp_caches, context: int, q: int):
    """(plan, run): the plan is the target's, made once, as in the verify re-run, where the MTP
    layer reuses the plan of the target's forward over the same batch."""
    batch = pack_spans([make_span(context, q)], PAGE, "verify")
    hidden = torch.zeros(q, runner.model.config.hidden_size, dtype=runner.dtype)

    def plan():
        runner.backend.plan(batch.attention_metadata())

    @torch.inference_mode()
    def run():
        ctx = ForwardContext(runner.backend, mtp_caches)
        out = mtp.forward_mtp(0, batch.input_ids, hidden, batch.positions, ctx)
        return mtp.compute_mtp_logits(0, out[-1:])
    return plan, run


def time_after(first, second, repeats: int) -> float:
    """ms per call of `second` when each call follows one of `first` (not timed)."""
    first()
    second()
    total = 0.0
    for _ in range(repeats):
        first()
        start = time.perf_counter()
        second()
        total += time.perf_counter() - start
    return 1e3 * total / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--head", default=None, help="external MTP head dir")
    parser.add_argument("--builtin-mtp", action="store_true", help="time the target's own MTP layer")
    parser.add_argument("--context", type=int, default=96)
    parser.add_argument("--queries", default="1,2,3,5")
    parser.add_argument("--mixed", default="31,64", help="D,C: D decode requests + a C-token prefill chunk")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per engine timing")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    engines = {"target": LLM(model=args.target, dtype="float32")}
    if args.draft:
        engines["draft"] = LLM(model=args.draft, dtype="float32")
    model = load_model(args.target, "float32", show_progress=False)
    decodes, chunk = (int(x) for x in args.mixed.split(","))
    runner = ModelRunner(model, 2 * -(-(args.context + 8 + chunk) // PAGE), PAGE)
    prefill_cache(runner, args.context + 8)
    queries = [int(q) for q in args.queries.split(",")]
    verify_q = queries[1]  # the verify batch of k = 1 with the default --queries
    timers = {f"forward_ms[{q}]": target_forward(runner, args.context, q) for q in queries}
    timers.update(mixed_forwards(runner, args.context, decodes, chunk))
    if args.head or args.builtin_mtp:
        if args.head:
            mtp = load_mtp_head(model, args.head)
            caches = KVCache(mtp.kv_cache_spec(), 64, PAGE, runner.dtype, runner.device).layers
        else:
            mtp, caches = model, runner.cache.layers
        timers.update({f"mtp_ms[{q}]": mtp_forward(runner, mtp, caches, args.context, q) for q in queries[:2]})
        # the engine's order: the target verifies q tokens (and plans), then the MTP layer re-runs
        after_verify = (target_forward(runner, args.context, verify_q),
                        mtp_forward(runner, mtp, caches, args.context, verify_q)[1])

    samples: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            samples.setdefault(f"{name}_engine_decode_ms", []).append(time_engine_decode(llm, args.tokens))
        for name, fn in timers.items():
            samples.setdefault(name, []).append(time_call(fn, args.repeats))
        if args.head or args.builtin_mtp:
            samples.setdefault(f"mtp_after_verify_ms[{verify_q}]", []).append(time_after(*after_verify, args.repeats))
    result = {name: round(statistics.median(values), 3) for name, values in samples.items()}
    if "draft_engine_decode_ms" in result:
        result["draft_over_target"] = round(result["draft_engine_decode_ms"] / result["target_engine_decode_ms"], 3)
    for q in queries[1:]:
        result[f"verify_over_decode[{q}]"] = round(result[f"forward_ms[{q}]"] / result["forward_ms[1]"], 3)
    result["mixed_over_parts"] = round(result["mixed_ms"] / (result["decodes_ms"] + result["chunk_ms"]), 3)
    if "mtp_ms[1]" in result:
        result["mtp_over_decode[1]"] = round(result["mtp_ms[1]"] / result["forward_ms[1]"], 3)
        after = result[f"mtp_after_verify_ms[{verify_q}]"]
        result[f"mtp_after_verify_over_decode[{verify_q}]"] = round(after / result["forward_ms[1]"], 3)
    report = {**run_info(f"{platform.machine()}, {torch.get_num_threads()} threads"),
              "target": args.target, "draft": args.draft, "head": args.head, "builtin_mtp": args.builtin_mtp,
              "context": args.context, "mixed": args.mixed, "result": result}
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
