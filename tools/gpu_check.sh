#!/usr/bin/env bash
# The prepared GPU check (tools/gpu_check.py) on a machine without network, from the repo root.
#
#   bash tools/gpu_check.sh --fetch-wheels          # HERE (PyPI reachable): fill tools/gpu_wheels/
#   bash tools/gpu_check.sh [gpu_check.py args]     # THERE: one GPU, a python3 whose torch has CUDA
#   bash tools/gpu_check.sh --dry-run [args]        # anywhere: all of it except CUDA, on CPU
#
# --fetch-wheels pins, from this checkout's .venv, megatron-core, transformers, omegaconf and
# safetensors (requirements.txt) and their dependencies (all.txt, stopping at torch, which the GPU
# machine brings), and downloads their wheels for CPython 3.12 on manylinux x86_64 (no builds),
# less those in GPU_WHEELS_SKIP (default numpy: the lent machine's image has one that satisfies
# the pins), plus pip (in case the interpreter has none). `--fetch-wheels --pins-only`
# writes the two lists and downloads nothing. tools/gpu_wheels/ is .gitignored: carry it.
#
# On the GPU machine the wheels are installed INTO the interpreter that has torch
# (`$PYTHON -m pip install --no-index --find-links tools/gpu_wheels -r requirements.txt`), not
# into a venv made from it: the lent machine's python3 is itself a venv, and a venv made from a
# venv's python sees the base interpreter's site-packages, not that venv's, so its torch would be
# missing. pip keeps every installed distribution that satisfies the pins (torch, numpy, ...) and
# installs only what is missing or pinned differently; nothing is fetched (PIP_NO_INDEX=1). The
# machine is bare on each lease, so nothing outlives the run.
#
# Each missing piece stops the script with one line `[gpu_check] error: ...` and exit 2: no
# python, no torch, no CUDA (not checked with --dry-run), wheels not carried, pip absent, the
# interpreter's site-packages not writable, wheels that do not cover the pins, an import failing.
#
# --dry-run: the same steps with the GPU left out: no CUDA needed, the install runs as above
# (offline, into $PYTHON), then `gpu_check.py --device cpu --tiny --quick`.
# --no-install: skip pip (say so) and use what $PYTHON has; the wheels are then not needed.
# --setup-only: stop after the install, the version report and the import check.
# Environment: PYTHON (default python3), GPU_WHEELS (default tools/gpu_wheels), OUT (results,
# default runs/gpu_check), VENV_PYTHON (--fetch-wheels: the .venv to pin from).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
WHEELS=${GPU_WHEELS:-tools/gpu_wheels}
PYVER=3.12
# pip does not expand a --platform to older manylinux tags: list them.
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# Not downloaded: numpy (15.8 MiB of the 49 MiB closure; the lent H200 machine's image has
# numpy 2.5.2, which megatron-core's `numpy` and transformers' `numpy>=1.17` accept). The rest of
# the closure is carried even where the image has a package, so that an image whose versions do
# not satisfy the pins still installs offline: 33 MiB in all, with the tree under 64 MiB.
GPU_WHEELS_SKIP=${GPU_WHEELS_SKIP-numpy}
say() { echo "[gpu_check] $*"; }
die() { echo "[gpu_check] error: $*" >&2; exit 2; }

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    PINS_ONLY=0
    [[ "${2:-}" == "--pins-only" ]] && PINS_ONLY=1
    VPY=${VENV_PYTHON:-.venv/bin/python}
    [[ -x "$VPY" ]] || die "$VPY not found: make the .venv first (tools/install.sh) or set VENV_PYTHON"
    mkdir -p "$WHEELS" || die "cannot create $WHEELS"
    # name==version of the closure of the roots in this .venv, for Python 3.12 on Linux x86_64,
    # stopping at torch (the GPU machine has its own).
    "$VPY" - "$WHEELS" <<'EOF' || exit 2
import sys
from importlib import metadata
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

out = sys.argv[1]
roots = ["megatron-core", "transformers", "omegaconf", "safetensors"]
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
        sys.exit(f"[gpu_check] error: {name} is not installed in this .venv: cannot pin it")
    for r in metadata.requires(name) or []:
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
            todo.append(req.name)
