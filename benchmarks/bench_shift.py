"""Adaptive speculation across a shift in workload: phases of requests whose drafts are accepted
more or less (chats, then random token ids, then chats again) run back to back through one
engine per mode, as a server sees them. Every engine gets the whole stream at once and the
modes step in turns of --turn-seconds, so drift falls on all of them alike. Per phase it
reports each mode's tokens/s against `none` (over the steps of a full batch most of whose
requests belong to the phase), and for each adaptive mode what it ran after the shift: how many
steps until its leader first took the side (plain decoding or a draft) of the faster of `none`
and the static reference, how many steps ran the losing side, and its choices in order.

  D=checkpoints/smollm2-135m-mtp-head/data/heldout_prompts.jsonl
  .venv/bin/python benchmarks/bench_shift.py --config configs/smollm2-135m-mtp.yaml --chat-prompts $D \
      --modes none,mtp:3,mtp:3@static --phases chat@0,random@1,chat@0 --batch 4 --waves 8 \
      --repeats 3 --threads 1 --out docs/bench/shift-smollm2-b4.json

A phase is SOURCE@TEMPERATURE, SOURCE one of `code` (held-out corpus text, --prompt-len
tokens), `chat` (--chat-prompts) or `random` (--prompt-len token ids drawn uniformly); each
phase is --waves x --batch requests. `MODE@static` runs MODE with adaptive speculation off
(always its full draft), the reference for which side wins a phase; without one, no side is
reported. The modes without `@static` run adaptive; `MODE@sN` with
speculation.adaptive_shift_sigmas = N.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from bench_sureness import parse_tagged_mode  # benchmarks/, this script's own folder

from moespec import bench
from moespec.machine import run_info

logger = logging.getLogger("bench_shift")


@dataclasses.dataclass
class Step:
    seconds: float
    tokens: int  # tokens the step emitted, over every request
    phase: int  # the phase most of the step's requests belong to (-1: none running)
    running: int  # requests in the step
    choice: str  # what adaptive speculation ran ('' for other engines)
    leader: str  # ... and its bucket's leader after the step's decision


def parse_phases(text: str) -> list[tuple[str, float]]:
    phases = []
    for item in text.split(","):
        source, at, temperature = item.partition("@")
        if source not in ("code", "chat", "random") or not at:
            raise ValueError(f"--phases {item!r}: expected code@T, chat@T or random@T")
        phases.append((source, float(temperature)))
    return phases


def build_prompts(args, tokenizer, phases) -> list[list[list[int]]]:
    """Each phase's prompts; a source used twice gets different prompts each time."""
    per_phase = args.waves * args.batch
    code = bench.heldout_prompts(tokenizer, per_phase * len(phases), args.prompt_len)
    chat = bench.chat_prompts(tokenizer, args.chat_prompts, per_phase * len(phases)) if args.chat_prompts else None
    if chat is None and any(source == "chat" for source, _ in phases):
        raise ValueError("--phases: a chat phase needs --chat-prompts")
    rng = random.Random(0)
    noise = [[rng.randrange(tokenizer.vocab_size) for _ in range(args.prompt_len)]
             for _ in range(per_phase * len(phases))]
    pools = {"code": code, "chat": chat, "random": noise}
    return [pools[source][i * per_phase:(i + 1) * per_phase] for i, (source, _) in enumerate(phases)]


def choice_label(choice) -> str:
    return "plain" if choice == 0 else str(getattr(choice, "label", choice))


def trace_choices(policy, log: list[tuple[str, str]]) -> None:
    """Every choice the policy makes lands in `log`, with the leader of its bucket after it."""
    choose = policy.choose

    def chosen(batch_size, *a, **kw):
        choice = choose(batch_size, *a, **kw)
        log.append((choice_label(choice), choice_label(policy.leaders.get(policy.bucket(batch_size), choice))))
        return choice
    policy.choose = chosen


def majority_phase(engine, phase_of: dict[str, int]) -> int:
    phases = [phase_of[seq.request_id] for seq in engine.scheduler.running]
    return max(set(phases), key=phases.count) if phases else -1


