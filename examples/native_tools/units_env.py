"""A tool environment in a model's own tool-call format (native tool calling: docs/environments.md).

The model sees the tools declared by its chat template, calls them as it was trained to (Qwen2.5:
<tool_call>{"name": "convert", "arguments": {...}}</tool_call>), vLLM's parser named by
env.tool_parser reads the calls, `call` answers each one here, and the results come back as the
template's tool messages. A turn without a call is the final answer, scored by `step`.

The rows: {"question": "How many metres are 3 miles?", "answer": "4828.03"} (the reward: the
answer within 0.5%). The tools' JSON schemas are in config.yaml (env.tools).
"""
import math
import re

from areal_hpc.env.base import Environment, Step

# metres per unit
LENGTH = {"m": 1.0, "km": 1000.0, "cm": 0.01, "mm": 0.001, "mile": 1609.344, "yard": 0.9144,
          "foot": 0.3048, "inch": 0.0254}


class Units(Environment):
    def __init__(self, tolerance: float = 0.005):
        self.tolerance = tolerance

    def reset(self, row: dict) -> str:
        self.answer = float(row["answer"])
        return row["question"]

    def call(self, name: str, arguments: dict) -> str:
        """One tool call: its result as text. A bad argument raises: the model reads the error
        as the call's result (its own mistake), the episode goes on."""
        if name == "convert":
            value, src, dst = arguments["value"], arguments["from"], arguments["to"]
            if src not in LENGTH or dst not in LENGTH:
                raise ValueError(f"unknown unit (known: {', '.join(LENGTH)})")
            return f"{float(value) * LENGTH[src] / LENGTH[dst]:.6g}"
        if name == "multiply":
            return f"{math.prod(float(x) for x in arguments['factors']):.6g}"
        raise ValueError(f"no tool {name!r}")

    def step(self, turn_text: str, turn_ids: list[int]) -> Step:
        """A turn without a call: the final answer (the last number in it)."""
        numbers = re.findall(r"-?\d+(?:\.\d+)?", turn_text.replace(",", ""))
        ok = bool(numbers) and abs(float(numbers[-1]) - self.answer) <= self.tolerance * abs(self.answer)
        return Step(done=True, reward=float(ok))
