"""The Slurm path on a local cluster whose fake nodes are hosts of their own
(`AREAL_SLURM_NETNS=1 tools/local_slurm.sh`): each slurmd, and so each job step, runs in its own
network, UTS and mount namespaces, with host name nodeK, its own address on a private subnet and
its own /etc/hosts. A rank that advertises a loopback address, or code that takes every rank for one
host, fails here as it would on a real cluster, where it passes on the default cluster (one host
name, 127.0.0.1 for every node)."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch.test_slurm import SMALL, _client_env, _model_args, _ranks_log_tail, _sh, _steps

ROOT = Path(__file__).resolve().parents[2]
TOOL = str(ROOT / "tools/local_slurm.sh")
NODES = 4           # the 32B rehearsal (test_rehearse.py): 2 hosts a component


@pytest.fixture(scope="session")
def netns_cluster():
    """{"env": a Slurm client's environment, "nodes": {node: (holder pid, address)}} of the
    namespaced local cluster, brought up for this session (without slurmdbd: nothing here needs
    sacct) unless one already runs (then it is left running)."""
    if os.geteuid() != 0:
        pytest.skip("the namespaced local cluster needs root (network namespaces)")
    missing = [c for c in ("unshare", "nsenter", "ip") if shutil.which(c) is None]
    if missing:
        pytest.skip(f"the namespaced local cluster needs {', '.join(missing)} (util-linux, iproute2)")
    have = all(shutil.which(c) or os.path.exists(f"/usr/sbin/{c}") for c in ("slurmctld", "slurmd"))
    if not have and shutil.which("apt-get") is None:
        pytest.skip("no local Slurm: tools/local_slurm.sh installs it with apt-get")
    tool_env = {**os.environ, "AREAL_SLURM_NETNS": "1", "AREAL_SLURM_DBD": "0"}
    status = _sh(TOOL, "status", env=tool_env, check=False)
    started = status.returncode != 0
    if started:
        up = _sh(TOOL, "up", str(NODES), env=tool_env, timeout=900, check=False)
        assert up.returncode == 0, (up.stdout, up.stderr[-4000:])
        status = _sh(TOOL, "status", env=tool_env)
    nodes = {m[0]: (int(m[1]), m[2]) for m in
             re.findall(r"^(node\d+): namespaces of pid (\d+), node\d+ ([\d.]+)/\d+$", status.stdout, re.M)}
    assert len(nodes) >= NODES, status.stdout
    yield {"env": _client_env(status.stdout), "nodes": nodes}
    if started:
        _sh(TOOL, "down", env=tool_env, timeout=120, check=False)


def _eth0_bytes(pid: int) -> int:
    """Bytes received by a fake node's eth0 (read in its network namespace)."""
    out = subprocess.run(["nsenter", "-t", str(pid), "--net", "ip", "-s", "-j", "link", "show", "eth0"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)[0]["stats64"]["rx"]["bytes"]


HET_SHOW = """#!/usr/bin/env bash
#SBATCH --nodes=1 --ntasks=1
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks=1
echo "batch on $(hostname)"
srun --het-group=0,1 --label bash -c 'echo "host=$(hostname) slurmd=$SLURMD_NODENAME \\
resolved=$(getent hosts "$(hostname)" | cut -d" " -f1) eth0=$(ip -o -4 addr show eth0 | awk "{print \\$4}") \\
boot=$(cat /proc/sys/kernel/random/boot_id)"'
"""


def test_netns_hetjob_tasks_are_on_separate_hosts(netns_cluster, tmp_path):
    """The two components' tasks see different host names (= their Slurm node names), each name
    resolves to that node's own non-loopback address (on its eth0), and the boot ids differ (UCX
    takes one boot id for one host)."""
    script, out = tmp_path / "show.sh", tmp_path / "show.out"
    script.write_text(HET_SHOW)
    _sh("sbatch", "--wait", f"--output={out}", str(script), env=netns_cluster["env"], timeout=120)
    text = out.read_text(errors="replace")
    tasks = [dict(kv.split("=", 1) for kv in line.split(": ", 1)[1].split())
             for line in text.splitlines() if re.match(r"\d+: host=", line)]
    assert len(tasks) == 2, text
    assert re.search(r"^batch on node\d+$", text, re.M), text
    for t in tasks:
        assert t["host"] == t["slurmd"], t
        address = t["eth0"].split("/")[0]
        assert t["resolved"] == address == netns_cluster["nodes"][t["host"]][1], t
        assert not address.startswith("127."), t
    assert len({t["host"] for t in tasks}) == len({t["resolved"] for t in tasks}) == 2, tasks
    assert len({t["boot"] for t in tasks}) == 2, tasks


def test_netns_sbatch_tiny_hetjob(netns_cluster, jobs, tiny_model, tmp_path):
    """slurm/areal_tiny.sh with the trainer rank and the generator rank on two namespaced nodes:
    MPI (srun --mpi=pmi2), the torch.distributed rendezvous at trainer rank 0's resolved address
    and the weight broadcasts all cross the nodes' network (the generator node's eth0 receives
    more than twice the model's weights: 3 versions are sent)."""
    env, nodes = netns_cluster["env"], netns_cluster["nodes"]
    out = tmp_path / "batch.out"
    before = {n: _eth0_bytes(pid) for n, (pid, _) in nodes.items()}
    r = _sh("sbatch", "--wait", "--parsable", f"--output={out}", "slurm/areal_tiny.sh", *SMALL,
            *_model_args(tiny_model, tmp_path, "sb"), env=jobs.env(env), timeout=900, check=False)
    log = out.read_text(errors="replace") if out.exists() else ""
    job = r.stdout.strip().split(";")[0]
    if r.returncode != 0:
        pytest.fail(f"sbatch exit {r.returncode}\n{r.stderr[-1000:]}\n{log[-1500:]}\n"
                    f"{_ranks_log_tail(tmp_path / 'sb', job)}")
    assert "2 het component(s)" in log and "ranks ended with exit code 0" in log, log
    m = re.search(r"trainers on (node\d+) .*generators on (node\d+) ", log)
    assert m and m[1] != m[2], log
    run = tmp_path / "sb"
    ranks = (run / f"logs/job-{job}/attempt-0/ranks.log").read_text(errors="replace")
    assert re.search(r"^0: ", ranks, re.M) and re.search(r"^1: ", ranks, re.M)
    assert _steps(run) == [0, 1, 2] and (run / "rollouts.h5").exists()
    weights = (Path(tiny_model) / "model.safetensors").stat().st_size
    received = _eth0_bytes(nodes[m[2]][0]) - before[m[2]]
    assert received >= 2 * weights, (received, weights)
    assert not jobs.leftovers(), "processes of the job are still running"


# Runs "$@" as a host whose /etc/hosts names it 127.0.1.1 (Debian's entry), in a mount namespace of
# its own, with the rendezvous address set (AREAL_HOST_ADDR): what is left is gloo's binding.
DEBIAN_HOSTS = """#!/usr/bin/env bash
f=$(mktemp)
printf '127.0.0.1 localhost\\n127.0.1.1 %s\\n' "$(hostname)" >"$f"
export AREAL_HOST_ADDR=$(hostname -I | cut -d' ' -f1)
exec unshare --mount sh -c 'mount --bind "$0" /etc/hosts && exec "$@"' "$f" "$@"
"""
GLOO_PLACEMENT = """#!/usr/bin/env bash
#SBATCH --nodes=1 --ntasks=1
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks=1
source slurm/site_gpu.sh || exit 2
srun --het-group=0,1 --mpi="$AREAL_SRUN_MPI" --kill-on-bad-exit=1 {hosts} "$AREAL_PYTHON" -m mpi4py \\
  -m areal_hpc.launch.placement configs/tiny_cpu.yaml model.path=x data.train_path=x
"""


def test_netns_gloo_on_loopback_across_hosts_is_refused(netns_cluster, tmp_path):
    """The tiny job's placement check on two hosts whose names resolve to 127.0.1.1: gloo (both
    ranks' groups on CPU) would bind loopback, and rank 0 refuses the job in one line; with
    GLOO_SOCKET_IFNAME=eth0 it passes. The MPI world is slurm/site_gpu.sh's as shipped (MPICH
    over OFI, the provider libfabric picks), across the two hosts."""
    hosts, script = tmp_path / "debian_hosts.sh", tmp_path / "gloo.sh"
    hosts.write_text(DEBIAN_HOSTS)
    hosts.chmod(0o755)
    script.write_text(GLOO_PLACEMENT.format(hosts=hosts))
    env = {k: v for k, v in netns_cluster["env"].items() if not re.match(r"(MPIR_CVAR|FI|UCX)_", k)}
    env["AREAL_PYTHON"] = sys.executable
    for gloo, rc in (("", 2), ("eth0", 0)):
        out = tmp_path / f"gloo{gloo}.out"
        r = _sh("sbatch", "--wait", f"--output={out}", str(script), env={**env, "GLOO_SOCKET_IFNAME": gloo},
                timeout=300, check=False)
        log = out.read_text(errors="replace")
        assert (r.returncode != 0) == bool(rc), log[-3000:]
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        if rc:
            assert len(errors) == 1 and re.match(
                r"error: placement: rank 0 \(trainer\) on node\d: gloo would bind loopback 127\.0\.1\.1 \(the "
                r"address host name node\d resolves to\) but the ranks' gloo groups span 2 hosts \(1 more rank", errors[0]), log
        else:
            assert not errors and "placement: 2 rank(s) on 2 node(s)" in log, log
            assert re.search(r"rank +0 trainer .* iface eth0 -> eth0  gloo eth0", log), log


REQUEUED_MPI = """#!/usr/bin/env bash
#SBATCH --nodes=1 --ntasks=2 --requeue --open-mode=append
# attempt 0: two ranks start MPI (their node's MPICH segment), say the segments they map (not
# another job's beside them), wait until the test has taken note ($GO exists) and are killed;
# attempt 1 (same job and step ids, so the same segment names) starts MPI again.
py={py}
if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then
  srun --mpi=pmi2 "$py" -c 'from mpi4py import MPI; import os, time
from areal_hpc.reaper import shm_mapped
MPI.COMM_WORLD.Barrier(); print("segments", *sorted(shm_mapped(os.getpid())), flush=True)
deadline = time.monotonic() + 300
while not os.path.exists(os.environ["GO"]) and time.monotonic() < deadline: time.sleep(0.1)
MPI.COMM_WORLD.Barrier(); os.kill(os.getpid(), 9)'
  scontrol requeue "$SLURM_JOB_ID"; exit 0
fi
if [ "$CLEAN" = 1 ]; then
  "$py" -c 'from areal_hpc.reaper import remove_stale_segments; print("removed", *remove_stale_segments(min_age_s=1))'
fi
timeout 30 srun --mpi=pmi2 "$py" -c 'from mpi4py import MPI; MPI.COMM_WORLD.Barrier(); print("started", MPI.COMM_WORLD.rank)'
echo "second start: exit $?"
"""


@pytest.mark.parametrize("clean", [0, 1])
def test_a_requeued_jobs_mpi_start_is_not_broken_by_its_killed_attempts_segments(netns_cluster, tmp_path, clean):
    """MPICH names a node's shared-memory segment after the PMI job name, which a requeued Slurm
    job repeats; a killed attempt leaves its segment behind, and the next attempt's MPI_Init
    takes it for its own: it fails or hangs (here bounded by `timeout 30`). What main.py does
    before MPI starts (reaper.remove_stale_segments) removes it, and the start succeeds."""
    from areal_hpc.launch.rehearse import job_info, release, until
    env = {k: v for k, v in netns_cluster["env"].items() if not re.match(r"(MPIR_CVAR|FI|UCX)_", k)}
    go = tmp_path / "go"
    env = {**env, "CLEAN": str(clean), "PYTHONPATH": str(ROOT), "GO": str(go)}
    script, out = tmp_path / "requeued.sh", tmp_path / "requeued.out"
    script.write_text(REQUEUED_MPI.format(py=sys.executable))
    before = {str(p) for p in Path("/dev/shm").glob("mpich_*")}
    job = _sh("sbatch", "--parsable", f"--output={out}", str(script), env=env).stdout.strip()
    holder = None
    try:
        until(lambda: out.exists() and out.read_text().count("segments ") == 2, 300,
              "the first attempt's MPI start")
        if not clean:
            # Another test's job beside this one (tools/test.sh runs two workers) removes stale
            # unmapped segments before its MPI starts, the killed attempt's among them: a
            # process here maps them, while the first attempt's ranks still do, until the second
            # start, as a rank of the killed attempt still alive would, so that only this job's
            # own start meets them.
            mine = sorted({p for line in re.findall(r"^segments (.*)$", out.read_text(), re.M)
                           for p in line.split()} - before)
            holder = subprocess.Popen([sys.executable, "-c", (
                "import mmap, os, sys, time\n"
                "maps = [mmap.mmap(os.open(p, os.O_RDWR), 0) for p in sys.argv[1:]]\n"
                "print('mapped', len(maps), flush=True); time.sleep(600)"), *mine],
                stdout=subprocess.PIPE, text=True)
            assert holder.stdout.readline().strip() == f"mapped {len(mine)}" and mine, mine
        go.touch()
        until(lambda: job_info(job, env).get("Restarts") == "1", 300, "the requeue")
        release(job, env)
        until(lambda: job_info(job, env).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"),
              300, "the second attempt")
    finally:
        _sh("scancel", job, env=env, check=False)
        if holder is not None:
            holder.kill()
            holder.wait(timeout=60)
    text = out.read_text(errors="replace")
    left = re.search(r"^segments (.*)$", text, re.M)
    assert left and "mpich_shm_" in left[1], text
    if clean:
        removed = re.search(r"^removed (.*)$", text, re.M)
        assert removed and removed[1].strip(), text
        # The killed attempt's own segments were removed. Another job's (a test run beside this
        # one on the host) may be listed too: there before this job, or alive and still there
        # once it is done. One of its own left behind would also fail the second start, below.
        seen, gone = set(left[1].split()), set(removed[1].split())
        others = before | {s for s in seen - gone if Path(s).exists()}
        assert seen - others <= gone, text
        assert "second start: exit 0" in text and text.count("started ") == 2, text
    else:       # the second attempt ran, and its MPI start failed or hung
        assert "second start: exit " in text and "second start: exit 0" not in text, text
