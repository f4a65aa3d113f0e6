"""Per-request sampling seeds (issue 30): a sample's seed comes from the run's seed, its prompt
and its index in the group; with it, the sample's tokens do not depend on the batch around it
(other requests, their arrival, how the group was split into vLLM requests), and a continuation
from a prefix is reproducible given where it was cut."""
import numpy as np
import pytest

from areal_hpc.config import RunConfig
from areal_hpc.rollout import seeds
from areal_hpc.rollout import vllm_engine as ve

from .test_vllm_engine import DTYPE, LONG_PROMPT, make_tiny_model, run_to_completion


# ------------------------------------------------------------ no engine needed

def test_seeds_are_stable_distinct_and_in_range():
    s = [seeds.sample_seed(1, "train", 7, i) for i in range(8)]
    assert s == [seeds.group_seed(1, "train", 7) + i for i in range(8)]
    assert len(set(s)) == 8 and all(0 <= x < 2**seeds.SEED_BITS for x in s)
    # the same on every machine and in every run (BLAKE2b of the integers, no Python hash())
    assert seeds.group_seed(1, "train", 7) == 39402515065201290
    assert seeds.group_seed(1, "train", 7) != seeds.group_seed(2, "train", 7)      # run seed
    assert seeds.group_seed(1, "train", 7) != seeds.group_seed(1, "train", 8)      # prompt
    assert seeds.group_seed(1, "train", 7) != seeds.group_seed(1, "eval", 7)       # held-out apart
    groups = {seeds.group_seed(1, "train", p) for p in range(10_000)}
    assert len(groups) == 10_000 and max(groups) < 2**61
    assert seeds.continuation_seed(s[0], 0) == s[0]
    cont = {seeds.continuation_seed(s[0], k) for k in range(1, 50)}
    assert len(cont) == 49 and s[0] not in cont and max(cont) < 2**seeds.SEED_BITS


def test_sync_mode_sends_groups_in_prompt_order():
    """rollout.mode sync: a scored group waits for the groups whose prompts came before it on
    this generator, so the batch and the log's rows come in one order whatever order the
    scores arrive in; at a preemption the held groups go first, complete. Each trajectory
    carries its sample's seed."""
    from areal_hpc.rollout.generator import Generator, _Group
    from areal_hpc.transport import messages as msgs

    from .test_vllm_engine import _Chan

    cfg = RunConfig()
    cfg.rollout.mode = "sync"
    gen = Generator(cfg, type("Topo", (), {"rank": 1})(), chan=_Chan())   # no MPI, no job
    gen._send_order = [5, 3, 9, 4]

    def scored(pid):
        g = _Group(msgs.Prompt(pid, [1, 2], 1, "math", "1"))
        g.samples[0] = ve.FinishedSample(
            f"train:{pid}:0", np.asarray([1, 2], np.int32), np.asarray([7], np.int32),
            np.asarray([-0.5], np.float32), np.zeros(1, np.int32), "stop", 0.0, 0.0, 0.0,
            seed=100 + pid)
        g.rewards[0] = 1.0
        return g

    sent = lambda: [m.trajectories[0]["prompt_id"] for _, _, m in gen.chan.sent]
    gen._send(scored(9))
    assert sent() == []
    gen._send(scored(5))
    assert sent() == [5]
    gen._send(scored(3))
    assert sent() == [5, 3, 9]
    assert [m.trajectories[0]["seed"] for _, _, m in gen.chan.sent] == [105, 103, 109]
    gen._send_order.append(8)
    gen._send(scored(8))                        # waits for 4, still being generated
    gen._send_held(every=True)                  # a preemption: what is held goes, in order
    assert sent() == [5, 3, 9, 8] and gen._send_order == [] and gen._held == {}


def test_a_preempted_sample_from_the_current_weights_is_generated_again():
    """A resumed job's partial samples: with per-request seeds, an unfinished one whose tokens
    all came from the weights the engine holds starts again from its own seed (it then draws
    what the uninterrupted run drew); one with tokens of older weights goes on from its prefix,
    a finished one is kept whole; without seeds every one is continued."""
    from areal_hpc.rollout.generator import Generator
    from areal_hpc.transport import messages as msgs

    class Engine:
        version = 3

        def __init__(self):
            self.fresh, self.continued = [], []

        def submit_group(self, ids, prompt, max_new_tokens, seeds=None, **sampling):
            self.fresh.append((list(ids), seeds))

        def continue_sample(self, smp, max_new_tokens, **sampling):
            self.continued.append((smp.request_id, len(smp.output_tokens), smp.seed))

    def cont(idx, versions, finish="abort"):
        n = len(versions)
        return msgs.Continuation(idx, np.arange(n, dtype=np.int32), np.zeros(n, np.float32),
                                 np.asarray(versions, np.int32), finish, 0.0, 0.0, 0.0)

    prompt = msgs.Prompt(7, [1, 2], 5, "math", "1", continued=(
        cont(0, [3, 3, 3]), cont(1, [2, 3]), cont(2, [3, 3], "stop"), cont(3, [])))
    s0 = seeds.group_seed(RunConfig().train.seed, "train", 7)
    for seeded in (True, False):
        cfg = RunConfig()
        cfg.rollout.per_request_seeds = seeded
        gen = Generator(cfg, type("Topo", (), {"rank": 1})(), engine=Engine())
        gen._submit("train", prompt)
        continued = [(rid, n) for rid, n, _ in gen.engine.continued]
        if seeded:
            assert continued == [("train:7:1", 2), ("train:7:2", 2)] and gen.regenerated == 1
            assert gen.engine.fresh == [(["train:7:0", "train:7:3", "train:7:4"],
                                         [s0, s0 + 3, s0 + 4])]
        else:
            assert continued == [("train:7:0", 3), ("train:7:1", 2), ("train:7:2", 2)]
            assert gen.engine.fresh == [(["train:7:3", "train:7:4"], None)]
            assert gen.regenerated == 0


