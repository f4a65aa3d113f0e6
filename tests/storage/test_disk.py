"""storage/disk.py: the free-space checks (at the launch, before each checkpoint save) against a
statvfs that says how much is free, the run directory's file system from mountinfo lines and what
it means for HDF5, the launchers' environment (HDF5 locking, slurm/job.sh's node-local vLLM
cache), and the rollout log's bytes a row and a token against the writer's own datasets."""
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from areal_hpc.config import ConfigError, load
from areal_hpc.launch.env import export_lines, rank_env
from areal_hpc.plan import read_arch
from areal_hpc.storage import disk
from areal_hpc.storage.manifest import MANIFEST, step_dir
from areal_hpc.storage.rollout_log import RolloutWriter

ROOT = Path(__file__).resolve().parents[2]
R32 = ROOT / "configs/qwen2_5_32b_math.yaml"
GiB = 2**30


class FakeStatvfs:
    """os.statvfs's answer for a file system with `free` bytes available."""

    def __init__(self, free: int):
        self.f_frsize, self.f_bavail = 1, free


def _free(monkeypatch, free: int) -> list[str]:
    """os.statvfs says `free` bytes; returns the paths it was asked about."""
    asked = []

    def statvfs(path):
        asked.append(str(path))
        return FakeStatvfs(free)
    monkeypatch.setattr(os, "statvfs", statvfs)
    return asked


def _cfg(tmp_path, *overrides):
    return load(R32, [f"output_dir={tmp_path}/runs", *overrides])


def _row_bytes(cfg) -> int:
    """One row of the 32B recipe at its longest: 27648 output tokens, 1024 of prompt."""
    return 186 + 13 * 27648 + 4 * (28672 - 27648)


# ---- free space ---------------------------------------------------------------------------------

