"""`moespec bench` runs every requested mode in one process and writes JSON and a plot."""
import json
import shutil
import subprocess
import sys

from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama_config(tmp_path):
    """A one-layer Llama, its own draft model."""
    import torch
    torch.manual_seed(0)
    model = tmp_path / "m"
    config = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, eos_token_id=1)
    LlamaForCausalLM(config).save_pretrained(model)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"checkpoints/tokenizer/{f}", model / f)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model:\n  path: {model}\ndraft:\n  model: {model}\ncache:\n  page_size: 8\n  num_kv_pages: 256\n")
    return cfg


def test_bench_writes_results_for_every_mode(tmp_path):
    import torch
    cfg = tiny_llama_config(tmp_path)
    out = tmp_path / "r.json"
    result = subprocess.run([sys.executable, "-m", "moespec", "bench", "--config", str(cfg), "--modes", "none,draft:2,none@again",
                             "--batch-sizes", "1,2", "--prompt-len", "16", "--max-tokens", "6", "--repeats", "2",
                             "--num-prompts", "3", "--waves", "2", "--cuda-graph", "both",
                             "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["cpu"] and report["cpu_capability"] == torch.backends.cpu.get_cpu_capability()  # what it ran on
    graphs = {label: report["results"].pop(label) for label in ("none/graph", "draft:2/graph", "none@again/graph")}
    again = report["results"].pop("none@again")  # an A/A control: plain decoding in an engine of its own
    assert set(report["results"]) == {"none", "draft:2"} and report["cuda_graph"] == "both"
    for none, control in zip(report["results"]["none"], again):
        assert control["tokens"] == none["tokens"] and control["accept_length"] is None
        assert control["speedup_runs"] == [c / n for c, n in zip(control["tok_s_runs"], none["tok_s_runs"])]
    # captured steps (checked replays on this CPU): captured in the warm-up, compared with the same switches
    assert all(r["compile_s"] > 0 and r["tok_s"] > 0 for rows in graphs.values() for r in rows)
    assert all("speedup_same_switches" in r for r in graphs["draft:2/graph"])
    assert all(r["compile_s"] == 0 for rows in report["results"].values() for r in rows)
    assert all(r["policy_steps"] == r["explore_steps"] == 0 and r["policy"] == {}
               and r["explore_steps_runs"] == [0, 0] for rows in report["results"].values() for r in rows)
    for rows in report["results"].values():
        assert [r["batch"] for r in rows] == [1, 2]
        # at least 3 prompts, in turns of 2 x batch size: 4 prompts at batch 1 and at batch 2
        assert all(r["tok_s"] > 0 and r["tokens"] == 4 * 6 for r in rows)
        assert all(len(r["tok_s_runs"]) == 2 and max(r["tok_s_runs"]) == r["tok_s"] for r in rows)
    for none, draft in zip(report["results"]["none"], report["results"]["draft:2"]):
        assert none["speedup"] == 1.0  # the median of per-repeat ratios to itself
        ratios = [d / n for d, n in zip(draft["tok_s_runs"], none["tok_s_runs"])]
        assert draft["speedup_runs"] == ratios and draft["speedup"] == sum(ratios) / 2
    draft = report["results"]["draft:2"]
    assert all(r["accept_length"] == 3.0 for r in draft)  # the draft is the target itself
    # every repeat's verifications, counted per request: 4 requests, 2 each (6 tokens: the
    # prompt's next one, then 3 a step, the last step's drafts cut at the request's room)
    assert [r["spec_steps_runs"] for r in draft] == [[8, 8], [8, 8]]
    assert all(r["spec_steps_runs"] == [0, 0] for r in report["results"]["none"])
    assert all(r["acceptance_by_position"] == [1.0, 1.0] for r in draft)
    assert out.with_suffix(".png").stat().st_size > 1000


def test_bench_turns_of_seconds_keep_each_engines_own_clock(tmp_path):
    """--turn-seconds: every mode holds a group of prompts at once and they step in short turns;
    each engine's seconds and latencies count its own steps only. `draft:plain`, the drafting
    engine forced to decode plainly, runs no speculative step."""
    cfg = tiny_llama_config(tmp_path)
    out = tmp_path / "r.json"
    result = subprocess.run([sys.executable, "-m", "moespec", "bench", "--config", str(cfg), "--modes",
                             "none,draft:2,none@again,draft:plain", "--batch-sizes", "2", "--prompt-len", "16",
                             "--max-tokens", "6", "--repeats", "2", "--num-prompts", "4", "--waves", "2",
                             "--turn-seconds", "0.005",
                             "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["turn_seconds"] == 0.005
    rows = {label: rows[0] for label, rows in report["results"].items()}
    assert set(rows) == {"none", "draft:2", "none@again", "draft:plain"}
    for row in rows.values():
        assert row["tokens"] == 4 * 6 and len(row["speedup_runs"]) == 2
        # a request's first token and its last five on the engine's own clock, within its seconds
        assert 0 < row["ttft_ms"] and 0 < row["tpot_ms"]
        assert row["ttft_ms"] + 5 * row["tpot_ms"] <= 1e3 * row["seconds"]
    assert rows["draft:2"]["accept_length"] == 3.0 and rows["none@again"]["accept_length"] is None
    assert rows["draft:plain"]["accept_length"] is None and rows["draft:plain"]["spec_steps"] == 0
    result = subprocess.run([sys.executable, "-m", "moespec", "bench", "--config", str(cfg), "--modes", "none",
                             "--turn-seconds", "-1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "--turn-seconds must be >= 0" in result.stderr


def test_output_lengths_spread_around_the_mean():
    from moespec.bench import output_lengths
    assert output_lengths(5, 64, 0.0) == [64] * 5
    lengths = output_lengths(2000, 100, 0.5)
    assert lengths == output_lengths(2000, 100, 0.5)  # the same for every mode
    assert min(lengths) >= 50 and max(lengths) <= 150 and abs(sum(lengths) / 2000 - 100) < 2


def test_eval_head_reports_engine_acceptance():
    """eval-head measures the built-in MTP layer's agreement and, through the engine, its acceptance."""
    result = subprocess.run([sys.executable, "-m", "moespec", "eval-head", "--target", "checkpoints/tiny-deepseek-v3",
                             "--builtin-mtp", "--windows", "2", "--window-len", "128", "--engine-prompts", "2",
                             "--threads", "2", "--json"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert 0.2 < report["head_agreement"] <= 1.0
    assert 1.0 < report["engine_accept_length"] <= 2.0
    assert len(report["engine_acceptance_by_position"]) == 1


def test_chat_prompts_render_the_chat_template_in_turn(tmp_path):
    """--chat-prompts: each chat rendered with the model's template, as the chat endpoint renders
    it, cycled to the count asked for; an empty file is an error that names the flag."""
    import pytest
    from moespec.bench import chat_prompts
    from moespec.models import load_tokenizer

    tokenizer = load_tokenizer("checkpoints/tokenizer")
    chats = [[{"role": "user", "content": "What is 2 + 2?"}], [{"role": "user", "content": "Name a color."}]]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"kind": "chat", "messages": m}) + "\n" for m in chats))
    prompts = chat_prompts(tokenizer, str(path), 3)
    expected = [tokenizer.encode(tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                                 add_special_tokens=False) for m in chats]
    assert prompts == [expected[0], expected[1], expected[0]] and expected[0] != expected[1]
    assert tokenizer.decode(prompts[1]).count("Name a color.") == 1
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="--chat-prompts"):
        chat_prompts(tokenizer, str(tmp_path / "empty.jsonl"), 1)


def test_sliced_turns_interleave_engines_and_count_only_their_own_steps():
    """run_sliced: engines step in turns of about `slice_s` of their own stepping; an engine's
    seconds and its requests' TTFT and TPOT count its own steps, not the others' turns."""
    import time
    from types import SimpleNamespace
    from moespec.bench import run_sliced
    from moespec.sequence import RequestMetrics

    calls = []

    class Engine:  # each request emits one token per step, for `tokens` steps
        def __init__(self, label, step_s):
            self.label, self.step_s, self.seqs = label, step_s, []

        def has_unfinished(self):
            return any(not s.is_finished for s in self.seqs)

        def step(self):
            calls.append(self.label)
            time.sleep(self.step_s)
            for s in self.seqs:
                if not s.is_finished:
                    s.metrics.num_generated_tokens += 1
                    s.metrics.first_token_time = s.metrics.first_token_time or time.monotonic()
                    s.is_finished = s.metrics.num_generated_tokens == s.tokens

    class Fake:
        def __init__(self, label, step_s):
            self.engine = Engine(label, step_s)

        def add(self, prompt, tokens):
            seq = SimpleNamespace(metrics=RequestMetrics(), is_finished=False, tokens=tokens)
            self.engine.seqs.append(seq)
            return [seq]

        def collect(self, prompt, group):
            return group

    engines = {"a": Fake("a", 0.002), "b": Fake("b", 0.004)}
    seconds, outs, clocks = {"a": 0.0, "b": 0.0}, {"a": [], "b": []}, {"a": [], "b": []}
    run_sliced(engines, ["a", "b"], [[1], [2]], [10, 20], 0.01, seconds, outs, clocks)
    assert calls.count("a") == 20 and calls.count("b") == 20
    switches = sum(x != y for x, y in zip(calls, calls[1:]))
    assert switches >= 6  # turns of ~5 steps of a and ~3 of b, not one engine to the end
    # a's 20 steps of 2 ms: its clock is its own ~40 ms, not the ~120 ms both took in turns
    assert 0.035 < seconds["a"] < 0.07 and 0.075 < seconds["b"] < 0.14, seconds
    a_short, a_long = clocks["a"]  # 10 and 20 tokens, the first after one step of a
    assert 0.001 < a_short.ttft < 0.02 and a_long.finished_time == seconds["a"]
    assert a_long.tpot == (a_long.finished_time - a_long.first_token_time) / 19 < 0.004
    assert [len(outs[label]) for label in engines] == [2, 2]


def test_bench_shift_counts_every_token_per_phase_and_what_adaptive_ran(tmp_path):
    """benchmarks/bench_shift.py: a stream of two phases through plain decoding, an adaptive and a
    static draft. Every engine emits every requested token (the steps' counts add up to the
    requests' max_tokens), each phase has a rate per mode, and the adaptive mode's choices over
    each phase add up to its decode steps there."""
    cfg = tiny_llama_config(tmp_path)
    out = tmp_path / "s.json"
    result = subprocess.run([sys.executable, "benchmarks/bench_shift.py", "--config", str(cfg),
                             "--modes", "none,draft:2,draft:2@static", "--phases", "code@0,random@1", "--batch", "2",
                             "--waves", "2", "--prompt-len", "12", "--max-tokens", "6", "--repeats", "1",
                             "--turn-seconds", "0.05", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    (repeat,) = report["repeats"]
    assert set(repeat["speedup"]) == {"draft:2", "draft:2@static"} and all(len(v) == 2 for v in repeat["speedup"].values())
    assert all(rate > 0 for rates in repeat["rates"].values() for rate in rates)
    assert all(sum(repeat["tokens"][label]) == repeat["requested_tokens"] for label in repeat["tokens"])
    (follows,) = repeat["follow"].values()  # the adaptive mode only
    for phase in follows:
        assert sum(n for _, n in phase["choices"]) == phase["steps_in_phase"]
        assert phase["steps_to_follow"] is None or 0 <= phase["steps_to_follow"] < phase["steps_in_phase"]
