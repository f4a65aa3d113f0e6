"""The generator's message handling that needs no engine."""
import time

from areal_hpc.rollout.generator import Generator
from areal_hpc.transport import messages as msgs


class _DeadEngine:
    def __getattr__(self, name):
        raise AssertionError(f"the lost engine was used: {name}")


def test_prompts_after_the_engine_was_lost_are_left_in_flight():
    """A preemption's TERM took the vLLM engine: prompts that arrive before the controller's STOP
    are not submitted to it (that raised EngineDeadError and failed the job instead of letting it
    checkpoint); they stay in flight in the controller's books and are issued again on resume."""
    gen = Generator.__new__(Generator)
    gen.engine, gen.groups, gen._engine_lost, gen._started = _DeadEngine(), {}, True, True
    gen.topo = type("Topo", (), {"rank": 1})()
    prompt = msgs.Prompt(7, [1, 2, 3], 2, "math", "6")
    assert gen._handle(msgs.Prompts([prompt])) is True
    assert gen._handle(msgs.StaleBefore(3)) is True
    assert gen.groups == {}


def test_time_accounting_ends_with_the_training_steps():
    """STEPS_DONE (the run's last batch is taken) closes the span of generators.json's
    `seconds`: the last step, the final evaluation and the trainer saving the policy, which
    follow, are not counted as the generator's idle time."""
    gen = Generator.__new__(Generator)
    gen.seconds = dict.fromkeys(("busy", "pause", "eval", "idle", "idle_scoring", "submit",
                                 "send", "other"), 0.0)
    gen._started, gen._t_ended = True, None
    gen._t_started = time.monotonic() - 10.0     # 10 s since the first prompt
    gen._count("busy", 7.0)
    gen._count("pause", 0.5)
    assert gen._handle(msgs.StepsDone()) is True
    span = sum(gen.seconds.values())
    assert 10.0 <= span < 10.5 and gen.seconds["other"] >= 2.5
    gen._count("idle", 60.0)                # a long save of the policy after the steps
    with gen._timed("busy"):
        pass
    gen._end_span()                         # again at the stop: the span stays closed
    assert sum(gen.seconds.values()) == span and gen.seconds["idle"] == 0.0


class _Engine:
    unfinished = False

    def has_unfinished(self):
        return self.unfinished


def test_engine_occupancy_counts_work_in_flight_not_weight_loads_or_the_time_after_the_span(
        monkeypatch):
    """`engine_s` counts the time the engine had training requests, whatever the loop did
    meanwhile (vLLM's EngineCore generates in its own process), and not the time it had none,
    a weight load's pause (a tick with count=False), or anything after the span's end."""
    from areal_hpc.rollout import generator as mod
    now = [100.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: now[0])
    gen = Generator.__new__(Generator)
    gen.engine, gen._engine_lost = _Engine(), False
    gen.engine_s, gen._occupied_since = 0.0, None
    gen._started, gen._t_ended = True, None

    def after(seconds, unfinished=None, count=True):
        now[0] += seconds
        if unfinished is not None:
            gen.engine.unfinished = unfinished
        gen._tick(count)

    after(0.0)
    after(1.0, unfinished=True)         # idle 1 s, then prompts submitted
    after(2.0)                          # the loop sent scores for 2 s: the engine generated
    after(0.5, count=False)             # a weight load paused it 0.5 s
    after(1.0, unfinished=False)        # its last request came back from a step
    after(3.0)                          # idle, waiting for the η budget
    assert gen.engine_s == 3.0
    after(0.0, unfinished=True)
    gen._t_ended = now[0]               # the run's last batch was taken
    after(5.0)
    assert gen.engine_s == 3.0
    gen._engine_lost = True             # a lost engine has no work, whatever its books say
    after(0.0)
    gen._t_ended = None
    after(1.0)
    assert gen.engine_s == 3.0
