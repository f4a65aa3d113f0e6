"""Native tool calling (env/tool_calls.py) with vLLM's own parsers and a tokenizer whose chat
template has Qwen2.5's format (random_models.QWEN_TOOLS_TEMPLATE: tools in the system turn,
<tool_call> in the assistant's, <tool_response> in a user turn): the rendered first prompt, parsed
calls (one, two, malformed, unknown, inside a reasoning block), and the tool results appended
token in, token out: the episode's ids equal the chat template's rendering of the same
conversation, whether the turn ended at EOS or at a stop string."""
import json

import pytest
from transformers import AutoTokenizer

from areal_hpc.config import DataConfig
from areal_hpc.data.prompts import prompt_ids
from areal_hpc.env.base import EnvConfigError, from_mapping
from areal_hpc.env.episode import Episode
from areal_hpc.random_models import qwen_byte_tokenizer

pytestmark = pytest.mark.slow       # imports vLLM's parsers (seconds)

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen_tools")
    qwen_byte_tokenizer(path, eos=256, max_len=4096, tools=True)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def calling(tok):
    from areal_hpc.env.tool_calls import ToolCalling
    return ToolCalling(tok, from_mapping({"fn": "calculator", "tool_parser": "hermes"}))


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_the_first_prompt_declares_the_tools(tok, calling):
    ids = prompt_ids(tok, DataConfig(train_path="x", chat=True), "What is 6*7?", calling.tools)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n") and "<tools>\n" in text
    assert json.dumps(calling.tools[0]) in text
    assert text.endswith("<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n")


def test_calls_are_parsed_in_order_and_bad_ones_answered(calling):
    two = calling.parse("Two steps.\n" + CALL % "6*7" + "\n" + CALL % "1+1")
    assert two.calls == [("calculator", '{"expression": "6*7"}'),
                         ("calculator", '{"expression": "1+1"}')] and not two.failed
    answer = calling.parse("So it is \\boxed{42}")
    assert answer.is_answer
    bad = calling.parse('<tool_call>\n{"name": "calculator", "arguments": {"expression": </tool_call>')
    assert not bad.calls and "malformed tool call" in bad.failed[0].error
    mixed = calling.parse(CALL % "2" + '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
                          + '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>')
    assert [type(c).__name__ for c in mixed.order] == ["tuple", "ToolCall", "ToolCall"]
    assert "unknown tool 'search'" in mixed.order[1].error
    assert mixed.order[2].error == "arguments are not a JSON object"


def test_a_call_inside_the_reasoning_is_not_a_call(tok):
    from areal_hpc.env.tool_calls import ToolCalling
    cfg = from_mapping({"fn": "calculator", "tool_parser": "hermes", "reasoning_parser": "deepseek_r1"})
    calling = ToolCalling(tok, cfg)
    assert calling.parse("<think>maybe " + CALL % "1" + "</think>It is 1.").is_answer
    assert calling.parse("<think>so</think>" + CALL % "1").calls == [("calculator", '{"expression": "1"}')]
    with pytest.raises(EnvConfigError, match="env.tool_parser"):
        ToolCalling(tok, from_mapping({"fn": "calculator", "tool_parser": "no_such_parser"}))


@pytest.mark.parametrize("ended", ["eos", "stop"])
def test_results_join_the_turn_as_the_chat_template_renders_them(tok, calling, ended):
    """The episode's ids (prompt, the sampled turn, the rendered results, the next turn) are the
    chat template's rendering of that conversation, token for token; the ids trained are the
    ids sampled, the results masked."""
    data = DataConfig(train_path="x", chat=True)
    prompt = prompt_ids(tok, data, "What is 6*7 and 1+1?", calling.tools)
    content = CALL % "6*7" + "\n" + CALL % "1+1"
    turn = _ids(tok, content) + ([tok.convert_tokens_to_ids("<|im_end|>")] if ended == "eos" else [])
    ep = Episode(prompt, max_tokens=4096, max_turns=4, encode=lambda t: _ids(tok, t))
    ep.add_sample(turn, [-0.5] * len(turn), [3] * len(turn))
    parsed = calling.parse(tok.decode(turn, skip_special_tokens=False))
    assert len(parsed.calls) == 2
    ep.add_observation(calling.observation(["42", "2"], last_token=turn[-1]))
    final = _ids(tok, "\\boxed{42}") + [tok.convert_tokens_to_ids("<|im_end|>")]
    ep.add_sample(final, [-0.1] * len(final), [4] * len(final))
    want = tok.apply_chat_template(
        [{"role": "user", "content": "What is 6*7 and 1+1?"}, {"role": "assistant", "content": content},
         {"role": "tool", "content": "42"}, {"role": "tool", "content": "2"}],
        tools=calling.tools, add_generation_prompt=True, tokenize=False) + "\\boxed{42}<|im_end|>"
    assert tok.decode(ep.ids) == want
    assert ep.ids == _ids(tok, want)
    trained = [t for t, m in zip(ep.output, ep.loss_mask) if m]
    assert trained == turn + final
    assert tok.decode([t for t, m in zip(ep.output, ep.loss_mask) if not m]).count("<tool_response>") == 2


def test_the_parser_and_the_template_are_checked_before_any_rank_starts(tmp_path):
    """preflight: a parser vLLM does not have, or a chat template that does not render an
    assistant turn's text as it is (the results could not follow it), is one line naming the key."""
    from areal_hpc import preflight
    from areal_hpc.config import ConfigError, load
    from tests.config.conftest import TINY_HF, write_model_dir
    model = write_model_dir(tmp_path / "model", {**TINY_HF, "vocab_size": 320})
    qwen_byte_tokenizer(model, eos=256, max_len=512, tools=True)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    base = [f"model.path={model}", f"data.train_path={data}", f"output_dir={tmp_path}/runs",
            "data.chat=true", "env.fn=calculator", "env.tool_parser=hermes"]
    preflight.check_inputs(load(None, base))
    for extra, key in ((["env.tool_parser=nope"], "config key 'env.tool_parser': 'nope' is not one of "
                        "vLLM's tool parsers"),
                       (["data.chat_template='{% for m in messages %}{{ m.role }}{% endfor %}'"],
                        "config key 'data.chat_template': native tool calling: ValueError: the chat "
                        "template does not render an assistant message's content as it is")):
        with pytest.raises(ConfigError) as err:
            preflight.check_inputs(load(None, [*base, *extra]))
        assert str(err.value).startswith(key) and "\n" not in str(err.value), err.value


def test_the_examples_tool_environment_answers_its_calls():
    """examples/native_tools: its config's tools pass the checks, and its environment answers a
    call in its own process (a bad unit: the error, answered to the model), and scores an answer."""
    from areal_hpc.config import load
    from areal_hpc.env.base import validate
    from areal_hpc.env.runner import EnvProcess
    cfg = load("examples/native_tools/config.yaml")
    validate(cfg.env)
    assert [t["function"]["name"] for t in cfg.env.tools] == ["convert", "multiply"]
    proc = EnvProcess(cfg.env)
    try:
        assert proc.reset({"question": "How many metres are 3 miles?", "answer": "4828.03"}).error is None
        ok = proc.call("convert", '{"value": 3, "from": "mile", "to": "m"}')
        assert ok.observation == "4828.03" and ok.tool.name == "convert" and ok.tool.error is None
        bad = proc.call("convert", '{"value": 3, "from": "league", "to": "m"}')
        assert bad.observation.startswith("error: ValueError: unknown unit") and not bad.done
        assert proc.step("So it is 4828.03 m.", [1]).reward == 1.0
    finally:
        proc.close()
