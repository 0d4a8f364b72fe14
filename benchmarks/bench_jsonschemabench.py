"""JSONSchemaBench (guidance-ai/jsonschemabench, `data/<subset>/*.json`) through moespec's
structured outputs, per whole subset and per engine (structured.backend):

  python benchmarks/bench_jsonschemabench.py --subsets WashingtonPost Snowplow \
      --out docs/bench/jsonschemabench-cpu.json

- coverage: schemas the engine accepts. Each schema is compiled as the server compiles it (in a
  compile process, stopped after --compile-timeout seconds) and refused where the engine would
  not enforce one of its keywords exactly (moespec/grammar/keywords.py);
- compliance: of the accepted schemas' outputs that finished with `stop`, those that parse and
  validate with `jsonschema` (the schema's own draft, with format checks). Outputs cut by
  max_tokens are counted apart. Generation is greedy, under MTP (configs/tiny-deepseek-mtp.yaml,
  the tiny DeepSeek-V3 checkpoint), --batch requests at a time;
- mask time: host time in the grammar hooks (masks, advancing and rolling back matchers, as
  benchmarks/bench_structured.py counts it) per output token, and wall time per output token
  against the same prompts without a constraint.

--dataset is the benchmark's git directory (read with git, no work tree needed) or a checkout.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import torch

from bench_structured import MaskTimer
from moespec.machine import run_info

DATASET = "/work/.mirror/guidance-ai+jsonschemabench/repo"
SUBSETS = ["WashingtonPost", "Github_trivial", "Snowplow", "JsonSchemaStore", "Glaiveai2K", "Kubernetes",
           "Github_easy", "Github_medium", "Github_hard", "Github_ultra"]
PROMPT = "# {name}: one JSON value that follows the schema\nvalue = "


def read_subset(dataset: str, subset: str) -> list[tuple[str, str]]:
    """(path inside the dataset, file text) of every schema of a subset, in name order."""
    root = Path(dataset)
    if (root / "data").is_dir():
        return [(str(p.relative_to(root)), p.read_text()) for p in sorted((root / "data" / subset).glob("*.json"))]
    names = subprocess.run(["git", "-C", dataset, "ls-tree", "-r", "-z", "--name-only", "HEAD", f"data/{subset}/"],
                           capture_output=True, text=True, check=True).stdout.split("\0")[:-1]
    batch = subprocess.run(["git", "-C", dataset, "cat-file", "--batch"], input="".join(f"HEAD:{n}\n" for n in names).encode(),
                           capture_output=True, check=True).stdout
    out, at = [], 0
    for name in names:
        header_end = batch.index(b"\n", at)
        header = batch[at:header_end].split()
        if header[-1] == b"missing":  # a large file the copy lists but does not hold: reported apart
            out.append((name, None))
            at = header_end + 1
            continue
        size = int(header[2])
        out.append((name, batch[header_end + 1: header_end + 1 + size].decode()))
        at = header_end + 1 + size + 1
    return out


class Compiler:
    """The server's compile processes (server/grammar_workers.CompileProcess), one at a time, with
    a time limit per schema."""

    def __init__(self, grammars, timeout_s: float) -> None:
        self.grammars, self.timeout_s, self.worker = grammars, timeout_s, None

    def accept(self, spec) -> str | None:
        """None where the schema is compiled into the grammar cache, else why it is refused."""
        from moespec.server.grammar_workers import CompileProcess
        from moespec.structured import GrammarError
        if self.worker is None:
            self.worker = CompileProcess(self.grammars.worker_args())
            self.worker.wait_ready()
        self.worker.connection.send(spec)
        if not self.worker.connection.poll(self.timeout_s):
            self.close()
            return f"compile timeout ({self.timeout_s:g} s)"
        try:
            answer = self.worker.connection.recv()
        except EOFError:
            self.close()
            return "the compile process died"
        if answer[0] == "error":
            return answer[2]
        try:
            self.grammars.load(spec, answer[1])
        except GrammarError as e:
            return e.reason
        return None

    def close(self) -> None:
        if self.worker is not None:
            self.worker.kill()
            self.worker = None


def validate(schema: dict, text: str) -> str | None:
    """None where `text` is JSON that validates against `schema`, else the first error."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON: {e}"
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    error = jsonschema.exceptions.best_match(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value))
    return None if error is None else f"{error.message[:200]} at {error.json_path}"


def generate(llm, prompts: list[str], params: list, timer: MaskTimer) -> tuple[list, float, float]:
    """Outputs, wall seconds and grammar-hook seconds."""
    masked, start = timer.seconds, time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, time.perf_counter() - start, timer.seconds - masked


