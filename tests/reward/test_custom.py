"""User reward functions (reward/custom.py): named by module path or by file path, checked at
start-up, and run by the real reward pool's worker processes with its timeout and error
counting."""
import sys
import textwrap
from pathlib import Path

import pytest

from areal_hpc.config import ConfigError, load
from areal_hpc.reward import custom
from areal_hpc.reward.pool import RewardPool, RewardResult

ROOT_CONFIG = Path(__file__).resolve().parents[2] / "configs/tiny_cpu.yaml"

USER_MODULE = textwrap.dedent('''
    import math
    import time

    def answer_n(completion, reference, row):
        """1 when the completion ends in 'Answer: <reference>'; logs the length."""
        ok = completion.strip().endswith(f"Answer: {reference}")
        return {"reward": float(ok), "chars": len(completion), "has_id": float("id" in row)}

    def two_args(completion, reference):
        return 0.25

    def raises(completion, reference, row):
        raise KeyError("no such field")

    def wrong_type(completion, reference, row):
        return "1.0"

    def nan(completion, reference, row):
        return math.nan

    def slow(completion, reference, row):
        time.sleep(60)
        return 1.0

    def no_reward_key(completion, reference, row):
        return {"score": 1}

    NOT_A_FUNCTION = 3

    def one_arg(completion):
        return 1.0
''')


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    """A module importable as `user_rewards` (its directory on sys.path, which spawned workers
    inherit) and the same code as a file elsewhere."""
    d = tmp_path_factory.mktemp("user")
    (d / "user_rewards.py").write_text(USER_MODULE)
    other = tmp_path_factory.mktemp("elsewhere") / "my_reward.py"
    other.write_text(USER_MODULE)
    sys.path.insert(0, str(d))
    yield other
    sys.path.remove(str(d))


def _specs(*pairs):
    return [custom.Spec(custom.resolve(s), w, custom.split_spec(s)[1], f"reward.functions[{i}]")
            for i, (s, w) in enumerate(pairs)]


def _score_all(pool, calls):
    for key, (completion, reference, row) in calls.items():
        pool.submit(key, "custom", completion, reference, row)
    return {r.key: r for r in pool.drain(timeout=120)}


def test_module_and_file_functions_score_in_the_pool_workers(user_module):
    by_module = _specs(("user_rewards:answer_n", 1.0))
    by_file = _specs((f"{user_module}:answer_n", 1.0))
    for specs in (by_module, by_file):
        with RewardPool(max_workers=1, functions=specs, fn_timeout_s=20) as pool:
            res = _score_all(pool, {"right": ("so 3+4=7. Answer: 7", "7", {"id": 1}),
                                    "wrong": ("Answer: 8", "7", {})})
            assert res["right"].reward == 1.0 and res["right"].error is None
            assert res["right"].extras == {"chars": 19, "has_id": 1.0}
            assert res["wrong"].reward == 0.0 and res["wrong"].extras == {"chars": 9, "has_id": 0.0}
            assert pool.stats()["errors"] == 0


def test_several_functions_are_summed_with_weights_and_each_logged(user_module):
    specs = _specs(("user_rewards:answer_n", 2.0), ("user_rewards:two_args", -1.0))
    with RewardPool(max_workers=1, functions=specs) as pool:
        res = _score_all(pool, {"k": ("Answer: 5", "5", {})})["k"]
    assert res.reward == pytest.approx(2.0 * 1.0 - 0.25)
    assert res.extras == {"answer_n.chars": 9, "answer_n.has_id": 0.0, "answer_n": 1.0, "two_args": 0.25}


def test_bad_functions_are_counted_errors_and_the_pool_keeps_serving(user_module):
    cases = {"raises": "KeyError: 'no such field'", "wrong_type": "is a str, not a number",
             "nan": "is nan", "no_reward_key": "without 'reward'", "slow": "timeout after 3 s"}
    for name, why in cases.items():
        with RewardPool(max_workers=1, functions=_specs((f"user_rewards:{name}", 1.0)),
                        fn_timeout_s=3) as pool:
            res = _score_all(pool, {"k": ("Answer: 1", "1", {})})["k"]
            assert res.reward == 0.0 and why in res.error, (name, res)
            assert pool.stats()["errors"] == 1
            if name == "slow":
                assert pool.stats()["timeouts"] == 1