def test_the_launch_refuses_a_run_dir_without_room_for_its_checkpoints(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    params = read_arch(cfg).total_params
    asked = _free(monkeypatch, 100 * GiB)
    said = []
    with pytest.raises(ConfigError) as err:
        disk.check_start(cfg, params, say=said.append)
    line = str(err.value)
    # keep 2 + the one being written, each 14 B a parameter; the log over the 3 steps until the
    # third save (a checkpoint every step); the 1 GiB margin
    need = 3 * 14 * params + 3 * 512 * 32 * _row_bytes(cfg) + GiB
    assert "\n" not in line and line.startswith("config key 'output_dir': no room for run qwen2_5_32b_math in "
                                                f"{tmp_path}/runs/qwen2_5_32b_math (")
    assert f"100.0 GiB free, {need / GiB:.1f} GiB needed (3 checkpoint(s) of {14 * params / GiB:.1f} GiB" in line
    assert "checkpoint.keep=2, 0 there" in line and "x 14 B (bfloat16 weights, fp32 main weights" in line
    for key in ("output_dir", "checkpoint.keep", "checkpoint.every_steps", "checkpoint.disk_margin_gb"):
        assert key in line.split("): ")[-1], line
    assert asked and all(Path(p) == tmp_path for p in asked)     # the run dir's nearest folder
    assert len(said) == 1 and said[0].startswith(f"run dir {tmp_path}/runs/qwen2_5_32b_math: ")

    _free(monkeypatch, need)                # exactly enough passes
    got = disk.check_start(cfg, params, say=said.append)
    assert got.total == need and (got.checkpoints, got.log_steps) == (3, 3)
    _free(monkeypatch, 0)                   # null: no check, the line still said
    assert disk.check_start(_cfg(tmp_path, "checkpoint.disk_margin_gb=null"), params, say=said.append) is None
    assert len(said) == 3
    # a dry run (slurm/job.sh --dry-run: placement only) says the same line as a warning
    _free(monkeypatch, 100 * GiB)
    dry = disk.check_start(cfg, params, say=said.append, dry_run=True)
    assert dry.total == need and said[-1] == f"warning (a dry run: the job itself would be refused): {line}"


def test_checkpoints_already_there_and_the_saves_left_bound_the_launchs_need(tmp_path, monkeypatch):
    _free(monkeypatch, 1 << 60)
    cfg = _cfg(tmp_path, "checkpoint.every_steps=10", "train.total_steps=25", "checkpoint.keep=3")
    run = Path(cfg.run_dir)
    quiet = [].append
    # afresh: keep 3 + 1 = 4 checkpoints, but only 3 saves (10, 20, the final 25): 25 steps of log
    need = disk.check_start(cfg, 1000, say=quiet)
    assert (need.checkpoints, need.log_steps, need.checkpoint_bytes) == (3, 25, 14000)
    # resumed at 10 with one checkpoint there: 2 saves left (20, 25), 15 steps; a manifest that
    # lists more bytes than the estimate is believed
    step_dir(run, 10).mkdir(parents=True)
    (step_dir(run, 10) / MANIFEST).write_text(json.dumps({"step": 10, "bytes": 50000, "files": {}}))
    step_dir(run, 5).mkdir(parents=True)        # no manifest: a save that did not finish
    need = disk.check_start(cfg, 1000, say=quiet)
    assert (need.checkpoints, need.log_steps, need.checkpoint_bytes) == (2, 15, 50000)
    # at keep + 1 checkpoints already: one more before the oldest goes
    for s in (3, 6, 8):
        step_dir(run, s).mkdir(parents=True)
        (step_dir(run, s) / MANIFEST).write_text(json.dumps({"step": s, "bytes": 1}))
    need = disk.check_start(cfg, 1000, say=quiet)
    assert (need.checkpoints, need.log_steps) == (1, 10)
    # complete: nothing to check
    assert disk.check_start(load(R32, [f"output_dir={tmp_path}/runs", "train.total_steps=10"]), 1000,
                            say=quiet) is None


def test_a_save_without_room_is_refused_with_one_line_and_one_with_room_passes(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, "checkpoint.every_steps=4", "train.total_steps=20")
    space = disk.SaveSpace(cfg, lambda: 10**9)
    step = disk.log_bytes_per_step(cfg)
    assert step == 512 * 32 * _row_bytes(cfg)
    need = 14 * 10**9 + 4 * step + GiB             # step 8: the log until step 12
    _free(monkeypatch, need - 1)
    with pytest.raises(disk.NoSpace) as err:
        space.check(8)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"no room for the checkpoint of step 8 in {cfg.run_dir} (")
    assert f"{(need - 1) / GiB:.1f} GiB free, {need / GiB:.1f} GiB needed" in line
    assert "over 4 step(s)" in line and "nothing of it written, the newest checkpoint kept" in line
    for key in ("checkpoint.every_steps", "checkpoint.keep", "checkpoint.disk_margin_gb"):
        assert key in line
    _free(monkeypatch, need)
    space.check(8)
    # the final save: no log after it; a preemption's save of the step just saved links its shards
    assert space.need(20).total == 14 * 10**9 + GiB
    assert space.need(8, relink=True).total == 4 * step + GiB
    # weights.mode=disk on the same file system: one more version during the next update
    disk_mode = disk.SaveSpace(_cfg(tmp_path, "checkpoint.every_steps=4", "weights.mode=disk"), lambda: 10**9)
    assert disk_mode.need(8).total - space.need(8).total == 2 * 10**9
    _free(monkeypatch, 0)
    disk.SaveSpace(_cfg(tmp_path, "checkpoint.disk_margin_gb=null"), lambda: 10**9).check(8)


def test_a_checkpoint_save_is_not_started_without_room(tmp_path, monkeypatch):
    """The trainer's Checkpointer with its SaveSpace: the save of step 4 raises before any
    folder of it exists (model and optimizer are never touched)."""
    from areal_hpc.train.checkpoint import Checkpointer
    cfg = _cfg(tmp_path)
    _free(monkeypatch, GiB)
    saver = Checkpointer(cfg.run_dir, space=disk.SaveSpace(cfg, lambda: 10**9))
    with pytest.raises(disk.NoSpace, match=r"^no room for the checkpoint of step 4 in .*: 1\.0 GiB free"):
        saver.save(4, model=None, optimizer=None)
    assert not (Path(cfg.run_dir) / "checkpoints").exists()
    assert disk.EXIT_NO_SPACE == 2          # a refused start's code: slurm/job.sh ends the job


