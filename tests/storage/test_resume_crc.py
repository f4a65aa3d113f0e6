"""Resume's CRC-32 checks split over the trainer ranks (storage.checkpoint.find_latest with a
communicator, train.checkpoint.find_resume): the split (`split_files`: every file once, balanced
by bytes, deterministic, each rank's own shard files where that stays balanced), the
single-process path, and a real 4-rank mpiexec world where a file checked by a non-zero rank is
corrupted: every rank passes the checkpoint over with the message naming the file and takes the
older one, each rank having read about a quarter of the bytes."""
import json
import random
from pathlib import Path

import pytest

from areal_hpc.storage import checkpoint as ck
from areal_hpc.train.checkpoint import shard_owner
from tests.storage.test_safe_pickle import stand_in_shards

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("resume_crc_worker.py")
RANKS = 4


def _sizes(seed: int, n: int = 40) -> dict[str, int]:
    rng = random.Random(seed)
    return {f"megatron/f{k:03d}.bin": rng.randint(1, 10_000_000) for k in range(n)}


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_split_covers_every_file_once_balanced_and_deterministic(seed, n):
    sizes = _sizes(seed)
    parts = ck.split_files(sizes, n)
    assert len(parts) == n
    flat = [rel for part in parts for rel in part]
    assert sorted(flat) == sorted(sizes) and len(flat) == len(set(flat))      # each exactly once
    loads = [sum(sizes[r] for r in part) for part in parts]
    # largest first onto the least loaded: no part exceeds another by more than the largest file
    assert max(loads) - min(loads) <= max(sizes.values())
    assert max(loads) <= sum(loads) / n + max(sizes.values())
    order = list(sizes)
    for part in parts:                  # each part in the manifest's order (first failure wins)
        assert part == sorted(part, key=order.index)
    assert ck.split_files(sizes, n) == parts                               # the same every time
    shuffled = list(sizes.items())
    random.Random(seed + 100).shuffle(shuffled)
    again = ck.split_files(dict(shuffled), n)
    assert [sorted(p) for p in again] == [sorted(p) for p in parts]      # whatever the order


def test_split_gives_each_rank_its_own_shard_files_while_balanced():
    sizes = {"megatron/.metadata": 5_000, "megatron/common.pt": 20_000, "state.h5": 30_000,
             "megatron/metadata.json": 100}
    sizes.update({f"megatron/__{r}_{k}.distcp": 1_000_000 + 1000 * r + k
                  for r in range(RANKS) for k in range(2)})
    parts = ck.split_files(sizes, RANKS, shard_owner)
    for r, part in enumerate(parts):
        assert {f"megatron/__{r}_0.distcp", f"megatron/__{r}_1.distcp"} <= set(part)
    assert sorted(rel for p in parts for rel in p) == sorted(sizes)
    # the shards of a layout that wrote everything from rank 0: by bytes instead
    skewed = {f"megatron/__0_{k}.distcp": 1_000_000 for k in range(8)} | {"state.h5": 10}
    parts = ck.split_files(skewed, RANKS, shard_owner)
    assert [sum(skewed[r] for r in p) for p in parts] == [2_000_010, 2_000_000, 2_000_000,
                                                           2_000_000]
    assert shard_owner("megatron/__12_3.distcp") == 12 and shard_owner("state.h5") is None
    assert shard_owner("megatron/grp__3_0.distcp") == 3 and shard_owner("x/__1_0.distcp") is None
    assert ck.split_files(sizes, RANKS, lambda rel: 99) == ck.split_files(sizes, RANKS)
    with pytest.raises(ValueError):
        ck.split_files(sizes, 0)


def _checkpoint(run_dir: Path, step: int, rng_state: dict) -> Path:
    """A checkpoint folder laid out as `save` writes it for 4 trainer ranks (the shards are
    random bytes of uneven sizes: nothing here loads them), with its manifest."""
    ckpt = ck.step_dir(run_dir, step)
    shards = ckpt / ck.SHARDS
    shards.mkdir(parents=True)
    rng = random.Random(step)
    for r in range(RANKS):
        for k in range(2):
            (shards / f"__{r}_{k}.distcp").write_bytes(rng.randbytes(
                (1 << 20) * (1 + k) + 4096 * r))
    # DCP's metadata, common.pt and metadata.json, which the pickle check passes (safe_pickle.py)
    stand_in_shards(shards)
    ck.write_state(ckpt / ck.STATE, step=step, config_yaml="name: t\n", scheduler=None,
                   rng=[rng_state] * RANKS, controller=None)
    ck.write_manifest(ckpt, step)
    return ckpt


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_crc")
    state = ck.rng_state()
    for name in ("clean", "corrupt"):
        for step in (2, 4):
            _checkpoint(root / name, step, state)
    newest = ck.step_dir(root / "corrupt", 4)
    manifest = ck.validate(newest)
    parts = ck.split_files({r: m["size"] for r, m in manifest["files"].items()}, RANKS,
                           shard_owner)
    bad = "megatron/__2_1.distcp"
    assert bad in parts[2]                      # checked by trainer rank 2, not rank 0
    _flip(newest / bad, 12345)
    return root, bad