@pytest.mark.parametrize("spec,why", [
    ("user_rewards:missing", "has no 'missing'"),
    ("user_rewards:NOT_A_FUNCTION", "is a int, not a function"),
    ("user_rewards:one_arg", "cannot be called as (completion, reference, row)"),
    ("no_such_package.mod:f", "cannot import 'no_such_package.mod': ModuleNotFoundError"),
    ("does/not/exist.py:f", "no such file"),
    ("no_colon_here", "expected 'package.module:function'"),
])
def test_an_unusable_function_is_a_config_error_naming_the_key(user_module, spec, why):
    cfg = load(ROOT_CONFIG, [f"reward.fn={spec}"]) if ":" in spec else None
    if cfg is None:
        with pytest.raises(ConfigError, match="config key 'reward.fn'") as e:
            load(ROOT_CONFIG, [f"reward.fn={spec}"])
    else:
        with pytest.raises(custom.RewardFnError, match="config key 'reward.fn'") as e:
            custom.check(cfg)
    assert why in str(e.value)


def test_a_module_that_fails_on_import_is_named(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('needs a GPU')\ndef f(c, r, row):\n    return 1\n")
    cfg = load(ROOT_CONFIG, ["reward.functions=[{fn: " + f"{bad}:f" + ", weight: 1}]"])
    with pytest.raises(custom.RewardFnError) as e:
        custom.check(cfg)
    assert str(e.value) == (f"config key 'reward.functions[0]': '{bad}:f': cannot import '{bad}': "
                            "RuntimeError: needs a GPU")


def test_relative_file_paths_are_resolved_against_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "r.py").write_text("def f(c, r, row):\n    return 1\n")
    monkeypatch.chdir(tmp_path)
    cfg = load(ROOT_CONFIG, ["reward.fn=r.py:f"])
    [spec] = custom.check(cfg)
    assert spec.spec == f"{tmp_path / 'r.py'}:f" and spec.name == "f" and spec.weight == 1.0


def test_two_functions_of_one_name_are_refused():
    with pytest.raises(ConfigError, match="two functions share a name"):
        load(ROOT_CONFIG, ["reward.functions=[{fn: a.b:f}, {fn: c.d:f}]"])


def test_the_custom_kind_needs_functions():
    with RewardPool(max_workers=1) as pool, pytest.raises(ValueError, match="needs the pool's functions"):
        pool.submit("k", "custom", "x", "1")


def test_the_answer_n_example_loads_and_scores(monkeypatch):
    """examples/answer_n: its config names its reward file; the function reads "Answer: N"."""
    from areal_hpc.data.tiny_task import make_problems

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    cfg = load("examples/answer_n/config.yaml")
    custom.check(cfg)                                   # imports, takes (completion, ref, row)
    answer_n = custom.load(cfg.reward.fn)
    p = make_problems(1, seed=0, answer_format="answer")[0]
    assert p["solution"].endswith(f"Answer: {p['answer']}")
    assert answer_n(p["solution"], p["answer"], p) == {"reward": 1.0, "format": 1.0,
                                                       "steps": float(p["solution"].count(","))}
    assert answer_n("1+2=3,Answer: 4", "3", {})["reward"] == 0.0
    assert answer_n("1+2=3,\\boxed{3}", "3", {})["format"] == 0.0


DAEMON = '''
import fcntl, os, sys, time
def _daemon(pidfile):
    if os.fork():   # back once the daemon runs (it holds its lock), so whatever ends the call
        deadline = time.monotonic() + 60        # next ends a daemon that was there
        while not os.path.exists(pidfile) and time.monotonic() < deadline:
            time.sleep(0.01)
        return
    os.setsid()
    if os.fork():
        os._exit(0)
    lock = open(pidfile + ".lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)        # held while it lives: pids differ across namespaces
    open(pidfile, "w").write(str(os.getpid()))
    while True:
        print("still here", flush=True)
        time.sleep(0.2)
'''


def _gone(pidfile: Path, timeout: float = 10.0) -> bool:
    """Whether the daemon that wrote `pidfile` is dead (its lock is free) within `timeout`.
    Told by its lock, not its pid: a pid read inside a PID namespace names another process
    here."""
    import fcntl
    import time
    deadline = time.monotonic() + timeout
    while not pidfile.exists():
        assert time.monotonic() < deadline, "the daemon never started"
        time.sleep(0.05)
    with open(f"{pidfile}.lock") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)


def test_the_import_check_runs_in_a_child_that_takes_what_it_started_with_it(tmp_path):
    """A module that starts a double-forked daemon holding stdout and prints 8 MB while it is
    imported: the check still ends, the daemon is dead, and the launcher ran none of it."""
    pidfile = tmp_path / "daemon.pid"
    mod = tmp_path / "noisy.py"
    mod.write_text(DAEMON + f"_daemon({str(pidfile)!r})\nprint('x' * (8 << 20))\n"
                   "def f(c, r, row):\n    return 1\n")
    cfg = load(ROOT_CONFIG, [f"reward.fn={mod}:f"])
    [spec] = custom.check(cfg)
    assert _gone(pidfile)
    assert spec.spec not in custom._LOADED      # imported in the child only


