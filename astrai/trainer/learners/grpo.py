"""grpo (offline): GRPO (Shao et al. 2024) on stored groups of responses with their rewards.

Each record holds a prompt (`data.prompt_field`), exactly G = `grpo.group_size` responses
(`data.responses_field`, strings), their G scalar rewards (`data.rewards_field`) and optionally the behaviour
log-probs of every response token (`data.logprobs_field`, G lists, at `rollout.temperature`) and the exact
sampled token ids (`response_ids`, G lists of ids in the vocabulary, checked at load time; otherwise a response
is its text's tokens + the end-of-turn id, `special_tokens.response_end_id`). The update is the
online one (`online_grpo.GRPOLearner`, same advantages, validation, loss and minibatching); only the
experience source differs (`StoredGroups`): `rollout.batch_size` records per batch instead of engine samples.

Old-policy fallback: where a record has no behaviour log-probs, `old_logprobs` are computed once per batch by
the policy as it is before the batch's first update (the "old policy" of PPO/GRPO), without a model copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from astrai import train_types
from astrai.data import DataError, PromptSampler
from astrai.data.examples import response_tokens
from astrai.data.records import check_token_ids, load_records, require_str
from astrai.data.sequences import Sequences
from astrai.data.truncation import prompt_ids_and_budget, report_dropped
from astrai.models.special_tokens import response_end_id, stop_token_ids
from astrai.experience.trajectory import Experience
from astrai.forward import response_logprobs, score_in_chunks
from astrai.trainer.models import TrainedModel, build_trained_model, reference_model
from astrai.trainer.learners.online_grpo import GRPOLearner, grpo_learner


@dataclass(frozen=True)
class GroupRecord:
    """One stored group: prompt ids (P_i,), G response id lists, G rewards, G behaviour log-prob lists or None,
    and the G response texts."""

    prompt_ids: list[int]
    response_ids: list[list[int]]
    rewards: list[float]
    logprobs: Optional[list[list[float]]]
    texts: list[str]


class StoredGroups:
    """Experience source of offline GRPO: `collect(policy_version) -> Experience` of B * G rows (no engine).

    Args:
        sampler: endless resumable sampler over `GroupRecord`s; batch_size: B records per batch.
        policy: the trained policy (scores the old-policy fallback); ref_model: frozen reference or None.
        pad_token_id, device, temperature: assembly and scoring settings; chunk_size: rows per no-grad forward.
    """

    def __init__(self, *, sampler, batch_size: int, policy: TrainedModel, ref_model, pad_token_id: int, device,
                 temperature: float, chunk_size: int):
        self.data_sampler, self.batch_size, self.policy, self.ref_model = sampler, batch_size, policy, ref_model
        self.pad_token_id, self.device, self.temperature = pad_token_id, device, temperature
        self.chunk_size = chunk_size
        self.engine = None

    def _score(self, model, sequences) -> torch.Tensor:
        return score_in_chunks(lambda c: response_logprobs(model, c, temperature=self.temperature)[0],
                               sequences, self.chunk_size)

    def collect(self, policy_version: int) -> Experience:
        """The next B stored groups as experience; old log-probs from the data, else from the current policy."""
        records = self.data_sampler.next_batch(self.batch_size)
        prompts = [r.prompt_ids for r in records for _ in r.response_ids]
        responses = [ids for r in records for ids in r.response_ids]
        seqs = Sequences.from_tokens(prompts, responses, pad_token_id=self.pad_token_id, device=self.device)
        mask = seqs.action_mask
        given = torch.zeros(mask.shape, dtype=torch.float32, device=self.device)
        has = torch.zeros(mask.shape[0], dtype=torch.bool, device=self.device)
        row = 0
        for r in records:
            for lp in (r.logprobs or [None] * len(r.response_ids)):
                if lp is not None:
                    given[row, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
                    has[row] = True
                row += 1
        old = given
        if not bool(has.all()):  # old-policy fallback: the current weights, before this batch's updates
            old = torch.where(has[:, None], given, self._score(self.policy.module, seqs))
        ref = self._score(self.ref_model, seqs) * mask if self.ref_model is not None else None
        scores = torch.tensor([x for r in records for x in r.rewards], dtype=torch.float32, device=self.device)
        return Experience(sequences=seqs, old_logprobs=old * mask, ref_logprobs=ref, scores=scores,
                          responses=tuple(t for r in records for t in r.texts), policy_version=policy_version)

    def state_dict(self) -> dict:
        """No state of its own (the data sampler is a checkpoint part of its own)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore (see `state_dict`)."""


def _number_list(value, n: int, what: str, where: str) -> list:
    if not isinstance(value, list) or len(value) != n:
        got = len(value) if isinstance(value, list) else type(value).__name__
        raise DataError(f"{where}: {what} must be a list of grpo.group_size={n} items, got {got}")
    return value


def group_record(row: dict, tokenizer, config, where: str, *, end_id: int,
                 vocab_size: int) -> Optional[GroupRecord]:
    """Tokenise and check one stored group; None when `data.truncation=filter` drops its prompt. Responses
    without `response_ids` are their text's tokens plus `end_id`; given `response_ids` must be integers in
    `[0, vocab_size)`.

    Raises:
        DataError: naming the row, the field and the problem.
    """
    d, g = config.data, config.grpo.group_size
    prompt = require_str(row, d.prompt_field, "data.prompt_field", where)
    texts = _number_list(row[d.responses_field], g, f"field {d.responses_field!r}", where)
    rewards = _number_list(row[d.rewards_field], g, f"field {d.rewards_field!r}", where)
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in rewards):
        raise DataError(f"{where}: field {d.rewards_field!r} must hold finite numbers")
    if not all(isinstance(t, str) for t in texts):
        raise DataError(f"{where}: field {d.responses_field!r} must hold strings")
    ids = row.get("response_ids")
    if ids is not None:
        ids = [check_token_ids(x, vocab_size, field=f"response_ids[{i}]", where=where)
               for i, x in enumerate(_number_list(ids, g, "field 'response_ids'", where))]
    fitted = prompt_ids_and_budget(prompt, tokenizer, d, where)
    if fitted is None:
        return None
    prompt_ids, budget = fitted
    if ids is not None:
        ids = [list(x)[:budget] for x in ids]
    else:
        ids = [response_tokens(t, tokenizer, budget=budget, end_id=end_id) for t in texts]
    logprobs = row.get(d.logprobs_field)
    if logprobs is not None:
        logprobs = _number_list(logprobs, g, f"field {d.logprobs_field!r}", where)
        for i, (lp, toks) in enumerate(zip(logprobs, ids)):
            if not isinstance(lp, list) or len(lp) < len(toks):
                raise DataError(f"{where}: {d.logprobs_field!r}[{i}] needs one log-prob per response token "
                                f"({len(toks)}), got {len(lp) if isinstance(lp, list) else lp!r}")
        logprobs = [list(lp[:len(toks)]) for lp, toks in zip(logprobs, ids)]
    return GroupRecord(prompt_ids=prompt_ids, response_ids=ids, rewards=[float(x) for x in rewards],
                       logprobs=logprobs, texts=list(texts))


def _quiet(message: str) -> None:
    """A log that prints nothing (ranks other than the main one)."""


def grpo_data(config, model_config, tokenizer, *, main: bool = True) -> list:
    """The offline grpo groups of `data.path` (prompt, responses, rewards and optional logprobs / response_ids
    fields), tokenised and checked against the vocabulary; the main rank reports dropped rows. Raises DataError
    for bad data."""
    d = config.data
    rows = load_records(d.path, {"data.prompt_field": d.prompt_field, "data.responses_field": d.responses_field,
                                 "data.rewards_field": d.rewards_field},
                        optional={"data.logprobs_field": d.logprobs_field, "response_ids": "response_ids"})
    end_id = response_end_id(tokenizer, stop_token_ids(model_config, tokenizer))
    vocab_size = min(tokenizer.vocab_size, model_config.vocab_size)
    records = [group_record(row, tokenizer, config, f"{d.path} row {i + 1}", end_id=end_id, vocab_size=vocab_size)
               for i, row in enumerate(rows)]
    records = [r for r in records if r is not None]
    report_dropped(len(records), len(rows), source=d.path, log=print if main else _quiet)
    return records


def build_grpo(config, dist, policy, tokenizer) -> GRPOLearner:
    """Offline grpo from `data.path` groups. Raises DataError for bad data."""
    d, g = config.data, config.grpo
    records = grpo_data(config, policy.config, tokenizer, main=dist.is_main)
    policy = policy.to(dist.device)
    held = train_types.get(config.train.type).models_held(config)  # a KL term's reference
    ref_model = reference_model(dist, policy, config) if held.reference else None
    trained = build_trained_model(config, dist, policy, name="policy")
    sampler = PromptSampler(records, seed=config.train.seed, shuffle=d.shuffle, rank=dist.rank,
                            world_size=dist.world_size)
    source = StoredGroups(sampler=sampler, batch_size=config.rollout.batch_size, policy=trained, ref_model=ref_model,
                          pad_token_id=tokenizer.pad_token_id, device=dist.device,
                          temperature=config.rollout.temperature, chunk_size=g.micro_batch_size)
    return grpo_learner(config, dist, trained, source, online=False)
