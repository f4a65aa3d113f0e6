"""Qwen2.5's shapes through the whole weight path: HF → Megatron (TP=2), vLLM, one PPO step, the
trained weights broadcast into the running engine, and the tied LM head following them.

The model is random, with the traits of Qwen2.5-0.5B/1.5B's config.json and scaled down in depth
and width: vocabulary 151,936, tied embeddings, q/k/v biases (none on o_proj), GQA 6:1 (12 query
heads, 2 KV heads), rope_theta 1e6, rms_norm_eps 1e-6; 2 layers, hidden 384 (head_dim 32:
vLLM's CPU attention has no kernel below 32), intermediate 1024. Biases and norm weights are
random too, so that a layout error in them shows. Megatron takes the vocabulary as it is (no
padding to a multiple of 128 * tp as Megatron-LM's scripts do): each TP rank holds 151,936 / tp
embedding rows, and vLLM, HF and the trainer agree on every row. The tokenizer is byte-level,
with Qwen's special tokens at Qwen's ids (<|endoftext|> = 151,643): 151,646 tokens, the model's
rows beyond them padding, as in Qwen2.5 (151,665 tokens, 151,936 rows).

One vLLM engine and one trainer job (`mpiexec -n 2 tests/rollout/weights_worker.py`) serve the
module; the tests run in file order and share them. The trainer job starts first, so that
Megatron's start overlaps vLLM's, and waits for the samples the engine produces.
"""

import contextlib
import json
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from areal_hpc.random_models import qwen_byte_tokenizer, save_random_qwen2
from areal_hpc.rollout import vllm_engine
from areal_hpc.transport.rendezvous import free_port
from areal_hpc.transport.weights import WeightGroupAddress
from tests.rollout.test_vllm_engine import (
    ATOL,
    WORKER,
    _wait_for,
    hf_logprobs,
    hf_model,
    run_to_completion,
)

VOCAB = 151_936
EOS = 151_643  # <|endoftext|>
HIDDEN = 384
TP = 2
GROUP = 2  # samples per prompt: GRPO needs two to give an advantage
NEW_TOKENS = 16


def make_qwen_model(path: Path) -> None:
    # Qwen's vocabulary size and special-token ids, q/k/v biases and norms made informative
    # (zero and one at init, a wrong layout would not show).
    qwen_byte_tokenizer(path, EOS, 32768)
    save_random_qwen2(path, bias_std=0.5, norm=(1.0, 0.2),
                      vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=1024,
                      num_attention_heads=12, max_position_embeddings=32768, rope_theta=1e6,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.02,
                      bos_token_id=EOS, eos_token_id=EOS, dtype="float32")


