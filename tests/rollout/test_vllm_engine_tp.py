"""VLLMEngine with vLLM tensor parallelism 2 (two CPU workers in one engine): generation and both
weight paths reach every worker, and each worker keeps only its own shard.

One TP2 engine for the whole module; the tests run in file order and the last one shuts it down.
The tiny Qwen2 has 2 attention and 2 KV heads, so TP2 splits it one head per worker.
"""

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil
import pytest
import torch

from areal_hpc.rollout import vllm_engine
from areal_hpc.transport.rendezvous import free_port
from areal_hpc.transport.weights import WeightGroupAddress

from .test_vllm_engine import hf_logprobs, hf_model, run_to_completion

TP = 2
ATOL = 1e-4
PROMPTS = {"p0": [5, 6, 7, 8], "p1": list(range(20, 50)), "p2": [3 + (7 * i) % 120 for i in range(140)]}
NEW_TOKENS = 12
BIND = "VLLM_CPU_OMP_THREADS_BIND"


# ------------------------------------------------------------ no engine needed


def test_omp_threads_bind_format():
    assert vllm_engine.omp_threads_bind({0, 1, 2, 3}, 2) == "0,1|2,3"
    assert vllm_engine.omp_threads_bind([7], 2) == "7|7"


def test_cpu_worker_binding_window(monkeypatch):
    monkeypatch.delenv(BIND, raising=False)
    cpus = os.sched_getaffinity(0)
    with vllm_engine._cpu_worker_binding(2):
        assert os.environ[BIND] == vllm_engine.omp_threads_bind(cpus, 2)
    assert BIND not in os.environ
    with vllm_engine._cpu_worker_binding(1):    # one worker: vLLM's own binding
        assert BIND not in os.environ
    monkeypatch.setenv(BIND, "nobind")           # the user's choice wins
    with vllm_engine._cpu_worker_binding(2):
        assert os.environ[BIND] == "nobind"
    assert os.environ[BIND] == "nobind"


# ------------------------------------------------------------ with a TP2 engine


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.delenv(BIND, raising=False)        # the engine must pick the binding itself
        env.setenv("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm_cache")))
        env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")   # closures on the workers
        eng = vllm_engine.VLLMEngine(model_dir, dtype="float32", max_model_len=256, seed=0,
                                     kv_cache_gib=1, tensor_parallel_size=TP)
        print(f"\nTP{TP} engine start: {eng.start_s:.1f} s, {len(eng._children)} child processes")
        yield eng
        eng.shutdown()


