"""Pieces of the small RL set-ups the tests build by hand: random token-id prompts, and the online experience
source and trained models around a tiny policy (everything else is the product's own code)."""

from types import SimpleNamespace

import torch

from astrai.distributed import setup_distributed
from astrai.trainer.experience import OnlineExperience
from astrai.trainer.models import TrainedModel
from astrai.trainer.optim import build_optimizer, build_scheduler


class RandomPrompts:
    """A data sampler of random prompts (2 to 5 token ids in [3, vocab)), as records with `.prompt` (ids) and an
    empty `.answer`; drawn from one seeded CPU generator, lengths first, then the ids of each prompt."""

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.generator, self.drawn = vocab, torch.Generator().manual_seed(seed), 0

    def next_batch(self, n: int):
        lengths = torch.randint(2, 6, (n,), generator=self.generator).tolist()
        self.drawn += n
        return [SimpleNamespace(prompt=torch.randint(3, self.vocab, (k,), generator=self.generator).tolist(),
                                answer="") for k in lengths]


def trained(model, *, name="policy", lr=3e-3, max_steps=100, dist=None) -> TrainedModel:
    """`model` with AdamW (betas 0.9/0.999, eps 1e-8, no weight decay) and a constant schedule, on CPU."""
    dist = dist or setup_distributed("cpu")
    optimizer = build_optimizer(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    scheduler = build_scheduler(optimizer, name="constant", warmup_steps=0, total_steps=max_steps)
    return TrainedModel(name=name, module=model, optimizer=optimizer, scheduler=scheduler, dist=dist)


def online_experience(policy: TrainedModel, runner, *, vocab: int, batch_size: int, group_size: int = 1,
                      seed: int = 0) -> OnlineExperience:
    """The product's online experience source over `RandomPrompts` (prompts are already token ids)."""
    return OnlineExperience(policy=policy, runner=runner, sampler=RandomPrompts(vocab, seed), encode=lambda p: p,
                            batch_size=batch_size, group_size=group_size, seed=seed, device=torch.device("cpu"))
