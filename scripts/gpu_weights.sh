#!/usr/bin/env bash
# The weight paths and the one-GPU run on a CUDA machine, in one call (about 3 minutes on one H100):
#   1. astraflow bench weights on cuda for the Qwen3-0.6B shape (same GPU by CUDA IPC, GPU to GPU when
#      there are two, gloo broadcast, the ZeroMQ pull with and without CURVE over 1 and over
#      min(4, cores) connections beside the link measured in as many streams (kernel TCP, raw ZeroMQ,
#      raw CURVE), the blob digest's hashing rate, the trainer's publish and the receiver's apply);
#   2. astraflow bench e2e recipes/gpu/single.toml with every role on GPU 0 (samples/s, weight sync a
#      step = publish + fetch + load + apply, the version's lag to decoding, busy fractions).
# Needs the CLI importable by $PYTHON (an install, or PYTHONPATH=src with its dependencies) and a GPU.
# Everything lands under $OUT (default runs/gpu-weights); the numbers are printed as they come.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu-weights}
MODEL=${MODEL:-models/qwen3-0.6b-shape}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
start=$(date +%s)
if [ ! -f "$MODEL/config.json" ]; then
    "$PY" -m astraflow model init --arch qwen3 --preset 0.6b-shape --out "$MODEL" > "$OUT/init.log" 2>&1 \
        || { echo "model init failed:"; tail -5 "$OUT/init.log"; exit 1; }
fi
echo "model ready after $(($(date +%s) - start)) s"

echo "== astraflow bench weights --model $MODEL --device cuda --repeats 3"
timeout 300 "$PY" -m astraflow bench weights --model "$MODEL" --device cuda --repeats 3 --json \
    > "$OUT/weights.json" 2> "$OUT/weights.err"
echo "rc $? after $(($(date +%s) - start)) s"
"$PY" -c "import json; from astraflow.bench.weights import format_lines; print('\n'.join(format_lines(json.load(open('$OUT/weights.json')))))" \
    || tail -20 "$OUT/weights.err"

echo "== astraflow bench e2e recipes/gpu/single.toml (every role on GPU 0)"
timeout 130 "$PY" -m astraflow bench e2e recipes/gpu/single.toml --out "$OUT/e2e" --timeout-s 110 \
    --set 'policy.0.trainer_gpus="0"' > "$OUT/e2e.txt" 2> "$OUT/e2e.err"
echo "rc $? after $(($(date +%s) - start)) s"
cat "$OUT/e2e.txt"
grep -v -i warning "$OUT/e2e.err" | tail -25
