"""Fixtures shared by the tests that run whole jobs (e2e, launch): the tiny model, built once, and
`jobs`, which starts job commands and finds every process they left (by an environment marker)."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections import defaultdict
from pathlib import Path

import psutil
import pytest
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]

# The two markers (`tools/test.sh --fast` runs what is neither: the unit tests of the logic, a few
# minutes; sandboxed programs, each a bubblewrap process of a second or less, are among them):
#   e2e   a whole job through a launcher (mpiexec, the local Slurm clusters): tests/e2e, and any
#         test using a Slurm cluster (CLUSTER_FIXTURES);
#   slow  starts vLLM engines, Megatron, MPI or torch.distributed worlds, jobs or clusters: a test
#         using one of HEAVY_FIXTURES, or in a module marked `pytestmark = pytest.mark.slow`.
# Every e2e test is slow too.
CLUSTER_FIXTURES = {"slurm_env", "netns_cluster"}
HEAVY_FIXTURES = {"tiny_model", "trained_tiny_model", "jobs", "reward_fn_run", "megatron_ws1",
                  "engine", "run_distributed", *CLUSTER_FIXTURES}


# Parallel runs (pytest-xdist, `tools/test.sh`; the scheduler below): every module runs whole on
# one worker (its module-scoped engines and worlds start once), and the modules that share a
# cluster run on one worker together: the local Slurm cluster's (one cluster up, no two jobs
# queued against each other's bounds), and the namespaced one's. The two clusters are separate
# (state, ports, subnet: tools/local_slurm.sh), so their groups run side by side. The engine
# restarts join the namespaced cluster's group: beside the 32B rehearsal's start (ten ranks and
# four vLLM workers on two cores) a fresh engine's first step once had no output for 60 s, a
# stall the test had not asked for; one after the other, they never meet.
GROUPS = {"launch/test_slurm.py": "slurm", "launch/test_slurm_netns.py": "netns",
          "launch/test_rehearse.py": "netns", "e2e/test_engine_restart.py": "netns"}
# The groups handed out first, longest first (seconds each took in a run on two workers, rounded:
# the fresh-clone run at bf30c83, 1,793 s in all), so that no long group starts last and leaves the
# other worker idle; the rest follow in their order.
LONGEST_FIRST = {
    "netns": 750, "slurm": 480, "e2e/test_trainer_death.py": 180, "e2e/test_preempt_resume.py": 170,
    "analysis/test_evaluate.py": 165, "e2e/test_repeat.py": 165, "e2e/test_local_job.py": 165,
    "e2e/test_generator_failure.py": 130, "e2e/test_native_tools_job.py": 115,
    "e2e/test_mid_step_stop.py": 110, "transport/test_rank_death.py": 90, "e2e/test_episodes_job.py": 90,
    "rollout/test_vllm_engine.py": 80, "launch/test_gpu_check.py": 60, "transport/test_weights.py": 60,
    "e2e/test_qwen_shapes.py": 45, "train/test_actor_parallel.py": 45, "rollout/test_sample_seeds.py": 35,
    "train/test_shares.py": 35, "rollout/test_episodes.py": 30, "transport/test_chunks.py": 30,
    "train/test_checkpoint_async.py": 30, "transport/test_collectives.py": 25,
    "rollout/test_vllm_engine_tp.py": 25,
}


def pytest_configure(config):
    config.addinivalue_line("markers", "e2e: runs a whole job through a launcher (mpiexec, Slurm)")
    config.addinivalue_line("markers", "slow: starts vLLM, Megatron, MPI worlds, sandboxes or jobs")


def _group(nodeid: str) -> str:
    """The group a test runs in: its module's path below tests/, or its GROUPS name."""
    rel = nodeid.split("::")[0].removeprefix("tests/")
    return GROUPS.get(rel, rel)


