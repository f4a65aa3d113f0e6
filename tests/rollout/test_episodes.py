"""Multi-turn episodes on a generator (rollout/episodes.py) with the real vLLM engine (CPU) and
real environment processes (env/runner.py): token in and token out, masks and versions, a slow
tool beside other requests, a weight update inside an episode, a preemption mid-episode and its
resumption. No MPI: the generator's channel is a list (as in test_vllm_engine.py).

One engine for the module; the tests share it and run in file order.
"""
import time

import numpy as np
import pytest
import torch

from areal_hpc.config import RunConfig
from areal_hpc.env.runner import EnvRunner
from areal_hpc.rollout import vllm_engine
from areal_hpc.rollout.generator import Generator
from areal_hpc.storage.rollout_log import RolloutWriter
from areal_hpc.transport import messages as msgs
from tests.rollout.test_vllm_engine import hf_logprobs, hf_model

TURN = 6            # tokens per model turn at most (rollout.max_new_tokens)
ATOL = 1e-4

ENV = '''
import os
import time
from areal_hpc.env.base import Step, ToolCall


class Echo:
    """Answers each model turn with "#<turn>:<its length>" (a tool call), reward 0.5 per answer;
    done after `turns` model turns, the final reward the last turn's length. Its answer to turn
    `slow_turn` of the question `slow` waits until the file `release` exists (a slow tool)."""

    def __init__(self, turns=3, slow="", slow_turn=1, release=""):
        self.turns, self.slow, self.slow_turn, self.release = turns, slow, slow_turn, release

    def reset(self, row):
        self.n, self.question = 0, row["question"]
        return row["question"]

    def step(self, text, ids):
        self.n += 1
        if self.question == self.slow and self.n == self.slow_turn:
            deadline = time.monotonic() + 300
            while not os.path.exists(self.release) and time.monotonic() < deadline:
                time.sleep(0.02)
        if self.n >= self.turns:
            return Step(done=True, reward=float(len(ids)))
        out = f"#{self.n}:{len(ids)}"
        return Step(observation=out, reward=0.5, tool=ToolCall("echo", text, len(out), 0.0, None))
'''


class _Chan:
    def __init__(self):
        self.sent = []

    def send(self, obj, dest, tag):
        self.sent.append(obj)

    def of(self, kind):
        return [m for m in self.sent if isinstance(m, kind)]


class _NoScores:
    """The reward pool: an episode's reward is its environment's; nothing reaches the pool."""
    unfinished = ()

    def submit(self, *a):
        raise AssertionError(f"nothing should be scored by the pool: {a}")

    def done(self, timeout=0.0):
        time.sleep(timeout)
        return []


def module_engine(model, tmp_path_factory, max_model_len: int, max_num_seqs: int):
    """A seeded fp32 engine on `model` for a module's tests (a fixture's body)."""
    with pytest.MonkeyPatch.context() as mp_env:
        mp_env.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        mp_env.setenv("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm_cache")))
        eng = vllm_engine.VLLMEngine(model, dtype="float32", max_model_len=max_model_len, seed=0,
                                     max_num_seqs=max_num_seqs, per_request_seeds=True)
        yield eng
        eng.shutdown()


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    yield from module_engine(model_dir, tmp_path_factory, 512, 16)


def _cfg(tmp_path, **args) -> RunConfig:
    (tmp_path / "echo_env.py").write_text(ENV)
    cfg = RunConfig()
    cfg.rollout.max_new_tokens, cfg.rollout.temperature = TURN, 1.0
    cfg.rollout.per_request_seeds = True
    cfg.env.fn = f"{tmp_path / 'echo_env.py'}:Echo"
    cfg.env.args = args
    cfg.env.max_turns, cfg.env.max_episode_tokens = 4, 200
    cfg.env.call_timeout_s = 600        # the slow tool's wait is the test's to end
    return cfg


def _generator(cfg, engine, model_dir) -> Generator:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    return Generator(cfg, type("Topo", (), {"rank": 1})(), engine=engine, rewards=_NoScores(),
                     chan=_Chan(), tokenizer=tok, envs=EnvRunner(cfg.env, 8))


def _prompt(pid, question, n=2, continued=()):
    return msgs.Prompt(pid, [5, 6, 7], n, "custom", None, row={"question": question},
                       continued=continued)


def _turn(gen, until=None, timeout=300.0) -> None:
    """The generator's loop without a controller: engine steps, answers, groups sent, until
    `until()` (default: nothing left)."""
    deadline = time.monotonic() + timeout
    while not (until() if until else not (gen.groups or gen.episodes)):
        assert time.monotonic() < deadline, "the episodes did not end"
        if gen.engine.has_unfinished():
            gen._step()
        for _, group in gen._collect_rewards(0.0 if gen.engine.has_unfinished() else 0.01):
            gen._send(group)


