"""User environments run in a contained child process (areal_hpc/env/runner.py): a hang, an
output flood, a daemon, garbage on the answer pipe cost the episode, never the caller."""
import json
import os
import time
from pathlib import Path

import pytest

from areal_hpc.env.base import EnvConfig, EnvConfigError, from_mapping, turn_stops
from areal_hpc.env.runner import EnvProcess, EnvRunner, check, replay
from tests.reward.test_custom import DAEMON, _gone


ENVS = '''
import os, sys, time
from areal_hpc.env.base import Environment, Step, ToolCall

class Echo(Environment):
    def __init__(self, prefix=">"):
        self.prefix = prefix
    def reset(self, row):
        self.turns = 0
        return row["question"]
    def step(self, text, ids):
        self.turns += 1
        if self.turns == 2:
            return Step(done=True, reward=1.0)
        return Step(self.prefix + text, False, None, ToolCall("echo", text, len(text), 0.0, None))

class Counts(Environment):
    def reset(self, row):
        self.seen = []
        return "go"
    def step(self, text, ids):
        self.seen.append(text)
        return Step(",".join(self.seen), len(self.seen) == 3, 1.0 if len(self.seen) == 3 else None)

class Ids(Environment):
    def reset(self, row):
        return [1, 2, 3]
    def step(self, text, ids):
        return ids[::-1], False, 0.5

class Hangs(Echo):
    def step(self, text, ids):
        time.sleep(600)

class Floods(Echo):
    def step(self, text, ids):
        sys.stdout.write("x" * (4 << 20)); sys.stdout.flush()
        os.write(2, b"y" * (4 << 20))
        return Step("ok")

class Raises(Echo):
    def step(self, text, ids):
        raise RuntimeError("a bug of the environment")

class Garbage(Echo):
    def step(self, text, ids):
        os.write(int(sys.argv[2]), b'{"id": 2, "observation": {"a": 1}, "done": false}\\n')
        time.sleep(600)

class Waits(Echo):
    def step(self, text, ids):
        while not os.path.exists(text):     # the test's go-ahead
            time.sleep(0.01)
        return Step("waited")

class Closes(Echo):
    """Writes its episode's question to the file `row["log"]` when closed; raises in step when
    asked to (the episode's error)."""
    def reset(self, row):
        self.row = row
        return super().reset(row)
    def step(self, text, ids):
        if text == "raise":
            raise RuntimeError("the tool broke")
        if text.startswith("wait:"):        # a tool that is still working (and says so)
            open(text[5:] + ".started", "w").close()
            while not os.path.exists(text[5:]):
                time.sleep(0.01)
        return super().step(text, ids)
    def close(self):
        with open(self.row["log"], "a") as f:
            f.write(self.row["question"] + "\\n")

class Discards(Echo):
    def step(self, text, ids):
        if text == "quietly":
            return Step(discard=True)
        return Step("ignored", discard="the tool server is down",
                    tool=ToolCall("search", text, 0, 30.0, "HTTP 503"))

class Tools(Echo):
    """Native tool calling: `call` answers the tools; "boom" raises (the model reads it), "down"
    discards the episode, "slow" hangs past the bound."""
    def call(self, name, arguments):
        x = arguments.get("x")
        if x == "boom":
            raise ValueError("x must be a number")
        if x == "down":
            return Step(discard="the search backend is down")
        if x == "slow":
            time.sleep(600)
        return f"{name}({x})"

class Escapes(Echo):
    """As root: unmount its own /proc (the host's is beneath), then write into the memory of the
    process the turn names (its host pid and an address)."""
    def step(self, text, ids):
        import ctypes, json
        target = json.loads(text)
        libc = ctypes.CDLL(None, use_errno=True)
        out = [f"umount {libc.umount2(b'/proc', 2)}"]
        try:
            with open(f"/proc/{target['pid']}/mem", "r+b", buffering=0) as f:
                f.seek(target["addr"])
                f.write(b"X" * target["n"])
            out.append("wrote")
        except OSError as e:
            out.append(f"denied {e.strerror}")
        return Step(" ".join(out))

class Leaks(Echo):
    def step(self, text, ids):
        _daemon(text)
        return Step("leaked")
'''


@pytest.fixture
def envs(tmp_path) -> Path:
    path = tmp_path / "envs.py"
    path.write_text(ENVS + DAEMON)
    return path


def _cfg(envs: Path, name: str, **kw) -> EnvConfig:
    return from_mapping({"fn": f"{envs}:{name}", **kw})


