"""Native tool calling: a model's own tool-call format, parsed by one of vLLM's tool parsers, and
the tool results rendered as the chat template's tool messages (docs/environments.md).

Qwen2.5 and Qwen3 call tools as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
with the tools declared in the system turn by the chat template, and read the results as tool
messages (Qwen's template puts them in a user turn, each in ``<tool_response>``). Nothing of that
format is written here: the first prompt is the tokenizer's ``apply_chat_template(tools=...)``
(data/prompts.py), a model turn goes through the parser ``env.tool_parser`` names (vLLM's
``ToolParserManager``: hermes, qwen3_xml, llama3_json, mistral, ...), after vLLM's reasoning
parser ``env.reasoning_parser`` when one is named (a call inside the reasoning is not a call,
as vLLM's server treats it), and the results are what the chat template renders after an
assistant message: its end, the tool messages, the next generation prompt.

Token in, token out: the observation appended after a model turn is exactly that rendered
suffix, tokenised once. A turn that ended at a special token the suffix begins with (Qwen's
``<|im_end|>`` as EOS or a stop id) has it already: it is not appended twice; a turn that ended
at a stop string (``</tool_call>``) gets it from the suffix.

A turn whose text opens a call (the parser's start tag) but has none that parses is malformed:
the model is answered with an error as the call's result, and it counts as a failed tool call.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from .base import EnvConfig, EnvConfigError, ToolCall, declared_tools, tool_names

# what stands for the model's turn when the chat template renders the messages after it
_TURN = "AREAL_MODEL_TURN_2f9c"
MAX_ARGS_CHARS = 1 << 16       # a call's arguments (JSON text) past this are refused unread


@dataclass
class ParsedTurn:
    """A model turn as the tool parser reads it: per call, in the turn's order, (name,
    arguments: a JSON object's text) to make, or the ToolCall record (with its error) of one
    that cannot be made (malformed, an unknown tool, arguments that are not a JSON object),
    answered to the model without a call. No call at all: the turn is the final answer."""
    order: list = field(default_factory=list)

    @property
    def calls(self) -> list[tuple[str, str]]:
        return [c for c in self.order if isinstance(c, tuple)]

    @property
    def failed(self) -> list[ToolCall]:
        return [c for c in self.order if isinstance(c, ToolCall)]

    @property
    def is_answer(self) -> bool:
        return not self.order


def _drop(record: logging.LogRecord) -> bool:
    return False


class ToolCalling:
    """The generator's side of native tool calling for one tokenizer and env section."""

    def __init__(self, tokenizer, cfg: EnvConfig, chat_template: str | None = None):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.tools = declared_tools(cfg)
        self.names = set(tool_names(self.tools))
        try:
            parser_cls = ToolParserManager.get_tool_parser(cfg.tool_parser)
        except KeyError:
            raise EnvConfigError(f"config key 'env.tool_parser': {cfg.tool_parser!r} is not one of "
                                 f"vLLM's tool parsers ({', '.join(sorted(ToolParserManager.list_registered()))})") from None
        self.request = ChatCompletionRequest(model="areal", messages=[{"role": "user", "content": ""}],
                                             tools=self.tools)
        self.parser = parser_cls(tokenizer, self.request.tools)
        # the parser logs a traceback for every call that does not parse: we count them instead.
        # A filter, not a level: vLLM's logging.config.dictConfig, run again when an engine
        # starts in this process, resets its child loggers' levels (seen: the job's log held
        # the hermes parser's tracebacks)
        quiet = logging.getLogger(parser_cls.__module__)
        if _drop not in quiet.filters:
            quiet.addFilter(_drop)
        self.opener = getattr(self.parser, "tool_call_start_token", None)
        self.reasoning = None
        if cfg.reasoning_parser:
            from vllm.reasoning import ReasoningParserManager
            try:
                cls = ReasoningParserManager.get_reasoning_parser(cfg.reasoning_parser)
            except KeyError:
                raise EnvConfigError(f"config key 'env.reasoning_parser': {cfg.reasoning_parser!r}"
                                     " is not one of vLLM's reasoning parsers") from None
            try:
                self.reasoning = cls(tokenizer)
            except (RuntimeError, ValueError) as exc:    # e.g. no <think> tokens in the vocabulary
                raise EnvConfigError(f"config key 'env.reasoning_parser': {exc}") from None

    # ---- a model turn ----

    def parse(self, text: str) -> ParsedTurn:
        content = text
        if self.reasoning is not None:
            _, content = self.reasoning.extract_reasoning(text, self.request)
            content = content or ""
        info = self.parser.extract_tool_calls(content, self.request)
        out = ParsedTurn()
        if not info.tools_called:
            if self.opener and self.opener in content:
                out.order.append(ToolCall("", content[content.index(self.opener):][:256], 0, 0.0,
                                           f"malformed tool call: no JSON object with a name and "
                                           f"arguments after {self.opener}"))
            return out
        for call in info.tool_calls:
            name, args = call.function.name, call.function.arguments
            why = None
            if name not in self.names:
                why = f"unknown tool {name!r} (the tools: {', '.join(sorted(self.names))})"
            elif len(args) > MAX_ARGS_CHARS:
                why = f"arguments over {MAX_ARGS_CHARS} characters"
            else:
                try:
                    if not isinstance(json.loads(args), dict):
                        why = "arguments are not a JSON object"
                except ValueError:
                    why = "arguments are not JSON"
            out.order.append((name, args) if why is None else
                             ToolCall(str(name)[:32], args[:256], 0, 0.0, why))
        return out

    # ---- the results ----

    def observation(self, results: list[str], last_token: int | None) -> list[int]:
        """The ids appended after a model turn whose calls gave `results` (one text each, in
        order): what the chat template renders after the assistant's message (its end, the tool
        messages, the next generation prompt), less a leading special token the turn already
        ended with (`last_token`)."""
        messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _TURN},
                    *({"role": "tool", "content": r} for r in results)]
        text = self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  chat_template=self.chat_template,
                                                  add_generation_prompt=True)
        at = text.rfind(_TURN)
        if at < 0:
            raise ValueError("the chat template does not render an assistant message's content "
                             "as it is: native tool calling cannot append its results")
        suffix = text[at + len(_TURN):]
        if last_token is not None and last_token in self.tokenizer.all_special_ids:
            ended = self.tokenizer.decode([last_token])
            if ended and suffix.startswith(ended):
                suffix = suffix[len(ended):]
        return self.tokenizer(suffix, add_special_tokens=False)["input_ids"]
