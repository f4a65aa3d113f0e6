"""gpu_check.py's checks of what the job does when things go wrong on GPUs (checks 6-9), each
runnable on CPU as a dry run (gloo instead of NCCL) so that its code is proven before a GPU is
lent. They need no vLLM: an engine's workers are stood in for by processes that run the receiver
half of the weight path (`areal_hpc.rollout.vllm_ext.WeightSyncExtension`) on one GPU each.

6. NCCL: the version torch was built with and the one the ranks load, against the floor of
   `deterministic: true` (areal_hpc/determinism.py).
7. A killed process's GPU memory: a child holds GiBs on a GPU and is SIGKILLed; how long until
   the driver reports that memory free again (an engine restart waits for it:
   rollout.engine_memory_wait_s), read as the restart reads it (NVML through
   areal_hpc/rollout/gpu_memory.py), torch's `mem_get_info` beside it.
8. The weight group with a dead member: a sender (this process, GPU 0) and a TP-2 engine's two
   workers (GPUs 1 and 2; on 2 GPUs, one worker): join, update; one worker SIGKILLed between
   updates, then the next update over the old group (every live member must give up within
   weights.timeout_s on the host and abort, not hang until the watchdog ends the process), a
   re-formed group with a new worker in its place, an update; the same with the worker killed
   inside an update. Times and outcomes per event.
9. P2P between two ranks that each narrowed CUDA_VISIBLE_DEVICES to their own GPU (what every
   rank does, areal_hpc/launch/placement.py): NCCL_DEBUG=INFO's transport lines read back
   (`via P2P/IPC`, `via P2P/CUMEM`, `via SHM`, `via NET`).

    python tools/gpu_faults.py member JSON     # one stand-in engine worker (started by check 8)
    python tools/gpu_faults.py hold GPU GIB    # holds GIB on GPU until killed (check 7)
    python tools/gpu_faults.py p2p RANK PORT   # one rank of check 9's two
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRANSPORTS = re.compile(r"via (P2P/IPC|P2P/CUMEM|P2P/direct pointer|P2P|SHM|NET/\S+)")


def gpu_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# ---------------------------------------------------------------- 6. NCCL

def check_nccl_version(report, cuda: bool) -> dict:
    import torch

    from areal_hpc import determinism

    built = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    loaded = determinism.installed_nccl() if cuda else None
    problem = determinism.nccl_problem(loaded[0], loaded[1]) if loaded else None
    rows = [["torch built with", built or "no NCCL (CPU build)"],
            ["the ranks load", f"{'.'.join(map(str, loaded[0]))} ({loaded[1]})" if loaded else "-"],
            ["deterministic: true needs", ".".join(map(str, determinism.NCCL_FLOOR))],
            ["verdict", problem or "fits (or no NCCL)"]]
    report.table(["NCCL", "value"], rows)
    return {"built": built, "loaded": loaded and list(loaded[0]), "problem": problem}


# ---------------------------------------------------------------- 7. memory after SIGKILL

def _hold(gpu: str, gib: float) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    import torch
    x = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    x.fill_(1)
    torch.cuda.synchronize()
    print("holding", flush=True)
    time.sleep(3600)


def check_memory_release(report, cuda: bool, gib: float = 8.0, bound_s: float = 120.0) -> dict:
    if not cuda:
        report("skipped: no GPU (the dry run starts and kills the holder only)")
        child = subprocess.Popen([sys.executable, __file__, "noop"])
        child.wait(timeout=60)
        return {"skipped": "no GPU"}
    import torch

    from areal_hpc.rollout.gpu_memory import read_devices

    def free_gib():
        nvml = read_devices(1)
        return (nvml[0].free / 2**30 if nvml else None), torch.cuda.mem_get_info(0)[0] / 2**30

    before = free_gib()
    child = subprocess.Popen([sys.executable, __file__, "hold", "0", str(gib)],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "holding", "the holder did not start"
    held = free_gib()
    t0 = time.monotonic()
    child.send_signal(signal.SIGKILL)
    back = None
    while time.monotonic() - t0 < bound_s:
        now = free_gib()
        if now[1] >= before[1] - 0.5:
            back = time.monotonic() - t0
            break
        time.sleep(0.05)
    child.wait(timeout=30)
    reaped = time.monotonic() - t0
    report.table(["event", "free GiB (NVML)", "free GiB (torch)", "seconds after SIGKILL"], [
        ["before", f"{before[0]:.1f}" if before[0] is not None else "-", f"{before[1]:.1f}", "-"],
        [f"holder has {gib:g} GiB", f"{held[0]:.1f}" if held[0] is not None else "-", f"{held[1]:.1f}", "-"],
        ["free again", "-", "-", f"{back:.2f}" if back is not None else f"not within {bound_s:g} s"],
        ["holder reaped", "-", "-", f"{reaped:.2f}"]])
    return {"gib": gib, "free_again_s": back, "reaped_s": reaped}


# ---------------------------------------------------------------- 8. weight group, dead member

def _state(total_mib: int):
    import torch
    n = 16
    per = max(1, total_mib * 2**20 // 4 // n)
    g = torch.Generator().manual_seed(7)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n)}


def _plan(sd, bucket_mib: int):
    from areal_hpc.transport.weights import dtype_to_str, plan_stages
    return plan_stages([[(k, tuple(v.shape), dtype_to_str(v.dtype)) for k, v in sd.items()]],
                       bucket_mib << 20)


def _member(spec: dict) -> None:
    """A stand-in engine worker: takes part in each update of `spec["updates"]` (the weight group's
    generation of each; a new one is joined when it changes), one JSON line each on stdout; kills
    itself at tensor `die_at` of update `die_in`; with `linger`, waits to be killed at the end."""
    if spec["cuda"]:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(spec["gpu"])
    import torch

    from areal_hpc.rollout.vllm_ext import WeightSyncExtension
    from areal_hpc.transport.weights import WeightGroupAddress

    if spec["cuda"]:
        torch.cuda.set_device(0)

    class Worker(WeightSyncExtension):
        device = torch.device("cuda", 0) if spec["cuda"] else torch.device("cpu")
        rank = 0
        die_at = None

        def reload_weights(self, weights_iterator):
            for i, (_, t) in enumerate(weights_iterator, 1):
                if i == self.die_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                t.sum()

    w = Worker()
    plan = [(root, [(n, tuple(s), d) for n, s, d in bucket]) for root, bucket in spec["plan"]]
    joined_gen = None
    for k, gen in enumerate(spec["updates"]):
        w.die_at = spec.get("die_at") if k == spec.get("die_in") else None
        t0 = time.monotonic()
        try:
            if gen != joined_gen:
                joined_gen = None
                w.init_weight_group(WeightGroupAddress(**{**spec["address"], "generation": gen}),
                                    spec["rank"])
                joined_gen = gen
            w.recv_weights(plan)
            print(json.dumps({"rank": spec["rank"], "update": k, "gen": gen, "outcome": "ok",
                              "s": time.monotonic() - t0}), flush=True)
        except Exception as exc:       # noqa: BLE001 - reported to the parent
            joined_gen = None
            print(json.dumps({"rank": spec["rank"], "update": k, "gen": gen,
                              "outcome": type(exc).__name__, "error": str(exc)[:200],
                              "s": time.monotonic() - t0}), flush=True)
    if spec.get("linger"):
        time.sleep(3600)


def check_weight_group(report, cuda: bool, timeout_s: float = 20.0, total_mib: int = 1024,
                       bucket_mib: int = 64) -> dict:
    """Check 8 (see the module docstring). On CPU: gloo, small tensors, a short bound."""
    import torch

    from areal_hpc.transport.rendezvous import reserve_port
    from areal_hpc.transport.weights import (WeightGroupAddress, WireTimeout, broadcast_stage,
                                             close_weight_group, init_weight_group)

    n_gpus = gpu_count() if cuda else 3
    if n_gpus < 2:
        report("skipped: one GPU (NCCL takes one rank per GPU: a sender and an engine's worker need two)")
        return {"skipped": "one GPU"}
    receivers = 2 if n_gpus >= 3 else 1
    world = 1 + receivers
    if not cuda:
        timeout_s, total_mib, bucket_mib = min(timeout_s, 5.0), 4, 1
    sd = _state(total_mib)
    plan = _plan(sd, bucket_mib)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
        sd = {k: v.to(device) for k, v in sd.items()}
    address = WeightGroupAddress("127.0.0.1", reserve_port(), world, "nccl" if cuda else "gloo",
                                 timeout_s=timeout_s, join_timeout_s=300)
    base = {"cuda": cuda, "plan": [[r, [[n, list(s), d] for n, s, d in b]] for r, b in plan],
            "address": {k: getattr(address, k) for k in ("host", "port", "world_size", "backend",
                                                          "timeout_s", "join_timeout_s")}}

    def start(rank, updates, die_in=None, die_at=None, linger=False):
        spec = {**base, "rank": rank, "gpu": rank, "updates": updates, "die_in": die_in,
                "die_at": die_at, "linger": linger}
        return subprocess.Popen([sys.executable, __file__, "member", json.dumps(spec)],
                                stdout=subprocess.PIPE, text=True)

    rows, events = [], {}
    group = None

    def send(gen, what):
        nonlocal group
        t0 = time.monotonic()
        if group is None:
            from dataclasses import replace
            group = init_weight_group(replace(address, generation=gen), 0)
        joined = time.monotonic() - t0
        t1 = time.monotonic()
        try:
            stats = broadcast_stage(group, plan, 0, sd.items(), device, timeout_s)
            s = time.monotonic() - t1
            outcome = f"ok: {stats.num_bytes / 2**30:.3f} GiB at {stats.num_bytes / s / 1e9:.2f} GB/s"
        except Exception as exc:       # noqa: BLE001 - the event's outcome
            s = time.monotonic() - t1
            outcome = type(exc).__name__ + (" (the host's deadline: group aborted)"
                                            if isinstance(exc, WireTimeout) else "")
            close_weight_group(group)
            group = None
        rows.append([what, f"{joined:.2f}", f"{s:.2f}", outcome])
        events[what] = {"join_s": joined, "s": s, "outcome": outcome}

    # The live workers (all but the last) take every update; the last worker's slot is held by
    # three processes in turn: killed between updates, killed inside one, then one that stays.
    live = [start(r, [0, 0, 1, 1, 2]) for r in range(1, receivers)]
    victim = start(receivers, [0], linger=True)
    send(0, "gen 0: update")
    first = victim.stdout.readline()
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=60)
    send(0, "gen 0: update, a worker SIGKILLed since the last one")
    second = start(receivers, [1, 1], die_in=1, die_at=3)
    send(1, "gen 1 (re-formed, a new worker): update")
    send(1, "gen 1: update, a worker SIGKILLed inside it")
    third = start(receivers, [2])
    send(2, "gen 2 (re-formed, a new worker): update")
    members = [json.loads(first)] if first.startswith("{") else []
    for p in [*live, second, third]:
        try:
            out, _ = p.communicate(timeout=timeout_s * 4 + 120)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        members += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    close_weight_group(group)
    report.table(["event (sender, GPU 0)", "join s", "update s", "outcome"], rows)
    report.table(["member", "update", "generation", "outcome"],
                 [[m["rank"], m["update"], m["gen"], f"{m['outcome']} after {m['s']:.1f} s"]
                  for m in members])
    return {"world": world, "timeout_s": timeout_s, "events": events, "members": members}


# ---------------------------------------------------------------- 9. P2P with narrowed devices

def _p2p(rank: int, port: int) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.ones(64 << 20, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    dist.destroy_process_group()


def check_p2p(report, cuda: bool) -> dict:
    if not cuda or gpu_count() < 2:
        report("skipped: needs two GPUs")
        return {"skipped": "fewer than two GPUs"}
    from areal_hpc.transport.rendezvous import reserve_port
    port = reserve_port()
    env = {**os.environ, "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,P2P,SHM,NET"}
    procs = [subprocess.Popen([sys.executable, __file__, "p2p", str(r), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    found = sorted({t for out in outs for t in TRANSPORTS.findall(out)})
    report.table(["ranks (each CUDA_VISIBLE_DEVICES=its own GPU)", "exit codes", "NCCL transports"],
                 [["0, 1", ",".join(str(p.returncode) for p in procs), ", ".join(found) or "none read"]])
    return {"transports": found, "exit": [p.returncode for p in procs]}


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "member":
        _member(json.loads(sys.argv[2]))
    elif cmd == "hold":
        _hold(sys.argv[2], float(sys.argv[3]))
    elif cmd == "p2p":
        _p2p(int(sys.argv[2]), int(sys.argv[3]))
    elif cmd != "noop":
        print(__doc__)
        sys.exit(2)
