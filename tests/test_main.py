"""areal_hpc.main's refused start, under a real mpiexec: one path (`main._refused`), exit 2 and
one line. A verdict every rank reached (the placement) is said once, by rank 0, and the ranks
leave together with MPI finalized (no abort); a rank's own refusal (its CPUs) is said by that
rank and its exit ends the job."""
import os
from pathlib import Path

WORKER = Path(__file__).with_name("main_worker.py")


def _start(world, case: str, *overrides: str) -> tuple[int, str]:
    """(exit code, output) of `mpiexec -n 2` ranks of main_worker.py (the suite's harness)."""
    proc = world.start(WORKER, 2, case, *overrides, env={"AREAL_SKIP_VERSION_CHECK": "1"})
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


def _errors(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error:")]


def test_a_placement_every_rank_refuses_is_said_once_and_the_ranks_leave_together(
        run_distributed, tmp_path):
    code, out = _start(run_distributed, "placement", f"output_dir={tmp_path}")
    assert code == 2, out[-3000:]
    assert _errors(out) == ["error: placement: n1: GPU 0 is given to rank 0 and rank 1 (and 1 more; "
                          "slurm/job.sh --dry-run prints the table)"], out[-3000:]
    assert "MPI_Abort" not in out, out[-3000:]                  # finalized, not aborted
    assert not (tmp_path / "tiny").exists()                     # nothing written for the run


def test_a_ranks_own_refusal_is_said_by_it_and_ends_the_job(run_distributed, tmp_path):
    cpu = max(os.sched_getaffinity(0)) + 1
    code, out = _start(run_distributed, "cpus", f"output_dir={tmp_path}", f"topology.trainer_cpus={cpu}")
    assert code == 2, out[-3000:]
    errors = _errors(out)
    assert errors and all(e.startswith("error: rank ") and f"topology.trainer_cpus: CPU(s) {cpu} are "
                          "not available here" in e for e in errors), out[-3000:]


def test_a_config_every_rank_refuses_is_said_once_before_mpi_starts(run_distributed, tmp_path):
    code, out = _start(run_distributed, "config", f"output_dir={tmp_path}", "train.total_steps=-1")
    assert code == 2, out[-3000:]
    assert len(_errors(out)) == 1 and "train.total_steps" in _errors(out)[0], out[-3000:]
