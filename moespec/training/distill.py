"""Self-distillation data for an MTP head: the target's own answers to prompts built from text that
ships with Python on this machine (the language reference's topics in `pydoc_data`, functions of
standard-library modules, installed packages' summaries) plus arithmetic questions.

Command: `moespec distill --config configs/smollm2-135m.yaml --out DIR [--prompts 2000]
[--max-tokens 256]`.

Four kinds of prompts, each rendered through the target's chat template: `chat` (what an
installed package is for), `code` (what a standard-library function does), `explanation` (a
reference passage in plain words) and `arithmetic`. Every tenth prompt of each kind is held out.
The target answers half the prompts greedily and half at temperature 0.7 (seeded), through the
engine. DIR receives:

- `train.npy`, `heldout.npy`: int32 token streams, each conversation (prompt and answer tokens)
  after the other, as `train-mtp-head --data DIR` reads them;
- `heldout_prompts.jsonl`: the held-out prompts (`kind`, `messages`), for accept-length runs;
- `answer_counts.npy`: how often each token id occurs in the training answers, from which
  `train-mtp-head --draft-vocab N` takes the N most frequent;
- `info.json`: the sources, counts, tokens and sampling settings.
"""
from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import random
import sysconfig
from pathlib import Path

import numpy as np

KINDS = ("chat", "code", "explanation", "arithmetic")
HELD_OUT_EVERY = 10
CODE_MODULES = ("json/encoder.py", "json/decoder.py", "textwrap.py", "string.py", "heapq.py", "bisect.py",
                "shlex.py", "fnmatch.py", "difflib.py", "statistics.py", "fractions.py", "calendar.py",
                "csv.py", "html/__init__.py", "colorsys.py", "random.py", "base64.py", "glob.py", "posixpath.py",
                "urllib/parse.py", "email/utils.py", "functools.py", "ipaddress.py", "pprint.py", "gettext.py")

# Questions per kind; a source is asked the next one each time the sources run out.
CHAT_QUESTIONS = ("What is the Python package {0} for? Its description says: \"{1}\". When would I use it?",
                  "Explain to a beginner what the Python package {0} does. Its summary reads: \"{1}\".",
                  "Give an example of a task where the Python package {0} helps. It is described as: \"{1}\".",
                  "Should I install the Python package {0} for my project? Its description says: \"{1}\".")
CODE_QUESTIONS = ("What does this Python function do?", "Explain step by step how this Python function works.",
                  "What are the inputs and the result of this Python function?")
PASSAGE_QUESTIONS = ("Explain this passage from the Python documentation in plain words:",
                     "Summarize this passage from the Python documentation and give a short example:")


def reference_passages(rng: random.Random) -> list[str]:
    """Distinct paragraphs of 200-900 characters from the language reference's pydoc topics."""
    import pydoc_data.topics

    passages = [p.strip() for text in pydoc_data.topics.topics.values() for p in text.split("\n\n")]
    passages = [" ".join(p.split()) for p in passages if 200 <= len(p) <= 900 and p.count("*") < 4]
    passages = list(dict.fromkeys(passages))  # topics share paragraphs; each once
    rng.shuffle(passages)
    return passages