def test_a_user_environment_serves_episodes_with_its_args(envs):
    proc = EnvProcess(_cfg(envs, "Echo", args={"prefix": "obs:"}))
    try:
        for _ in range(2):                       # the same child, a fresh instance each
            first = proc.reset({"question": "1+2="})
            assert first.observation == "1+2=" and first.error is None
            step = proc.step("<calc>1+2</calc>", [5, 6])
            assert step.observation == "obs:<calc>1+2</calc>" and not step.done
            assert step.tool.name == "echo" and step.tool.output_bytes == 16
            assert proc.step("3", [5]) == type(step)(done=True, reward=1.0)
        ids = EnvProcess(_cfg(envs, "Ids"))
        assert ids.reset({}).observation == [1, 2, 3]
        assert ids.step("", [4, 5]).observation == [5, 4] and ids._calls == 2
        ids.close()
    finally:
        proc.close()


def test_close_is_called_at_every_episodes_end_its_error_too(envs, tmp_path):
    """`finish` calls the environment's close() as the episode ends (not only when the next one
    starts), after an error too, and kills what the episode started; the child serves the next
    episode."""
    log = tmp_path / "closed"
    with EnvRunner(_cfg(envs, "Closes"), max_episodes=2) as runner:
        assert runner.reset("a", {"question": "q1", "log": str(log)}).result().error is None
        assert runner.step("a", "t", [1]).result().error is None
        assert runner.step("a", "t", [1]).result().done
        assert runner.finish("a").result().error is None
        assert log.read_text() == "q1\n"                # closed at its end, before any reset
        assert runner.reset("b", {"question": "q2", "log": str(log)}).result().error is None
        failed = runner.step("b", "raise", [1]).result()
        assert failed.done and "the tool broke" in failed.error
        assert runner.finish("b").result().error is None
        assert log.read_text() == "q1\nq2\n"
        assert runner.reset("c", {"question": "q3", "log": str(log)}).result().error is None
        runner.finish("c").result()
    assert log.read_text() == "q1\nq2\nq3\n"


def test_a_hanging_step_is_the_episodes_error_and_the_next_episode_starts_fresh(envs):
    proc = EnvProcess(_cfg(envs, "Hangs", call_timeout_s=1.0))
    try:
        proc.reset({"question": "q"})
        step = proc.step("t", [1])
        assert step.done and step.error == "step: timeout after 1 s" and proc.proc is None
        assert step.cause == "timeout"
        assert proc.reset({"question": "again"}).observation == "again"
    finally:
        proc.close()


def test_an_output_flood_is_capped_and_the_call_answers(envs, capfd):
    proc = EnvProcess(_cfg(envs, "Floods", output_bytes=1 << 16, call_timeout_s=60))
    try:
        proc.reset({"question": "q"})
        assert proc.step("t", [1]).observation == "ok"
    finally:
        proc.close()
    err = capfd.readouterr().err
    assert "output past 65536 bytes dropped]" in err and len(err) < (1 << 16) + 10_000


def test_what_an_episode_starts_dies_with_it(envs, tmp_path):
    """A daemon an episode leaves is killed at the episode's end (`finish`), and one left by an
    episode still running when the runner closes dies with the child's namespace."""
    with EnvRunner(_cfg(envs, "Leaks"), max_episodes=1) as runner:
        for i in range(2):
            pidfile = tmp_path / f"daemon{i}.pid"
            assert runner.reset("e", {"question": "q"}).result().error is None
            assert runner.step("e", str(pidfile), [1]).result().observation == "leaked"
            deadline = time.monotonic() + 60
            while not pidfile.exists():     # the daemon is up
                assert time.monotonic() < deadline, "the daemon never started"
                time.sleep(0.02)
            if i == 0:      # the episode's end kills what it started
                assert runner.finish("e").result().error is None
                assert _gone(pidfile)
    assert _gone(pidfile)   # close kills the child's namespace whole


def test_a_raising_environment_and_garbage_on_the_answer_pipe_are_errors(envs):
    proc = EnvProcess(_cfg(envs, "Raises"))
    try:
        proc.reset({"question": "q"})
        step = proc.step("t", [1])
        assert step.error == "step: RuntimeError: a bug of the environment" and step.done
        assert step.cause == "raised"
        assert proc.proc is not None         # the child goes on
    finally:
        proc.close()
    proc = EnvProcess(_cfg(envs, "Garbage", call_timeout_s=60))
    try:
        proc.reset({"question": "q"})
        step = proc.step("t", [1])
        assert step.error == "step: answer refused: observation is a dict" and proc.proc is None
        assert step.cause == "refused"
    finally:
        proc.close()


