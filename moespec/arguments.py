"""The command-line pieces every `moespec` command shares: the config arguments (`--config`,
`--set`), loading an EngineConfig from them, and running a command module on its own. Commands
(moespec.cli, plan, bench, training) import them from here, so none imports the CLI."""
from __future__ import annotations

import argparse
import logging

from moespec.config import load_config, parse_override


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set cache.page_size=32 or "
                             "--set speculation.tree.top_k=4 (repeatable)")


def load_engine_config(args: argparse.Namespace, extra: dict | None = None):
    overrides = dict(parse_override(o) for o in args.overrides)
    overrides.update(extra or {})
    return load_config(args.config, overrides)


def run_standalone(prog: str, doc: str | None, add_arguments, run, argv: list[str] | None = None) -> None:
    """Entry point of a command module run as `python -m moespec.training.X`: parse, log, run."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    run(parser.parse_args(argv))
