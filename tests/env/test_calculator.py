"""The built-in calculator environment (areal_hpc/env/calculator.py)."""
import pytest

from areal_hpc.env.base import from_mapping
from areal_hpc.env.calculator import Calculator, evaluate, last_call, show
from areal_hpc.env.episode import Episode
from areal_hpc.env.runner import EnvProcess


@pytest.mark.parametrize("expr, value", [("12*(3+4)", 84), ("7/2", 3.5), ("-2**3", -8), ("2**-1", 0.5),
                                         ("17 // 5 + 17 % 5", 5), (" 1e3 + 1 ", 1001.0)])
def test_arithmetic(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr, why", [
    ("__import__('os').system('true')", "Call is not allowed"), ("x + 1", "Name is not allowed"),
    ("(1).real", "Attribute is not allowed"), ("9**9**9", "exponent beyond"),
    ("(10**20)**2", r"beyond ±1e\+30"), ("1/0", "division by zero"), ("1 +", "not an arithmetic"),
    ("(-8)**0.5", "complex"), ("True + 1", "Constant is not allowed"), ("1+" * 200 + "1", "over"),
    ("'a' * 3", "Constant is not allowed")])
def test_anything_else_is_refused_with_the_reason(expr, why):
    with pytest.raises(ValueError, match=why):
        evaluate(expr)


def test_an_episode_of_the_calculator():
    env = Calculator(prompt_template="Q: {question}")
    assert env.reset({"question": "12*7=", "answer": "84"}) == "Q: 12*7="
    assert last_call("a <calc>1</calc> b <calc>12*7</calc>", "<calc>", "</calc>") == "12*7"
    step = env.step("I need <calc>12*7</calc>", [1, 2])
    assert step.observation == "84" and not step.done and step.reward is None
    assert (step.tool.name, step.tool.args, step.tool.output_bytes, step.tool.error) == (
        "calculator", "12*7", 2, None)
    bad = env.step("<calc>12*x</calc>", [1])
    assert bad.observation == "error: Name is not allowed (numbers and + - * / // % ** only)"
    assert bad.tool.error.startswith("Name is not allowed")
    assert env.step("so \\boxed{84}", [3]).reward == 1.0
    assert env.step("so \\boxed{85}", [3]) == type(step)(done=True, reward=0.0)
    assert show(2.0) == "2" and show(0.25) == "0.25"


def test_the_calculator_runs_over_the_runner_and_builds_an_episode():
    """The built-in by its name, in its own process, driving an Episode with a char tokenizer."""
    cfg = from_mapping({"fn": "calculator", "args": {"open_tag": "[", "close_tag": "]"},
                        "observation_template": "={observation},"})
    vocab = "0123456789+=,{}[]\\boxed"
    enc = lambda text: [vocab.index(c) for c in text]     # noqa: E731 (a one-character tokenizer)
    proc = EnvProcess(cfg)
    try:
        first = proc.reset({"question": "12+7=", "answer": "19"})
        ep = Episode(enc(first.observation), max_tokens=64, max_turns=cfg.max_turns, encode=enc,
                     template=cfg.observation_template)
        for text in ("[12+7]", "\\boxed{19}"):
            ep.add_sample(enc(text), [-1.0] * len(text), [0] * len(text))
            ep.apply(proc.step(text, enc(text)))
    finally:
        proc.close()
    assert ep.done and ep.reward == 1.0 and ep.error is None and ep.n_turns == 2
    assert "".join(vocab[i] for i in ep.ids) == "12+7=[12+7]=19,\\boxed{19}"
    assert [t.args for t in ep.tool_calls] == ["12+7"]