def _sent(gen) -> dict:
    """The trajectories of the groups sent, by (prompt id, sample index)."""
    return {(t["prompt_id"], t["sample_idx"]): t for g in gen.chan.of(msgs.Group)
            for t in g.trajectories}


def _check_episode(t, tok, turns: int):
    """A finished Echo episode: sampled turns and "#k:len" observations alternate, observation
    tokens masked with version -1 and log-probability 0, the tool records and rewards as the
    environment gave them."""
    out, mask, ends = t["output_tokens"], t["loss_mask"], t["turn_ends"].tolist()
    kinds = t["turn_is_sample"].tolist()
    assert kinds == [1, 0] * (turns - 1) + [1]
    starts = [0] + ends[:-1]
    sampled = [out[a:b] for a, b, k in zip(starts, ends, kinds) if k]
    for i, (a, b, k) in enumerate(zip(starts, ends, kinds)):
        assert (mask[a:b] == k).all()
        if k:
            assert (t["versions"][a:b] >= 0).all() and 1 <= b - a <= TURN
        else:
            n = i // 2 + 1
            expect = tok(f"#{n}:{len(sampled[n - 1])}", add_special_tokens=False)["input_ids"]
            assert out[a:b].tolist() == expect            # appended as tokenised once
            assert (t["versions"][a:b] == -1).all() and (t["behav_logprobs"][a:b] == 0).all()
    assert [c.name for c in t["tool_calls"]] == ["echo"] * (turns - 1)
    assert t["reward"] == pytest.approx(0.5 * (turns - 1) + len(sampled[-1]))
    assert t["finish_reason"] == "stop"
    return sampled


def test_episodes_token_in_token_out(engine, model_dir, tmp_path):
    """Two groups of two episodes of three model turns: the trained ids are the sampled ids and
    the observations' ids, never re-tokenised; every sampled token's behaviour log-probability
    is the model's for that token after exactly the sequence before it (prompt, earlier turns,
    observations), which a re-tokenised turn would not give."""
    gen = _generator(_cfg(tmp_path), engine, model_dir)
    try:
        gen._handle(msgs.Prompts([_prompt(0, "abc"), _prompt(1, "xyz")]))
        _turn(gen)
        got = _sent(gen)
        assert sorted(got) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        ref = hf_model(model_dir)
        for key, t in got.items():
            question = "abc" if key[0] == 0 else "xyz"
            assert t["prompt_tokens"].tolist() == gen.tokenizer(question,
                                                                add_special_tokens=False)["input_ids"]
            _check_episode(t, gen.tokenizer, 3)
            sample = type("S", (), {"prompt_tokens": t["prompt_tokens"],
                                    "output_tokens": t["output_tokens"]})
            lp = hf_logprobs(ref, sample, 1.0)
            m = t["loss_mask"] == 1
            assert np.abs(lp[m] - t["behav_logprobs"][m]).max() < ATOL
            assert (t["versions"][m] == 0).all()
        assert gen.episodes == {} and gen.groups == {}
        assert gen.tokens_generated == sum(int(t["loss_mask"].sum()) for t in got.values())
    finally:
        gen.envs.close()


def test_a_slow_tool_does_not_stall_the_engine(engine, model_dir, tmp_path):
    """One episode's tool is still working on its answer to the first turn when another group
    arrives: the engine generates that group's episodes, every turn of them, meanwhile."""
    release = tmp_path / "release"
    gen = _generator(_cfg(tmp_path, turns=4, slow="slow", slow_turn=1, release=str(release)),
                     engine, model_dir)
    try:
        gen._handle(msgs.Prompts([_prompt(0, "slow", n=1)]))
        slow = gen.episodes[("train", 0, 0)]
        _turn(gen, until=lambda: slow.phase == "step")
        gen._handle(msgs.Prompts([_prompt(1, "fast", n=2)]))
        steps = [0]
        real_step = gen._step

        def counted():
            steps[0] += 1
            real_step()
        gen._step = counted
        _turn(gen, until=lambda: (1, 1) in _sent(gen))
        assert slow.phase == "step" and not slow.future.done()     # the tool still works
        print(f"\nwhile one episode's tool worked: {steps[0]} engine steps, a group of two "
              f"episodes of 4 model turns generated and sent")
        assert sorted(_sent(gen)) == [(1, 0), (1, 1)] and steps[0] >= 8
        release.touch()
        _turn(gen)
        assert sorted(_sent(gen)) == [(0, 0), (1, 0), (1, 1)]
        _check_episode(_sent(gen)[(0, 0)], gen.tokenizer, 4)
    finally:
        gen.envs.close()