open(f"{out}/all.txt", "w").write("".join(f"{n}=={v}\n" for n, v in sorted(seen.items())))
open(f"{out}/requirements.txt", "w").write("".join(f"{n}=={seen[n]}\n" for n in roots))
EOF
    say "pins: $(tr '\n' ' ' < "$WHEELS/requirements.txt")($(wc -l < "$WHEELS/all.txt") with dependencies, $WHEELS/all.txt)"
    [[ $PINS_ONLY == 1 ]] && exit 0
    grep -v -E "^($(echo $GPU_WHEELS_SKIP | tr ' ' '|'))==" "$WHEELS/all.txt" > "$WHEELS/download.txt"
    say "downloading $(wc -l < "$WHEELS/download.txt") wheels + pip for CPython $PYVER manylinux x86_64 into $WHEELS (not downloaded: ${GPU_WHEELS_SKIP:-nothing})"
    "$VPY" -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" \
        --implementation cp "${PLATFORMS[@]}" -d "$WHEELS" -r "$WHEELS/download.txt" pip >"$WHEELS/download.log" 2>&1 || {
        tail -5 "$WHEELS/download.log" >&2; die "pip download failed (no network to PyPI?); log $WHEELS/download.log"; }
    # Check that the folder alone holds every downloaded pin for the target.
    "$VPY" -m pip install --dry-run --ignore-installed --no-index --find-links "$WHEELS" \
        --only-binary=:all: --python-version "$PYVER" --implementation cp "${PLATFORMS[@]}" \
        --target /tmp/areal_gpu_wheels_dryrun --no-deps -r "$WHEELS/download.txt" >/dev/null \
        || die "the downloaded wheels do not cover $WHEELS/download.txt"
    ls -l "$WHEELS"/*.whl | awk '{printf "    %6.1f MiB  %s\n", $5 / 1048576, $NF}'
    mib=$(du -sm "$WHEELS" | cut -f1)
    say "$WHEELS: ${mib} MiB (the device tool carries at most 64 MiB with the tree); carry it: carry=[\"$WHEELS\"]"
    [[ $mib -lt 60 ]] || die "$WHEELS is ${mib} MiB: too big to carry; add packages the GPU machine has to GPU_WHEELS_SKIP"
    exit 0
fi

DRY=0
INSTALL=1
SETUP_ONLY=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) DRY=1; shift ;;
        --no-install) INSTALL=0; shift ;;
        --setup-only) SETUP_ONLY=1; shift ;;
        *) break ;;
    esac
done
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT" || die "cannot create OUT=$OUT"
export OUT
LOG="$OUT/gpu_setup.log"
: > "$LOG"
PY=${PYTHON:-python3}
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore
t0=$(date +%s)

# 1. The interpreter, its torch and CUDA: one line says which is missing.
command -v "$PY" >/dev/null 2>&1 || die "no '$PY' on PATH: set PYTHON to the interpreter that has torch"
"$PY" - "$DRY" >"$OUT/probe.txt" 2>>"$LOG" <<'EOF'
import os, sys, sysconfig
dry = sys.argv[1] == "1"
where = f"{sys.executable} (Python {sys.version.split()[0]}, prefix {sys.prefix})"
print(f"[gpu_check] python: {where}")
try:
    import torch
except Exception as exc:  # noqa: BLE001
    nested = ""
    if sys.prefix != sys.base_prefix:
        nested = (f"; this is a venv over {sys.base_prefix}: a venv sees its base interpreter's "
                  "site-packages, not those of a venv it was made from")
    print(f"[gpu_check] error: no torch in {where}: {type(exc).__name__}: {exc}{nested}; "
          "set PYTHON to the interpreter that has torch", file=sys.stderr)
    sys.exit(2)
cuda = torch.cuda.is_available()
print(f"[gpu_check] torch {torch.__version__} at {os.path.dirname(torch.__file__)}, built for CUDA "
      f"{torch.version.cuda}, cuda available: {cuda}"
      + (f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if cuda else ""))
if not cuda and not dry:
    why = "a CPU-only build" if torch.version.cuda is None else "no GPU visible to it"
    print(f"[gpu_check] error: no CUDA: torch {torch.__version__} is {why} "
          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
          "--dry-run runs everything else on CPU", file=sys.stderr)
    sys.exit(3)
site = sysconfig.get_paths()["purelib"]
print(f"[gpu_check] site-packages: {site} ({'writable' if os.access(site, os.W_OK) else 'NOT writable'})")
EOF
rc=$?
cat "$OUT/probe.txt"
if [[ $rc -ne 0 ]]; then
    grep "^\[gpu_check\] error:" "$LOG" >&2 || { tail -3 "$LOG" >&2; die "'$PY' failed before torch was checked (log $LOG)"; }
    exit 2
fi

# 2. The carried wheels, pip, and the offline install into $PY.
if [[ $INSTALL == 0 ]]; then
    say "install SKIPPED (--no-install): using what $PY has; $WHEELS not read"
else
    [[ -d "$WHEELS" ]] || die "wheels not carried: no $WHEELS/ (fetch them with 'bash tools/gpu_check.sh --fetch-wheels' where PyPI is reachable, then carry the folder: device run carry=[\"$WHEELS\"])"
    [[ -f "$WHEELS/requirements.txt" ]] || die "wheels not carried: no $WHEELS/requirements.txt (run 'bash tools/gpu_check.sh --fetch-wheels' and carry $WHEELS)"
    grep -q "site-packages: .*(writable)" "$OUT/probe.txt" \
        || die "$(grep -o 'site-packages: [^ ]*' "$OUT/probe.txt" | cut -d' ' -f2) is not writable: run as its owner or set PYTHON to an interpreter you can install into"
    PIPWHEEL=$(ls "$WHEELS"/pip-*.whl 2>/dev/null | head -1)
    if "$PY" -m pip --version >/dev/null 2>&1; then
        PIP=("$PY" -m pip)
    elif [[ -n "$PIPWHEEL" ]]; then
        PIP=("$PY" "$PIPWHEEL/pip")
    else
        die "no pip in $PY and no $WHEELS/pip-*.whl"
    fi
    say "$("${PIP[@]}" --version | cut -d' ' -f1-2); installing offline: pip install --no-index --find-links $WHEELS -r $WHEELS/requirements.txt ($(tr '\n' ' ' < "$WHEELS/requirements.txt"| sed 's/ $//'); log $LOG)"
    if ! "${PIP[@]}" install --no-index --find-links "$WHEELS" --only-binary=:all: --no-cache-dir \
            -r "$WHEELS/requirements.txt" >>"$LOG" 2>&1; then
        missing=$(grep -o -E "(No matching distribution found for|Could not find a version that satisfies the requirement) [^ ]+" "$LOG" | awk '{print $NF}' | sort -u | tr '\n' ' ')
        [[ -n "$missing" ]] && die "the carried wheels do not cover: ${missing}(and $PY does not have them; log $LOG)"
        die "pip install failed: $(grep -E '^ERROR' "$LOG" | head -1) (log $LOG)"
    fi
    installed=$(grep -E "^Successfully installed" "$LOG" | sed 's/^Successfully installed //')
    say "installed: ${installed:-nothing (every pin already satisfied)}"
fi

# 3. Versions and the imports the check needs (vLLM is not one of them).
"$PY" - "$WHEELS/requirements.txt" 2>>"$LOG" <<'EOF' || die "an import the check needs fails: $(tail -1 "$LOG") (log $LOG)"
import sys, warnings
from importlib import metadata
warnings.filterwarnings("ignore")
names = ["torch", "megatron-core", "transformers", "omegaconf", "safetensors", "numpy", "huggingface-hub",
         "tokenizers", "vllm"]
def version(n):
    try:
        return metadata.version(n)
    except metadata.PackageNotFoundError:
        return "not installed"
print("[gpu_check] versions: " + ", ".join(f"{n} {version(n)}" for n in names))
try:
    pins = [l.split("==") for l in open(sys.argv[1]).read().split()]
except OSError:
    pins = []
off = [f"{n} {version(n)} (pinned {v})" for n, v in pins if version(n) != v]
if off:
    print("[gpu_check] warning: differs from the pins: " + ", ".join(off))
sys.path.insert(0, ".")
import megatron.core, transformers, omegaconf, safetensors  # noqa: E401,F401
from areal_hpc.train.actor import Actor  # noqa: F401
from areal_hpc.train.attention import varlen_call_plan
print(f"[gpu_check] imports ok; varlen_attn call: {varlen_call_plan()}")
EOF
command -v nvidia-smi >/dev/null && [[ $DRY == 0 ]] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
say "setup took $(( $(date +%s) - t0 )) s"
if [[ $SETUP_ONLY == 1 ]]; then
    say "setup only (--setup-only): gpu_check.py not run"
    exit 0
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ $DRY == 1 ]]; then
    say "dry run: CUDA measurements left out; gpu_check.py --device cpu --tiny --quick $*"
    "$PY" tools/gpu_check.py --device cpu --tiny --quick "$@"
else
    "$PY" tools/gpu_check.py "$@"
fi
rc=$?
say "exit $rc after $(( $(date +%s) - t0 )) s; results: $OUT/gpu_check.txt"
exit $rc
