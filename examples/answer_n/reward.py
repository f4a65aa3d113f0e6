"""The example's reward function: the tiny task's solutions end "Answer: N" (not \\boxed{N}).

Named in config.yaml as `reward.fn: examples/answer_n/reward.py:answer_n`; it runs in the
generators' reward processes, once per sample. It returns the reward and two fields that
TensorBoard and metrics.jsonl show per step as reward/format and reward/steps.
"""
import re

_FINAL = re.compile(r"Answer:\s*(-?\d+)\s*$")


def answer_n(completion: str, reference, row: dict) -> dict:
    """1.0 when the completion ends "Answer: N" with N the row's answer, else 0.0."""
    found = _FINAL.search(completion)
    return {"reward": float(found is not None and found.group(1) == str(reference).strip()),
            "format": float(found is not None),             # ended with an answer at all
            "steps": float(completion.count(","))}          # partial sums written
