#!/usr/bin/env bash
# The decode-loop and weight-apply choices of the GPU recipes on one two-GPU machine, in one call
# (docs/benchmarks.md, "The overlapped decode loop and kv_on_update on 2 x H100"; about 8 minutes):
#   1. the GPU-only tests of the engine and the weight paths (overlapped loop, device delta encoder);
#   2. astraflow bench e2e recipes/gpu/single.toml, RaaS on GPU 0 and trainer on GPU 1, as shipped and
#      with the settings before them (sync loop, KV recompute, 16 tasks) in the same call;
#   3. astraflow bench rollout at batch 256, both decode loops side by side;
#   4. astraflow bench delta (the device delta encoder on a real run) and bench pipeline of the
#      two-policy recipe.
# Needs `python3 -m astraflow` importable with its entry points and two GPUs (set GPUS="0 0" for one).
# Everything lands under $OUT (default runs/gpu-e2e-loops); the numbers are printed as they come.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu-e2e-loops}
MODEL=${MODEL:-models/qwen3-0.6b-shape}
read -r RAAS_GPU TRAINER_GPU <<< "${GPUS:-0 1}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ ! -f "$MODEL/config.json" ]; then
    "$PY" -m astraflow model init --arch qwen3 --preset 0.6b-shape --out "$MODEL" > "$OUT/init.log" 2>&1 \
        || { echo "model init failed:"; tail -5 "$OUT/init.log"; exit 1; }
fi
run() { # run NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    echo "== $name"
    timeout "$secs" "$@" > "$OUT/$name.txt" 2> "$OUT/$name.err"
    echo "rc $?"
    cat "$OUT/$name.txt"
}
stamp=$(date +%s)
run pytest 240 "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_engine_gpu.py tests/unit/test_weights_gpu.py
E2E=("$PY" -m astraflow bench e2e recipes/gpu/single.toml --set run.steps=20 --timeout-s 110
    --set "policy.0.trainer_gpus=\"$TRAINER_GPU\"" --set "rollout.gpus=\"$RAAS_GPU\"")
run e2e_shipped 120 "${E2E[@]}" --out "$OUT/e2e-shipped-$stamp"
run e2e_before 120 "${E2E[@]}" --out "$OUT/e2e-before-$stamp" --set 'policy.0.engine_options.decode_loop="sync"' \
    --set 'policy.0.engine_options.kv_on_update="recompute"' --set rollout.slots=16
run rollout 120 "$PY" -m astraflow bench rollout --model "$MODEL" --batch 256 --prompt-len 128 --new-tokens 128 \
    --repeats 2 --dtype bfloat16 --device cuda --loop both
run delta 120 "$PY" -m astraflow bench delta recipes/gpu/single.toml --set run.steps=10 --timeout-s 110 \
    --set "rollout.gpus=\"$RAAS_GPU\"" --set "policy.0.trainer_gpus=\"$TRAINER_GPU\"" --out "$OUT/delta-$stamp"
run pipeline 200 "$PY" -m astraflow bench pipeline recipes/gpu/two-policy.toml --timeout-s 95
