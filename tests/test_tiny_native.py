"""The tiny native tool-calling model's data (areal_hpc/tiny_native.py): what it is pre-trained on
is what the job's generator will see and append, token for token."""
import json

import pytest

from areal_hpc import tiny_native as tn
from areal_hpc.config import RunConfig
from areal_hpc.data.prompts import prompt_ids
from areal_hpc.data.tiny_task import make_problems
from areal_hpc.env.tool_calls import ToolCalling

PROBLEMS = make_problems(300, seed=1)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tn.build_tokenizer(tmp_path_factory.mktemp("native_tok"), PROBLEMS, seed=0)


@pytest.fixture(scope="module")
def calling(tok):
    cfg = RunConfig()
    cfg.env.fn, cfg.env.tool_parser = "calculator", "hermes"
    return ToolCalling(tok, cfg.env)


def _conversation(tok, problem, call):
    ids, labels = tn.example(tok, problem, call)
    text = tok.decode(ids)
    return ids, labels, text


def test_the_prompt_is_the_jobs_and_declares_the_tool(tok):
    cfg = RunConfig()
    cfg.data.chat = True
    p = PROBLEMS[0]
    ids, labels, text = _conversation(tok, p, call=False)
    want = prompt_ids(tok, cfg.data, p["question"], tn.TOOLS)
    assert ids[:len(want)] == want and all(x == -100 for x in labels[:len(want)])
    assert text.startswith("<|im_start|>system\n<tools>\n") and '"name": "calculator"' in text
    # the model's own turn, trained, ends at <|im_end|>: its EOS
    assert ids[-1] == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert text.endswith(p["solution"] + "<|im_end|>") and labels[-1] == tok.eos_token_id


def test_a_call_the_parser_reads_and_the_observation_the_generator_appends(tok, calling):
    p = next(q for q in PROBLEMS if q["question"].count("+") == 2)
    ids, labels, text = _conversation(tok, p, call=True)
    cfg = RunConfig()
    cfg.data.chat = True
    head = prompt_ids(tok, cfg.data, p["question"], tn.TOOLS)
    turn_end = ids.index(tok.eos_token_id, len(head)) + 1
    turn = ids[len(head):turn_end]
    assert labels[len(head):turn_end] == turn                      # trained
    parsed = calling.parse(tok.decode(turn))
    expression = p["question"].rstrip("=")
    assert parsed.calls == [("calculator", json.dumps({"expression": expression}))]
    assert tn.answer_call(tok.decode(turn)) == p["answer"]
    # what follows the call is exactly what the job appends after it (masked), then the answer
    obs = calling.observation([p["answer"]], last_token=turn[-1])
    assert ids[turn_end:turn_end + len(obs)] == obs
    assert labels[turn_end:turn_end + len(obs)] == [-100] * len(obs)
    rest = ids[turn_end + len(obs):]
    assert tok.decode(rest) == f"\\boxed{{{p['answer']}}}<|im_end|>" and labels[-len(rest):] == rest


def test_the_bpe_merges_shorten_the_conversation_and_keep_digits_apart(tok):
    p = PROBLEMS[3]
    ids, _, text = _conversation(tok, p, call=True)
    assert len(ids) * 3 < len(text.encode())
    assert tok.tokenize("123+45") == ["1", "2", "3", "+", "4", "5"]
    # tokenised whole or in the pieces pre-training joins: the same ids
    assert tok(text, add_special_tokens=False)["input_ids"] == ids


@pytest.mark.parametrize("turn, want", [
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>', "5"),
    ('<tool_call>\n{"name": "calc", "arguments": {"expression": "2+3"}}\n</tool_call>',
     "error: unknown tool 'calc'"),
    ('<tool_call>\n{"name": "calculator", "arguments"\n</tool_call>', "error: malformed call"),
    ("2+3=5,\\boxed{5}", None),
])
def test_answer_call(turn, want):
    assert tn.answer_call(turn) == want