def test_single_process_path_reads_everything_and_names_the_file(runs, caplog):
    root, bad = runs
    stats: dict = {}
    assert ck.find_latest(root / "clean", stats=stats)[1]["step"] == 4
    total = ck.validate(ck.step_dir(root / "clean", 4))["bytes"]
    assert stats == {"bytes": total, "files": 12, "rejected": []}
    with caplog.at_level("WARNING", logger="areal_hpc.storage.checkpoint"):
        hit = ck.find_latest(root / "corrupt", stats=stats)
    assert hit[0] == ck.step_dir(root / "corrupt", 2)
    msg = f"{ck.step_dir(root / 'corrupt', 4)}: {bad} fails its CRC-32 check (corrupted)"
    assert stats["rejected"] == [msg] and msg in caplog.text
    with pytest.raises(ck.CheckpointError, match=f"{bad} fails its CRC-32"):
        ck.validate(ck.step_dir(root / "corrupt", 4))
    # tools' path: no communicator, or a communicator of one rank, sizes only
    one = type("One", (), {"Get_rank": lambda s: 0, "Get_size": lambda s: 1})()
    assert ck.find_latest(root / "corrupt", comm=one)[0] == hit[0]
    assert ck.find_latest(root / "corrupt", check_crc=False)[1]["step"] == 4


def test_four_ranks_split_the_checks_and_reject_a_corrupted_file_together(runs, tmp_path,
                                                                           run_distributed):
    root, bad = runs
    run_distributed(WORKER, RANKS, tmp_path, root / "clean", root / "corrupt", timeout=300)
    reports = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(RANKS)]
    one = ck.validate(ck.step_dir(root / "clean", 4))["bytes"]
    two = ck.validate(ck.step_dir(root / "clean", 2))["bytes"]
    msg = f"{ck.step_dir(root / 'corrupt', 4)}: {bad} fails its CRC-32 check (corrupted)"
    for how in ("owner", "bytes"):
        clean = [rep[f"clean/{how}"] for rep in reports]
        assert [c["step"] for c in clean] == [4] * RANKS and all(not c["rejected"] for c in clean)
        assert sum(c["bytes"] for c in clean) == one                  # every byte read once
        corrupt = [rep[f"corrupt/{how}"] for rep in reports]
        assert [c["path"] for c in corrupt] == [str(ck.step_dir(root / "corrupt", 2))] * RANKS
        assert all(c["rejected"] == [msg] for c in corrupt), corrupt   # on every rank, by name
        # both checkpoints checked; a rank stops at its first failing file
        assert sum(c["bytes"] for c in corrupt) <= one + two
        for c in clean + corrupt:       # about a quarter each (the parts are balanced by bytes)
            total = one if c in clean else one + two
            assert 0.15 * total < c["bytes"] < 0.35 * total, (how, c["bytes"], total)
    per_rank = [rep["clean/owner"]["bytes"] for rep in reports]
    print(f"\nresume CRC-32, {RANKS} ranks, one checkpoint of {one} bytes: bytes per rank "
          f"{per_rank} ({[round(b / one, 3) for b in per_rank]} of it), seconds "
          f"{[rep['clean/owner']['seconds'] for rep in reports]}")


def test_trainer_resume_uses_the_collective_search(runs, monkeypatch, tmp_path):
    """Trainer._resume: every rank calls find_resume (no rank-0-only search and broadcast), loads
    what it returns; with nothing to resume from, rank 0 sets the old files aside."""
    from areal_hpc.config import load
    from areal_hpc.storage.run_dir import RunDir
    from areal_hpc.train import checkpoint as train_ckpt
    from tests.train.one_rank import StandInActor, TrainerOfParts, one_rank_topology
    root, _ = runs
    calls = []
    real = train_ckpt.find_resume

    def spy(run_dir, comm=None, timeout_s=None, stats=None):
        calls.append((run_dir, comm, timeout_s))
        return real(run_dir, comm, timeout_s=timeout_s, stats=stats)
    monkeypatch.setattr(train_ckpt, "find_resume", spy)
    monkeypatch.setattr(train_ckpt, "load", lambda path, **kw: {"step": ck.step_of(path),
                                                                "path": path})
    old = RunDir(root / "nothing")      # a rollout log, no checkpoint: killed before its first one
    old.path.mkdir()
    old.rollouts.write_bytes(b"the first attempt's rows")
    for run, want in (("corrupt", 2), ("nothing", None)):
        cfg = load(None, [f"model.path={tmp_path / 'model'}", "data.train_path=x.jsonl", f"output_dir={root}",
                          f"name={run}", "train.total_steps=9", "rollout.collective_timeout_s=7.0"])
        t = TrainerOfParts(cfg, one_rank_topology(cfg), StandInActor())
        state = t._resume()
        assert calls[-1] == (cfg.run_dir, t.topo.role_comm, 7.0) and cfg.run_dir == root / run
        aside = sorted(p.name for p in (root / run).glob("*.attempt-*"))
        if want is None:
            assert state is None and aside == ["rollouts.attempt-1.h5"]
        else:
            assert state["path"] == ck.step_dir(root / run, want) and t.version == want
            assert not aside
