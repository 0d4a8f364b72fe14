#!/usr/bin/env bash
# Reproduces docs/benchmarks.md: every measurement side by side in one process per model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
THREADS=${THREADS:-2}
mkdir -p docs/bench
$PY benchmarks/bench_step_cost.py --target checkpoints/tiny-llama --draft checkpoints/tiny-llama-draft \
    --head checkpoints/tiny-llama-mtp-head --threads "$THREADS" --out docs/bench/step-cost-tiny-llama.json
$PY benchmarks/bench_step_cost.py --target checkpoints/tiny-deepseek-v3 --builtin-mtp --threads "$THREADS" \
    --out docs/bench/step-cost-tiny-deepseek-v3.json
$PY benchmarks/bench_engine.py --model checkpoints/tiny-deepseek-v3 --batch-sizes 1 16 --threads "$THREADS" \
    --out docs/bench/engine-tiny-deepseek-v3.json
$PY benchmarks/bench_engine.py --model checkpoints/tiny-llama --batch-sizes 1 16 --threads "$THREADS" \
    --out docs/bench/engine-tiny-llama.json
$PY -m moespec bench --config configs/tiny-deepseek-mtp.yaml --modes none,mtp:1,mtp:2,mtp:3 \
    --batch-sizes 1,4,16 --threads "$THREADS" --out docs/bench/spec-tiny-deepseek-v3.json
$PY -m moespec bench --config configs/tiny-llama-draft.yaml --modes none,draft:2,draft:4,mtp:1,mtp:2,mtp:3 \
    --set speculation.mtp_head=checkpoints/tiny-llama-mtp-head --batch-sizes 1,4,16 --threads "$THREADS" \
    --hf-assisted --out docs/bench/spec-tiny-llama.json
$PY -m moespec bench --config configs/tiny-deepseek-mtp.yaml --modes none,mtp:1 --adaptive on --max-tokens 128 \
    --batch-sizes 1,4,16,32 --threads "$THREADS" --out docs/bench/spec-tiny-deepseek-v3-adaptive.json
$PY -m moespec bench --config configs/tiny-llama-draft.yaml --modes none,draft:4 --adaptive on --max-tokens 128 \
    --batch-sizes 1,4,16,32 --threads "$THREADS" --out docs/bench/spec-tiny-llama-adaptive.json
