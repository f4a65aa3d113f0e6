"""The preflight reads untrusted inputs within bounds (issue: the trust boundary's third round,
item 5): a FIFO, a device or a directory where a file belongs, a 17 KB parquet holding a huge
question, a megabyte first question, a chat template whose loops never end, a run directory moved
by a symlink: each is one ConfigError line naming the key and the file (or row), and none hangs.

The checks that could hang if broken (a FIFO, an endless template) run in a child process under a
generous timeout that only guards the suite; the assertions are on what the child printed."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_hpc import preflight
from areal_hpc.config import ConfigError, load
from areal_hpc.data import files
from areal_hpc.data.prompts import prompt_ids
from areal_hpc.preflight import bounded_rendering, check_inputs
from tests.config.conftest import write_model_dir

ROOT = Path(__file__).resolve().parents[1]
GUARD_S = 600       # only a broken bound comes near it

# Runs check_inputs on each case (a list of overrides) in one child: one JSON line a case.
CHILD = """
import json, sys
from areal_hpc import preflight
from areal_hpc.config import ConfigError, load
args = json.loads(sys.argv[1])
for name, value in args["patch"].items():
    setattr(preflight, name, value)
for overrides in args["cases"]:
    try:
        preflight.check_inputs(load(None, overrides))
        print(json.dumps({"refused": None}), flush=True)
    except ConfigError as exc:
        print(json.dumps({"refused": str(exc)}), flush=True)
"""


def _in_child(cases: list[list[str]], **patch) -> list[str | None]:
    """check_inputs' refusal (or None) for each case, run in a child process."""
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps({"cases": cases, "patch": patch})],
                         cwd=ROOT, capture_output=True, text=True, timeout=GUARD_S,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line)["refused"] for line in out.stdout.splitlines()]


@pytest.fixture
def inputs(tmp_path):
    """A model directory, a dataset and the overrides that pass check_inputs with them."""
    model = write_model_dir(tmp_path / "model")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                            for i in range(4)))
    base = [f"model.path={model}", f"data.train_path={data}", f"output_dir={tmp_path}/runs"]
    return model, data, base


def _one_line(msg: str | None, *parts: str) -> None:
    assert msg is not None and "\n" not in msg, msg
    for part in parts:
        assert part in msg, (part, msg)


def test_a_fifo_device_or_directory_where_a_file_belongs_is_one_line_and_no_hang(inputs, tmp_path):
    model, data, base = inputs
    fifos = {}
    for name in ("train.jsonl", "train.parquet", "train.arrow", "eval.jsonl", "chat.jinja"):
        fifos[name] = tmp_path / name
        os.mkfifo(fifos[name])
    tok_model = write_model_dir(tmp_path / "tok_model")
    (tok_model / "tokenizer.json").unlink()
    os.mkfifo(tok_model / "tokenizer.json")
    cfg_model = write_model_dir(tmp_path / "cfg_model")
    (cfg_model / "config.json").unlink()
    os.mkfifo(cfg_model / "config.json")
    (tmp_path / "adir.jsonl").mkdir()
    cases = [
        ([*base, f"data.train_path={fifos['train.jsonl']}"], "data.train_path", "train.jsonl: a FIFO"),
        ([*base, f"data.train_path={fifos['train.parquet']}"], "data.train_path", "train.parquet: a FIFO"),
        ([*base, f"data.train_path={fifos['train.arrow']}"], "data.train_path", "train.arrow: a FIFO"),
        ([*base, f"data.eval_path={fifos['eval.jsonl']}"], "data.eval_path", "eval.jsonl: a FIFO"),
        ([*base, "data.train_path=/dev/zero"], "data.train_path", "/dev/zero: a character device"),
        ([*base, f"data.train_path={tmp_path}/adir.jsonl"], "data.train_path", "adir.jsonl"),
        ([*base, "data.chat=true", f"data.chat_template={fifos['chat.jinja']}"], "data.chat_template",
         "chat.jinja: a FIFO"),
        ([*base, f"model.path={tok_model}"], "model.path", "tokenizer.json: a FIFO"),
        ([*base, f"model.path={cfg_model}"], "config.json", "a FIFO, not a regular file"),
    ]
    refusals = _in_child([overrides for overrides, _, _ in cases])
    assert len(refusals) == len(cases)
    for (_, key, what), msg in zip(cases, refusals):
        _one_line(msg, key, what)


