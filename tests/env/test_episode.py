"""The episode builder: token in, token out (areal_hpc/env/episode.py)."""
import math

import numpy as np
import pytest
from tokenizers import Tokenizer, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from areal_hpc.env.base import Step, ToolCall
from areal_hpc.env.episode import CUT_TOKENS, CUT_TURNS, NO_VERSION, OBSERVATION, SAMPLE, Episode

CHARS = "0123456789+=,<>/calrestu"  # each once


def _merging_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-pair tokenizer over the tiny task's characters with merges ("1"+"2" -> "12", and the
    tags), so that sampled ids "1","2" decode to text that encodes to the one id of "12": a turn
    tokenised again is not the turn sampled."""
    vocab = {c: i for i, c in enumerate(CHARS)}
    merges = [("1", "2"), ("<", "c"), ("<c", "a"), ("<ca", "l"), ("<cal", "c"), ("<calc", ">")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab, merges)))


def _encode(tok):
    return lambda text: tok.encode(text, add_special_tokens=False)


def test_sampled_ids_are_kept_as_sampled_even_where_retokenising_would_change_them():
    tok = _merging_tokenizer()
    one, two = tok.convert_tokens_to_ids(["1", "2"])
    prompt = tok.encode("3+9=", add_special_tokens=False)
    sampled = [one, two, tok.convert_tokens_to_ids("+"), one]          # "12+1", not canonical
    assert tok.encode(tok.decode(sampled), add_special_tokens=False) != sampled   # the test's power
    ep = Episode(prompt, max_tokens=64, max_turns=3, encode=_encode(tok), template="<{observation}>")
    ep.add_sample(sampled, [-0.5, -0.25, -1.0, -2.0], [3, 3, 4, 4])
    n = ep.add_observation("13", ToolCall("calculator", "12+1", 2, 0.01))
    obs_ids = tok.encode("<13>", add_special_tokens=False)
    ep.add_sample([two], [-0.125], [5])
    assert n == len(obs_ids)
    assert ep.ids == prompt + sampled + obs_ids + [two]
    assert ep.ids != tok.encode(tok.decode(ep.ids), add_special_tokens=False)
    a = ep.arrays()
    assert a["output"].tolist() == sampled + obs_ids + [two]
    assert a["loss_mask"].tolist() == [1] * 4 + [0] * len(obs_ids) + [1]
    assert a["versions"].tolist() == [3, 3, 4, 4] + [NO_VERSION] * len(obs_ids) + [5]
    assert a["behav_logprobs"].tolist() == [-0.5, -0.25, -1.0, -2.0] + [0.0] * len(obs_ids) + [-0.125]
    assert [(t.kind, t.start, t.end) for t in ep.turns] == [
        (SAMPLE, 0, 4), (OBSERVATION, 4, 4 + n), (SAMPLE, 4 + n, 5 + n)]
    assert a["turn_ends"].tolist() == [4, 4 + n, 5 + n] and a["turn_is_sample"].tolist() == [1, 0, 1]
    assert ep.oldest_version == 3 and ep.tool_calls[0].args == "12+1"


def test_observation_tokens_are_masked_and_token_observations_go_between_the_template_parts(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)     # the tiny model's own (built by the fixture:
    # a fresh clone has no models/tiny)
    enc = _encode(tok)
    ep = Episode(enc("2+3="), max_tokens=40, max_turns=4, encode=enc, template="={observation},")
    ep.add_sample(enc("2+3"), [-1.0] * 3, [0] * 3)
    ep.add_observation(enc("5"))                                          # ids, as they are
    ep.add_sample(enc("\\boxed{5}"), [-0.5] * 9, [1] * 9)
    a = ep.arrays()
    obs = a["loss_mask"] == 0
    assert a["output"][obs].tolist() == enc("=") + enc("5") + enc(",")
    assert (a["versions"][obs] == NO_VERSION).all() and (a["behav_logprobs"][obs] == 0.0).all()
    assert (a["versions"][~obs] >= 0).all()
    # a masked sum over the output is finite and ignores the observation
    assert math.isfinite(float((a["behav_logprobs"] * a["loss_mask"]).sum()))
    assert float((a["behav_logprobs"] * a["loss_mask"]).sum()) == pytest.approx(-3.0 - 4.5)
    assert tok.decode(ep.ids) == "2+3=2+3=5,\\boxed{5}"


def test_a_turn_cut_by_a_weight_update_continues_as_one_turn_with_its_versions():
    ep = Episode([5, 6], max_tokens=32, max_turns=2)
    ep.add_sample([7, 8], [-1.0, -1.0], [2, 2])
    ep.add_sample([9], [-0.3], [3], continues=True)                     # after the update
    assert ep.n_turns == 1 and ep.turns == [ep.turns[0]] and ep.turns[0].end == 3
    assert ep.versions == [2, 2, 3] and ep.oldest_version == 2
    with pytest.raises(ValueError, match="without a model turn"):
        ep.add_observation([4])
        ep.add_sample([1], [0.0], [3], continues=True)


def test_bounds_cut_the_episode_at_max_turns_and_max_episode_tokens():
    ep = Episode([1], max_tokens=100, max_turns=2)
    for _ in range(2):
        ep.add_sample([2, 3], [0.0, 0.0], [0, 0])
        ep.apply(Step(observation=[4], reward=0.25))
    assert ep.done and ep.cut == CUT_TURNS and ep.n_turns == 2 and ep.reward == 0.5
    ep = Episode([1, 1], max_tokens=8, max_turns=5)
    ep.add_sample([2, 3], [0.0, 0.0], [0, 0])
    assert ep.add_observation(list(range(10, 20))) == 4                  # cut to the budget
    assert ep.done and ep.cut == CUT_TOKENS and len(ep.ids) == 8 and ep.budget_left == 0
    with pytest.raises(ValueError, match="ended"):
        ep.add_sample([2], [0.0], [0])
    ep = Episode([1], max_tokens=4, max_turns=5)
    with pytest.raises(ValueError, match="4 tokens, 3 left"):
        ep.add_sample([2, 2, 2, 2], [0.0] * 4, [0] * 4)


def test_done_an_error_and_bad_input():
    ep = Episode([1], max_tokens=16, max_turns=3)
    ep.add_sample([2], [-1.0], [0])
    ep.apply(Step(observation="ignored: nothing follows", done=True, reward=1.0,
                  tool=ToolCall("python", "print(1)", 2, 0.1)))
    assert ep.done and ep.cut is None and ep.reward == 1.0 and len(ep.output) == 1
    assert len(ep.tool_calls) == 1
    ep = Episode([1], max_tokens=16, max_turns=3)
    ep.add_sample([2], [-1.0], [0])
    ep.apply(Step(error="timeout after 10 s"))
    assert ep.done and ep.error == "timeout after 10 s" and ep.reward == 0.0
    with pytest.raises(ValueError, match="2 ids, 1 logprobs"):
        Episode([1], max_tokens=16, max_turns=3).add_sample([1, 2], [0.0], [0, 0])
    with pytest.raises(ValueError, match="NaN"):
        Episode([1], max_tokens=16, max_turns=3).add_sample([1], [float("nan")], [0])
    with pytest.raises(ValueError, match="needs the episode's encode"):
        Episode([1], max_tokens=16, max_turns=3).add_observation("text")
    with pytest.raises(ValueError, match="leave none"):
        Episode([1, 2], max_tokens=2, max_turns=1)
    assert np.asarray(Episode([1], max_tokens=2, max_turns=1).arrays()["output"]).size == 0


def test_a_saved_episode_goes_on_token_for_token():
    """A preempted episode: its state through JSON, restored, continued: the same arrays as an
    episode never interrupted."""
    import json

    def build(ep, cut_after):
        ep.add_sample([2, 3], [-0.5, -0.5], [0, 0])
        ep.apply(Step(observation=[9, 9], reward=0.5, tool=ToolCall("t", "a", 2, 0.5)))
        if cut_after:
            ep = Episode.from_state(json.loads(json.dumps(ep.state())))
        ep.add_sample([4], [-0.25], [1])
        ep.apply(Step(done=True, reward=1.0))
        return ep

    whole = build(Episode([1], max_tokens=16, max_turns=3), cut_after=False)
    resumed = build(Episode([1], max_tokens=16, max_turns=3), cut_after=True)
    assert resumed.state() == whole.state()
    assert resumed.sampled_turns() == [[2, 3], [4]] and resumed.reward == 1.5
    for k, v in whole.arrays().items():
        assert np.array_equal(resumed.arrays()[k], v), k


def test_an_id_past_the_vocabulary_is_refused_before_the_engine():
    """The engine's vocabulary bounds every id an environment gives (vLLM would refuse the
    next request, on the generator's loop): the prompt at reset, an observation given as ids."""
    with pytest.raises(ValueError, match=r"prompt: token id 10 is outside the vocabulary \[0, 9\]"):
        Episode([1, 10], max_tokens=16, max_turns=3, vocab_size=10)
    ep = Episode([1], max_tokens=16, max_turns=3, vocab_size=10)
    ep.add_sample([2], [0.0], [0])
    with pytest.raises(ValueError, match="observation: token id 12 is outside"):
        ep.add_observation([5, 12])
    assert ep.output == [2]                 # nothing of the refused observation appended
    saved = Episode.from_state(ep.state(), vocab_size=10)
    with pytest.raises(ValueError, match="observation: token id 10"):
        saved.add_observation([10])
    Episode([1, 2**20], max_tokens=16, max_turns=3).add_observation([2**30])   # unbounded: 2^31


def test_a_huge_text_observation_is_cut_before_it_is_tokenised():
    """An observation of megabytes is tokenised no further than the episode could hold (at
    most MAX_CHARS_PER_TOKEN characters per token left), and the episode ends cut."""
    from areal_hpc.env.episode import MAX_CHARS_PER_TOKEN
    seen = []

    def encode(text):
        seen.append(len(text))
        return [1] * len(text)
    ep = Episode([1], max_tokens=64, max_turns=3, encode=encode, template="[{observation}]")
    ep.add_sample([2], [0.0], [0])
    left = ep.budget_left
    ep.add_observation("x" * (4 << 20))
    assert seen == [left * MAX_CHARS_PER_TOKEN + 2]         # the cut text in the template
    assert ep.done and ep.cut == CUT_TOKENS and ep.budget_left == 0
    # a text that fits is appended whole, as before
    ep = Episode([1], max_tokens=64, max_turns=3, encode=encode, template="[{observation}]")
    ep.add_sample([2], [0.0], [0])
    assert ep.add_observation("xyz") == 5 and not ep.done
