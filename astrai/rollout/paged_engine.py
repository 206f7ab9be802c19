"""Paged, continuously batched rollout engine: the engine of the online train types.

PagedAttention (Kwon et al. 2023, vLLM) for the KV memory, continuous batching (Yu et al. 2022, Orca) for the
schedule; both re-implemented here on astrai's model and kernels (`astrai.kernels`). What it adds over a naive
contiguous-cache loop (the reference engine of the tests):
- KV in fixed-size blocks of a preallocated `InferenceWorkspace`, addressed by block tables (no padding, no
  per-batch reallocation); requests join and leave between decode steps (`scheduler.Scheduler`).
- The G samples of a prompt (`n=G`, or identical prompts in the list) prefill it once and share its blocks,
  copying the partial last block on write; a prefix cache reuses full prompt blocks across calls, tagged with the
  `policy_version` and cleared by `load_weights` (docs/conventions.md section 4).
- Per-request RNG: request i draws from its own `torch.Generator` seeded from (one draw of the caller's
  generator, i), so batching and prefix sharing never change a row's samples.
- Behaviour log-probs exactly as docs/conventions.md section 2 (temperature-scaled, before truncation and penalties).
- `sleep()` frees the KV storage while the trainer steps, `wake()` takes it back.
- `cuda_graphs=True`: decode steps padded to batch-size buckets and replayed as CUDA graphs (`cuda_graphs.py`).
- A streaming API for serving (`add_request` / `step` / `abort`, `astrai.rollout.streaming`): requests join and
  leave the running batch between decode steps of one live session instead of one `generate` call per batch.
"""

from __future__ import annotations

import copy
import threading
import warnings
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

import torch

from astrai.cpu_threads import ThreadGovernor, active_governor, adaptive_threads as make_governor, governed
from astrai.data.sequences import left_pad
from astrai.kernels import InferenceWorkspace
from astrai.rollout.block_pool import BlockPool, PrefixCache
from astrai.rollout.cuda_graphs import DecodeGraphs, decode_buckets
from astrai.rollout.engine_settings import check_paged_engine, check_paged_options, engine_backend
from astrai.rollout.engine_settings import resolve_dtype as _resolve_dtype
from astrai.rollout.engine import EngineCapacity
from astrai.rollout.generation import Generation, copy_weights
from astrai.rollout.model_runner import PagedModelRunner, fuse_projections
from astrai.rollout.cpu_decode import FlatTrunk
from astrai.rollout.cpu_ops import use_cpu_kernels
from astrai.rollout.packed_linear import prepack_available, prepack_linears, slow_half_precision
from astrai.rollout.prompt_ids import check_prompt_ids
from astrai.rollout.sampling import SamplingParams
from astrai.rollout.row_sampling import (FrequencyPenalty, RowSampling, draw_base_seed, per_prompt_settings,
                                         request_seed)
from astrai.rollout.scheduler import Group, Request, Scheduler
from astrai.rollout.streaming import StepOutput, StreamSession
from astrai.rollout.tensor_parallel import TensorParallelRunner, local_kv_heads, parallel_copy, request_digest

__all__ = ["PagedGenerationEngine", "paged_engine"]

ParamsArg = Union[SamplingParams, Sequence[SamplingParams]]
PenaltyArg = Union[None, FrequencyPenalty, Sequence[Optional[FrequencyPenalty]]]


