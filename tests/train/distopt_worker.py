"""One rank of the distributed-optimizer checkpoint test: a gloo world of DP ranks.

    python tests/train/distopt_worker.py RANK WORLD_SIZE PORT WORKDIR

WORKDIR/in.pkl holds `{"model_dir", "cfg": TrainConfig, "actor": Actor keyword arguments,
"batches": [seqs of step 0, 1, ...], "save_at": k}`. Four runs, each on a fresh Actor:

- `ref`: train every batch without interruption; checkpoints after 0 steps (before any optimizer
  step) and after `save_at` steps, then continues (saving must not disturb the run).
- `resumed`: load the step-`save_at` checkpoint, train the remaining batches.
- `from_zero`: load the step-0 checkpoint (no Adam state yet), train every batch.
- a plain-optimizer Actor loading the step-`save_at` checkpoint: `mismatch_error`.

Writes WORKDIR/out.<rank>.pkl: per run the per-step losses / grad norms / lrs, the gathered HF
weights at the end, and a summary of each optimizer state at the end (`_opt_state`).
"""

import dataclasses
import pickle
import sys
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist


class GlooComm:
    """The few MPI-communicator methods `checkpoint.save/load` use, over torch.distributed."""

    def Get_rank(self):
        return dist.get_rank()

    def Get_size(self):
        return dist.get_world_size()

    def Barrier(self):
        dist.barrier()

    def bcast(self, obj, root=0):
        box = [obj]
        dist.broadcast_object_list(box, src=root)
        return box[0]

    def gather(self, obj, root=0):
        out = [None] * dist.get_world_size() if dist.get_rank() == root else None
        dist.gather_object(obj, out, dst=root)
        return out


def _opt_state(actor) -> dict:
    """Every (param index -> step, exp_avg, exp_avg_sq) of this rank's inner torch optimizer, and
    whether any two params share one `step` tensor."""
    out, steps = {}, []
    inner = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    for oi, o in enumerate(inner):
        torch_opt = o.optimizer
        for gi, g in enumerate(torch_opt.param_groups):
            for pi, p in enumerate(g["params"]):
                st = torch_opt.state.get(p, {})
                if "step" in st:
                    steps.append(st["step"])
                out[(oi, gi, pi)] = {k: (v.clone() if torch.is_tensor(v) else v)
                                     for k, v in st.items()}
                out[(oi, gi, pi)]["param"] = p.detach().clone()
                out[(oi, gi, pi)]["group_lr"] = g["lr"]
    shared = len({id(s) for s in steps}) < len(steps)
    return {"state": out, "step_tensor_shared": shared}


def _train(actor, batches, start: int) -> list[dict]:
    return [actor.train_step(seqs, start + i) for i, seqs in enumerate(batches)]


def start_world() -> tuple[int, Path, dict, GlooComm, Callable]:
    """This rank's gloo world from the command line (RANK WORLD_SIZE PORT WORKDIR), Megatron's
    groups at tp = pp = 1 (every rank a DP rank): (rank, WORKDIR, WORKDIR/in.pkl's spec, the
    communicator, a maker of fresh Actors of the spec)."""
    rank, world, port, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    from areal_hpc.train.actor import Actor
    from areal_hpc.train.megatron_model import init_megatron_parallel

    spec = pickle.loads((work / "in.pkl").read_bytes())
    init_megatron_parallel(1, 1, seed=spec["cfg"].seed, backend="gloo")
    return rank, work, spec, GlooComm(), lambda: Actor(spec["cfg"], spec["model_dir"],
                                                       **spec["actor"])


def main() -> None:
    from areal_hpc.storage import checkpoint as ck
    from areal_hpc.train import checkpoint as train_ck
    from areal_hpc.train.actor import Actor

    rank, work, spec, comm, make = start_world()
    cfg, batches, k = spec["cfg"], spec["batches"], spec["save_at"]
    run_dir = work / "run"
    out = {}

    def finish(tag, actor, stats):
        out[tag] = {"stats": stats, "weights": actor.hf_state_dict(), "opt": _opt_state(actor)}

    # Uninterrupted reference, checkpointing before the first optimizer step and after k steps.
    a = make()
    train_ck.save(run_dir, 0, model=a.model, optimizer=a.optimizer, scheduler=a.lr_scheduler,
                  comm=comm, keep=10)
    stats = _train(a, batches[:k], 0)
    train_ck.save(run_dir, k, model=a.model, optimizer=a.optimizer, scheduler=a.lr_scheduler,
                  comm=comm, keep=10)
    out["ref_at_save"] = _opt_state(a)
    stats += _train(a, batches[k:], k)
    finish("ref", a, stats)
    del a

    # Fresh Actor, resumed from step k.
    b = make()
    train_ck.load(ck.step_dir(run_dir, k), model=b.model, optimizer=b.optimizer,
                  scheduler=b.lr_scheduler, comm=comm)
    out["resumed_after_load"] = _opt_state(b)
    finish("resumed", b, _train(b, batches[k:], k))
    del b

    # Fresh Actor, resumed from the checkpoint written before any optimizer step.
    c = make()
    try:
        train_ck.load(ck.step_dir(run_dir, 0), model=c.model, optimizer=c.optimizer,
                      scheduler=c.lr_scheduler, comm=comm)
        finish("from_zero", c, _train(c, batches, 0))
    except Exception as exc:            # reported to the test, which decides
        out["from_zero_error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
    del c

    # The plain optimizer cannot take the distributed optimizer's state: refused, naming why.
    d = Actor(dataclasses.replace(cfg, distributed_optimizer=False), spec["model_dir"],
              **spec["actor"])
    try:
        train_ck.load(ck.step_dir(run_dir, k), model=d.model, optimizer=d.optimizer, comm=comm)
        out["mismatch_error"] = None
    except Exception as exc:
        out["mismatch_error"] = f"{type(exc).__name__}: {exc}"
    (work / f"out.{rank}.pkl").write_bytes(pickle.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
