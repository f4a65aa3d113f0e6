"""One rank of the multi-rank asynchronous checkpoint test: a gloo world of DP ranks with the
distributed optimizer (each rank writes its own optimizer shard).

    python tests/train/async_ckpt_worker.py RANK WORLD_SIZE PORT WORKDIR

WORKDIR/in.pkl holds `{"model_dir", "cfg": TrainConfig, "actor": Actor keyword arguments,
"batches": [seqs, seqs]}`. One step is trained, then the same state is saved synchronously
(run `sync`) and asynchronously (run `async`, step 1) while the second batch trains; the async
save is sealed after that. Fresh Actors load each checkpoint. Writes WORKDIR/out.<rank>.pkl:
the optimizer state at the save and after each load (`distopt_worker._opt_state`), the
gathered weights at the save and after each load, what resume found before and after the seal,
the shard files each rank's writer read back, and whether the save was in flight.
"""

import pickle
import sys
import traceback

from tests.train.distopt_worker import _opt_state, start_world


def main() -> None:
    from areal_hpc.storage import checkpoint as ck
    from areal_hpc.train import checkpoint as train_ck

    rank, work, spec, comm, make = start_world()
    batches = spec["batches"]
    out = {}
    a = make()
    a.train_step(batches[0], 0)
    out["at_save"] = {"opt": _opt_state(a), "weights": a.hf_state_dict()}
    train_ck.save(work / "sync", 1, model=a.model, optimizer=a.optimizer,
                  scheduler=a.lr_scheduler, comm=comm)
    saver = train_ck.Checkpointer(work / "async", comm=comm, async_save=True)
    out["returned"] = saver.save(1, model=a.model, optimizer=a.optimizer,
                                 scheduler=a.lr_scheduler, wait=False)
    folder = ck.step_dir(work / "async", 1)
    out["found_in_flight"] = train_ck.find_resume(work / "async", comm)
    a.train_step(batches[1], 1)             # changes every shard while the writers write
    out["sealed"] = str(saver.wait())
    out["found"] = str(train_ck.find_resume(work / "async", comm)[0])
    manifest = ck.validate(folder)
    out["own_shards"] = sorted(rel for rel in manifest["files"]
                               if train_ck.shard_owner(rel) == rank)
    for run in ("sync", "async"):
        b = make()
        train_ck.load(ck.step_dir(work / run, 1), model=b.model, optimizer=b.optimizer,
                      scheduler=b.lr_scheduler, comm=comm)
        out[run] = {"opt": _opt_state(b), "weights": b.hf_state_dict()}
    (work / f"out.{rank}.pkl").write_bytes(pickle.dumps(out))


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
