"""lm-evaluation-harness (`lm-eval run --model local-completions`) against `moespec serve`,
offline, on two small local tasks this test writes: a loglikelihood multiple-choice task and a
`generate_until` task (task YAMLs over local jsonl files). lm-eval tokenizes with the served
model's own tokenizer files (tokenizer_backend=huggingface, tokenized_requests=True), or with
the server's token endpoints (tokenizer_backend=remote), and scores
each choice through /v1/completions with echo; every loglikelihood it reports equals
transformers' float32 log-probability of the same tokens (within 1e-4), and every generation
equals transformers' greedy continuation cut at the stop string. Served in one process, and
across two ranks (torchrun, experts sharded, data-parallel attention) with the remote tokenizer."""
import glob
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_server import free_port
from test_server_lifecycle import wait_exit, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "checkpoints" / "tiny-deepseek-v3"
MODEL = "tiny-deepseek-v3"  # the served model's default name: its folder
TOLERANCE = 1e-4
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

QUESTIONS = [  # a Python-ish multiple choice the tiny model was trained near (the standard library)
    {"question": "import os\nimport", "choices": ["sys", "banana", "42"], "answer": 0},
    {"question": "def main():\n    return", "choices": ["None", "main()", "]]"], "answer": 0},
    {"question": "for i in range(10):\n    print(", "choices": ["i)", "for", " else:"], "answer": 0},
    {"question": "class Foo(object):\n    def __init__(self", "choices": ["):", ", x):", " = 3"], "answer": 0},
]
PROMPTS = [{"prompt": "def add(a, b):\n", "target": "    return a + b"},
           {"prompt": "import", "target": " os"},
           {"prompt": "if __name__ == '__main__':\n", "target": "    main()"}]
MC_TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


def write_tasks(folder: Path) -> None:
    for name, rows, template in (("tiny_mc", QUESTIONS, MC_TASK), ("tiny_gen", PROMPTS, GEN_TASK)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        (folder / f"{name}.yaml").write_text(template.format(data=data))


def serve_command(ranks: int, port: int) -> list[str]:
    bin_dir = Path(sys.executable).parent
    if ranks == 1:
        return [str(bin_dir / "moespec"), "serve", "--config", "configs/tiny-deepseek-mtp.yaml", "--port", str(port)]
    return [str(bin_dir / "torchrun"), "--nproc-per-node", str(ranks), "--master-port", str(free_port()), "-m",
            "moespec", "serve", "--config", "configs/tiny-deepseek-mtp-ep2.yaml", "--port", str(port)]


def lm_eval_command(port: int, tasks: Path, output: Path, tokenizer: str) -> list[str]:
    """`tokenizer`: huggingface (the checkpoint's tokenizer files, read locally) or remote (the
    server's /tokenizer_info, /tokenize and /detokenize)."""
    local = f",tokenizer={CHECKPOINT}" if tokenizer == "huggingface" else ""
    model_args = (f"base_url=http://127.0.0.1:{port}/v1/completions,model={MODEL},tokenizer_backend={tokenizer}"
                  f"{local},tokenized_requests=True,num_concurrent=2,max_retries=1")
    return [str(Path(sys.executable).parent / "lm-eval"), "run", "--model", "local-completions",
            "--model_args", model_args, "--tasks", "tiny_mc,tiny_gen", "--include_path", str(tasks),
            "--output_path", str(output), "--log_samples", "--batch_size", "4"]


def samples(output: Path, task: str) -> list[dict]:
    (path,) = glob.glob(str(output / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(CHECKPOINT)


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split (api/model.py _encode_pair): trailing spaces go to the continuation, the
    whole text is encoded and the context's tokens cut off its front."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    return context_ids, whole[len(context_ids):]


def reference_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    context_ids, continuation_ids = encode_pair(tokenizer, context, continuation)
    ids = context_ids + continuation_ids
    with torch.no_grad():
        logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [L, V]
    return sum(logprobs[p - 1, ids[p]].item() for p in range(len(context_ids), len(ids)))


def reference_generation(model, tokenizer, prompt: str, max_tokens: int, until: str) -> str:
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True).split(until)[0]


@pytest.mark.slow
@pytest.mark.parametrize("ranks,tokenizer", [(1, "huggingface"), (2, "remote")],
                         ids=["one-process-local-tokenizer", "two-ranks-remote-tokenizer"])
def test_lm_eval_local_completions_against_moespec_serve(tmp_path, reference, ranks, tokenizer):
    write_tasks(tmp_path)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OFFLINE, PYTHONPATH=str(ROOT), HF_HOME=str(tmp_path / "hf"))
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(serve_command(ranks, port), env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                              start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", [server], timeout=240, logs=[log.name])
        run = subprocess.run(lm_eval_command(port, tmp_path, tmp_path / "out", tokenizer), env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    finally:
        server.send_signal(signal.SIGTERM)
        wait_exit(server, timeout=60)
        log.close()
    model, tokenizer = reference
    scored = samples(tmp_path / "out", "tiny_mc")
    assert len(scored) == len(QUESTIONS)
    worst = 0.0
    for sample in scored:
        assert len(sample["resps"]) == len(sample["doc"]["choices"])
        for args, resp in zip(sample["arguments"].values(), sample["resps"]):
            loglikelihood = float(resp[0][0])
            expected = reference_loglikelihood(model, tokenizer, args["arg_0"], args["arg_1"])
            assert abs(loglikelihood - expected) < TOLERANCE, (args, loglikelihood, expected)
            worst = max(worst, abs(loglikelihood - expected))
    print(f"lm-eval loglikelihoods ({ranks} rank(s)): largest |moespec - transformers| = {worst:.2e}")
    generated = samples(tmp_path / "out", "tiny_gen")
    assert len(generated) == len(PROMPTS)
    for sample in generated:
        text = sample["resps"][0][0]
        assert text == reference_generation(model, tokenizer, sample["doc"]["prompt"], 12, "\n\n"), sample