def run_stream(engines: dict, prompts: list[list[list[int]]], params: list[list],
               turn_s: float) -> dict[str, list[Step]]:
    """Every phase's requests submitted to every engine at once, in phase order (the scheduler
    admits them first come, first served, so a phase's requests join as the last one's finish);
    the engines step in turns of `turn_s` seconds of their own clocks until all finish."""
    steps: dict[str, list[Step]] = {label: [] for label in engines}
    phase_of: dict[str, dict[str, int]] = {label: {} for label in engines}
    seqs: dict[str, list] = {label: [] for label in engines}
    choices: dict[str, list[tuple[str, str]]] = {label: [] for label in engines}
    for label, llm in engines.items():
        trace_choices(llm.engine.policy, choices[label])
        for i, (phase_prompts, phase_params) in enumerate(zip(prompts, params)):
            for prompt, p in zip(phase_prompts, phase_params):
                for seq in llm.add(prompt, p):
                    phase_of[label][seq.request_id] = i
                    seqs[label].append(seq)
    clock = dict.fromkeys(engines, 0.0)
    while active := [label for label, llm in engines.items() if llm.engine.has_unfinished()]:
        for label in active:
            engine, end = engines[label].engine, clock[label] + turn_s
            while clock[label] < end and engine.has_unfinished():
                phase, running = majority_phase(engine, phase_of[label]), len(engine.scheduler.running)
                before, chosen = emitted(seqs[label]), len(choices[label])
                start = time.perf_counter()
                engine.step()
                seconds = time.perf_counter() - start
                clock[label] += seconds
                choice, leader = choices[label][-1] if len(choices[label]) > chosen else ("", "")
                steps[label].append(Step(seconds, emitted(seqs[label]) - before, phase, running, choice, leader))
    for label, llm in engines.items():
        del llm.engine.policy.choose  # the class's own again
    return steps


def emitted(seqs: list) -> int:
    return sum(seq.metrics.num_generated_tokens for seq in seqs)


def phase_rates(steps: list[Step], count: int, batch: int) -> list[float]:
    """tokens/s per phase, over the steps of a full batch most of whose requests belong to it (the
    last phase's drain, where the batch shrinks and drafts gain more, left out)."""
    rates = []
    for i in range(count):
        mine = [s for s in steps if s.phase == i and s.running >= batch]
        rates.append(sum(s.tokens for s in mine) / max(sum(s.seconds for s in mine), 1e-9))
    return rates


def compress(choices: list[str]) -> list[list]:
    """['plain', 'plain', '3'] -> [['plain', 2], ['3', 1]]"""
    runs: list[list] = []
    for c in choices:
        if runs and runs[-1][0] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    return runs


def follow(steps: list[Step], phase: int, speculate: bool) -> dict:
    """The adaptive engine's decode steps while most requests belong to `phase`: how many ran
    before its leader first took the winning side (a draft where `speculate`, else plain
    decoding; None: never), how many ran the losing side, and the choices in order."""
    seen = [s for s in steps if s.phase == phase and s.choice]
    hit = next((i for i, s in enumerate(seen) if (s.leader != "plain") == speculate), None)
    return {"steps_to_follow": hit, "steps_in_phase": len(seen),
            "steps_on_losing_side": sum((s.choice != "plain") != speculate for s in seen),
            "choices": compress([s.choice for s in seen])}


def parse_shift_mode(text: str) -> tuple[str, dict]:
    """A --modes entry: `MODE@static` runs MODE with adaptive speculation off; the others run
    adaptive, with bench_sureness's tags (`@sN`: adaptive_shift_sigmas = N, ...)."""
    static = text.partition("@")[2] == "static"
    label, spec = bench.parse_mode(text) if static else parse_tagged_mode(text)
    return label, {**spec, "adaptive": not static and spec["mode"] != "none"}


def build_engines(base, modes: list[tuple[str, dict]], batch: int) -> dict:
    """One engine per mode, `batch` requests at most, prefix cache off (every mode prefills alike)."""
    from moespec.llm import LLM

    scheduler = dataclasses.replace(base.scheduler, max_num_seqs=batch)
    cache = dataclasses.replace(base.cache, prefix_caching=False)
    return {label: LLM(config=dataclasses.replace(base, scheduler=scheduler, cache=cache,
                                                  speculation=dataclasses.replace(base.speculation, **spec)))
            for label, spec in modes}


