#!/usr/bin/env bash
# Install (first use) and run the test suite: fast unit tests first, then the tests that start real
# vLLM engines, Megatron, mpiexec. Extra arguments go to pytest (e.g. tools/test.sh -k staleness).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
tools/install.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$root/.cache/vllm}
if [ $# -gt 0 ]; then exec .venv/bin/python -m pytest "$@"; fi
.venv/bin/ruff check areal_hpc tools tests examples     # pyflakes: unused / undefined names (pyproject.toml)
exec .venv/bin/python -m pytest -q --durations=60 \
  tests/config tests/test_imports.py tests/test_cpus.py tests/test_random_models.py tests/test_versions.py tests/test_determinism.py tests/test_slurm_job.py tests/test_progress.py tests/plan tests/data tests/reward tests/algo tests/storage tests/test_audit.py tests/test_audit_episodes.py tests/test_preflight.py tests/test_main.py tests/env \
  tests/analysis tests/transport \
  tests/rollout tests/train tests/launch tests/e2e