class PagedGenerationEngine:
    """Colocated rollout engine over a paged KV cache.

    Args:
        model: the policy (`AutoRegressiveLM`); deep-copied (eval, no grad) so training never changes the
            engine's weights until `load_weights`.
        pad_token_id: pads prompts and finished responses.
        policy_version: version tag of the initial weights.
        block_size: tokens per KV block (None: 16 with the torch and triton backends, 256 with flash-attn).
        max_kv_tokens: cap of the KV pool in tokens; the pool grows on demand up to it.
        max_batch_tokens: token budget of one step (prefill chunks + one per decoding request).
        max_num_seqs: most concurrently live requests.
        prefix_cache: reuse full prompt blocks across calls (same `policy_version` only).
        backend: `torch`, `triton`, `flash_attn`, `auto` or None (`ASTR_BACKEND`), chosen for the engine's device,
            dtype and block size; see `astrai.kernels.select_backend` and docs/kernels.md.
        dense_decode: torch backend only: decode-only steps append to dense per-row keys/values
            (`astrai.kernels.DenseDecodeCache`) instead of gathering the blocks in every layer; same tokens.
        dtype: dtype of the inference copy and its KV cache (`torch.float32`/`bfloat16`/`float16` or its name;
            None: the model's). `load_weights` casts incoming tensors to it; `old_logprobs` stay float32 (the
            logits are upcast before the log-softmax), so an fp32 policy can roll out from a bf16 copy: the
            rounding then shows as a small nonzero `rollout/logprob_gap`. On a CPU the GEMM weights are also kept
            prepacked in oneDNN's layout in bfloat16, and in float32 on x86 CPUs other than Intel's, where MKL's
            decode-sized GEMMs are slow (`self.prepacked`, `astrai.rollout.packed_linear`: bf16 results the same,
            float32 ones to rounding; one more copy of those weights, repacked by `load_weights`), and the norms,
            rotary embeddings and gated activations run as one compiled call each where the CPU kernels build
            (`self.cpu_kernels`, `astrai.rollout.cpu_ops`: float32 results to rounding, about 1e-6).
        cuda_graphs: pad decode-only steps to batch buckets and replay them as CUDA graphs on CUDA
            (`astrai.rollout.cuda_graphs`; `auto` then picks the triton backend); on other devices the padded steps
            run eagerly (same tokens, for tests).
        adaptive_threads: on a CPU, decode with fewer torch threads while other processes busy the cores, and
            with the caller's count again when they are free (`astrai.cpu_threads.ThreadGovernor`; only inside
            `generate` and `step`: the caller's count is put back on return). Its choices change float rounding, so
            leave it off for bitwise repeats. `last_stats["threads_mean"]`: the mean count over the last
            `generate`'s steps; `thread_steps`: [sum of counts, steps] over all its calls. Said once where the
            system cannot report the load (the count then stays).
        tp_group: a torch process group of more than one rank: the copy is split over it
            (`astrai.rollout.tensor_parallel`: heads, MLP columns/rows and vocabulary; every rank of the group must
            make the same calls with the same prompts, and samples the same tokens). None (or a group of one): the
            whole copy, as before.

    Raises:
        BackendUnavailableError: when the requested backend cannot serve the engine's device, dtype or block size,
            or `cuda_graphs` cannot be captured with it (one line).
        ValueError: naming a size argument that is not a positive integer (or a block_size the backend cannot
            use, max_kv_tokens below one block, or an unknown dtype); a model `tp_group` cannot split
            (`tensor_parallel.check_tensor_parallel`), or `cuda_graphs` with a tensor-parallel group.
    """

    def __init__(self, model, *, pad_token_id: int, policy_version: int = 0, block_size: Optional[int] = None,
                 max_kv_tokens: int = 32768, max_batch_tokens: int = 2048, max_num_seqs: int = 256,
                 prefix_cache: bool = True, backend: Optional[str] = None, dense_decode: bool = True,
                 dtype: Union[None, str, torch.dtype] = None, cuda_graphs: bool = False, adaptive_threads: bool = False,
                 tp_group=None):
        for name, value in (("block_size", block_size), ("max_kv_tokens", max_kv_tokens),
                            ("max_batch_tokens", max_batch_tokens), ("max_num_seqs", max_num_seqs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"PagedGenerationEngine: {name} must be a positive integer, got {value!r}")
        dtype = _resolve_dtype(dtype)
        self.tp = None
        if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
            if cuda_graphs:
                raise ValueError("rollout.cuda_graphs: not yet supported with rollout.tensor_parallel_size > 1")
            self.model, self.tp = parallel_copy(model, tp_group)  # this rank's heads, MLP slices, vocabulary rows
            self.model.eval().requires_grad_(False)
        else:
            self.model = copy.deepcopy(model).eval().requires_grad_(False)
        if dtype is not None:
            self.model.to(dtype)
        slow = slow_half_precision(self.device, self.dtype)
        if slow is not None:
            warnings.warn(slow, stacklevel=2)
        fuse_projections(self.model)  # one GEMM for q/k/v and one for gate/up (the Parameters become views)
        # CPU (bf16; float32 off Intel): GEMM weights kept in oneDNN's layout, not reordered in every call
        self.prepacked = (prepack_linears(self.model) if self.tp is None and not cuda_graphs
                          and prepack_available(self.device, self.dtype) else None)
        # CPU: norms, rotary and gated activations in one compiled call each (astrai.rollout.cpu_ops)
        self.cpu_kernels = self.device.type == "cpu" and use_cpu_kernels(self.model, self.dtype)
        # CPU with the kernels: the trunk's layers in one flat loop, no module calls (astrai.rollout.cpu_decode)
        self.flat = (FlatTrunk.build(self.model, self.prepacked.linear if self.prepacked is not None else None)
                     if self.cpu_kernels and self.tp is None else None)
        self.pad_token_id, self.policy_version = pad_token_id, policy_version
        self.backend, self.block_size = engine_backend(self.model.config, device=self.device, dtype=self.dtype,
                                                       backend=backend, block_size=block_size, cuda_graphs=cuda_graphs)
        self.cuda_graphs, self._graphs = bool(cuda_graphs), None
        if max_kv_tokens < self.block_size:
            raise ValueError(f"PagedGenerationEngine: max_kv_tokens {max_kv_tokens} is below one block "
                             f"({self.block_size} tokens)")
        self.max_kv_blocks = max_kv_tokens // self.block_size
        self.max_batch_tokens, self.max_num_seqs = max_batch_tokens, max_num_seqs
        self.use_prefix_cache, self.dense_decode = prefix_cache, dense_decode
        self.workspace: Optional[InferenceWorkspace] = None
        self.pool: Optional[BlockPool] = None
        self.prefix_cache: Optional[PrefixCache] = None
        self.asleep = False
        self.last_stats: dict[str, int] = {}
        self._session: Optional[StreamSession] = None
        self._lock = threading.Lock()
        self.threads: Optional[ThreadGovernor] = None
        if adaptive_threads and self.device.type == "cpu":
            self.threads = make_governor("the engine", "decodes")
        self.thread_steps = [0, 0]  # over all calls: [sum of the thread count over decode steps, steps]

    def _governor(self) -> Optional[ThreadGovernor]:
        """The governor of this call: one whose scope is open in this thread (the trainer's, around a training
        step) or else the engine's own; None when the engine does not adapt its threads."""
        if self.threads is None:
            return None
        return active_governor() or self.threads

    def _ticking(self, forward: Callable, counts: Optional[list[int]] = None) -> Callable:
        """`forward` with a tick of the call's governor before each step (as is without one); with `counts`
        ([sum, steps]) it adds each step's thread count."""
        if self.threads is None:
            return forward

        def ticking(*args, **kwargs):
            threads = self._governor().tick()
            if counts is not None:
                counts[0] += threads
                counts[1] += 1
            return forward(*args, **kwargs)
        return ticking

    @property
    def device(self) -> torch.device:
        """Device of the engine's weights (and of the tensors `generate` returns)."""
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """Parameter (and KV cache) dtype."""
        return next(self.model.parameters()).dtype

    @property
    def capacity(self) -> EngineCapacity:
        """Rows, KV tokens and step tokens it holds at once, and the model's position limit."""
        return EngineCapacity(max_num_seqs=self.max_num_seqs, max_kv_tokens=self.max_kv_blocks * self.block_size,
                              max_batch_tokens=self.max_batch_tokens,
                              max_position_embeddings=self.model.config.max_position_embeddings)

    @torch.no_grad()
    def load_weights(self, state_dict: Union[Mapping[str, torch.Tensor], Iterable], policy_version: int) -> int:
        """Copy `state_dict` (HF names, any device and float dtype, cast to the engine's `dtype`) into the engine,
        tag it, and drop the prefix cache. `state_dict` may also be an iterable of (name, tensor) pairs, streamed in
        one parameter at a time (`generation.copy_weights`).

        Serialised with `generate` (one lock). Returns the acknowledged `policy_version`.

        Raises:
            RuntimeError: while streamed requests (`add_request`) are live: weights never change mid-generation.
            KeyError: naming missing or unexpected tensors (a mapping: the engine keeps its weights, version and
                cache; a stream: the engine is left untagged, `policy_version` -1, so the next sync reloads it).
            ValueError: naming a tensor of the wrong shape or type (the same).
        """
        with self._lock:
            self._end_session("load_weights")
            if not isinstance(state_dict, Mapping):
                self.policy_version = -1  # until the stream is complete
            if self.tp is not None:  # this rank's slice of each full tensor (a view): no second full copy
                state_dict = self.tp.shard_all(state_dict)
            try:
                copy_weights(self.model, state_dict)
            finally:  # the copied tensors reach the prepacked ones (stale ones would be repacked on use anyway)
                if self.prepacked is not None:
                    self.prepacked.refresh()
            if self.prefix_cache is not None:
                self.prefix_cache.clear()
            self.policy_version = policy_version
            return self.policy_version

    def sleep(self) -> None:
        """Release the KV storage (and the prefix cache) until `wake()`; the weights stay."""
        with self._lock:
            self._end_session("sleep")
            if self.prefix_cache is not None:
                self.prefix_cache.clear()
            self._graphs = None  # they point at the KV storage freed here
            if self.workspace is not None:
                self.workspace.release()
            self.asleep = True

    def wake(self) -> None:
        """Take the KV storage back (zeroed); a no-op when awake."""
        with self._lock:
            if self.workspace is not None:
                self.workspace.allocate()
            self.asleep = False

    def _ensure_capacity(self, blocks_wanted: int) -> None:
        """Create or grow the workspace to `min(blocks_wanted, max_kv_blocks)` pool blocks (only between calls; with
        `cuda_graphs` the workspace has one more, the padded rows' scratch block)."""
        target = min(blocks_wanted, self.max_kv_blocks)
        if self.pool is not None and self.pool.num_blocks >= target:
            return
        if self.workspace is not None:
            target = max(target, self.pool.num_blocks)
            self.workspace.release()
        self._graphs = None
        config = self.model.config  # the KV heads as the weights hold them: a tensor-parallel rank's own only
        self.workspace = InferenceWorkspace(
            num_layers=config.num_hidden_layers, num_kv_heads=local_kv_heads(self.model), head_dim=config.head_dim,
            num_blocks=target + int(self.cuda_graphs), block_size=self.block_size, dtype=self.dtype,
            device=self.device)
        self.pool = BlockPool(target)
        self.prefix_cache = PrefixCache(self.pool, self.block_size) if self.use_prefix_cache else None

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: ParamsArg,
                 generator: Optional[torch.Generator] = None, *, n: int = 1,
                 penalties: PenaltyArg = None, on_token: Optional[Callable[[int, int], None]] = None) -> Generation:
        """Sample `n` responses per prompt (rows grouped by prompt: row b * n + g is sample g of prompt b).

        Args:
            prompts: B lists of prompt token ids (each non-empty).
            params: one `SamplingParams` for all, or one per prompt (temperature, top-k, top-p, stop tokens,
                max_new_tokens composed per request).
            generator: caller RNG; exactly one int64 is drawn from it per call (None: torch's default RNG).
            n: samples per prompt (G).
            penalties: an optional `FrequencyPenalty` for all prompts, or one (or None) per prompt.
            on_token: optional `(row, token id) -> None`, called in the calling thread right after each token of
                output row `row` is sampled (for streaming; it must not call back into the engine).

        Returns:
            `Generation` with B * n rows: prompt_ids (B*n, P) left-padded, prompt_mask, response_ids (B*n, T)
            right-padded, action_mask, old_logprobs (B*n, T) float32 (0 at padding), finished, policy_version.

        Raises:
            ValueError: no prompts, an empty prompt, a token id that is not an integer in [0, vocab_size), n not
                an integer >= 1, params that are not `SamplingParams` (one, or one per prompt), per-prompt lists of
                the wrong length, prompt + max_new_tokens beyond the model's rotary table, or more samples of one
                prompt than `max_num_seqs`.
            RuntimeError: while asleep, while streamed requests are live, or when one prompt group cannot fit in
                `max_kv_tokens`.
        """
        with self._lock:
            if self.asleep:
                raise RuntimeError("generate: the engine is asleep; call wake() first")
            self._end_session("generate")
            prompts = check_prompt_ids(prompts, self.model.config.vocab_size)
            requests = self._make_requests(prompts, params, generator, n, penalties)
            self._run(requests, n, on_token)
            return self._assemble(prompts, requests, n)

    # ------------------------------------------------------------------ streaming API (serving, one step at a time)
    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, *, n: int = 1,
                    penalty: Optional[FrequencyPenalty] = None, seed: Optional[int] = None,
                    top_logprobs: int = 0) -> int:
        """Queue `n` samples of one prompt for the next `step()`; returns the request id its `StepOutput`s carry.

        Args:
            prompt_ids: the prompt's token ids (non-empty, each in [0, vocab_size)).
            params: its sampling settings; penalty: an optional frequency penalty.
            seed: base seed of its choices' generators (choice g: `request_seed(seed, g)`); None draws one from
                torch's default RNG.
            top_logprobs: k most likely tokens to report with every sampled token (0: none).

        Raises:
            ValueError: naming the bad argument (see `StreamSession.add`; a prompt as for `generate`).
            RuntimeError: while asleep, or on a tensor-parallel engine.
        """
        with self._lock:
            if self.asleep:
                raise RuntimeError("add_request: the engine is asleep; call wake() first")
            if self.tp is not None:  # its ranks would need one seed and one request order: generate() agrees on both
                raise RuntimeError("add_request: the streaming API is not supported on a tensor-parallel engine "
                                   "(rollout.tensor_parallel_size > 1); use generate()")
            prompt = check_prompt_ids([prompt_ids], self.model.config.vocab_size)[0]
            if self._session is None:
                self._session = StreamSession(self)
            return self._session.add(prompt, params, n=n, penalty=penalty, seed=seed, top_logprobs=top_logprobs)

    def step(self) -> list[StepOutput]:
        """One decode step over every live streamed request (new ones prefill in it); the tokens it sampled."""
        with self._lock, governed(self._governor()):
            return [] if self._session is None else self._session.step()

    def abort(self, request_id: int, choice: Optional[int] = None) -> None:
        """Stop a streamed request (or one of its choices): its KV blocks are back in the pool on return."""
        with self._lock:
            if self._session is not None:
                self._session.abort(request_id, choice)

    @property
    def has_unfinished_requests(self) -> bool:
        """True while some streamed request is not done (call `step()`)."""
        return self._session is not None and self._session.live

    def stream_stats(self) -> dict[str, int]:
        """`StreamSession.stats()` of the live session (zeros before the first `add_request`)."""
        with self._lock:
            return dict(StreamSession.EMPTY_STATS) if self._session is None else self._session.stats()

    def _end_session(self, what: str) -> None:
        """Drop an idle streaming session before `what` changes the pool or the weights; refuse a live one."""
        if self._session is not None and self._session.live:
            raise RuntimeError(f"{what}: {len(self._session.requests)} streamed request(s) are live; let them finish "
                               "or abort them first")
        self._session = None

    def _make_requests(self, prompts, params, generator, n, penalties) -> list[Request]:
        """One `Request` per output row, each with its own seeded generator."""
        per_params, per_penalty = per_prompt_settings(prompts, params, n, penalties)
        limit = self.model.config.max_position_embeddings
        base = draw_base_seed(generator)
        if self.tp is not None:  # one seed and one batch for the whole group: every rank draws the same tokens
            base = self.tp.agree(base, request_digest(prompts, per_params, n, per_penalty))
        requests = []
        for b, prompt in enumerate(prompts):
            if len(prompt) + per_params[b].max_new_tokens > limit:
                raise ValueError(f"generate: prompt {b} ({len(prompt)} tokens) + max_new_tokens "
                                 f"{per_params[b].max_new_tokens} exceeds max_position_embeddings {limit}")
            for g in range(n):
                index = b * n + g
                rng = torch.Generator(device=self.device).manual_seed(request_seed(base, index))
                requests.append(Request(index=index, prompt=list(prompt), sampling=RowSampling(
                    per_params[b], per_penalty[b], rng, [])))
        return requests

    def _run(self, requests: list[Request], n: int, on_token=None) -> None:
        """Group requests by (prompt, settings), size the pool, and schedule them to completion."""
        by_key: dict[tuple, Group] = {}
        for req in requests:
            key = (tuple(req.prompt), req.sampling.params.max_new_tokens)
            by_key.setdefault(key, Group(members=[])).members.append(req)
        groups = list(by_key.values())
        biggest = max(len(g.members) for g in groups)
        if biggest > self.max_num_seqs:
            raise ValueError(f"generate: {biggest} samples of one prompt exceed max_num_seqs {self.max_num_seqs} "
                             "(they are decoded together); raise max_num_seqs or lower n")
        blocks = lambda t: -(-t // self.block_size)  # noqa: E731
        wanted = sum(blocks(len(r.prompt) + r.sampling.params.max_new_tokens) for r in requests)
        largest = max(blocks(len(g.leader.prompt) + g.leader.sampling.params.max_new_tokens) * len(g.members)
                      for g in groups)
        self._ensure_capacity(max(wanted, largest))
        runner = self._runner()
        counts = [0, 0]  # [sum of the thread count over decode steps, steps] of this call
        scheduler = Scheduler(pool=self.pool, prefix_cache=self.prefix_cache, workspace=self.workspace,
                              forward=self._ticking(runner.forward, counts), policy_version=self.policy_version,
                              max_batch_tokens=self.max_batch_tokens, max_num_seqs=self.max_num_seqs,
                              on_token=on_token)
        hits_before = self.prefix_cache.hits if self.prefix_cache is not None else 0
        with governed(self._governor()):
            scheduler.run(groups)
        rebuilds = runner.decode_cache.rebuilds if runner.decode_cache is not None else 0
        self.last_stats = {"steps": scheduler.steps, "groups": len(groups), "dense_decode_rebuilds": rebuilds,
                           "prefix_cache_hits": (self.prefix_cache.hits - hits_before) if self.prefix_cache else 0,
                           "prefix_cache_entries": len(self.prefix_cache or ())}
        if counts[1]:
            self.last_stats["threads_mean"] = counts[0] / counts[1]
            self.thread_steps = [a + b for a, b in zip(self.thread_steps, counts)]

    def _runner(self) -> PagedModelRunner:
        """A model runner over the workspace; with `cuda_graphs` it serves decode steps from the engine's
        `DecodeGraphs`, kept across calls while the KV storage stays (captures are reused)."""
        if self.cuda_graphs and (self._graphs is None or not self._graphs.valid):
            self._graphs = DecodeGraphs(self.model, self.workspace, self.backend,
                                        buckets=decode_buckets(self.max_num_seqs), scratch_block=self.pool.num_blocks,
                                        capture=self.device.type == "cuda")
        if self.tp is not None:
            return TensorParallelRunner(self.model, self.workspace, self.backend, self.tp,
                                        dense_decode=self.dense_decode)
        return PagedModelRunner(self.model, self.workspace, self.backend, dense_decode=self.dense_decode,
                                graphs=self._graphs if self.cuda_graphs else None, flat=self.flat)

    def _assemble(self, prompts, requests: list[Request], n: int) -> Generation:
        """Pack the per-request results into a `Generation` (rows in request order)."""
        device = self.device
        prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(n)], self.pad_token_id, device)
        width = max(len(r.generated) for r in requests)
        response = torch.full((len(requests), width), self.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((len(requests), width), dtype=torch.float32)
        mask = torch.zeros((len(requests), width), dtype=torch.bool)
        for row, req in enumerate(requests):
            t = len(req.generated)
            response[row, :t] = torch.tensor(req.generated, dtype=torch.long)
            logprobs[row, :t] = torch.tensor(req.logprobs, dtype=torch.float32)
            mask[row, :t] = True
        finished = torch.tensor([r.finished for r in requests], dtype=torch.bool)
        return Generation(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response.to(device),
                          action_mask=mask.to(device), old_logprobs=logprobs.to(device), finished=finished.to(device),
                          policy_version=self.policy_version)


def paged_engine(model, *, pad_token_id: int, policy_version: int = 0, dtype=None,
                 attention_backend: Optional[str] = None, tp_group=None, **options) -> PagedGenerationEngine:
    """The `paged` entry of the engine factory (`astrai.rollout.engine.build_engine`): a `PagedGenerationEngine`
    with `attention_backend` as its `backend` and `options` as its sizes (`max_num_seqs`, `max_kv_tokens`,
    `max_batch_tokens`, `block_size`, `prefix_cache`, `dense_decode`, `cuda_graphs`: `PAGED_OPTIONS`), split
    over `tp_group` when it is a group of several ranks (`rollout.tensor_parallel_size`).

    Raises:
        ValueError: an option it does not take (one line)."""
    check_paged_options(options)
    return PagedGenerationEngine(model, pad_token_id=pad_token_id, policy_version=policy_version, dtype=dtype,
                                 backend=attention_backend, tp_group=tp_group, **options)


paged_engine.check = check_paged_engine
