"""What the other ranks of an MPI job can do when one rank dies, with the real MPICH wheel and
mpi4py of .venv under its own launcher (hydra's mpiexec): issue 39 item 3, docs/rank_death.md.

Each test runs tests/transport/rank_death_worker.py as 4 ranks; rank 3 dies (SIGKILL, or exit(1)
without MPI_Finalize) while ranks 0-2 are idle, receiving from it, sending to it or in a barrier
with it, and then they try p2p among themselves, collectives on a communicator of their own made
before the death and on one made after it (Create_group), a barrier on the world,
MPIX_Comm_get_failed and MPIX_Comm_shrink. Every wait
in the worker is bounded; the tests wait for the records the ranks write (events), with
generous limits that only guard against a hang."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from areal_hpc.reaper import kill_and_wait

pytestmark = pytest.mark.slow     # starts MPI worlds (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("rank_death_worker.py")
SURVIVORS = (0, 1, 2)
LIMIT_S = 240       # a failure guard: a run takes 1-20 s
# rank 3 (the victim) on a host of its own: hydra starts one proxy per host, here all on this
# machine (fork), as it would on two nodes
OWN_NODE = ["-launcher", "fork", "-hosts", "n1:3,n2:1"]
KEEP = ["-disable-auto-cleanup"]


def _env(extra: dict | None) -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MPIR_CVAR_", "FI_", "UCX_"))}
    return {**env, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(extra or {})}


def _records(out: Path) -> dict[int, list[dict]]:
    recs = {}
    for r in range(4):
        f = out / f"rank{r}.jsonl"
        lines = f.read_text().splitlines() if f.exists() else []
        recs[r] = [json.loads(line) for line in lines if line.endswith("}")]
    return recs


def _outcome(recs: dict, rank: int, prefix: str) -> tuple[str, str] | None:
    hit = [r for r in recs[rank] if r["event"].startswith(prefix)]
    return (hit[0]["outcome"], hit[0]["detail"]) if hit else None


def _end(out: Path) -> None:
    """End every process of this run that is still there (found by its unique output folder)."""
    mine = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if str(out) in " ".join(p.info["cmdline"] or []) and p.pid != os.getpid():
                mine.append(p)
        except psutil.Error:
            pass
    kill_and_wait(mine, timeout=30)


def _cmd(out: Path, case: str, how: str, opts: list[str]) -> list[str]:
    from areal_hpc.launch.local import mpiexec
    return [mpiexec(), *opts, "-n", "4", sys.executable, "-m", "mpi4py", str(WORKER), str(out),
            case, how]


def run(tmp_path: Path, case: str, how: str, opts: list[str], env: dict | None = None):
    """The job to its end (it ends by itself in every case run this way): (exit code, output,
    records of each rank)."""
    out = tmp_path / f"{case}-{how}"
    out.mkdir()
    try:
        r = subprocess.run(_cmd(out, case, how, opts), cwd=ROOT, env=_env(env), text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=LIMIT_S,
                           start_new_session=True)
    finally:
        _end(out)
    return r.returncode, r.stdout, _records(out)


def _victim_died(recs: dict) -> None:
    assert any(r["event"] == "dying" for r in recs[3]), recs[3]


def test_plain_mpiexec_ends_the_whole_job(tmp_path):
    rc, out, recs = run(tmp_path, "idle", "kill", [])
    _victim_died(recs)
    assert rc != 0 and "BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES" in out, out[-3000:]
    for r in SURVIVORS:     # killed at once: none got as far as the world barrier (5 s)
        assert _outcome(recs, r, "barrier on the world") is None, recs[r]
        assert _outcome(recs, r, "done") is None, recs[r]


@pytest.mark.parametrize("how", ["kill", "exit"])
def test_without_auto_cleanup_a_rank_killed_by_a_signal_takes_its_nodes_ranks(tmp_path, how):
    """hydra's proxy SIGKILLs every rank on its node when one of them ends by a signal, whatever
    -disable-auto-cleanup says; a rank that exits (here exit(1)) leaves them running."""
    rc, out, recs = run(tmp_path, "idle", how, KEEP)
    _victim_died(recs)
    assert rc != 0, out[-3000:]
    assert "BAD TERMINATION" not in out, out[-3000:]
    for r in SURVIVORS:
        if how == "kill":
            assert _outcome(recs, r, "done") is None, recs[r]
        else:
            assert _outcome(recs, r, "done") is not None, (recs[r], out[-3000:])
            assert _outcome(recs, r, "p2p among survivors")[0] == "ok", recs[r]
            assert _outcome(recs, r, "allreduce on alive")[0] == "ok", recs[r]


# what the survivors saw in each case, the victim killed on a node of its own, over UCX (the
# wheel's default netmod): nothing raised an error; what involves the dead rank never completes
CASES = {
    "idle": {},
    "recv": {0: ("case: blocking Recv from the victim", "timeout"),
             1: ("case: Irecv from the victim", "timeout"),
             2: ("case: Channel.poll from the victim", "timeout")},
    "send": {0: ("case: Isend of 4 MiB to the victim", "timeout"),
             1: ("case: Channel.flush to the victim", "timeout"),
             2: ("case: Isend of 8 bytes to the victim", "ok")},
    "coll": {r: ("case: barrier with the victim", "timeout") for r in SURVIVORS},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_without_auto_cleanup_the_ranks_of_other_nodes_go_on_without_an_error(tmp_path, case):
    rc, out, recs = run(tmp_path, case, "kill", KEEP + OWN_NODE)
    _victim_died(recs)
    assert rc != 0 and "BAD TERMINATION" not in out, out[-3000:]
    for r in SURVIVORS:
        seen = {rec["event"]: rec["outcome"] for rec in recs[r]}
        assert seen.get("done") == "info", (recs[r], out[-3000:])
        if r in CASES[case]:
            event, outcome = CASES[case][r]
            assert seen.get(event) == outcome, recs[r]
        # among themselves, on the world's communicator and on one made before the death
        assert seen["p2p among survivors"] == "ok", recs[r]
        assert seen["barrier on alive"] == seen["allreduce on alive"] == "ok", recs[r]
        # with the dead rank: no error, no end; MPICH's ch4 reports no failed process
        assert seen["barrier on the world"] == "timeout", recs[r]
        # a communicator of the survivors alone can still be made after the death, and works
        assert _outcome(recs, r, "Create_group of the survivors") == ("ok", "a communicator of 3 rank(s)"), recs[r]
        assert seen["barrier on the group made after the death"] == "ok", recs[r]
        assert _outcome(recs, r, "MPIX_Comm_get_failed") == ("ok", "failed world ranks []"), recs[r]
        assert seen["MPIX_Comm_shrink of the world"] == "timeout", recs[r]
        assert not any(rec["outcome"] == "error" for rec in recs[r]), recs[r]


def test_mpich_fault_tolerance_switch_aborts_at_init(tmp_path):
    """MPIR_CVAR_ENABLE_FT=1: MPICH's ch4 device asserts in MPI_Init (FT is ch3-only code)."""
    rc, out, recs = run(tmp_path, "idle", "kill", KEEP, env={"MPIR_CVAR_ENABLE_FT": "1"})
    assert rc != 0, out[-3000:]
    assert "Assertion failed" in out and "ch4" in out, out[-3000:]
    assert not any(_outcome(recs, r, "victim died") for r in SURVIVORS), recs


