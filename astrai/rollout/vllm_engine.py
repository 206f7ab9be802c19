"""`rollout.engine: vllm`: vLLM's offline `LLM` behind the engine protocol (`astrai.rollout.engine`), colocated in
the trainer's process.

- Built once from the policy: its config and weights are written to a temporary Hugging Face directory
  (config.json, generation_config.json, model.safetensors), vLLM loads it (no tokenizer: prompts and responses are
  token ids), and the directory is deleted.
- `load_weights` streams the trainer's (name, tensor) pairs into vLLM's own in-place reload
  (`Worker.reload_weights`, which re-runs the layers' weight post-processing: the CPU build repacks its linear
  weights), one parameter at a time through `LLM.collective_rpc`, never through disk; then vLLM's prefix cache is
  reset and the engine is tagged with the new `policy_version`. vLLM's engine core runs in this process
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set here) so the tensors are handed over, not pickled. With tied embeddings
  the LM head's post-processing is re-run after each load (vLLM's reload re-processes only the layers it loaded
  into; the CPU build's LM head would keep a GEMM handle packed from the old weights).
- Behaviour log-probs: vLLM's `logprobs_mode="processed_logprobs"`, the log-prob of each sampled token under the
  distribution it was sampled from (after temperature, top-k and top-p). Without truncation (RL's default) that is
  exactly `log_softmax(logits / temperature)[token]` (docs/conventions.md section 2), what the trainer scores; with
  top-k/top-p it is the truncated, renormalised distribution's (the paged engine records the untruncated one), so
  `rollout/logprob_gap` then also holds the truncated mass: docs/vllm.md.
- Sampling options map one to one (temperature, top_k, top_p, max_new_tokens -> max_tokens, stop_token_ids with
  `ignore_eos` so only the job's stop set stops a row, a seed per row from the caller's generator as the paged
  engine derives them, greedy `top_k=1` as vLLM's temperature 0, a frequency penalty p as vLLM's p * T); what vLLM
  cannot honour is refused in one line (`check_sampling`).
- `sleep()` / `wake()`: vLLM's sleep mode (level 1: KV cache dropped, weights offloaded to host memory) where the
  platform has it (CUDA); the CPU build has none (its worker ignores the call), so there they only mark the engine
  asleep and `generate` refuses until `wake()`.

vLLM is optional: `pip install 'astrai[vllm]'` (CUDA) or `bash tools/make_vllm_venv.sh` (the CPU build, in its own
virtual environment: it pins transformers below 5.20). Without it, building or checking this engine raises one
ValueError line naming `rollout.engine` and the install command.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch

from astrai.data.sequences import left_pad
from astrai.deps import unavailable_reason
from astrai.rollout.engine import EngineCapacity
from astrai.rollout.engine_settings import PAGED_OPTIONS, resolve_dtype
from astrai.rollout.generation import Generation
from astrai.rollout.prompt_ids import check_prompt_ids
from astrai.rollout.row_sampling import draw_base_seed, per_prompt_settings, request_seed
from astrai.rollout.sampling import SamplingParams

__all__ = ["INSTALL", "VLLM_OPTIONS", "VLLMGenerationEngine", "check_sampling", "check_vllm_engine",
           "check_vllm_options", "vllm_engine"]

INSTALL = "pip install 'astrai[vllm]'; the CPU build: bash tools/make_vllm_venv.sh, docs/vllm.md"
"""How to install vLLM, as the one-line refusal says it."""

VLLM_OPTIONS = ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "gpu_memory_utilization",
                "kv_cache_memory_bytes", "prefix_cache", "cuda_graphs")
"""The options the vllm engine takes beyond the common arguments (`rollout.engine_options`; `cuda_graphs` from
`rollout.cuda_graphs`): vLLM's engine arguments of the same names, `prefix_cache` -> `enable_prefix_caching`,
`cuda_graphs` -> `enforce_eager=False` (without it vLLM runs eagerly, as the paged engine does)."""

_COUNTS = ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes")
_SWITCHES = ("prefix_cache", "cuda_graphs")
_VLLM_FREQUENCY_PENALTY = 2.0  # vLLM's SamplingParams accept frequency_penalty in [-2, 2]


def _require_vllm() -> None:
    """ValueError (one line naming rollout.engine and the install command) when vllm is missing or broken."""
    reason = unavailable_reason("vllm", needed_by="rollout.engine: vllm", install=INSTALL)
    if reason is not None:
        raise ValueError(reason)


def check_vllm_options(options: Mapping[str, Any]) -> None:
    """ValueError (one line naming `rollout.engine_options.<option>`) for an option the vllm engine does not take
    or a value of the wrong kind (counts: positive integers; switches: booleans; gpu_memory_utilization: (0, 1])."""
    for name, value in options.items():
        if name not in VLLM_OPTIONS:
            close = [] if name in PAGED_OPTIONS else difflib.get_close_matches(name, VLLM_OPTIONS, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"options: {', '.join(VLLM_OPTIONS)}"
            if name in PAGED_OPTIONS:
                hint = f"it is the paged engine's; {hint}"
            raise ValueError(f"rollout.engine_options: the vllm engine takes no option {name!r} ({hint})")
        if name in _COUNTS:
            ok, expected = not isinstance(value, bool) and isinstance(value, int) and value >= 1, "an integer > 0"
        elif name in _SWITCHES:
            ok, expected = isinstance(value, bool), "true or false"
        else:
            ok = not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value <= 1
            expected = "a number in (0, 1]"
        if not ok:
            raise ValueError(f"rollout.engine_options.{name}: expected {expected}, got {value!r}")


def check_sampling(params: SamplingParams, penalty: Any = None) -> None:
    """ValueError (one line) for sampling settings vLLM cannot honour as the engine protocol defines them.

    Refused: greedy (`top_k == 1`) at a temperature other than 1 (vLLM samples greedy rows at temperature 0 and
    reports their log-probs unscaled, `log_softmax(logits)`, where the protocol's are `log_softmax(logits / T)`),
    and a frequency penalty over a window (vLLM's counts every generated token) or outside vLLM's range once scaled
    (astrai subtracts `penalty * count` from `logits / T`, which is vLLM's `frequency_penalty = penalty * T` on the
    unscaled logits).
    """
    if params.top_k == 1 and params.temperature != 1.0:
        raise ValueError(f"rollout.engine vllm: greedy sampling (top_k=1) at temperature {params.temperature} is "
                         "refused: vLLM reports greedy rows' log-probs at temperature 1; use temperature 1 with "
                         "top_k=1, or the paged engine")
    if penalty is not None:
        window, value = getattr(penalty, "window", 0), getattr(penalty, "penalty", 0.0)
        if window:
            raise ValueError(f"rollout.engine vllm: a frequency penalty over a window of {window} tokens is refused "
                             "(vLLM counts every generated token); use window 0 or the paged engine")
        if abs(value * params.temperature) > _VLLM_FREQUENCY_PENALTY:
            raise ValueError(f"rollout.engine vllm: frequency penalty {value} at temperature {params.temperature} "
                             f"is vLLM's {value * params.temperature:g}, outside its range [-2, 2]")


def check_vllm_engine(model_config, *, device=None, dtype=None, attention_backend: Optional[str] = None,
                      tensor_parallel_size: int = 1, tp_group: Any = None, **options) -> None:
    """What `vllm_engine` would refuse for a model of `model_config`, without building it (the factory's `check`,
    `python -m astrai.train --check`): vLLM not installed or broken, an option it does not take, a dtype outside
    float32/bfloat16/float16, an attention backend other than auto (vLLM picks its own kernels), an astrai MoE
    model (its config.json is astrai's own model type, which vLLM does not know), `rollout.tensor_parallel_size`
    above 1 (one whole colocated copy per rank here).

    Raises:
        ValueError: one line naming the field.
    """
    if tensor_parallel_size > 1 or tp_group is not None:
        raise ValueError(f"rollout.tensor_parallel_size: the vllm engine holds one whole copy per rank; got "
                         f"{tensor_parallel_size if tensor_parallel_size > 1 else 'a tensor-parallel group'}, "
                         "expected 1 (tensor-parallel rollouts are the paged engine's)")
    check_vllm_options(options)
    try:
        resolve_dtype(dtype)
    except ValueError:
        raise ValueError(f"rollout.dtype: the vllm engine takes float32, bfloat16 or float16, got {dtype!r}") from None
    if attention_backend not in (None, "auto"):
        raise ValueError(f"rollout.attention_backend: the vllm engine picks its own attention kernels; got "
                         f"{attention_backend!r}, expected auto")
    if getattr(model_config, "num_local_experts", 0):
        raise ValueError("rollout.engine: vllm cannot serve astrai's MoE model (its config.json has astrai's own "
                         "model type); use the paged engine")
    _require_vllm()


class VLLMGenerationEngine:
    """A vLLM `LLM` over an inference copy of the policy, behind `GenerationEngine` (`astrai.rollout.engine`).

    Args:
        model: the policy (`AutoRegressiveLM`), whole; its config and weights are exported once to a temporary
            Hugging Face directory that vLLM loads (deleted afterwards).
        pad_token_id: pads prompts and finished responses in the outputs.
        policy_version: the tag of `model`'s weights.
        dtype: the copy's dtype (`float32` / `bfloat16` / `float16` or a torch dtype; None: the model's).
        max_num_seqs: rows vLLM decodes at once; max_model_len: prompt + response tokens per row at most (None:
            the model's `max_position_embeddings`); max_num_batched_tokens: tokens per scheduler step (None:
            vLLM's default); gpu_memory_utilization, kv_cache_memory_bytes: vLLM's KV sizing on GPUs (on CPU:
            the `VLLM_CPU_KVCACHE_SPACE` variable, GiB); prefix_cache: vLLM's automatic prefix caching;
            cuda_graphs: let vLLM capture CUDA graphs (else `enforce_eager`).

    Raises:
        ValueError: one line for vLLM missing, a refused option, dtype or model (`check_vllm_engine`), or vLLM
            failing to build the engine (its first line).
    """

    def __init__(self, model, *, pad_token_id: int, policy_version: int = 0,
                 dtype: Union[None, str, torch.dtype] = None, max_num_seqs: int = 256,
                 max_model_len: Optional[int] = None, max_num_batched_tokens: Optional[int] = None,
                 gpu_memory_utilization: Optional[float] = None, kv_cache_memory_bytes: Optional[int] = None,
                 prefix_cache: bool = True, cuda_graphs: bool = False):
        options = {k: v for k, v in dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                         max_num_batched_tokens=max_num_batched_tokens,
                                         gpu_memory_utilization=gpu_memory_utilization,
                                         kv_cache_memory_bytes=kv_cache_memory_bytes, prefix_cache=prefix_cache,
                                         cuda_graphs=cuda_graphs).items() if v is not None}
        check_vllm_engine(model.config, dtype=dtype, **options)
        # the engine core in this process: weights are handed over as tensors, not pickled to a second process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import vllm
        from vllm.platforms import current_platform

        self.config = model.config
        self.pad_token_id, self.policy_version = pad_token_id, policy_version
        self._dtype = resolve_dtype(dtype) or next(model.parameters()).dtype
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len or model.config.max_position_embeddings
        self._device = torch.device(current_platform.device_type)
        self._sleeps = bool(current_platform.is_sleep_mode_available())
        self._names = _weight_shapes(model)
        self.asleep = False
        self._lock = threading.Lock()
        folder = Path(tempfile.mkdtemp(prefix="astrai-vllm-"))
        try:
            _export(model, folder)
            engine_args = dict(
                model=str(folder), skip_tokenizer_init=True, dtype=str(self._dtype).removeprefix("torch."),
                logprobs_mode="processed_logprobs", generation_config="vllm", seed=0, max_num_seqs=max_num_seqs,
                max_model_len=self.max_model_len, enable_prefix_caching=prefix_cache, enforce_eager=not cuda_graphs,
                enable_sleep_mode=self._sleeps)
            engine_args.update({k: v for k, v in dict(max_num_batched_tokens=max_num_batched_tokens,
                                                      gpu_memory_utilization=gpu_memory_utilization,
                                                      kv_cache_memory_bytes=kv_cache_memory_bytes).items()
                                if v is not None})
            try:
                self.llm = vllm.LLM(**engine_args)
            except Exception as err:  # vLLM's own refusal (an architecture, a size): its first line, one line
                text = str(err).strip().splitlines()
                raise ValueError(f"rollout.engine vllm: vLLM could not build the engine: {type(err).__name__}: "
                                 f"{text[0] if text else ''}") from err
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self._vllm = vllm

    @property
    def device(self) -> torch.device:
        """Where vLLM's weights live (`cpu` for the CPU build); the tensors `generate` returns are on it."""
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype in vLLM."""
        return self._dtype

    @property
    def capacity(self) -> EngineCapacity:
        """Rows at once, KV tokens (vLLM's cache blocks x block size), tokens per step, and `max_model_len`."""
        config = self.llm.llm_engine.vllm_config
        blocks, block_size = config.cache_config.num_gpu_blocks, config.cache_config.block_size
        return EngineCapacity(max_num_seqs=self.max_num_seqs,
                              max_kv_tokens=blocks * block_size if blocks else None,
                              max_batch_tokens=config.scheduler_config.max_num_batched_tokens,
                              max_position_embeddings=self.max_model_len)

    @torch.no_grad()
    def load_weights(self, state_dict: Union[Mapping[str, torch.Tensor], Iterable], policy_version: int) -> int:
        """Stream `state_dict` (HF names; a mapping or an iterable of (name, tensor) pairs, any device and float
        dtype) into vLLM's in-place reload, reset its prefix cache and tag the engine with `policy_version`.

        Each tensor is checked (name, floating point, the parameter's shape) and copied as it arrives (vLLM holds
        a layer's tensors until the layer is complete, and the trainer's stream may reuse a tensor after the next
        item); after the last one every parameter must have come. Returns the acknowledged `policy_version`.

        With tied embeddings the LM head's weight post-processing is re-run after the load
        (`_refresh_tied_layers`: vLLM's reload re-processes only the layers it loaded into, and the CPU build's LM
        head would keep a GEMM handle packed from the old weights).

        Raises:
            KeyError: an unexpected name, or parameters missing; ValueError: a tensor of the wrong shape or type.
                A mapping is checked whole first (the engine then keeps its weights and version); a stream leaves
                the engine untagged (`policy_version` -1), refusing to generate until a complete load.
        """
        if isinstance(state_dict, Mapping):  # checked whole before vLLM takes anything
            for _ in self._checked(state_dict.items(), set(), copy=False):
                pass
            missing = sorted(set(self._names) - set(state_dict))
            if missing:
                raise KeyError(f"load_weights: missing {missing[:3]}; nothing was loaded")
        with self._lock:
            self.policy_version = -1  # until the stream is complete
            if self.asleep and self._sleeps:
                self.llm.wake_up(tags=["weights"])  # the offloaded weights back, the KV cache stays released
            seen: set[str] = set()
            items = state_dict.items() if isinstance(state_dict, Mapping) else state_dict
            self.llm.collective_rpc("reload_weights", kwargs=dict(
                weights_iterator=self._checked(items, seen), is_checkpoint_format=True))
            missing = sorted(set(self._names) - seen)
            if missing:
                raise KeyError(f"load_weights: missing {missing[:3]}")
            self.llm.apply_model(_refresh_tied_layers)
            if not self.llm.reset_prefix_cache():  # KV of the old weights must not serve the new version
                raise RuntimeError("load_weights: vLLM did not reset its prefix cache; the engine stays untagged")
            self.policy_version = policy_version
            return self.policy_version

    def _checked(self, items: Iterable, seen: set[str], copy: bool = True):
        """(name, tensor) pairs as vLLM takes them: names checked against the policy's, each tensor copied in the
        engine's dtype on its device (the caller's may be reused after the next item); `lm_head.weight` of tied
        embeddings is skipped (vLLM ties it itself)."""
        for name, tensor in items:
            if name not in self._names:
                if name == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue
                raise KeyError(f"load_weights: unexpected {name!r}")
            shape = self._names[name]
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tuple(tensor.shape) != shape:
                got = (f"{type(tensor).__name__} of shape {tuple(tensor.shape)}, dtype {tensor.dtype}"
                       if isinstance(tensor, torch.Tensor) else type(tensor).__name__)
                raise ValueError(f"load_weights: {name}: expected a floating-point tensor of shape {shape}, got {got}")
            seen.add(name)
            yield name, (tensor.detach().to(device=self._device, dtype=self._dtype, copy=True) if copy else tensor)

    def sleep(self) -> None:
        """Release the KV memory until `wake()`: vLLM's sleep level 1 where the platform has a sleep mode (the
        weights go to host memory and come back on `wake`); on the CPU build only the `asleep` mark."""
        with self._lock:
            if self.asleep:
                return
            if self._sleeps:
                self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        """Take the KV memory back (vLLM's `wake_up`); a no-op when awake."""
        with self._lock:
            if not self.asleep:
                return
            if self._sleeps:
                self.llm.wake_up()
            self.asleep = False

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: Union[SamplingParams, Sequence[SamplingParams]],
                 generator: Optional[torch.Generator] = None, *, n: int = 1, penalties: Any = None,
                 on_token: Optional[Callable[[int, int], None]] = None) -> Generation:
        """Sample `n` responses per prompt (row b * n + g is sample g of prompt b), as the paged engine does.

        Args:
            prompts: B lists of prompt token ids (each non-empty, in [0, vocab_size)).
            params: one `SamplingParams` for all prompts, or one per prompt.
            generator: caller RNG; one int64 is drawn from it per call, and row i samples with vLLM seed
                `request_seed(base, i)` (None: torch's default RNG).
            n: samples per prompt.
            penalties: an optional `FrequencyPenalty` for all prompts, or one (or None) per prompt
                (`check_sampling` says which vLLM can apply).
            on_token: refused (vLLM's offline `generate` returns whole responses; stream with the paged engine).

        Returns:
            `Generation`: prompt_ids (B*n, P) left-padded, prompt_mask, response_ids (B*n, T) right-padded,
            action_mask, old_logprobs (B*n, T) float32 (vLLM's processed log-probs; 0 at padding), finished (a stop
            token ended the row), policy_version.

        Raises:
            ValueError: as the paged engine's `generate` for bad prompts, n, params or lengths (here:
                `max_model_len`), and `check_sampling`'s refusals; RuntimeError: while asleep or untagged.
        """
        with self._lock:
            if self.asleep:
                raise RuntimeError("generate: the engine is asleep; call wake() first")
            if self.policy_version == -1:
                raise RuntimeError("generate: the engine's weights are incomplete (a failed load_weights); load "
                                   "them again first")
            if on_token is not None:
                raise ValueError("generate: rollout.engine vllm returns whole responses; on_token (per-token "
                                 "streaming) is the paged engine's")
            prompts = check_prompt_ids(prompts, self.config.vocab_size)
            requests = self._requests(prompts, params, generator, n, penalties)
            outputs = self.llm.generate([self._vllm.TokensPrompt(prompt_token_ids=p) for p, _ in requests],
                                        [sp for _, sp in requests], use_tqdm=False)
            return self._assemble(prompts, outputs, n)

    def _requests(self, prompts, params, generator, n, penalties) -> list[tuple[list[int], Any]]:
        """(prompt ids, vLLM SamplingParams) per output row, each row with its own seed."""
        per_params, per_penalty = per_prompt_settings(prompts, params, n, penalties)
        base = draw_base_seed(generator)
        rows = []
        for b, prompt in enumerate(prompts):
            p, penalty = per_params[b], per_penalty[b]
            check_sampling(p, penalty)
            if len(prompt) + p.max_new_tokens > self.max_model_len:
                raise ValueError(f"generate: prompt {b} ({len(prompt)} tokens) + max_new_tokens {p.max_new_tokens} "
                                 f"exceeds the vllm engine's max_model_len {self.max_model_len}")
            greedy = p.top_k == 1
            common = dict(max_tokens=p.max_new_tokens, temperature=0.0 if greedy else p.temperature,
                          top_k=0 if greedy else p.top_k, top_p=1.0 if greedy else p.top_p,
                          stop_token_ids=list(p.stop_token_ids), ignore_eos=True, logprobs=0, flat_logprobs=True,
                          detokenize=False, skip_special_tokens=False,
                          frequency_penalty=(penalty.penalty * p.temperature) if penalty is not None else 0.0)
            for g in range(n):
                rows.append((list(prompt), self._vllm.SamplingParams(seed=request_seed(base, b * n + g), **common)))
        return rows

    def _assemble(self, prompts, outputs, n: int) -> Generation:
        """The vLLM outputs (in request order) as a `Generation`."""
        prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(n)], self.pad_token_id, self._device)
        completions = [out.outputs[0] for out in outputs]
        width = max(len(c.token_ids) for c in completions)
        rows = len(completions)
        response = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((rows, width), dtype=torch.float32)
        mask = torch.zeros((rows, width), dtype=torch.bool)
        for row, c in enumerate(completions):
            t = len(c.token_ids)
            values = c.logprobs.logprobs  # FlatLogprobs: one entry (the sampled token's) per position
            if len(values) != t:
                raise RuntimeError(f"vllm returned {len(values)} log-probs for {t} tokens in row {row}")
            response[row, :t] = torch.tensor(list(c.token_ids), dtype=torch.long)
            logprobs[row, :t] = torch.tensor(values, dtype=torch.float32)
            mask[row, :t] = True
        finished = torch.tensor([c.finish_reason == "stop" for c in completions], dtype=torch.bool)
        device = self._device
        return Generation(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response.to(device),
                          action_mask=mask.to(device), old_logprobs=logprobs.to(device), finished=finished.to(device),
                          policy_version=self.policy_version)


def _refresh_tied_layers(model: torch.nn.Module) -> None:
    """Re-run the weight post-processing of every layer that shares its weight with an earlier one (the LM head of
    tied embeddings): vLLM's reload processes only the layers it loaded into (the embedding), and the CPU build's
    LM head keeps a GEMM handle packed from the old weight otherwise."""
    seen: set[int] = set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter):
            continue
        method = getattr(module, "quant_method", None)
        if id(weight) in seen and method is not None:
            method.process_weights_after_loading(module)
        seen.add(id(weight))