def _bomb(path: Path, size: int, rows: int = 1) -> Path:
    """A parquet file whose question of `size` zero bytes compresses to almost nothing."""
    offsets = pa.array([0, size], pa.int32()).buffers()[1]
    question = pa.StringArray.from_buffers(1, offsets, pa.py_buffer(bytes(size)))
    table = pa.table({"question": question, "answer": ["1"]})
    if rows > 1:
        table = pa.concat_tables([pa.table({"question": ["1+1"] * (rows - 1), "answer": ["2"] * (rows - 1)}),
                                  table])
    pq.write_table(table, path, compression="zstd", row_group_size=rows)
    return path


def test_a_small_parquet_holding_a_huge_question_is_refused_unread(inputs, tmp_path, monkeypatch):
    """The issue's 17 KB parquet holding a 512 MiB question, scaled down with the cap (1 MiB a row,
    a 32 MiB question): refused from its metadata, naming the file and the row."""
    model, data, base = inputs
    monkeypatch.setattr(files, "MAX_ROW_BYTES", 1 << 20)
    one = _bomb(tmp_path / "one.parquet", 32 << 20)
    assert one.stat().st_size < (64 << 10)
    with pytest.raises(ConfigError) as info:
        check_inputs(load(None, [*base, f"data.train_path={one}"]))
    _one_line(str(info.value), "config key 'data.train_path'", f"{one}[0]: row group 0 decompresses",
              "refused unread")
    many = _bomb(tmp_path / "many.parquet", 32 << 20, rows=50)      # one row among 50 small ones
    with pytest.raises(ConfigError) as info:
        check_inputs(load(None, [*base, f"data.train_path={many}"]))
    _one_line(str(info.value), "config key 'data.train_path'", f"{many}[0:50]", "over 100x its")


def test_a_huge_first_question_is_refused_before_it_is_rendered(inputs, tmp_path, monkeypatch):
    model, data, base = inputs
    rendered = []
    monkeypatch.setattr(preflight, "prompt_ids", lambda *a: rendered.append(a) or prompt_ids(*a))
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps({"question": "1" * (20 << 20), "answer": "1"}) + "\n")
    with pytest.raises(ConfigError) as info:
        check_inputs(load(None, [*base, f"data.train_path={big}"]))
    _one_line(str(info.value), "config key 'data.train_path'", "row 0: the question is 20971520 characters",
              "(not tokenized)")
    assert rendered == []
    check_inputs(load(None, base))      # the same path renders every row of a good dataset
    assert len(rendered) == 1 + 4


ENDLESS = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
           "{% for m in messages %}{{ m.content }}{% endfor %}")
SLOW_ON_LONG = ("{% for m in messages %}{% if m.content | length > 20 %}{% for i in range(100000) %}"
                "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}{{ m.content }}{% endfor %}")


def test_a_chat_template_whose_loops_run_for_minutes_is_refused_within_its_bound(inputs, tmp_path):
    model, data, base = inputs
    endless = tmp_path / "endless.jinja"
    endless.write_text(ENDLESS)
    long_last = tmp_path / "long_last.jsonl"
    long_last.write_text(data.read_text() + json.dumps({"question": "1+" * 20, "answer": "1"}) + "\n")
    chat = [*base, "data.chat=true"]
    refusals = _in_child([[*chat, f"data.chat_template={endless}"],
                          [*chat, f"data.chat_template='{SLOW_ON_LONG}'", f"data.train_path={long_last}"],
                          [*chat, f"data.chat_template='{SLOW_ON_LONG}'"]], TEMPLATE_TIMEOUT_S=2.0)
    _one_line(refusals[0], "config key 'data.chat_template'", "the first prompt: rendering its prompt took over 2 s")
    _one_line(refusals[1], "config key 'data.chat_template'", "data.train_path: row 4: rendering its prompt took "
              "over 2 s")
    assert refusals[2] is None          # the same template on short questions renders at once


