"""Accept length of an MTP head on the held-out prompts of `moespec distill`'s data, per draft
length k and temperature, with the acceptance at each draft position.

  python benchmarks/bench_heldout_acceptance.py --config configs/smollm2-135m-mtp.yaml \
      --data checkpoints/smollm2-135m-mtp-head/data --ks 1,2,3 --temperatures 0,0.7 \
      --out docs/bench/smollm2-heldout-acceptance.json

Each held-out prompt is rendered with the model's chat template, as the chat endpoint renders
it, and answered up to --max-tokens (or its end of turn) with speculation at k (adaptive off).
`--heads` compares several heads (name=path) on the same prompts: e.g. the RMSNorm head against
EAGLE's, trained on the same data with the same budget. `--draft-vocabs 1024,2048,4096,0`
measures each head again drafting over the N most frequent answer tokens (its layer unchanged:
the head is trained on the full vocabulary), for accept length against step cost (tok/s).
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

from moespec.machine import run_info


def read_prompts(data: Path, limit: int) -> list[dict]:
    rows = [json.loads(line) for line in (data / "heldout_prompts.jsonl").read_text().splitlines() if line]
    return rows[:limit] if limit else rows


def measure(llm, prompts: list[list[int]], temperature: float, max_tokens: int) -> dict:
    from moespec.sampling import SamplingParams

    stats = llm.engine.spec_stats
    before = (stats.steps, stats.accepted_tokens, list(stats.accepted_at), list(stats.drafted_at))
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i) for i in range(len(prompts))]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    steps, accepted = stats.steps - before[0], stats.accepted_tokens - before[1]
    at = [a - b for a, b in zip(stats.accepted_at, before[2] + [0] * len(stats.accepted_at))]
    of = [a - b for a, b in zip(stats.drafted_at, before[3] + [0] * len(stats.drafted_at))]
    return {"accept_length": (accepted + steps) / steps if steps else 0.0,
            "acceptance_by_position": [round(a / d, 4) if d else 0.0 for a, d in zip(at, of)],
            "verify_steps": steps, "tokens": (tokens := sum(len(o.outputs[0].token_ids) for o in outputs)),
            "seconds": round(seconds, 2), "tok_s": round(tokens / seconds, 1)}


def with_draft_vocab(head: str, size: int, counts: Path, out: Path) -> str:
    """A copy of `head` drafting over the `size` most frequent answer tokens (0: the whole
    vocabulary): the layer's weights are the same, only config.json and `draft_vocab` change."""
    import numpy as np
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(head) / "config.json").read_text())
    tensors = load_file(str(Path(head) / "model.safetensors"))
    tensors.pop("draft_vocab", None)
    config["draft_vocab_size"] = size
    if size:
        tensors["draft_vocab"] = torch.from_numpy(np.load(counts)).topk(size).indices.sort().values
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def expand_heads(args: argparse.Namespace, work: Path) -> dict[str, str | None]:
    """name -> head directory: --heads, each at every --draft-vocabs size when given."""
    heads = dict(item.split("=", 1) for item in args.heads.split(",")) if args.heads else {"config": None}
    if not args.draft_vocabs:
        return heads
    if not args.heads:  # the config's own head, copied at each size
        from moespec.config import load_config
        heads = {"config": load_config(args.config).speculation.mtp_head}
    return {f"{name}/N={size or 'V'}": with_draft_vocab(head, size, args.data / "answer_counts.npy",
                                                         work / f"{name}-{size}")
            for name, head in heads.items() for size in args.draft_vocabs}


def run(args: argparse.Namespace) -> dict:
    from moespec.bench import chat_prompts
    from moespec.config import load_config
    from moespec.llm import LLM

    torch.set_num_threads(args.threads)
    rows = read_prompts(args.data, args.limit)
    work = Path(tempfile.mkdtemp(prefix="heads-"))
    heads = expand_heads(args, work)
    results = []
    for name, head in heads.items():
        for k in args.ks:
            overrides = {"speculation.mode": "mtp", "speculation.num_speculative_tokens": k,
                         "speculation.adaptive": False, "scheduler.max_num_seqs": args.batch}
            if head:
                overrides["speculation.mtp_head"] = head
            llm = LLM(config=load_config(args.config, overrides))
            try:
                prompts = chat_prompts(llm.get_tokenizer(), args.data / "heldout_prompts.jsonl", len(rows))
                for temperature in args.temperatures:
                    row = {"head": name, "k": k, "temperature": temperature,
                           **measure(llm, prompts, temperature, args.max_tokens)}
                    results.append(row)
                    print(f"{name:14s} k={k} T={temperature:.1f}  accept length {row['accept_length']:.3f}  "
                          f"{row['tok_s']:7.1f} tok/s  "
                          f"by position {row['acceptance_by_position']}", flush=True)
            finally:
                llm.close()
    shutil.rmtree(work)
    return {**run_info(f"{platform.machine()}, {args.threads} threads"), "benchmark": "heldout_acceptance",
            "config": args.config, "data": str(args.data), "prompts": len(rows),
            "kinds": sorted({r["kind"] for r in rows}), "max_tokens": args.max_tokens, "batch": args.batch,
            "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--data", type=Path, required=True, help="`moespec distill` output (heldout_prompts.jsonl)")
    parser.add_argument("--heads", default="", help="name=head_dir,... (default: the config's head)")
    parser.add_argument("--draft-vocabs", type=lambda s: [int(x) for x in s.split(",")], default=[],
                        help="re-measure each head drafting over the N most frequent answer tokens (0: all)")
    parser.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3])
    parser.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.7])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=0, help="first N held-out prompts (0: all)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = run(args)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