def _weight_shapes(model) -> dict[str, tuple[int, ...]]:
    """The policy's HF weight names and shapes (`hf_state_dict`: tied `lm_head.weight` left out), what a sync
    streams."""
    from astrai.models.llama import hf_state_dict

    return {name: tuple(t.shape) for name, t in hf_state_dict(model).items()}


def _export(model, folder: Path) -> None:
    """`model` as a Hugging Face directory vLLM loads: config.json, generation_config.json, model.safetensors.

    Raises:
        OutputWriteError: one line naming the file and the cause when it cannot be written (a full disk under
            the temporary directory, a file-size limit); the caller removes the folder.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from astrai.models.llama import hf_state_dict
    from astrai.outputs import OutputWriteError

    tensors = {k: v.detach().cpu().contiguous() for k, v in hf_state_dict(model).items()}
    path = folder / "model.safetensors"
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
        path = folder / "config.json"
        path.write_text(json.dumps(model.config.to_hf_dict(), indent=2))
        path = folder / "generation_config.json"
        path.write_text(json.dumps(model.config.generation_config_dict(), indent=2))
    except (OSError, SafetensorError) as err:
        code = re.search(r"\(os error (\d+)\)", str(err)) if isinstance(err, SafetensorError) else None
        if code:  # safetensors' "I/O error: File too large (os error 27)": said as the OSError it is
            err = OSError(int(code.group(1)), os.strerror(int(code.group(1))))
        raise OutputWriteError.of(path, err) from None


def vllm_engine(model, *, pad_token_id: int, policy_version: int = 0, dtype=None,
                attention_backend: Optional[str] = None, tp_group: Any = None, **options) -> VLLMGenerationEngine:
    """The `vllm` entry of the engine factory (`astrai.rollout.engine.build_engine`): a `VLLMGenerationEngine`
    with `options` (`VLLM_OPTIONS`); `attention_backend` must be None or auto (vLLM picks its kernels).

    Raises:
        ValueError: vLLM missing, or a refused option, dtype, backend or model (one line, `check_vllm_engine`)."""
    check_vllm_engine(model.config, dtype=dtype, attention_backend=attention_backend, tp_group=tp_group, **options)
    return VLLMGenerationEngine(model, pad_token_id=pad_token_id, policy_version=policy_version, dtype=dtype,
                                **options)


vllm_engine.check = check_vllm_engine
