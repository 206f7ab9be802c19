"""Top-k logit distillation from a local teacher (`distill.jsd_top_k` > 0; GKD's generalised JSD, Agarwal et al. 2024):
a loss term added to the policy loss of the train types that distill (online_grpo, online_ppo).

Each micro-batch of the policy update: the frozen teacher (the one `distill.teacher` loads, which also scores the
sampled tokens for the per-token advantage) scores the student's sampled sequences without grad and keeps its top-k
token ids and log-probs at every action token (`forward.response_topk`: `chunk_size` rows per forward, the LM head
applied a few hundred positions at a time, so only (b, T, k) results are kept, never (B, T, V)); the student's
training forward, the one that gives the policy loss its log-probs, also gathers its log-probs at those ids
(`forward.response_logprobs_at`); the per-token `algos.topk_jsd` (both distributions renormalised over the k ids)
is aggregated over the action tokens as the policy loss is (`loss_agg_mode`, the step's global units) and added
times `distill.jsd_coef`. Both sides use the sampling temperature, as every scoring does (docs/conventions.md
section 2). `distill/jsd` logs the unweighted term (a token-mean share, as `policy/entropy`; each token's JSD
counted at 0 where rounding makes it slightly negative). With `distill.jsd_coef` 0 the term is computed and logged
but adds nothing to the loss (monitoring the divergence costs the teacher's top-k forward all the same).

The teacher runs once per micro-batch per epoch (with `epochs` > 1 its top-k is recomputed on every replay rather
than stored with the rollout: nothing (B, T, k) travels through the experience, the replay or a checkpoint).

Several teachers routed by a data column (`distill.teachers`, all local): the teacher is the runner's
`experience.teachers.TeacherRoutes`, and each row of a micro-batch takes its top-k from its own route's teacher (the
rollout carries each row's route, `RolloutResult.routes`, into the micro-batches; a route without a teacher of its own
is `default`, as when the teachers score the sampled tokens): the micro-batch's rows of each distinct teacher go
through that teacher's `response_topk` together and the results are scattered back (`TeacherRoutes.score_rows`).
With partitioned teachers (fsdp2, zero3) the ranks first agree per micro-batch on each teacher's row count (their
maximum) and a rank with fewer pads with repeats of one of its rows whose results it drops, so every rank runs each
teacher's forward equally often. Logged beside `distill/jsd`: `distill/<route>/jsd`, each route's token mean of the
JSD over the action tokens of its rows in the step on every rank (0 when none), `route_metrics`.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch

from astrai.algos import aggregate_loss, metric_agg_mode, topk_jsd
from astrai.config import ConfigError
from astrai.data.sequences import Sequences
from astrai.experience.teachers import TeacherRoutes
from astrai.forward import response_logprobs_at, response_topk
from astrai.models.wrappers import bare_module

__all__ = ["TopKDistillation", "check_top_k", "topk_distillation"]


class TopKDistillation:
    """The top-k logit distillation term of the policy update (see the module docstring).

    Args:
        teacher: the frozen local teacher (a module prepared for inference like the reference model), or the
            routed local teachers of `distill.teachers` (`TeacherRoutes`: each row's top-k from its route's).
        top_k: k >= 1, the teacher's tokens per position (`distill.jsd_top_k`).
        beta: GKD's interpolation in [0, 1] (0 forward KL, 1 reverse KL; `distill.jsd_beta`).
        coef: the term's weight in the loss (`distill.jsd_coef`).
        temperature: the sampling temperature (both distributions are scored at it).
        chunk_size: rows per no-grad teacher forward.
        loss_agg_mode: the policy loss's aggregation (`algos.LOSS_AGG_MODES`); loss_scale_factor: its L.

    Raises:
        ValueError: `top_k < 1` or `beta` outside [0, 1].
    """

    def __init__(self, teacher: torch.nn.Module | TeacherRoutes, *, top_k: int, beta: float, coef: float,
                 temperature: float, chunk_size: int, loss_agg_mode: str = "token-mean",
                 loss_scale_factor: Optional[float] = None):
        if top_k < 1 or not 0.0 <= beta <= 1.0:
            raise ValueError(f"TopKDistillation: top_k must be >= 1 and beta in [0, 1], got {top_k} and {beta}")
        self.teacher, self.top_k, self.beta, self.coef = teacher, top_k, beta, coef
        self.temperature, self.chunk_size = temperature, chunk_size
        self.loss_agg_mode, self.loss_scale_factor = loss_agg_mode, loss_scale_factor
        self._route_sums: Optional[torch.Tensor] = None  # (2R,): per route the JSD sum, then the token count

    @property
    def routes(self) -> tuple[str, ...]:
        """The routes of routed teachers (`TeacherRoutes.routes`), in scoring order; () for one teacher."""
        return self.teacher.routes if isinstance(self.teacher, TeacherRoutes) else ()

    def teacher_topk(self, sequences: Sequences,
                     routes: Optional[Sequence[str]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's top-k ids (B, T, k) int64 and log-probs (B, T, k) float32 at the action tokens of
        `sequences` (`forward.response_topk`; 0 elsewhere); with routed teachers each row's from the teacher of its
        route (`routes`, B names: `TeacherRoutes.score_rows`, the ranks agreeing on each partitioned teacher's row
        count).

        Raises:
            ValueError: routed teachers without one known route per row.
        """
        def topk(teacher, rows: Sequences):
            return response_topk(teacher, rows, k=self.top_k, temperature=self.temperature,
                                 chunk_size=self.chunk_size)

        if not isinstance(self.teacher, TeacherRoutes):
            return topk(self.teacher, sequences)
        if routes is None:
            raise ValueError("distill.jsd_top_k: several routed teachers (distill.teachers) and a micro-batch that "
                             "carries no routes to pick each row's teacher by")
        scored = self.teacher.score_rows(sequences, routes, topk)
        if scored is None:  # no rows
            shape = (*sequences.action_mask.shape, self.top_k)
            device = sequences.input_ids.device
            return torch.zeros(shape, dtype=torch.long, device=device), torch.zeros(shape, device=device)
        return scored

    def __call__(self, model: torch.nn.Module, sequences: Sequences, num_units: torch.Tensor, *,
                 with_entropy: bool = False, routes: Optional[Sequence[str]] = None):
        """The student's forward over one micro-batch with the distillation term.

        Args:
            routes: with routed teachers, each row's route (B names, `RolloutResult.routes`); ignored otherwise.

        Returns:
            `(logprobs, entropy, loss, metrics)`: the sampled tokens' log-probs (B, T) float32 and entropy (or None),
            as `forward.response_logprobs` gives them (same forward); `loss`, 0-dim, `coef` times the aggregated
            per-token JSD (this micro-batch's share of the step's, over `num_units`); metrics `distill/jsd`, the
            unweighted JSD as a share of the step's token mean (detached). With routed teachers the per-route JSD
            sums and token counts are also accumulated for `route_metrics`.

        Raises:
            ValueError: routed teachers without one known route per row.
        """
        ids, teacher = self.teacher_topk(sequences, routes)
        logprobs, entropy, student = response_logprobs_at(model, sequences, ids, temperature=self.temperature,
                                                          with_entropy=with_entropy)
        mask = sequences.action_mask
        jsd = topk_jsd(student, teacher, beta=self.beta)  # (B, T)
        loss = aggregate_loss(jsd, mask, loss_agg_mode=self.loss_agg_mode, num_units=num_units,
                              loss_scale_factor=self.loss_scale_factor)
        # the metric of a divergence is >= 0: a token where the two agree can round to -1e-9, which the log shows
        counted = jsd.detach().clamp_min(0.0)
        share = aggregate_loss(counted, mask, loss_agg_mode=metric_agg_mode(self.loss_agg_mode), num_units=num_units)
        if self.routes:
            self._accumulate(counted, mask, routes)
        return logprobs, entropy, self.coef * loss, {"distill/jsd": share}

    @torch.no_grad()
    def _accumulate(self, jsd: torch.Tensor, mask: torch.Tensor, routes: Sequence[str]) -> None:
        """Add one micro-batch's per-route JSD sums and action-token counts (jsd, mask (B, T); routes B names)."""
        names = self.routes
        member = torch.tensor([[r == name for r in routes] for name in names], dtype=torch.float32,
                              device=jsd.device).reshape(len(names), len(routes))  # (R, B)
        real = mask.float()
        sums = torch.cat([member @ (jsd.float() * real).sum(-1), member @ real.sum(-1)])
        self._route_sums = sums if self._route_sums is None else self._route_sums + sums

    def reset_route_metrics(self) -> None:
        """Forget the per-route sums accumulated so far (at the start of a policy step)."""
        self._route_sums = None

    def route_metrics(self, *, device: torch.device | str = "cpu",
                      all_reduce_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
                      ) -> dict[str, torch.Tensor]:
        """With routed teachers, per route (every one, so every rank logs the same names) `distill/<route>/jsd`: the
        mean JSD (each token's at >= 0) over the action tokens of the rows routed to it in the micro-batches since
        the last reset, summed over the data-parallel ranks with `all_reduce_sum` (one call on every rank, so each
        holds the same values); 0 for a route no token reached. Resets the sums. {} for one teacher (no call)."""
        names = self.routes
        if not names:
            return {}
        sums = self._route_sums if self._route_sums is not None else torch.zeros(2 * len(names), device=device)
        self._route_sums = None
        if all_reduce_sum is not None:
            sums = all_reduce_sum(sums)
        total, count = sums[:len(names)], sums[len(names):]
        mean = torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))
        return {f"distill/{name}/jsd": mean[i] for i, name in enumerate(names)}