def test_the_rollout_log_bytes_are_the_writers(tmp_path):
    w = RolloutWriter(tmp_path / "r.h5")
    try:
        size = lambda ds: np.dtype(ds.dtype).itemsize
        assert sum(size(ds) for ds in w.f["traj"].values()) == disk.ROW_BYTES
        tokens = {name: size(ds) for name, ds in w.f["tokens"].items()}
        assert tokens.pop("prompt") == disk.PROMPT_TOKEN_BYTES
        assert sum(tokens.values()) == disk.OUTPUT_TOKEN_BYTES
        assert disk.TURN_BYTES == sum(size(ds) for ds in w.f["turns"].values())
        assert disk.TOOL_BYTES == sum(size(ds) for ds in w.f["tools"].values())
    finally:
        w.close()


# ---- the file system ----------------------------------------------------------------------------

MOUNTINFO = r"""27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
120 27 0:52 / /lustre rw,relatime shared:60 - lustre 10.0.0.1@o2ib:/scratch rw,flock,lazystatfs
121 27 0:53 / /lhome rw,relatime shared:61 - lustre 10.0.0.1@o2ib:/home rw,localflock,lazystatfs
122 27 0:54 / /proj rw,relatime shared:62 master:3 - lustre 10.0.0.1@tcp:/proj rw,lazystatfs
123 27 0:55 / /noflock rw,relatime - lustre mgs@tcp:/nf rw,noflock
130 27 0:60 / /nfs3 rw,relatime shared:70 - nfs fs1:/export rw,vers=3,hard,nolock,proto=tcp,local_lock=all,addr=10.0.0.2
131 27 0:61 / /shared rw,relatime shared:71 - nfs4 fs2:/export rw,vers=4.2,hard,proto=tcp,local_lock=none,addr=10.0.0.2
140 27 8:17 / /scratch rw,noatime shared:80 - xfs /dev/sdb1 rw,attr2,inode64,noquota
150 27 0:70 / /gpfs/fs1 rw,relatime shared:90 - gpfs fs1 rw
160 27 0:23 / /dev/shm rw,nosuid,nodev - tmpfs tmpfs rw,size=24683772k
170 27 0:30 / /ctr rw,relatime - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w
180 27 0:80 / /mnt/my\040disk rw - ext4 /dev/sdc rw
190 27 0:90 / /stack rw - nfs4 fs3:/a rw
191 190 0:91 / /stack rw - xfs /dev/sdd rw
not a mountinfo line
"""


@pytest.mark.parametrize("path, fstype, no_locking, swmr, says", [
    ("/lustre/u/run", "lustre", False, True, "Lustre with flock"),
    ("/lhome/u", "lustre", False, True, "Lustre with localflock"),
    ("/proj/u/runs/x", "lustre", True, True, "Lustre without flock"),
    ("/noflock", "lustre", True, True, "Lustre without flock"),
    ("/nfs3/runs", "nfs", True, False, "NFS (local_lock=all, nolock)"),
    ("/shared/runs", "nfs4", True, False, "reading the rollout log while the job writes it is not reliable"),
    ("/scratch/r", "xfs", False, True, "a local file system"),
    ("/gpfs/fs1/u", "gpfs", False, True, "GPFS"),
    ("/dev/shm/x", "tmpfs", False, True, "a local file system"),
    ("/ctr/x", "overlay", False, True, "a local file system"),
    ("/lustrex/u", "ext4", False, True, "a local file system"),        # a prefix of a name is not a mount
    ("/mnt/my disk/r", "ext4", False, True, "a local file system"),     # \040 is a space
    ("/stack/r", "xfs", False, True, "a local file system"),            # the later mount hides the earlier
    ("/", "ext4", False, True, "a local file system"),
])
def test_mountinfo_gives_each_file_systems_hdf5_advice(path, fstype, no_locking, swmr, says):
    mounts = disk.parse_mountinfo(MOUNTINFO)
    assert len(mounts) == 14
    m = disk.find_mount(path, mounts)
    assert m.fstype == fstype
    advice = disk.hdf5_advice(m)
    assert (advice.no_locking, advice.swmr) == (no_locking, swmr) and says in advice.says
    if no_locking:
        assert "turned off" in advice.says
    else:
        assert "nothing to do" in advice.says


