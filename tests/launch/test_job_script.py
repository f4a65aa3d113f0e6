"""slurm/job.sh's own logic without a cluster: fake `srun`, `scontrol` and python on PATH stand in
for Slurm and the ranks (tests/launch/test_slurm.py runs the same script on the local cluster).
What the GPU recipes' site file gives each het component, and the requeue rule: an attempt that
ends without a new checkpoint is requeued only a few times in a row."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The colon form's components run one after another, each as its het component's one task
# (SLURM_PROCID = the component's index); job.sh's step options are skipped.
FAKE_SRUN = """#!/usr/bin/env bash
if [ "$1" = --mpi=list ]; then printf 'MPI plugin types are...\\n\\tnone\\n\\tpmi2\\n'; exit 0; fi
k=0 rc=0 cmd=()
run() { SLURM_PROCID=$k "${cmd[@]}" || rc=$?; k=$((k + 1)); cmd=(); }
for a in "$@"; do
  if [ "$a" = : ]; then run
  elif [ ${#cmd[@]} = 0 ] && [[ $a == -* ]]; then continue
  else cmd+=("$a"); fi
done
run
exit $rc
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
echo "scontrol $*" >>"$FAKE_CALLS"
"""
# python for job.sh: launch.env's exports for a 1 + 1 CPU job, ranks that print what they were
# given, write a checkpoint (FAKE_CHECKPOINT) and exit with FAKE_RC; anything else is python.
FAKE_PYTHON = """#!/usr/bin/env bash
case "$*" in
  "-m areal_hpc.launch.env "*)
    printf 'export %s\\n' "AREAL_RUN_DIR=$FAKE_RUN" AREAL_N_TRAINERS=1 AREAL_N_GENERATORS=1 \\
      AREAL_GPUS_PER_TRAINER=0 AREAL_GPUS_PER_GENERATOR=0 ;;
  "-m mpi4py -m areal_hpc.main "*)
    echo "rank $SLURM_PROCID CUDA_DEVICE_MAX_CONNECTIONS=${{CUDA_DEVICE_MAX_CONNECTIONS-unset}}" \\
      "MPIR_CVAR_CH4_NETMOD=${{MPIR_CVAR_CH4_NETMOD-unset}}"
    if [ -n "${{FAKE_CHECKPOINT:-}}" ] && [ "$SLURM_PROCID" = 0 ]; then
      mkdir -p "$FAKE_RUN/checkpoints/$FAKE_CHECKPOINT" && touch "$FAKE_RUN/checkpoints/$FAKE_CHECKPOINT/manifest.json"
    fi
    exit "${{FAKE_RC:-0}}" ;;
  *) exec {python} "$@" ;;
esac
"""


def _fakes(tmp_path) -> dict:
    """A clean environment (no MPI or CUDA variables of this shell) with the fakes first on PATH,
    as the batch shell of job 4242, attempt 0, would have it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL),
                       ("python", FAKE_PYTHON.format(python=sys.executable))):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8",
            "AREAL_PYTHON": str(bin_dir / "python"), "FAKE_RUN": str(tmp_path / "run"),
            "FAKE_CALLS": str(tmp_path / "calls"), "SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0",
            "SLURM_HET_SIZE": "2", "SLURM_NTASKS_HET_GROUP_0": "1", "SLURM_NTASKS_HET_GROUP_1": "1"}


def _job(env, site: bool = False, **extra) -> subprocess.CompletedProcess:
    body = "exec bash slurm/job.sh configs/tiny_cpu.yaml"
    return subprocess.run(["bash", "-c", f"source slurm/site_gpu.sh || exit 2; {body}" if site else body],
                          cwd=ROOT, env={**env, **extra}, capture_output=True, text=True, timeout=60)


def _ranks(env, attempt: int = 0) -> list[str]:
    return (Path(env["FAKE_RUN"]) / f"logs/job-4242/attempt-{attempt}/ranks.log").read_text().splitlines()


