"""Random Qwen2 models and a Qwen-like tokenizer, for the tests, the benchmarks and the tiny model:
the one place that knows how the project builds a model it has not trained.

`random_qwen2` draws every weight from torch's global generator after `torch.manual_seed(seed)`,
so a model is the same for the same seed, shape and perturbation. Hugging Face's init leaves the
q/k/v biases at 0 and the RMSNorm weights at 1: a converter that put them in the wrong place
would not show, so a test of layouts asks for `bias_std` and `norm` to make them informative.
"""
from __future__ import annotations

from pathlib import Path

# The shape a test model has unless it says otherwise: 2 layers, grouped-query attention (4 query
# heads, 2 key/value heads), a vocabulary of 128.
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def random_qwen2(seed: int = 0, *, bias_std: float = 0.0, norm: tuple[float, float] | None = None,
                 **fields):
    """A Qwen2ForCausalLM of `SMALL`'s shape, any Qwen2Config field overridden by `fields`.
    After the init, with `bias_std` > 0 the biases are drawn N(0, bias_std²) and with
    `norm` = (mean, std) the norms' weights N(mean, std²)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**{**SMALL, **fields}))
    if bias_std > 0 or norm is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias") and bias_std > 0:
                    p.normal_(std=bias_std)
                elif "norm" in name and norm is not None:
                    p.normal_(mean=norm[0], std=norm[1])
    return model


def save_random_qwen2(path, seed: int = 0, **options) -> str:
    """`random_qwen2(seed, **options)` saved as a Hugging Face directory at `path`; returns the
    path."""
    random_qwen2(seed, **options).save_pretrained(path)
    return str(path)


# A chat template in Qwen2.5's tool-calling format (written here, not Qwen's text): the tools as
# JSON lines in <tools></tools> in the system turn, a call as <tool_call>{"name": ...,
# "arguments": {...}}</tool_call> in the assistant's turn, the results of consecutive tool
# messages in one user turn, each in <tool_response></tool_response>. `head` and `tail`: the
# system turn's text (template source) before <tools> and after </tools>: the tiny native model's
# have no prose (every character costs its pre-training).
# (One line: no whitespace of its own; a newline right after a tag is written as an
# expression: transformers renders templates with trim_blocks.)
def qwen_tools_template(head: str, tail: str) -> str:
    return (
        "{% set sys = messages[0].content if messages and messages[0].role == 'system' else '' %}"
        "{% if tools %}"
        "<|im_start|>system\n" + head + "<tools>"
        "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>"
        + tail + "<|im_end|>\n"
        "{% elif sys %}<|im_start|>system\n{{ sys }}<|im_end|>\n{% endif %}"
        "{% for m in messages %}"
        "{% if m.role == 'tool' %}"
        "{% if loop.first or loop.previtem.role != 'tool' %}<|im_start|>user{% endif %}"
        "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
        "{% if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>\n{% endif %}"
        "{% elif m.role != 'system' or not loop.first %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


QWEN_TOOLS_TEMPLATE = qwen_tools_template(
    "{{ sys if sys else 'You are a helpful assistant.' }}\n\n# Tools\n\nCall a tool with "
    "<tool_call></tool_call> holding a JSON object with its name and arguments. The tools:\n",
    '\n<tool_call>\n{"name": <tool name>, "arguments": <arguments as a JSON object>}\n</tool_call>')
# The tiny native model's (areal_hpc/tiny_native.py): the same format, no prose.
TERSE_TOOLS_TEMPLATE = qwen_tools_template("{{ sys ~ '\\n' if sys }}", "")
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
               "</think>")


def qwen_byte_tokenizer(path, eos: int, max_len: int, tools: bool = False,
                        template: str = QWEN_TOOLS_TEMPLATE, chat_eos: bool = False,
                        merges: list[tuple[str, str]] = ()):
    """A byte-level Qwen2Tokenizer saved at `path`: the 256 byte symbols at ids 0..255, then
    the tokens of `merges` (byte-level BPE merges, in rank order; none by default: one token per
    byte), reserved fillers up to `eos`, then <|endoftext|> (= eos and pad), <|im_start|> and
    <|im_end|>, as Qwen's own ids lie (transformers loads any model_type "qwen2" checkpoint's
    tokenizer as Qwen2Tokenizer, so it is built as one). `tools`: then also TOOL_TOKENS (added,
    not special, as Qwen's) and `template` as its chat template. `chat_eos`: <|im_end|> is its
    EOS (an instruct model's: a turn ends there), <|endoftext|> then only its pad. Returns the
    tokenizer."""
    from transformers import AddedToken, Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    if len(vocab) > eos:
        raise ValueError(f"{len(vocab)} byte and merged tokens do not fit below eos id {eos}")
    vocab |= {f"<|reserved_{i}|>": i for i in range(len(vocab), eos)}
    vocab |= {"<|endoftext|>": eos, "<|im_start|>": eos + 1, "<|im_end|>": eos + 2}
    if tools:
        vocab |= {t: eos + 3 + i for i, t in enumerate(TOOL_TOKENS)}
    tok = Qwen2Tokenizer(vocab=vocab, merges=list(merges), unk_token=None,
                         eos_token="<|im_end|>" if chat_eos else "<|endoftext|>",
                         pad_token="<|endoftext|>", model_max_length=max_len)
    if tools:
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
        tok.chat_template = template
    Path(path).mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(path)
    return tok


def random_seqs(lens: list[int], vocab: int, rng, low: int = 0) -> list[dict]:
    """Sequences of `lens` tokens each, token ids drawn by numpy Generator `rng` from [low, vocab),
    an eighth of each (at least 2 tokens) the prompt; rewards 0/1 alternating (one GRPO group):
    the packs the benchmarks and tools/gpu_check.py train on."""
    seqs = []
    for i, n in enumerate(lens):
        p = max(2, n // 8)
        seqs.append({"prompt_tokens": rng.integers(low, vocab, p), "output_tokens": rng.integers(low, vocab, n - p),
                     "reward": float(i % 2)})
    return seqs