def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(ROOT / "tests")
        uses = set(getattr(item, "fixturenames", ()))
        if rel.parts[0] == "e2e" or CLUSTER_FIXTURES & uses:
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.slow)
        elif HEAVY_FIXTURES & uses:
            item.add_marker(pytest.mark.slow)
    # stable: within a group, and among the groups not listed, the collection order stays
    items.sort(key=lambda item: -LONGEST_FIRST.get(_group(item.nodeid), 0))


if importlib.util.find_spec("xdist") is not None:
    def pytest_xdist_make_scheduler(config, log):
        """xdist's scheduling by scope, each scope a `_group`, handed out in collection order
        (run with --no-loadscope-reorder): a worker takes the next group when it has two tests
        or fewer left. (xdist's own xdist_group marks need a node id pytest 9 no longer lets a
        plugin rename.)"""
        from xdist.scheduler import LoadScopeScheduling

        class ByGroup(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return _group(nodeid)
        return ByGroup(config, log)


_SKIPPED: list[str] = []      # the tests skipped in this run (under xdist: on the controller)


def pytest_runtest_logreport(report):
    if report.skipped:
        _SKIPPED.append(report.nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The seconds each test module took (setup, call and teardown of its tests; under xdist,
    on whichever worker ran it), the longest first; and, under AREAL_TEST_NO_SKIPS=1 (CI), that
    the run fails for its skips (`pytest_sessionfinish`)."""
    per_module: dict[str, float] = defaultdict(float)
    for reports in terminalreporter.stats.values():
        for rep in reports:
            if getattr(rep, "when", None) in ("setup", "call", "teardown") and hasattr(rep, "duration"):
                per_module[rep.nodeid.split("::")[0]] += rep.duration
    if per_module:
        terminalreporter.section("seconds per test module (the 25 longest)")
        for mod, s in sorted(per_module.items(), key=lambda kv: -kv[1])[:25]:
            terminalreporter.write_line(f"{s:8.1f}  {mod}")
    if _SKIPPED and os.environ.get("AREAL_TEST_NO_SKIPS") == "1":
        terminalreporter.write_line(f"AREAL_TEST_NO_SKIPS=1: {len(_SKIPPED)} test(s) skipped on this "
                                    f"machine (their reasons above): the run fails", red=True)


def pytest_sessionfinish(session, exitstatus):
    """A machine-dependent skip fails the run under AREAL_TEST_NO_SKIPS=1 (CI). (The terminal
    summary comes after this hook, so the skips are counted as their reports come.)"""
    if _SKIPPED and os.environ.get("AREAL_TEST_NO_SKIPS") == "1" and session.exitstatus == 0:
        session.exitstatus = 1


def built_once(tmp_path_factory, name: str, build, timeout_s: float = 1800):
    """`build(folder)` once per test run, its JSON-able result kept: in one pytest process, or
    shared by pytest-xdist's workers (the first to take the lock builds in the run's common
    temp folder, the others wait for it, at most `timeout_s`, and reuse it). A build that fails
    leaves nothing: the next one to ask tries again, and fails with its own message."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    out, done = base / f"shared-{name}", base / f"shared-{name}.json"
    with FileLock(str(base / f"shared-{name}.lock"), timeout=timeout_s):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            done.with_suffix(".tmp").write_text(json.dumps(build(out)))
            done.with_suffix(".tmp").rename(done)
    return json.loads(done.read_text())


def _world_env(env: dict | None) -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(env or {})}