def stdlib_functions(rng: random.Random) -> list[str]:
    """Source of 4-30 line functions from standard-library modules."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for name in CODE_MODULES:
        path = root / name
        if not path.is_file():
            continue
        source = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and 4 <= node.end_lineno - node.lineno + 1 <= 30:
                found.append(ast.get_source_segment(source, node))
    rng.shuffle(found)
    return found


def package_summaries(rng: random.Random) -> list[tuple[str, str]]:
    """(name, one-line summary) of the installed distributions."""
    seen, found = set(), []
    for dist in importlib.metadata.distributions():
        name, summary = dist.metadata.get("Name"), (dist.metadata.get("Summary") or "").strip()
        if name and name.lower() not in seen and 20 <= len(summary) <= 200:
            seen.add(name.lower())
            found.append((name, summary))
    found.sort()
    rng.shuffle(found)
    return found


def build_prompts(count: int, seed: int) -> list[dict]:
    """`count` prompts, the kinds in turn: [{kind, content}]."""
    rng = random.Random(seed)
    passages, functions, packages = reference_passages(rng), stdlib_functions(rng), package_summaries(rng)
    makers = {
        "chat": lambda i: phrasing(CHAT_QUESTIONS, i, packages).format(*packages[i % len(packages)]),
        "code": lambda i: (f"{phrasing(CODE_QUESTIONS, i, functions)}\n\n"
                           f"```python\n{functions[i % len(functions)]}\n```"),
        "explanation": lambda i: f"{phrasing(PASSAGE_QUESTIONS, i, passages)}\n\n{passages[i % len(passages)]}",
        "arithmetic": lambda i: arithmetic_question(rng),
    }
    return [{"kind": KINDS[i % len(KINDS)], "content": makers[KINDS[i % len(KINDS)]](i // len(KINDS))}
            for i in range(count)]


def phrasing(questions: tuple[str, ...], i: int, sources: list) -> str:
    """The question for the i-th prompt of a kind: the first until its sources run out, then the
    next, so that a source used again comes with another question."""
    return questions[(i // len(sources)) % len(questions)]


def arithmetic_question(rng: random.Random) -> str:
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    op = rng.choice(("+", "-", "*", "/"))
    if op == "/":
        return f"What is {a * b} divided by {b}? Explain the steps."
    return f"What is {a} {op} {b}? Explain the steps."


def is_held_out(index: int) -> bool:
    return (index // len(KINDS)) % HELD_OUT_EVERY == HELD_OUT_EVERY - 1


def generate_answers(llm, prompts: list[dict], max_tokens: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) per prompt: even ones greedy, odd ones at temperature 0.7 (seeded)."""
    from moespec.sampling import SamplingParams

    tokenizer = llm.get_tokenizer()
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p["content"]}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    ids = [llm.engine.encode(text) for text in texts]  # as the chat endpoint encodes a rendered chat
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0 if i % 2 == 0 else 0.7, seed=seed + i)
              for i in range(len(prompts))]
    outputs = llm.generate(ids, params)
    return [(prompt, list(out.outputs[0].token_ids)) for prompt, out in zip(ids, outputs)]


def write_data(out: Path, prompts: list[dict], pairs: list[tuple[list[int], list[int]]], vocab_size: int,
               info: dict) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    streams = {"train": [], "heldout": []}
    counts = np.zeros(vocab_size, dtype=np.int64)
    held = []
    for i, (prompt, (prompt_ids, answer)) in enumerate(zip(prompts, pairs)):
        split = "heldout" if is_held_out(i) else "train"
        streams[split].extend(prompt_ids + answer)
        if split == "train":
            np.add.at(counts, np.asarray(answer, dtype=np.int64), 1)
        else:
            held.append({"kind": prompt["kind"], "messages": [{"role": "user", "content": prompt["content"]}]})
    for split, stream in streams.items():
        np.save(out / f"{split}.npy", np.asarray(stream, dtype=np.int32))
    np.save(out / "answer_counts.npy", counts)
    (out / "heldout_prompts.jsonl").write_text("".join(json.dumps(h) + "\n" for h in held))
    info = {**info, "train_tokens": len(streams["train"]), "heldout_tokens": len(streams["heldout"]),
            "train_answer_tokens": int(counts.sum()), "heldout_prompts": len(held),
            "prompts_by_kind": {k: sum(p["kind"] == k for p in prompts) for k in KINDS}}
    (out / "info.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from moespec.arguments import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument("--out", required=True, type=Path, help="directory to write the data to")
    parser.add_argument("--prompts", type=int, default=2000, help="prompts in all (a tenth held out)")
    parser.add_argument("--max-tokens", type=int, default=256, help="answer length at most")
    parser.add_argument("--data-seed", type=int, default=0)


def run(args: argparse.Namespace) -> None:
    from moespec.arguments import load_engine_config
    from moespec.llm import LLM

    config = load_engine_config(args)
    prompts = build_prompts(args.prompts, args.data_seed)
    llm = LLM(config=config)
    try:
        pairs = generate_answers(llm, prompts, args.max_tokens, args.data_seed)
        vocab_size = llm.engine.vocab_size
    finally:
        llm.close()
    info = {"model": str(config.model.path), "prompts": args.prompts, "max_tokens": args.max_tokens,
            "sampling": "even prompts greedy, odd ones temperature 0.7 (seeded)",
            "sources": ["pydoc_data.topics (the Python language reference)", "standard-library function sources",
                        "installed packages' summaries", "arithmetic questions"]}
    print(json.dumps(write_data(args.out, prompts, pairs, vocab_size, info), indent=1))


def main(argv: list[str] | None = None) -> None:
    from moespec.arguments import run_standalone

    run_standalone("moespec distill", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    main()
