import json

import pytest

from areal_hpc.data.prompts import load_prompts


def test_math_rows(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps({"question": "1+2=", "answer": "so #### 3"}) + "\n")
    assert load_prompts(str(p)) == [{"question": "1+2=", "reward_kind": "math", "reference": "3"}]


def test_code_rows(tmp_path):
    p = tmp_path / "c.jsonl"
    tests = [{"input": "1 2\n", "output": "3\n"}]
    p.write_text(json.dumps({"prompt": "add two ints", "tests": tests}) + "\n")
    rows = load_prompts(str(p), "code", "prompt", "tests")
    assert rows == [{"question": "add two ints", "reward_kind": "code", "reference": tests}]


def test_wrong_format_names_the_line_and_unknown_kind(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps({"question": "1+2=", "answer": "3"}) + "\n")
    with pytest.raises(ValueError, match=r"m\.jsonl:1"):
        load_prompts(str(p), "code", "question", "answer")
    with pytest.raises(ValueError, match="unknown dataset kind"):
        load_prompts(str(p), "poetry")


def test_custom_rewards_keep_the_whole_row_and_need_only_the_question(tmp_path):
    p = tmp_path / "rows.jsonl"
    p.write_text('{"question": "1+2=", "answer": "work\\n#### 3", "level": 2}\n{"question": "x?"}\n')
    rows = load_prompts(str(p), custom=True)
    assert rows == [{"question": "1+2=", "reward_kind": "custom", "reference": "3",
                     "row": {"question": "1+2=", "answer": "work\n#### 3", "level": 2}},
                    {"question": "x?", "reward_kind": "custom", "reference": None, "row": {"question": "x?"}}]
    p.write_text('{"prompt": "x?"}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:1: missing key 'question'"):
        load_prompts(str(p), custom=True)


CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _data(**kw):
    from areal_hpc.config import DataConfig
    d = DataConfig(train_path="unused")
    for k, v in kw.items():
        setattr(d, k, v)
    return d


def test_chat_prompts_are_the_tokenizers_own_rendering(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    from areal_hpc.data.prompts import prompt_ids
    tok = AutoTokenizer.from_pretrained(tiny_model)
    plain = prompt_ids(tok, _data(prompt_template="Q: {question}"), "1+2=")
    assert plain == tok("Q: 1+2=", add_special_tokens=False)["input_ids"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q: 1+2="}]
    own = tok.apply_chat_template(messages, chat_template=CHAT, add_generation_prompt=True, tokenize=True)
    own = own["input_ids"] if hasattr(own, "keys") else own
    template_file = tmp_path / "chat.jinja"
    template_file.write_text(CHAT)
    for template in (CHAT, str(template_file)):      # the template, or its file
        d = _data(prompt_template="Q: {question}", chat=True, system_prompt="Be brief.",
                  chat_template=template)
        assert prompt_ids(tok, d, "1+2=") == list(own)
    d.assistant_prefix = "<think>\n"
    text = tok.apply_chat_template(messages, chat_template=CHAT, add_generation_prompt=True, tokenize=False)
    assert prompt_ids(tok, d, "1+2=") == tok(text + "<think>\n", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("template,key", [
    (None, "data.chat"),                                                  # no template anywhere
    ("{% for m in messages %}{{ m.content }", "data.chat_template"),     # not valid Jinja
])
def test_a_chat_prompt_that_cannot_render_stops_the_job_at_start_up(tiny_model, template, key):
    from pathlib import Path

    from areal_hpc.config import ConfigError, load
    from areal_hpc.preflight import check_inputs
    root = Path(__file__).resolve().parents[2]
    cfg = load(root / "configs/tiny_cpu.yaml", [f"model.path={tiny_model}", "data.chat=true",
                                                f"data.train_path={tiny_model}/train.jsonl", "data.eval_path=null"])
    cfg.data.chat_template = template
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        check_inputs(cfg)


def test_a_chat_template_file_must_be_a_regular_file_within_its_cap(tmp_path):
    import os

    from areal_hpc.data.prompts import MAX_TEMPLATE_BYTES, read_chat_template
    os.mkfifo(tmp_path / "fifo.jinja")
    (tmp_path / "big.jinja").write_text("{{ x }}" * (MAX_TEMPLATE_BYTES // 7 + 1))
    (tmp_path / "bad.jinja").write_bytes(b"{{ \xff }}")
    (tmp_path / "ok.jinja").write_text("{{ messages[0].content }}")
    for name, match in (("fifo.jinja", r"fifo\.jinja: a FIFO, not a regular file"),
                        ("big.jinja", rf"big\.jinja: \d+ bytes, over the {MAX_TEMPLATE_BYTES}"),
                        ("bad.jinja", r"bad\.jinja: not UTF-8 text"),
                        ("nope.jinja", r"nope\.jinja' is neither a Jinja template \(no '\{'\) nor a file")):
        with pytest.raises(ValueError, match=match):
            read_chat_template(str(tmp_path / name))
    assert read_chat_template(str(tmp_path / "ok.jinja")) == "{{ messages[0].content }}"
    assert read_chat_template("{{ inline }}") == "{{ inline }}"