def test_a_slow_tool_holds_its_own_episode_only(envs, tmp_path):
    go = tmp_path / "go"
    with EnvRunner(_cfg(envs, "Waits", call_timeout_s=120), max_episodes=2) as runner:
        for key in ("slow", "fast"):
            runner.reset(key, {"question": "q"}).result()
        slow = runner.step("slow", str(go), [1])
        fast = runner.step("fast", str(tmp_path), [1])     # exists: answers at once
        assert fast.result(timeout=60).observation == "waited"
        assert not slow.done()                              # still waiting for its go-ahead
        go.touch()
        assert slow.result(timeout=60).observation == "waited"
        stuck = runner.step("slow", str(tmp_path / "never"), [1])
    assert stuck.result().error.startswith("step: the environment's process died")  # closed


def test_config_errors_name_the_key(envs, tmp_path):
    for section, key in (({"max_turns": 0}, "env.max_turns"), ({"max_turns": 2.5}, "env.max_turns"),
                         ({"call_timeout_s": float("nan")}, "env.call_timeout_s"),
                         ({"turn_stop": ["```", ""]}, r"env.turn_stop\[1\]"),
                         ({"turn_stop": "</calc>"}, "env.turn_stop"),
                         ({"observation_template": "<{obs}>"}, "env.observation_template"),
                         ({"observation_template": "{observation"}, "env.observation_template"),
                         ({"fn": "no_colon"}, "env.fn"), ({"args": [1]}, "env.args"),
                         ({"max_turn": 3}, "env.max_turn")):
        with pytest.raises(EnvConfigError, match=f"^config key '{key}': "):
            from_mapping(section)
    assert from_mapping({"turn_stop": ["</calc>", 7], "observation_template": "{{{observation}}}"})
    from omegaconf import OmegaConf                     # an env section as the job's loader has it
    cfg = from_mapping(OmegaConf.create({"env": {"fn": "calculator", "turn_stop": ["</calc>", 7]}}).env)
    assert cfg.fn == "calculator" and turn_stops(cfg) == (["</calc>"], [7])
    for fn, why in ((f"{tmp_path}/none.py:E", "no such file"), (f"{envs}:Nope", "'Nope' is missing"),
                    (f"{envs}:_daemon", "is a function, not a class"),
                    (f"{envs}:Environment", "has no reset or step method")):
        with pytest.raises(EnvConfigError, match=f"^config key 'env.fn': .*{why}"):
            check(from_mapping({"fn": fn}))
    bad = tmp_path / "bad.py"
    bad.write_text("raise SystemExit('no')\n")
    with pytest.raises(EnvConfigError, match="cannot import .*SystemExit: no"):
        check(from_mapping({"fn": f"{bad}:E"}))
    check(from_mapping({"fn": f"{envs}:Echo"}))


def test_an_environment_that_blocks_at_import_is_bounded(tmp_path):
    mod = tmp_path / "blocks.py"
    mod.write_text("import time\ntime.sleep(600)\n")
    with pytest.raises(EnvConfigError, match="config key 'env.fn': the environment did not start: "
                       "timeout after"):
        check(from_mapping({"fn": f"{mod}:E", "start_timeout_s": 2}))


def test_a_child_that_dies_names_its_last_words(envs, tmp_path):
    mod = tmp_path / "dies.py"
    mod.write_text(ENVS + "class Dies(Echo):\n    def step(self, text, ids):\n"
                   "        print('segfault, as it were', flush=True)\n        os._exit(3)\n")
    proc = EnvProcess(from_mapping({"fn": f"{mod}:Dies"}))
    try:
        proc.reset({"question": "q"})
        step = proc.step("t", [1])
        assert step.error == ("step: the environment's process died (exit code 3): segfault, "
                              "as it were") and proc.proc is None and step.cause == "died"
        assert proc.step("t", [1]).cause == "died"
    finally:
        proc.close()


def test_a_resumed_episode_brings_a_fresh_environment_to_where_it_was(envs):
    """The process of a preempted episode is gone; replay steps a new one through the saved
    turns, and the turn after them is answered as if nothing had happened."""
    proc = EnvProcess(_cfg(envs, "Counts"))
    try:
        proc.reset({})
        before = [proc.step(t, [1]).observation for t in ("a", "b")]
        proc.close()                                    # the preemption
        assert replay(proc, {}, [("a", [1]), ("b", [1])]) is None
        assert proc.step("b", [1]).observation == "a,b"    # the last saved turn, stepped again
        last = proc.step("c", [1])
        assert (last.observation, last.done, last.reward) == ("a,b,c", True, 1.0)
    finally:
        proc.close()
    assert before == ["a", "a,b"]


