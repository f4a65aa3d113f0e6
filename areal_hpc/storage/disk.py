"""The run directory's disk: room for what is about to be written, and the file system it is on
(what that means for HDF5's file locks and SWMR readers).

Free space. A 32B checkpoint is ~460 GB (every parameter's weight in model.dtype, and for a half-
precision model its fp32 main weight, plus Adam's two fp32 moments: 14 B a parameter; 12 B in
fp32, which has no main copy: what train/checkpoint.py saves through Megatron's dist-
checkpointing, each replica once), and the rollout log grows by up to ~6 GB a step (B x n rows of
`ROW_BYTES`, their tokens at `PROMPT_TOKEN_BYTES` / `OUTPUT_TOKEN_BYTES`). The oldest checkpoint
is deleted only once a newer one is complete (storage/checkpoint.py `seal`), so a run holds up to
checkpoint.keep + 1 of them. `os.statvfs` of the run directory is compared with what is needed:

- at the launch (`check_start`, from preflight.launcher, every attempt): the checkpoints written
  before the oldest is deleted (keep + 1, less those already there, at most the saves left), the
  rollout log's growth until the last of them, and checkpoint.disk_margin_gb; too little is a
  ConfigError line naming the directory, the bytes free and needed, and the keys that change it.
- before each save (`SaveSpace.check`, from train/checkpoint.py `Checkpointer.save`, once the
  save in flight is complete and pruned, before the new one's folder exists): the checkpoint (or
  none, when a preemption's save of the step just saved links its shards), the log's growth until
  the next save (none once a preemption signal came), the margin. Trainer rank 0 looks, every
  trainer rank raises `NoSpace` with its line: nothing of the save is written and the newest
  checkpoint stays as it was. The trainer then stops the generators and the job ends with
  `EXIT_NO_SPACE` (train/trainer.py `run_trainer`).

`EXIT_NO_SPACE` is 2, a refused start's code (main.py `_refused`), reached by every rank together
(MPI finalized, no abort): slurm/job.sh ends the job with it (it requeues exit 3, a stuck rank,
and any failure after a preemption signal; exit 3 here would requeue a run that cannot save until
the attempts-without-a-checkpoint bound). When a preemption signal came first (the refused save
was the preemption's), job.sh requeues once; the next attempt's launch check refuses in one line
before any rank starts, unless space was freed meanwhile, and the job ends there.
Weight versions in weights.mode=disk count too when their folder is on the run directory's file
system (two at the launch, one more during an update).

File system. `mount_of` finds the run directory's mount in /proc/self/mountinfo (the longest
mount point above its real path: the file system's type, its source and options, `flock`,
`localflock` on Lustre, `nolock` / `local_lock=` on NFS), `hdf5_advice` says what that means:
HDF5 takes a file lock (flock) on every open; on NFS the lock manager makes it fail or hang, and
Lustre mounted without flock refuses flock() (ENOSYS: "unable to lock file"), so there
HDF5_USE_FILE_LOCKING=FALSE; SWMR readers (reading the rollout log while the job writes it) need
POSIX write ordering, which NFS does not give. Local file systems, GPFS and Lustre with flock or
localflock need nothing. HDF5 reads the variable once, when it starts (h5py's import: tested with
HDF5 2.0), before any rank has read its config, so it is set in the ranks' environment by the
launchers (`hdf5_env` in launch/env.py `rank_env`, unless the job set it), and the launch says so
in one line (`fs_line`); a rank started otherwise warns (`locking_warning`, main.py). h5py's
per-open `locking=` argument would do it in-process, at every h5py.File of the package instead.
"""
from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from .. import preemption
from ..config import ConfigError, RunConfig
from ..transport import mpi as coll
from .episode_log import GROUPS
from .manifest import MANIFEST, list_checkpoints, step_of
from .run_dir import WEIGHTS
from .run_state import is_int, no_constant

GiB = 2**30
EXIT_NO_SPACE = 2       # main.py's refused start: slurm/job.sh ends the job (module docstring)

# The rollout log (storage/rollout_log.py; tests/storage/test_disk.py pins these to the writer's
# datasets): per row its /traj fields and the commit marker, per prompt token /tokens/prompt, per
# output token output, behav_logprobs, versions and loss_mask.
ROW_BYTES = 186
PROMPT_TOKEN_BYTES = 4
OUTPUT_TOKEN_BYTES = 13
TURN_BYTES = sum(np.dtype(d).itemsize for d in GROUPS["turns"].values())
TOOL_BYTES = sum(np.dtype(d).itemsize for d in GROUPS["tools"].values())

