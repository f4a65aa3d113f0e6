"""One trainer rank of the weight-path tests, under `mpiexec -n W python -m mpi4py`:

    weights_worker.py WORKDIR

WORKDIR/in.pkl holds {"cases": [{"tag", "tp", "pp", "port", "version", "mode", "model_dir"},
...], "torch_port"}. For each case Megatron is rebuilt over the W ranks (dp = W / (tp*pp)) from
the case's `model_dir`, and the trainer's own `WeightPublisher` plans and publishes (no controller:
the test process plays the generator and calls `update_weights` itself). Rank 0 writes
WORKDIR/<tag>.plan.pkl once the plan is known (the generator needs it) and <tag>.done after
publishing. Broadcast cases join the weight group at 127.0.0.1:<port> as stage senders.

A case with "train": {"seqs", "out", "cfg", "group_size"} first runs one `Actor.train_step`
(`TrainConfig(**cfg)`, `group_size`) on the sequences pickled at `seqs` (waited for: the test
writes them once its generator has produced them), saves the trained policy as a HF directory
in `out` and writes <out>/result.pkl: the log-probs before the step, the step's statistics, the
shapes of rank 0's embedding and output-layer parameters and the Actor's build time (HF →
Megatron); then publishes the trained weights.
"""

import os
import pickle
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    from mpi4py import MPI
    from megatron.core import parallel_state

    from areal_hpc.config import RunConfig, TrainConfig
    from areal_hpc.train.actor import Actor
    from areal_hpc.train.layout import ParallelLayout
    from areal_hpc.train.weight_publisher import WeightPublisher
    from areal_hpc.transport import weights as wsync

    work = Path(sys.argv[1])
    spec = pickle.loads((work / "in.pkl").read_bytes())
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['torch_port']}",
                            rank=comm.Get_rank(), world_size=comm.Get_size())
    for case in spec["cases"]:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        layout = ParallelLayout.create(case["tp"], case["pp"], seed=0, backend="gloo")
        cfg = RunConfig()
        cfg.topology.pp = case["pp"]
        cfg.weights.mode = case["mode"]
        cfg.weights.bucket_mb = 1       # several buckets even for the tiny model
        cfg.weights.timeout_s = 120
        train = case.get("train")
        t0 = time.perf_counter()
        actor = Actor(TrainConfig(**(train or {}).get("cfg", {})), case["model_dir"],
                      group_size=(train or {}).get("group_size", 1), layout=layout)
        if train is not None:
            _train_step(actor, train, comm, build_s=time.perf_counter() - t0)
        group = None
        if case["mode"] == "broadcast" and actor.is_weight_sender:
            address = wsync.WeightGroupAddress("127.0.0.1", case["port"], case["pp"] + 1, "gloo",
                                               timeout_s=120, join_timeout_s=600)
            group = wsync.init_weight_group(address, actor.weight_stage)
        publisher = WeightPublisher(cfg.weights, actor, comm, pp=case["pp"],
                                    collective_timeout_s=cfg.rollout.collective_timeout_s,
                                    weight_dir=str(work / "weights"), group=group)
        plan = publisher.plan()
        if comm.Get_rank() == 0:
            _publish(work / f"{case['tag']}.plan.pkl", pickle.dumps(plan))
        publisher.publish(case["version"])
        if comm.Get_rank() == 0:
            _publish(work / f"{case['tag']}.done",
                     str(wsync.version_dir(publisher.weight_dir, case["version"])).encode())
        comm.Barrier()
    dist.destroy_process_group()


def _train_step(actor, train: dict, comm, build_s: float, timeout_s: float = 900) -> None:
    seqs_path = Path(train["seqs"])
    deadline = time.monotonic() + timeout_s
    while not seqs_path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {seqs_path} after {timeout_s} s")
        time.sleep(0.2)
    seqs = pickle.loads(seqs_path.read_bytes())
    before = actor.compute_logprobs(seqs)
    stats = actor.train_step(seqs, version=0)
    actor.save_hf(train["out"])
    shapes = {n: tuple(p.shape) for n, p in actor.model.named_parameters() if "embedding" in n or "output_layer" in n}
    if comm.Get_rank() == 0:
        _publish(Path(train["out"]) / "result.pkl",
                 pickle.dumps({"logprobs": before, "stats": stats, "shapes": shapes, "build_s": build_s}))


def _publish(path: Path, data: bytes) -> None:
    """Write `data` whole under `path`: the test polls for the name and reads it at once, so the
    name appears only after the bytes are there."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