def test_the_example_of_docs_environments_runs(tmp_path):
    """docs/environments.md's one-file environment, as written there, through the runner."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "environments.md").read_text()
    code = doc.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "my_env.py").write_text(code)
    proc = EnvProcess(from_mapping({"fn": f"{tmp_path}/my_env.py:Lookup", "args": {"table_size": 5}}))
    try:
        assert proc.reset({"question": "4 squared?", "answer": "16"}).observation == "4 squared?"
        step = proc.step("<sq>4</sq>", [1])
        assert step.observation == "16" and step.tool.args == "4"
        assert proc.step("<sq>9</sq>", [1]).observation == "unknown"
        assert (proc.step("it is 16", [1]).reward, proc.step("it is 15", [1]).reward) == (1.0, 0.0)
    finally:
        proc.close()


def test_an_answer_with_an_infinite_or_overflowing_tool_figure_is_refused():
    """1e400 parses to inf and an int past int64 fits JSON: either would make the rollout log's
    writer raise on the controller; the runner refuses the answer (the episode ends), and a
    lone surrogate in any text comes out as its escape, valid UTF-8 for the tokenizer and the
    log (honest code makes one: a file name through os.fsdecode)."""
    from areal_hpc.env.runner import _step_of

    def line(**tool):
        rec = {"name": "t", "args": "a", "output_bytes": 1, "seconds": 0.5, "error": None, **tool}
        return json.dumps({"id": 1, "observation": "x", "done": False, "reward": None,
                           "tool": rec}).replace('"SECS"', "1e400").encode()
    assert _step_of(line(), 1, "step").tool.seconds == 0.5
    with pytest.raises(ValueError, match="tool seconds is inf"):
        _step_of(line(seconds="SECS"), 1, "step")
    with pytest.raises(ValueError, match="tool output_bytes is 9223372036854775808"):
        _step_of(line(output_bytes=2**63), 1, "step")
    step = _step_of(json.dumps({"id": 1, "observation": "obs \udcff", "done": False, "reward": None,
                                "tool": {"name": "n\ud800", "args": "a\udcfe", "output_bytes": 1,
                                         "seconds": 0.5, "error": "e\udfff"}}).encode(), 1, "step")
    assert step.observation == "obs \\udcff" and step.tool.name == "n\\ud800"
    assert step.tool.args == "a\\udcfe" and step.tool.error == "e\\udfff"
    err = _step_of(json.dumps({"id": 1, "error": "bad \udcff"}).encode(), 1, "step")
    assert err.error == "bad \\udcff" and err.done
    for text in (step.observation, step.tool.name, step.tool.args, step.tool.error, err.error):
        text.encode("utf-8")


def test_an_honest_tool_record_with_a_surrogate_reaches_the_log(envs, tmp_path):
    """Through the child: a file name that is not UTF-8, through os.fsdecode, in the observation
    and the tool record; the rollout log's episode columns take the record."""
    envs.write_text(envs.read_text() + '''
class FileNames(Echo):
    def step(self, text, ids):
        name = os.fsdecode(b"data-\\xff.csv")
        return Step("wrote " + name, False, None, ToolCall("ls", name, 2**40, 0.25, "no " + name))
''')
    proc = EnvProcess(_cfg(envs, "FileNames"))
    try:
        proc.reset({"question": "q"})
        step = proc.step("t", [1])
    finally:
        proc.close()
    assert step.error is None and step.observation == "wrote data-\\udcff.csv", step
    assert step.tool.args == "data-\\udcff.csv" and step.tool.output_bytes == 2**40
    from areal_hpc.storage.episode_log import TOOL_TEXT_BYTES, utf8_cut
    assert utf8_cut(step.tool.error, TOOL_TEXT_BYTES["error"]) == b"no data-\\udcff.csv"


def test_an_environment_discards_an_episode_with_its_reason(envs):
    """Step(discard=...) ends the episode as not the model's doing: cause "env", the reason in
    its error, its tool record kept, its observation not appended; the child goes on."""
    from areal_hpc.env.episode import Episode
    proc = EnvProcess(_cfg(envs, "Discards"))
    try:
        proc.reset({"question": "q"})
        step = proc.step("find x", [1])
        assert step.done and step.cause == "env" and step.observation is None
        assert step.error == "discarded by the environment: the tool server is down"
        assert step.tool.error == "HTTP 503" and proc.proc is not None
        ep = Episode([1, 2], max_tokens=16, max_turns=4)
        ep.add_sample([3], [-0.5], [0])
        ep.apply(step)
        assert ep.done and ep.discard == "env" and ep.tool_calls == [step.tool]
        assert Episode.from_state(ep.state()).discard == "env"
        proc.reset({"question": "q"})
        quiet = proc.step("quietly", [1])
        assert quiet.cause == "env" and quiet.error == "discarded by the environment"
    finally:
        proc.close()
    from areal_hpc.env.runner import _step_of
    with pytest.raises(ValueError, match="discard is not a string"):
        _step_of(json.dumps({"id": 1, "observation": None, "done": True, "reward": None,
                             "tool": None, "discard": 1}).encode(), 1, "step")


