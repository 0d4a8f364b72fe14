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
$PY benchmarks/bench_linear.py --threads "$THREADS" --out docs/bench/linear.json
# packed linears (model.pack_linears) on and off, eager and compiled
for m in tiny-llama tiny-deepseek-v3; do
    $PY benchmarks/bench_engine.py --model checkpoints/$m --batch-sizes 1 16 --compile --unpacked --repeats 5 \
        --threads "$THREADS" --out docs/bench/engine-$m-packed.json
    $PY benchmarks/bench_engine.py --model checkpoints/$m --dtype bfloat16 --batch-sizes 1 16 --unpacked --repeats 3 \
        --threads "$THREADS" --out docs/bench/engine-$m-bf16-packed.json
done
$PY -m moespec bench --config configs/tiny-deepseek-mtp.yaml --modes none,mtp:1,mtp:2,mtp:3 \
    --batch-sizes 1,4,16 --threads "$THREADS" --out docs/bench/spec-tiny-deepseek-v3.json
$PY -m moespec bench --config configs/tiny-llama-draft.yaml --modes none,draft:2,draft:3,draft:4,mtp:1,mtp:2,mtp:3 \
    --set speculation.mtp_head=checkpoints/tiny-llama-mtp-head --batch-sizes 1,4,16 --threads "$THREADS" \
    --hf-assisted --out docs/bench/spec-tiny-llama.json
# batch 1, 128 new tokens, seven repeats (the issue's single-stream comparison)
$PY -m moespec bench --config configs/tiny-llama-draft.yaml --modes none,draft:3,draft:4,mtp:3 \
    --set speculation.mtp_head=checkpoints/tiny-llama-mtp-head --batch-sizes 1 --max-tokens 128 --repeats 7 \
    --threads "$THREADS" --hf-assisted --out docs/bench/spec-tiny-llama-batch1-128.json
$PY -m moespec bench --config configs/tiny-deepseek-mtp.yaml --modes none,mtp:1,mtp:2,mtp:3 --batch-sizes 1 \
    --max-tokens 128 --repeats 7 --threads "$THREADS" --out docs/bench/spec-tiny-deepseek-v3-batch1-128.json
# adaptive speculation (the default configs' setting): serving-like, output lengths 64-192
$PY -m moespec bench --config configs/tiny-deepseek-mtp.yaml --modes none,mtp:2,mtp:3 --adaptive on --max-tokens 128 \
    --max-tokens-spread 0.5 --batch-sizes 1,4,16,32 --threads "$THREADS" --out docs/bench/spec-tiny-deepseek-v3-adaptive.json
$PY -m moespec bench --config configs/tiny-llama-draft.yaml --modes none,draft:4 --adaptive on --max-tokens 128 \
    --max-tokens-spread 0.5 --batch-sizes 1,4,16,32 --threads "$THREADS" --out docs/bench/spec-tiny-llama-adaptive.json
# the same with every output 128 tokens long: without speculation the requests stay in lockstep
$PY -m moespec bench --config configs/tiny-deepseek-mtp.yaml --modes none,mtp:2,mtp:3 --adaptive on --max-tokens 128 \
    --batch-sizes 1,4,16,32 --threads "$THREADS" --out docs/bench/spec-tiny-deepseek-v3-adaptive-fixed-length.json
# draft trees against chains (docs/benchmarks.md, "Draft trees against chains")
$PY -m moespec bench --config configs/tiny-deepseek-mtp.yaml \
    --modes none,mtp:1,mtp:2,mtp:3,mtp-tree:2x3x6,mtp-tree:4x2x8,mtp-tree:4x3x8 --batch-sizes 1,4,16 \
    --threads "$THREADS" --out docs/bench/tree-tiny-deepseek-v3.json
$PY -m moespec bench --config configs/tiny-llama-draft.yaml \
    --modes none,draft:2,draft:4,draft:6,draft-tree:2x4x8,draft-tree:4x4x8,draft-tree:2x6x10 --batch-sizes 1,4,16 \
    --threads "$THREADS" --out docs/bench/tree-tiny-llama.json
$PY -m moespec bench --config configs/tiny-deepseek-mtp.yaml --modes none,mtp:3,mtp:5,mtp-tree:4x3x8,mtp-tree:4x5x16 \
    --batch-sizes 1 --threads "$THREADS" --out docs/bench/tree-deep-tiny-deepseek-v3.json
$PY -m moespec bench --config configs/tiny-llama-draft.yaml --modes none,draft:4,draft:6,draft-tree:2x6x10,draft-tree:4x6x16 \
    --batch-sizes 1 --threads "$THREADS" --out docs/bench/tree-deep-tiny-llama.json