def test_a_module_that_blocks_at_import_is_a_bounded_config_error(tmp_path, monkeypatch):
    pidfile = tmp_path / "daemon.pid"
    mod = tmp_path / "blocks.py"
    mod.write_text(DAEMON + f"_daemon({str(pidfile)!r})\nimport time\ntime.sleep(600)\n")
    monkeypatch.setattr(custom, "IMPORT_TIMEOUT_S", 3.0)
    cfg = load(ROOT_CONFIG, [f"reward.fn={mod}:f"])
    with pytest.raises(custom.RewardFnError, match="config key 'reward.fn': importing the reward "
                       "function.* took over 3 s"):
        custom.check(cfg)
    assert _gone(pidfile)


def test_what_a_call_starts_dies_with_it_and_its_prints_are_capped(tmp_path, capfd):
    from areal_hpc.reward import pool as pool_mod

    pidfile = tmp_path / "daemon.pid"
    mod = tmp_path / "leaky.py"
    mod.write_text(DAEMON + "def f(c, r, row):\n"
                   f"    _daemon({str(pidfile)!r})\n"
                   "    print('y' * (3 << 20), flush=True)\n    return 0.5\n"
                   "def many(c, r, row):\n    return {'reward': 1, **{f'k{i}': i for i in range(40)}}\n"
                   "def huge(c, r, row):\n    return 1e300\n")
    specs = _specs((f"{mod}:f", 1.0))
    with RewardPool(max_workers=1, functions=specs, fn_timeout_s=30) as pool:
        res = _score_all(pool, {"k": ("x", "1", {})})["k"]
        assert res.reward == 0.5 and res.error is None
        assert _gone(pidfile)
    err = capfd.readouterr().err
    assert len(err) < pool_mod.WORKER_OUTPUT_BYTES + 10_000 and "bytes dropped]" in err
    for name, why in (("many", "40 logged fields (at most 16)"), ("huge", "beyond ±1e+06")):
        with RewardPool(max_workers=1, functions=_specs((f"{mod}:{name}", 1.0))) as pool:
            res = _score_all(pool, {"k": ("x", "1", {})})["k"]
            assert res.reward == 0.0 and why in res.error, res


# ---- user code cannot reach the parent ---------------------------------------------------------

HOSTILE = '''
import ctypes, fcntl, os, pickle, platform, sys, time

class Evil:
    def __reduce__(self):
        return (os.system, ("touch " + MARKER,))

def pickles(c, r, row):
    """Writes its own pickle where the worker's result goes (its fd is in the worker's argv)."""
    result_fd = int(sys.argv[2])
    os.write(result_fd, pickle.dumps(Evil()) + b"\\n")
    return 1.0

def patches(c, r, row):
    """Turns the worker's own check off, then returns what it would refuse."""
    import areal_hpc.reward.custom as custom
    custom._number = lambda value, what: value
    return {"reward": float("nan"), "ok": float("inf")}

class Liar(dict):
    def __len__(self):
        return 1

def many(c, r, row):
    return Liar({"reward": 1.0, **{f"k{i}": 1.0 for i in range(100_000)}})

class LongName(str):
    def __len__(self):
        return 3

def long_name(c, r, row):
    return {"reward": 1.0, LongName("n" * 1_000_000): 1.0}

def spawns(c, r, row):
    """A CLONE_PARENT child (from a forked child: the kernel refuses the flag to pid 1) and a
    chain that re-spawns itself as fast as it can; each holds a lock; then it blocks."""
    libc = ctypes.CDLL(None, use_errno=True)
    nr = {"x86_64": 56, "aarch64": 220}[platform.machine()]
    if os.fork() == 0:
        if libc.syscall(nr, 17 | 0x8000, 0, 0, 0, 0) == 0:       # SIGCHLD | CLONE_PARENT
            f = open(MARKER + ".sibling", "w")
            fcntl.flock(f, fcntl.LOCK_EX)
            open(MARKER + ".sibling.ready", "w").close()
            while True:
                time.sleep(1)
        os._exit(0)
    if os.fork() == 0:
        f = open(MARKER + ".chain", "w")
        fcntl.flock(f, fcntl.LOCK_EX)
        open(MARKER + ".chain.ready", "w").close()
        while True:
            if os.fork():
                os._exit(0)
    time.sleep(600)

def stops_reading(c, r, row):
    """The worker's main loop is pointed at a pipe nobody writes, while the calls' pipe keeps
    a reader that never reads."""
    call_fd = int(sys.argv[1])
    global _kept
    _kept = os.dup(call_fd)
    r, w = os.pipe()
    os.dup2(r, call_fd)
    return 1.0

def floods_stderr(c, r, row):
    block = b"e" * (1 << 20)
    for _ in range(300):                 # 300 MB on the raw descriptor
        os.write(2, block)
    return 1.0
'''


