"""`moespec bench`: every speculation mode measured side by side in one run.

  moespec bench --config configs/tiny-deepseek-mtp.yaml --modes none,mtp:1,mtp:2 \
      --batch-sizes 1,4,16 --out results.json [--plot results.png] [--hf-assisted]

A mode is `none`, `mtp[:k]` or `draft[:k]` (draft model / MTP head from the config), or a draft
tree: `mtp-tree:4x3x8` / `draft-tree:4x3x8` (top_k x depth x draft tokens), or `mtp-tree:auto`
(chains and trees measured per batch size: adaptive, whatever --adaptive says). Each tree shape that ran
reports its accept length (`tree_accept_lengths`). Prompts
are held-out windows of the corpus. Batch size b means serving b requests at a time
(`scheduler.max_num_seqs` = b): the prompts of a turn, --waves x b of them, are submitted at
once and a finished request's slot goes to the next waiting one, so the batch stays full
until the last wave drains (--max-tokens-spread varies output lengths, so that requests also
finish at different steps without speculation, as in serving). The modes take turns (the
order rotates each repeat) until each has run max(--num-prompts, waves x b) prompts,
`repeats` times: a turn is a whole group of prompts, or with --turn-seconds S every mode holds
the group at once and a turn is S seconds of stepping, so that the machine's drift within a
group's run falls on every mode alike (each engine's TTFT and TPOT then count its own steps).
Reported per mode and batch size, from its fastest repeat: output tokens/s,
mean TTFT and TPOT, accept length and per-position acceptance, the steps adaptive speculation
chose and how many of them it spent exploring (explore_steps); and its speedup over `none`
as the median of the per-repeat ratios, with every ratio (`speedup_runs`) for the spread:
shared CPU machines drift by 10-20% within a minute (a variant such as `mtp:2/compiled` also
gets its speedup over `none/compiled`, speedup_same_switches). Every engine first runs one
warm-up turn of WARMUP_TOKENS tokens per request at the batch size, in which adaptive
speculation takes its first measurement of every choice. With --hf-assisted, transformers' plain
and assisted `generate` (same target and draft) run at batch 1 in the same process for
comparison.

With --shared-prefix N every prompt is one shared N-token system prompt followed by its own
--prompt-len tokens (a chat service's traffic), and --prefix-caching both runs every mode with
the prefix cache on and off side by side (off: labelled `<mode>/no-cache`), reporting TTFT,
the share of prompt tokens served from the cache and the accept length of each.

With --chat-prompts FILE the prompts are chats instead (JSON lines with `messages`, such as the
held-out prompts of `moespec distill`'s data), rendered with the model's chat template as the
chat endpoint renders them and taken in turn (cycled when fewer than needed; with the prefix
cache off, a repeat is served afresh); --prompt-len does not apply.

--compile both runs every mode eager and with static steps compiled (model.compile; labelled
`<mode>/compiled`) side by side; the compiling happens before the measurement (Engine.warm_up,
every bucket up to the batch size) and its time is reported as compile_s. --cuda-graph both
does the same for captured steps (model.cuda_graph, `<mode>/graph`: CUDA graphs on a GPU; on
a CPU each replay re-runs the step under a check, a test rather than a speed-up). --overlap both
does the same for overlap scheduling (`<mode>/overlap`), and every row reports its decode and
verify steps' wall time (step_ms) and the share of their host + device time that ran beside
the device (host_hidden_share: the next step's preparation under overlap; 0 without).
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from moespec.machine import run_info
from moespec.sequence import RequestMetrics

logger = logging.getLogger(__name__)
# tokens per request of every engine's warm-up at each batch size: enough decode steps for
# adaptive speculation to measure each choice once, as a server does in its first seconds (each
# draft length's first steps run cold and are not measured, verification.COLD_STEPS: 4 lengths of
# 2 + 2 steps and plain decoding's 2 take 14 steps, and 20-30 tokens)
WARMUP_TOKENS = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--modes", default="none,mtp",
                        help="comma list: none, mtp[:k], draft[:k], mtp-tree:KxDxN, draft-tree:KxDxN, mtp-tree:auto; "
                             "MODE@TAG runs a mode again in an engine of its own (none@again: an A/A control)")
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=8,
                        help="prompts per measurement, at least (rounded up to whole turns of --waves x batch size)")
    parser.add_argument("--waves", type=int, default=4,
                        help="prompts per turn of a mode, in batch sizes: the batch stays full until the last wave")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-tokens-spread", type=float, default=0.0,
                        help="vary each request's max_tokens uniformly by this fraction around --max-tokens")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--turn-seconds", type=float, default=0.0, metavar="S",
                        help="0: a mode's turn is a whole group of prompts; S > 0: every mode holds the group at "
                             "once and the modes step in turns of S seconds each (finer pairing on a drifting "
                             "machine; TTFT and TPOT on each engine's own clock)")
    parser.add_argument("--adaptive", choices=["on", "off"], default="off",
                        help="adaptive speculation length (off: always draft k)")
    parser.add_argument("--hf-assisted", action="store_true",
                        help="also time transformers' generate and assisted generation at batch 1")
    parser.add_argument("--chat-prompts", default=None, metavar="FILE",
                        help="JSON lines of chats ({\"messages\": [...]}) to use as prompts, rendered with the "
                             "model's chat template, instead of corpus text")
    parser.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                        help="every prompt starts with the same N tokens (a system prompt)")
    parser.add_argument("--prefix-caching", choices=["config", "on", "off", "both"], default="config",
                        help="both: every mode with the prefix cache on and off (labelled <mode>/no-cache)")
    parser.add_argument("--compile", choices=["config", "on", "off", "both"], default="config",
                        help="static steps through torch.compile (model.compile); both: every mode compiled and "
                             "eager side by side (compiled: labelled <mode>/compiled); compiling happens in the "
                             "warm-up and is reported as compile_s")
    parser.add_argument("--cuda-graph", choices=["config", "on", "off", "both"], default="config",
                        help="static steps captured once per bucket and replayed (model.cuda_graph; CUDA graphs on "
                             "a GPU); both: labelled <mode>/graph; capturing happens in the warm-up (compile_s)")
    parser.add_argument("--overlap", choices=["config", "on", "off", "both"], default="config",
                        help="overlap scheduling (scheduler.overlap); both: labelled <mode>/overlap; modes with "
                             "speculation run without it (not supported yet)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", default="bench-results.json")
    parser.add_argument("--plot", default=None, help="PNG path (default: next to --out)")


def parse_mode(text: str) -> tuple[str, dict]:
    """A --modes entry -> (its label, the speculation fields it sets). `MODE@TAG` runs MODE in an
    engine of its own labelled by the whole text, so one mode can run twice: `none,none@again`
    measures the bench's own spread (an A/A control) beside the modes compared. `mtp:plain` and
    `draft:plain` build the speculating engine, its draft loaded and kept, and decode plainly
    (`schedule: {1: 0}`, not adaptive): its upkeep beside `none` and its adaptive self."""
    from moespec.speculation.tree import TreeShape

    body, at, tag = text.partition("@")
    if at and not tag:
        raise ValueError(f"--modes {text!r}: the tag after '@' is empty")
    name, _, arg = body.partition(":")
    allowed = ("none, mtp[:k], draft[:k], mtp:plain, draft:plain, mtp-tree:KxDxN, draft-tree:KxDxN, mtp-tree:auto, "
               "draft-tree:auto (each may end in @TAG)")
    if name not in ("none", "mtp", "draft", "mtp-tree", "draft-tree"):
        raise ValueError(f"--modes: {name!r} is not a mode; allowed: {allowed}")
    if not name.endswith("-tree"):
        spec = {"mode": name, "tree": None}
        if arg == "plain" and name != "none":
            spec.update(schedule={1: 0}, adaptive=False)
        elif arg:
            spec["num_speculative_tokens"] = int(arg)
        return text, spec
    if arg == "auto":  # chains and trees measured per batch size: adaptive whatever --adaptive says
        return text, {"mode": name[:-5], "tree": "auto", "adaptive": True}
    try:
        shape = TreeShape.parse(arg)
    except ValueError as e:
        raise ValueError(f"--modes {text!r}: {e}") from None
    return text, {"mode": name[:-5], "num_speculative_tokens": shape.depth,
                  "tree": {"top_k": shape.top_k, "depth": shape.depth, "num_draft_tokens": shape.num_draft_tokens}}


def parse_modes(text: str) -> list[tuple[str, dict]]:
    """--modes -> every mode's (label, fields); a label given twice is an error."""
    modes = [parse_mode(m) for m in text.split(",")]
    labels = [label for label, _ in modes]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"--modes: {', '.join(repeated)} given twice; tag a second run of a mode: MODE@TAG")
    return modes