$PY -m moespec bench --config configs/tiny-deepseek-mtp.yaml --modes none,mtp:1,mtp:2,mtp:3,mtp-tree:2x3x6,mtp-tree:auto \
    --batch-sizes 1,4,16 --threads "$THREADS" --out docs/bench/tree-auto-tiny-deepseek-v3.json
# overlap scheduling under speculation, everything on (compiled static steps)
$PY -m moespec bench --config configs/tiny-deepseek-mtp.yaml --modes none,mtp:1,mtp:2 --batch-sizes 1,16 --compile on \
    --overlap both --repeats 3 --threads "$THREADS" --out docs/bench/spec-overlap-tiny-deepseek-v3.json
$PY -m moespec bench --config configs/tiny-llama-draft.yaml --modes none,draft:2,draft:3 --batch-sizes 1,16 --compile on \
    --overlap both --repeats 3 --threads "$THREADS" --out docs/bench/spec-overlap-tiny-llama.json
# seeded requests (exact match with the target's keyed draw) against rejection sampling
$PY benchmarks/bench_seeded_acceptance.py --threads "$THREADS" --out docs/bench/seeded-acceptance.json
# what a seeded row's keyed draw costs per call (rows x vocabulary)
$PY benchmarks/bench_keyed_noise.py --threads "$THREADS" --out docs/bench/keyed-noise.json
# structured outputs: a JSON schema's cost per step, constrained against unconstrained
$PY benchmarks/bench_structured.py --threads "$THREADS" --repeats 9 --out docs/bench/structured.json
# where a step's time goes
PROFILE="$PY benchmarks/profile_spec_step.py --threads $THREADS"
$PROFILE --model checkpoints/tiny-llama --out docs/bench/profile-tiny-llama-none.json
$PROFILE --model checkpoints/tiny-llama --out docs/bench/profile-tiny-llama-draft3.json \
    --speculation '{"mode": "draft", "draft_model": "checkpoints/tiny-llama-draft", "num_speculative_tokens": 3}'
$PROFILE --model checkpoints/tiny-llama --out docs/bench/profile-tiny-llama-draft4.json \
    --speculation '{"mode": "draft", "draft_model": "checkpoints/tiny-llama-draft", "num_speculative_tokens": 4}'
$PROFILE --model checkpoints/tiny-llama --out docs/bench/profile-tiny-llama-mtp3.json \
    --speculation '{"mode": "mtp", "mtp_head": "checkpoints/tiny-llama-mtp-head", "num_speculative_tokens": 3}'
$PROFILE --model checkpoints/tiny-deepseek-v3 --out docs/bench/profile-tiny-deepseek-v3-none.json
$PROFILE --model checkpoints/tiny-deepseek-v3 --out docs/bench/profile-tiny-deepseek-v3-mtp1.json \
    --speculation '{"mode": "mtp", "num_speculative_tokens": 1}'
$PROFILE --model checkpoints/tiny-deepseek-v3 --out docs/bench/profile-tiny-deepseek-v3-mtp2.json \
    --speculation '{"mode": "mtp", "num_speculative_tokens": 2}'
$PROFILE --model checkpoints/tiny-deepseek-v3 --out docs/bench/profile-tiny-deepseek-v3-mtp3.json \
    --speculation '{"mode": "mtp", "num_speculative_tokens": 3}'
$PROFILE --model checkpoints/tiny-deepseek-v3 --out docs/bench/profile-tiny-deepseek-v3-tree2x3x6.json \
    --speculation '{"mode": "mtp", "num_speculative_tokens": 3, "tree": {"top_k": 2, "depth": 3, "num_draft_tokens": 6}}'
# expert parallelism over 2 local ranks: data-parallel against replicated attention
$PY benchmarks/bench_dp_attention.py --requests 32 --max-tokens 48 --repeats 6 --spec none,mtp \
    --out docs/bench/dp-attention.json
# ... and serial against overlap scheduling (scheduler.overlap) across the ranks
$PY benchmarks/bench_dp_attention.py --compare overlap --requests 32 --max-tokens 48 --repeats 4 \
    --spec none,mtp --out docs/bench/ep-overlap-scheduling.json
# ... and eager against compiled steps (model.compile) across the ranks
$PY benchmarks/bench_dp_attention.py --compare compile --requests 32 --max-tokens 48 --repeats 3 \
    --spec none,mtp --out docs/bench/ep-compile.json
# ... and microbatching within each MoE layer against two-batch overlap (parallel.two_batch_overlap)
$PY benchmarks/bench_dp_attention.py --compare two_batch --requests 32 --max-tokens 48 --repeats 4 \
    --spec none,mtp --out docs/bench/ep-two-batch.json
# the verify step's communication hidden by microbatching and by two-batch overlap, over a modelled link
$PY benchmarks/bench_ep_overlap.py --steps 30 --out docs/bench/ep-overlap.json
