#!/usr/bin/env bash
# Speculative decoding on a CUDA GPU: the GPU test suite first (greedy identity of every mode
# against no speculation, FlashInfer, the exchange and DeepEP against CPU), then captured steps
# against eager and `moespec bench` side by side. Results go to ${OUT:-docs/bench/gpu}, with this script's own log.
# Uses the machine's own python3 with torch (CUDA), transformers, tokenizers, safetensors, pyyaml.
#
# Sections run in order of what matters most, each under a time limit, and the script stops
# starting new ones after BUDGET_S seconds (default 450; every section ends within it, so the
# script stays under 8 minutes): a lent GPU is timed, start-up included.
# A section that fails or runs out of time is reported and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/bench/gpu}
BUDGET_S=${BUDGET_S:-450}
mkdir -p "$OUT"
PY=${PY:-python3}
exec > >(tee -a "$OUT/run_gpu.log") 2>&1

section() {  # section NAME LIMIT_S COMMAND...
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  if (( SECONDS + 20 > BUDGET_S )); then
    echo "== $(date +%T) $name: skipped (budget of ${BUDGET_S}s spent)"
    return
  fi
  (( limit > BUDGET_S - SECONDS )) && limit=$(( BUDGET_S - SECONDS ))
  echo "== $(date +%T) $name (limit ${limit}s)"
  timeout --signal=INT --kill-after=10 "$limit" "$@"
  local rc=$?
  echo "== $(date +%T) $name: exit $rc after $(( SECONDS - start ))s"
}

$PY -c "import moespec.models" 2>/dev/null || $PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
$PY -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"
BENCH=("$PY" -m moespec bench --set model.device=cuda)

# First, the GPU suite (FlashInfer against torch attention, the fixed-capacity exchange and DeepEP against
# CPU, greedy identity of every speculation mode, captured and compiled steps, the CUDA FP8 path)
section "pytest -m gpu" 200 bash -c "$PY -m pytest -q -s -m gpu tests/test_gpu.py tests/test_fp8.py 2>&1 \
    | tee '$OUT/pytest-gpu.log'"
# Captured steps (model.cuda_graph: CUDA graphs) against eager, side by side, without and with speculation
section "graph tiny-deepseek-v3" 90 "${BENCH[@]}" --config configs/tiny-deepseek-mtp.yaml --modes none,mtp:2 \
    --batch-sizes 1,16 --cuda-graph both --repeats 2 --out "$OUT/graph-tiny-deepseek-v3.json"
section "graph tiny-llama" 90 "${BENCH[@]}" --config configs/tiny-llama-draft.yaml --modes none,draft:2 \
    --batch-sizes 1,16 --cuda-graph both --repeats 2 --out "$OUT/graph-tiny-llama.json"
# The same on FlashInfer's CUDA-graph wrappers (bfloat16: FlashInfer has no float32 kernels)
if $PY -c "import flashinfer" 2>/dev/null; then
  section "graph flashinfer tiny-llama" 60 "${BENCH[@]}" --config configs/tiny-llama-draft.yaml \
      --set model.dtype=bfloat16 --set model.attention_backend=flashinfer --modes none,draft:2 --batch-sizes 1,16 \
      --cuda-graph both --repeats 2 --out "$OUT/graph-flashinfer-tiny-llama.json"
fi
section "spec tiny-deepseek-v3" 60 "${BENCH[@]}" --config configs/tiny-deepseek-mtp.yaml \
    --modes none,mtp:1,mtp:2,mtp:3 --batch-sizes 1,4,16 --out "$OUT/spec-tiny-deepseek-v3.json"
section "spec tiny-llama" 60 "${BENCH[@]}" --config configs/tiny-llama-draft.yaml \
    --modes none,draft:2,draft:4,mtp:1,mtp:2,mtp:3 --set speculation.mtp_head=checkpoints/tiny-llama-mtp-head \
    --batch-sizes 1,4,16 --out "$OUT/spec-tiny-llama.json"
# Compiled static steps (model.compile) and overlap scheduling against eager, side by side
section "compile tiny-deepseek-v3" 120 "${BENCH[@]}" --config configs/tiny-deepseek-mtp.yaml --modes none,mtp:2 \
    --batch-sizes 1,16 --compile both --overlap both --repeats 2 --out "$OUT/compile-tiny-deepseek-v3.json"
echo "== $(date +%T) done in ${SECONDS}s"