@contextlib.contextmanager
def _output_to(path: Path):
    """fds 1 and 2 point to `path` while the block runs: the processes started in it (vLLM's
    engine core and workers) inherit them and write their log there for their whole life."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_bytes()[-n:].decode(errors="replace")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen_shapes")
    make_qwen_model(path)
    return str(path)


class TrainerJob(NamedTuple):
    proc: Any           # the Popen of its mpiexec
    work: Path          # its folder: in.pkl, seqs.pkl (the samples it waits for), its output
    case: dict          # the case tests/rollout/weights_worker.py runs
    out: Path           # the trained model's HF export


@pytest.fixture(scope="module")
def trainer(qwen_dir, tmp_path_factory, run_distributed):
    """The trainer job: builds the Actor (HF → Megatron, TP=2), waits for the samples, trains one
    step, then publishes version 1 over the weight group as the stage-0 sender."""
    work = tmp_path_factory.mktemp("trainer")
    train = {"seqs": str(work / "seqs.pkl"), "out": str(work / "trained"), "group_size": GROUP,
             "cfg": {"lr": 1e-3}}
    case = {"tag": "qwen", "tp": TP, "pp": 1, "mode": "broadcast", "port": free_port(),
            "version": 1, "model_dir": qwen_dir, "train": train}
    (work / "in.pkl").write_bytes(pickle.dumps({"cases": [case], "torch_port": free_port()}))
    proc = run_distributed.start(WORKER, TP, work)
    yield TrainerJob(proc=proc, work=work, case=case, out=Path(train["out"]))
    run_distributed.stop(proc)      # a test failed before the job finished


@pytest.fixture(scope="module")
def engine_log(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm_log") / "engine.log"


@pytest.fixture(scope="module")
def engine(qwen_dir, trainer, engine_log, tmp_path_factory):
    """The module's engine (after `trainer`: the job starts first). Its processes write their
    log to `engine_log`, where the tests look for vLLM's warnings."""
    with pytest.MonkeyPatch.context() as mp_env:
        mp_env.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        mp_env.setenv("VLLM_LOGGING_LEVEL", "INFO")  # the update's own log lines are checked
        mp_env.setenv("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm_cache")))
        try:
            with _output_to(engine_log):
                eng = vllm_engine.VLLMEngine(qwen_dir, dtype="float32", max_model_len=512, seed=0,
                                             max_num_seqs=8)
        except Exception:
            pytest.fail(f"vLLM did not start; its log ends:\n{_tail(engine_log)}")
        print(f"\nengine start: {eng.start_s:.1f} s (log: {engine_log})")
        yield eng
        eng.shutdown()


@pytest.fixture(scope="module")
def samples(engine, trainer):
    """GROUP samples for each of 4 prompts at version 0, group-contiguous; handed to the trainer
    with rewards 1, 0 in every group."""
    rng = np.random.default_rng(0)
    prompts = {f"q{i}": rng.integers(0, VOCAB, 6 + 3 * i).tolist() for i in range(4)}
    prompts["q0"][-2:] = [EOS + 3, VOCAB - 1]  # ids past the tokenizer's (padding rows) are input too
    for qid, prompt in prompts.items():
        for k in range(GROUP):
            engine.submit(f"{qid}/{k}", prompt, NEW_TOKENS, temperature=1.0, ignore_eos=True)
    done = run_to_completion(engine)
    out = [done[f"{qid}/{k}"] for qid in prompts for k in range(GROUP)]
    seqs = [dict(prompt_tokens=s.prompt_tokens, output_tokens=s.output_tokens,
                 behav_logprobs=s.behav_logprobs, reward=float(i % GROUP == 0))
            for i, s in enumerate(out)]
    path = Path(trainer.case["train"]["seqs"])
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(pickle.dumps(seqs))
    os.replace(tmp, path)  # the trainer polls for it: never a partial file
    return out


