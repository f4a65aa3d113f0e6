"""A generator rank's vLLM engine: streaming samples with per-token versions, interruptible.

`VLLMEngine` wraps vLLM v1's synchronous `LLMEngine` in its default multiprocess mode: the
EngineCore (scheduler + model workers) runs in child processes and keeps generating while the
generator rank's loop does other work between `step()` calls (MPI, rewards, bookkeeping).

Weight updates follow AReaL's interruptible generation (AReaL paper, arXiv 2505.24298, §4;
docs/architecture.md#weight-transports):
abort every in-flight request, keeping the tokens, behaviour logprobs and versions seen so far;
load the new weights; reset the prefix cache (mandatory: cached KV blocks of the old weights
would otherwise be reused silently); then resubmit each interrupted request as
prompt + partial output with the remaining token budget. Its KV cache is recomputed with the
new weights, and its later tokens carry the new version. A finished sample therefore holds
`versions = [v0, ..., v0, v1, ..., v1]`, one entry per output token.

A group of n samples of one prompt is one vLLM request with `n` samples (`submit_group`): the
prompt is validated and rendered once instead of n times, a third of the submission cost per
sample on the tiny model (BENCHMARKS.md, generator loop work). vLLM fans it out into n child
sequences that finish independently; each is reported on its own as it finishes. An interrupted
sample has its own prefix, so after a weight update every unfinished sample is resubmitted
alone, as its own one-sample request.

Per-request seeds (`sample_seed`): a sample's random numbers can come from its own seed rather
than the engine's shared stream, so that which tokens a sample draws does not depend on which
requests happen to share its batch or when they arrive. vLLM (0.32, v1) gives a request with
`SamplingParams.seed` its own `torch.Generator`, seeded once when the request enters the
engine; with n > 1 it fans the request out into n children with seeds seed, seed + 1, ...,
seed + n - 1 (`ParentRequest`). On CPU the sampler (`forward_cpu`) draws one integer per
decode step from that generator and uses it as the Gumbel-noise seed of that token
(`fused_gumbel_argmax`); requests without a seed draw theirs from the global stream. A group's
samples therefore get consecutive seeds: `group_seed(...) + sample_idx`, one vLLM request for
each run of consecutive seeds. A sample continued from a prefix (after a weight update
interrupted it, or from a preempted job's partial output) is a new vLLM request whose generator
starts afresh: it is seeded with `continuation_seed(seed, k)`, k = the tokens it already has,
so a continuation is reproducible given where it was cut (it does not repeat the draws the
uninterrupted sample would have made from token k on: vLLM cannot start a generator part-way).

On CPU an engine for seeded requests runs without chunked prefill (`per_request_seeds`): vLLM
0.32 samples a token for a request whose prompt is only partly prefilled, discards it, and
rewinds the request's generator with `Generator.set_offset`, which a CPU generator does not
have: the worker dies ("CPU Generator does not use offset"). Without chunking no request is
ever partly prefilled (nothing to rewind), so neither the crash nor a draw that depends on how
the step's token budget happened to be shared can occur. GPU generators rewind; chunked prefill
stays on there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from areal_hpc.cpus import split_cpus
from areal_hpc.reaper import MPI_ENV_PREFIXES   # vLLM's children drop them
from areal_hpc.rollout.seeds import SEED_BITS, continuation_seed
from areal_hpc.transport.weights import Bucket, WeightGroupAddress

logger = logging.getLogger(__name__)

WORKER_EXTENSION_CLS = "areal_hpc.rollout.vllm_ext.WeightSyncExtension"
FORKED_WORKERS = "areal_hpc.rollout.vllm_workers.ForkedWorkersExecutor"


@dataclass(slots=True)
class FinishedSample:
    """One finished sample. Token arrays are aligned: one logprob and one version per token."""

    request_id: str
    prompt_tokens: np.ndarray  # int32 [prompt_len]
    output_tokens: np.ndarray  # int32 [n]
    behav_logprobs: np.ndarray  # float32 [n], log π_behav(token | context), after temperature
    versions: np.ndarray  # int32 [n], policy version that produced each token
    finish_reason: str  # "stop" (EOS/stop token), "length" (max_new_tokens), "abort" (vLLM's)
    t_submit: float  # time.time() seconds
    t_first_token: float  # time.time() seconds; == t_end if no token was produced
    t_end: float  # time.time() seconds
    num_interrupts: int = 0  # weight updates this sample lived through
    seed: int | None = None  # its per-request sampling seed (None: the engine's shared stream)


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt_tokens: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    ignore_eos: bool
    t_submit: float
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    t_first_token: float | None = None
    attempt: int = 0  # resubmissions so far; part of the vLLM request id
    seed: int | None = None  # the sample's seed (its continuations': `continuation_seed`)
    # what ends it besides EOS and its length: strings (kept in its output) and token ids
    # (a multi-turn episode's turn stops, env.turn_stop)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # the tokens it had when its current vLLM request was submitted (a cut one continues after
    # them), and how many of the prompt's last tokens are its own text too (a model turn cut
    # at a preemption and continued as a prompt): vLLM searches stop strings in the request's
    # new text only, so a stop that straddles the cut is found here (`_stop_across_the_cut`)
    cut: int = 0
    stop_context: int = 0


def engine_options(r) -> dict:
    """`VLLMEngine` keyword arguments from a run's `rollout` section (RolloutConfig): lengths,
    memory and the scheduler's limits (max_num_seqs, max_num_batched_tokens; None = vLLM's
    defaults)."""
    return dict(max_model_len=r.max_model_len, enforce_eager=r.enforce_eager,
                kv_cache_gib=r.kv_cache_gib, gpu_memory_utilization=r.gpu_memory_utilization,
                max_num_seqs=r.max_num_seqs, max_num_batched_tokens=r.max_num_batched_tokens)


@contextlib.contextmanager
def _child_process_environment() -> Iterator[None]:
    """Start vLLM's children with spawn and without the MPI job's environment.

    spawn rather than fork: forking an MPI process is unsafe (registered memory, progress
    threads, the PMI socket fd), and spawn starts children with only the fds they need.
    Children read `os.environ` when they start, and they all start while the engine is
    constructed, so the variables are stripped for that window only and then put back.
    """
    saved = {k: v for k, v in os.environ.items() if k.startswith(MPI_ENV_PREFIXES)}
    method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    if method not in (None, "spawn"):
        logger.warning("VLLM_WORKER_MULTIPROC_METHOD=%s overridden with spawn", method)
    for k in saved:
        del os.environ[k]
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    try:
        yield
    finally:
        os.environ.update(saved)
        # vLLM's CPU platform sets spawn itself; leave spawn in place in that case too.
        if method is not None:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = method


def omp_threads_bind(cpus: Iterable[int], n: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `n` CPU workers: one CPU list per worker, "|"-separated,
    e.g. "0,1|2,3"."""
    return "|".join(",".join(map(str, part)) for part in split_cpus(cpus, n))