@pytest.fixture
def hostile(tmp_path):
    marker = tmp_path / "marker"
    mod = tmp_path / "hostile.py"
    mod.write_text(f"_MARKER = {str(marker)!r}\n" + HOSTILE.replace("MARKER", "_MARKER"))
    return mod, marker


def test_a_result_pickle_cannot_execute_in_the_parent(hostile):
    mod, marker = hostile
    with RewardPool(max_workers=1, functions=_specs((f"{mod}:pickles", 1.0))) as pool:
        res = _score_all(pool, {"k": ("x", "1", {})})["k"]
        assert res.reward == 0.0 and res.error.startswith("reward worker result refused:"), res
        assert "\n" not in res.error
        pool.submit("next", "custom", "x", "1", {})   # a fresh worker, the same refusal
        assert pool.drain(timeout=120)[0].error.startswith("reward worker result refused")
    assert not marker.exists()


@pytest.mark.parametrize("name", ["patches", "many", "long_name"])
def test_results_are_checked_again_in_the_parent(hostile, name):
    """The worker's own check patched away, or fooled by a dict or str whose len() lies: the
    parent refuses NaN and infinity, 100,000 logged fields, a 1,000,000-character name."""
    mod, _ = hostile
    with RewardPool(max_workers=1, functions=_specs((f"{mod}:{name}", 1.0))) as pool:
        res = _score_all(pool, {"k": ("x", "1", {})})["k"]
    assert res.reward == 0.0 and res.extras is None, res
    assert res.error.startswith("reward worker result refused:") and len(res.error) <= 200, res


def _lock_free(path: Path) -> bool:
    import fcntl
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False


def test_a_clone_parent_child_and_a_respawning_chain_are_gone_after_close(hostile):
    import time
    mod, marker = hostile
    pool = RewardPool(max_workers=1, functions=_specs((f"{mod}:spawns", 1.0)), fn_timeout_s=600)
    try:
        pool.submit("k", "custom", "x", "1", {})
        deadline = time.monotonic() + 120
        while not all(Path(f"{marker}.{w}.ready").exists() for w in ("sibling", "chain")):
            assert time.monotonic() < deadline, "the hostile function never got going"
            time.sleep(0.05)
    finally:
        pool.close()
    # no waiting: once close() has returned, neither holds its lock any more
    assert _lock_free(Path(f"{marker}.sibling")) and _lock_free(Path(f"{marker}.chain"))
    assert pool.done() == [RewardResult("k", 0.0, "reward pool closed")]


def test_raw_writes_to_the_workers_stderr_are_capped(hostile, capfd):
    from areal_hpc.reward import pool as pool_mod
    mod, _ = hostile
    with RewardPool(max_workers=1, functions=_specs((f"{mod}:floods_stderr", 1.0))) as pool:
        res = _score_all(pool, {"k": ("x", "1", {})})["k"]
    assert res == RewardResult("k", 1.0, None), res
    err = capfd.readouterr().err
    assert err.count("e") < pool_mod.WORKER_OUTPUT_BYTES + 10_000 and "bytes dropped]" in err


def test_a_worker_that_stops_taking_calls_costs_a_bounded_wait(hostile):
    """A function that stops its worker reading calls: the next call (1 MB, more than a pipe
    holds) is a timeout within its own bound, and the pool serves on with a fresh worker."""
    mod, _ = hostile
    with RewardPool(max_workers=1, functions=_specs((f"{mod}:stops_reading", 1.0)),
                    fn_timeout_s=3) as pool:
        assert _score_all(pool, {"first": ("x", "1", {})})["first"].reward == 1.0
        res = _score_all(pool, {"big": ("x" * (1 << 20), "1", {})})["big"]
        assert res.reward == 0.0 and res.error.startswith("timeout"), res
        assert _score_all(pool, {"next": ("x", "1", {})})["next"].reward == 1.0
        assert pool.stats()["timeouts"] == 1 and pool.stats()["restarts"] == 1
