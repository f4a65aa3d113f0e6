"""Every message between the controller (trainer rank 0) and the generator ranks, typed.

One dataclass per MPI tag, used by both sides: the sender builds it and posts it with `post`
(which takes the tag from the class), the receiver matches on the class. A trajectory stays a
dict (`Trajectory`, the data contract's fields): the rollout log, the ledger, the trainer and
the replay tool all read it as one.

    controller → generator                 generator → controller
    Prompts          PROMPTS               Group            TRAJECTORIES
    WeightsNotice    WEIGHTS               Partial          PARTIAL
    EvalRequest      EVAL                  EvalResult       EVAL_RESULT
    Stop             STOP                  GeneratorStats   STATS
    ControllerBeat   CONTROLLER_HEARTBEAT  WeightsAck       WEIGHTS_ACK
    StaleBefore      STALE_BEFORE          Heartbeat        HEARTBEAT
    StepsDone        STEPS_DONE

docs/architecture.md#data-contract describes each field's meaning.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NotRequired, TypedDict

import numpy as np

from .mpi import Tag


class Trajectory(TypedDict):
    """One sample of a group, as the generator sends it and the rollout log stores it."""
    prompt_id: int
    sample_idx: int
    prompt_tokens: np.ndarray       # int32
    output_tokens: np.ndarray       # int32
    behav_logprobs: np.ndarray      # float32, one per output token
    versions: np.ndarray            # int32, the policy version of each output token
    reward: float                   # 0 for an unscored sample of a PARTIAL group
    finish_reason: str              # "stop", "length", or "abort" (cut by a preemption)
    generator_rank: int
    t_submit: float                 # time.time() seconds
    t_first_token: float
    t_end: float
    reward_error: str               # "" when scored normally
    reward_extra: dict              # a reward function's logged fields
    # a multi-turn episode's (env/episode.py; absent: a single-turn sample, all of it sampled)
    loss_mask: NotRequired[np.ndarray]      # uint8 per output token: 1 sampled, 0 observation
    turn_ends: NotRequired[np.ndarray]      # int64, each turn's end in the output tokens
    turn_is_sample: NotRequired[np.ndarray]  # uint8 per turn: 1 the model's, 0 an observation
    tool_calls: NotRequired[list]           # env.base.ToolCall records (or their dicts)
    discard: NotRequired[str]               # why an episode is not trained ("" or absent: it is)


@dataclass(frozen=True, slots=True)
class Continuation:
    """A sample of a preempted job, read back from its PARTIAL row: the generator goes on from
    its tokens (an unfinished one) or scores it again (a finished one)."""
    sample_idx: int
    output_tokens: np.ndarray
    behav_logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str
    t_submit: float
    t_first_token: float
    t_end: float
    # a multi-turn episode's, as the rollout log reads them back (a single-turn sample: one
    # turn, all ones, no tool calls; None / (): not given)
    loss_mask: np.ndarray | None = None
    turn_ends: np.ndarray | None = None
    turn_is_sample: np.ndarray | None = None
    tool_calls: tuple = ()
    prompt_tokens: np.ndarray | None = None     # an episode's own prompt (its environment's)


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt to generate a group of `n` samples for (training) or to evaluate."""
    prompt_id: int
    prompt_tokens: list[int]
    n: int
    reward_kind: str                # "math", "code" or "custom"
    reference: Any                  # the answer, or the code tests
    row: dict | None = None         # the whole dataset row, for reward functions of the user's
    continued: tuple[Continuation, ...] = ()    # a preempted job's samples of this prompt


# -- controller → generator ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Prompts:
    TAG: ClassVar[Tag] = Tag.PROMPTS
    prompts: list[Prompt]


@dataclass(frozen=True, slots=True)
class WeightsNotice:
    """Load `version`: over the weight group by `plan` (a broadcast follows), or from `path`.
    `generation`: join the weight group's generation first (it was re-formed, `regroup`)."""
    TAG: ClassVar[Tag] = Tag.WEIGHTS
    version: int
    plan: list | None = None
    path: str | None = None
    generation: int | None = None