MARGIN_KEY = "checkpoint.disk_margin_gb"
LOCKING_ENV = "HDF5_USE_FILE_LOCKING"


class NoSpace(RuntimeError):
    """Too little free space for a checkpoint save: raised on every trainer rank before any byte
    of it is written (`SaveSpace.check`); the message is the one line to say."""


# ------------------------------------------------------------------------------ what is written

def checkpoint_bytes_per_param(dtype: str) -> int:
    """Bytes a checkpoint holds per parameter, optimizer state included (the module docstring)."""
    return 12 if dtype == "float32" else 14


def _per_param_why(dtype: str) -> str:
    return ("fp32 weights, Adam's 2 moments" if dtype == "float32"
            else f"{dtype} weights, fp32 main weights, Adam's 2 moments")


def log_bytes_per_step(cfg: RunConfig) -> int:
    """The most one step's batch adds to the rollout log: B x n rows, each at most as long as the
    engine allows (prompt + output <= rollout.max_model_len, output <= rollout.max_new_tokens; an
    episode's output, turns and observations, <= env.max_episode_tokens) with its turns and tool
    calls. Rows dropped as too stale come on top: the margin's."""
    r, e = cfg.rollout, cfg.env
    rows = cfg.train.batch_prompts * r.group_size
    if e.fn:
        out = e.max_episode_tokens or r.max_model_len
        row = (ROW_BYTES + out * OUTPUT_TOKEN_BYTES + 2 * e.max_turns * TURN_BYTES
               + e.max_turns * TOOL_BYTES)
    else:
        out = min(r.max_new_tokens, r.max_model_len)
        row = ROW_BYTES + out * OUTPUT_TOKEN_BYTES + (r.max_model_len - out) * PROMPT_TOKEN_BYTES
    return rows * row