def test_a_stale_group_of_episodes_is_stopped_and_sent(engine, model_dir, tmp_path):
    """StaleBefore: a group whose episodes hold a token older than the version is stopped at
    once, its episodes as far as they got (here: waiting on a slow tool, "abort_env", reward 0)
    and sent (the controller drops it); its environments end; a group sampled later by newer
    weights runs on to its end."""
    release = tmp_path / "release"
    gen = _generator(_cfg(tmp_path, turns=3, slow="slow", slow_turn=1, release=str(release)),
                     engine, model_dir)
    v0 = engine.version
    try:
        gen._handle(msgs.Prompts([_prompt(0, "slow", n=2)]))
        held = [gen.episodes[("train", 0, i)] for i in range(2)]
        _turn(gen, until=lambda: all(ep.phase == "step" for ep in held))
        engine.version = v0 + 1         # as after a weight update: later tokens carry it
        gen._handle(msgs.Prompts([_prompt(1, "fast", n=2)]))
        _turn(gen, until=lambda: any(ep.episode is not None and ep.episode.output
                                     for k, ep in gen.episodes.items() if k[1] == 1))
        gen._handle(msgs.StaleBefore(v0))               # nothing is older than v0
        assert gen.stale_aborted == 0 and not _sent(gen)
        gen._handle(msgs.StaleBefore(v0 + 1))
        stale = _sent(gen)
        assert sorted(stale) == [(0, 0), (0, 1)] and gen.stale_aborted == 1
        for t in stale.values():
            assert t["finish_reason"] == "abort_env" and t["reward"] == 0.0
            assert t["turn_is_sample"].tolist() == [1] and (t["versions"] == v0).all()
        assert not any(k[1] == 0 for k in gen.episodes) and ("train", 0) not in gen.groups
        release.touch()
        _turn(gen)
        assert sorted(_sent(gen)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert gen.episodes == {} and gen.groups == {}
        assert gen.tokens_generated == sum(int(t["loss_mask"].sum()) for t in _sent(gen).values())
    finally:
        engine.version = v0
        gen.envs.close()


def test_a_weight_update_inside_an_episode(engine, model_dir, tmp_path):
    """New weights while episodes run: a turn in flight is cut and resumed from its prefix, and
    every later turn's tokens carry the new version; the oldest sampled token is what η counts."""
    from safetensors.torch import load_file, save_file
    g = torch.Generator().manual_seed(7)
    weights = {k: (v + 0.2 * torch.randn(v.shape, generator=g)).contiguous()
               for k, v in load_file(f"{model_dir}/model.safetensors").items()}
    (tmp_path / "w").mkdir()
    save_file(weights, str(tmp_path / "w" / "model.safetensors"))
    release = tmp_path / "release"
    gen = _generator(_cfg(tmp_path, turns=4, slow="abc", slow_turn=2, release=str(release)),
                     engine, model_dir)
    v0 = engine.version
    try:
        gen._handle(msgs.Prompts([_prompt(0, "abc")]))
        held = [gen.episodes[("train", 0, i)] for i in range(2)]
        _turn(gen, until=lambda: all(ep.phase == "step" and ep.episode.n_turns == 2 for ep in held))
        gen._handle(msgs.Prompts([_prompt(1, "def")]))
        running = [gen.episodes[("train", 1, i)] for i in range(2)]

        def mid_turn(ep) -> bool:
            req = engine._requests.get(f"train:1:{running.index(ep)}")
            return ep.phase == "turn" and ep.episode.n_turns >= 1 and req is not None \
                and len(req.tokens) >= 1
        # prompt 0's episodes wait for their tool's answer to turn 2; one of prompt 1's is in
        # the middle of a model turn
        _turn(gen, until=lambda: any(mid_turn(ep) for ep in running))
        cut = next(i for i, ep in enumerate(running) if mid_turn(ep))
        engine.update_weights_from_file(v0 + 1, str(tmp_path / "w"))
        release.touch()
        _turn(gen)
        got = _sent(gen)
        assert len(got) == 4
        new = hf_model(model_dir, str(tmp_path / "w" / "model.safetensors"))
        for key, t in got.items():
            _check_episode(t, gen.tokenizer, 4)
            v = t["versions"][t["loss_mask"] == 1]
            assert (np.diff(v) >= 0).all() and set(v.tolist()) <= {v0, v0 + 1}
            if key[0] == 0 or key == (1, cut):      # begun before the update, ended after it
                assert v[0] == v0 and v[-1] == v0 + 1
            if key == (1, cut):     # the update came in the middle of one of its model turns
                ends, kinds = t["turn_ends"], t["turn_is_sample"]
                starts = np.concatenate([[0], ends[:-1]])
                assert any(k and len(set(t["versions"][a:b].tolist())) == 2
                           for a, b, k in zip(starts, ends, kinds))
            later = (t["versions"] == v0 + 1)
            lp = hf_logprobs(new, type("S", (), {"prompt_tokens": t["prompt_tokens"],
                                                 "output_tokens": t["output_tokens"]}), 1.0)
            assert np.abs(lp[later] - t["behav_logprobs"][later]).max() < ATOL
    finally:
        gen.envs.close()
        engine.version = v0 + 1


def test_a_preemption_mid_episode_resumes_with_nothing_lost(engine, model_dir, tmp_path):
    """STOP (preempted) while one episode waits for its tool and another is in a model turn:
    each goes back as far as it got (PARTIAL, through the real rollout log); a fresh generator
    and fresh environments continue them from there: the finished episodes start with the
    partial ones' tokens, mask and versions, and end as a run without the preemption would."""
    cfg = _cfg(tmp_path, turns=4, slow="slow", slow_turn=2, release=str(tmp_path / "never"))
    gen = _generator(cfg, engine, model_dir)

    def mid_turn(key) -> bool:
        ep, req = gen.episodes.get(key), engine._requests.get(f"train:{key[1]}:{key[2]}")
        return (ep is not None and ep.phase == "turn" and ep.episode.n_turns >= 1
                and req is not None and len(req.tokens) >= 1)

    try:
        gen._handle(msgs.Prompts([_prompt(0, "slow", n=1)]))
        slow = gen.episodes[("train", 0, 0)]
        _turn(gen, until=lambda: slow.phase == "step" and slow.episode.n_turns == 2)
        gen._handle(msgs.Prompts([_prompt(1, "fast", n=2)]))
        _turn(gen, until=lambda: any(mid_turn(("train", 1, i)) for i in range(2)))
        cut = [i for i in range(2) if mid_turn(("train", 1, i))]
        assert gen._handle(msgs.Stop(preempted=True)) is False
    finally:
        gen.envs.close()
    (partial,) = gen.chan.of(msgs.Partial)
    assert sorted(g[0]["prompt_id"] for g in partial.groups) == [0, 1]
    reasons = {(t["prompt_id"], t["sample_idx"]): t["finish_reason"]
               for g in partial.groups for t in g}
    assert reasons[(0, 0)] == "abort_env"               # its tool's answer was in flight
    assert all(reasons[(1, i)] == "abort" for i in cut)     # in the middle of a model turn

    # through the rollout log, as the controller keeps and reads them back
    w = RolloutWriter(tmp_path / "rollouts.h5", "test")
    try:
        w.append([t for g in partial.groups for t in g])
        rows = {(r["prompt_id"], r["sample_idx"]): r for r in (w.read(i) for i in range(3))}
    finally:
        w.close()

    def continued(pid, n):
        return tuple(msgs.Continuation(**{k: rows[(pid, i)][k] for k in (
            "sample_idx", "output_tokens", "behav_logprobs", "versions", "finish_reason",
            "t_submit", "t_first_token", "t_end", "loss_mask", "turn_ends", "turn_is_sample",
            "prompt_tokens")}, tool_calls=tuple(rows[(pid, i)]["tool_calls"])) for i in range(n))

    gen2 = _generator(_cfg(tmp_path, turns=4), engine, model_dir)
    try:
        gen2._handle(msgs.Prompts([_prompt(0, "slow", n=1, continued=continued(0, 1)),
                                   _prompt(1, "fast", n=2, continued=continued(1, 2))]))
        _turn(gen2)
    finally:
        gen2.envs.close()
    done = {(t["prompt_id"], t["sample_idx"]): t for g in gen2.chan.of(msgs.Group)
            for t in g.trajectories}
    assert sorted(done) == [(0, 0), (1, 0), (1, 1)]
    for key, t in done.items():
        a, k = rows[key], len(rows[key]["output_tokens"])
        for f in ("output_tokens", "behav_logprobs", "versions", "loss_mask"):
            assert np.array_equal(t[f][:k], a[f]), (key, f)
        if k:           # (one without a token yet started afresh, from its environment's prompt)
            assert np.array_equal(t["prompt_tokens"], a["prompt_tokens"])
        _check_episode(t, gen2.tokenizer, 4)
    assert sum(len(rows[key]["output_tokens"]) > 0 for key in done) >= 2


def test_turn_stops_end_a_model_turn(engine, model_dir, tmp_path):
    """env.turn_stop's strings (kept in the output) and token ids end a model turn before its
    length: the environment gets the turn with its stop, and the next turn follows it."""
    cfg = _cfg(tmp_path, turns=4)
    strings = [chr(c) for c in range(0x41, 0x5B)]      # A-Z: one token each here
    stop_id = 3 + 0x30 - 0x21                           # "0"
    cfg.env.turn_stop = [*strings, stop_id]
    gen = _generator(cfg, engine, model_dir)
    try:
        gen._handle(msgs.Prompts([_prompt(0, "abc", n=4)]))
        _turn(gen)
    finally:
        gen.envs.close()
    ended = {"string": 0, "id": 0}
    for t in _sent(gen).values():
        for ids in _check_episode(t, gen.tokenizer, 4):
            last = gen.tokenizer.decode([int(ids[-1])])
            inside = [gen.tokenizer.decode([int(i)]) for i in ids[:-1]]
            # no stop before a turn's last token; a turn shorter than its length ends at one
            assert not set(inside) & set(strings) and stop_id not in ids[:-1].tolist()
            if len(ids) < TURN:
                assert last in strings or int(ids[-1]) in (stop_id, 1), (ids, last)
            ended["string"] += last in strings
            ended["id"] += int(ids[-1]) == stop_id
    print(f"\nmodel turns ended by a stop string: {ended['string']}, by a stop id: {ended['id']}")
    assert ended["string"] > 0


def test_a_resumed_turn_that_had_all_its_tokens_ends_without_another(engine, model_dir, tmp_path):
    """A preempted model turn saved with all of its rollout.max_new_tokens (its end was still in
    flight): the resumed episode ends that turn as it is (no token past its length) and asks the
    environment, instead of sampling one more token."""
    gen = _generator(_cfg(tmp_path, turns=2), engine, model_dir)
    prompt = gen.tokenizer("abc", add_special_tokens=False)["input_ids"]
    turn = np.arange(10, 10 + TURN, dtype=np.int32)
    saved = msgs.Continuation(0, turn, np.full(TURN, -1.0, np.float32),
                              np.full(TURN, engine.version, np.int32), "abort", 1.0, 1.5, 2.0,
                              np.ones(TURN, np.uint8), np.asarray([TURN]), np.ones(1, np.uint8),
                              (), np.asarray(prompt, np.int32))
    try:
        gen._handle(msgs.Prompts([_prompt(0, "abc", n=1, continued=(saved,))]))
        _turn(gen)
    finally:
        gen.envs.close()
    t = _sent(gen)[(0, 0)]
    assert t["output_tokens"][:TURN].tolist() == turn.tolist()
    sampled = _check_episode(t, gen.tokenizer, 2)
    assert len(sampled[0]) == TURN


def test_an_observation_past_the_vocabulary_ends_its_episode_not_the_generator(tmp_path):
    """An environment's ids checked against the engine's vocabulary (the larger of the
    tokenizer's and config.json's vocab_size, as vLLM checks a request): one past it ends that
    episode with the reason; no turn goes to the engine, nothing raises on the generator."""
    from areal_hpc.config import load
    from areal_hpc.env.base import Step
    from areal_hpc.env.episode import Episode
    from areal_hpc.rollout.episodes import EpisodeLoop, _Ep
    from tests.env.test_episode import _merging_tokenizer
    (tmp_path / "config.json").write_text('{"vocab_size": 32}')
    loop = EpisodeLoop()
    loop.cfg = load(None, [f"model.path={tmp_path}", "data.train_path=t"])
    loop.tokenizer = _merging_tokenizer()
    assert len(loop.tokenizer) == 30 and loop._vocab_size == 32
    loop._submit_turn = lambda ep: pytest.fail("a turn went to the engine after a refused answer")
    ep = _Ep("train", 0, 0, {}, None, 0.0,
             episode=Episode([1], max_tokens=16, max_turns=3, vocab_size=loop._vocab_size))
    ep.episode.add_sample([2], [0.0], [0])
    loop._after_step(ep, Step(observation=[3, 32], reward=0.5))
    assert ep.episode.done and ep.episode.output == [2]
    assert ep.episode.error == "step: observation: token id 32 is outside the vocabulary [0, 31]"
