"""VLLMEngine on the real vLLM (CPU): logprobs, per-token versions, interrupt + weight update.

One engine for the whole module (starting one takes 20-60 s on 2 cores). The tests run in
file order and share it: the last one shuts it down and checks that no process is left.
A tiny random Qwen2 is written to a temp dir; nothing is downloaded.
"""

import dataclasses
import multiprocessing as mp
import os

import numpy as np
import psutil
import pytest
import torch

from areal_hpc.config import RunConfig
from areal_hpc.rollout import vllm_engine
from areal_hpc.transport.rendezvous import free_port
from areal_hpc.transport.weights import WeightGroupAddress

DTYPE = "float32"  # fp32 so that behaviour logprobs can be compared with HF to ~1e-5
ATOL = 1e-4
LONG_PROMPT = [3 + (7 * i) % 120 for i in range(140)]  # > one 128-token KV block on CPU
FAKE_MPI_ENV = {"PMI_RANK": "0", "PMI_FD": "9", "HYDI_CONTROL_FD": "7", "MPI_LOCALRANKID": "0"}


def make_tiny_model(path):
    """Random Qwen2 (head_dim 32: vLLM's CPU attention has no kernel for 16) + char tokenizer.
    Two KV heads, so that a Megatron TP=2 trainer can shard it (tests of the weight path)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from areal_hpc.random_models import save_random_qwen2

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {chr(0x21 + i): 3 + i for i in range(125)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    ).save_pretrained(path)
    save_random_qwen2(path, num_attention_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False,
                      initializer_range=0.2,  # peaked, so that a weight change shows
                      eos_token_id=1, bos_token_id=1, pad_token_id=0)


def hf_model(model_dir, weights_path=None):
    from safetensors.torch import load_file
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    if weights_path is not None:
        model.load_state_dict(load_file(weights_path), strict=True)
    return model


@torch.no_grad()
def hf_logprobs(model, sample, temperature):
    """log_softmax(logits / T) of every output token given its full context, [n]."""
    ids = np.concatenate([sample.prompt_tokens, sample.output_tokens]).astype(np.int64)
    logits = model(torch.from_numpy(ids)[None]).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    p = len(sample.prompt_tokens)
    targets = torch.from_numpy(ids[p:])
    return logp[p - 1 : -1].gather(1, targets[:, None])[:, 0].numpy()


def run_to_completion(engine):
    out = []
    while engine.has_unfinished():
        out += engine.step()
    ids = [s.request_id for s in out]
    assert len(ids) == len(set(ids)), f"a request finished twice: {ids}"
    return {s.request_id: s for s in out}


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp_env:
        mp_env.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        mp_env.setenv("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm_cache")))
        # Only so the test can run a closure on the worker (to look at its environment).
        mp_env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        for k, v in FAKE_MPI_ENV.items():  # as if launched by mpiexec (hydra)
            mp_env.setenv(k, v)
        eng = vllm_engine.VLLMEngine(
            model_dir, dtype=DTYPE, max_model_len=512, seed=0, max_num_seqs=16
        )
        print(f"\nengine start: {eng.start_s:.1f} s, {len(eng._children)} child processes")
        yield eng
        eng.shutdown()


# ------------------------------------------------------------ no engine needed


def test_child_environment_without_mpi(monkeypatch):
    monkeypatch.setenv("PMI_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("MPICH_INTERFACE_HOSTNAME", "n1")
    monkeypatch.setenv("PMIX_RANK", "3")
    monkeypatch.setenv("HYDRA_LAUNCHER", "slurm")
    monkeypatch.setenv("KEEP_ME", "1")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    with vllm_engine._child_process_environment():
        assert not [k for k in os.environ if k.startswith(vllm_engine.MPI_ENV_PREFIXES)]
        assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
        assert os.environ["KEEP_ME"] == "1"
    assert os.environ["PMI_RANK"] == "3" and os.environ["OMPI_COMM_WORLD_RANK"] == "3"
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"


# ------------------------------------------------------------ with the engine


def test_children_do_not_see_the_mpi_job(engine):
    def worker_env(worker):     # local: pickled by value (a plain `pytest` run does not put the
        return dict(os.environ)  # repo root on the engine processes' sys.path)

    for k, v in FAKE_MPI_ENV.items():
        assert os.environ[k] == v  # restored in the generator rank's own process
    (env,) = engine._engine.collective_rpc(worker_env)
    assert not [k for k in env if k.startswith(vllm_engine.MPI_ENV_PREFIXES)]


def test_tokens_logprobs_versions_match_hf(engine, model_dir):
    temperature = 0.8
    prompts = {"a": [3, 4, 5, 6, 7], "b": list(range(10, 40)), "long": LONG_PROMPT}
    for rid, prompt in prompts.items():
        engine.submit(rid, prompt, 20, temperature=temperature, ignore_eos=True)
    group = {f"g:{i}": list(range(40, 52)) for i in range(3)}  # one request, three samples
    engine.submit_group(list(group), group["g:0"], 20, temperature=temperature, ignore_eos=True)
    assert engine.num_running() == 6
    with pytest.raises(ValueError, match="already running"):
        engine.submit_group(["x", "g:1"], [3, 4], 4)
    prompts |= group
    done = run_to_completion(engine)
    assert len({tuple(done[rid].output_tokens) for rid in group}) == 3  # sampled apart
    assert sorted(done) == sorted(prompts) and engine.num_running() == 0

    model = hf_model(model_dir)
    for rid, s in done.items():
        assert s.prompt_tokens.tolist() == prompts[rid]
        assert s.output_tokens.dtype == np.int32 and len(s.output_tokens) == 20
        assert s.behav_logprobs.dtype == np.float32 and s.behav_logprobs.shape == (20,)
        assert s.versions.dtype == np.int32 and s.versions.tolist() == [0] * 20
        assert s.finish_reason == "length" and s.num_interrupts == 0
        assert s.t_submit <= s.t_first_token <= s.t_end
        diff = np.abs(hf_logprobs(model, s, temperature) - s.behav_logprobs).max()
        print(f"{rid}: max |vLLM - HF| logprob = {diff:.2e}")
        assert diff < ATOL


def _trainer(model_dir, port, sent_path, meta_queue):
    """Plays trainer rank 0: perturbs the weights and broadcasts them over the weight group."""
    from safetensors.torch import load_file, save_file

    from areal_hpc.transport.weights import (
        broadcast_weights, close_weight_group, dtype_to_str, init_sender_group,
        init_weight_group, plan_buckets,
    )

    g = torch.Generator().manual_seed(1234)
    new = {}
    for name, t in load_file(os.path.join(model_dir, "model.safetensors")).items():
        t = t + 0.2 * torch.randn(t.shape, generator=g)
        # Norm weights travel in bf16 (vLLM casts them into its fp32 params): two dtypes.
        new[name] = t.to(torch.bfloat16) if "norm" in name else t
    # What vLLM ends up holding, in fp32, for the test's HF reference.
    save_file({k: v.float().contiguous() for k, v in new.items()}, sent_path)
    buckets = plan_buckets([(k, v.shape, dtype_to_str(v.dtype)) for k, v in new.items()], 32 << 10)
    meta_queue.put(buckets)
    address = WeightGroupAddress("127.0.0.1", port, 2, "gloo", timeout_s=300)
    group = init_sender_group(address)
    stats = broadcast_weights(group, new, buckets)
    meta_queue.put(stats)
    # The group re-formed (its generation 1), the same version sent again: the engine, which
    # runs it already, takes it off the wire without loading it.
    close_weight_group(group)
    group = init_weight_group(dataclasses.replace(address, generation=1), 0)
    broadcast_weights(group, new, buckets)


def test_weight_update_mid_generation(engine, model_dir, tmp_path):
    sent_path = str(tmp_path / "sent.safetensors")
    port = free_port()
    ctx = mp.get_context("spawn")
    meta_queue = ctx.Queue()
    trainer = ctx.Process(target=_trainer, args=(model_dir, port, sent_path, meta_queue))
    trainer.start()
    try:
        assert engine.init_weight_group(WeightGroupAddress("127.0.0.1", port, 2, "gloo"), 1) == [1]
        buckets = meta_queue.get(timeout=120)
        assert len({b[0][2] for b in buckets}) == 2 and len(buckets) > 2

        temperature, max_new = 1.0, 40
        prompts = {"u0": [5, 6, 7, 8], "u1": list(range(20, 50)), "u2": LONG_PROMPT}
        for rid, prompt in prompts.items():
            engine.submit(rid, prompt, max_new, temperature=temperature, ignore_eos=True)
        group = {"ug:0": [9, 10, 11], "ug:1": [9, 10, 11]}  # a group: each sample resumes alone
        engine.submit_group(list(group), group["ug:0"], max_new, temperature=temperature,
                            ignore_eos=True)
        prompts |= group
        early = []  # prefill + a few decode steps, then interrupt
        while min(len(r.tokens) for r in engine._requests.values()) < 3:
            early += engine.step()
        assert not early and engine.num_running() == 5

        paused_s = engine.update_weights(1, [(0, b) for b in buckets])
        assert engine.num_running() == 5  # all five resubmitted
        stats = meta_queue.get(timeout=120)
        early += engine.step()
        # version 1 again over the group's next generation: received and dropped, the model
        # and the requests untouched (each sample is interrupted once, below)
        address = WeightGroupAddress("127.0.0.1", port, 2, "gloo", generation=1)
        assert engine.init_weight_group(address, 1) == [1]
        engine.drain_weights([(0, b) for b in buckets])
        assert engine.version == 1 and engine.num_running() == 5
        done = run_to_completion(engine)
    finally:
        trainer.join(timeout=60)
    assert trainer.exitcode == 0
    print(
        f"\nupdate: generation paused {paused_s * 1e3:.0f} ms; trainer broadcast "
        f"{stats.num_buckets} buckets, {stats.num_bytes} B in {stats.seconds * 1e3:.0f} ms"
    )
    assert engine.version == 1
    assert set(done) == set(prompts)  # nothing lost, nothing duplicated (run_to_completion)

    old, new = hf_model(model_dir), hf_model(model_dir, sent_path)
    for rid, s in done.items():
        v = s.versions.tolist()
        k = v.count(0)
        assert len(v) == max_new and v == [0] * k + [1] * (max_new - k), v
        assert 1 <= k < max_new and s.num_interrupts == 1
        assert s.prompt_tokens.tolist() == prompts[rid]
        lp_old, lp_new = hf_logprobs(old, s, temperature), hf_logprobs(new, s, temperature)
        d_old = np.abs(lp_old[:k] - s.behav_logprobs[:k]).max()
        d_new = np.abs(lp_new[k:] - s.behav_logprobs[k:]).max()
        changed = np.abs(lp_old[k:] - s.behav_logprobs[k:]).max()
        print(f"{rid}: {k} v0 tokens |d|={d_old:.1e}; {max_new - k} v1 tokens |d|={d_new:.1e} "
              f"(vs old weights {changed:.2f})")
        assert d_old < ATOL and d_new < ATOL
        assert changed > 0.05  # the update did change the policy


def test_abort_all_then_continue_from_the_prefix(engine):
    """A preemption's path: every sample aborted with what it has so far, then continued by a
    fresh submission of prompt + prefix: the prefix keeps its tokens, log-probabilities and
    versions. (That the recomputed context gives the right log-probabilities is the weight
    update test's: the same resubmission.)"""
    prompt, max_new = list(range(60, 70)), 30
    engine.submit_group(["p:0", "p:1"], prompt, max_new, temperature=1.0, ignore_eos=True)
    while min(len(r.tokens) for r in engine._requests.values()) < 4:
        assert not engine.step()
    cut = engine.abort_all()
    assert engine.num_running() == 0 and not engine.has_unfinished()
    assert sorted(s.request_id for s in cut) == ["p:0", "p:1"]
    for s in cut:
        assert s.finish_reason == "abort" and 4 <= len(s.output_tokens) < max_new
        engine.continue_sample(s, max_new, temperature=1.0, ignore_eos=True)
    full = vllm_engine.FinishedSample(                   # nothing left to do
        "full", np.asarray(prompt, np.int32), np.full(3, 5, np.int32), np.full(3, -1.0, np.float32),
        np.zeros(3, np.int32), "abort", 0.0, 0.0, 0.0)
    engine.continue_sample(full, 3)
    done = run_to_completion(engine)
    assert done["full"].finish_reason == "length" and done["full"].output_tokens.tolist() == [5] * 3
    for s in cut:
        d, k = done[s.request_id], len(s.output_tokens)
        assert len(d.output_tokens) == max_new and d.num_interrupts == 1
        assert d.output_tokens[:k].tolist() == s.output_tokens.tolist()
        assert d.behav_logprobs[:k].tolist() == s.behav_logprobs.tolist()
        assert d.versions.tolist() == [engine.version] * max_new and d.t_submit == s.t_submit


def test_abort_one_group_while_another_runs(engine):
    """A group too stale to be trained is stopped where it is (`abort`): its samples come back
    with what they have, the engine forgets them (no late output reaches `step`), and another
    group in the same engine runs on to its end. A group's samples go together: aborting only
    some of one vLLM request's samples is refused."""
    prompt, max_new = list(range(60, 70)), 40
    engine.submit_group(["a:0", "a:1", "a:2"], prompt, max_new, temperature=1.0, ignore_eos=True)
    engine.submit_group(["b:0", "b:1"], prompt, max_new, temperature=1.0, ignore_eos=True)
    while min(len(r.tokens) for r in engine._requests.values()) < 3:
        assert not engine.step()
    assert engine.oldest_version("a:0") == engine.version and engine.oldest_version("x:0") is None
    with pytest.raises(ValueError, match="not being aborted"):
        engine.abort(["a:0", "a:1"])
    cut = engine.abort(["a:0", "a:1", "a:2", "not-here"])
    assert sorted(s.request_id for s in cut) == ["a:0", "a:1", "a:2"]
    for s in cut:
        n = len(s.output_tokens)
        assert s.finish_reason == "abort" and 3 <= n < max_new
        assert len(s.behav_logprobs) == n and s.versions.tolist() == [engine.version] * n
    assert sorted(engine._requests) == ["b:0", "b:1"] and engine.abort(["a:0"]) == []
    done = run_to_completion(engine)
    assert sorted(done) == ["b:0", "b:1"]
    assert all(len(d.output_tokens) == max_new for d in done.values())


class _Chan:
    def __init__(self):
        self.sent = []

    def send(self, obj, dest, tag):
        self.sent.append((dest, tag, obj))


class _NoScores:
    """A reward pool nothing reaches in this test (no sample finishes before the abort)."""

    def submit(self, *a):
        raise AssertionError(f"nothing should be scored here: {a}")


def test_generator_stops_a_stale_group_and_sends_it(engine):
    """StaleBefore on a generator (Generator._abort_stale) with the real engine: a training group
    whose oldest token predates the version is stopped and sent at once as far as it got
    (finish_reason "abort", reward 0); a group that started later and an evaluation group are
    left running to their end."""
    from areal_hpc.rollout.generator import Generator, _Group, request_id
    from areal_hpc.topology import CONTROLLER_RANK
    from areal_hpc.transport import messages as msgs
    from areal_hpc.transport.mpi import Tag

    gen = Generator(RunConfig(), type("Topo", (), {"rank": 3})(), engine=engine,   # no MPI, no job
                    rewards=_NoScores(), chan=_Chan())
    prompt, max_new, v0 = list(range(60, 70)), 40, engine.version

    def submit(kind, pid, n):
        gen.groups[(kind, pid)] = _Group(msgs.Prompt(pid, prompt, n, "math", "1"))
        engine.submit_group([request_id(kind, pid, i) for i in range(n)], prompt, max_new,
                            temperature=1.0, ignore_eos=True)

    try:
        submit("train", 1, 3)
        submit("eval", 1, 2)
        while min(len(r.tokens) for r in engine._requests.values()) < 2:
            assert not engine.step()
        engine.version = v0 + 1                 # as after a weight update: later tokens carry it
        submit("train", 2, 2)
        while min(len(r.tokens) for r in engine._requests.values()) < 2:
            assert not engine.step()
        gen._abort_stale(v0)                    # nothing is older than v0
        assert gen.chan.sent == [] and gen.stale_aborted == 0
        gen._abort_stale(v0 + 1)
        (dest, tag, group), = gen.chan.sent
        assert dest == CONTROLLER_RANK and tag == Tag.TRAJECTORIES and gen.stale_aborted == 1
        trajs = group.trajectories
        assert [t["prompt_id"] for t in trajs] == [1, 1, 1]
        assert [t["sample_idx"] for t in trajs] == [0, 1, 2]
        assert all(t["finish_reason"] == "abort" and t["reward"] == 0.0 and t["generator_rank"] == 3
                   and 2 <= len(t["output_tokens"]) < max_new and t["versions"][0] == v0
                   for t in trajs)
        assert gen.tokens_generated == sum(len(t["output_tokens"]) for t in trajs)
        assert sorted(gen.groups) == [("eval", 1), ("train", 2)]
        done = run_to_completion(engine)
        assert sorted(done) == ["eval:1:0", "eval:1:1", "train:2:0", "train:2:1"]
    finally:
        engine.version = v0


def test_update_from_file_and_prefix_cache_reset(engine, model_dir, tmp_path):
    """Weights from a directory of safetensors shards. LONG_PROMPT's first KV block is in the
    prefix cache from earlier tests, computed with other weights; it must not be reused."""
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(99)
    weights = {
        k: (v + 0.2 * torch.randn(v.shape, generator=g)).contiguous()
        for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()
    }
    names = sorted(weights)  # two shards in a directory, as an HF export writes them
    for i, part in enumerate((names[::2], names[1::2])):
        save_file({k: weights[k] for k in part}, str(tmp_path / f"model-{i}.safetensors"))
    save_file(weights, str(tmp_path / "reference.st"))  # not *.safetensors: not loaded
    engine.submit("pending", [3, 4, 5], 8, ignore_eos=True)  # waiting or running: interrupted
    engine.update_weights_from_file(2, str(tmp_path))
    assert engine.num_running() == 1
    engine.submit("f", LONG_PROMPT, 8, temperature=1.0, ignore_eos=True)
    done = run_to_completion(engine)
    assert done["pending"].versions.tolist() == [2] * 8
    s = done["f"]
    assert s.versions.tolist() == [2] * 8
    reference = hf_model(model_dir, str(tmp_path / "reference.st"))
    diff = np.abs(hf_logprobs(reference, s, 1.0) - s.behav_logprobs).max()
    assert diff < ATOL


def test_a_load_that_fails_part_way_holds_the_samples_and_the_next_load_is_whole(
        engine, model_dir, tmp_path):
    """A load that breaks off part-way (here a shard that will not open after the first loaded;
    under broadcast, a receive that timed out) leaves vLLM's model half loaded: layers still on
    the reload's placeholder tensors. Nothing is generated with it: the samples it interrupted
    and those submitted meanwhile wait, and the engine lives (a step on that model killed it:
    "_C::onednn_mm ... Meta tensors"). The next load is whole: a layer the failed one had part
    loaded (layer 0's attention: q came, k and v did not) computes with the new weights alone."""
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(7)
    weights = {k: (v + 0.2 * torch.randn(v.shape, generator=g)).contiguous()
               for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()}
    first = sorted(k for k in weights if ".layers.0." in k and "k_proj" not in k
                   and "v_proj" not in k)
    assert any("q_proj" in k for k in first)
    broken = tmp_path / "broken"
    broken.mkdir()
    save_file({k: weights[k] for k in first}, str(broken / "model-0.safetensors"))
    (broken / "model-1.safetensors").write_bytes(b"\x10" * 64)   # not a safetensors file
    whole = tmp_path / "whole"
    whole.mkdir()
    save_file(weights, str(whole / "model.safetensors"))

    before = engine.version
    engine.submit("cut", [3, 4, 5, 6], 12, temperature=1.0, ignore_eos=True)
    while not engine._requests["cut"].tokens:
        assert engine.step() == []
    with pytest.raises(RuntimeError, match="load_weights_from_file failed"):
        engine.update_weights_from_file(before + 1, str(broken))
    assert engine.version == before
    tokens = list(engine._requests["cut"].tokens)
    engine.submit("late", [7, 8, 9], 6, temperature=1.0, ignore_eos=True)
    assert engine.num_running() == 2 and engine.step() == []     # held, not sent to vLLM
    assert engine._requests["cut"].tokens == tokens and not engine._requests["late"].tokens
    assert all(p.is_running() for p in engine.processes())
    engine.update_weights_from_file(before + 2, str(whole))
    done = run_to_completion(engine)
    cut, late = done["cut"], done["late"]
    k = cut.versions.tolist().count(before)
    assert 1 <= k < 12 and cut.versions.tolist() == [before] * k + [before + 2] * (12 - k)
    assert cut.num_interrupts == 1 and late.num_interrupts == 0
    assert late.versions.tolist() == [before + 2] * 6
    reference = hf_model(model_dir, str(whole / "model.safetensors"))
    assert np.abs(hf_logprobs(reference, late, 1.0) - late.behav_logprobs).max() < ATOL
    assert np.abs(hf_logprobs(reference, cut, 1.0)[k:] - cut.behav_logprobs[k:]).max() < ATOL


def test_a_stop_string_across_a_weight_update_ends_the_sample(engine, model_dir):
    """A stop string whose first character was sampled before a weight update and whose second
    after it ends the sample there, as it ends one never cut (vLLM searches only the new
    request's text; the model would write on past its turn, e.g. a made-up tool output that is
    then trained). Likewise for a model turn continued as a prompt (`stop_context`: its tokens
    end the prompt), as a preempted episode's turn is. Greedy decoding under one set of weights,
    so that the uncut and the cut sample agree."""
    weights = os.path.join(model_dir, "model.safetensors")
    engine.update_weights_from_file(3, weights)
    prompt = list(range(60, 70))
    engine.submit("probe", prompt, 24, temperature=0.0, ignore_eos=True)
    greedy = run_to_completion(engine)["probe"].output_tokens.tolist()
    decode = engine._engine.get_tokenizer().decode
    text = [decode([t]) for t in greedy]
    # a cut after k tokens, with the pair (k-1, k) seen nowhere before it
    k = next(k for k in range(4, 20) if text[k - 1] + text[k] not in "".join(text[:k]))
    stop = text[k - 1] + text[k]
    engine.submit("uncut", prompt, 24, temperature=0.0, ignore_eos=True, stop=[stop])
    assert run_to_completion(engine)["uncut"].output_tokens.tolist() == greedy[:k + 1]
    engine.submit("cut", prompt, 24, temperature=0.0, ignore_eos=True, stop=[stop])
    while len(engine._requests["cut"].tokens) < k:
        assert not engine.step()
    assert engine._requests["cut"].tokens == greedy[:k], "one token per step expected here"
    engine.update_weights_from_file(4, weights)         # the same weights: the same next token
    as_prompt = vllm_engine.FinishedSample(
        "as_prompt", np.asarray(prompt + greedy[:k], np.int32), np.zeros(0, np.int32),
        np.zeros(0, np.float32), np.zeros(0, np.int32), "abort", 0.0, 0.0, 0.0)
    engine.continue_sample(as_prompt, 24 - k, temperature=0.0, ignore_eos=True, stop=[stop],
                           stop_context=k)
    done = run_to_completion(engine)
    cut = done["cut"]
    assert cut.finish_reason == "stop" and cut.num_interrupts == 1, (cut.output_tokens, stop)
    assert cut.output_tokens.tolist() == greedy[:k + 1] and cut.versions.tolist() == [3] * k + [4]
    assert len(cut.behav_logprobs) == k + 1
    assert done["as_prompt"].finish_reason == "stop"
    assert done["as_prompt"].output_tokens.tolist() == [greedy[k]]


# ------------------------------------------------------------ trainer layouts → engine

WORKER = os.path.join(os.path.dirname(__file__), "weights_worker.py")


def _perturbed_copy(model_dir, out, seed):
    """`model_dir` with every weight moved by 0.2·N(0,1): the 'trained' policy of one case."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    g = torch.Generator().manual_seed(seed)
    path = os.path.join(out, "model.safetensors")
    weights = {k: (v + 0.2 * torch.randn(v.shape, generator=g)).contiguous()
               for k, v in load_file(path).items()}
    save_file(weights, path, metadata={"format": "pt"})
    return str(out)


def _wait_for(path, proc, timeout=600):
    import time

    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise AssertionError(f"trainer ranks exited ({proc.returncode}):\n{proc.stdout.read()[-4000:]}")
        assert time.monotonic() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.2)


@pytest.mark.parametrize("world,layouts", [
    (1, [("tp1", 1, 1, "broadcast"), ("tp1_disk", 1, 1, "disk")]),
    (2, [("tp2", 2, 1, "broadcast"), ("pp2", 1, 2, "broadcast"), ("pp2_disk", 1, 2, "disk")]),
    (4, [("tp2pp2", 2, 2, "broadcast")]),
], ids=["world1", "world2", "world4"])
def test_update_from_trainer_layouts(engine, model_dir, tmp_path, world, layouts, run_distributed):
    """The trainer's own `WeightPublisher` from Megatron layouts (TP gathered, one sender per
    PP stage, or versioned safetensors on disk) into the running engine: afterwards vLLM's
    log-probs match a HF forward pass of the weights the trainer was loaded with."""
    import pickle

    cases = []
    for i, (tag, tp, pp, mode) in enumerate(layouts):
        cases.append({"tag": tag, "tp": tp, "pp": pp, "mode": mode, "port": free_port(),
                      "version": 10 + i + 10 * world,
                      "model_dir": _perturbed_copy(model_dir, tmp_path / tag, 1000 * world + i)})
    (tmp_path / "in.pkl").write_bytes(pickle.dumps({"cases": cases, "torch_port": free_port()}))
    proc = run_distributed.start(WORKER, world, tmp_path)
    prompts = {"p0": [5, 6, 7, 8], "p1": list(range(20, 50))}
    try:
        for case in cases:
            tag, version = case["tag"], case["version"]
            if case["mode"] == "broadcast":
                pp = case["pp"]
                address = WeightGroupAddress("127.0.0.1", case["port"], pp + 1, "gloo", 120, 600)
                assert engine.init_weight_group(address, pp) == [pp]
                _wait_for(tmp_path / f"{tag}.plan.pkl", proc)
                plan = pickle.loads((tmp_path / f"{tag}.plan.pkl").read_bytes())
                assert {root for root, _ in plan} == set(range(pp)) and len(plan) >= 1
                paused_s = engine.update_weights(version, plan)
                _wait_for(tmp_path / f"{tag}.done", proc)
            else:
                _wait_for(tmp_path / f"{tag}.done", proc)
                path = (tmp_path / f"{tag}.done").read_text()
                assert sorted(os.listdir(path)) and all(f.endswith(".safetensors") for f in os.listdir(path))
                paused_s = engine.update_weights_from_file(version, path)
            assert engine.version == version
            for rid, prompt in prompts.items():
                engine.submit(f"{tag}-{rid}", prompt, 12, temperature=1.0, ignore_eos=True)
            done = run_to_completion(engine)
            reference, before = hf_model(case["model_dir"]), hf_model(model_dir)
            for rid, s in done.items():
                assert s.versions.tolist() == [version] * 12
                diff = np.abs(hf_logprobs(reference, s, 1.0) - s.behav_logprobs).max()
                moved = np.abs(hf_logprobs(before, s, 1.0) - s.behav_logprobs).max()
                print(f"\n{rid}: max |vLLM - HF(trainer weights)| = {diff:.1e} "
                      f"(vs initial weights {moved:.2f}); paused {paused_s * 1e3:.0f} ms")
                assert diff < ATOL and moved > 0.05
        assert proc.wait(timeout=300) == 0, proc.stdout.read()[-4000:]
    finally:
        run_distributed.stop(proc)
    disk = [c for c in cases if c["mode"] == "disk"]
    if disk:                            # disk mode keeps the newest version only
        weights_dir = tmp_path / "weights"
        assert [d.name for d in weights_dir.iterdir()] == [f"v{disk[-1]['version']:08d}"]


def test_shutdown_leaves_no_process(engine):
    children = list(engine._children)
    assert children, "vLLM runs in child processes"
    # Processes this session started before the engine (e.g. Megatron's checkpoint-writer
    # Manager, which Megatron keeps for the life of the process) are not the engine's.
    since = min(p.create_time() for p in children) - 1.0
    engine.shutdown()
    engine.shutdown()  # idempotent
    assert not [p for p in children if p.is_running()]
    left = [p for p in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline()) and p.create_time() >= since]
    assert not left, [(p.pid, p.cmdline()) for p in left]
