#!/usr/bin/env bash
# The prepared GPU check (tools/gpu_check.py) on a machine without network, from the repo root:
#
#   bash tools/gpu_check.sh --fetch-wheels     # HERE (network to PyPI): fill tools/gpu_wheels/
#   bash tools/gpu_check.sh [--quick] [...]    # THERE (a GPU, torch with CUDA already installed)
#
# --fetch-wheels downloads, for CPython 3.12 on manylinux x86_64 and without dependencies, the
# wheels of megatron-core, transformers, omegaconf, safetensors and their dependencies at the
# versions of this checkout's .venv (everything the trainer and the check import, except torch
# and what torch brings), plus pip itself, and writes tools/gpu_wheels/requirements.txt.
# tools/gpu_wheels/ is not committed (.gitignore); carry it to the GPU machine.
#
# On the GPU machine: a venv in $AREAL_GPU_VENV (default /tmp/areal_gpu_venv) that sees the
# system site-packages (its torch), then `pip install --no-index --find-links tools/gpu_wheels`
# of requirements.txt: pip keeps what is installed and satisfies the pins' dependencies, and
# installs only what is missing. Then prints versions and runs tools/gpu_check.py with the
# remaining arguments; results go to $OUT/gpu_check.txt (default runs/gpu_check/).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
WHEELS=tools/gpu_wheels
PYVER=3.12
PLATFORM=manylinux_2_28_x86_64
# pip does not expand a --platform to older manylinux tags: list them.
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    VPY=${VENV_PYTHON:-.venv/bin/python}
    mkdir -p "$WHEELS"
    # name==version of the closure of the roots in this .venv, for Python 3.12 on Linux x86_64,
    # stopping at torch (the GPU machine has its own).
    "$VPY" - "$WHEELS" <<'EOF' || exit 2
import sys
from importlib import metadata
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

out = sys.argv[1]
roots = ["megatron-core", "transformers", "omegaconf", "safetensors", "numpy", "packaging"]
stop = lambda n: n == "torch" or n.startswith(("nvidia-", "cuda-")) or n == "triton"
env = dict(default_environment(), python_version="3.12", python_full_version="3.12.0",
           sys_platform="linux", platform_system="Linux", platform_machine="x86_64",
           implementation_name="cpython", platform_python_implementation="CPython")
seen, todo = {}, list(roots)
while todo:
    name = canonicalize_name(todo.pop())
    if name in seen or stop(name):
        continue
    try:
        seen[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        sys.exit(f"{name} is not installed in this .venv: cannot pin it")
    for r in metadata.requires(name) or []:
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
            todo.append(req.name)
pins = [f"{n}=={v}" for n, v in sorted(seen.items())]
open(f"{out}/all.txt", "w").write("\n".join(pins) + "\n")
open(f"{out}/requirements.txt", "w").write(
    "\n".join(f"{n}=={seen[canonicalize_name(n)]}" for n in roots[:4]) + "\n")
print(" ".join(pins))
EOF
    echo "[gpu_check] downloading $(wc -l < "$WHEELS/all.txt") wheels + pip for CPython $PYVER $PLATFORM into $WHEELS"
    "$VPY" -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" \
        --implementation cp "${PLATFORMS[@]}" -d "$WHEELS" -r "$WHEELS/all.txt" pip || {
        echo "[gpu_check] pip download failed (no network to PyPI?)" >&2; exit 1; }
    # Check that the folder alone resolves the requirements for the target (torch given).
    "$VPY" -m pip install --dry-run --ignore-installed --no-index --find-links "$WHEELS" \
        --only-binary=:all: --python-version "$PYVER" --implementation cp "${PLATFORMS[@]}" \
        --target /tmp/areal_gpu_wheels_dryrun --no-deps -r "$WHEELS/all.txt" >/dev/null || {
        echo "[gpu_check] the downloaded wheels do not cover all.txt" >&2; exit 1; }
    du -sh "$WHEELS"
    ls "$WHEELS"
    exit 0
fi

OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
export OUT
LOG="$OUT/gpu_setup.log"
PY=${PYTHON:-python3}
VENV=${AREAL_GPU_VENV:-/tmp/areal_gpu_venv}
t0=$(date +%s)

if [[ ! -f "$WHEELS/requirements.txt" ]]; then
    echo "[gpu_check] $WHEELS/requirements.txt missing: run 'bash tools/gpu_check.sh --fetch-wheels' on a machine with network, and carry $WHEELS" >&2
fi

echo "[gpu_check] system python: $($PY -c 'import sys; print(sys.version.split()[0], sys.executable)')"
echo "[gpu_check] before install (system python):"
$PY - "$WHEELS/requirements.txt" <<'EOF'
import sys
from importlib import metadata
try:
    names = ["torch"] + [l.split("==")[0] for l in open(sys.argv[1]).read().split()]
except OSError:
    names = ["torch", "megatron-core", "transformers", "omegaconf", "safetensors"]
for n in names:
    try:
        print(f"    {n} {metadata.version(n)}")
    except Exception:
        print(f"    {n} not installed")
EOF

# A venv over the system site-packages (created without pip: ensurepip may be absent); pip is
# the system's if the venv sees one, else the carried pip wheel run from its path.
RUNPY=$PY
if [[ -x "$VENV/bin/python" ]] || $PY -m venv --system-site-packages --without-pip "$VENV" >>"$LOG" 2>&1; then
    RUNPY="$VENV/bin/python"
else
    echo "[gpu_check] could not create a venv at $VENV; installing with --user into /tmp/areal_gpu_user" >&2
    export PYTHONUSERBASE=/tmp/areal_gpu_user
fi
PIPWHEEL=$(ls "$WHEELS"/pip-*.whl 2>/dev/null | head -1)
if "$RUNPY" -m pip --version >/dev/null 2>&1; then
    PIP=("$RUNPY" -m pip)
elif [[ -n "$PIPWHEEL" ]]; then
    PIP=("$RUNPY" "$PIPWHEEL/pip")
else
    PIP=()
    echo "[gpu_check] no pip available (neither installed nor $WHEELS/pip-*.whl)" >&2
fi
USERFLAG=()
[[ "$RUNPY" == "$PY" ]] && USERFLAG=(--user)
if [[ ${#PIP[@]} -gt 0 && -f "$WHEELS/requirements.txt" ]]; then
    echo "[gpu_check] pip install --no-index --find-links $WHEELS -r $WHEELS/requirements.txt (log: $LOG)"
    if ! "${PIP[@]}" install --no-index --find-links "$WHEELS" "${USERFLAG[@]}" \
            -r "$WHEELS/requirements.txt" >>"$LOG" 2>&1; then
        echo "[gpu_check] pip install failed; last lines of $LOG:" >&2
        tail -15 "$LOG" >&2
    fi
fi
echo "[gpu_check] setup took $(( $(date +%s) - t0 )) s"
"$RUNPY" - <<'EOF'
from importlib import metadata
import torch
print(f"[gpu_check] torch {torch.__version__} (CUDA {torch.version.cuda}), cuda available: {torch.cuda.is_available()}")
for n in ("megatron-core", "transformers", "omegaconf", "safetensors", "numpy", "huggingface-hub", "tokenizers"):
    try:
        print(f"    {n} {metadata.version(n)}")
    except Exception:
        print(f"    {n} not installed")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$RUNPY" tools/gpu_check.py "$@"
rc=$?
echo "[gpu_check] exit $rc after $(( $(date +%s) - t0 )) s; results: $OUT/gpu_check.txt"
exit $rc
