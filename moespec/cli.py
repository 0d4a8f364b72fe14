"""`moespec` command line (also `python -m moespec`).

  moespec generate --config C --prompt "..." [--max-tokens N] [--temperature T] [--json]
  moespec serve    --config C [--host H] [--port P] [--api-key K]
  moespec bench    --config C --modes none,mtp --batch-sizes 1,4,16 --out results.json
  moespec plan     --config C [--gpu-memory 141GB] [--json]
  moespec train-tokenizer | train-model | distill | train-mtp-head | eval-head ...

Any config key can be overridden with `--set section.key=value` (repeatable; nested keys too:
`--set speculation.tree.top_k=4`).
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

from moespec.arguments import add_config_arguments, load_engine_config

# subcommands implemented elsewhere: name -> module exposing add_arguments(parser) and run(args)
LAZY_COMMANDS = {
    "bench": ("moespec.bench", "measure speculation modes side by side (tokens/s, accept length, TTFT, TPOT)"),
    "plan": ("moespec.plan", "per-rank memory of a deployment from config.json alone: weights, KV cache, buffers"),
    "train-tokenizer": ("moespec.training.tokenizer", "train the byte-level BPE tokenizer"),
    "train-model": ("moespec.training.train_model", "train a tiny target or draft model"),
    "distill": ("moespec.training.distill", "self-distillation data: a target's answers to prompts, for its MTP head"),
    "train-mtp-head": ("moespec.training.train_mtp_head", "train an MTP head for a frozen target"),
    "eval-head": ("moespec.training.evaluate", "evaluate a target and its MTP head through the inference code"),
}


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate completions offline")
    add_config_arguments(p)
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from moespec.llm import LLM
    from moespec.sampling import SamplingParams

    llm = LLM(config=load_engine_config(args))  # under torchrun, ranks other than 0 serve inside and exit
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    try:
        outputs = llm.generate(args.prompt, params, use_tqdm=not args.json)
    finally:
        llm.close()
    for out in outputs:
        if args.json:
            print(json.dumps({"prompt": out.prompt, "token_ids": out.token_ids, "text": out.text,
                              "finish_reason": out.finish_reason}), flush=True)
        else:
            print(f"--- {out.prompt!r} ({len(out.token_ids)} tokens, {out.finish_reason})\n{out.text}", flush=True)
    return 0


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_config_arguments(p)
    p.add_argument("--host", default=None, help="bind address (default: server.host from the config)")
    p.add_argument("--port", type=int, default=None, help="port (default: server.port from the config)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: server.api_key)")
    p.add_argument("--reasoning-parser", choices=["none", "deepseek-r1"], default=None,
                   help="split chat output into reasoning_content and content (default: server.reasoning_parser)")
    p.add_argument("--tool-call-parser", choices=["none", "deepseek-v3", "hermes"], default=None,
                   help="parse tool calls out of chat output (default: server.tool_call_parser)")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from moespec.server.launch import serve

    serve(load_engine_config(args, parser_overrides(args)), args.host, args.port, args.api_key, args.log_level)
    return 0


def parser_overrides(args: argparse.Namespace) -> dict:
    """--reasoning-parser and --tool-call-parser as config overrides (when given)."""
    parsers = {"server.reasoning_parser": args.reasoning_parser, "server.tool_call_parser": args.tool_call_parser}
    return {key: value for key, value in parsers.items() if value is not None}


def add_lazy(sub, name: str, module: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text)
    mod = importlib.import_module(module)
    mod.add_arguments(p)
    p.set_defaults(func=mod.run)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moespec", description="MoE + speculative decoding serving stack")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate(sub)
    add_serve(sub)
    command = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in LAZY_COMMANDS.items():
        if name == command:  # import a command's code only when it runs
            add_lazy(sub, name, module, help_text)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from moespec.config import ConfigError

    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"moespec: config error: {e}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as e:
        print(f"moespec: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