def _perturbed(model_dir, seed):
    """Every weight moved by 0.2·N(0,1); norms in bf16, so an update carries two dtypes."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in load_file(os.path.join(model_dir, "model.safetensors")).items():
        t = (t + 0.2 * torch.randn(t.shape, generator=g)).contiguous()
        out[name] = t.to(torch.bfloat16) if "norm" in name else t
    return out


def _check_policy(engine, version, reference, before, tag):
    """Sample the fixed prompts; vLLM's logprobs must be the reference model's, not `before`'s.
    Returns the largest |vLLM - reference| logprob difference."""
    for rid, prompt in PROMPTS.items():
        engine.submit(f"{tag}-{rid}", prompt, NEW_TOKENS, temperature=1.0, ignore_eos=True)
    done = run_to_completion(engine)
    assert sorted(done) == sorted(f"{tag}-{rid}" for rid in PROMPTS)
    worst = 0.0
    for rid, s in done.items():
        assert s.versions.tolist() == [version] * NEW_TOKENS
        diff = np.abs(hf_logprobs(reference, s, 1.0) - s.behav_logprobs).max()
        print(f"\n{rid}: max |vLLM TP{TP} - HF| = {diff:.1e}", end="")
        assert diff < ATOL
        if before is not None:
            moved = np.abs(hf_logprobs(before, s, 1.0) - s.behav_logprobs).max()
            print(f" (vs initial weights {moved:.2f})", end="")
            assert moved > 0.05
        worst = max(worst, float(diff))
    return worst


def test_workers_each_hold_one_shard(engine, model_dir):
    def worker_view(worker):    # local, so cloudpickle sends it by value (no `tests` package there)
        import os

        import torch

        attn = worker.model_runner.model.model.layers[0].self_attn
        return {"rank": worker.rank, "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                "pid": os.getpid(), "parent": os.getppid(), "threads": torch.get_num_threads(),
                "cpus": sorted(os.sched_getaffinity(0)),
                "start": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"),
                "heads": (attn.num_heads, attn.num_kv_heads),
                "qkv_rows": attn.qkv_proj.output_size_per_partition}

    views = engine._engine.collective_rpc(worker_view)
    assert [v["rank"] for v in views] == list(range(TP))
    bind = vllm_engine.omp_threads_bind(os.sched_getaffinity(0), TP)
    assert all(v["bind"] == bind for v in views)     # set while they started...
    assert BIND not in os.environ                     # ...and only then
    # forked from the engine process (vllm_ext.ForkedWorkersExecutor), not spawned from it, and
    # each still bound to its own share of the CPUs, one OpenMP thread per CPU
    engine_core = {p.pid for p in engine._children} - {v["pid"] for v in views}
    assert len(engine_core) == 1 and all(v["parent"] in engine_core for v in views), views
    assert all(v["start"] == "fork" for v in views), views
    for v, part in zip(views, bind.split("|")):
        cpus = sorted(map(int, part.split(",")))
        assert v["cpus"] == cpus and v["threads"] == len(cpus), (v, part)
    cfg = hf_model(model_dir).config
    heads = (cfg.num_attention_heads // TP, cfg.num_key_value_heads // TP)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    qkv_rows = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head_dim // TP
    assert all(v["heads"] == heads and v["qkv_rows"] == qkv_rows for v in views), views
    print(f"\nworkers: {views}")


def test_initial_weights_match_hf(engine, model_dir):
    _check_policy(engine, 0, hf_model(model_dir), None, "v0")


def test_broadcast_reaches_every_worker(engine, model_dir, tmp_path):
    """This process plays the trainer's single stage sender (weight-group rank 0); the engine's
    two workers join as ranks 1 and 2 and receive every bucket."""
    from safetensors.torch import save_file

    from areal_hpc.transport.weights import (
        broadcast_weights, dtype_to_str, init_weight_group, plan_buckets,
    )

    new = _perturbed(model_dir, 1234)
    sent = str(tmp_path / "sent.safetensors")
    save_file({k: v.float().contiguous() for k, v in new.items()}, sent)
    buckets = plan_buckets([(k, tuple(v.shape), dtype_to_str(v.dtype)) for k, v in new.items()], 32 << 10)
    assert len(buckets) > 3 and len({b[0][2] for b in buckets}) == 2

    port, world = free_port(), 1 + TP
    with ThreadPoolExecutor(1) as pool:
        address = WeightGroupAddress("127.0.0.1", port, world, "gloo", 120, 300)
        group = pool.submit(init_weight_group, address, 0)
        assert engine.init_weight_group(address, 1) == [1, 2]
        group = group.result(timeout=60)
        sender = pool.submit(broadcast_weights, group, new, buckets)
        paused_s = engine.update_weights(1, [(0, b) for b in buckets])
        stats = sender.result(timeout=60)
    assert engine.version == 1 and stats.num_buckets == len(buckets)
    diff = _check_policy(engine, 1, hf_model(model_dir, sent), hf_model(model_dir), "bcast")
    print(f"\nbroadcast: {stats.num_buckets} buckets, {stats.num_bytes} B in "
          f"{stats.seconds * 1e3:.0f} ms; paused {paused_s * 1e3:.0f} ms; max |d| {diff:.1e}")


def test_update_from_file_reaches_every_worker(engine, model_dir, tmp_path):
    from safetensors.torch import save_file

    weights = {k: v.float().contiguous() for k, v in _perturbed(model_dir, 99).items()}
    path = str(tmp_path / "model.safetensors")
    save_file(weights, path)
    engine.update_weights_from_file(2, path)
    assert engine.version == 2
    diff = _check_policy(engine, 2, hf_model(model_dir, path), hf_model(model_dir), "disk")
    print(f"\ndisk: max |d| {diff:.1e}")


def test_shutdown_leaves_no_process(engine):
    children = list(engine._children)
    assert len(children) >= 1 + TP, "EngineCore plus one process per worker"
    since = min(p.create_time() for p in children) - 1.0
    engine.shutdown()
    assert not [p for p in children if p.is_running()]
    left = [p for p in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline()) and p.create_time() >= since]
    assert not left, [(p.pid, p.cmdline()) for p in left]