def next_save(cfg: RunConfig, step: int) -> int:
    """The step of the first checkpoint after `step` (< total_steps): the next multiple of
    checkpoint.every_steps below total_steps, else the final one at total_steps."""
    total, every = cfg.train.total_steps, cfg.checkpoint.every_steps
    return min(total, (step // every + 1) * every) if every else total


def _saves_after(cfg: RunConfig, step: int) -> int:
    """How many checkpoints the run writes after `step` (< total_steps), the final one included."""
    total, every = cfg.train.total_steps, cfg.checkpoint.every_steps
    return (max(0, (total - 1) // every - step // every) if every else 0) + 1


def _nth_save(cfg: RunConfig, step: int, n: int) -> int:
    total, every = cfg.train.total_steps, cfg.checkpoint.every_steps
    k = (step // every + n) * every if every else total
    return k if k < total else total


def _checkpoints_here(run_dir: Path) -> list[tuple[int, int | None]]:
    """(step, bytes its manifest lists or None) of every folder with a manifest, newest first."""
    out = []
    try:
        folders = list_checkpoints(run_dir)
    except OSError:
        return out
    for ckpt in folders:
        path = ckpt / MANIFEST
        if not path.is_file():
            continue
        try:
            size = json.loads(path.read_text(), parse_constant=no_constant).get("bytes")
        except (OSError, ValueError, AttributeError, RecursionError):
            size = None
        out.append((step_of(ckpt), size if is_int(size) and size >= 0 else None))
    return out


def _checkpoint_size(cfg: RunConfig, params: int, here: list[tuple[int, int | None]]) -> tuple[int, str]:
    """(bytes of one checkpoint, how they were counted): the parameters at
    `checkpoint_bytes_per_param`, or the newest manifest's bytes where they are more."""
    per = checkpoint_bytes_per_param(cfg.model.dtype)
    count = f"{params / 1e9:.2f}e9" if params >= 10**8 else f"{params:,}"
    size, why = params * per, f"{count} parameters x {per} B ({_per_param_why(cfg.model.dtype)})"
    listed = next((b for _, b in here if b is not None), None)
    if listed is not None and listed > size:
        size, why = listed, "as the newest checkpoint's manifest lists"
    return size, why


# ------------------------------------------------------------------------------ free space

def existing(path: str | os.PathLike) -> Path:
    """`path`, or its nearest folder above that exists (a run directory not made yet)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged process may still write on `path`'s file system."""
    st = os.statvfs(existing(path))
    return st.f_bavail * st.f_frsize


def _same_fs(a, b) -> bool:
    try:
        return os.stat(existing(a)).st_dev == os.stat(existing(b)).st_dev
    except OSError:
        return True


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class Need:
    """What is about to be written in a run directory, term by term."""
    checkpoints: int            # written before any is deleted
    checkpoint_bytes: int
    checkpoint_why: str
    log_steps: int              # steps of rollout-log growth
    log_step_bytes: int
    weight_versions: int        # weights.mode=disk versions on the same file system
    weight_bytes: int
    margin: int

    @property
    def total(self) -> int:
        return (self.checkpoints * self.checkpoint_bytes + self.log_steps * self.log_step_bytes
                + self.weight_versions * self.weight_bytes + self.margin)

    def terms(self, why_count: str = "") -> str:
        parts = []
        if self.checkpoints:
            parts.append(f"{self.checkpoints} checkpoint(s) of {_gib(self.checkpoint_bytes)}{why_count}: "
                         f"{self.checkpoint_why}")
        if self.log_steps:
            parts.append(f"the rollout log's growth over {self.log_steps} step(s), at "
                         f"most {_gib(self.log_step_bytes)} each")
        if self.weight_versions:
            parts.append(f"{self.weight_versions} weight version(s) of {_gib(self.weight_bytes)} "
                         f"(weights.mode=disk)")
        parts.append(f"{_gib(self.margin)} margin ({MARGIN_KEY})")
        return "; ".join(parts)


def _weights(cfg: RunConfig, params: int, versions: int) -> tuple[int, int]:
    """(versions, bytes each) of weights.mode=disk's folder when on the run directory's file system."""
    folder = cfg.weights.disk_dir or Path(cfg.run_dir) / WEIGHTS
    if cfg.weights.mode != "disk" or not _same_fs(folder, cfg.run_dir):
        return 0, 0
    return versions, params * (4 if cfg.model.dtype == "float32" else 2)


def _where(run_dir) -> str:
    m = mount_of(run_dir)
    return f"{run_dir} ({m.fstype} at {m.point})" if m else str(run_dir)


def check_start(cfg: RunConfig, params: int, say: Callable[[str], None] | None = None,
                dry_run: bool = False) -> Need | None:
    """The launch's check (preflight.launcher): the run directory's file system said in one line
    (`fs_line`, to `say`, default stderr), then its free space against what the run writes before
    its oldest checkpoint is deleted (the module docstring); ConfigError when short, or with
    `dry_run` (slurm/job.sh --dry-run: placement only, nothing written) the same line said as a
    warning. Returns what was needed, or None (no check: checkpoint.disk_margin_gb null, or no
    step left)."""
    run_dir = Path(cfg.run_dir)
    say = say or (lambda line: print(f"[launch] {line}", file=sys.stderr, flush=True))
    say(fs_line(run_dir))
    ck, total = cfg.checkpoint, cfg.train.total_steps
    if ck.disk_margin_gb is None:
        return None
    here = _checkpoints_here(run_dir)
    start = here[0][0] if here and ck.resume == "auto" else 0
    if start >= total:
        return None
    n = min(_saves_after(cfg, start), max(1, ck.keep + 1 - len(here)))
    size, why = _checkpoint_size(cfg, params, here)
    need = Need(n, size, why, _nth_save(cfg, start, n) - start, log_bytes_per_step(cfg),
                *_weights(cfg, params, 2), int(ck.disk_margin_gb * GiB))
    free = free_bytes(run_dir)
    if free < need.total:
        line = (f"config key 'output_dir': no room for run {cfg.name} in {_where(run_dir)}: "
                f"{_gib(free)} free, {_gib(need.total)} needed ("
                + need.terms(f", written before the oldest is deleted (checkpoint.keep={ck.keep}, "
                             f"{len(here)} there)")
                + f"): free space there, or change output_dir, checkpoint.keep, "
                f"checkpoint.every_steps, or {MARGIN_KEY} (null: no check)")
        if not dry_run:
            raise ConfigError(line)
        say(f"warning (a dry run: the job itself would be refused): {line}")
    return need


class SaveSpace:
    """The check before each checkpoint save (train/checkpoint.py `Checkpointer`, which the
    trainer gives it). `params()`: the model's parameter count (called on trainer rank 0, at the
    first save that checks)."""

    def __init__(self, cfg: RunConfig, params: Callable[[], int]):
        self.cfg, self._params, self._count = cfg, params, None

    def need(self, step: int, relink: bool = False) -> Need:
        """What the save of `step` and the steps until the next save write (the module docstring);
        `relink`: its shards are links to those of the checkpoint of `step` just saved."""
        cfg = self.cfg
        if self._count is None:
            self._count = self._params()
        ahead = (0 if step >= cfg.train.total_steps or preemption.requested()
                 else next_save(cfg, step) - step)
        size, why = _checkpoint_size(cfg, self._count, _checkpoints_here(Path(cfg.run_dir))[:1])
        return Need(0 if relink else 1, size, why, ahead, log_bytes_per_step(cfg),
                    *_weights(cfg, self._count, 1 if ahead else 0),
                    int(cfg.checkpoint.disk_margin_gb * GiB))

    def problem(self, step: int, relink: bool = False) -> str | None:
        """The one line refusing the save of `step`, or None when the run directory has room."""
        need, run_dir = self.need(step, relink), self.cfg.run_dir
        free = free_bytes(run_dir)
        if free >= need.total:
            return None
        return (f"no room for the checkpoint of step {step} in {_where(run_dir)}: {_gib(free)} free, "
                f"{_gib(need.total)} needed ({need.terms()}); nothing of it written, the newest "
                f"checkpoint kept: free space there and rerun to resume, or change "
                f"checkpoint.every_steps, checkpoint.keep or {MARGIN_KEY} (null: no check)")

    def check(self, step: int, relink: bool = False, comm=None) -> None:
        """Raise NoSpace on every trainer rank (collective over `comm`, the MPI trainer
        communicator; rank 0 looks) when the run directory has no room for the save of `step`."""
        if self.cfg.checkpoint.disk_margin_gb is None:
            return
        rank0 = comm is None or comm.Get_rank() == 0
        problem = self.problem(step, relink) if rank0 else None
        if comm is not None:
            problem = coll.bcast(comm, problem, root=0,
                                 what=f"checkpoint step {step}: room for it (trainer rank 0 looks)")
        if problem:
            raise NoSpace(problem)


# ------------------------------------------------------------------------------ the file system

@dataclass(frozen=True)
class Mount:
    point: str                  # where it is mounted
    fstype: str                 # "ext4", "nfs4", "lustre", ...
    source: str                 # device, server:/export, MGS@tcp:/fs
    options: frozenset          # the mount's own and its file system's (super block) options


_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """mountinfo's octal escapes (a space is \\040)."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a /proc/<pid>/mountinfo text, in its order (a later mount on the same point
    hides an earlier one). Its lines: `id parent major:minor root POINT OPTIONS [optional
    fields...] - FSTYPE SOURCE SUPER_OPTIONS`; a line without the `-` is left out."""
    mounts = []
    for line in text.splitlines():
        parts = line.split()
        if "-" not in parts[6:]:
            continue
        sep = parts.index("-", 6)
        if len(parts) < sep + 3:
            continue
        opts = set(parts[5].split(","))
        if len(parts) > sep + 3:
            opts |= set(parts[sep + 3].split(","))
        mounts.append(Mount(_unescape(parts[4]), parts[sep + 1], _unescape(parts[sep + 2]),
                            frozenset(opts)))
    return mounts


def read_mountinfo() -> str:
    """This process's /proc/self/mountinfo ("" where there is none)."""
    try:
        return Path("/proc/self/mountinfo").read_text()
    except OSError:
        return ""


def find_mount(real: str, mounts: list[Mount]) -> Mount | None:
    """The mount of `mounts` that holds the absolute, resolved path `real`: the longest mount
    point above it, the last one listed on that point."""
    best = None
    for m in mounts:
        if real == m.point or real.startswith(m.point.rstrip("/") + "/"):
            if best is None or len(m.point) >= len(best.point):
                best = m
    return best


def mount_of(path: str | os.PathLike, mounts: list[Mount] | None = None) -> Mount | None:
    """The mount that holds `path` (or, not made yet, its nearest existing folder above), among
    `mounts` (default: this process's /proc/self/mountinfo)."""
    return find_mount(os.path.realpath(existing(path)),
                      parse_mountinfo(read_mountinfo()) if mounts is None else mounts)


LOCAL_FS = ("ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "ramfs", "overlay")
NFS = ("nfs", "nfs4")


@dataclass(frozen=True)
class Advice:
    no_locking: bool            # HDF5_USE_FILE_LOCKING=FALSE needed
    swmr: bool                  # SWMR readers work while the job writes
    says: str


def hdf5_advice(m: Mount | None) -> Advice:
    """What the file system `m` means for HDF5 (the module docstring)."""
    if m is None:
        return Advice(False, True, "its mount is not in /proc/self/mountinfo: HDF5 file locking "
                      f"left as it is (export {LOCKING_ENV}=FALSE if an open fails with 'unable to "
                      "lock file')")
    if m.fstype in NFS:
        lock = sorted(o for o in m.options if o == "nolock" or o.startswith("local_lock="))
        return Advice(True, False, f"NFS{' (' + ', '.join(lock) + ')' if lock else ''}: HDF5's "
                      "file locks go through NFS's lock manager and can fail or hang, so they are "
                      "turned off; SWMR readers need POSIX write ordering, which NFS does not give: "
                      "reading the rollout log while the job writes it is not reliable here (read "
                      "it once the job has ended)")
    if m.fstype == "lustre":
        if "flock" in m.options:
            return Advice(False, True, "Lustre with flock: HDF5 file locking and SWMR work, nothing to do")
        if "localflock" in m.options:
            return Advice(False, True, "Lustre with localflock: HDF5's locks hold within a node (the "
                          "run has one writer), SWMR works, nothing to do")
        return Advice(True, True, "Lustre without flock: flock() fails (ENOSYS) and HDF5 would "
                      "refuse every open ('unable to lock file'), so its file locking is turned off "
                      "(or mount with -o flock); SWMR works")
    if m.fstype == "gpfs":
        return Advice(False, True, "GPFS: HDF5 file locking and SWMR work, nothing to do")
    if m.fstype in LOCAL_FS:
        return Advice(False, True, "a local file system: HDF5 file locking and SWMR work, nothing to do")
    return Advice(False, True, f"no known HDF5 problem on {m.fstype}: file locking left as it is "
                  f"(export {LOCKING_ENV}=FALSE if an open fails with 'unable to lock file')")


def hdf5_env(run_dir: str | os.PathLike, mounts: list[Mount] | None = None) -> dict[str, str]:
    """{HDF5_USE_FILE_LOCKING: FALSE} where the run directory's file system needs it, else {}:
    a default of the ranks' environment (launch/env.py `rank_env`; the job's own value wins)."""
    return {LOCKING_ENV: "FALSE"} if hdf5_advice(mount_of(run_dir, mounts)).no_locking else {}


def fs_line(run_dir: str | os.PathLike, env: Mapping[str, str] | None = None,
            mounts: list[Mount] | None = None) -> str:
    """The launch's line: the run directory's file system, its mount point, what it means for
    HDF5 and what is done (with `env`, default os.environ, the launching environment)."""
    env = os.environ if env is None else env
    m = mount_of(run_dir, mounts)
    advice = hdf5_advice(m)
    where = f"{m.fstype} at {m.point} ({m.source})" if m else "an unknown file system"
    done = ""
    if advice.no_locking:
        done = (f"; {LOCKING_ENV}={env[LOCKING_ENV]} from the environment kept" if LOCKING_ENV in env
                else f"; {LOCKING_ENV}=FALSE set for the ranks (the job had not set it)")
    return f"run dir {run_dir}: {where}: {advice.says}{done}"


def locking_warning(run_dir: str | os.PathLike, env: Mapping[str, str] | None = None,
                    mounts: list[Mount] | None = None) -> str | None:
    """A rank's line when its run directory's file system needs HDF5's file locking off and its
    environment does not say so (a start that went through no launcher); None otherwise."""
    env = os.environ if env is None else env
    m = mount_of(run_dir, mounts)
    if LOCKING_ENV in env or not hdf5_advice(m).no_locking:
        return None
    return (f"run dir {run_dir} is on {m.fstype} at {m.point}, where HDF5's file locks fail or hang, "
            f"and this rank's environment has no {LOCKING_ENV} (HDF5 reads it as it starts, before "
            f"the config): start the job through slurm/job.sh or areal_hpc.launch, or export "
            f"{LOCKING_ENV}=FALSE")
