#!/usr/bin/env bash
# Speculative decoding on a CUDA GPU: the GPU test suite (which includes greedy identity of every
# mode against no speculation), then `moespec bench` side by side. Results go to ${OUT:-docs/bench/gpu}.
# Uses the machine's own python3 with torch (CUDA), transformers, tokenizers, safetensors, pyyaml.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/bench/gpu}
mkdir -p "$OUT"
PY=${PY:-python3}
$PY -c "import moespec.models" 2>/dev/null || $PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
$PY -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"
# The GPU suite (FlashInfer against torch attention, the fixed-capacity exchange and DeepEP against
# CPU, greedy identity of every speculation mode, the CUDA FP8 path), output kept
$PY -m pytest -q -s -m gpu tests/test_gpu.py tests/test_fp8.py 2>&1 | tee "$OUT/pytest-gpu.log" \
    || echo "GPU tests failed: see $OUT/pytest-gpu.log"
$PY -m moespec bench --config configs/tiny-deepseek-mtp.yaml --set model.device=cuda --modes none,mtp:1,mtp:2,mtp:3 \
    --batch-sizes 1,4,16 --out "$OUT/spec-tiny-deepseek-v3.json"
$PY -m moespec bench --config configs/tiny-llama-draft.yaml --set model.device=cuda \
    --modes none,draft:2,draft:4,mtp:1,mtp:2,mtp:3 --set speculation.mtp_head=checkpoints/tiny-llama-mtp-head \
    --batch-sizes 1,4,16 --out "$OUT/spec-tiny-llama.json"
# Captured steps (model.cuda_graph: CUDA graphs) against eager, side by side, without and with speculation
$PY -m moespec bench --config configs/tiny-deepseek-mtp.yaml --set model.device=cuda --modes none,mtp:2 \
    --batch-sizes 1,16 --cuda-graph both --repeats 2 --out "$OUT/graph-tiny-deepseek-v3.json"
$PY -m moespec bench --config configs/tiny-llama-draft.yaml --set model.device=cuda --modes none,draft:2 \
    --batch-sizes 1,16 --cuda-graph both --repeats 2 --out "$OUT/graph-tiny-llama.json"
# The same on FlashInfer's CUDA-graph wrappers (bfloat16: FlashInfer has no float32 kernels)
if $PY -c "import flashinfer" 2>/dev/null; then
  $PY -m moespec bench --config configs/tiny-llama-draft.yaml --set model.device=cuda --set model.dtype=bfloat16 \
      --set model.attention_backend=flashinfer --modes none,draft:2 --batch-sizes 1,16 --cuda-graph both --repeats 2 \
      --out "$OUT/graph-flashinfer-tiny-llama.json"
fi
# Compiled static steps (model.compile) and overlap scheduling against eager, side by side
$PY -m moespec bench --config configs/tiny-deepseek-mtp.yaml --set model.device=cuda --modes none,mtp:2 \
    --batch-sizes 1,16 --compile both --overlap both --repeats 2 --out "$OUT/compile-tiny-deepseek-v3.json"
