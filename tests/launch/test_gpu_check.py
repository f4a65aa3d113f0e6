"""tools/gpu_check.sh on CPU, laid out as on the lent GPU machine, offline.

The lent machine: `python3` is itself a venv whose site-packages hold torch; no vLLM, no network;
the tree is copied there with tools/gpu_wheels carried; the script installs the carried wheels
into that interpreter and runs tools/gpu_check.py.

Here: the interpreter is a fresh venv `X` that sees this checkout's .venv (torch 2.13 CPU,
megatron-core, transformers...) through a .pth file, so that pip installs into X and never into
.venv. (A `python -m venv --system-site-packages` made from .venv's python would not do: a venv
made from a venv's python sees the base interpreter's site-packages, not .venv's, which is the
failure the old script had on the GPU machine; `test_venv_from_a_venv_has_no_torch` shows the
one line the script now prints for it.) A `vllm` that fails to import stands first on PYTHONPATH.
The wheels folder holds `--fetch-wheels --pins-only`'s requirements.txt (the pins, all already
satisfied in X) plus a probe wheel built here that X lacks; PIP_INDEX_URL points at a closed port.

Covered: interpreter / torch / CUDA / wheels / pip detection and their one-line refusals, the
offline install into the interpreter (pip resolves the pins against what is installed, installs
the missing probe from the folder), the version report, the imports gpu_check.py needs without
vLLM, and `--dry-run`'s CPU run of all nine checks (tiny model, quick; check 8's weight group on
gloo, its engine workers without vLLM). Not covered: the real
wheels (cp312 manylinux, downloaded by `--fetch-wheels`; this .venv is CPython 3.11), and
everything CUDA: the NCCL step, the FlashAttention varlen kernel, timings and peak memory.
"""
import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow     # starts MPI / torch.distributed worlds or processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools/gpu_check.sh"
VPY = Path(sys.executable)
PROBE = "areal_gpu_probe"


def _run(args, env_extra, timeout=240):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_INDEX_URL="http://127.0.0.1:9/simple", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.update(env_extra)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _one_error_line(proc) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("[gpu_check] error: "), lines[0]
    return lines[0]


