"""Run under `mpiexec -n N python -m mpi4py tests/storage/resume_crc_worker.py OUT_DIR RUN_DIR...`.

Every rank finds the checkpoint to resume from in each RUN_DIR collectively (the trainer's
`checkpoint.find_resume`: the CRC-32 checks split over the ranks, each taking the shard files it
wrote), then once more by bytes alone (`find_latest` with the communicator, no owner), and writes
OUT_DIR/rank<R>.json: per call the step found, the messages of the checkpoints passed over, the
bytes and files it read for CRC-32s and the seconds it took."""
import json
import sys
import time
from pathlib import Path

from mpi4py import MPI

from areal_hpc.storage import checkpoint as store
from areal_hpc.train.checkpoint import find_resume

BOUND = 120.0


def main(out: Path, run_dirs: list[str]) -> None:
    comm = MPI.COMM_WORLD.Dup()
    comm.Set_name("trainer communicator")
    me = comm.Get_rank()
    report = {}
    for run_dir in run_dirs:
        for how in ("owner", "bytes"):
            stats: dict = {}
            t0 = time.monotonic()
            if how == "owner":
                hit = find_resume(run_dir, comm, timeout_s=BOUND, stats=stats)
            else:
                hit = store.find_latest(run_dir, comm=comm, timeout_s=BOUND, stats=stats)
            report[f"{Path(run_dir).name}/{how}"] = {
                "step": hit[1]["step"] if hit else None, "path": str(hit[0]) if hit else None,
                "rejected": stats["rejected"], "bytes": stats["bytes"], "files": stats["files"],
                "seconds": round(time.monotonic() - t0, 4)}
    (out / f"rank{me}.json").write_text(json.dumps(report))
    comm.Free()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