# ------------------------------------------------------------ on the engine

@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_seeds")
    make_tiny_model(path)
    with pytest.MonkeyPatch.context() as mp_env:
        mp_env.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        mp_env.setenv("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm_cache")))
        # the smallest token budget seeded requests allow on CPU (no chunked prefill)
        eng = ve.VLLMEngine(str(path), dtype=DTYPE, max_model_len=256, seed=0, max_num_seqs=16,
                            max_num_batched_tokens=256, per_request_seeds=True)
        yield eng
        eng.shutdown()


def _same(a, b):
    """Bit for bit: tokens, their log-probabilities, versions."""
    return (a.output_tokens.tolist() == b.output_tokens.tolist()
            and a.behav_logprobs.tobytes() == b.behav_logprobs.tobytes()
            and a.versions.tolist() == b.versions.tolist())


def test_a_seeded_sample_does_not_depend_on_its_batch(engine):
    """One group alone, then the same seeds with other requests decoding around them, split
    into one-sample requests submitted in another order: the same tokens and log-probabilities,
    bit for bit (vLLM's CPU kernels measured batch-invariant on this model)."""
    prompt, max_new, s0 = list(range(60, 72)), 24, seeds.group_seed(1, "train", 3)
    engine.submit_group([f"a:{i}" for i in range(4)], prompt, max_new, 1.0, ignore_eos=True,
                        seeds=[s0 + i for i in range(4)])
    alone = run_to_completion(engine)
    assert [alone[f"a:{i}"].seed for i in range(4)] == [s0 + i for i in range(4)]
    assert len({tuple(s.output_tokens) for s in alone.values()}) == 4   # distinct draws
    engine.submit_group([f"o:{i}" for i in range(5)], LONG_PROMPT, 40, 1.0, ignore_eos=True)
    for _ in range(3):
        engine.step()
    for i in (3, 1):
        engine.submit(f"b:{i}", prompt, max_new, 1.0, ignore_eos=True, seed=s0 + i)
    engine.submit_group(["b:0", "b:2"], prompt, max_new, 1.0, ignore_eos=True,
                        seeds=[s0, s0 + 2])     # not consecutive: two vLLM requests
    mixed = run_to_completion(engine)
    for i in range(4):
        assert _same(alone[f"a:{i}"], mixed[f"b:{i}"]), i
    # another seed, other tokens; the shared stream is not the seeded one
    engine.submit("c", prompt, max_new, 1.0, ignore_eos=True, seed=s0 + 4)
    assert not _same(run_to_completion(engine)["c"], alone["a:0"])


def test_a_seeded_long_prompt_beside_decoding_requests(engine):
    """vLLM 0.32 on CPU kills its worker ("CPU Generator does not use offset") when a seeded
    request's prompt is prefilled in chunks while others decode (here: two 130-token prefills
    and two decodes exceed the step's 256 tokens); the engine runs seeded requests without
    chunked prefill, and the long prompt's tokens are those it draws alone."""
    engine.submit_group(["l:0", "l:1"], LONG_PROMPT[:130], 8, 1.0, ignore_eos=True, seeds=[5, 6])
    alone = run_to_completion(engine)
    assert engine._engine.reset_prefix_cache()     # its prompt is prefilled again below
    engine.submit_group(["d:0", "d:1"], list(range(60, 70)), 60, 1.0, ignore_eos=True, seeds=[9, 10])
    for _ in range(3):
        engine.step()
    engine.submit_group(["m:0", "m:1"], LONG_PROMPT[:130], 8, 1.0, ignore_eos=True, seeds=[5, 6])
    mixed = run_to_completion(engine)
    assert _same(alone["l:0"], mixed["m:0"]) and _same(alone["l:1"], mixed["m:1"])


def test_a_continuation_repeats_given_where_it_was_cut(engine):
    """A sample cut after k tokens (a weight update, a preemption) goes on from
    continuation_seed(seed, k): continued twice from the same prefix, the same tokens; its seed
    stays the sample's own."""
    prompt, max_new, seed = list(range(40, 50)), 30, seeds.sample_seed(1, "train", 11, 1)
    engine.submit_group(["p:1"], prompt, max_new, 1.0, ignore_eos=True, seeds=[seed])
    while len(engine._requests["p:1"].tokens) < 4:
        assert not engine.step()
    (cut,) = engine.abort_all()
    assert cut.finish_reason == "abort" and cut.seed == seed
    outs = []
    for _ in range(2):
        engine.continue_sample(cut, max_new, 1.0, ignore_eos=True)
        outs.append(run_to_completion(engine)["p:1"])
    assert _same(outs[0], outs[1]) and outs[0].seed == seed and outs[0].num_interrupts == 1
    k = len(cut.output_tokens)
    assert outs[0].output_tokens[:k].tolist() == cut.output_tokens.tolist()


def test_seeds_need_an_engine_started_for_them(engine, monkeypatch):
    monkeypatch.setattr(engine, "per_request_seeds", False)
    with pytest.raises(ValueError, match="per_request_seeds"):
        engine.submit("x", [5, 6], 4, seed=1)
    monkeypatch.setattr(engine, "per_request_seeds", True)
    with pytest.raises(ValueError, match="distinct"):
        engine.submit_group(["y:0", "y:1"], [5, 6], 4, seeds=[3, 3])
    with pytest.raises(ValueError, match="distinct"):
        engine.submit("z", [5, 6], 4, seed=2**62)
    assert not engine.has_unfinished()
    np.testing.assert_equal(engine.num_running(), 0)