def test_mountinfo_fields():
    mounts = disk.parse_mountinfo(MOUNTINFO)
    lustre = disk.find_mount("/lustre", mounts)
    assert (lustre.point, lustre.source) == ("/lustre", "10.0.0.1@o2ib:/scratch")
    assert {"rw", "relatime", "flock", "lazystatfs"} <= lustre.options      # the mount's and the fs's
    assert disk.find_mount("/mnt/my disk", mounts).point == "/mnt/my disk"
    assert "nothing to do" not in disk.hdf5_advice(disk.Mount("/x", "beegfs", "b", frozenset())).says
    assert "not in /proc/self/mountinfo" in disk.hdf5_advice(None).says


def test_this_machines_mountinfo_names_the_file_system_of_the_current_directory():
    text = Path("/proc/self/mountinfo").read_text()
    mounts = disk.parse_mountinfo(text)
    assert len(mounts) == len([ln for ln in text.splitlines() if " - " in ln])
    m = disk.mount_of(".")
    assert m is not None and m.fstype and m.point
    assert os.stat(m.point).st_dev == os.stat(".").st_dev          # the mount point is on that fs
    assert disk.mount_of(Path.cwd() / "not/made/yet") == m
    line = disk.fs_line(Path.cwd())
    assert line.startswith(f"run dir {Path.cwd()}: {m.fstype} at {m.point} ({m.source}): ")


NFS_ROOT = "1 0 0:40 / / rw - nfs4 server:/export rw,vers=4.2,local_lock=none\n"


def test_the_launchers_turn_hdf5_locking_off_on_nfs_unless_the_job_chose(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    monkeypatch.delenv(disk.LOCKING_ENV, raising=False)
    monkeypatch.setattr(disk, "read_mountinfo", lambda: NFS_ROOT)
    assert rank_env(cfg)[disk.LOCKING_ENV] == "FALSE"
    assert f"export {disk.LOCKING_ENV}=FALSE" in export_lines(cfg)
    line = disk.fs_line(cfg.run_dir)
    assert "nfs4 at / (server:/export): NFS (local_lock=none)" in line
    assert line.endswith(f"; {disk.LOCKING_ENV}=FALSE set for the ranks (the job had not set it)")
    warning = disk.locking_warning(cfg.run_dir)
    assert "is on nfs4 at /" in warning and f"export {disk.LOCKING_ENV}=FALSE" in warning

    monkeypatch.setenv(disk.LOCKING_ENV, "BEST_EFFORT")     # the job's own choice wins
    assert not any(ln.startswith(f"export {disk.LOCKING_ENV}=") for ln in export_lines(cfg))
    assert disk.fs_line(cfg.run_dir).endswith(f"; {disk.LOCKING_ENV}=BEST_EFFORT from the environment kept")
    assert disk.locking_warning(cfg.run_dir) is None

    monkeypatch.delenv(disk.LOCKING_ENV)
    monkeypatch.setattr(disk, "read_mountinfo", lambda: MOUNTINFO)       # ext4 at /: nothing
    assert disk.LOCKING_ENV not in rank_env(cfg)
    assert disk.locking_warning(cfg.run_dir) is None


# ---- vLLM's compile cache under Slurm ----------------------------------------------------------

def test_job_sh_puts_vllms_cache_on_node_local_disk_unless_set(tmp_path):
    """slurm/job.sh's VLLM_CACHE_ROOT line, run by bash: $SLURM_TMPDIR, else $TMPDIR, else /tmp;
    a VLLM_CACHE_ROOT of the job's wins. The local launcher keeps the repository's cache."""
    lines = [ln for ln in (ROOT / "slurm/job.sh").read_text().splitlines()
             if ln.startswith("export VLLM_CACHE_ROOT=")]
    assert len(lines) == 1

    def root(**env) -> str:
        r = subprocess.run(["bash", "-c", f'set -u; {lines[0]}; echo "$VLLM_CACHE_ROOT"'],
                           env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()
    uid = os.getuid()
    assert root() == f"/tmp/areal_hpc-vllm-cache-{uid}"
    assert root(TMPDIR="/local/job7") == f"/local/job7/areal_hpc-vllm-cache-{uid}"
    assert root(TMPDIR="/local/job7", SLURM_TMPDIR="/ssd/7") == f"/ssd/7/areal_hpc-vllm-cache-{uid}"
    assert root(VLLM_CACHE_ROOT="/mine", TMPDIR="/local/job7") == "/mine"
    assert rank_env(_cfg(tmp_path))["VLLM_CACHE_ROOT"] == str((ROOT / ".cache/vllm").resolve())
