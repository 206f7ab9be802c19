"""Several teachers of on-policy distillation routed by a data column (`distill.teachers` with `distill.route_field`;
TRL#6734's multi-teacher routing): each prompt row is scored by the teacher its column's value names, e.g. the math
rows by a math teacher and the code rows by a code teacher.

The route travels with the row: the rollout runner resolves each sample's teacher from its prompt record
(`route_of`: the column's value, or `DEFAULT_ROUTE` for a value without a teacher of its own when that key is given)
and the experience carries it (`Experience.routes`, one per sample, so the G samples of a GRPO group share their
prompt's). When the teachers score (`TeacherRoutes.response_logprobs`), the rows are grouped by teacher, each group is
scored by its teacher in one batch (a local teacher in the runner's chunks at the sampling temperature, as the single
teacher and the reference are; a served one through `served_teacher.ServedTeacher`) and the log-probs are scattered
back to their rows. A local teacher partitioned over the ranks (fsdp2, zero3) runs collectives in every forward, so
the ranks first agree on how many rows each such teacher scores (their maximum: `agree_counts`) and a rank with fewer
pads its group with repeats of one of its rows, whose scores it drops: every rank calls every partitioned teacher
equally often, in the same order. Top-k logit distillation (`distill.jsd_top_k`, all teachers local) routes the
rows of each micro-batch of the policy update the same way (`TeacherRoutes.score_rows` with the teachers' top-k,
`trainer.learners.topk_distill`), the ranks agreeing on the counts per micro-batch.

Every row's route is checked when the data is read (`check_routes`, at start-up and by `--check`): the column must be
in the data, and a row whose value names no teacher is refused in one line naming the value, the row and the field,
unless `distill.teachers` has a `default` key.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from astrai.data.sequences import Sequences

__all__ = ["DEFAULT_ROUTE", "TeacherRoutes", "check_routes", "route_metrics", "route_of"]

DEFAULT_ROUTE = "default"
"""The `distill.teachers` key whose teacher scores the rows whose route value has no teacher of its own (or that
have no value)."""


def _value(record: Any, route_field: str) -> Optional[str]:
    """The route value of prompt `record` (its `columns[route_field]` as text), or None when it has none (absent or
    null)."""
    value = getattr(record, "columns", {}).get(route_field)
    return None if value is None else str(value)


def route_of(record: Any, routes: Sequence[str], route_field: str, *, source: str = "the data") -> str:
    """The teacher (a key of `routes`, `distill.teachers`) that scores prompt `record` (a record with `.columns` and
    `.index`, e.g. `astrai.data.truncation.EncodedPrompt`): the one its `route_field` column names, else
    `DEFAULT_ROUTE` when `routes` has it.

    Raises:
        ValueError: one line naming the value (or its absence), the row (its index in `source`) and the field, when
            neither exists.
    """
    value = _value(record, route_field)
    if value is not None and value in routes:
        return value
    if DEFAULT_ROUTE in routes:
        return DEFAULT_ROUTE
    row = f"row {getattr(record, 'index', '?')} of {source}"
    what = (f"has no {route_field!r} column" if value is None else
            f"names {value!r} in its {route_field!r} column")
    raise ValueError(f"distill.teachers: {row} {what} (distill.route_field), which no teacher scores (teachers: "
                     f"{', '.join(routes)}); add a teacher for it or a {DEFAULT_ROUTE!r} one")


def check_routes(records: Sequence[Any], routes: Sequence[str], route_field: str, *, source: str) -> None:
    """Refuse data that `distill.teachers` cannot route: the column `route_field` in no row of `records` (the prompt
    records read from `source`, a file or the data.mixture), or a row whose value has no teacher (`route_of`).

    Raises:
        ValueError: one line naming the field and `source` (or, for a row, the value, the row and the field).
    """
    if not any(_value(record, route_field) is not None for record in records):
        raise ValueError(f"distill.route_field: no row of {source} has a {route_field!r} column, which "
                         f"distill.teachers routes the rows by; name a column of the data")
    for record in records:
        route_of(record, routes, route_field, source=source)


class TeacherRoutes:
    """The teachers of `distill.teachers` in the reference model's place: route -> teacher (a frozen module, prepared
    as the reference is, or an object with `response_logprobs(sequences) -> (B, T) float32`, a served teacher). Routes
    naming the same teacher may share one object (it then scores their rows in one batch).

    Args:
        teachers: route -> teacher, in the order they score (the same on every rank).
        route_field: the data column that routes the rows (`distill.route_field`).
        agree_counts: with local teachers partitioned over several ranks, `agree_counts(counts) -> counts`, the
            element-wise maximum over the ranks of an int64 vector (rows per teacher); None: each rank scores its own
            rows only (one process, whole teachers, served ones).
        source: how the data is named in messages (`data.path`, or the data.mixture).
    """

    def __init__(self, teachers: Mapping[str, Any], *, route_field: str,
                 agree_counts: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, source: str = "the data"):
        if not teachers:
            raise ValueError("TeacherRoutes: no teachers")
        self.teachers, self.route_field = dict(teachers), route_field
        self.agree_counts, self.source = agree_counts, source

    @property
    def routes(self) -> tuple[str, ...]:
        """The routes, in scoring order."""
        return tuple(self.teachers)

    def route_of(self, record: Any) -> str:
        """The route whose teacher scores prompt `record` (`route_of`); ValueError when none does."""
        return route_of(record, self.routes, self.route_field, source=self.source)

    def check(self, records: Sequence[Any]) -> None:
        """`check_routes` over the prompt `records` (ValueError, one line)."""
        check_routes(records, self.routes, self.route_field, source=self.source)

    def response_logprobs(self, sequences: Sequences, routes: Sequence[str],
                          score: Callable[[Any, Sequences], torch.Tensor]) -> torch.Tensor:
        """The log-probs (B, T) float32 of `sequences`' response tokens, each row scored by the teacher of its route
        (`routes`, B names of `self.routes`): the rows of each distinct teacher scored together by
        `score(teacher, rows) -> (b, T)` (the runner's: chunked no-grad forwards at the sampling temperature, or the
        served teacher's own), scattered back to their rows (`score_rows`); 0 at padding. Partitioned teachers
        score the agreed number of rows on every rank (see the module docstring).

        Raises:
            ValueError: when `routes` does not hold one known route per row.
        """
        out = self.score_rows(sequences, routes, score)
        if out is None:  # no rows to score
            return torch.zeros(sequences.input_ids.shape[0], sequences.input_ids.shape[1] - sequences.prompt_length,
                               dtype=torch.float32, device=sequences.input_ids.device)
        return out.float()

    def score_rows(self, sequences: Sequences, routes: Sequence[str], score: Callable[[Any, Sequences], Any]):
        """Each row of `sequences` scored by the teacher of its route (`routes`, B names of `self.routes`): the rows
        of each distinct teacher (routes naming one teacher share it) selected together, in route order, and
        `score(teacher, rows)` -> a (b, ...) tensor or a tuple of them (e.g. `forward.response_topk`'s ids and
        log-probs, each (b, T, k)) scattered back to their rows: a (B, ...) tensor or tuple of the scored dtypes and
        shapes. With `agree_counts` the local teachers first agree on their row counts (one call, the maximum over
        the ranks) and a rank with fewer pads each group with repeats of one of its rows (row 0 when it has none of
        that teacher's), whose scores it drops, so every rank calls every local teacher equally often, in the same
        order; a teacher whose agreed count is 0 is not called. None when nothing was scored (no rows anywhere).

        Raises:
            ValueError: when `routes` does not hold one known route per row.
        """
        n = sequences.input_ids.shape[0]
        if len(routes) != n or any(r not in self.teachers for r in routes):
            unknown = sorted(set(routes) - set(self.teachers))
            raise ValueError(f"distill.teachers: {len(routes)} routes for {n} rows"
                             + (f", {unknown[0]!r} not a route ({', '.join(self.teachers)})" if unknown else ""))
        groups: dict[int, tuple[Any, list[int]]] = {}  # one group per distinct teacher object, in route order
        for route in self.teachers:
            groups.setdefault(id(self.teachers[route]), (self.teachers[route], []))
        for row, route in enumerate(routes):
            groups[id(self.teachers[route])][1].append(row)
        local = [key for key, (teacher, _) in groups.items() if isinstance(teacher, torch.nn.Module)]
        wanted = {key: len(rows) for key, (_, rows) in groups.items()}
        if self.agree_counts is not None and local:
            agreed = self.agree_counts(torch.tensor([wanted[key] for key in local], dtype=torch.long))
            wanted.update(zip(local, (int(c) for c in agreed.reshape(-1).tolist())))
        device = sequences.input_ids.device
        out: Optional[list[torch.Tensor]] = None
        single = True
        for key, (teacher, rows) in groups.items():
            if wanted[key] == 0:
                continue
            padded = rows + [rows[0] if rows else 0] * (wanted[key] - len(rows))  # repeats: scored, then dropped
            index = torch.tensor(padded, dtype=torch.long, device=device)
            scored = score(teacher, sequences.select(index))
            single = not isinstance(scored, tuple)
            parts = [scored] if single else list(scored)
            if out is None:
                out = [torch.zeros((n, *part.shape[1:]), dtype=part.dtype, device=device) for part in parts]
            if rows:
                for whole, part in zip(out, parts):
                    whole[index[:len(rows)]] = part[:len(rows)].to(whole)
        if out is None:
            return None
        return out[0] if single else tuple(out)


@torch.no_grad()
def route_metrics(kl: torch.Tensor, action_mask: torch.Tensor, routes: Sequence[str], names: Sequence[str], *,
                  all_reduce_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> dict[str, torch.Tensor]:
    """Per teacher of `names` (every route, so every rank logs the same names): `distill/<route>/reverse_kl`, the
    mean of `kl` (N, T), the per-token reverse-KL estimate `old_logprobs - teacher_logprobs`, over the action tokens
    (`action_mask` (N, T) bool) of the rows routed to it (`routes`, N names), and `distill/<route>/share`, the share
    of the rows routed to it. With `all_reduce_sum` (the sum over data-parallel ranks) both are over every rank's
    rows, so each rank holds the same values; a teacher no row reached has reverse_kl 0 and share 0."""
    rows = torch.tensor([[r == name for r in routes] for name in names], dtype=torch.bool,
                        device=kl.device).reshape(len(names), len(routes))  # (R, N)
    tokens = rows[:, :, None] & action_mask.bool()[None]  # (R, N, T)
    sums = torch.cat([(kl.float()[None] * tokens).sum(dim=(1, 2)), tokens.sum(dim=(1, 2)).float(),
                      rows.sum(dim=1).float(), torch.tensor([float(len(routes))], device=kl.device)])
    if all_reduce_sum is not None:
        sums = all_reduce_sum(sums)
    k = len(names)
    kl_sum, count, routed, total = sums[:k], sums[k:2 * k], sums[2 * k:3 * k], sums[3 * k]
    mean = torch.where(count > 0, kl_sum / count.clamp(min=1), torch.zeros_like(kl_sum))
    share = routed / total.clamp(min=1)
    out = {}
    for i, name in enumerate(names):
        out[f"distill/{name}/reverse_kl"] = mean[i]
        out[f"distill/{name}/share"] = share[i]
    return out
