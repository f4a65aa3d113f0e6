"""The generator's message handling that needs no engine."""
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
