"""areal_hpc.main's refused start, under a real mpiexec: one path (`main._refused`), exit 2 and
one line. A verdict every rank reached (the placement) is said once, by rank 0, and the ranks
leave together with MPI finalized (no abort); a rank's own refusal (its CPUs) is said by that
rank and its exit ends the job."""
import os
import subprocess
import sys
from pathlib import Path

from areal_hpc.launch.local import mpiexec

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("main_worker.py")


def _start(case: str, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "AREAL_SKIP_VERSION_CHECK": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", str(WORKER), case,
                           *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _errors(r) -> list[str]:
    return [line for line in r.stderr.splitlines() if line.startswith("error:")]


def test_a_placement_every_rank_refuses_is_said_once_and_the_ranks_leave_together(tmp_path):
    r = _start("placement", f"output_dir={tmp_path}")
    assert r.returncode == 2, r.stderr[-3000:]
    assert _errors(r) == ["error: placement: n1: GPU 0 is given to rank 0 and rank 1 (and 1 more; "
                          "slurm/job.sh --dry-run prints the table)"], r.stderr[-3000:]
    assert "MPI_Abort" not in r.stderr, r.stderr[-3000:]        # finalized, not aborted
    assert not (tmp_path / "tiny").exists()                     # nothing written for the run


def test_a_ranks_own_refusal_is_said_by_it_and_ends_the_job(tmp_path):
    cpu = max(os.sched_getaffinity(0)) + 1
    r = _start("cpus", f"output_dir={tmp_path}", f"topology.trainer_cpus={cpu}")
    assert r.returncode == 2, r.stderr[-3000:]
    errors = _errors(r)
    assert errors and all(e.startswith("error: rank ") and f"topology.trainer_cpus: CPU(s) {cpu} are "
                          "not available here" in e for e in errors), r.stderr[-3000:]


def test_a_config_every_rank_refuses_is_said_once_before_mpi_starts(tmp_path):
    r = _start("config", f"output_dir={tmp_path}", "train.total_steps=-1")
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(_errors(r)) == 1 and "train.total_steps" in _errors(r)[0], r.stderr[-3000:]