def test_tool_calls_are_answered_by_call_one_after_another(envs):
    """Native tool calling's calls: `call(name, arguments)`'s text is the result with a tool
    record; an exception is the call's error, answered to the model (the episode goes on); a
    discard or a hang ends the episode; a resumed episode's saved calls are made again."""
    from areal_hpc.env.runner import replay_steps
    with EnvRunner(_cfg(envs, "Tools", call_timeout_s=5), max_episodes=1) as runner:
        assert runner.reset("a", {"question": "q"}).result().error is None
        steps = runner.call("a", [("f", '{"x": 1}'), ("g", '{"x": "boom"}'), ("f", '{"x": 2}')]).result()
        assert [s.observation for s in steps] == ["f(1)", "error: ValueError: x must be a number", "f(2)"]
        assert [s.tool.error for s in steps] == [None, "error: ValueError: x must be a number", None]
        assert steps[0].tool.name == "f" and steps[0].tool.args == '{"x": 1}'
        assert steps[0].tool.output_bytes == 4 and not any(s.done for s in steps)
        down = runner.call("a", [("f", '{"x": "down"}'), ("f", '{"x": 3}')]).result()
        assert len(down) == 1 and down[0].cause == "env" and "backend is down" in down[0].error
        runner.finish("a").result()
        assert runner.reset("b", {"question": "q"}).result().error is None
        slow = runner.call("b", [("f", '{"x": "slow"}')]).result()
        assert slow[0].cause == "timeout" and slow[0].done
        runner.finish("b")
    proc = EnvProcess(_cfg(envs, "Tools"))
    try:
        steps = replay_steps(proc, {"question": "q"}, [("t", [1], [("f", '{"x": 5}')]), ("t", [2], None)])
        assert [s.observation for s in steps] == ["q", "f(5)", ">t"]
    finally:
        proc.close()
    plain = EnvProcess(_cfg(envs, "Echo"))
    try:
        plain.reset({"question": "q"})
        assert "no call(name, arguments) method" in plain.call("f", "{}").error
    finally:
        plain.close()


def test_at_the_end_running_episodes_get_their_close_unless_a_call_is_in_flight(envs, tmp_path):
    """`close(ending_s)` (a preemption's or the run's end): an episode whose environment is idle
    gets its close(); one answering a call is killed (its call answers that it died)."""
    log = tmp_path / "closed"
    runner = EnvRunner(_cfg(envs, "Closes", call_timeout_s=600), max_episodes=2)
    assert runner.reset("a", {"question": "q1", "log": str(log)}).result().error is None
    assert runner.reset("b", {"question": "q2", "log": str(log)}).result().error is None
    busy = runner.step("b", f"wait:{tmp_path / 'never'}", [1])
    deadline = time.monotonic() + 60
    while not (tmp_path / "never.started").exists():
        assert time.monotonic() < deadline, "the step never started"
        time.sleep(0.01)
    runner.close(ending_s=60)
    assert log.read_text() == "q1\n"
    assert "died" in busy.result(timeout=60).error


@pytest.mark.skipif(os.geteuid() != 0, reason="the attack is root's: as another user the child "
                    "is in a user namespace of its own and cannot reach its parent (CI runs as root)")
def test_as_root_an_environment_cannot_write_into_its_parents_memory(envs):
    """Run as root: the environment's child unmounts its own /proc, sees the host's beneath, and
    tries to write into the memory of the process that runs its episodes (the generator).
    Refused: the child has no CAP_SYS_PTRACE (contain.wrap's bounding set) and the parent is
    not dumpable (contain.protect_from_children), so the kernel's ptrace check fails whatever
    Yama says; the parent's bytes are unchanged."""
    import ctypes
    from areal_hpc.reward.contain import protect_from_children
    protect_from_children()
    buf = ctypes.create_string_buffer(b"A" * 16)
    proc = EnvProcess(_cfg(envs, "Escapes"))
    try:
        assert proc.reset({"question": "q"}).error is None
        step = proc.step(json.dumps({"pid": os.getpid(), "addr": ctypes.addressof(buf), "n": 16}), [1])
    finally:
        proc.close()
    assert step.error is None and "denied" in step.observation, step
    assert buf.raw == b"A" * 16 + b"\0"
