"""Pieces of the small RL set-ups the tests build by hand: random token-id prompts, and the online experience
source and trained models around a tiny policy (everything else is the product's own code)."""

from types import SimpleNamespace

import torch

from astrai.distributed import setup_distributed
from astrai.experience.sources import OnlineExperience
from astrai.rollout.build import build_rollout_engine
from astrai.rollout.engine import sync_weights
from astrai.trainer.models import TrainedModel, build_trained_model
from astrai.trainer.optim import build_optimizer, build_scheduler
from astrai.trainer.learners.policy_gradient import online_experience as wired_online_experience


class RandomPrompts:
    """A data sampler of random prompts (2 to 5 token ids in [3, vocab)), as records with `.prompt_ids` and an
    empty `.answer`; drawn from one seeded CPU generator, lengths first, then the ids of each prompt."""

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.generator, self.drawn = vocab, torch.Generator().manual_seed(seed), 0

    def next_batch(self, n: int):
        lengths = torch.randint(2, 6, (n,), generator=self.generator).tolist()
        self.drawn += n
        return [SimpleNamespace(prompt_ids=torch.randint(3, self.vocab, (k,), generator=self.generator).tolist(),
                                answer="") for k in lengths]


def trained(model, *, name="policy", lr=3e-3, max_steps=100, dist=None) -> TrainedModel:
    """`model` with AdamW (betas 0.9/0.999, eps 1e-8, no weight decay) and a constant schedule, on CPU."""
    dist = dist or setup_distributed("cpu")
    optimizer = build_optimizer(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    scheduler = build_scheduler(optimizer, name="constant", warmup_steps=0, total_steps=max_steps)
    return TrainedModel(name=name, module=model, optimizer=optimizer, scheduler=scheduler, dist=dist)


def online_experience(policy: TrainedModel, runner, *, vocab: int, batch_size: int, group_size: int = 1,
                      seed: int = 0) -> OnlineExperience:
    """The product's online experience source over `RandomPrompts`; the engine syncs to `policy`'s weights."""
    return OnlineExperience(sync_weights=lambda version: sync_weights(runner.engine, policy.full_weights, version),
                            runner=runner, sampler=RandomPrompts(vocab, seed), batch_size=batch_size,
                            group_size=group_size, seed=seed, device=torch.device("cpu"))


def built_online_experience(config, policy, tokenizer, *, chunk_size: int = 2) -> OnlineExperience:
    """The online experience source the online train types make from a loaded config (CPU, no reference)."""
    dist = setup_distributed("cpu")
    engine = build_rollout_engine(config, policy, tokenizer)
    return wired_online_experience(config, dist, build_trained_model(config, dist, policy, name="policy"), tokenizer,
                                   engine=engine, ref_model=None, chunk_size=chunk_size, group_size=1)


def next_prompts(experience: OnlineExperience, n: int) -> tuple[list[list[int]], list]:
    """The prompt ids and the records (the score function's targets) of the next `n` records of an experience
    source's sampler."""
    records = experience.data_sampler.next_batch(n)
    return [r.prompt_ids for r in records], list(records)
