"""Native tool calling on a generator (rollout/episodes.py, env/tool_calls.py) with the real vLLM
engine (CPU), vLLM's hermes parser and the built-in calculator in its own process: a random
Qwen2 whose byte-level tokenizer carries a chat template in Qwen2.5's format
(random_models.QWEN_TOOLS_TEMPLATE). A random model does not call tools by itself, so the calls
come from a model turn saved by a "preempted job" (a Continuation, as the rollout log gives it
back) and taken as sampled; the results, the next turn and the end are the real pipeline's.

One engine for the module (its model is not the other rollout tests': it needs the tool tokens).
"""
import numpy as np
import pytest
from transformers import AutoTokenizer

from areal_hpc.config import RunConfig
from areal_hpc.data.prompts import prompt_ids
from areal_hpc.env.runner import EnvRunner
from areal_hpc.env.tool_calls import ToolCalling
from areal_hpc.random_models import qwen_byte_tokenizer, save_random_qwen2
from areal_hpc.rollout.generator import Generator
from areal_hpc.transport import messages as msgs
from tests.rollout.test_episodes import _Chan, _NoScores, _sent, _turn, module_engine

TURN = 8
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen_tools")
    qwen_byte_tokenizer(path, eos=256, max_len=1024, tools=True)
    save_random_qwen2(path, vocab_size=320, num_attention_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, eos_token_id=256, bos_token_id=256, pad_token_id=256)
    return str(path)


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    yield from module_engine(model, tmp_path_factory, 1024, 8)


def _generator(model, engine) -> Generator:
    cfg = RunConfig()
    cfg.model.path, cfg.data.chat = model, True
    cfg.rollout.max_new_tokens, cfg.rollout.per_request_seeds = TURN, True
    cfg.env.fn, cfg.env.tool_parser = "calculator", "hermes"
    cfg.env.max_turns, cfg.env.max_episode_tokens = 3, 1000
    tok = AutoTokenizer.from_pretrained(model)
    return Generator(cfg, type("Topo", (), {"rank": 1})(), engine=engine, rewards=_NoScores(),
                     chan=_Chan(), tokenizer=tok, envs=EnvRunner(cfg.env, 4),
                     tool_calling=ToolCalling(tok, cfg.env))


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_the_first_prompt_declares_the_tools_and_a_turn_without_a_call_is_the_answer(model, engine):
    gen = _generator(model, engine)
    try:
        gen._handle(msgs.Prompts([msgs.Prompt(0, [5, 6], 2, "custom", None,
                                              row={"question": "What is 6*7?", "answer": "42"})]))
        _turn(gen)
    finally:
        gen.envs.close()
    got = _sent(gen)
    want = prompt_ids(gen.tokenizer, gen.cfg.data, "What is 6*7?", gen.tool_calling.tools)
    for t in got.values():
        assert t["prompt_tokens"].tolist() == want
        assert "<tools>" in gen.tokenizer.decode(t["prompt_tokens"])
        assert t["finish_reason"] == "stop" and t["loss_mask"].all() and not t["tool_calls"]


def test_a_turns_calls_are_made_and_their_results_appended_as_tool_messages(model, engine):
    """A saved model turn with two calls (one whose expression fails), ended at <|im_end|>: both
    are made by the calculator's `call` in its process, the results appended as the template's
    tool messages (no second <|im_end|>), the model's next turn follows, the episode ends at its
    answer; the ids trained are the ids sampled, each call has its record."""
    gen = _generator(model, engine)
    tok = gen.tokenizer
    prompt = _ids(tok, "<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    turn = np.asarray(_ids(tok, CALL % "6*7" + "\n" + CALL % "1/0") + [im_end], np.int32)
    n = len(turn)
    saved = msgs.Continuation(0, turn, np.full(n, -1.0, np.float32), np.zeros(n, np.int32), "abort",
                              1.0, 1.5, 2.0, np.ones(n, np.uint8), np.asarray([n]),
                              np.ones(1, np.uint8), (), np.asarray(prompt, np.int32))
    try:
        gen._handle(msgs.Prompts([msgs.Prompt(0, [5, 6], 1, "custom", None, continued=(saved,),
                                              row={"question": "What is 6*7?", "answer": "42"})]))
        _turn(gen)
    finally:
        gen.envs.close()
    t = _sent(gen)[(0, 0)]
    out, mask = t["output_tokens"].tolist(), t["loss_mask"].tolist()
    ends, kinds = t["turn_ends"].tolist(), t["turn_is_sample"].tolist()
    assert kinds[:3] == [1, 0, 1] and ends[0] == n and out[:n] == turn.tolist()
    results = out[ends[0]:ends[1]]
    assert results == gen.tool_calling.observation(["42", "error: ValueError: division by zero"],
                                                   last_token=im_end)
    assert tok.decode(results).startswith("\n<|im_start|>user\n<tool_response>\n42\n</tool_response>")
    assert mask[ends[0]:ends[1]] == [0] * len(results)
    assert all(m == 1 for m, v in zip(mask, t["versions"]) if v >= 0)
    calls = [(c.name, c.args, c.error) for c in t["tool_calls"]][:2]
    assert calls == [("calculator", '{"expression": "6*7"}', None),
                     ("calculator", '{"expression": "1/0"}', "error: ValueError: division by zero")]
    assert t["finish_reason"] in ("stop", "max_turns", "max_episode_tokens") and not t["discard"]