def _probe_wheel(folder: Path) -> None:
    """A pure-Python wheel of `areal-gpu-probe` 0.1 (what X lacks, as the GPU machine lacks
    megatron-core)."""
    files = {f"{PROBE}/__init__.py": "VERSION = '0.1'\n",
             f"{PROBE}-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: areal-gpu-probe\nVersion: 0.1\n",
             f"{PROBE}-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                             "Tag: py3-none-any\n"}
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append(f"{PROBE}-0.1.dist-info/RECORD,,")
    with zipfile.ZipFile(folder / f"{PROBE}-0.1-py3-none-any.whl", "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{PROBE}-0.1.dist-info/RECORD", "\n".join(record) + "\n")


@pytest.fixture(scope="module")
def machine(tmp_path_factory):
    """(X's python, its site-packages, a wheels folder, a PYTHONPATH dir with a broken vllm)."""
    base = tmp_path_factory.mktemp("gpu_machine")
    x = base / "x"
    subprocess.run([str(VPY), "-m", "venv", "--without-pip", str(x)], check=True, timeout=120)
    xpy = x / "bin/python"
    site = Path(subprocess.check_output([str(xpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    outer = subprocess.check_output([str(VPY), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                    text=True).strip()
    (site / "outer_venv.pth").write_text(outer + "\n")
    wheels = base / "wheels"
    proc = _run(["--fetch-wheels", "--pins-only"], {"GPU_WHEELS": str(wheels), "VENV_PYTHON": str(VPY)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pins = (wheels / "requirements.txt").read_text().split()
    assert [p.split("==")[0] for p in pins] == ["megatron-core", "transformers", "omegaconf", "safetensors"]
    assert not any(line.startswith(("torch==", "nvidia-")) for line in (wheels / "all.txt").read_text().split())
    with (wheels / "requirements.txt").open("a") as f:
        f.write("areal-gpu-probe==0.1\n")
    _probe_wheel(wheels)
    novllm = base / "novllm"
    (novllm / "vllm").mkdir(parents=True)
    (novllm / "vllm/__init__.py").write_text("raise ImportError('vLLM is not installed on the GPU machine')\n")
    return xpy, site, wheels, novllm


def test_dry_run_installs_offline_and_runs_cpu_checks(machine, tmp_path):
    xpy, site, wheels, novllm = machine
    proc = _run(["--dry-run"], {"PYTHON": str(xpy), "GPU_WHEELS": str(wheels), "OUT": str(tmp_path),
                                "PYTHONPATH": str(novllm)})
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert f"python: {xpy}" in out
    assert "torch 2." in out and "cuda available: False" in out
    assert "installed: areal-gpu-probe-0.1" in out  # the one pin X lacked, from the folder
    assert (site / PROBE / "__init__.py").exists()  # into X, the interpreter the script was given
    assert subprocess.run([str(VPY), "-c", f"import {PROBE}"], capture_output=True).returncode != 0  # not .venv
    versions = next(ln for ln in out.splitlines() if ln.startswith("[gpu_check] versions: "))
    for pin in (wheels / "requirements.txt").read_text().split()[:4]:
        name, version = pin.split("==")
        assert f"{name} {version}" in versions
    assert "vllm not installed" in versions
    assert "warning: differs from the pins" not in out
    assert "imports ok; varlen_attn call: window_size=(-1, 0)" in out
    assert "dry run: CUDA measurements left out" in out
    summary = out[out.index("## Summary"):]
    for check in ("Environment", "1. Megatron-core", "2. attention varlen", "3. Train-step", "4. Peak memory",
                  "5. deterministic", "6. NCCL version", "7. GPU memory", "8. weight group", "9. P2P"):
        assert f"| {check}" in summary and "FAILED" not in summary, summary
    # check 8 on gloo without vLLM: a worker killed between updates and inside one, the group
    # re-formed each time with a new worker, every update after a re-forming delivered
    import re
    events = dict(re.findall(r"^\| (gen \d[^|]*?) \| [\d.]+ \| [\d.]+ \| ([^|]*?) \|$", out, re.M))
    for k in ("gen 0: update", "gen 1 (re-formed, a new worker): update",
              "gen 2 (re-formed, a new worker): update"):
        assert events[k].startswith("ok:"), events
    assert not events["gen 0: update, a worker SIGKILLed since the last one"].startswith("ok"), events
    # (inside an update, gloo may have handed every bucket to the sockets before the worker
    # died: the sender's outcome there is reported, not asserted; on NCCL it cannot finish)
    assert "gen 1: update, a worker SIGKILLed inside it" in events, events
    # check 5 (--quick: one child): the deterministic child ran with the mode
    assert "One child (--quick): no repeat check." in out, out
    assert "deterministic: true (Megatron deterministic_mode" in (tmp_path / "deterministic_1/gpu_check.txt").read_text()
    assert (tmp_path / "gpu_check.txt").exists()
    # a second run on the same machine: nothing left to install
    again = _run(["--dry-run", "--setup-only"], {"PYTHON": str(xpy), "GPU_WHEELS": str(wheels),
                                                  "OUT": str(tmp_path), "PYTHONPATH": str(novllm)})
    assert again.returncode == 0, again.stdout + again.stderr
    assert "installed: nothing (every pin already satisfied)" in again.stdout
    assert "setup only (--setup-only): gpu_check.py not run" in again.stdout


@pytest.mark.parametrize("layout", ["no_folder", "no_requirements"])
def test_refuses_without_wheels(machine, tmp_path, layout):
    xpy = machine[0]
    wheels = tmp_path / "gpu_wheels"
    if layout == "no_requirements":
        wheels.mkdir()
    proc = _run(["--dry-run"], {"PYTHON": str(xpy), "GPU_WHEELS": str(wheels), "OUT": str(tmp_path / "out")})
    assert proc.returncode == 2
    line = _one_error_line(proc)
    assert "wheels not carried" in line and "--fetch-wheels" in line


def test_refuses_wheels_that_do_not_cover_a_pin(machine, tmp_path):
    xpy, site, wheels, _ = machine
    short = tmp_path / "gpu_wheels"
    short.mkdir()
    (short / "requirements.txt").write_text((wheels / "requirements.txt").read_text() + "areal-gpu-absent==1.0\n")
    proc = _run(["--dry-run"], {"PYTHON": str(xpy), "GPU_WHEELS": str(short), "OUT": str(tmp_path / "out")})
    assert proc.returncode == 2
    assert "do not cover: areal-gpu-absent" in _one_error_line(proc)


def test_no_install_skips_pip(machine, tmp_path):
    xpy = machine[0]
    proc = _run(["--dry-run", "--no-install", "--setup-only"],
                {"PYTHON": str(xpy), "GPU_WHEELS": str(tmp_path / "absent"), "OUT": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "install SKIPPED (--no-install)" in proc.stdout
    assert "installing offline" not in proc.stdout
    assert "imports ok" in proc.stdout


def test_refuses_without_cuda(machine, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    xpy, _, wheels, _ = machine
    proc = _run([], {"PYTHON": str(xpy), "GPU_WHEELS": str(wheels), "OUT": str(tmp_path)})
    assert proc.returncode == 2
    line = _one_error_line(proc)
    assert "no CUDA" in line and "--dry-run" in line
    assert "installing" not in proc.stdout  # refused before touching the interpreter


def test_venv_from_a_venv_has_no_torch(tmp_path):
    """The old script's layout: a --system-site-packages venv made from a venv's python."""
    nested = tmp_path / "nested"
    subprocess.run([str(VPY), "-m", "venv", "--system-site-packages", "--without-pip", str(nested)],
                   check=True, timeout=120)
    proc = _run(["--dry-run"], {"PYTHON": str(nested / "bin/python"), "OUT": str(tmp_path / "out")})
    assert proc.returncode == 2
    line = _one_error_line(proc)
    assert "no torch in" in line and "a venv sees its base interpreter's site-packages" in line


def test_refuses_missing_python(tmp_path):
    proc = _run([], {"PYTHON": "areal-no-such-python", "OUT": str(tmp_path)})
    assert proc.returncode == 2
    assert "no 'areal-no-such-python' on PATH" in _one_error_line(proc)


def test_refuses_when_an_import_fails(machine, tmp_path):
    xpy = machine[0]
    broken = tmp_path / "broken"
    (broken / "megatron").mkdir(parents=True)
    (broken / "megatron/__init__.py").write_text("raise ImportError('megatron-core absent')\n")
    proc = _run(["--dry-run", "--no-install", "--setup-only"],
                {"PYTHON": str(xpy), "OUT": str(tmp_path / "out"), "PYTHONPATH": str(broken)})
    assert proc.returncode == 2
    line = _one_error_line(proc)
    assert "an import the check needs fails" in line and "megatron-core absent" in line
