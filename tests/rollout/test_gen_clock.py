"""A generator's time accounting (rollout/gen_clock.py), on an injected clock."""
from areal_hpc.rollout.gen_clock import GenClock


def _clock(t0=100.0):
    now = [t0]
    return GenClock(now=lambda: now[0]), now


def test_time_accounting_ends_with_the_training_steps():
    """STEPS_DONE (the run's last batch is taken) closes the span of generators.json's
    `seconds`: the last step, the final evaluation and the trainer saving the policy, which
    follow, are not counted as the generator's idle time."""
    clock, now = _clock()
    clock.count("busy", 5.0)                # before the first training prompt: not counted
    clock.start()
    now[0] += 10.0                          # 10 s since the first prompt
    clock.count("busy", 7.0)
    clock.count("pause", 0.5)
    clock.end()
    span = sum(clock.seconds.values())
    assert span == 10.0 and clock.seconds["other"] == 2.5
    clock.count("idle", 60.0)               # a long save of the policy after the steps
    with clock.timed("busy"):
        now[0] += 3.0
    clock.end()                             # again at the stop: the span stays closed
    clock.start()                           # and a late prompt does not reopen it
    assert sum(clock.seconds.values()) == span and clock.seconds["idle"] == 0.0


def test_timed_work_goes_to_its_bucket():
    clock, now = _clock()
    clock.start()
    with clock.timed("submit"):
        now[0] += 0.25
    with clock.timed("eval"):
        now[0] += 2.0
    now[0] += 1.0                           # the loop's messages: "other" at the end
    clock.end()
    assert clock.seconds["submit"] == 0.25 and clock.seconds["eval"] == 2.0
    assert clock.seconds["other"] == 1.0


def test_engine_occupancy_counts_work_in_flight_not_weight_loads_or_the_time_after_the_span():
    """`engine_s` counts the time the engine had training requests, whatever the loop did
    meanwhile (vLLM's EngineCore generates in its own process), and not the time it had none,
    a weight load's pause (a tick with count=False), or anything after the span's end."""
    clock, now = _clock()
    clock.start()
    busy = [False]

    def after(seconds, unfinished=None, count=True):
        now[0] += seconds
        if unfinished is not None:
            busy[0] = unfinished
        clock.tick(busy[0], count)

    after(0.0)
    after(1.0, unfinished=True)         # idle 1 s, then prompts submitted
    after(2.0)                          # the loop sent scores for 2 s: the engine generated
    after(0.5, count=False)             # a weight load paused it 0.5 s
    after(1.0, unfinished=False)        # its last request came back from a step
    after(3.0)                          # idle, waiting for the η budget
    assert clock.engine_s == 3.0
    after(0.0, unfinished=True)
    clock.end()                         # the run's last batch was taken
    after(5.0)
    assert clock.engine_s == 3.0
