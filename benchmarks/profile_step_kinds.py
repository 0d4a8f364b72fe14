"""Where the time of a `moespec bench`-like run goes, per engine: a plain engine and the config's
speculating one take turns on the same prompts (64 tokens from the held-out corpus, 4 waves of
the batch size, 64 +- 50% new tokens, prefix cache off, one thread), and every step is timed and
counted by kind: steps carrying prompt chunks, plain decode steps, speculative steps by k (and the
first after plain ones, which catches up), each also per batch-size bucket.

  python benchmarks/profile_step_kinds.py CONFIG BATCH TEMPERATURE REPEATS [key=value ...]

e.g. `configs/tiny-deepseek-mtp.yaml 64 0.7 3`, or with `'speculation.schedule={1: 0}'
speculation.adaptive=false` to force the speculating engine to decode plainly.
"""
from __future__ import annotations

import collections
import sys
import time
from dataclasses import replace

import torch
import yaml

from moespec.bench import heldout_prompts, output_lengths
from moespec.config import load_config
from moespec.engine import Engine
from moespec.llm import LLM
from moespec.models import load_tokenizer
from moespec.sampling import SamplingParams

STATS: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))  # engine -> kind -> [n, s]
LABELS: dict[int, str] = {}  # id(engine) -> its label


def step_kind(prepared, after_plain: bool) -> str:
    if prepared is None:
        return "empty"
    if prepared.num_spec:
        return f"spec k={prepared.num_spec}" + (" catch-up" if after_plain else "")
    return "plain" if prepared.batch.mode == "decode" else "prompt chunks"


def instrument() -> None:
    """Engine.step timed and classified by the step it prepared."""
    prepare, step = Engine.prepare, Engine.step
    last: dict[int, object] = {}

    def timed_prepare(self, *args, **kwargs):
        last[id(self)] = prepared = prepare(self, *args, **kwargs)
        return prepared

    def timed_step(self, stop=False):
        last[id(self)] = None
        after_plain = getattr(getattr(self, "verifier", None), "ran_plain", False)
        start = time.perf_counter()
        outputs = step(self, stop)
        seconds = time.perf_counter() - start
        prepared = last[id(self)]
        kind = step_kind(prepared, after_plain)
        kinds = [kind]
        if prepared is not None and kind != "prompt chunks":
            kinds.append(f"  {kind} @ bucket {1 << (len(prepared.scheduled.chunks) - 1).bit_length()}")
        for name in kinds:
            entry = STATS[LABELS.get(id(self), "?")][name]
            entry[0] += 1
            entry[1] += seconds
        return outputs

    Engine.prepare, Engine.step = timed_prepare, timed_step


def main() -> None:
    config_path, batch, temperature, repeats = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    overrides = {key: yaml.safe_load(value) for key, value in (a.split("=", 1) for a in sys.argv[5:])}
    torch.set_num_threads(1)
    instrument()
    base = load_config(config_path, {"cache.prefix_caching": False, "scheduler.max_num_seqs": batch, **overrides})
    engines = {"none": LLM(config=replace(base, speculation=replace(base.speculation, mode="none"))),
               "spec": LLM(config=base)}
    for label, llm in engines.items():
        LABELS[id(llm.engine)] = label
    windows = heldout_prompts(load_tokenizer(base.model.tokenizer or base.model.path), 4 * batch + 1, 64)
    prompts = [w[:64] for w in windows[:4 * batch]]
    params = SamplingParams(temperature=temperature, max_tokens=64, ignore_eos=True, seed=0)
    per_prompt = [replace(params, max_tokens=n) for n in output_lengths(len(prompts), 64, 0.5)]
    for llm in engines.values():  # warm-up, as the bench's
        llm.generate([windows[-1][:64]] * batch, replace(params, max_tokens=16), use_tqdm=False)
    STATS.clear()
    seconds = collections.defaultdict(list)
    for r in range(repeats):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        total = dict.fromkeys(order, 0.0)
        for i in range(0, len(prompts), batch):
            for label in order:
                start = time.perf_counter()
                engines[label].generate(prompts[i:i + batch], per_prompt[i:i + batch], use_tqdm=False)
                total[label] += time.perf_counter() - start
        for label in order:
            seconds[label].append(total[label])
    print("none / spec seconds per repeat:", [round(a / b, 3) for a, b in zip(seconds["none"], seconds["spec"])])
    for label in engines:
        print(f"{label}: {sum(seconds[label]):.2f} s")
        for kind, (n, s) in sorted(STATS[label].items()):
            print(f"   {kind:32s} {n:6d} steps {s:8.2f} s  {1e3 * s / max(n, 1):7.2f} ms/step")
    for bucket, state in engines["spec"].engine.policy.report().items():
        print(f"bucket {bucket}: choice {state['choice']}, {state['steps']} steps, {state['explored']} explored; "
              f"predicted {({str(c): round(v) for c, v in state['predicted'].items()})} "
              f"measured {({str(c): round(v) for c, v in state['measured'].items()})} tok/s")


if __name__ == "__main__":
    main()