@contextlib.contextmanager
def _cpu_worker_binding(tensor_parallel_size: int) -> Iterator[None]:
    """Give each of vLLM's CPU workers its own share of this process's CPUs, while they start.

    vLLM's CPU platform binds worker i's OpenMP threads to the CPUs of NUMA node i unless
    VLLM_CPU_OMP_THREADS_BIND lists them, and fails to start with more workers than NUMA nodes
    (a one-node box, or a rank confined to one node by Slurm/mpiexec). The split is of
    `os.sched_getaffinity(0)`, so ranks that the launcher pinned apart stay apart. A value the
    user set wins; GPU platforms and one worker are left alone.
    """
    from vllm.platforms import current_platform

    key = "VLLM_CPU_OMP_THREADS_BIND"
    if tensor_parallel_size <= 1 or not current_platform.is_cpu() or key in os.environ:
        yield
        return
    os.environ[key] = omp_threads_bind(os.sched_getaffinity(0), tensor_parallel_size)
    logger.info("vLLM CPU workers bound to %s=%s", key, os.environ[key])
    try:
        yield
    finally:
        os.environ.pop(key, None)


def _descendants() -> list:
    """This process's descendants, minus multiprocessing's resource tracker: Python starts that
    one once per process, on first use, and it must outlive any one engine."""
    import psutil

    return [
        p for p in psutil.Process().children(recursive=True)
        if "resource_tracker" not in " ".join(_cmdline(p))
    ]


