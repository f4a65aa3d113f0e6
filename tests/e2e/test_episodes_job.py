"""A job with multi-turn episodes (env.fn: a user's environment in one file) on the real stack
(mpiexec, vLLM, Megatron, HDF5), preempted (USR1) while episodes are in flight and resumed: the
episodes in flight go back as far as they got and the resumed job continues them; the audit
(every trained token sampled, every observation token masked, every partial row continued by a
row that starts with it, nothing lost or trained twice) holds. The environment fails every
`reset` of the first training prompt: that group, without a sampled token, is recorded FAILED and
never trained, and neither attempt ends for it. Its hint tool fails once for the second prompt:
that episode is discarded (env.on_error: drop_episode), logged with its cause, counted, and left
out of the loss (the audit recomputes what was trained from the log)."""
import json
import signal
from pathlib import Path

import psutil

from areal_hpc.audit import audit
from areal_hpc.storage import checkpoint as ck
from areal_hpc.config import load
from areal_hpc.data.prompts import load_prompts_of
from areal_hpc.rollout.ledger import PromptCursor
from areal_hpc.storage.rollout_log import FAILED, PARTIAL, RolloutReader
from tests.e2e.test_preempt_resume import _steps_done, _wait_for

ROOT = Path(__file__).resolve().parents[2]
STEPS, B, N = 4, 3, 2

# Turn 1 gets a hint back ("check:" and the answer's digit count); turn 2 is scored and ends the
# episode. The hint takes a while (as a tool does). While the file `hold` exists beside the
# environment's file, the hint waits for it to go (and says so in the file `holding`): the test
# preempts once an episode waits there, so the preemption always finds one in flight (without
# it, a preemption that came while the generator waited at the staleness bound found none).
# Its `reset` raises for the question in the file `fail_question` (the first training prompt's):
# every episode of that group ends before the model's first turn. The first episode of the
# question in `discard_question` to reach its first turn discards itself (a failed tool).
ENV = '''
import os
import time
from areal_hpc.env.base import Step, ToolCall

HERE = os.path.dirname(os.path.abspath(__file__))


class Hint:
    def __init__(self, delay_s=0.2):
        self.delay_s = delay_s

    def reset(self, row):
        fail = os.path.join(HERE, "fail_question")
        if os.path.exists(fail) and open(fail).read() == row["question"]:
            raise ConnectionError("the tool server is down")
        self.turn, self.answer, self.question = 0, str(row["answer"]), row["question"]
        return row["question"]

    def step(self, text, ids):
        self.turn += 1
        if self.turn == 1 and open(os.path.join(HERE, "discard_question")).read() == self.question:
            try:
                os.close(os.open(os.path.join(HERE, "discarded"), os.O_CREAT | os.O_EXCL))
                return Step(discard="the hint service timed out",
                            tool=ToolCall("hint", "", 0, self.delay_s, "timeout"))
            except FileExistsError:
                pass
        if self.turn == 1:
            time.sleep(self.delay_s)
            if os.path.exists(os.path.join(HERE, "hold")):
                open(os.path.join(HERE, "holding"), "w").close()
                while os.path.exists(os.path.join(HERE, "hold")):
                    time.sleep(0.05)
            out = f"check:{len(self.answer)}"
            return Step(observation=out, tool=ToolCall("hint", "", len(out), self.delay_s, None))
        return Step(done=True, reward=float(self.answer in text))
'''


def test_episodes_preempted_mid_episode_resume_with_the_audit_clean(jobs, tiny_model, tmp_path):
    env = tmp_path / "hint_env.py"
    env.write_text(ENV)
    cfg = load(ROOT / "configs/tiny_cpu.yaml", [f"data.train_path={tiny_model}/train.jsonl"])
    rows = load_prompts_of(cfg, cfg.data.train_path)
    cursor = PromptCursor(len(rows), cfg.data.seed)
    first, second = rows[cursor.next()], rows[cursor.next()]        # prompt ids 0 and 1
    (tmp_path / "fail_question").write_text(first["question"])
    (tmp_path / "discard_question").write_text(second["question"])
    args = jobs.args(tiny_model, tmp_path, "ep", f"train.total_steps={STEPS}",
                     f"train.batch_prompts={B}", f"rollout.group_size={N}",
                     "rollout.max_new_tokens=24", "data.eval_limit=4", "data.eval_samples=1",
                     "checkpoint.every_steps=0", f"env.fn={env}:Hint", "env.max_turns=3",
                     "env.call_timeout_s=900")
    run_dir = tmp_path / "ep"
    proc = jobs.start(args)
    _wait_for(lambda: _steps_done(run_dir) >= 1, proc)
    (tmp_path / "hold").touch()
    _wait_for((tmp_path / "holding").exists, proc)
    for p in jobs.processes(ranks_only=True):       # Slurm's time-limit warning
        try:
            p.send_signal(signal.SIGUSR1)
        except psutil.Error:
            pass
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 3, out[-4000:]
    assert "every sample of prompt 0 ended before a sampled token" in out, out[-4000:]
    assert "the tool server is down" in out
    assert "discarded (env): discarded by the environment: the hint service timed out" in out
    (tmp_path / "hold").unlink()
    done = _steps_done(run_dir)
    assert ck.find_latest(run_dir)[1]["step"] == done < STEPS

    resumed = jobs.start(args)
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out[-4000:]
    assert f"resuming from {ck.step_dir(run_dir, done)}" in out, out[-4000:]
    with RolloutReader(run_dir / "rollouts.h5") as r:
        rows = [r[i] for i in range(len(r))]
        consumed = r.column("consumed_step")
    trained = [x for x, c in zip(rows, consumed) if c >= 0]
    assert len(trained) == STEPS * B * N
    # the failed prompt: its one group FAILED, no token, never trained, never issued again
    of_0 = [(c, len(x["output_tokens"])) for x, c in zip(rows, consumed) if x["prompt_id"] == 0]
    assert of_0 == [(FAILED, 0)] * N, of_0
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["failed_groups"] for m in metrics) == 1
    # the discarded episode: its cause in the log, counted by its step, left out of the loss
    discarded = [x for x in trained if x["discard"]]
    assert [(x["prompt_id"], x["discard"]) for x in discarded] == [(1, "env")], discarded
    assert discarded[0]["tool_calls"][-1]["error"] == "timeout"
    assert sum(m["episode/discarded_env"] for m in metrics) == 1
    assert sum(m["filtered_seqs"] for m in metrics) >= 1
    # every trained episode: two model turns around the hint's observation (or fewer, cut or
    # ended early), observation tokens masked with version -1, the hint's tool record
    two = [x for x in trained if x["turn_is_sample"].tolist() == [1, 0, 1]]
    assert len(two) >= len(trained) // 2, [x["turn_is_sample"].tolist() for x in trained]
    for x in two:
        a, b = x["turn_ends"][:2]
        assert (x["loss_mask"][a:b] == 0).all() and (x["versions"][a:b] == -1).all()
        assert [c["name"] for c in x["tool_calls"]] == ["hint"]
    partial = [x for x, c in zip(rows, consumed) if c == PARTIAL]
    reasons = {x["finish_reason"] for x in partial}
    print(f"\n{len(partial)} partial rows at the preemption, finish reasons {sorted(reasons)}; "
          f"{len(two)} of {len(trained)} trained episodes with two model turns")
    assert reasons & {"abort", "abort_env"} and any(len(x["output_tokens"]) for x in partial)
    report = audit(run_dir)
    assert report.exit_code == 0, report.text()
    assert not jobs.leftovers(), "processes of the job are still running"