def topk_distillation(config, teacher: Optional[torch.nn.Module | TeacherRoutes], *, chunk_size: int,
                      loss_agg_mode: str, loss_scale_factor: Optional[float]) -> Optional[TopKDistillation]:
    """The top-k distillation term of a validated config (`distill.jsd_top_k`, `distill.jsd_beta`, `distill.jsd_coef`,
    `rollout.temperature`) over the loaded local `teacher` (or the routed local teachers of `distill.teachers`, a
    `TeacherRoutes`); None when `distill.jsd_top_k` is 0.

    Raises:
        ConfigError: `distill.jsd_top_k` above a teacher's vocabulary size, or a teacher that is not a local module.
    """
    d = config.distill
    if not d.jsd_top_k:
        return None
    check_top_k(config, teacher)
    return TopKDistillation(teacher, top_k=d.jsd_top_k, beta=d.jsd_beta, coef=d.jsd_coef,
                            temperature=config.rollout.temperature, chunk_size=chunk_size,
                            loss_agg_mode=loss_agg_mode, loss_scale_factor=loss_scale_factor)


def check_top_k(config, teacher) -> None:
    """Refuse `distill.jsd_top_k` > 0 for a `teacher` that is not a local module, or that has fewer tokens than k
    (its `config.vocab_size`); nothing when `distill.jsd_top_k` is 0. `teacher` is one teacher (as
    `models.teacher_model` gives it), a `TeacherRoutes`, or `models.load_teachers`' answer (route -> teacher, the
    route "" for `distill.teacher`): every routed teacher is checked, its error naming `distill.teachers.<route>`.

    Raises:
        ConfigError: one line naming distill.jsd_top_k.
    """
    k = config.distill.jsd_top_k
    if not k:
        return
    if isinstance(teacher, TeacherRoutes):
        teacher = teacher.teachers
    if isinstance(teacher, Mapping):
        if teacher and set(teacher) != {""}:
            for route, one in teacher.items():
                _check_one(k, one, f"distill.teachers.{route}")
            return
        teacher = teacher.get("")
    _check_one(k, teacher, "")


def _check_one(k: int, teacher, route: str) -> None:
    """`check_top_k` for one teacher; `route`: how an error names a routed one ("" for distill.teacher)."""
    if not isinstance(teacher, torch.nn.Module):
        if route.startswith("distill.teachers."):
            raise ConfigError(f"distill.jsd_top_k: {route} is a served teacher, which returns only the sampled "
                              "tokens' log-probs, not its top-k logits; load every routed teacher locally or set "
                              "distill.jsd_top_k to 0")
        raise ConfigError("distill.jsd_top_k: top-k logit distillation needs a local distill.teacher (a model astrai "
                          "loads), not a served one")
    vocab = getattr(getattr(bare_module(teacher), "config", None), "vocab_size", None)
    if vocab is not None and k > vocab:
        where = f" ({route})" if route else ""
        raise ConfigError(f"distill.jsd_top_k: {k} is more than the teacher's{where} {vocab} tokens; set it <= "
                          f"{vocab}")
