#!/usr/bin/env bash
# CI step for the verifiers workflow: install verifiers 0.3 into the project's virtualenv without the
# ~60 packages its metadata asks for (scripts/verifiers-min.txt: the ~20 that its import, the classic
# environment API and `datasets` need on top of the `dev` extra), then check that it imports. .ci/run
# calls it before `make test` with ASTRAFLOW_REQUIRE_VERIFIERS=1, so the verifiers smoke
# (tests/e2e/test_workload_smoke.py, marker `verifiers`) runs in the suite instead of skipping.
# Run after `make install`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
BIN=$VENV/bin
export HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

start=$(date +%s)
"$BIN/pip" install -q --no-deps -r scripts/verifiers-min.txt
echo "verifiers (lean set) installed in $(($(date +%s) - start)) s"
"$BIN/python" - <<'PY'
import sys

sys.path.insert(0, "recipes/verifiers")
import verifiers
import vf_arith
from verifiers.clients import OpenAIChatCompletionsClient, OpenAICompletionsClient  # noqa: F401

env = vf_arith.load_environment(num_examples=2)
assert len(env.get_dataset(n=2, seed=0)) == 2
print("verifiers", verifiers.__version__, "imports, and the smoke environment loads")
PY
