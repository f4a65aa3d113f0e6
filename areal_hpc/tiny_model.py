"""Make the tiny model: a character-level Qwen2 pre-trained briefly on the tiny task.

    python tools/make_tiny_model.py --out models/tiny [--seed 0] [--steps N] [--minutes M]
    python tools/make_tiny_model.py --out models/tiny_answer --format answer   # "...,Answer: 17"
    python -m areal_hpc.tiny_model --out models/tiny                           # the same

(The launchers build it this way, from any directory, when a config names models/tiny.)

Writes to --out, in Hugging Face format (vLLM and the Megatron converter both read it):
    config.json, generation_config.json, model.safetensors      the model (float32)
    tokenizer.json, tokenizer_config.json                       one token per character
    train.jsonl (2000 RL prompts), heldout.jsonl (200)           {"question", "answer"} rows
    pretrain_report.json                                         greedy and T=1 accuracy, timings

Pre-training leaves room for RL on purpose, the way an SFT model does: label smoothing (0.1, over
the used characters) keeps the sampling distribution broad, so the model is right far more often
greedily than when sampled at temperature 1, as RL samples. With the defaults (700 steps, one to
two minutes on one CPU thread) that is about 45% greedy and 10% at T=1 on the held-out set.
The held-out set is a fixed
sample of the same distribution, not unseen questions: with single-digit terms there are only 100
two-term questions, and pre-training sees nearly all of them.

Deterministic for a given seed and step count (bit-identical weights on the same machine and
thread count). --minutes only caps the wall time on a slow or busy machine; a run it stops
warns, since its result then depends on the machine's speed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import GenerationConfig, Qwen2ForCausalLM, Qwen2Tokenizer

from .data.tiny_task import FORMATS, alphabet, make_problems
from . import tiny_native
from .random_models import random_qwen2
from .reward.math import math_reward

PAD, EOS = "<pad>", "<eos>"
N_RL_PROMPTS, N_HELDOUT = 2000, 200
# Distinct data streams per --seed: pre-training, RL prompts and held-out never share a generator.
PRETRAIN_SEED, RL_SEED, HELDOUT_SEED = 1_000_000, 2_000_000, 3_000_000


def build_tokenizer(answer_format: str = "boxed") -> Qwen2Tokenizer:
    """One token per character of the tiny task's alphabet (`alphabet(answer_format)`), after two
    specials: <pad> 0, <eos> 1.

    Built as a Qwen2Tokenizer (a PreTrainedTokenizerFast: byte-level BPE, here with no merges)
    because transformers 5 loads any model_type "qwen2" checkpoint's tokenizer as that class,
    rebuilding its pipeline around the saved vocabulary: built any other way, the tokenizer.json
    on disk and what AutoTokenizer (and so vLLM) hands back would disagree. Byte-level maps the
    printable ASCII of the alphabet to itself, and a space to "Ġ" (the vocabulary holds that).
    There is no <unk>: characters outside the alphabet are dropped, as Qwen2's BPE does.
    """
    chars = ["\u0120" if c == " " else c for c in alphabet(answer_format)]
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, *chars])}
    return Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, pad_token=PAD, eos_token=EOS,
                          model_max_length=512)


def build_model(tokenizer: Qwen2Tokenizer, args) -> Qwen2ForCausalLM:
    return random_qwen2(
        args.seed,
        vocab_size=64 * math.ceil(len(tokenizer) / 64),  # the padding Megatron likes; rows unused
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=tokenizer.model_max_length,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def task_examples(problems: list[dict], tokenizer) -> list[tuple[list[int], list[int]]]:
    """``(ids, labels)`` of ``question + solution + <eos>``, loss on ``solution + <eos>`` only."""
    examples = []
    for p in problems:
        q, s = encode(tokenizer, p["question"]), encode(tokenizer, p["solution"])
        ids = q + s + [tokenizer.eos_token_id]
        examples.append((ids, [-100] * len(q) + ids[len(q):]))
    return examples


def make_batches(examples: list[tuple[list[int], list[int]]], tokenizer, batch_size: int, seed: int):
    """Padded ``(input_ids, labels)`` batches of `examples`, each ``[batch_size, max_len]``, in a
    fixed order. Batches group similar lengths (sort within chunks of 16 batches, then shuffle the
    batches) so the rare long problems don't pad every batch to their length.
    """
    batches = []
    chunk = 16 * batch_size
    for start in range(0, len(examples) - batch_size + 1, chunk):
        part = sorted(examples[start:start + chunk], key=lambda e: len(e[0]))
        for b in range(0, len(part) - batch_size + 1, batch_size):
            rows = part[b:b + batch_size]
            width = max(len(ids) for ids, _ in rows)
            input_ids = torch.full((batch_size, width), tokenizer.pad_token_id)
            labels = torch.full((batch_size, width), -100)
            for i, (ids, lab) in enumerate(rows):
                input_ids[i, :len(ids)] = torch.tensor(ids)
                labels[i, :len(lab)] = torch.tensor(lab)
            batches.append((input_ids, labels))
    order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(seed))
    return [batches[i] for i in order]


def smoothed_loss(logits, labels, smoothing: float, used_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy with label smoothing over the used vocabulary only.

    Smoothing keeps the pre-trained policy's sampling distribution broader than its mode: greedy
    decoding is right much more often than sampling at T=1, the gap an RL fine-tune closes first
    (as with an SFT model). Unused embedding rows get no mass, so sampling never emits them."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    target = labels[:, 1:]
    valid = target != -100
    nll = -logp.gather(-1, target.clamp(min=0)[..., None])[..., 0]
    spread = -logp[..., used_ids].mean(dim=-1)
    per_token = (1 - smoothing) * nll + smoothing * spread
    return per_token[valid].mean()


def pretrain(model, batches, steps: int, lr: float, max_seconds: float, smoothing: float,
             used_ids: torch.Tensor) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * s / steps))))
    model.train()
    t0, losses, done = time.perf_counter(), [], 0
    bar = tqdm(range(steps), desc="pretrain", unit="step", mininterval=5)
    for step in bar:
        input_ids, labels = batches[step % len(batches)]
        # Right padding only: causal attention keeps real tokens from seeing the pads after them.
        loss = smoothed_loss(model(input_ids=input_ids).logits, labels, smoothing, used_ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        done = step + 1
        if step % 10 == 0:
            bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
        if time.perf_counter() - t0 > max_seconds:
            print(f"WARNING: stopped at step {done}/{steps} by --minutes; the result depends on "
                  "this machine's speed", file=sys.stderr)
            break
    bar.close()
    model.eval()
    return {"steps": done, "seconds": round(time.perf_counter() - t0, 1),
            "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4)}


@torch.no_grad()
def evaluate(model, tokenizer, problems: list[dict], samples: int, seed: int,
             extractor: str = "boxed") -> dict:
    """Mean reward on ``problems``: greedy if ``samples`` is 0, else that many completions per
    problem sampled at temperature 1 with no top-k/top-p, as RL samples."""
    tokenizer.padding_side = "left"  # batched generation continues each prompt from its end
    enc = tokenizer([p["question"] for p in problems], add_special_tokens=False,
                    padding=True, return_tensors="pt")
    tokenizer.padding_side = "right"
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": None, "top_p": None,
                "num_return_sequences": samples} if samples else {"do_sample": False}
    torch.manual_seed(seed)
    max_new = max(len(p["solution"]) for p in problems) + 16  # room for the model to go wrong
    out = model.generate(**enc, **sampling, max_new_tokens=max_new,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    per_problem = max(samples, 1)  # generate returns a problem's samples next to each other
    by_k = defaultdict(list)
    for i, text in enumerate(texts):
        p = problems[i // per_problem]
        by_k[p["question"].count("+") + 1].append(math_reward(text, p["answer"], extractor))
    rewards = [r for rs in by_k.values() for r in rs]
    return {"accuracy": round(sum(rewards) / len(rewards), 4), "completions": len(rewards),
            "by_terms": {k: round(sum(rs) / len(rs), 3) for k, rs in sorted(by_k.items())},
            "examples": [{"question": problems[i // per_problem]["question"],
                          "completion": texts[i]} for i in range(0, 3 * per_problem, per_problem)]}


def write_jsonl(path: Path, problems: list[dict]) -> None:
    with open(path, "w") as f:
        for p in problems:
            f.write(json.dumps({"question": p["question"], "answer": p["answer"]}) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="make_tiny_model.py", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, help="pre-training steps (700; native: 1500)")
    ap.add_argument("--minutes", type=float, help="cap on pre-training wall time (3; native: 8)")
    ap.add_argument("--batch-size", type=int, help="64; native: 16 (its examples are longer)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--label-smoothing", type=float,
                    help="0.1; native: 0 (with it the JSON of most sampled calls came out broken)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    # One thread: on a shared 2-core machine two OpenMP threads ran 10x slower than one whenever
    # another job held a core (1.46 vs 0.14 s/step); on an idle machine two are only 1.7x faster.
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-samples", type=int, default=4, help="T=1 samples per held-out problem")
    ap.add_argument("--format", choices=(*FORMATS, "native"), default="boxed",
                    help='how solutions end: "\\boxed{17}" or "Answer: 17"; "tool": boxed, with a '
                         'calculator call ("[3+5]8,") in 40%% of them; "native": chat turns, a '
                         'calculator call in Qwen2.5\'s format in 60%% of them (tiny_native.py)')
    ap.add_argument("--eval-limit", type=int, default=N_HELDOUT,
                    help="held-out problems the report evaluates")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)

    native = args.format == "native"
    for key, plain, with_tools in (("steps", 700, 1500), ("batch_size", 64, 16),
                                   ("label_smoothing", 0.1, 0.0), ("minutes", 3.0, 8.0)):
        if getattr(args, key) is None:
            setattr(args, key, with_tools if native else plain)
    fmt = {"answer_format": "boxed" if native else args.format}
    heldout = make_problems(N_HELDOUT, HELDOUT_SEED + args.seed, **fmt)
    rl_prompts = make_problems(N_RL_PROMPTS, RL_SEED + args.seed, **fmt)
    pretrain_data = make_problems(args.steps * args.batch_size, PRETRAIN_SEED + args.seed, **fmt)
    extractor = "answer" if args.format == "answer" else "boxed"

    tokenizer = (tiny_native.build_tokenizer(args.out, pretrain_data, PRETRAIN_SEED + args.seed)
                 if native else build_tokenizer(args.format))
    model = build_model(tokenizer, args)
    examples = (tiny_native.examples(tokenizer, pretrain_data, PRETRAIN_SEED + args.seed) if native
                else task_examples(pretrain_data, tokenizer))
    batches = make_batches(examples, tokenizer, args.batch_size, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M params, vocab {len(tokenizer)} "
          f"(embedding rows {model.config.vocab_size})")

    # smoothing spreads over what the model writes (native: its turns' ids, not every byte)
    used = ({i for _, labels in examples for i in labels if i >= 0} if native
            else set(range(len(tokenizer))) - {tokenizer.pad_token_id})
    used_ids = torch.tensor(sorted(used))
    train_stats = pretrain(model, batches, args.steps, args.lr, 60 * args.minutes,
                           args.label_smoothing, used_ids)
    shown = heldout[:args.eval_limit]
    if native:
        greedy = tiny_native.evaluate(model, tokenizer, shown, samples=0, seed=args.seed)
        sampled = tiny_native.evaluate(model, tokenizer, shown, samples=args.eval_samples,
                                       seed=args.seed)
    else:
        greedy = evaluate(model, tokenizer, shown, samples=0, seed=args.seed, extractor=extractor)
        sampled = evaluate(model, tokenizer, shown, samples=args.eval_samples, seed=args.seed,
                           extractor=extractor)
    print(f"held-out accuracy: greedy {greedy['accuracy']:.3f}, "
          f"T=1 {sampled['accuracy']:.3f} ({args.eval_samples} samples per problem)")
    if native:
        print(f"  first turns calling the calculator: greedy {greedy['call_rate']:.3f}, T=1 "
              f"{sampled['call_rate']:.3f}; well-formed at T=1: {sampled['calls_well_formed']}")
    else:
        print(f"  T=1 by number of terms: {sampled['by_terms']}")

    model.save_pretrained(args.out, safe_serialization=True)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     bos_token_id=None).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    write_jsonl(args.out / "train.jsonl", rl_prompts)
    write_jsonl(args.out / "heldout.jsonl", heldout)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "params": n_params,
              **train_stats, "greedy": greedy, "sampled_t1": sampled}
    (args.out / "pretrain_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
