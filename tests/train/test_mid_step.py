"""The mid-step judgement (areal_hpc/train/mid_step.py) on an injected clock: no process, no MPI."""
from areal_hpc.preemption import MID_STEP_MARGIN_S
from areal_hpc.train.mid_step import MidStepJudge


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_rest_of_the_step_against_the_time_left():
    asked = []

    def job_end(signal_at):
        asked.append(signal_at)
        return 1000.0, "SLURM_JOB_END_TIME"
    clock = Clock(900.0)
    judge = MidStepJudge(job_end, clock)
    judge.checkpoint_s, judge.last_publish_s = 20.0, 5.0
    # 2 of 4 minibatches in 20 s: the rest ~20 s + the 5 s update; 25 s more than that are left
    clock.now = 1000.0 - 20.0 - MID_STEP_MARGIN_S - 50.0
    assert judge.stop(3, 890.0, 2, 4, 20.0) is False and judge.why == ""
    clock.now = 1000.0 - 20.0 - MID_STEP_MARGIN_S - 10.0         # 10 s left, 25 s needed
    assert judge.stop(3, 890.0, 2, 4, 20.0) is True
    assert "the rest of the step needs ~25 s, but 10 s are left" in judge.why
    assert "SLURM_JOB_END_TIME" in judge.why
    assert asked == [890.0]                                      # the job's end asked once


def test_unknown_times_let_the_step_finish():
    judge = MidStepJudge(lambda at: (None, ""), Clock(0.0))
    assert judge.stop(0, 0.0, 3, 4, 30.0) is False               # the job's end unknown
    judge = MidStepJudge(lambda at: (10.0, "x"), Clock(9.0))
    assert judge.stop(0, 0.0, 0, 4, 0.0) is False                # no minibatch done, no last step
    judge.last_step_s = 100.0                                    # now known: 100 s needed, ~0 left
    assert judge.stop(0, 0.0, 0, 4, 0.0) is True
