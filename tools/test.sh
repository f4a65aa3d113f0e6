#!/usr/bin/env bash
# Install (first use) and run the tests. Two tiers (docs/testing.md says what each proves):
#   tools/test.sh          everything: the unit tests and the tests that start real vLLM engines,
#                          Megatron, mpiexec worlds, jobs and the local Slurm clusters (what CI runs)
#   tools/test.sh --fast   only the tests that start no engine, world, job or cluster (-m "not slow")
# Both run on TEST_WORKERS pytest-xdist workers (default 2; 0 = one process): each test module whole
# on one worker, each Slurm cluster's modules together (tests/conftest.py). Other arguments go to
# pytest as they are (e.g. tools/test.sh -k staleness; tools/test.sh --fast tests/algo).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
tools/install.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$root/.cache/vllm}
export AREAL_HPC_CACHE=${AREAL_HPC_CACHE:-$root/.cache/areal_hpc}    # the start-up checks' passes (checked.py)
workers=${TEST_WORKERS:-2}
xdist=()
[ "$workers" -gt 0 ] && xdist=(-n "$workers" --dist loadscope --no-loadscope-reorder)
fast=()
if [ "${1:-}" = "--fast" ]; then shift; fast=(-m "not slow"); fi
if [ $# -gt 0 ] && [ ${#fast[@]} -eq 0 ]; then exec .venv/bin/python -m pytest "$@"; fi
.venv/bin/ruff check areal_hpc tools tests examples     # pyflakes: unused / undefined names (pyproject.toml)
if [ $# -gt 0 ]; then exec .venv/bin/python -m pytest "${xdist[@]}" "${fast[@]}" "$@"; fi
exec .venv/bin/python -m pytest -q --durations=60 "${xdist[@]}" "${fast[@]}" \
  tests/config tests/test_imports.py tests/test_cpus.py tests/test_random_models.py tests/test_tiny_native.py tests/test_stuck.py tests/test_versions.py tests/test_determinism.py tests/test_slurm_job.py tests/test_progress.py tests/plan tests/data tests/reward tests/algo tests/storage tests/test_audit.py tests/test_audit_episodes.py tests/test_preflight.py tests/test_checked.py tests/test_main.py tests/env \
  tests/analysis tests/transport \
  tests/rollout tests/train tests/launch tests/e2e
