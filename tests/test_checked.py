"""areal_hpc/checked.py: the tokenizer check's pass is remembered for the same inputs, and only
for them: a changed dataset, model file, data setting or length bound checks again, and a
refusal is never remembered."""
import json
import os

import pytest
import transformers

from areal_hpc import checked
from areal_hpc.config import ConfigError, load
from areal_hpc.preflight import check_inputs
from tests.config.conftest import write_model_dir


@pytest.fixture
def inputs(tmp_path, monkeypatch):
    """A model directory, a dataset, the overrides that pass check_inputs with them, and a count
    of the tokenizer loads (the check's slow part) in this process."""
    monkeypatch.setenv(checked.CACHE_ENV, str(tmp_path / "cache"))
    model = write_model_dir(tmp_path / "model")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4)))
    loads = []
    real = transformers.AutoTokenizer.from_pretrained

    def counted(*args, **kwargs):
        loads.append(args[0])
        return real(*args, **kwargs)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counted)
    return model, data, [f"model.path={model}", f"data.train_path={data}", f"output_dir={tmp_path}/runs"], loads


def test_a_pass_is_remembered_and_the_same_inputs_are_not_checked_again(inputs):
    model, data, base, loads = inputs
    check_inputs(load(None, base))
    assert len(loads) == 1 and len(list(checked.folder().iterdir())) == 1
    check_inputs(load(None, [*base, "name=another", "train.total_steps=3"]))   # not read by the check
    assert len(loads) == 1


@pytest.mark.parametrize("change", ["dataset", "model_file", "template", "max_model_len"])
def test_a_change_to_what_the_check_reads_checks_again(inputs, change):
    model, data, base, loads = inputs
    check_inputs(load(None, base))
    extra = []
    if change == "dataset":       # the same size and a new question: its modification time differs
        text = data.read_text().replace("0+1=", "9+1=")
        st = os.stat(data)
        data.write_text(text)
        os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    elif change == "model_file":
        (model / "tokenizer_config.json").write_text((model / "tokenizer_config.json").read_text() + " ")
    elif change == "template":
        extra = ["data.prompt_template='Q: {question} A:'"]
    else:
        extra = ["rollout.max_model_len=200"]
    check_inputs(load(None, [*base, *extra]))
    assert len(loads) == 2


def test_a_refusal_is_not_remembered(inputs, tmp_path):
    model, data, base, loads = inputs
    bad = tmp_path / "long.jsonl"
    bad.write_text(data.read_text() + json.dumps({"question": "1+" * 200, "answer": "1"}) + "\n")
    for _ in range(2):
        with pytest.raises(ConfigError, match=r"data.train_path.*row 4: its prompt is \d+ tokens"):
            check_inputs(load(None, [*base, f"data.train_path={bad}", "rollout.max_model_len=200", "rollout.max_new_tokens=16"]))
    assert len(loads) == 2 and not checked.folder().exists()


def test_an_unwritable_cache_only_means_the_check_runs(inputs, tmp_path, monkeypatch):
    model, data, base, loads = inputs
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(checked.CACHE_ENV, str(blocker / "below_a_file"))
    check_inputs(load(None, base))
    check_inputs(load(None, base))
    assert len(loads) == 2
