"""Before a restarted vLLM engine starts: wait until its GPUs have the memory it will ask for.

A killed engine's processes are gone within seconds (`engine_guard.kill_engine` waits for
them), but the driver frees their GPU memory as it tears their contexts down, which can take
longer on a GPU holding tens of GiB. vLLM refuses to start while a device's free memory is below
`gpu_memory_utilization` of its total ("Free memory on device ... is less than desired GPU
memory utilization"), and the generator rank, and with it the job, would end there. So the
rank waits, polling every second, at most rollout.engine_memory_wait_s; past it the job ends
with one line naming each short device and the processes that hold memory on it.

The devices are read through NVML (no CUDA context in the generator rank, which would itself
hold memory on them), mapped from this rank's CUDA_VISIBLE_DEVICES as vLLM maps them (an index,
or a GPU/MIG UUID): the engine's workers use the first `engine_tp` visible devices. Without
NVML (a CPU node) there is nothing to wait for.
"""
from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

GiB = 1 << 30


class EngineMemoryError(RuntimeError):
    """A restarted engine's GPUs did not get back the memory it needs within the bound."""


@dataclass(frozen=True)
class DeviceMemory:
    """One visible device as NVML reports it: `holders` are (pid, bytes, command) of the
    processes with memory on it (bytes None where the driver does not say)."""
    visible: int
    physical: str
    free: int
    total: int
    holders: tuple[tuple[int, int | None, str], ...] = field(default=())


def _command(pid: int) -> str:
    import psutil

    try:
        return " ".join(psutil.Process(pid).cmdline())[:120] or "?"
    except psutil.Error:
        return "? (not visible from this rank)"


def read_devices(n: int) -> list[DeviceMemory] | None:
    """The first `n` devices this rank sees, through NVML; None without NVML or a GPU."""
    try:
        from vllm.utils.import_utils import import_pynvml
        nvml = import_pynvml()
        nvml.nvmlInit()
    except Exception:       # noqa: BLE001 - no NVML library or no driver: a CPU node
        return None
    try:
        ids = [x for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
        ids = ids or [str(i) for i in range(nvml.nvmlDeviceGetCount())]
        out = []
        for i, dev in enumerate(ids[:n]):
            dev = dev.strip()
            handle = (nvml.nvmlDeviceGetHandleByIndex(int(dev)) if dev.isdigit()
                      else nvml.nvmlDeviceGetHandleByUUID(dev))
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            holders = tuple((p.pid, p.usedGpuMemory, _command(p.pid))
                            for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle))
            out.append(DeviceMemory(i, dev, int(mem.free), int(mem.total), holders))
        return out
    finally:
        nvml.nvmlShutdown()


def _short(devices: list[DeviceMemory], fraction: float) -> list[DeviceMemory]:
    """The devices with less free memory than vLLM's budget (its own rounding)."""
    return [d for d in devices if d.free < math.ceil(d.total * fraction)]


def _describe(d: DeviceMemory, fraction: float) -> str:
    held = ", ".join(f"pid {pid} ({cmd}) {'?' if b is None else f'{b / GiB:.1f}'} GiB"
                     for pid, b, cmd in d.holders) or "no process listed by the driver"
    return (f"GPU {d.visible} ({d.physical}): {d.free / GiB:.1f} GiB free of "
            f"{d.total / GiB:.1f}, needs {math.ceil(d.total * fraction) / GiB:.1f} "
            f"(rollout.gpu_memory_utilization = {fraction:g}); held by {held}")


def wait_for_memory(read: Callable[[], list[DeviceMemory] | None], fraction: float,
                    bound_s: float, who: str, poll_s: float = 1.0,
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> float:
    """Poll `read()` until every device has `fraction` of its memory free; the seconds waited
    (0 at once, and without a reading: no GPU). Past `bound_s`: `EngineMemoryError`, one line
    naming `who`, each short device and its holders."""
    t0 = clock()
    devices = read()
    if devices is None:
        return 0.0
    short = _short(devices, fraction)
    if not short:
        return clock() - t0
    log.warning("%s: waiting up to %g s (rollout.engine_memory_wait_s) for the killed engine's "
                "GPU memory: %s", who, bound_s, "; ".join(_describe(d, fraction) for d in short))
    while short:
        if clock() - t0 >= bound_s:
            raise EngineMemoryError(
                f"{who}: the new vLLM engine cannot start: its GPUs did not get their memory back "
                f"within {bound_s:g} s (rollout.engine_memory_wait_s): "
                + "; ".join(_describe(d, fraction) for d in short) + "; the job ends")
        sleep(poll_s)
        short = _short(read() or [], fraction)
    waited = clock() - t0
    log.info("%s: the GPUs have their memory back after %.1f s", who, waited)
    return waited
