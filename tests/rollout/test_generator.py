"""The generator's message handling that needs no engine."""
from areal_hpc.config import RunConfig
from areal_hpc.rollout.gen_clock import GenClock
from areal_hpc.rollout.generator import Generator
from areal_hpc.transport import messages as msgs

RANK1 = type("Topo", (), {"rank": 1})()


class _DeadEngine:
    def __getattr__(self, name):
        raise AssertionError(f"the lost engine was used: {name}")


def test_prompts_after_the_engine_was_lost_are_left_in_flight():
    """A preemption's TERM took the vLLM engine: prompts that arrive before the controller's STOP
    are not submitted to it (that raised EngineDeadError and failed the job instead of letting it
    checkpoint); they stay in flight in the controller's books and are issued again on resume."""
    gen = Generator(RunConfig(), RANK1, engine=_DeadEngine())
    gen._engine_lost = True
    prompt = msgs.Prompt(7, [1, 2, 3], 2, "math", "6")
    assert gen._handle(msgs.Prompts([prompt])) is True
    assert gen._handle(msgs.StaleBefore(3)) is True
    assert gen.groups == {}


def test_steps_done_closes_the_time_accounting():
    """STEPS_DONE (the run's last batch is taken) ends the span of generators.json's `seconds`
    (the rules: test_gen_clock.py)."""
    now = [100.0]
    gen = Generator(RunConfig(), RANK1, clock=GenClock(now=lambda: now[0]))
    gen.clock.start()
    now[0] += 10.0
    assert gen._handle(msgs.StepsDone()) is True
    assert gen.clock.t_ended == 110.0 and gen.clock.seconds["other"] == 10.0


def test_a_lost_engine_has_no_work_whatever_its_books_say():
    now = [0.0]
    gen = Generator(RunConfig(), RANK1, engine=_DeadEngine(), clock=GenClock(now=lambda: now[0]))
    gen._engine_lost = True
    gen.clock.start()
    gen._tick()                             # the dead engine is not asked
    now[0] += 5.0
    gen._tick()
    assert gen.clock.engine_s == 0.0
