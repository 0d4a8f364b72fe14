#!/usr/bin/env bash
# Speculative decoding on a CUDA GPU with the torch attention backend: greedy identity of every
# mode against no speculation, then `moespec bench` side by side. Results go to ${OUT:-docs/bench/gpu}.
# Uses the machine's own python3 with torch (CUDA), transformers, tokenizers, safetensors, pyyaml.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/bench/gpu}
mkdir -p "$OUT"
PY=${PY:-python3}
$PY -c "import moespec.models" 2>/dev/null || $PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
$PY -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"
# GPU-only tests (the CUDA FP8 path against the CPU reference, ...), output kept
$PY -m pytest -q -s -m gpu tests/test_fp8.py 2>&1 | tee "$OUT/pytest-gpu.log" || echo "GPU tests failed: see $OUT/pytest-gpu.log"
$PY - <<'PY'
from moespec import LLM, SamplingParams
from moespec.bench import heldout_prompts

greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
cases = [("checkpoints/tiny-deepseek-v3", {"mode": "mtp", "num_speculative_tokens": 1}),
         ("checkpoints/tiny-deepseek-v3", {"mode": "mtp", "num_speculative_tokens": 3}),
         ("checkpoints/tiny-llama", {"mode": "draft", "draft_model": "checkpoints/tiny-llama-draft",
                                     "num_speculative_tokens": 4}),
         ("checkpoints/tiny-llama", {"mode": "mtp", "mtp_head": "checkpoints/tiny-llama-mtp-head",
                                     "num_speculative_tokens": 2})]
reference = {}
for model, spec in cases:
    if model not in reference:
        llm = LLM(model=model, device="cuda")
        prompts = heldout_prompts(llm.get_tokenizer(), 6, 64)
        reference[model] = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(model=model, device="cuda", speculation={**spec, "adaptive": False})
    got = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    same = sum(a == b for a, b in zip(got, reference[model]))
    print(f"greedy identity on cuda: {model} {spec['mode']} k={spec['num_speculative_tokens']}: "
          f"{same}/{len(got)} identical, accept length {llm.engine.spec_stats.accept_length:.2f}")
PY
$PY -m moespec bench --config configs/tiny-deepseek-mtp.yaml --set model.device=cuda --modes none,mtp:1,mtp:2,mtp:3 \
    --batch-sizes 1,4,16 --out "$OUT/spec-tiny-deepseek-v3.json"
$PY -m moespec bench --config configs/tiny-llama-draft.yaml --set model.device=cuda \
    --modes none,draft:2,draft:4,mtp:1,mtp:2,mtp:3 --set speculation.mtp_head=checkpoints/tiny-llama-mtp-head \
    --batch-sizes 1,4,16 --out "$OUT/spec-tiny-llama.json"
