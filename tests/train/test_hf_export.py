"""The streamed HF export (train/hf_export.py): bit for bit the old whole-model export, loadable by
transformers, in shards no bigger than a chunk, never holding more than a chunk plus one tensor;
the same from two gloo processes (pp = 2, tp = 2); atomic and restartable."""

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areal_hpc.config import TrainConfig
from areal_hpc.train import hf_export
from areal_hpc.storage.run_dir import INDEX, is_complete
from areal_hpc.train.hf_export import ExportError, export

WORKER = Path(__file__).with_name("export_worker.py")


def _actor(model_dir):
    from areal_hpc.train.actor import Actor
    return Actor(TrainConfig(), model_dir)


def read_export(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a HF directory, through its index when it has one."""
    index = d / INDEX
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    out = {}
    for f in files:
        part = load_file(d / f)
        assert not set(part) & set(out)
        out.update(part)
    return out


def assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("tied", [False, True])
def test_equals_old_export_and_loads(megatron_ws1, model_dir, tied_model_dir, tmp_path, tied):
    from transformers import Qwen2ForCausalLM
    src = tied_model_dir if tied else model_dir
    actor = _actor(src)
    actor.save_hf(str(tmp_path / "old"))                    # the whole-model export
    old = load_file(tmp_path / "old" / "model.safetensors")

    one = export(actor, tmp_path / "one", chunk_bytes=1 << 30, step=5)
    assert one.files == 1 and sorted(os.listdir(tmp_path / "one")) == sorted(
        os.listdir(tmp_path / "old") + [INDEX])
    assert_same(read_export(tmp_path / "one"), old)

    chunk = 16 << 10
    many = export(actor, tmp_path / "many", chunk_bytes=chunk, step=5)
    assert many.files > 4 and many.bytes == sum(v.numel() * v.element_size() for v in old.values())
    assert many.peak_bytes <= chunk + many.largest_tensor_bytes
    index = json.loads((tmp_path / "many" / INDEX).read_text())
    assert index["metadata"]["total_size"] == many.bytes and index["metadata"]["step"] == 5
    names = sorted(set(index["weight_map"].values()))
    assert names == [f"model-{i:05d}-of-{many.files:05d}.safetensors" for i in range(1, many.files + 1)]
    for f in names:                             # a shard holds more than a chunk only when alone
        part = load_file(tmp_path / "many" / f)
        assert len(part) == 1 or sum(v.numel() * v.element_size() for v in part.values()) <= chunk
    assert_same(read_export(tmp_path / "many"), old)
    assert not (tmp_path / "many.partial").exists() and is_complete(tmp_path / "many", 5)

    hf = Qwen2ForCausalLM.from_pretrained(tmp_path / "many")
    ref = Qwen2ForCausalLM.from_pretrained(tmp_path / "old")
    assert_same(hf.state_dict(), ref.state_dict())


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def test_peak_stays_within_a_chunk(megatron_ws1, tmp_path):
    """A model eight times the chunk: the exporter never holds more than a chunk plus one tensor,
    and the process's peak resident memory grows by about that, not by the model.
    EXPORT_PEAK_SCALE=k widens the model k times (k^2 its size; BENCHMARKS.md)."""
    k = int(os.environ.get("EXPORT_PEAK_SCALE", "1"))
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_conftest", Path(__file__).with_name("conftest.py"))
    builders = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builders)
    src = builders._tiny_qwen2_dir(tmp_path / "model", tie=False, vocab_size=2048, hidden_size=256 * k,
                          intermediate_size=1024 * k, num_hidden_layers=8, num_attention_heads=8,
                          num_key_value_heads=4)
    actor = _actor(src)
    model_bytes = sum(p.numel() * p.element_size() for p in actor.model.parameters())
    chunk = model_bytes // 8

    def peak_growth(fn) -> int:
        import ctypes
        import gc
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)             # freed heap back to the system
        before = _rss_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")       # resets VmHWM, the peak RSS
        fn()
        return (_rss_kib("VmHWM") - before) << 10

    stats = {}
    grew = peak_growth(lambda: stats.update(s=export(actor, tmp_path / "hf", chunk_bytes=chunk)))
    s = stats["s"]
    grew_old = peak_growth(lambda: actor.save_hf(str(tmp_path / "old")))
    print(f"\nmodel {model_bytes / 2**20:.1f} MiB, chunk {chunk / 2**20:.1f} MiB, largest tensor "
          f"{s.largest_tensor_bytes / 2**20:.1f} MiB: streamed export held at most "
          f"{s.peak_bytes / 2**20:.1f} MiB ({s.files} shards), peak RSS +{grew / 2**20:.1f} MiB; "
          f"whole-model export: peak RSS +{grew_old / 2**20:.1f} MiB")
    assert s.bytes == model_bytes and s.files >= 8
    assert s.peak_bytes <= chunk + s.largest_tensor_bytes
    assert s.largest_tensor_bytes <= model_bytes / 16
    # generous: the bucket, one parameter's split tensors, allocator and library slack
    assert grew <= chunk + 2 * s.largest_tensor_bytes + (24 << 20), grew
    assert_same(read_export(tmp_path / "hf"), load_file(tmp_path / "old" / "model.safetensors"))


def test_two_processes_pp2_and_tp2_equal_single_process(megatron_ws1, model_dir, tied_model_dir,
                                                         tmp_path, run_distributed):
    chunk = 16 << 10
    cases = [{"tag": "pp2", "tp": 1, "pp": 2, "model_dir": model_dir, "chunk_bytes": chunk},
             {"tag": "pp2_tied", "tp": 1, "pp": 2, "model_dir": tied_model_dir, "chunk_bytes": chunk},
             {"tag": "tp2", "tp": 2, "pp": 1, "model_dir": model_dir, "chunk_bytes": chunk}]
    with open(tmp_path / "in.pkl", "wb") as f:
        pickle.dump({"cases": cases, "cfg": TrainConfig()}, f)
    run_distributed(WORKER, 2, tmp_path, mpi=False, timeout=900)
    for src, tag in ((model_dir, "pp2"), (tied_model_dir, "pp2_tied"), (model_dir, "tp2")):
        export(_actor(src), tmp_path / f"ref_{tag}", chunk_bytes=chunk, step=3)
        assert_same(read_export(tmp_path / tag), read_export(tmp_path / f"ref_{tag}"))
        assert is_complete(tmp_path / tag, 3)
        stats = [pickle.loads((tmp_path / f"{tag}.{r}.pkl").read_bytes()) for r in range(2)]
        assert stats[0] == stats[1] and stats[0].peak_bytes <= chunk + stats[0].largest_tensor_bytes
    index = json.loads((tmp_path / "pp2" / INDEX).read_text())["weight_map"]
    # stage 0's shards first: the embedding in the first file, the last layer and head in the last
    files = sorted(set(index.values()))
    assert index["model.embed_tokens.weight"] == files[0] and index["lm_head.weight"] == files[-1]


def test_atomic_replace_and_failure(megatron_ws1, model_dir, tmp_path, monkeypatch):
    actor = _actor(model_dir)
    out = tmp_path / "policy"
    assert not is_complete(out)
    export(actor, out, chunk_bytes=16 << 10, step=2)
    assert is_complete(out, 2) and is_complete(out) and not is_complete(out, 3)
    first = sorted(os.listdir(out))

    # a failing shard write: every rank raises, the finished export is untouched, .partial stays
    calls = []

    def failing(path, bucket):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(path, bucket)
    real = hf_export._write_shard
    monkeypatch.setattr(hf_export, "_write_shard", failing)
    with pytest.raises(ExportError, match="No space left"):
        export(actor, out, chunk_bytes=16 << 10, step=3)
    assert is_complete(out, 2) and sorted(os.listdir(out)) == first
    assert (tmp_path / "policy.partial").exists() and not is_complete(tmp_path / "policy.partial")
    monkeypatch.setattr(hf_export, "_write_shard", real)

    # the rerun replaces the old export by the new one and clears the partial folder
    export(actor, out, chunk_bytes=1 << 30, step=3)
    assert is_complete(out, 3) and not (tmp_path / "policy.partial").exists()
    assert "model.safetensors" in os.listdir(out) and not (tmp_path / "policy.replaced").exists()
    # a missing shard makes it incomplete; a folder that is not a model is never replaced
    export(actor, out, chunk_bytes=16 << 10, step=3)
    next(out.glob("model-00002-of-*.safetensors")).unlink()
    assert not is_complete(out, 3)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "mine.txt").write_text("keep")
    with pytest.raises(ExportError, match="not a model directory"):
        export(actor, other, chunk_bytes=1 << 30)
    assert (other / "mine.txt").read_text() == "keep"


def test_main_exports_only_when_policy_is_missing(model_dir, tmp_path, monkeypatch, capsys):
    """A rerun of a complete run: "already complete" when policy/ is a finished export of the
    final step, else the job goes on to an export-only launch (stopped here at the topology)."""
    from areal_hpc import preflight as preflight_mod
    from areal_hpc import main as main_mod
    from areal_hpc.topology import Topology

    monkeypatch.setenv("AREAL_SKIP_VERSION_CHECK", "1")
    monkeypatch.setattr(preflight_mod, "check_inputs", lambda cfg: None)
    monkeypatch.setattr(preflight_mod, "find_latest", lambda run_dir, check_crc=True: (
        Path(run_dir) / "checkpoints" / "step_00000004", {"step": 4}))
    def stop(*a, **k):
        raise preflight_mod.ConfigError("stopped before the launch")
    monkeypatch.setattr(Topology, "build", staticmethod(stop))
    argv = [str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"),
            f"output_dir={tmp_path}", "name=r", f"model.path={model_dir}", "train.total_steps=4"]
    policy = tmp_path / "r" / "policy"
    assert main_mod.main(argv) == 2
    assert "exporting it only" in capsys.readouterr().out

    policy.mkdir(parents=True)
    (policy / "config.json").write_text("{}")
    (policy / "model.safetensors").write_bytes(b"")
    (policy / INDEX).write_text(json.dumps({"metadata": {"step": 4},
                                            "weight_map": {"w": "model.safetensors"}}))
    assert main_mod.main(argv) == 0
    assert "already complete" in capsys.readouterr().out
    (policy / INDEX).write_text(json.dumps({"metadata": {"step": 3},
                                            "weight_map": {"w": "model.safetensors"}}))
    assert main_mod.main(argv) == 2                 # an export of an earlier step: export again
    assert "exporting it only" in capsys.readouterr().out


def test_export_only_from_the_final_checkpoint(megatron_ws1, model_dir, tmp_path):
    """What a rerun of a complete run without its policy/ does on the trainer ranks
    (`trainer.run_export`): the final checkpoint's weights, not the initial model's; and the
    end-of-run export is skipped when policy/ is already a finished export of that step."""
    from areal_hpc.config import load, to_yaml
    from areal_hpc.train import checkpoint as train_ck
    from areal_hpc.train.layout import ParallelLayout
    from areal_hpc.train.trainer import export_policy, run_export
    from tests.train.one_rank import one_rank_topology

    cfg = load(None, [f"model.path={model_dir}", "data.train_path=unused.jsonl",
                      f"output_dir={tmp_path}", "name=r", "train.total_steps=2",
                      "model.dtype=float32", "train.max_tokens_per_mb=64",
                      "rollout.max_model_len=64", "rollout.max_new_tokens=32",
                      "rollout.group_size=2"])
    trained = _actor(model_dir)
    with torch.no_grad():
        for p in trained.model.parameters():
            p.add_(0.25)
    train_ck.save(cfg.run_dir, 2, model=trained.model, optimizer=trained.optimizer,
                  config_yaml=to_yaml(cfg))
    topo = one_rank_topology(cfg)
    assert run_export(cfg, topo, ParallelLayout.read()) == 0     # the test's world of one (megatron_ws1)
    policy = cfg.run_dir / "policy"
    assert is_complete(policy, 2)
    assert_same(read_export(policy), {k: v.cpu() for k, v in trained.hf_state_dict().items()})
    mtime = (policy / INDEX).stat().st_mtime_ns
    export_policy(trained, cfg, topo.role_comm, 2, force=False)     # complete: not written again
    assert (policy / INDEX).stat().st_mtime_ns == mtime
    export_policy(trained, cfg, topo.role_comm, 3, force=False)     # of another step: written
    assert is_complete(policy, 3)