class VLLMEngine:
    """Synchronous vLLM v1 engine for one generator rank. Not thread-safe.

    Typical loop: `submit(...)` prompts as capacity allows; `step()` and hand the finished
    samples on; on a weight-update message, `update_weights(version, plan)` while the trainer
    broadcasts. `version` is the policy version of the loaded weights (0 for the initial ones).

    Behaviour logprobs are vLLM's "processed_logprobs": log_softmax(logits / temperature) after
    top-k/top-p masking, i.e. exactly the distribution sampled from. With top_p = 1 and
    top_k = -1 they equal what the trainer computes as log_softmax(logits / T).
    """

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "bfloat16",
        max_model_len: int = 4096,
        seed: int = 0,
        version: int = 0,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        kv_cache_gib: float | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = True,
        logprobs_mode: str = "processed_logprobs",
        worker_extension_cls: str = WORKER_EXTENSION_CLS,
        per_request_seeds: bool = False,
    ):
        from vllm import EngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.llm_engine import LLMEngine

        # Seeded requests on CPU: no chunked prefill (see the module's doc); each step's token
        # budget then has to hold a whole prompt.
        no_chunking = per_request_seeds and current_platform.is_cpu()
        if no_chunking and max_num_batched_tokens is not None \
                and max_num_batched_tokens < max_model_len:
            raise ValueError(f"per-request seeds on CPU run without chunked prefill: "
                             f"max_num_batched_tokens ({max_num_batched_tokens}) must be at "
                             f"least max_model_len ({max_model_len})")

        args = EngineArgs(
            model=model,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=None if kv_cache_gib is None else int(kv_cache_gib * 2**30),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=False if no_chunking else None,
            enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager,
            logprobs_mode=logprobs_mode,
            worker_extension_cls=worker_extension_cls,
            disable_log_stats=True,
            # a worker process per TP rank, and on CPU, where vLLM always starts one: forked
            # from the engine process (vllm_workers); one GPU: vLLM runs it in that process
            distributed_executor_backend=FORKED_WORKERS
            if tensor_parallel_size > 1 or current_platform.is_cpu() else None,
        )
        self.version = version
        self.per_request_seeds = per_request_seeds
        self._requests: dict[str, _Request] = {}  # unfinished samples, by their request_id
        # vLLM request id → its samples by completion index (None once finished): a group's
        # first submission ("<first request_id>*<n>"), or one resubmitted sample ("<id>@<attempt>").
        self._live: dict[str, list[_Request | None]] = {}
        self._pending: list[FinishedSample] = []  # finished outside step(), returned by step()
        # While the model holds no weights to generate with (a load failed part-way, or a new
        # engine waits for its version over the weight group: `hold`), requests are kept here,
        # vLLM id → samples, and go to vLLM with the next load that succeeds (`_update`).
        self._held: dict[str, list[_Request]] = {}
        self._holding = False
        children_before = {p.pid for p in _descendants()}
        t0 = time.perf_counter()
        with _child_process_environment(), _cpu_worker_binding(tensor_parallel_size):
            self._engine = LLMEngine.from_engine_args(args, enable_multiprocessing=True)
        self.start_s = time.perf_counter() - t0
        # Remember what vLLM started, so that shutdown() can check that it is all gone.
        self._children = [p for p in _descendants() if p.pid not in children_before]
        self._closed = False
        logger.info(
            "vLLM engine up in %.1f s (%s, %d child processes)",
            self.start_s, model, len(self._children),
        )

    # ---------------------------------------------------------------- generation

    def submit(
        self,
        request_id: str,
        prompt_tokens: Sequence[int],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        *,
        top_k: int = -1,
        ignore_eos: bool = False,
        seed: int | None = None,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        """Queue one sample. `request_id` must be unique among this engine's unfinished ones.
        `stop` / `stop_token_ids`: it also ends (finish_reason "stop") at one of these strings,
        kept in its output, or at one of these token ids."""
        self.submit_group([request_id], prompt_tokens, max_new_tokens, temperature, top_p,
                          top_k=top_k, ignore_eos=ignore_eos,
                          seeds=None if seed is None else [seed], stop=stop,
                          stop_token_ids=stop_token_ids)

    def submit_group(
        self,
        request_ids: Sequence[str],
        prompt_tokens: Sequence[int],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        *,
        top_k: int = -1,
        ignore_eos: bool = False,
        seeds: Sequence[int] | None = None,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        """Queue len(request_ids) samples of one prompt as one vLLM request; each sample is
        returned by `step()` on its own, under its own request id, as it finishes. The ids must
        be distinct and unique among this engine's unfinished samples. `seeds`: one per
        sample, distinct, each in [0, 2**62) (see `sample_seed`); each run of consecutive
        seeds is one vLLM request (vLLM seeds child i of a request seed + i)."""
        if not request_ids:
            raise ValueError("submit_group needs at least one request id")
        if len(set(request_ids)) != len(request_ids):
            raise ValueError(f"duplicate request ids in one group: {list(request_ids)!r}")
        running = [rid for rid in request_ids if rid in self._requests]
        if running:
            raise ValueError(f"request {running[0]!r} is already running")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if seeds is not None:
            if not self.per_request_seeds:
                raise ValueError("seeded requests need an engine started with "
                                 "per_request_seeds=True")
            seeds = [int(s) for s in seeds]
            if len(seeds) != len(request_ids) or len(set(seeds)) != len(seeds) \
                    or not all(0 <= s < 2**SEED_BITS for s in seeds):
                raise ValueError(f"seeds must be distinct, one per request, in [0, 2**{SEED_BITS})"
                                 f": {seeds!r}")
        prompt = [int(t) for t in prompt_tokens]
        now = time.time()
        reqs = [_Request(request_id=rid, prompt_tokens=prompt, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_p=top_p, top_k=top_k,
                         ignore_eos=ignore_eos, t_submit=now,
                         seed=None if seeds is None else seeds[i], stop=tuple(stop),
                         stop_token_ids=tuple(int(t) for t in stop_token_ids))
                for i, rid in enumerate(request_ids)]
        runs, start = [], 0     # runs of consecutive seeds (all of them without seeds)
        for i in range(1, len(reqs) + 1):
            if i == len(reqs) or (seeds is not None and seeds[i] != seeds[i - 1] + 1):
                runs.append(reqs[start:i])
                start = i
        for run in runs:
            self._add(f"{run[0].request_id}*{len(run)}", run)

    def _add(self, vllm_id: str, reqs: list[_Request]) -> None:
        """One vLLM request for `reqs`: samples of one context (prompt + the tokens so far)
        and one sampling setting, `len(reqs)` of them; held back while the model has no
        weights (`hold`): vLLM's engine core steps every request it has on its own, and a
        model left half loaded by a failed load fails its first step (its layers still hold
        the reload's placeholder tensors), which kills the engine."""
        if self._holding:
            self._held[vllm_id] = list(reqs)
            for r in reqs:
                self._requests[r.request_id] = r
            return
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind

        req = reqs[0]
        params = SamplingParams(
            n=len(reqs),
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_tokens=req.max_new_tokens - len(req.tokens),
            ignore_eos=req.ignore_eos,
            # child i of this request is seeded seed + i (vLLM's ParentRequest)
            seed=None if req.seed is None else continuation_seed(req.seed, len(req.tokens)),
            logprobs=0,  # the sampled token's logprob only
            # stop strings are matched on the detokenised text; the token ids stay as sampled
            stop=list(req.stop) or None,
            stop_token_ids=list(req.stop_token_ids) or None,
            include_stop_str_in_output=True,
            detokenize=bool(req.stop),
            output_kind=RequestOutputKind.DELTA,
        )
        # An already rendered engine input: a TokensPrompt would go through the renderer again
        # (and vLLM 0.32 warns that raw prompts are deprecated).
        prompt = tokens_input(req.prompt_tokens + req.tokens)
        self._engine.add_request(vllm_id, prompt, params)
        self._live[vllm_id] = list(reqs)
        for r in reqs:
            self._requests[r.request_id] = r
            r.cut = len(r.tokens)

    def continue_sample(
        self,
        sample: FinishedSample,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        *,
        top_k: int = -1,
        ignore_eos: bool = False,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        stop_context: int = 0,
    ) -> None:
        """Queue a sample an earlier engine started (`abort_all` at a preemption, read back from
        the rollout log). One that had finished is returned by the next `step()` as it is; an
        unfinished one (finish_reason "abort") goes on from prompt + its tokens, recomputed with
        the current weights as after a weight update: its tokens keep their logprobs and
        versions, later ones carry this engine's version. `stop_context`: how many of the
        prompt's last tokens belong to the text `stop` strings are searched in (a model turn's
        earlier part, given as prompt): a stop string that begins there ends the sample too."""
        n = len(sample.output_tokens)
        if len(sample.behav_logprobs) != n or len(sample.versions) != n:
            raise ValueError(f"{sample.request_id}: tokens, logprobs and versions differ in length "
                             f"({n}, {len(sample.behav_logprobs)}, {len(sample.versions)})")
        if sample.request_id in self._requests:
            raise ValueError(f"request {sample.request_id!r} is already running")
        if sample.finish_reason != "abort":
            self._pending.append(sample)
            return
        req = _Request(request_id=sample.request_id,
                       prompt_tokens=[int(t) for t in sample.prompt_tokens],
                       max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                       top_k=top_k, ignore_eos=ignore_eos, t_submit=sample.t_submit,
                       tokens=[int(t) for t in sample.output_tokens],
                       logprobs=[float(x) for x in sample.behav_logprobs],
                       versions=[int(v) for v in sample.versions],
                       t_first_token=sample.t_first_token if n else None,
                       attempt=sample.num_interrupts,
                       # an engine without seeds continues it from its shared stream
                       seed=sample.seed if self.per_request_seeds else None,
                       stop=tuple(stop), stop_token_ids=tuple(int(t) for t in stop_token_ids),
                       stop_context=max(0, min(int(stop_context), len(sample.prompt_tokens))))
        self._resubmit(req, time.time())

    def _resubmit(self, req: _Request, now: float) -> None:
        """An interrupted sample again, one attempt later and alone (its prefix is its own):
        prompt + its tokens so far; one with no tokens left to generate is finished ("length")."""
        req.attempt += 1
        if len(req.tokens) >= req.max_new_tokens:  # its final output was still in flight
            self._pending.append(self._finish(req, "length", now))
        else:
            self._add(f"{req.request_id}@{req.attempt}", [req])

    def abort_all(self) -> list[FinishedSample]:
        """Stop every unfinished sample and return them all, each with the tokens, logprobs and
        versions it has so far (finish_reason "abort"), with the samples that finished but
        `step()` has not returned yet (their own finish reason). The outputs come from this
        process's own bookkeeping, so an engine that is already gone (its processes killed at a
        preemption) costs only the abort call, which is then skipped."""
        samples, self._pending = self._pending, []
        self._held = {}
        now = time.time()
        if self._live:
            try:
                self._engine.abort_request(list(self._live))
            except Exception as exc:    # noqa: BLE001 - the engine died first; the tokens are here
                logger.warning("aborting vLLM's requests failed (%s); keeping the outputs so far",
                               exc)
        samples += [self._finish(r, "abort", now) for r in self._requests.values()]
        self._live.clear()
        self._requests.clear()
        return samples

    def abort(self, request_ids: Iterable[str]) -> list[FinishedSample]:
        """Stop these samples and return them as far as they got (finish_reason "abort"), with
        any of them that finished but `step()` has not returned yet (their own reason); ids not
        here are ignored. A vLLM request is aborted only with all its unfinished samples: pass a
        group's samples together (one request holds one group's first submission)."""
        ids = set(request_ids)
        now = time.time()
        out = [s for s in self._pending if s.request_id in ids]
        self._pending = [s for s in self._pending if s.request_id not in ids]
        stop = []
        for vid, slots in [*self._live.items(), *self._held.items()]:
            mine = [r for r in slots if r is not None and r.request_id in ids]
            if not mine:
                continue
            if len(mine) != sum(r is not None for r in slots):
                raise ValueError(f"vLLM request {vid} holds samples not being aborted "
                                 f"({sorted(r.request_id for r in slots if r is not None)})")
            stop.append(vid)
        in_vllm = [vid for vid in stop if vid in self._live]
        if in_vllm:
            self._engine.abort_request(in_vllm)
        for vid in stop:
            self._live.pop(vid, None)
            self._held.pop(vid, None)
        out += [self._finish(self._requests.pop(rid), "abort", now)
                for rid in sorted(ids) if rid in self._requests]
        return out

    def oldest_version(self, request_id: str) -> int | None:
        """The version of an unfinished sample's first token (None: not running, or no token
        yet)."""
        req = self._requests.get(request_id)
        return req.versions[0] if req is not None and req.versions else None

    def step(self) -> list[FinishedSample]:
        """Collect the engine's next outputs; return the samples that finished.

        Blocks until the engine has produced something if any request is unfinished;
        returns [] at once otherwise (calling vLLM's step() with nothing running would block).
        """
        finished, self._pending = self._pending, []
        if not self._live:      # nothing in vLLM (held requests wait for a load)
            return finished
        outputs = self._engine.step()
        now = time.time()
        for out in outputs:
            slots = self._live.get(out.request_id)
            if slots is None:  # a late output of an aborted attempt
                continue
            # DELTA outputs: each completion is one sample's new tokens, `index` naming it.
            for completion in out.outputs:
                req = slots[completion.index]
                if req is None:
                    continue
                new_tokens = list(completion.token_ids)
                reason = completion.finish_reason
                if new_tokens:
                    if req.t_first_token is None:
                        req.t_first_token = now
                    logprobs = completion.logprobs
                    if logprobs is None or len(logprobs) != len(new_tokens):
                        raise RuntimeError(f"{req.request_id}: expected one logprob per token")
                    before = len(req.tokens)
                    req.tokens += new_tokens
                    req.logprobs += [lp[tok].logprob for tok, lp in zip(new_tokens, logprobs)]
                    req.versions += [self.version] * len(new_tokens)
                    end = self._stop_across_the_cut(req, before)
                    if end is not None:     # it ends there, as it would have uncut
                        del req.tokens[end:], req.logprobs[end:], req.versions[end:]
                        if reason is None:
                            self._engine.abort_request([out.request_id])
                        reason = "stop"
                if reason is not None:
                    slots[completion.index] = None
                    del self._requests[req.request_id]
                    finished.append(self._finish(req, str(reason), now))
            if out.finished or not any(slots):
                del self._live[out.request_id]
        return finished

    def _stop_across_the_cut(self, req: _Request, before: int) -> int | None:
        """Where a stop string that straddles `req`'s cut ends (its token count), if the tokens
        from `before` on complete one; None otherwise. vLLM searches a request's new text only,
        so a stop whose start came before the cut (a weight update, a preemption) would be
        missed and the model would write on past its turn (e.g. a made-up tool output that
        is then trained). Only the first tokens after the cut can complete one."""
        context = req.stop_context if req.cut == 0 else 0
        if not req.stop or (req.cut == 0 and context == 0):
            return None
        longest = max(len(s) for s in req.stop)
        window = longest + 8                    # tokens: a token is a character or more, mostly
        if before - req.cut >= window:
            return None
        ids = (req.prompt_tokens[len(req.prompt_tokens) - context:] if context else []) + req.tokens
        at = context + req.cut                  # the cut, in `ids`
        lo = max(0, at - window)
        decode = self._engine.get_tokenizer().decode
        head = len(decode(ids[lo:at]))          # characters before the cut
        for j in range(context + before + 1, min(len(ids), at + window) + 1):
            text = decode(ids[lo:j])
            for stop in req.stop:
                i = text.find(stop, max(0, head - len(stop) + 1))
                if i != -1 and i < head < i + len(stop):
                    return j - context
        return None

    @staticmethod
    def _finish(req: _Request, finish_reason: str, now: float) -> FinishedSample:
        return FinishedSample(
            request_id=req.request_id,
            prompt_tokens=np.asarray(req.prompt_tokens, dtype=np.int32),
            output_tokens=np.asarray(req.tokens, dtype=np.int32),
            behav_logprobs=np.asarray(req.logprobs, dtype=np.float32),
            versions=np.asarray(req.versions, dtype=np.int32),
            finish_reason=finish_reason,
            t_submit=req.t_submit,
            t_first_token=req.t_first_token if req.t_first_token is not None else now,
            t_end=now,
            num_interrupts=req.attempt,
            seed=req.seed,
        )

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    def longest_unfinished(self) -> int:
        """The most tokens an unfinished sample has so far (0: none)."""
        return max((len(r.tokens) for r in self._requests.values()), default=0)

    def num_running(self) -> int:
        """Submitted and not yet finished (waiting or generating inside vLLM)."""
        return len(self._requests)

    def processes(self) -> list:
        """The processes this engine started (its EngineCore, its workers' parents) that still
        run, as psutil handles: for a watch, a profile, a kill."""
        return [p for p in self._children if p.is_running()]

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = ()) -> list:
        """vLLM's `collective_rpc`: `method` (a worker method's name, or a function taking the
        worker first) run in every worker; their results. For tools and benchmarks."""
        return self._engine.collective_rpc(method, timeout, args)

    # ---------------------------------------------------------------- weights

    def init_weight_group(self, address: WeightGroupAddress, rank: int) -> list[int]:
        """Join the weight group (see `WeightSyncExtension.init_weight_group`); blocks until
        the trainer's stage senders join at the same `address`, at most its `join_timeout_s`;
        later receives are bounded by its `timeout_s`. `rank` is the first worker's; worker i
        joins as rank + i. Returns the workers' ranks."""
        # vLLM's RPC encodes its arguments with msgspec, which turns a dataclass into a dict:
        # send the dict, and the extension rebuilds the address.
        return self._rpc("init_weight_group", dataclasses.asdict(address), rank)

    def _rpc(self, method: str, *args) -> list:
        """`method` of the worker extension on every worker, through its `reported`: every
        worker's reply is read; a failure on any raises `RuntimeError` naming each."""
        out = self._engine.collective_rpc("reported", args=(method, *args))
        errors = [r["areal_worker_error"] for r in out
                  if isinstance(r, dict) and "areal_worker_error" in r]
        if errors:
            raise RuntimeError(f"{method} failed: " + "; ".join(errors))
        return out

    def update_weights(self, version: int, plan: Sequence[tuple[int, Bucket]]) -> float:
        """Interrupt, receive the trainer's broadcast (`broadcast_stage` on every stage sender
        with the same plan), and resume; tokens generated from here on carry `version`.
        Returns the seconds generation was paused (abort → resubmission)."""
        return self._update(version, "recv_weights", [(int(root), list(b)) for root, b in plan])

    def drain_weights(self, plan: Sequence[tuple[int, Bucket]]) -> float:
        """Take part in a broadcast of the version this engine already runs (it went out again
        for a member that rejoined the weight group) without loading it: the workers receive
        every bucket and drop it; requests are not interrupted. Returns the seconds."""
        t0 = time.perf_counter()
        self._rpc("recv_weights", [(int(root), list(b)) for root, b in plan], False)
        return time.perf_counter() - t0

    def update_weights_from_file(self, version: int, path: str) -> float:
        """As `update_weights`, from a safetensors file or a directory of shards."""
        return self._update(version, "load_weights_from_file", str(path))

    def hold(self) -> None:
        """Send no request to vLLM until a weight load succeeds: this engine's model has no
        weights the samples may be generated with (a new engine that waits for its version
        over the weight group). Submitted samples wait, and go on after the load."""
        self._holding = True

    def _update(self, version: int, method: str, arg) -> float:
        t0 = time.perf_counter()
        held, self._held = self._held, {}
        waiting = {r.request_id for reqs in held.values() for r in reqs}
        interrupted = [r for r in self._requests.values() if r.request_id not in waiting]
        if self._live:
            # A group's id aborts all its samples (vLLM aborts a parent's children with it).
            self._engine.abort_request(list(self._live))
            self._live.clear()
        self._requests.clear()
        t1 = time.perf_counter()
        # A failed load raises here, before `version` moves: the engine's model may be half
        # loaded, and nothing may be generated with it until a load succeeds (`hold`). The
        # samples are kept (the interrupted ones with the tokens they have), so that the next
        # load resumes them; an engine that died with the load takes them to its replacement
        # (`abort_all`).
        self._holding = True
        try:
            self._rpc(method, arg)
        except BaseException:
            now = time.time()
            for req in interrupted:
                self._resubmit(req, now)
            for vid, reqs in held.items():
                self._add(vid, reqs)
            raise
        self._holding = False
        load_s = time.perf_counter() - t1
        # Without this the next prefill silently reuses KV blocks computed with the old weights.
        if not self._engine.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset the prefix cache after a weight update")
        self.version = version
        now = time.time()
        for req in interrupted:
            self._resubmit(req, now)
        for vid, reqs in held.items():
            self._add(vid, reqs)
        paused_s = time.perf_counter() - t0
        logger.info(
            "weights v%d loaded in %.3f s; paused %.3f s; %d requests resumed",
            version, load_s, paused_s, len(interrupted),
        )
        return paused_s

    # ---------------------------------------------------------------- lifetime

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine and make sure every process it started is gone. Idempotent."""
        if self._closed:
            return
        self._closed = True
        import psutil

        # vLLM's processes and theirs, listed before shutdown: once the EngineCore has exited
        # its children are re-parented and no longer show up as our descendants.
        procs = {p for p in self._children if p.is_running()}
        for p in list(procs):
            with contextlib.suppress(psutil.NoSuchProcess):
                procs.update(p.children(recursive=True))
        try:
            self._engine.engine_core.shutdown()
        finally:
            _, alive = psutil.wait_procs(list(procs), timeout=timeout_s)
            for p in alive:
                logger.warning("killing leftover vLLM process %d %s", p.pid, _cmdline(p))
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            psutil.wait_procs(alive, timeout=5)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _cmdline(p) -> list[str]:
    import psutil

    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []
