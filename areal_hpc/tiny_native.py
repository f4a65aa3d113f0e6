"""The tiny task in Qwen2.5's native tool-calling format: what `tools/make_tiny_model.py --format
native` pre-trains, so that a job on the CPU runs native tool calling end to end with a model that
calls its tool by itself (examples/calculator/native.yaml).

The tokenizer is byte-level BPE with Qwen's chat and tool tokens (random_models.qwen_byte_tokenizer:
<|im_start|>, <|im_end|> as its EOS, <tool_call>, </tool_call>, <tool_response>, ...), with
MERGES merges learnt from the pre-training conversations by the tokenizers library's BPE trainer
under Qwen2's own pre-tokenizer (digits stay one per token, as Qwen2's; the JSON and the
declared tool's words become a few tokens each: a conversation of ~600 bytes is ~160 tokens, the
fixed text of a call ~12 tokens to learn instead of ~50), and a chat
template in Qwen2.5's format without prose (random_models.TERSE_TOOLS_TEMPLATE): the tools
declared in <tools></tools> in the system turn, the results in <tool_response> in a user turn.
A conversation is the calculator's declared tool (env/base.py BUILTIN_TOOLS, what
``env.fn=calculator`` declares), the question as the user's turn, then either

    <tool_call>\\n{"name": "calculator", "arguments": {"expression": "3+5+9"}}\\n</tool_call><|im_end|>
    \\n<|im_start|>user\\n<tool_response>\\n17\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n
    \\boxed{17}<|im_end|>

(a call in TOOL_SHARE of the problems; the observation is what the chat template renders after
the call, as the generator appends it), or the written solution of the tiny task and <|im_end|>.
Loss on the model's turns only. The job parses the calls with vLLM's hermes parser; the
pre-training report (`evaluate`) reads them with a regular expression.
"""
from __future__ import annotations

import json
import random
import re

import torch

from .env.base import BUILTIN_TOOLS
from .env.calculator import evaluate as calculate, show
from .random_models import TERSE_TOOLS_TEMPLATE, qwen_byte_tokenizer
from .reward.math import math_reward

MERGES = 200                 # <|endoftext|> (the pad) at 256 + MERGES, then <|im_start|>, <|im_end|>
MAX_LEN = 1024
TOOL_SHARE = 0.6             # of the pre-training problems solved with a call
TOOLS = BUILTIN_TOOLS["calculator"]
CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'
_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


_SPECIAL = re.compile(r"<\|im_start\|>|<\|im_end\|>|<\|endoftext\|>|</?tool_call>|</?tool_response>")


def build_tokenizer(path, problems: list[dict], seed: int):
    """The tokenizer, saved at `path`: byte-level, then with MERGES merges learnt from the
    conversations of `problems` (the special tokens' text left out)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    plain = qwen_byte_tokenizer(path, eos=256, max_len=MAX_LEN, tools=True,
                                template=TERSE_TOOLS_TEMPLATE, chat_eos=True)
    texts = [piece for parts in _conversations(plain, problems, seed)
             for piece in _SPECIAL.split("".join(text for text, _ in parts)) if piece]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = plain.backend_tokenizer.pre_tokenizer      # Qwen2's split, byte-level
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=256 + MERGES, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(bpe.to_str())["model"]["merges"]]
    qwen_byte_tokenizer(path, eos=256 + MERGES, max_len=MAX_LEN, tools=True,
                        template=TERSE_TOOLS_TEMPLATE, chat_eos=True, merges=merges)
    return AutoTokenizer.from_pretrained(path)      # as the job's ranks and vLLM load it


def prompt_text(tok, question: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": question}], tools=TOOLS,
                                   add_generation_prompt=True, tokenize=False)


def observation(tok, question: str, turn: str, result: str) -> str:
    """What follows a model turn `turn` (ended at <|im_end|>) whose call answered `result`: the
    chat template's tool message and next generation prompt, without the <|im_end|> the turn
    ended at (as env/tool_calls.py appends it)."""
    messages = [{"role": "user", "content": question},
                {"role": "assistant", "content": turn.removesuffix("<|im_end|>")},
                {"role": "tool", "content": result}]
    full = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                   tokenize=False)
    head = prompt_text(tok, question) + turn
    if not full.startswith(head):
        raise ValueError("the chat template does not render a conversation as its prompt, the "
                         "turn and the tool message")
    return full[len(head):]


def _parts(tok, problem: dict, call: bool) -> list[tuple[str, bool]]:
    """One pre-training conversation as (text, trained) pieces: the model's turns trained."""
    q, answer = problem["question"], problem["answer"]
    if not call:
        return [(prompt_text(tok, q), False), (problem["solution"] + "<|im_end|>", True)]
    turn = CALL.format(q.rstrip("=")) + "<|im_end|>"
    return [(prompt_text(tok, q), False), (turn, True),
            (observation(tok, q, turn, answer), False), (f"\\boxed{{{answer}}}<|im_end|>", True)]


def _conversations(tok, problems: list[dict], seed: int):
    rng = random.Random(seed)           # which problems call the tool: the same for a seed
    return (_parts(tok, p, rng.random() < TOOL_SHARE) for p in problems)


def _tokens(tok, parts: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    ids, labels = [], []
    for text, trained in parts:
        part = tok(text, add_special_tokens=False)["input_ids"]
        ids += part
        labels += part if trained else [-100] * len(part)
    return ids, labels


def example(tok, problem: dict, call: bool) -> tuple[list[int], list[int]]:
    """(input ids, labels: -100 outside the model's turns) of one pre-training conversation."""
    return _tokens(tok, _parts(tok, problem, call))


def examples(tok, problems: list[dict], seed: int) -> list[tuple[list[int], list[int]]]:
    return [_tokens(tok, parts) for parts in _conversations(tok, problems, seed)]


def answer_call(text: str) -> str | None:
    """The calculator's answer to the first call in a model turn's text (an error as the
    calculator answers one), or None when the turn holds no call."""
    m = _CALL_RE.search(text)
    if m is None:
        return None if "<tool_call>" not in text else "error: malformed call"
    try:
        call = json.loads(m.group(1))
        if call.get("name") != "calculator":
            return f"error: unknown tool {call.get('name')!r}"
        return show(calculate(str(call["arguments"]["expression"])))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"error: {exc}"


def _generate(model, tok, contexts: list[list[int]], samples: int, max_new: int) -> list[list[int]]:
    width = max(len(c) for c in contexts)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(c)) + c for c in contexts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(c) for c in contexts])[:, None])
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": None, "top_p": None,
                "num_return_sequences": samples} if samples else {"do_sample": False}
    out = model.generate(input_ids=ids, attention_mask=mask.long(), **sampling,
                         max_new_tokens=max_new, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)[:, width:]
    turns = []
    for row in out.tolist():
        end = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
        turns.append(row[:end])
    return turns


@torch.no_grad()
def evaluate(model, tok, problems: list[dict], samples: int, seed: int) -> dict:
    """Mean reward on `problems` over whole episodes (a call answered, then the model's next
    turn), greedy if `samples` is 0, else that many sampled at temperature 1; and the share of
    first turns that call the tool, and of those calls the share that parse and evaluate."""
    torch.manual_seed(seed)
    n = max(samples, 1)
    prompts = [tok(prompt_text(tok, p["question"]), add_special_tokens=False)["input_ids"]
               for p in problems]
    firsts = _generate(model, tok, prompts, samples, max_new=128)
    rewards, calls, good, seconds, examples_ = [], 0, 0, [], []
    for i, turn in enumerate(firsts):
        p = problems[i // n]
        text = tok.decode(turn, skip_special_tokens=False)
        result = answer_call(text)
        if result is None:
            rewards.append(math_reward(text, p["answer"], "boxed"))
            continue
        calls += 1
        good += not result.startswith("error:")
        obs = tok(observation(tok, p["question"], text, result), add_special_tokens=False)["input_ids"]
        seconds.append((i, prompts[i // n] + turn + obs))
        rewards.append(0.0)
    if seconds:
        ends = _generate(model, tok, [c for _, c in seconds], 1 if samples else 0, max_new=32)
        for (i, _), turn in zip(seconds, ends):
            rewards[i] = math_reward(tok.decode(turn, skip_special_tokens=True),
                                     problems[i // n]["answer"], "boxed")
    for i in range(0, min(3 * n, len(firsts)), n):
        examples_.append({"question": problems[i // n]["question"],
                          "first_turn": tok.decode(firsts[i], skip_special_tokens=False)})
    return {"accuracy": round(sum(rewards) / len(rewards), 4), "completions": len(rewards),
            "call_rate": round(calls / len(firsts), 3),
            "calls_well_formed": round(good / calls, 3) if calls else None,
            "examples": examples_}