def _start_ofi(out: Path, case: str) -> tuple[subprocess.Popen, Path]:
    """The job over OFI tcp (what slurm/site_gpu.sh sets under srun's pmi2), victim on its own
    node, in the background: (mpiexec, its output file)."""
    out.mkdir()
    log = out.parent / f"{out.name}.out"
    env = _env({"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"})
    with open(log, "w") as f:
        proc = subprocess.Popen(_cmd(out, case, "kill", KEEP + OWN_NODE), cwd=ROOT, env=env,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def _kill(proc: subprocess.Popen, out: Path) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    _end(out)


def test_over_ofi_tcp_a_survivor_that_sends_to_the_dead_rank_is_stuck_inside_mpi(tmp_path):
    """In a barrier on the world the ranks that send to the dead one (1 and 2) do not come back
    from MPI calls at all, so no deadline of the caller's can fire; rank 0, which only
    receives, gives up at its bound. Nobody ends the job: it has to be killed from outside."""
    out = tmp_path / "ofi"
    proc, log = _start_ofi(out, "idle")
    try:
        deadline = time.monotonic() + LIMIT_S
        while _outcome(_records(out), 0, "barrier on the world") is None:
            assert proc.poll() is None and time.monotonic() < deadline, (_records(out), log.read_text()[-3000:])
            time.sleep(0.2)
        # rank 0 gave up at its 5 s bound; 1 and 2 started the same barrier within a second of
        # it and poll every 5 ms: give them three bounds more
        time.sleep(15)
        recs = _records(out)
        assert _outcome(recs, 0, "barrier on the world")[0] == "timeout", recs[0]
        for r in (1, 2):
            assert _outcome(recs, r, "allreduce on alive")[0] == "ok", recs[r]
            assert _outcome(recs, r, "barrier on the world") is None, recs[r]
        assert proc.poll() is None      # nobody ends the job
    finally:
        _kill(proc, out)

