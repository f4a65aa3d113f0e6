"""Hostile or damaged files give a clear one-line error (or a fallback) at once: never a hang,
never code execution. Rollout logs: flipped bytes and truncation, in a closed log (read without
SWMR) and in one whose writer crashed (SWMR, with bounded retries), through the reader, the
analysis CLI and the resume path. Checkpoints: a pickled RNG blob is never unpickled; malformed
manifests and run states fall back to the previous checkpoint with the reason logged."""
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from areal_hpc.storage import checkpoint as ck
from areal_hpc.storage import manifest as mf
from areal_hpc.storage.rollout_log import RolloutLogError, RolloutReader, RolloutWriter
from areal_hpc.storage import run_state
from areal_hpc.storage.run_state import ControllerState
from tests.storage.test_safe_pickle import stand_in_shards

ROOT = Path(__file__).resolve().parents[2]
HANG = 60           # a subprocess still running after this long is a hang (the box is shared)
# Seconds the read itself may take before it fails: not a speed target (a busy box reads slower)
# but a hang's bound, far below the hours of HDF5's default 100 SWMR attempts; the attempts
# themselves are read back from the open file (test_a_swmr_read_is_bounded_by_its_attempts).
NOT_A_HANG = 20.0


def _traj(pid, n_out=200):
    rng = np.random.default_rng(pid)
    return {"prompt_id": pid, "sample_idx": 0,
            "prompt_tokens": rng.integers(0, 500, 20, dtype=np.int32),
            "output_tokens": rng.integers(0, 500, n_out, dtype=np.int32),
            "behav_logprobs": -rng.random(n_out, dtype=np.float32),
            "versions": np.full(n_out, pid // 4, dtype=np.int32),
            "reward": 1.0, "finish_reason": "stop", "generator_rank": 1,
            "t_submit": 1.0, "t_first_token": 1.5, "t_end": 2.0}


def _write_log(path: Path) -> Path:
    w = RolloutWriter(path, config_yaml="name: hostile\n")
    for b in range(5):
        w.append([_traj(4 * b + i) for i in range(4)])
    w.mark_consumed([0, 1, 2, 3], 1)
    w.close()
    return path


CRASHED_WRITER = """
import os, sys
sys.path.insert(0, sys.argv[2])
from test_hostile_files import _traj
from areal_hpc.storage.rollout_log import RolloutWriter
w = RolloutWriter(sys.argv[1])
for b in range(5):
    w.append([_traj(4 * b + i) for i in range(4)])
os._exit(0)                 # killed: the file keeps its SWMR-writer flags
"""

# What each consumer of a log does with it; prints the elapsed time of the read, then the error.
READ = """
import sys, time
from areal_hpc.storage.rollout_log import RolloutReader, RolloutWriter
path, how = sys.argv[1], sys.argv[2]
t = time.monotonic()
try:
    if how == "reader":
        with RolloutReader(path) as r:
            for name in ("reward", "finish_reason", "t_end", "consumed_step", "prompt_end"):
                r.column(name)
            for name in ("prompt", "output", "behav_logprobs", "versions"):
                r.tokens(name)
            rows = [r[i] for i in range(len(r))]
    elif how == "load":
        from areal_hpc.analysis.load import load_run
        load_run(path, progress=False)
    else:                       # the resume path: Controller._restore
        with RolloutReader(path) as r:
            n = len(r)
            rows = [r[i] for i in range(n)]
        RolloutWriter.reopen(path, n).close()
    print(f"{time.monotonic() - t:.3f}")
    print("OK")
except Exception as e:
    print(f"{time.monotonic() - t:.3f}")
    print(f"{type(e).__name__}: {e}")
"""


def _run_read(path: Path, how: str) -> tuple[float, str]:
    r = subprocess.run([sys.executable, "-c", READ, str(path), how], capture_output=True,
                       text=True, timeout=HANG, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    elapsed, result = r.stdout.strip().split("\n", 1)
    return float(elapsed), result


def _flip(src: Path, dst: Path, offset: int) -> Path:
    data = bytearray(src.read_bytes())
    data[offset] ^= 0xFF
    dst.write_bytes(bytes(data))
    return dst


def _metadata_offset(path: Path) -> int:
    """An offset inside the object header of /traj/output_end (checksummed metadata)."""
    with h5py.File(path, "r", libver="latest", swmr=True) as f:     # intact: SWMR is fine
        info = h5py.h5o.get_info(f["traj/output_end"].id)
        token = getattr(info, "token", None)
        addr = getattr(info, "addr", None)
    if addr is None:            # HDF5 1.12+: the address is a token (little-endian haddr_t)
        addr = int.from_bytes(bytes(token)[:8], "little")
    return addr + 20


@pytest.fixture(scope="module")
def closed_log(tmp_path_factory):
    return _write_log(tmp_path_factory.mktemp("log") / "rollouts.h5")


@pytest.fixture(scope="module")
def crashed_log(tmp_path_factory):
    path = tmp_path_factory.mktemp("crashed") / "rollouts.h5"
    subprocess.run([sys.executable, "-c", CRASHED_WRITER, str(path), str(Path(__file__).parent)],
                   check=True, timeout=HANG, cwd=ROOT)
    with open(path, "rb") as fh:
        assert fh.read(12)[11] != 0         # status flags set: readers must use SWMR
    return path


def test_damaged_closed_log_errors_at_once(closed_log, tmp_path):
    """Flipped metadata bytes (middle of the file: /traj/output_end's object header) and a
    truncation in the middle: every consumer fails within NOT_A_HANG seconds, one line naming the
    file. Before: SWMR reads retried for over 400 s."""
    size = closed_log.stat().st_size
    bad = {"flipped": _flip(closed_log, tmp_path / "flipped.h5", _metadata_offset(closed_log)),
           "truncated": tmp_path / "truncated.h5"}
    bad["truncated"].write_bytes(closed_log.read_bytes()[: size // 2])
    for kind, path in bad.items():
        for how in ("reader", "load", "resume"):
            elapsed, result = _run_read(path, how)
            assert result.startswith("RolloutLogError: ") and str(path) in result, (kind, how,
                                                                                    result)
            assert "\n" not in result and elapsed < NOT_A_HANG, (kind, how, elapsed)


def test_damaged_log_from_the_command_line(closed_log, tmp_path):
    path = _flip(closed_log, tmp_path / "flipped.h5", _metadata_offset(closed_log))
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "areal_hpc.analysis", str(path), "--no-plots"],
                       capture_output=True, text=True, timeout=HANG, cwd=ROOT)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(path) in lines[0]
    assert time.monotonic() - t < HANG


def test_crashed_writer_log_is_read_in_swmr_mode_with_bounded_retries(crashed_log, tmp_path):
    elapsed, result = _run_read(crashed_log, "reader")       # intact: readable (SWMR)
    assert result == "OK"
    path = _flip(crashed_log, tmp_path / "flipped.h5", _metadata_offset(crashed_log))
    for how in ("reader", "load"):
        elapsed, result = _run_read(path, how)
        assert result.startswith("RolloutLogError: ") and str(path) in result, (how, result)
        assert elapsed < NOT_A_HANG, (how, elapsed)


def test_a_swmr_read_is_bounded_by_its_attempts(crashed_log):
    """The bound on a SWMR reader's retries, read back from the open file's access properties
    (H5Pget_metadata_read_attempts), not from a clock: SWMR_READ_ATTEMPTS (a damaged file's
    metadata read gives up after 0.27 s of waits), not HDF5's default 100 (hours)."""
    import ctypes

    from areal_hpc.storage import h5_read
    get = h5_read.hdf5_function("H5Pget_metadata_read_attempts")
    assert get is not None
    get.argtypes, get.restype = [ctypes.c_int64, ctypes.POINTER(ctypes.c_uint)], ctypes.c_int
    with h5_read.open_swmr(crashed_log) as f:
        plist = f.id.get_access_plist()
        attempts = ctypes.c_uint()
        assert get(plist.id, ctypes.byref(attempts)) >= 0
    assert attempts.value == h5_read.SWMR_READ_ATTEMPTS == 28


def test_many_flipped_bytes_never_hang(closed_log, crashed_log, tmp_path):
    """Bytes flipped all over both kinds of file: each read ends (OK: the byte was token data
    without a checksum) or fails with a RolloutLogError, quickly."""
    for src in (closed_log, crashed_log):
        size = src.stat().st_size
        for k, off in enumerate([50, 100, 300, 2000, 8000, *range(size // 16, size, size // 8)]):
            path = _flip(src, tmp_path / f"{src.parent.name}-{k}.h5", off)
            elapsed, result = _run_read(path, "reader")
            assert result == "OK" or result.startswith("RolloutLogError: "), (src, off, result)
            assert elapsed < NOT_A_HANG, (src, off, elapsed)


def _raw_chunk_offset(path: Path, name: str) -> int:
    with h5py.File(path, "r") as f:
        return f[name].id.get_chunk_info(0).byte_offset


@pytest.mark.parametrize("name, row, value, why", [
    ("tokens/behav_logprobs", 0, np.float32(np.nan).tobytes(), "behav_logprobs is not a log-prob"),
    ("tokens/behav_logprobs", 0, np.float32(5.0).tobytes(), "behav_logprobs is not a log-prob"),
    ("traj/t_end", 3, np.float64(np.inf).tobytes(), "t_end is not a finite number"),
    ("traj/reward", 2, np.float32(np.nan).tobytes(), "reward is not a finite number"),
    ("traj/finish_reason", 5, b"\x07", "unknown finish_reason"),
    ("tokens/versions", 0, np.int32(-5).tobytes(), "versions is negative"),
    ("traj/output_end", 4, np.int64(3).tobytes(), "offset that goes backwards"),
])
def test_impossible_values_name_the_file_and_row(closed_log, tmp_path, name, row, value, why):
    """Values no writer of ours produces, written through HDF5 (so their chunks' checksums
    hold): what cannot be true is checked when read."""
    path = tmp_path / "bad.h5"
    shutil.copy(closed_log, path)
    with h5py.File(path, "r+") as f:
        f[name][row] = np.frombuffer(value, dtype=f[name].dtype)[0]
    with pytest.raises(RolloutLogError, match=why) as e:
        with RolloutReader(path) as r:
            r.column(name.split("/")[1]) if name.startswith("traj") else r.tokens(name.split("/")[1])
    assert str(path) in str(e.value) and f"row {row}" in str(e.value)
    with pytest.raises(RolloutLogError, match=f"row {row}"):
        with RolloutReader(path) as r:
            r[row]
    if name != "tokens/behav_logprobs":            # the analysis does not read them
        from areal_hpc.analysis.load import load_run
        with pytest.raises(RolloutLogError, match=f"row {row}") as e:
            load_run(path, progress=False)
        assert str(path) in str(e.value)


@pytest.mark.parametrize("name", ["traj/reward", "traj/output_end", "traj/consumed_step",
                                  "tokens/output", "tokens/behav_logprobs", "tokens/versions"])
def test_a_flipped_bit_in_any_data_chunk_is_caught_by_its_checksum(closed_log, tmp_path, name):
    """Every dataset of the log is written with a Fletcher-32 checksum per chunk: single-bit
    flips in the data (which used to read back as silent garbage when the value stayed
    plausible) fail the read with one line naming the file, the dataset and the rows."""
    with h5py.File(closed_log, "r") as f:
        info = f[name].id.get_chunk_info(0)
        assert f[name].fletcher32
    rng = np.random.default_rng(len(name))
    for k, byte in enumerate(rng.integers(0, info.size - 4, 3)):     # the last 4: the sum itself
        data = bytearray(closed_log.read_bytes())
        data[info.byte_offset + int(byte)] ^= 1 << int(rng.integers(0, 8))
        path = tmp_path / f"flip{k}.h5"
        path.write_bytes(bytes(data))
        with pytest.raises(RolloutLogError) as e:
            with RolloutReader(path) as r:
                group, ds = name.split("/")
                r.column(ds) if group == "traj" else r.tokens(ds)
        # "rows a-b" (the damaged chunk), or "row i" (the offsets' last row, read at open)
        assert str(path) in str(e.value) and f"/{name} row" in str(e.value), e.value
        with pytest.raises(RolloutLogError, match=f"/{name} row"):
            with RolloutReader(path) as r:
                r[3]


def test_inconsistent_lengths_are_errors(closed_log, tmp_path):
    path = tmp_path / "short.h5"
    path.write_bytes(closed_log.read_bytes())
    with h5py.File(path, "r+") as f:
        f["tokens/behav_logprobs"].resize((100,))       # fewer than the offsets need
    with pytest.raises(RolloutLogError, match="behav_logprobs has 100 entries") as e:
        RolloutReader(path)
    assert str(path) in str(e.value)
    with h5py.File(path, "r+") as f:
        del f["tokens/behav_logprobs"]
        f["tokens/behav_logprobs"] = np.zeros(4000, dtype=np.float64)   # wrong dtype
    with pytest.raises(RolloutLogError, match="not a 1-D float32"):
        RolloutReader(path)


# ---------------------------------------------------------------------------- checkpoints

CONTROLLER = ControllerState(
    version=2, cursor_consumed=8, accepted=4, rejected=0, dropped_stale=0,
    generated_tokens=100, rollout_rows=10, buffer_rows=np.array([6, 7], dtype=np.int64),
    buffer_group_ends=np.array([2], dtype=np.int64),
    inflight_prompt_ids=np.array([5], dtype=np.int64),
    inflight_dataset_index=np.array([5], dtype=np.int64))


def _manifest(ckpt: Path, step: int) -> dict:
    files = {rel: {"size": (ckpt / rel).stat().st_size, "crc32": ck.crc32_file(ckpt / rel)}
             for rel in mf.listed_files(ckpt)}
    return {"format": ck.FORMAT, "step": step, "created": time.time(), "files": files,
            "bytes": sum(v["size"] for v in files.values())}


def _write_manifest(ckpt: Path, manifest) -> None:
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    (ckpt / ck.MANIFEST).write_text(text)


def _fake_checkpoint(run_dir: Path, step: int, controller=CONTROLLER) -> Path:
    """A checkpoint folder as `save` lays it out (the shards are a stand-in: nothing here
    loads them, but the pickle check passes them), with a valid manifest."""
    ckpt = ck.step_dir(run_dir, step)
    stand_in_shards(ckpt / ck.SHARDS)
    (ckpt / ck.SHARDS / "__0_0.distcp").write_bytes(os.urandom(256))
    ck.write_state(ckpt / ck.STATE, step=step, config_yaml="name: t\n", scheduler={"num_steps": 3},
                   rng=[ck.rng_state()], controller=controller)
    _write_manifest(ckpt, _manifest(ckpt, step))
    return ckpt


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pwned"))


def test_pickled_rng_state_is_never_unpickled(tmp_path, caplog):
    marker = tmp_path / "executed"
    pickle.loads(pickle.dumps(_Payload(tmp_path / "selftest")))      # the payload does work
    assert (tmp_path / "selftest").exists()
    ckpt = _fake_checkpoint(tmp_path, 3)
    with h5py.File(ckpt / ck.STATE, "a") as f:          # as older versions stored RNG states
        del f["rng/trainer_rank_0"]
        blob = pickle.dumps({"python": _Payload(marker)})
        f["rng"].create_dataset("trainer_rank_0", data=np.frombuffer(blob, dtype=np.uint8))
    _write_manifest(ckpt, _manifest(ckpt, 3))
    with caplog.at_level("WARNING"):
        found = ck.find_latest(tmp_path)
    assert found is not None and found[0] == ckpt
    state = ck.read_state(ckpt / ck.STATE)
    assert state["rng"] == [None] and state["controller"].version == 2
    assert not marker.exists()
    src = (ROOT / "areal_hpc/storage/checkpoint.py").read_text()
    assert "import pickle" not in src and "pickle.load" not in src


def test_rng_states_round_trip_without_pickle(tmp_path):
    import random

    import torch
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1)
    saved = ck.rng_state()
    want = (random.random(), random.gauss(0, 1), np.random.rand(), torch.rand(2).tolist())
    ckpt = _fake_checkpoint(tmp_path, 1)
    with h5py.File(ckpt / ck.STATE, "a") as f:
        del f["rng/trainer_rank_0"]
        run_state._write_rng(f["rng"].create_group("trainer_rank_0"), saved)
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    ck.set_rng_state(ck.read_state(ckpt / ck.STATE)["rng"][0])
    assert (random.random(), random.gauss(0, 1), np.random.rand(), torch.rand(2).tolist()) == want


def _bad_json(ckpt):
    (ckpt / ck.MANIFEST).write_text('{"format": "areal_hpc checkpoint", "files": ')


def _edit(change):
    def apply(ckpt):
        m = json.loads((ckpt / ck.MANIFEST).read_text())
        change(m)
        _write_manifest(ckpt, m)
    return apply


def _state_edit(change):
    def apply(ckpt):
        with h5py.File(ckpt / ck.STATE, "a") as f:
            change(f)
        _write_manifest(ckpt, _manifest(ckpt, ck.step_of(ckpt)))
    return apply


def _resealed(change):
    def apply(ckpt):
        change(ckpt / ck.SHARDS)
        _write_manifest(ckpt, _manifest(ckpt, ck.step_of(ckpt)))
    return apply


def _traversal(rel):
    def change(m):
        m["files"][rel] = {"size": 5, "crc32": 0}
        m["bytes"] += 5
    return change


def _set(group, key, value):
    def change(f):
        f[group].attrs[key] = value
    return change


BAD = {
    "bad JSON": (_bad_json, "unreadable manifest.json"),
    "a JSON list": (lambda c: _write_manifest(c, "[1, 2]"), "not an areal_hpc checkpoint"),
    "step as a string": (_edit(lambda m: m.update(step="4")), "step '4'"),
    "step of another folder": (_edit(lambda m: m.update(step=2)), "the folder is step 4"),
    "files as a list": (_edit(lambda m: m.update(files=list(m["files"]))), "table of files"),
    "size as a string": (_edit(lambda m: m["files"][ck.STATE].update(size="12")),
                         "non-negative ints"),
    "NaN created": (lambda c: (c / ck.MANIFEST).write_text(
        (c / ck.MANIFEST).read_text().replace('"created": ', '"created": NaN, "x": ')),
        "unreadable manifest.json"),
    "../ in a name": (_edit(_traversal("../../../etc/passwd")), "not a path inside"),
    "an absolute name": (_edit(_traversal("/etc/passwd")), "not a path inside"),
    "megatron/../.. name": (_edit(_traversal("megatron/../../x")), "not a path inside"),
    "a missing file": (lambda c: (c / ck.SHARDS / "__0_0.distcp").unlink(), "is missing"),
    "an unlisted file": (lambda c: (c / ck.SHARDS / "extra.distcp").write_bytes(b"x"),
                         "not in the manifest"),
    "state.h5 garbage": (lambda c: ((c / ck.STATE).write_bytes(b"not hdf5" * 10),
                                    _write_manifest(c, _manifest(c, 4))),
                         "unreadable run state"),
    "state of another step": (_state_edit(lambda f: f.attrs.__setitem__("step", 9)),
                              "state.h5 is of step 9"),
    "negative controller count": (_state_edit(_set("controller", "cursor_consumed", -1)),
                                  "cursor_consumed = -1"),
    "controller version as text": (_state_edit(_set("controller", "version", "2")),
                                   "version = '2'"),
    "buffer rows beyond the log": (_state_edit(_set("controller", "rollout_rows", 3)),
                                   "beyond its rollout_rows"),
    "unknown optimizer format": (_state_edit(lambda f: f.attrs.__setitem__(
        "optimizer_format", "mystery")), "unknown optimizer_format"),
    "scheduler not JSON": (_state_edit(lambda f: f.attrs.__setitem__("scheduler_json", "{")),
                           "scheduler_json is not JSON"),
    # resealed: only the pickle check (safe_pickle.py) sees them; real Megatron files:
    # test_checkpoint_pickles.py
    "common.pt that runs code": (_resealed(lambda s: torch.save(_Payload(s / "ran"),
                                                                s / "common.pt")),
                                 "megatron/common.pt: its pickle names builtins.getattr, pathlib.Path"),
    ".metadata deleted": (_resealed(lambda s: (s / ".metadata").unlink()),
                          "megatron/.metadata: missing"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_malformed_newest_checkpoint_falls_back_with_reason(tmp_path, caplog, kind):
    spoil, reason = BAD[kind]
    _fake_checkpoint(tmp_path, 2)
    newest = _fake_checkpoint(tmp_path, 4)
    spoil(newest)
    with caplog.at_level("WARNING", logger="areal_hpc.storage.checkpoint"):
        found = ck.find_latest(tmp_path)
    assert found is not None and found[0] == ck.step_dir(tmp_path, 2), kind
    assert "step_00000004" in caplog.text and reason in caplog.text, caplog.text
    assert ck.find_latest(tmp_path, check_crc=False)[0] == ck.step_dir(tmp_path, 2)
    assert not (newest / ck.SHARDS / "ran").exists()


def test_find_latest_never_raises(tmp_path):
    newest = _fake_checkpoint(tmp_path, 4)
    _write_manifest(newest, {"format": ck.FORMAT, "step": 4, "created": 1.0,
                             "files": {ck.STATE: None}, "bytes": 0})
    assert ck.find_latest(tmp_path) is None
    assert ck.find_latest(tmp_path / "nothing-here") is None