@dataclass(frozen=True, slots=True)
class EvalRequest:
    """Run these held-out prompts to completion at the current version (each prompt's `n` is
    its sample count)."""
    TAG: ClassVar[Tag] = Tag.EVAL
    prompts: list[Prompt]


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop generating and exit; at a preemption, first send the in-flight groups (Partial)."""
    TAG: ClassVar[Tag] = Tag.STOP
    preempted: bool = False


@dataclass(frozen=True, slots=True)
class ControllerBeat:
    """The trainer is alive (at least every rollout.heartbeat_s)."""
    TAG: ClassVar[Tag] = Tag.CONTROLLER_HEARTBEAT
    version: int


@dataclass(frozen=True, slots=True)
class StaleBefore:
    """A training group with a token older than `version` can no longer be trained within η
    (the controller drops it on arrival): stop generating it and send it as far as it got."""
    TAG: ClassVar[Tag] = Tag.STALE_BEFORE
    version: int


@dataclass(frozen=True, slots=True)
class StepsDone:
    """The run's last batch is taken: no training group is needed any more (what follows: the
    last step, the final evaluation, saving the policy, STOP). The generator's time accounting
    ends here, so that none of that counts as its idle time."""
    TAG: ClassVar[Tag] = Tag.STEPS_DONE


# -- generator → controller ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Group:
    """One scored training group: its n trajectories."""
    TAG: ClassVar[Tag] = Tag.TRAJECTORIES
    trajectories: list[Trajectory]


@dataclass(frozen=True, slots=True)
class Partial:
    """At a preemption's Stop, before the stats: every training group still in flight, each
    with all its samples as far as they got (finish_reason "abort" for unfinished ones)."""
    TAG: ClassVar[Tag] = Tag.PARTIAL
    groups: list[list[Trajectory]]


@dataclass(frozen=True, slots=True)
class EvalResult:
    """Per evaluated prompt {"prompt_id", "rewards": [one per sample]}."""
    TAG: ClassVar[Tag] = Tag.EVAL_RESULT
    version: int
    results: list[dict]
    seconds: float


# The generator's buckets of its own loop work (GeneratorStats.seconds; older files hold only
# "other", or none).
LOOP_WORK = ("submit", "send", "other")


@dataclass(frozen=True, slots=True)
class GeneratorStats:
    """A generator's totals at its stop (generators.json holds one per generator: written and
    read by storage/run_dir.py), with the shares every report derives from them."""
    TAG: ClassVar[Tag] = Tag.STATS
    rank: int
    tokens: int
    seconds: dict[str, float]       # where its time went (busy, pause, eval, idle, ...)
    version: int
    reward: dict[str, int]          # the reward pool's calls, errors, timeouts
    stale_aborted: int = 0          # training groups stopped mid-generation as too stale
    engine_s: float = 0.0           # of the span, seconds its engine had training work: see
                                    # Generator._tick (overlaps the loop's buckets)
    engine_restarts: int = 0        # its vLLM engine restarted after a fault (engine_guard.py)

    def span_s(self) -> float:
        """From the first training prompt until the run's last batch is taken (every bucket),
        held-out evaluations set apart."""
        return sum(v for k, v in self.seconds.items() if k != "eval")

    def busy_share(self) -> float:
        """The loop's time inside the engine's step over the span."""
        total = self.span_s()
        return self.seconds["busy"] / total if total > 0 else 0.0

    def engine_share(self) -> float:
        """The share of the span in which the engine had training requests to generate, not
        paused for a weight update. The engine generates in its own process while the loop
        works, so this is the generation resource's busy share."""
        total = self.span_s()
        return min(1.0, self.engine_s / total) if total > 0 else 0.0

    def loop_work(self) -> float:
        """Seconds of the span spent in the generator's own loop (LOOP_WORK buckets)."""
        return sum(self.seconds.get(k, 0.0) for k in LOOP_WORK)

    def idle_s(self) -> float:
        """Seconds with nothing to generate, waiting for scores included."""
        return self.seconds.get("idle", 0.0) + self.seconds.get("idle_scoring", 0.0)


# What the controller hands the trainer instead of a batch when a generator's new engine waits
# for weights (`WeightsAck` "awaiting"): the trainer sends the version it holds again, over a
# re-formed weight group, and then waits for its batch again.
RESEND_WEIGHTS = "resend weights"


@dataclass(frozen=True, slots=True)
class WeightsAck:
    """"started" when a generator begins loading `version`, "loaded" once its engine runs it;
    "awaiting" when its engine holds no weights it may generate with (a new engine after a
    fault, or a broadcast that failed part-way) and waits for the group to be re-formed and
    `version` sent again."""
    TAG: ClassVar[Tag] = Tag.WEIGHTS_ACK
    version: int
    phase: str                      # "started" | "loaded" | "awaiting"
    paused_s: float = 0.0           # with "loaded": how long generation was paused


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """A generator's loop still turns (at least every rollout.heartbeat_s)."""
    TAG: ClassVar[Tag] = Tag.HEARTBEAT
    version: int
    running: int                    # requests in its engine
    tokens: int                     # generated so far
    engine_restarts: int = 0        # its vLLM engine's restarts after a fault, so far
    engine_down: bool = False       # sent as a faulted engine is replaced (until it is up)
    engine_fault: str = ""          # the cause of the newest restart


MESSAGES = (Prompts, WeightsNotice, EvalRequest, Stop, ControllerBeat, StaleBefore, StepsDone,
            Group, Partial, EvalResult, GeneratorStats, WeightsAck, Heartbeat)
_BY_TAG = {m.TAG: m for m in MESSAGES}


def post(chan, msg, dest: int) -> None:
    """Send `msg` (one of MESSAGES) to `dest` under its class's tag."""
    if type(msg) not in MESSAGES:
        raise TypeError(f"not a controller/generator message: {type(msg).__name__}")
    chan.send(msg, dest, msg.TAG)


def check(tag: Tag, msg) -> Any:
    """A received message, checked against its tag: a message of another class under a tag (a
    mismatched peer, or a stray sender on the communicator) is a TypeError naming both."""
    want = _BY_TAG.get(tag)
    if want is None or type(msg) is not want:
        raise TypeError(f"message under tag {Tag(tag).name} is a {type(msg).__name__}, "
                        f"expected {want.__name__ if want else 'nothing'}")
    return msg