def switch_values(choice: str, configured: bool) -> list[bool]:
    """A --prefix-caching / --compile choice as the settings to run: config, on, off or both."""
    return {"config": [configured], "on": [True], "off": [False], "both": [True, False]}[choice]


def heldout_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    from moespec.training.corpus import CorpusSpec, load_corpus

    ids: list[int] = []
    for text in load_corpus(CorpusSpec()).heldout_texts():
        ids += tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= count * length * 4:
            break
    stride = max(length, len(ids) // max(count, 1))
    return [ids[i * stride: i * stride + length] for i in range(count)]


def chat_prompts(tokenizer, path: str, count: int) -> list[list[int]]:
    """`count` prompts from the chats in `path` (JSON lines with `messages`), each rendered with
    the model's chat template and encoded as the chat endpoint encodes it, the chats in turn."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"--chat-prompts {path}: no chats")
    texts = [tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=False, add_generation_prompt=True)
             for line in lines]
    return [tokenizer.encode(texts[i % len(texts)], add_special_tokens=False) for i in range(count)]


def run_modes(engines: dict, order: list[str], prompts: list[list[int]], params: list, chunk: int,
              shared: int = 0, slice_s: float = 0.0) -> dict[str, dict]:
    """Every mode over the same prompts, `chunk` prompts at a time; the modes take turns on each
    chunk, so a slow phase of the machine falls on all of them alike. `slice_s` 0: a turn is a
    whole chunk (a generate call); else every mode holds the chunk at once and a turn is
    `slice_s` seconds of stepping (`run_sliced`), so drift over a chunk's seconds cancels too."""
    before = {label: snapshot(llm.engine.spec_stats) for label, llm in engines.items()}
    steps_before = {label: step_times(llm.engine.stats) for label, llm in engines.items()}
    policy_before = {label: policy_steps(llm.engine.policy) for label, llm in engines.items()}
    seconds = dict.fromkeys(order, 0.0)
    outs: dict[str, list] = {label: [] for label in order}
    own_clocks: dict[str, list] | None = {label: [] for label in order} if slice_s else None
    for i in range(0, len(prompts), chunk):
        if slice_s:
            run_sliced(engines, order, prompts[i:i + chunk], params[i:i + chunk], slice_s, seconds, outs, own_clocks)
            continue
        for label in order:
            start = time.perf_counter()
            outs[label] += engines[label].generate(prompts[i:i + chunk], params[i:i + chunk], use_tqdm=False)
            seconds[label] += time.perf_counter() - start
    rows = {label: summarize_mode(outs[label], seconds[label], before[label], engines[label].engine.spec_stats, shared,
                                  own_clocks[label] if own_clocks else None)
            for label in order}
    for label in order:
        steps, busy, wall = (b - a for a, b in zip(steps_before[label], step_times(engines[label].engine.stats)))
        rows[label].update(step_ms=1e3 * wall / max(steps, 1), host_hidden_share=hidden_share(busy, wall))
        chosen, explored = (b - a for a, b in zip(policy_before[label], policy_steps(engines[label].engine.policy)))
        rows[label].update(policy_steps=chosen, explore_steps=explored)
    return rows


def run_sliced(engines: dict, order: list[str], prompts: list[list[int]], params: list, slice_s: float,
               seconds: dict[str, float], outs: dict[str, list], own_clocks: dict[str, list]) -> None:
    """One chunk of prompts submitted to every mode at once, the modes then stepping in turns of
    `slice_s` seconds until their requests finish: within a turn an engine's caches stay warm, and
    a change in the machine's speed lasting more than a few turns falls on every mode alike.
    Each engine keeps its own clock (the seconds it spent stepping): `seconds` gains it, and
    `own_clocks` each request's RequestMetrics on it, the chunk submitted at 0."""
    groups = {label: [engines[label].add(p, q) for p, q in zip(prompts, params)] for label in order}
    clock = dict.fromkeys(order, 0.0)
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    while active := [label for label in order if engines[label].engine.has_unfinished()]:
        for label in active:
            engine, turn_end = engines[label].engine, clock[label] + slice_s
            waiting = [seq for group in groups[label] for seq in group if id(seq) not in done]
            while clock[label] < turn_end and engine.has_unfinished():
                start = time.perf_counter()
                engine.step()
                clock[label] += time.perf_counter() - start
                for seq in waiting:
                    if id(seq) not in first and seq.metrics.first_token_time is not None:
                        first[id(seq)] = clock[label]
                    if id(seq) not in done and seq.is_finished:
                        done[id(seq)] = clock[label]
    for label in order:
        seconds[label] += clock[label]
        outs[label] += [engines[label].collect(prompt, group) for prompt, group in zip(prompts, groups[label])]
        own_clocks[label] += [RequestMetrics(first_token_time=first.get(id(seq)), finished_time=done.get(id(seq)),
                                             num_generated_tokens=seq.metrics.num_generated_tokens)
                              for group in groups[label] for seq in group]


def policy_steps(policy) -> tuple[int, int]:
    """Steps adaptive speculation chose, and those of them that ran a choice to measure it."""
    return sum(policy.steps.values()), policy.explore_total


def policy_report(policy) -> dict:
    """Adaptive speculation per batch-size bucket at the end of the runs: the choice, steps,
    exploration steps, predicted and measured tokens/s per choice (a tree by its shape). The
    predictions are the last step's, at its batch size, and at the bucket's top batch size (where
    a full batch runs most of its steps, and where the measured rates mostly come from) for
    requests with room for every draft: the measured rates count the tokens kept, so near
    requests' ends they fall below that prediction."""
    label = lambda choice: getattr(choice, "label", str(choice))  # noqa: E731
    return {str(bucket): {"choice": label(state["choice"]), "steps": state["steps"], "explored": state["explored"],
                          "predicted_batch": state["predicted_batch"],
                          **{source: {label(c): rate for c, rate in state[source].items()}
                             for source in ("predicted", "measured")},
                          "predicted_at_top": {label(c): policy.predict(bucket, c).rate for c in state["predicted"]}}
            for bucket, state in policy.report().items()}


def hidden_share(busy: float, wall: float) -> float:
    """Share of host + device time (`busy`) that ran beside the device: 0 for serial steps."""
    return (busy - wall) / busy if busy else 0.0


def step_times(stats) -> tuple[int, float, float]:
    """Decode and speculative steps: (count, host + device seconds, wall seconds); under overlap
    the wall time is less than host + device by the host work that ran beside the device."""
    return (stats.decode_steps + stats.spec_steps,
            stats.decode_host_s + stats.decode_device_s + stats.spec_host_s + stats.spec_device_s,
            stats.decode_wall_s + stats.spec_wall_s)


def output_lengths(count: int, mean: int, spread: float) -> list[int]:
    """Each prompt's max_tokens: `mean`, or with spread s uniform in [mean(1-s), mean(1+s)] (seeded,
    the same for every mode), so requests finish at different steps as in serving."""
    rng = random.Random(0)
    return [max(1, round(mean * (1 + spread * rng.uniform(-1, 1)))) for _ in range(count)]


def snapshot(stats) -> tuple:
    return (stats.steps, stats.accepted_tokens, list(stats.accepted_at), list(stats.drafted_at),
            {label: list(counts) for label, counts in stats.by_tree.items()})


def summarize_mode(outs: list, elapsed: float, before: tuple, s, shared: int = 0,
                   own_clocks: list | None = None) -> dict:
    """`shared`: the prompts' shared prefix length (the share of it served from the cache is reported);
    `own_clocks`: each request's RequestMetrics on its engine's own clock, where not its own
    (`run_sliced`)."""
    metrics = own_clocks if own_clocks is not None else [o.metrics for o in outs]
    tokens = sum(len(o.token_ids) for o in outs)
    steps, accepted = s.steps - before[0], s.accepted_tokens - before[1]
    acc_at = [a - (before[2][i] if i < len(before[2]) else 0) for i, a in enumerate(s.accepted_at)]
    drafted = [d - (before[3][i] if i < len(before[3]) else 0) for i, d in enumerate(s.drafted_at)]
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    trees = {label: (steps_ - before[4].get(label, [0, 0])[0], acc - before[4].get(label, [0, 0])[1])
             for label, (steps_, acc) in s.by_tree.items()}
    return {
        "seconds": elapsed, "tokens": tokens, "tok_s": tokens / elapsed,
        "ttft_ms": 1e3 * mean([m.ttft for m in metrics if m.ttft is not None]),
        "tpot_ms": (lambda t: None if t is None else 1e3 * t)(mean([m.tpot for m in metrics if m.tpot is not None])),
        "accept_length": (accepted + steps) / steps if steps else None,
        "cached_prompt_share": (sum(o.num_cached_tokens for o in outs)
                                / max(1, sum(len(o.prompt_token_ids) for o in outs))),
        "cached_shared_share": (sum(min(o.num_cached_tokens, shared) for o in outs) / (shared * len(outs))
                                if shared else None),
        "acceptance_by_position": [a / d if d else None for a, d in zip(acc_at, drafted)],
        "tree_accept_lengths": {label: (acc + n) / n for label, (n, acc) in trees.items() if n},
        "tree_step_share": (sum(n for n, _ in trees.values()) / steps) if steps and trees else None,
        "spec_steps": steps,
    }


def summarize_runs(rows: list[dict], baseline: list[dict] | None) -> dict:
    """The fastest of a mode's repeated runs, with its speedup over `none` as the median of the
    per-repeat ratios (within a repeat the modes took turns on each group of prompts, so a slow
    phase of a noisy machine hits both sides of a ratio), and every ratio for the spread; per
    repeat too, its speculative steps and the steps adaptive speculation explored, so each ratio
    reads against what ran (the fastest run's own counts are `spec_steps` and `explore_steps`)."""
    best = dict(max(rows, key=lambda row: row["tok_s"]))
    ratios = [row["tok_s"] / base["tok_s"] for row, base in zip(rows, baseline)] if baseline else None
    best.update(tok_s_runs=[row["tok_s"] for row in rows], speedup_runs=ratios,
                speedup=statistics.median(ratios) if ratios else None,
                spec_steps_runs=[row["spec_steps"] for row in rows],
                explore_steps_runs=[row["explore_steps"] for row in rows])
    return best


def time_hf(config, prompts: list[list[int]], max_tokens: int) -> dict:
    """transformers' plain and assisted generate, greedy, batch 1, same target/draft pair."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32).eval()
    draft = (AutoModelForCausalLM.from_pretrained(config.draft.model, dtype=torch.float32).eval()
             if config.draft.model else None)
    results = {}
    for name, kwargs in (("hf_generate", {}), ("hf_assisted", {"assistant_model": draft})):
        if name == "hf_assisted" and draft is None:
            continue
        tokens, start = 0, time.perf_counter()
        for prompt in prompts:
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                      do_sample=False, pad_token_id=0, eos_token_id=None, **kwargs)
            tokens += out.shape[1] - ids.shape[1]
        results[name] = {"tok_s": tokens / (time.perf_counter() - start)}
    return results


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, rows in report["results"].items():
        sizes = [r["batch"] for r in rows]
        ax1.plot(sizes, [r["tok_s"] for r in rows], marker="o", label=mode)
        ax2.plot(sizes, [r["speedup"] for r in rows], marker="o", label=mode)
    for ax, label in ((ax1, "output tokens/s"), (ax2, "speedup over none")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    ax2.axhline(1.0, color="gray", linestyle="--")
    fig.suptitle(f"{report['config']} ({report['date']}, {report['machine']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run(args: argparse.Namespace) -> int:
    from moespec.arguments import load_engine_config
    from moespec.llm import LLM
    from moespec.models import load_tokenizer
    from moespec.sampling import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    base = load_engine_config(args)
    modes = parse_modes(args.modes)
    if args.turn_seconds < 0:
        raise ValueError(f"--turn-seconds must be >= 0, got {args.turn_seconds}")
    sizes = [int(b) for b in args.batch_sizes.split(",")]

    caching = switch_values(args.prefix_caching, base.cache.prefix_caching)
    compiling = switch_values(args.compile, base.model.compile)
    capturing = switch_values(args.cuda_graph, base.model.cuda_graph)
    overlapping = switch_values(args.overlap, base.scheduler.overlap)
    variants = [(label + ("/no-cache" if args.prefix_caching == "both" and not on else "")
                 + ("/compiled" if args.compile == "both" and compiled else "")
                 + ("/graph" if args.cuda_graph == "both" and captured else "")
                 + ("/overlap" if args.overlap == "both" and overlap else ""), spec, on, compiled, captured, overlap)
                for label, spec in modes for on in caching for compiled in compiling for captured in capturing
                for overlap in overlapping]

    def build_engines(batch: int) -> dict:
        engines = {}
        for label, spec, on, compiled, captured, overlap in variants:
            scheduler = replace(base.scheduler, max_num_seqs=batch, overlap=overlap)
            fields = {**vars(base.speculation), "adaptive": args.adaptive == "on", **spec}  # *-tree:auto adapts
            engines[label] = LLM(config=replace(base, scheduler=scheduler, cache=replace(base.cache, prefix_caching=on),
                                                model=replace(base.model, compile=compiled, cuda_graph=captured),
                                                speculation=replace(base.speculation, **fields)))
        return engines

    def turn_size(batch: int) -> int:  # prompts per turn of a mode
        return args.waves * batch

    def prompt_count(batch: int) -> int:  # at least --num-prompts, in whole turns
        return -(-max(args.num_prompts, turn_size(batch)) // turn_size(batch)) * turn_size(batch)

    tokenizer = load_tokenizer(base.model.tokenizer or base.model.path)
    count = max(prompt_count(b) for b in sizes)
    windows = heldout_prompts(tokenizer, count + 2, max(args.prompt_len, args.shared_prefix))
    prompts = [w[:args.prompt_len] for w in windows[:count]]
    warmup = [w[:args.prompt_len] for w in windows[-1:]] * max(sizes)  # never the measured prompts' prefix
    if args.chat_prompts:
        prompts = chat_prompts(tokenizer, args.chat_prompts, count)
    if args.shared_prefix:
        prompts = [windows[-2][:args.shared_prefix] + p for p in prompts]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    lengths = output_lengths(len(prompts), args.max_tokens, args.max_tokens_spread)
    per_prompt = [replace(params, max_tokens=n) for n in lengths]
    results = {label: [] for label, *_ in variants}
    for batch in sizes:
        engines = build_engines(batch)
        for llm in engines.values():
            llm.engine.warm_up()  # model.compile: every bucket (captured steps were captured when built)
        compile_s = {label: llm.engine.warm_up_s for label, llm in engines.items()}
        for llm in engines.values():  # warm-up; adaptive speculation's first measurement of each choice
            llm.generate(warmup[:batch], replace(params, max_tokens=WARMUP_TOKENS), use_tqdm=False)
        runs: dict[str, list[dict]] = {label: [] for label in engines}
        for r in range(args.repeats):
            labels = list(engines)
            order = labels[r % len(labels):] + labels[:r % len(labels)]  # rotate: no mode always first
            rows = run_modes(engines, order, prompts[:prompt_count(batch)], per_prompt, turn_size(batch),
                             args.shared_prefix, args.turn_seconds)
            for label, row in rows.items():
                runs[label].append(row)
        for label, rows in runs.items():
            row = summarize_runs(rows, runs.get("none"))
            suffix = label[label.index("/"):] if "/" in label else ""
            if suffix and label != "none" + suffix and "none" + suffix in runs:
                # against plain decoding with the same switches (compiled speculation against compiled decoding)
                row["speedup_same_switches"] = summarize_runs(rows, runs["none" + suffix])["speedup"]
            row.update(batch=batch, compile_s=compile_s[label], policy=policy_report(engines[label].engine.policy))
            results[label].append(row)
            logger.info("batch %d %-8s %8.1f tok/s  speedup %s (runs %s)  accept length %s  TTFT %.1f ms  "
                        "cached prompt share %.3f  step %.2f ms  host hidden %.0f%%", batch, label,
                        row["tok_s"], f"{row['speedup']:.2f}" if row["speedup"] else "-",
                        ", ".join(f"{x:.2f}" for x in row["speedup_runs"] or []),
                        f"{row['accept_length']:.2f}" if row["accept_length"] else "-", row["ttft_ms"],
                        row["cached_prompt_share"], row["step_ms"], 100 * row["host_hidden_share"])
            if any(r["policy_steps"] for r in rows):
                logger.info("batch %d %-8s adaptive: %d of %d steps explored (runs %s)", batch, label,
                            sum(r["explore_steps"] for r in rows), sum(r["policy_steps"] for r in rows),
                            ", ".join(str(r["explore_steps"]) for r in rows))
            if row["tree_accept_lengths"]:
                logger.info("batch %d %-8s accept length per tree shape: %s (tree steps %.0f%%)", batch, label,
                            ", ".join(f"{k} {v:.2f}" for k, v in row["tree_accept_lengths"].items()),
                            100 * row["tree_step_share"])
            if "speedup_same_switches" in row:
                logger.info("batch %d %-8s speedup over none%s: %.2f", batch, label, suffix, row["speedup_same_switches"])
        for llm in engines.values():
            llm.close()
    report = {**run_info(f"{platform.machine()}, {torch.get_num_threads()} threads"),
              "config": args.config, "prompt_len": args.prompt_len, "chat_prompts": args.chat_prompts,
              "num_prompts": args.num_prompts,
              "shared_prefix": args.shared_prefix, "prefix_caching": args.prefix_caching, "compile": args.compile,
              "cuda_graph": args.cuda_graph, "overlap": args.overlap,
              "max_tokens": args.max_tokens, "max_tokens_spread": args.max_tokens_spread, "waves": args.waves,
              "turn_seconds": args.turn_seconds,
              "temperature": args.temperature, "adaptive": args.adaptive,
              "results": results}
    if args.hf_assisted:
        hf = time_hf(base, prompts[:args.num_prompts], args.max_tokens)
        ours_b1 = {label: rows[0]["tok_s"] for label, rows in results.items() if rows and rows[0]["batch"] == 1}
        report["transformers_batch1"] = hf
        report["transformers_batch1"]["ours_tok_s"] = ours_b1
        logger.info("transformers at batch 1: %s", json.dumps(hf))
    Path(args.out).write_text(json.dumps(report, indent=2))
    plot(report, args.plot or str(Path(args.out).with_suffix(".png")))
    print(json.dumps(report, indent=2))
    return 0