def test_site_file_gives_megatron_variables_to_the_trainers_alone(tmp_path):
    """slurm/site_gpu.sh as shipped: CUDA_DEVICE_MAX_CONNECTIONS=1 reaches the trainer ranks (het
    component 0) and not the generators' vLLM engines; MPICH's netmod defaults to OFI for every
    rank (the MPICH wheel, under pmi2), and job.sh's log says so. A user's own values win."""
    env = _fakes(tmp_path)
    r = _job(env, site=True)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "MPI: srun --mpi=pmi2; FI_PROVIDER=tcp MPIR_CVAR_CH4_NETMOD=ofi" in r.stdout, r.stdout
    assert _ranks(env) == ["rank 0 CUDA_DEVICE_MAX_CONNECTIONS=1 MPIR_CVAR_CH4_NETMOD=ofi",
                           "rank 1 CUDA_DEVICE_MAX_CONNECTIONS=unset MPIR_CVAR_CH4_NETMOD=ofi"]
    r = _job(env, site=True, SLURM_RESTART_COUNT="1", MPIR_CVAR_CH4_NETMOD="ucx", CUDA_DEVICE_MAX_CONNECTIONS="2")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert _ranks(env, 1) == ["rank 0 CUDA_DEVICE_MAX_CONNECTIONS=2 MPIR_CVAR_CH4_NETMOD=ucx",
                              "rank 1 CUDA_DEVICE_MAX_CONNECTIONS=2 MPIR_CVAR_CH4_NETMOD=ucx"]
    r = _job(env, AREAL_TRAINER_ENV="CUDA_DEVICE_MAX_CONNECTIONS")
    assert r.returncode == 2 and "error: AREAL_TRAINER_ENV holds 'CUDA_DEVICE_MAX_CONNECTIONS', not K=V" in r.stdout


def test_attempts_without_a_new_checkpoint_are_not_requeued_forever(tmp_path):
    """Ranks that exit 3 (preempted) get the job requeued; an attempt that wrote no checkpoint
    newer than the one it started from counts, and the third such attempt in a row ends the job
    (exit 1) with one line instead of another requeue. A new checkpoint resets the count; a
    plain failure is not requeued at all."""
    env = _fakes(tmp_path)
    calls = Path(env["FAKE_CALLS"])
    plan = [(None, "requeue", "the start (no checkpoint yet)"),     # a failure before the first checkpoint
            ("step_00000004", "requeue", "step_00000004"),          # progress: the count starts again
            (None, "requeue", "step_00000004"),
            (None, "requeue", "step_00000004"),
            (None, "stop", None)]
    for attempt, (checkpoint, verdict, resume) in enumerate(plan):
        calls.unlink(missing_ok=True)
        if verdict == "stop":      # a re-save's folder beside a checkpoint is not a new checkpoint
            resave = Path(env["FAKE_RUN"]) / "checkpoints/step_00000009.next"
            resave.mkdir()
            (resave / "manifest.json").touch()
        r = _job(env, SLURM_RESTART_COUNT=str(attempt), FAKE_RC="3", FAKE_CHECKPOINT=checkpoint or "")
        if verdict == "requeue":
            assert r.returncode == 0, (attempt, r.stdout, r.stderr)
            assert f"preempted (exit code 3): requeueing job 4242; the next attempt resumes from {resume}" \
                in r.stdout, r.stdout
            assert calls.read_text() == "scontrol requeue 4242\n"
        else:
            errors = [line for line in r.stdout.splitlines() if "error" in line]
            assert r.returncode == 1 and not calls.exists(), (r.stdout, r.stderr)
            assert len(errors) == 1 and errors[0].endswith(
                "error: preempted (exit code 3), but 3 attempt(s) in a row ended without a new checkpoint "
                "(newest: step_00000004): not requeueing job 4242 again (AREAL_MAX_ATTEMPTS_WITHOUT_CHECKPOINT=3)"), r.stdout
    r = _job(env, SLURM_RESTART_COUNT="5", FAKE_RC="1")
    assert r.returncode == 1 and "requeue" not in r.stdout and not calls.exists(), r.stdout


WHEEL = "MPICH Version:      5.0.2\nMPICH Release date: ...\nMPICH Device:       ch4:ucx ofi\nMPICH configure: ..."


