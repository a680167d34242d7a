#!/usr/bin/env bash
# Held-out accuracy against wall-clock time, astraflow against TRL's GRPOTrainer, on one GPU, in one
# command (docs/benchmarks.md, "GPU: held-out accuracy against TRL"):
#   1. a random-init Qwen3 "small" (`astraflow model init`),
#   2. pre-trained from scratch by `astraflow sft` on generated 3-digit sums until it answers SFT_TARGET
#      of a validation set (bench/heldout.py pretrain: one round of SFT_ROWS rows at a time),
#   3. `astraflow bench trl recipes/gpu/arith.toml --heldout N`: RL through `astraflow up`, then the same
#      model, prompts, reward and settings through TRL's GRPOTrainer, each saving weights every EVERY
#      steps; one evaluator scores every checkpoint of both on held-out sums (greedy, exact answer).
# It prints the table (and writes everything under OUT). The first run took 159 s on an H100.
#
#   scripts/gpu_trl.sh [OUT]             the GPU run (default OUT: runs/gpu-trl)
#   SMOKE=1 scripts/gpu_trl.sh [OUT]     the same path on a CPU with tiny sizes (a minute or two)
#   scripts/gpu_trl.sh fetch [DIR]       here, with PyPI: TRL's wheels (and the packages it needs that a
#                                        GPU image with torch and transformers usually lacks) into DIR
#                                        (default .gpu/whl), for a machine without a network
#
# Needs `python3 -m astraflow` importable with its entry points (an installed astraflow, or its wheel)
# and TRL: WHEELS=DIR installs DIR/*.whl into /tmp/site first (pip --no-index) and takes TRL from there;
# TRL_PATH=DIR names a pip --target directory that holds trl; otherwise `bench trl` installs it (network).
# Sizes: PRESET, LENGTH, CORPUS, SFT_TARGET, SFT_EPOCHS (rounds), SFT_ROWS (rows a round), SFT_LR, STEPS,
# EVERY, HELDOUT, DEVICE; EXTRA_SET
# adds `--set` overrides for both sides (space-separated a.b=v items).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
TRL_WHEELS="trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19"

if [ "${1:-}" = "fetch" ]; then
    dir=${2:-.gpu/whl}
    mkdir -p "$dir"
    # pure-Python wheels: any CPU, Python 3.12 as on the GPU image
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$dir" $TRL_WHEELS
    ls "$dir" | grep -E '^(trl|datasets|dill|multiprocess)-'
    exit 0
fi

OUT=${1:-runs/gpu-trl}
if [ "${SMOKE:-0}" = "1" ]; then
    : "${PRESET:=tiny}" "${LENGTH:=2}" "${CORPUS:=400}" "${SFT_TARGET:=0}" "${SFT_EPOCHS:=1}" "${SFT_LR:=3e-3}"
    : "${STEPS:=4}" "${EVERY:=2}" "${HELDOUT:=16}" "${DEVICE:=cpu}" "${SFT_ROWS:=200}"
    : "${EXTRA_SET:=policy.group_size=4 policy.batch_prompts=4 rollout.slots=4}"
else
    : "${PRESET:=small}" "${LENGTH:=3}" "${CORPUS:=20000}" "${SFT_TARGET:=0.3}" "${SFT_EPOCHS:=40}" "${SFT_LR:=1e-3}"
    : "${SFT_ROWS:=2000}"
    : "${STEPS:=50}" "${EVERY:=5}" "${HELDOUT:=512}" "${DEVICE:=cuda}" "${EXTRA_SET:=}"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

if [ -n "${WHEELS:-}" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
    export PYTHONPATH=$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    : "${TRL_PATH:=/tmp/site}"
fi
trl_arg=()
[ -n "${TRL_PATH:-}" ] && trl_arg=(--trl-path "$TRL_PATH")
sets=()
for s in $EXTRA_SET; do sets+=(--set "$s"); done

rm -rf "$OUT" && mkdir -p "$OUT"
t0=$(date +%s)
if [ "$DEVICE" != "cpu" ]; then
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
fi
$PY -m astraflow model init --arch qwen3 --preset "$PRESET" --out "$OUT/base" > /dev/null
$PY -m astraflow.bench.heldout corpus --task add --length "$LENGTH" --rows "$CORPUS" > "$OUT/corpus.jsonl"
echo "== pre-training from scratch: astraflow sft on $CORPUS generated sums ($PRESET, $DEVICE)"
$PY -m astraflow.bench.heldout pretrain --model "$OUT/base" --data "$OUT/corpus.jsonl" --out "$OUT/sft" \
    --task add --length "$LENGTH" --target "$SFT_TARGET" --max-epochs "$SFT_EPOCHS" --lr "$SFT_LR" \
    --rows-per-round "$SFT_ROWS" --device "$DEVICE" 2>&1 | grep -E '^sft (epoch|round)' | tee "$OUT/sft.log"
t1=$(date +%s)
echo "== RL: astraflow up, then TRL GRPOTrainer ($STEPS steps each), held-out accuracy of every checkpoint"
$PY -m astraflow bench trl recipes/gpu/arith.toml --out "$OUT/bench" --steps "$STEPS" --device "$DEVICE" \
    --heldout "$HELDOUT" --checkpoint-every "$EVERY" "${trl_arg[@]}" \
    --set "policy.model=\"$OUT/sft\"" --set "workflow.options.length=$LENGTH" "${sets[@]}" \
    --timeout-s 600 2>&1 | tee "$OUT/bench.log"
t2=$(date +%s)
echo "model + corpus + SFT $((t1 - t0)) s; both RL runs and the evaluation $((t2 - t1)) s; all $((t2 - t0)) s"