def _mpi_world(worker: Path, n: int, args) -> list[str]:
    """The mpiexec command line of a test's world, after what areal_hpc.main does before MPI
    starts: this node's MPICH segments that no process maps and that are over 10 s old are
    removed. Many test worlds end without MPI_Finalize (a rank that times out, one killed) and
    leave theirs (12 runs of test_collectives' bcast world left 12); a world's segment is named
    after its PMI job name (hydra's carries mpiexec's pid, which can repeat within a run where
    pid_max is 32768), and a world that meets a leftover of its name fails or hangs in MPI_Init
    (reaper.SHM_PREFIX): the likely cause of one such world that printed nothing for 120 s."""
    from areal_hpc import reaper
    from areal_hpc.launch.local import mpiexec
    reaper.remove_stale_segments()
    return [mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py", str(worker), *map(str, args)]


class World:
    """The one harness of the distributed tests: a test's worker script run as a world of n ranks,
    from the repository root, each rank with OMP_NUM_THREADS=1 and the repository on PYTHONPATH
    (`env` adds to that).
    - `world(worker, n, *args)` (mpi=True): `mpiexec -n N python -m mpi4py WORKER ARGS`, an MPI
      world (the worker asks MPI for its rank); mpi=False: N processes `python WORKER RANK N PORT
      ARGS`, a torch.distributed world on a free port. Returns the output (stdout and stderr,
      the ranks one after another without MPI); `check`: every rank must exit 0 (the assertion
      shows the output's end).
    - `start(worker, n, *args)`: the MPI world in the background (a Popen of mpiexec, output in
      its stdout), for a test that plays a part beside it; `stop(proc)` ends one still running.
    """

    @staticmethod
    def __call__(worker: Path, n: int, *args, mpi: bool = True, env: dict | None = None,
            timeout: float = 600, check: bool = True) -> str:
        if mpi:
            r = subprocess.run(_mpi_world(worker, n, args), cwd=ROOT, capture_output=True,
                               text=True, timeout=timeout, env=_world_env(env))
            out = r.stdout + r.stderr
            assert not check or r.returncode == 0, out[-4000:]
            return out
        from areal_hpc.transport.rendezvous import free_port
        port = str(free_port())
        procs = [subprocess.Popen([sys.executable, str(worker), str(r), str(n), port,
                                   *map(str, args)], cwd=ROOT, env=_world_env(env),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(n)]
        try:
            logs = [p.communicate(timeout=timeout)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for p, log in zip(procs, logs):
            assert not check or p.returncode == 0, log[-4000:]
        return "".join(logs)

    @staticmethod
    def start(worker: Path, n: int, *args, env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen(_mpi_world(worker, n, args), cwd=ROOT, env=_world_env(env),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    @staticmethod
    def stop(proc: subprocess.Popen) -> None:
        if proc.poll() is None:     # mpiexec passes SIGTERM on to the ranks; SIGKILL would orphan them
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def run_distributed() -> World:
    return World()


class Jobs:
    """Start `python <args>` from the repo root, marked so that this session's job processes (MPI
    ranks, vLLM engines, their children, re-parented orphans) can be found and signalled."""

    root = ROOT

    def __init__(self):
        self.marker = ("AREAL_HPC_TEST_SESSION", uuid.uuid4().hex)
        self._seen: dict[int, psutil.Process] = {}

    def env(self, env=None) -> dict:
        env = dict(os.environ if env is None else env)
        env[self.marker[0]] = self.marker[1]
        return env

    def run(self, args, timeout, env=None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, env=self.env(env))

    def start(self, args, env=None) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=self.env(env), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    @staticmethod
    def args(model, out_dir, name, *extra) -> list[str]:
        """The tiny job on `model` (a make_tiny_model.py output), run in <out_dir>/<name>."""
        return ["-m", "areal_hpc.launch.local", "configs/tiny_cpu.yaml",
                f"model.path={model}", f"data.train_path={model}/train.jsonl",
                f"data.eval_path={model}/heldout.jsonl", f"output_dir={out_dir}", f"name={name}",
                *extra]

    def processes(self, ranks_only: bool = False) -> list[psutil.Process]:
        """Live processes of this session's jobs (only the MPI ranks if `ranks_only`).

        Marked processes, their descendants, and every process seen here before that is still
        the same process: vLLM's engine processes rewrite their title over the environment
        block (setproctitle), so they carry no readable marker and, once re-parented, can only
        be found because they were seen under a rank earlier."""
        found: dict[int, psutil.Process] = {}
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if p.pid == os.getpid() or p.environ().get(self.marker[0]) != self.marker[1]:
                    continue
                if not ranks_only or "areal_hpc.main" in " ".join(p.info["cmdline"] or []):
                    found[p.pid] = p
            except psutil.Error:
                pass
        if ranks_only:
            return list(found.values())
        for p in list(found.values()):
            try:
                found.update((c.pid, c) for c in p.children(recursive=True))
            except psutil.Error:
                pass
        for pid, p in self._seen.items():
            try:
                if pid not in found and p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    found[pid] = p
            except psutil.Error:
                pass
        self._seen.update(found)
        return [p for p in found.values() if p.pid != os.getpid()]

    def leftovers(self, grace_s: float = 10.0) -> list[tuple[int, str]]:
        """Processes of this session's jobs still running after `grace_s` (a rank's reaper
        ends a moment after its rank)."""
        psutil.wait_procs(self.processes(), timeout=grace_s)
        out = []
        for p in self.processes():
            try:
                out.append((p.pid, " ".join([p.name(), *p.cmdline()])[:120]))
            except psutil.Error:
                pass
        return out


@pytest.fixture(scope="session")
def jobs() -> Jobs:
    return Jobs()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, jobs):
    """The tiny model's recipe (tools/make_tiny_model.py) pre-trained 30 steps, built once a
    run (shared by xdist's workers): enough for jobs to run, not to answer problems
    (tests/analysis's `trained_tiny_model` does)."""
    def build(folder: Path) -> str:
        out = folder / "tiny"
        r = jobs.run(["tools/make_tiny_model.py", "--out", str(out), "--steps", "30"], timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return str(out)
    return Path(built_once(tmp_path_factory, "tiny_model", build))


# One finished job scored by a user reward function, shared by the e2e tests of a short async run
# at η = 1 and of reward functions and chat templates (tests/e2e/test_local_job.py) and the replay
# test (tests/train/test_replay.py): a job costs about a minute of a suite near its budget.
# Async, η = 1, one generator, evaluated at the start, at step 2 and at the end, two minibatches per step
# (the minibatch split depends on the batch order, which replay must rebuild), prompts through a
# chat template from a file. The reward, from the completion's length, differs within most groups
# (the barely pre-trained model answers nothing right: with 0/1 rewards every loss would be 0) and
# its values are float32-exact, as the rollout log stores rewards.
REWARD_FN_RUN = {"steps": 3, "B": 2, "n": 2}


@pytest.fixture(scope="session")
def reward_fn_run(tmp_path_factory, jobs, tiny_model):
    def build(tmp: Path) -> dict:
        fn = tmp / "my_reward.py"
        fn.write_text("def by_length(completion, reference, row):\n"
                      "    assert set(row) == {'question', 'answer'}  # the whole dataset row\n"
                      "    return {'reward': (len(completion) % 7) / 8, 'chars': len(completion)}\n")
        chat = tmp / "chat.jinja"
        chat.write_text("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
        k = REWARD_FN_RUN
        r = jobs.run(jobs.args(tiny_model, tmp, "fn", f"reward.fn={fn}:by_length",
                               "data.chat=true", f"data.chat_template={chat}",
                               f"train.total_steps={k['steps']}", f"train.batch_prompts={k['B']}",
                               f"rollout.group_size={k['n']}", "train.ppo_minibatches=2",
                               "rollout.max_new_tokens=24", "data.eval_limit=6", "data.eval_samples=1",
                               "data.eval_every_steps=2"),
                     timeout=900)
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-6000:])
        assert not jobs.leftovers(), "processes of the job are still running"
        return {"run": str(tmp / "fn"), "stdout": r.stdout, "stderr": r.stderr}
    built = built_once(tmp_path_factory, "reward_fn_run", build)
    return {**built, "run": Path(built["run"]), **REWARD_FN_RUN}