def test_vllm_loads_qwen_shapes(qwen_dir, samples):
    """The model has Qwen2.5's traits, and vLLM's behaviour log-probs equal HF's."""
    config = json.loads((Path(qwen_dir) / "config.json").read_text())
    assert (config["vocab_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (VOCAB, 12, 2)
    assert config["tie_word_embeddings"] and config["rms_norm_eps"] == 1e-6
    model = hf_model(qwen_dir)
    assert model.config.rope_parameters["rope_theta"] == 1e6
    names = {n for n, _ in model.named_parameters()}
    assert {f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"} <= names
    assert "model.layers.0.self_attn.o_proj.bias" not in names
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for s in samples:
        assert s.versions.tolist() == [0] * NEW_TOKENS
        diff = np.abs(hf_logprobs(model, s, 1.0) - s.behav_logprobs).max()
        assert diff < ATOL, (s.request_id, diff)


def test_megatron_matches_vllm_and_trains(trainer, samples):
    """The trainer's log-probs before its step (Megatron, TP=2, vocab-parallel) equal vLLM's
    behaviour log-probs; one train_step runs on them."""
    _wait_for(trainer.out / "result.pkl", trainer.proc)
    result = pickle.loads((trainer.out / "result.pkl").read_bytes())
    assert result["shapes"] == {"module.embedding.word_embeddings.weight": (VOCAB // TP, HIDDEN)}
    for s, lp in zip(samples, result["logprobs"], strict=True):
        diff = np.abs(lp - s.behav_logprobs).max()
        assert diff < ATOL, (s.request_id, diff)
    st = result["stats"]
    print(f"\nActor build (HF -> Megatron, tp={TP}) {result['build_s']:.1f} s; train_step "
          f"{st['seconds']:.1f} s (prox {st['prox_seconds']:.1f}, fwd/bwd {st['fwd_bwd_seconds']:.1f}, "
          f"optimizer {st['optim_seconds']:.1f}) on {st['n_tokens']} output tokens")
    assert st["n_tokens"] == len(samples) * NEW_TOKENS and st["skipped_steps"] == 0
    assert np.isfinite(st["loss"]) and st["grad_norm"] > 0


def test_update_reaches_engine_and_tied_head(trainer, engine, engine_log, qwen_dir, samples):
    """The trained weights, broadcast into the running engine: vLLM's log-probs equal HF's on
    them, differ from the initial ones, and differ from those of a model whose LM head kept the
    initial embedding (what vLLM on CPU computed before the tied head was reprocessed); vLLM
    no longer warns that the head loaded nothing."""
    case, work = trainer.case, trainer.work
    log_start = engine_log.stat().st_size
    assert engine.init_weight_group(WeightGroupAddress("127.0.0.1", case["port"], 2, "gloo", 120, 600), 1) == [1]
    _wait_for(work / "qwen.plan.pkl", trainer.proc)
    plan = pickle.loads((work / "qwen.plan.pkl").read_bytes())
    sent = {name for _, bucket in plan for name, _, _ in bucket}
    assert "model.embed_tokens.weight" in sent and "lm_head.weight" not in sent  # tied: not sent
    paused_s = engine.update_weights(1, plan)
    _wait_for(work / "qwen.done", trainer.proc)
    assert trainer.proc.wait(timeout=300) == 0, trainer.proc.stdout.read()[-4000:]

    prompts = {"p0": samples[0].prompt_tokens.tolist(), "p1": [EOS, 5, 17, 151_000, VOCAB - 3, 99]}
    for rid, prompt in prompts.items():
        engine.submit(rid, prompt, NEW_TOKENS, temperature=1.0, ignore_eos=True)
    done = run_to_completion(engine)
    trained, initial = hf_model(str(trainer.out)), hf_model(qwen_dir)
    stale_head = hf_model(str(trainer.out))  # trained, but its head the initial embedding
    stale_head.lm_head.weight = torch.nn.Parameter(initial.model.embed_tokens.weight.detach().clone())
    assert stale_head.lm_head.weight is not stale_head.model.embed_tokens.weight
    for rid, s in done.items():
        assert s.versions.tolist() == [1] * NEW_TOKENS
        d_trained = np.abs(hf_logprobs(trained, s, 1.0) - s.behav_logprobs).max()
        d_initial = np.abs(hf_logprobs(initial, s, 1.0) - s.behav_logprobs).max()
        d_stale = np.abs(hf_logprobs(stale_head, s, 1.0) - s.behav_logprobs).max()
        print(f"\n{rid}: max |vLLM - HF(trained)| = {d_trained:.1e}; vs initial weights "
              f"{d_initial:.3f}; vs trained with the initial head {d_stale:.3f}; "
              f"paused {paused_s:.2f} s")
        assert d_trained < ATOL and d_initial > 0.05 and d_stale > 0.02, (rid, d_trained, d_initial, d_stale)
    deadline = time.monotonic() + 30  # the worker's output reaches the file asynchronously
    while True:
        log = engine_log.read_bytes()[log_start:].decode(errors="replace")
        if "Reloading weights inplace" in log or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert "Reloading weights inplace" in log, _tail(engine_log)  # the update's own lines are here
    assert "Failed to load weights" not in log, log[-4000:]