def test_the_ofi_provider_default_leaves_nccls_fabric_alone_and_follows_its_interface():
    """On an EFA or Slingshot node the default provider is that fabric's (FI_PROVIDER is
    libfabric's process-wide filter, which NCCL's OFI plugin shares in the trainers); with tcp,
    MPI's interface is NCCL's (FI_TCP_IFACE, its first match here). The site's own win."""
    from areal_hpc.launch.mpi_env import defaults
    netmod = {"MPIR_CVAR_CH4_NETMOD": "ofi"}
    assert defaults(WHEEL, {}, fabric="efa") == {**netmod, "FI_PROVIDER": "efa"}
    assert defaults(WHEEL, {}, fabric="cxi") == {**netmod, "FI_PROVIDER": "cxi"}
    assert defaults(WHEEL, {"FI_PROVIDER": "verbs"}, fabric="efa") == netmod
    names = ["lo", "eno1", "ib0", "ib1"]
    for spec, iface in (("ib", "ib0"), ("=ib1", "ib1"), ("^lo,eno", "ib0"), ("eth", None)):
        env = {"NCCL_SOCKET_IFNAME": spec}
        want = {**netmod, "FI_PROVIDER": "tcp"} | ({"FI_TCP_IFACE": iface} if iface else {})
        assert defaults(WHEEL, env, interfaces=names) == want, spec
    assert defaults(WHEEL, {"NCCL_SOCKET_IFNAME": "ib", "FI_TCP_IFACE": "eno1"},
                    interfaces=names) == {**netmod, "FI_PROVIDER": "tcp"}
    assert defaults(WHEEL, {"NCCL_SOCKET_IFNAME": "ib"}, fabric="efa", interfaces=names) == \
        {**netmod, "FI_PROVIDER": "efa"}


def test_a_nodes_fabric_is_read_from_sysfs_and_dev(tmp_path):
    from areal_hpc.launch.mpi_env import node_fabric

    def device(name, driver):
        d = tmp_path / name / "sys/bus/pci/drivers" / driver
        d.mkdir(parents=True)
        link = tmp_path / name / "sys/class/infiniband" / f"{driver}_0" / "device"
        link.mkdir(parents=True)
        (link / "driver").symlink_to(d)
        return str(tmp_path / name)
    assert node_fabric(device("efa_node", "efa")) == "efa"
    assert node_fabric(device("ib_node", "mlx5_core")) is None     # NCCL's own IB transport
    (tmp_path / "cxi_node/dev").mkdir(parents=True)
    (tmp_path / "cxi_node/dev/cxi0").touch()
    assert node_fabric(str(tmp_path / "cxi_node")) == "cxi"
    assert node_fabric(str(tmp_path / "empty")) is None


def test_mpich_netmod_default_only_where_it_helps():
    """OFI by default for an MPICH whose default netmod is UCX but which has OFI (the wheel),
    under pmi2, when nothing was chosen; never for another MPI or an MPICH without OFI."""
    from areal_hpc.launch.mpi_env import defaults, mpich_netmods
    assert mpich_netmods(WHEEL) == ["ucx", "ofi"]
    assert defaults(WHEEL, {}) == {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
    assert defaults(WHEEL, {"AREAL_SRUN_MPI": "pmi2"}) == {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
    assert defaults(WHEEL, {"FI_PROVIDER": "efa"}) == {"MPIR_CVAR_CH4_NETMOD": "ofi"}   # the site's
    for env in ({"MPIR_CVAR_CH4_NETMOD": "ucx"}, {"MPIR_CVAR_PMI_VERSION": "2"}, {"AREAL_SRUN_MPI": "pmix"}):
        assert defaults(WHEEL, env) == {}, env
    for other in (WHEEL.replace("ch4:ucx ofi", "ch4:ucx"), WHEEL.replace("ch4:ucx ofi", "ch4:ofi"),
                  WHEEL.replace("ch4:ucx ofi", "ch3:nemesis"),
                  "MPI VERSION    : CRAY MPICH version 8.1.28 (ANL base 3.4a2)",
                  "Intel(R) MPI Library 2021.13 for Linux* OS", "Open MPI v5.0.5, package: Open MPI", ""):
        assert defaults(other, {}) == {}, other