def run_subset(llm, backend: str, subset: str, files: list[tuple[str, str]], args, timer: MaskTimer) -> dict:
    from moespec.sampling import SamplingParams
    compiler = Compiler(llm.engine.grammars, args.compile_timeout)
    rows: list[dict] = []
    compile_s = wall = masks = 0.0
    tokens = 0
    for at in range(0, len(files), args.batch):  # compiled and generated a batch at a time (the LRU keeps them)
        start = time.perf_counter()
        chunk = [accept(compiler, rows, name, text) for name, text in files[at: at + args.batch]]
        chunk = [entry for entry in chunk if entry is not None]
        compile_s += time.perf_counter() - start
        prompts = [PROMPT.format(name=Path(rows[i]["file"]).stem) for i, _, _ in chunk]
        params = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured=spec) for _, _, spec in chunk]
        outs, seconds, grammar_s = generate(llm, prompts, params, timer) if chunk else ([], 0.0, 0.0)
        wall, masks = wall + seconds, masks + grammar_s
        for (i, schema, _), out in zip(chunk, outs):
            completion = out.outputs[0]
            tokens += len(completion.token_ids)
            rows[i].update(finish=completion.finish_reason, tokens=len(completion.token_ids))
            if completion.finish_reason == "stop":
                rows[i]["invalid"] = validate(schema, completion.text)
                if rows[i]["invalid"]:
                    rows[i]["text"] = completion.text[:2000]
        print(f"  {subset} {backend}: {len(rows)}/{len(files)} schemas", flush=True)
    compiler.close()
    return summarize(subset, backend, rows, compile_s, wall, masks, tokens)


def accept(compiler: Compiler, rows: list[dict], name: str, text: str) -> tuple | None:
    """Appends the schema's row; (row index, schema, spec) where it is accepted."""
    from moespec.structured import GrammarError, StructuredOutputs
    schema = json.loads(text)
    try:
        spec = StructuredOutputs.unparsed(json=schema)
        refused = compiler.accept(spec)
    except GrammarError as e:
        refused = e.reason
    rows.append({"file": name, "refused": refused})
    return (len(rows) - 1, schema, spec) if refused is None else None


def summarize(subset: str, backend: str, rows: list[dict], compile_s: float, wall: float, masks: float,
              tokens: int) -> dict:
    stop = [r for r in rows if r.get("finish") == "stop"]
    valid = [r for r in stop if not r["invalid"]]
    return {"subset": subset, "backend": backend, "schemas": len(rows),
            "accepted": sum(r["refused"] is None for r in rows),
            "finished_stop": len(stop), "cut_by_max_tokens": sum(r.get("finish") == "length" for r in rows),
            "valid": len(valid), "compliance": len(valid) / len(stop) if stop else None,
            "output_tokens": tokens, "compile_s": compile_s, "generate_s": wall,
            "grammar_us_per_token": 1e6 * masks / tokens if tokens else None,
            "wall_us_per_token": 1e6 * wall / tokens if tokens else None,
            "invalid": [r for r in stop if r["invalid"]], "refusals": refusal_counts(rows), "rows": rows}


def refusal_counts(rows: list[dict]) -> dict[str, int]:
    """Refusals by their reason's leading words (the keyword, for a refused keyword)."""
    counts: dict[str, int] = {}
    for r in rows:
        if r["refused"]:
            reason = r["refused"]
            key = reason.split(" at ")[0] if reason.startswith("keyword") else reason[:60]
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def unconstrained(llm, files: list[tuple[str, str]], args, timer: MaskTimer) -> dict:
    """Wall time per output token of the same prompts without a constraint (at most one batch)."""
    from moespec.sampling import SamplingParams
    prompts = [PROMPT.format(name=Path(name).stem) for name, _ in files[: args.batch]]
    outs, seconds, _ = generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens), timer)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests": len(prompts), "output_tokens": tokens, "wall_us_per_token": 1e6 * seconds / tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default=DATASET)
    parser.add_argument("--subsets", nargs="+", default=SUBSETS[:3], choices=SUBSETS)
    parser.add_argument("--backends", nargs="+", default=["xgrammar", "llguidance", "auto"])
    parser.add_argument("--config", default="configs/tiny-deepseek-mtp.yaml")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--compile-timeout", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from moespec.llm import LLM
    timer = MaskTimer()
    report = {**run_info(f"{args.threads} thread(s), CPU"), "command": " ".join(["python"] + sys.argv),
              "config": args.config, "max_tokens": args.max_tokens, "batch": args.batch, "results": [],
              "unconstrained": {}}
    llms = {b: LLM.from_config(args.config, structured_backend=b, max_num_seqs=args.batch) for b in args.backends}
    for subset in args.subsets:
        files = read_subset(args.dataset, subset)
        report.setdefault("missing", {})[subset] = [name for name, text in files if text is None]
        files = [(name, text) for name, text in files if text is not None]
        report["unconstrained"][subset] = unconstrained(llms[args.backends[0]], files, args, timer)
        for backend, llm in llms.items():
            result = run_subset(llm, backend, subset, files, args, timer)
            report["results"].append(result)
            print(table_row(result), flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("\n".join(table_row(r) for r in report["results"]))


def table_row(r: dict) -> str:
    compliance = "-" if r["compliance"] is None else f"{100 * r['compliance']:.1f}%"
    return (f"| {r['subset']} | {r['backend']} | {r['schemas']} | {r['accepted']} | {r['finished_stop']} | "
            f"{r['cut_by_max_tokens']} | {r['valid']} | {compliance} | {r['grammar_us_per_token'] or 0:.0f} |")


if __name__ == "__main__":
    multiprocessing.set_start_method("spawn", force=True)
    main()