def run(args) -> dict:
    from moespec.arguments import load_engine_config
    from moespec.models import load_tokenizer
    from moespec.sampling import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    base = load_engine_config(args)
    phases = parse_phases(args.phases)
    modes = [parse_shift_mode(text) for text in args.modes.split(",")]
    tokenizer = load_tokenizer(base.model.tokenizer or base.model.path)
    prompts = build_prompts(args, tokenizer, phases)
    lengths = bench.output_lengths(args.waves * args.batch * len(phases), args.max_tokens, args.max_tokens_spread)
    params = [[SamplingParams(temperature=t, max_tokens=lengths[i * len(ps) + j], ignore_eos=True, seed=0)
               for j in range(len(ps))] for i, ((_, t), ps) in enumerate(zip(phases, prompts))]
    engines = build_engines(base, modes, args.batch)
    warmup = bench.heldout_prompts(tokenizer, args.batch + 1, args.prompt_len)[-1:] * args.batch
    for llm in engines.values():  # warm-up, and adaptive speculation's first measurement of each choice
        llm.generate(warmup, SamplingParams(max_tokens=bench.WARMUP_TOKENS, ignore_eos=True), use_tqdm=False)
    repeats = []
    for r in range(args.repeats):
        steps = run_stream(engines, prompts, params, args.turn_seconds)
        rates = {label: phase_rates(s, len(phases), args.batch) for label, s in steps.items()}
        statics = [label for label in engines if label.endswith("@static")]
        repeat = {"rates": rates, "speedup": {label: [a / b for a, b in zip(rates[label], rates["none"])]
                                              for label in rates if label != "none"}, "follow": {},
                  "requested_tokens": sum(p.max_tokens for ps in params for p in ps),
                  # per mode, the tokens its steps emitted: first those with no request running yet, then per phase
                  "tokens": {label: [sum(st.tokens for st in s if st.phase == i) for i in range(-1, len(phases))]
                             for label, s in steps.items()}}
        repeat["policy"] = {label: bench.policy_report(engines[label].engine.policy)
                            for label, (_, spec) in zip(engines, modes) if spec["adaptive"]}
        for label, (_, spec) in zip(engines, modes):
            if not spec["adaptive"] or not statics:
                continue
            repeat["follow"][label] = [follow(steps[label], i, any(rates[s][i] > rates["none"][i] for s in statics))
                                       for i in range(len(phases))]
        repeats.append(repeat)
        log_repeat(r, phases, repeat)
    for llm in engines.values():
        llm.close()
    summary = {label: [statistics.median(rep["speedup"][label][i] for rep in repeats) for i in range(len(phases))]
               for label in repeats[0]["speedup"]}
    logger.info("median speedup over none per phase: %s", json.dumps(
        {label: [round(x, 3) for x in v] for label, v in summary.items()}))
    return {**run_info(f"{platform.machine()}, {torch.get_num_threads()} threads"),
            "config": args.config, "modes": args.modes, "phases": args.phases, "batch": args.batch,
            "waves": args.waves, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
            "max_tokens_spread": args.max_tokens_spread, "turn_seconds": args.turn_seconds,
            "median_speedup": summary, "repeats": repeats}


def log_repeat(r: int, phases, repeat: dict) -> None:
    for i, (source, t) in enumerate(phases):
        speedups = ", ".join(f"{label} {v[i]:.3f}" for label, v in repeat["speedup"].items())
        follows = "; ".join(f"{label}: led by the winning side after {f[i]['steps_to_follow']} of "
                            f"{f[i]['steps_in_phase']} steps ({f[i]['steps_on_losing_side']} on the losing side), ran "
                            f"{' '.join(f'{c}x{n}' for c, n in f[i]['choices'][:10])}"
                            for label, f in repeat["follow"].items())
        logger.info("repeat %d phase %d %s@%g: %s | %s", r, i, source, t, speedups, follows)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--modes", default="none,mtp:3,mtp:3@static")
    parser.add_argument("--phases", default="code@0,code@1.5,code@0")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--waves", type=int, default=8, help="requests per phase, in batches")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-tokens-spread", type=float, default=0.5)
    parser.add_argument("--chat-prompts", default=None, metavar="FILE")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--turn-seconds", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="bench-shift.json")
    args = parser.parse_args(sys.argv[1:])
    if "none" not in args.modes.split(","):
        parser.error("--modes must include none")
    report = run(args)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