def test_the_bound_puts_back_the_callers_alarm_and_is_off_outside_the_main_thread():
    fired = []
    old = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    signal.setitimer(signal.ITIMER_REAL, 500)
    try:
        with bounded_rendering(1.0) as ids:
            assert ids is not prompt_ids
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 400       # the caller's timer runs on
        assert signal.getsignal(signal.SIGALRM) is not None and fired == []
        signal.setitimer(signal.ITIMER_REAL, 0.01)          # and its handler answers
        for _ in range(60000):
            if fired:
                break
            time.sleep(0.01)
        assert fired == [1]
        seen = []
        thread = threading.Thread(target=lambda: seen.append(bounded_rendering(1.0).__enter__()))
        thread.start()
        thread.join()
        assert seen == [prompt_ids]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_a_run_directory_moved_by_a_symlink_is_refused(inputs, tmp_path):
    model, data, base = inputs
    (tmp_path / "runs").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "runs" / "r").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError) as info:
        check_inputs(load(None, [*base, "name=r"]))
    _one_line(str(info.value), "config key 'name'", "resolves to", "elsewhere", "a symlink there")
    check_inputs(load(None, [*base, "name=s"]))


def test_a_template_that_fails_on_a_later_row_names_the_row(inputs, tmp_path):
    model, data, base = inputs
    long_last = tmp_path / "long_last.jsonl"
    long_last.write_text(data.read_text() + json.dumps({"question": "1+" * 20, "answer": "1"}) + "\n")
    template = ("{% for m in messages %}{% if m.content | length > 20 %}{{ raise_exception(\"too long\") }}"
                "{% endif %}{{ m.content }}{% endfor %}")
    with pytest.raises(ConfigError) as info:
        check_inputs(load(None, [*base, "data.chat=true", f"data.chat_template='{template}'",
                                 f"data.train_path={long_last}"]))
    _one_line(str(info.value), "config key 'data.chat_template': data.train_path: row 4: its prompt does "
              "not render: TemplateError: too long")


@pytest.mark.parametrize("override,message", [
    ("env.max_turns=0", "config key 'env.max_turns': must be >= 1, got 0"),
    ('env.turn_stop=[""]', "config key 'env.turn_stop[0]': expected a non-empty string or a token id"),
    ("env.fn=nofile.py:X", "config key 'env.fn': "),
])
def test_the_env_section_is_checked_before_any_rank_starts(override, message):
    """The env section's keys (config ranges, then env/base.py's syntax), its environment imported
    in a child, in one line."""
    with pytest.raises(ConfigError) as err:
        preflight.check_env(load("configs/tiny_cpu.yaml", [override]))
    assert str(err.value).startswith(message) and "\n" not in str(err.value), err.value


def test_no_env_section_is_single_turn():
    preflight.check_env(load("configs/tiny_cpu.yaml"))      # nothing to check, nothing refused


def test_an_environment_that_starts_is_taken_and_its_episodes_must_fit_the_engine():
    preflight.check_env(load("configs/tiny_cpu.yaml", ["env.fn=calculator"]))
    with pytest.raises(ConfigError) as err:
        load("configs/tiny_cpu.yaml", ["env.fn=calculator", "env.max_episode_tokens=100000"])
    assert str(err.value).startswith("config key 'env.max_episode_tokens': 100000 is past "
                                     "rollout.max_model_len"), err.value


def test_a_generator_node_builds_and_resets_the_environment_on_the_first_row(tmp_path):
    """generator_node: the environment built and reset on the first training row (as the
    controller sends it: the whole row) in its own child; a reset that fails is one line naming
    env.fn, before the generator starts (else every group of the run would fail)."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"problem": "6*7?", "solution": "42", "tool": "calc"}) + "\n")
    env = tmp_path / "picky.py"
    env.write_text("class Picky:\n"
                   "    def reset(self, row):\n"
                   "        if row.get('tool') != 'calc' or row['question'] != '6*7?':\n"
                   "            raise KeyError('the row has no tool')\n"
                   "        return row['question']\n"
                   "    def step(self, text, ids):\n"
                   "        return None, True, 0.0\n")
    base = ["model.path=m", f"data.train_path={data}", "data.question_key=problem",
            "data.answer_key=solution", f"env.fn={env}:Picky"]
    preflight.generator_node(load(None, base))
    data.write_text(json.dumps({"problem": "6*7?", "solution": "42"}) + "\n")
    with pytest.raises(ConfigError) as err:
        preflight.generator_node(load(None, base))
    assert str(err.value) == ("config key 'env.fn': its reset on the first training row fails: "
                              "reset: KeyError: 'the row has no tool'"), err.value
