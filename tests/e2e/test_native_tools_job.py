"""Native tool calling end to end on the real stack (mpiexec, vLLM, Megatron, HDF5): the job of
examples/calculator/native.yaml through the launcher tools/run_local.sh runs, on a tiny model whose
byte-level BPE tokenizer carries a chat template in Qwen2.5's format and which was pre-trained
(tools/make_tiny_model.py --format native, briefly) to call the calculator in Qwen's own
`<tool_call>` JSON. The model's calls are its own, sampled: vLLM's hermes parser reads them, the
built-in calculator answers them in its own process, the results come back as the template's
tool messages (masked, version -1), the model's next turn follows; the audit is clean."""
import json
from pathlib import Path

from transformers import AutoTokenizer

from areal_hpc.audit import audit
from areal_hpc.env.calculator import evaluate, show
from areal_hpc.storage.rollout_log import RolloutReader
from tests.conftest import built_once

STEPS, B, N = 2, 2, 4


def _model(tmp_path_factory, jobs) -> Path:
    def build(folder: Path) -> str:
        out = folder / "tiny_native"
        r = jobs.run(["tools/make_tiny_model.py", "--out", str(out), "--format", "native",
                      "--steps", "300", "--eval-limit", "8", "--eval-samples", "1"], timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        return str(out)
    return Path(built_once(tmp_path_factory, "tiny_native_model", build))


def test_a_tiny_model_calls_the_calculator_in_qwens_format_end_to_end(jobs, tmp_path_factory,
                                                                        tmp_path):
    model = _model(tmp_path_factory, jobs)
    r = jobs.run(["-m", "areal_hpc.launch.local", "examples/calculator/native.yaml",
                  f"model.path={model}", f"data.train_path={model}/train.jsonl",
                  f"data.eval_path={model}/heldout.jsonl", f"output_dir={tmp_path}", "name=native",
                  f"train.total_steps={STEPS}", f"train.batch_prompts={B}",
                  f"rollout.group_size={N}", "data.eval_limit=4", "data.eval_samples=1",
                  "tensorboard=false", "checkpoint.every_steps=0"], timeout=900)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-6000:])
    run_dir = tmp_path / "native"
    tok = AutoTokenizer.from_pretrained(model)
    with RolloutReader(run_dir / "rollouts.h5") as log:
        rows = [log[i] for i in range(len(log))]
        consumed = log.column("consumed_step")
    trained = [x for x, c in zip(rows, consumed) if c >= 0]
    assert len(trained) == STEPS * B * N
    # the first prompt declares the tool through the chat template, in the system turn
    prompt = tok.decode(trained[0]["prompt_tokens"])
    assert prompt.startswith("<|im_start|>system\n<tools>\n") and '"name": "calculator"' in prompt

    answered = []
    for x in trained:
        calls = [c for c in x["tool_calls"] if c["error"] is None]
        if not calls:
            continue
        a, b = x["turn_ends"][:2]
        out = x["output_tokens"]
        first, obs = tok.decode(out[:a]), tok.decode(out[a:b])
        assert first.startswith("<tool_call>") and first.endswith("</tool_call><|im_end|>"), first
        assert x["turn_is_sample"].tolist()[:3] == [1, 0, 1]
        # the model's own call, made by the calculator; its result as the template's tool message
        expression = json.loads(calls[0]["args"])["expression"]
        assert calls[0]["name"] == "calculator"
        assert obs == ("\n<|im_start|>user\n<tool_response>\n" + show(evaluate(expression)) +
                       "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"), obs
        assert (x["loss_mask"][a:b] == 0).all() and (x["versions"][a:b] == -1).all()
        assert (x["loss_mask"][:a] == 1).all() and (x["versions"][:a] >= 0).all()
        answered.append(x)
    assert answered, [tok.decode(x["output_tokens"]) for x in trained]
    print(f"\n{len(answered)} of {len(trained)} trained episodes made a call the calculator answered")
    report = audit(run_dir)
    assert report.exit_code == 0, report.text()
    assert not jobs.leftovers(), "processes of the job are still running"
