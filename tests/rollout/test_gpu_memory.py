"""The restarted engine's memory wait (areal_hpc/rollout/gpu_memory.py): its polling and its
one-line end on a fake clock, and its NVML reading on a fake NVML (a CPU box has none; the real
reading is in tools/gpu_check.py's list for a lent GPU node)."""
import os
from dataclasses import dataclass

import psutil
import pytest

from areal_hpc.rollout import gpu_memory
from areal_hpc.rollout.gpu_memory import DeviceMemory, EngineMemoryError, wait_for_memory

GiB = 1 << 30


class _Clock:
    def __init__(self):
        self.now, self.sleeps = 100.0, []

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.sleeps.append(s)
        self.now += s


def _dev(free_gib, total_gib=80, holders=()):
    return DeviceMemory(0, "GPU-abc", int(free_gib * GiB), int(total_gib * GiB), tuple(holders))


def _wait(readings, bound_s=300.0, fraction=0.9):
    clock, seq = _Clock(), iter(readings)
    waited = wait_for_memory(lambda: next(seq), fraction, bound_s, "generator rank 3 (host g1)",
                             clock=clock, sleep=clock.sleep)
    return waited, clock.sleeps


def test_without_a_gpu_there_is_nothing_to_wait_for():
    assert _wait([None]) == (0.0, [])


def test_memory_already_free_is_not_waited_for():
    assert _wait([[_dev(72)]]) == (0.0, [])         # exactly vLLM's 0.9 x 80 GiB


def test_the_wait_ends_when_the_killed_engines_memory_comes_back():
    waited, sleeps = _wait([[_dev(3)], [_dev(3)], [_dev(40)], [_dev(79)]])
    assert waited == 3.0 and sleeps == [1.0, 1.0, 1.0]


def test_past_the_bound_the_job_ends_naming_the_device_and_its_holder():
    holder = (4242, 70 * GiB, "python -m vllm.zombie")
    with pytest.raises(EngineMemoryError) as err:
        _wait([[_dev(10, holders=[holder])]] * 100, bound_s=5.0)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("generator rank 3 (host g1): the new vLLM engine")
    for part in ("within 5 s (rollout.engine_memory_wait_s)", "GPU 0 (GPU-abc): 10.0 GiB free of "
                 "80.0, needs 72.0", "rollout.gpu_memory_utilization = 0.9",
                 "pid 4242 (python -m vllm.zombie) 70.0 GiB"):
        assert part in msg, msg


@dataclass
class _Info:
    free: int
    total: int


@dataclass
class _Proc:
    pid: int
    usedGpuMemory: int      # noqa: N815 - NVML's field name


class _FakeNVML:
    """The NVML calls read_devices makes, over {physical index: (uuid, free, total,
    [(pid, bytes)])}; a handle is the physical index."""

    def __init__(self, devices):
        self.devices, self.calls = devices, []

    def nvmlInit(self):                             # noqa: N802 - NVML's names
        self.calls.append("init")

    def nvmlShutdown(self):                         # noqa: N802
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self):                   # noqa: N802
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):        # noqa: N802
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid):      # noqa: N802
        return next(i for i, d in self.devices.items() if d[0] == uuid)

    def nvmlDeviceGetMemoryInfo(self, h):           # noqa: N802
        return _Info(self.devices[h][1], self.devices[h][2])

    def nvmlDeviceGetComputeRunningProcesses(self, h):     # noqa: N802
        return [_Proc(p, b) for p, b in self.devices[h][3]]


def test_devices_are_read_as_vllm_maps_them_by_index_or_uuid(monkeypatch):
    import vllm.utils.import_utils as iu

    nvml = _FakeNVML({0: ("GPU-a", 1, 8, []), 1: ("GPU-b", 2, 8, []),
                      2: ("GPU-c", 3, 8, [(os.getpid(), 5)]), 3: ("GPU-d", 4, 8, [])})
    monkeypatch.setattr(iu, "import_pynvml", lambda: nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-d,0")
    devs = gpu_memory.read_devices(2)           # an engine with TP 2: the first two visible
    assert [(d.visible, d.physical, d.free) for d in devs] == [(0, "2", 3), (1, "GPU-d", 4)]
    (pid, used, cmd), = devs[0].holders
    assert pid == os.getpid() and used == 5
    assert cmd == " ".join(psutil.Process().cmdline())[:120]     # named by its command line
    assert nvml.calls == ["init", "shutdown"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert [d.physical for d in gpu_memory.read_devices(4)] == ["0", "1", "2", "3"]


def test_the_real_reading_is_none_exactly_where_there_is_no_nvidia_driver():
    assert (gpu_memory.read_devices(1) is None) == (not os.path.exists("/dev/nvidiactl"))
