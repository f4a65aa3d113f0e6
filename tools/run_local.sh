#!/usr/bin/env bash
# Run the whole job on one machine with mpiexec: tools/run_local.sh CONFIG.yaml [key=value ...]
# Creates the environment (.venv) on first use and, for the tiny recipe, builds the tiny model.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
tools/install.sh
exec .venv/bin/python -m areal_hpc.launch.local "$@"
