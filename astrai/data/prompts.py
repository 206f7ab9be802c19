"""Prompt datasets for online RL (online_ppo, online_grpo): loading and deterministic sampling.

A prompt file is jsonl (one JSON object per line; blank lines are skipped), json, parquet, csv, or a directory
written by `datasets.Dataset.save_to_disk` (the non-jsonl ones are read through `datasets`, `data.records`), or a
Hugging Face dataset id ``org/name[@revision][:config[:split]]`` (``openai/gsm8k:main:train``, `data.hub`). The
GSM8K layout is the default: ``question`` and ``answer``, the answer ending in ``#### <final answer>``. The prompt
field holds a plain string or a chat, a list of ``{"role", "content"}`` messages (rendered with the model's chat
template; a plain string with it too, or as raw text, as ``data.chat_template`` says: ``astrai.data.prompt_format``);
the answer field is optional (reward functions may need none); every other field of a record travels
with it as a column (``PromptRecord.columns``: the reward functions receive them by name). The path may be
``builtin:<name>``, which resolves to ``astrai/data/assets/<name>.jsonl`` shipped with the package
(``builtin:math_prompts``: 400 generated grade-school problems, see ``tools/make_math_prompts.py``;
``builtin:code_tasks``: 48 function-writing tasks with unit tests, see ``tools/make_code_tasks.py``), or to a set
made in memory by a generator (``builtin:arithmetic`` and ``builtin:arithmetic_test``, see
``astrai.data.arithmetic``). ``mixture_records`` blends several such files by weight.

Every loading error is a ``DataError`` (a ``ValueError``) with a one-line message naming the file,
the 1-based line (jsonl) or row number and the field concerned.

``PromptSampler`` walks the dataset in epochs. The order of epoch ``e`` is a pure function of
``(seed, e)``; its state is just ``(epoch, position)``, so a resumed run draws exactly the batches
an uninterrupted run would have drawn. With several data-parallel ranks, each draws a disjoint share of every
epoch and the state stays global, so a run also resumes on another number of ranks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence, Union

from astrai.data.files import DataError, generated_records, jsonl_objects, resolve_prompt_path
from astrai.data.records import read_rows

Prompt = Union[str, list]
"""A stored prompt: the question text, or a chat (a list of {"role": str, "content": str} messages)."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt with its reference answer and the rest of its record.

    Attributes:
        prompt: the question text or chat messages, as stored (no chat template applied).
        answer: the reference answer text ("" when the dataset has no answer field).
        index: 0-based position of the record in its dataset (stable across epochs and resumes).
        columns: every field of the record but the prompt field, by name (the answer field included), as
            stored (JSON values); what reward functions receive as keyword arguments.
    """

    prompt: Prompt
    answer: str
    index: int
    columns: Mapping[str, Any] = field(default_factory=dict)


def extract_gsm8k_answer(answer: str) -> str:
    """The final answer of a GSM8K-style solution: the text after the last ``####``, stripped,
    with commas (thousands separators) removed: ``"...\n#### 1,450"`` -> ``"1450"``.

    A text without ``####`` is taken whole (stripped, commas removed), so a bare gold answer
    such as ``"42"`` also works. Never raises for a ``str``; may return ``""``.
    """
    head, sep, tail = answer.rpartition("####")
    return (tail if sep else answer).strip().replace(",", "")


def _field(obj: dict[str, Any], name: str, where: str, key: str = "data.answer_field") -> str:
    """Return ``obj[name]`` as a string or raise a DataError naming the field, its config `key` and location."""
    if name not in obj:
        keys = ", ".join(repr(k) for k in obj) or "none"
        hint = (f"; set {key}: prompt (TRL's prompt column)" if key == "data.prompt_field" and "prompt" in obj
                else "")
        raise DataError(f"{where}: missing field {name!r} ({key}); present keys: {keys}{hint}")
    value = obj[name]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
    return value


def _prompt(obj: dict[str, Any], name: str, where: str) -> Prompt:
    """``obj[name]`` as a prompt: a string, or a non-empty list of messages with string ``role`` and ``content``
    (other keys dropped) whose last message is the user's; DataError naming the field and location otherwise."""
    value = obj.get(name)
    if not isinstance(value, list):
        return _field(obj, name, where, "data.prompt_field")
    if not value:
        raise DataError(f"{where}: field {name!r} is an empty list of messages")
    messages = []
    for i, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise DataError(f"{where}: field {name!r} message {i}: expected {{'role': str, 'content': str}}, got "
                            f"{message!r}"[:300])
        messages.append({"role": message["role"], "content": message["content"]})
    if messages[-1]["role"] != "user":
        raise DataError(f"{where}: field {name!r}: the last message must be the user's (the model answers it), "
                        f"got role {messages[-1]['role']!r}")
    return messages


def read_prompt_records(
    path: Path, *, prompt_field: str = "question", answer_field: str | None = "answer"
) -> list[PromptRecord]:
    """Parse a jsonl prompt file into records, in file order.

    Args:
        path: an existing jsonl file (see ``resolve_prompt_path``).
        prompt_field: key holding the prompt text.
        answer_field: key holding the reference answer; ``None`` when the file has none
            (records then carry ``answer=""``).

    Raises:
        DataError: ``X line N: ...`` for bytes that are not UTF-8, invalid JSON, a value that
            is not an object, a missing field (listing the present keys) or a non-string field;
            ``X: no records ...`` when the file holds no non-blank line.
    """
    records = objects_to_records(jsonl_objects(path), prompt_field=prompt_field, answer_field=answer_field)
    if not records:
        raise DataError(f"{path}: no records (the file is empty or holds only blank lines)")
    return records


def objects_to_records(objects: Iterable[tuple[str, dict]], *, prompt_field: str,
                       answer_field: str | None, require_answers: bool = True) -> list[PromptRecord]:
    """``PromptRecord`` of each ``(location, object)``, indexed in order, every other field kept as a column.

    Without `require_answers` the answer field is optional as a whole: when no record holds it every answer is
    "" (as with `answer_field` None). DataError naming the location for a missing or malformed prompt, an answer
    that is not a string, or a missing answer field (when required, or when some records hold it)."""
    pairs = list(objects)
    has_answers = answer_field is not None and (require_answers or any(answer_field in obj for _, obj in pairs))
    records: list[PromptRecord] = []
    for where, obj in pairs:
        prompt = _prompt(obj, prompt_field, where)
        answer = _field(obj, answer_field, where) if has_answers else ""
        columns = {k: v for k, v in obj.items() if k != prompt_field}
        records.append(PromptRecord(prompt=prompt, answer=answer, index=len(records), columns=columns))
    return records


class PromptDataset:
    """An in-memory list of ``PromptRecord`` loaded from a jsonl file.

    Args:
        path: a jsonl / json / parquet / csv file, a `save_to_disk` directory, ``builtin:<name>`` (e.g.
            ``builtin:math_prompts``, ``builtin:arithmetic``), or a Hugging Face dataset id
            ``org/name[@revision][:config[:split]]`` (`astrai.data.hub`; a local path spelled the same wins).
        prompt_field: key of the prompt text in each object (default ``question``).
        answer_field: key of the reference answer (default ``answer``), or ``None``.
        field: the config key or option named in errors about the path.
        require_answers: every record must hold `answer_field` (else the field may be absent from all records:
            answers are then "").

    Attributes:
        path: the resolved file, the dataset id with its split (a string, ``openai/gsm8k:main:train``), or None
            for a generated built-in set.

    Raises:
        DataError: see ``resolve_prompt_path``, ``read_prompt_records`` and ``astrai.data.hub.load_hub_dataset``.
    """

    def __init__(self, path: str | Path, *, prompt_field: str = "question", answer_field: str | None = "answer",
                 field: str = "data.path", require_answers: bool = True) -> None:
        self.source = str(path)
        self.prompt_field = prompt_field
        self.answer_field = answer_field
        generated = generated_records(path)
        if generated is not None:
            self.path = None
            self.records = objects_to_records(((f"{path} row {i + 1}", obj) for i, obj in enumerate(generated)),
                                              prompt_field=prompt_field, answer_field=answer_field,
                                              require_answers=require_answers)
        else:
            self.path, rows = read_rows(path, field=field)
            self.records = objects_to_records(rows, prompt_field=prompt_field, answer_field=answer_field,
                                              require_answers=require_answers)
            if not self.records:
                raise DataError(f"{self.path}: no records")

    def __len__(self) -> int:
        """Number of records (always >= 1)."""
        return len(self.records)

    def __getitem__(self, index: int) -> PromptRecord:
        """Record at ``index``; raises IndexError when out of range."""
        return self.records[index]

    def __iter__(self) -> Iterator[PromptRecord]:
        """Records in file order."""
        return iter(self.records)

    def __repr__(self) -> str:
        return f"PromptDataset({self.source!r}, records={len(self)})"

    @property
    def has_answers(self) -> bool:
        """Whether its records hold the answer field (else every answer is "")."""
        return self.answer_field is not None and any(self.answer_field in r.columns for r in self.records)


def mixture_records(datasets: Sequence[PromptDataset], weights: Sequence[float], *, seed: int) -> list[PromptRecord]:
    """One epoch's worth of records blended from several datasets by weight (re-indexed 0..N-1).

    N is the datasets' total size; dataset i contributes ``round(N * w_i / sum(w))`` records (at least one): its
    records in a seeded shuffle (``random.Random(f"astrai-mixture:{seed}:{i}")``), cycled when it must contribute
    more than it has, cut when fewer. The blend is a fixed list, so `PromptSampler` shuffles and resumes it as any
    dataset. Each record's columns gain ``source`` (the dataset's path) unless the record already has one.

    Raises:
        DataError: for mismatched lengths, no datasets, or a weight that is not a positive finite number.
    """
    if not datasets or len(datasets) != len(weights):
        raise DataError(f"data.mixture: {len(datasets)} datasets but {len(weights)} weights")
    if any(not (w > 0 and w < float("inf")) for w in weights):
        raise DataError(f"data.mixture: weights must be positive numbers, got {list(weights)}")
    total, mass = sum(len(d) for d in datasets), sum(weights)
    out: list[PromptRecord] = []
    for i, (dataset, weight) in enumerate(zip(datasets, weights)):
        want = max(1, round(total * weight / mass))
        order = list(range(len(dataset)))
        random.Random(f"astrai-mixture:{seed}:{i}").shuffle(order)
        for k in range(want):
            rec = dataset[order[k % len(order)]]
            columns = dict(rec.columns) if "source" in rec.columns else {**rec.columns, "source": dataset.source}
            out.append(PromptRecord(prompt=rec.prompt, answer=rec.answer, index=len(out), columns=columns))
    return out


def epoch_order(num_records: int, *, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The visiting order of epoch ``epoch``: a permutation of ``range(num_records)``.

    A pure function of its arguments: stdlib ``random.Random`` seeded with the string
    ``"astrai-prompts:{seed}:{epoch}"`` (hashed with SHA-512 by ``random``, independent of
    ``PYTHONHASHSEED``, so ``(seed, epoch + 1)`` and ``(seed + 1, epoch)`` differ).
    With ``shuffle=False`` the order is file order in every epoch.
    """
    order = list(range(num_records))
    if shuffle:
        random.Random(f"astrai-prompts:{seed}:{epoch}").shuffle(order)
    return order


class PromptSampler:
    """Endless, resumable batches of prompts, epoch after epoch, each rank drawing its own share.

    The records form one stream: epoch 0's order, then epoch 1's, ... Every rank uses the SAME seed, so the
    stream is the same on all ranks. A call of ``next_batch(b)`` on each of the ``world_size`` ranks consumes the
    next ``b * world_size`` records of the stream, and rank ``r`` takes every ``world_size``-th of them starting at
    its rank, so within an epoch whose length is a multiple of the world size rank ``r`` draws
    ``order[r::world_size]`` (the ranks' shares are disjoint and together cover the epoch once; a batch that crosses
    an epoch boundary continues the interleaving in the next epoch's order). The state, ``(epoch, position)``, is
    in GLOBAL terms (``position``: records of the epoch handed out over all ranks), the same on every rank, so a job
    resumed on another world size continues exactly where the stream was: no record twice, none lost.

    Args:
        dataset: any sequence of ``PromptRecord`` (usually a ``PromptDataset``), non-empty.
        seed: base seed of the epoch orders (the same on every rank).
        shuffle: shuffle each epoch (default) or keep file order.
        rank, world_size: this process's data-parallel rank and the number of ranks (0 and 1: one process).

    Raises:
        DataError: for an empty dataset. ValueError: for a rank outside ``[0, world_size)``.
    """

    def __init__(self, dataset: PromptDataset | list[PromptRecord], *, seed: int = 0, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1) -> None:
        if len(dataset) == 0:
            raise DataError("PromptSampler: the dataset has no records")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"PromptSampler: rank {rank} outside [0, world_size={world_size})")
        self.dataset = dataset
        self.seed = int(seed)
        self.shuffle = shuffle
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.position = 0  # records of the current epoch already handed out, over all ranks
        self._order: list[int] | None = None
        self._drawn = 0

    def _current_order(self) -> list[int]:
        if self._order is None:
            self._order = epoch_order(len(self.dataset), seed=self.seed, epoch=self.epoch, shuffle=self.shuffle)
        return self._order

    @property
    def drawn(self) -> int:
        """Records handed out on this rank by this sampler (monotone; a restored state does not change it)."""
        return self._drawn

    def _take(self, count: int) -> list[int]:
        """The dataset indices of the next ``count`` records of the stream (all ranks'), advancing the state."""
        taken: list[int] = []
        while len(taken) < count:
            order = self._current_order()
            take = min(count - len(taken), len(order) - self.position)
            taken.extend(order[self.position:self.position + take])
            self.position += take
            if self.position == len(order):
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
        return taken

    def next_batch(self, batch_size: int) -> list[PromptRecord]:
        """This rank's next ``batch_size`` records; every rank must call it with the same ``batch_size``. A batch
        that reaches the end of an epoch continues with the start of the next one (so every batch is full, and
        ``batch_size`` may exceed the dataset size).

        Raises:
            ValueError: if ``batch_size`` is not a positive int.
        """
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        indices = self._take(batch_size * self.world_size)[self.rank::self.world_size]
        self._drawn += batch_size
        return [self.dataset[i] for i in indices]

    def state_dict(self) -> dict[str, int | bool]:
        """Plain-JSON state, the same on every rank: ``epoch``, ``position`` (global) and, for validation on
        load, ``seed``, ``shuffle`` and ``num_records``."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "shuffle": self.shuffle, "num_records": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict()`` saved on any world size: the next batches are the ones the saved
        samplers would have drawn next, split over this sampler's ranks.

        Raises:
            DataError: if a key is missing, or the saved seed, shuffle flag or dataset size
                differs from this sampler's (the saved position would point into another order),
                or the position is outside ``[0, num_records)``.
        """
        missing = [k for k in ("epoch", "position", "seed", "num_records") if k not in state]
        if missing:
            raise DataError(f"sampler state: missing keys {missing}; present keys: {sorted(state)}")
        expected = {"seed": self.seed, "num_records": len(self.dataset), "shuffle": self.shuffle}
        for key, value in expected.items():
            if key in state and state[key] != value:
                raise DataError(f"sampler state: saved {key}={state[key]!r} but this run has {key}={value!r}; "
                                "resuming would not continue the same prompt order")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self.dataset):
            raise DataError(f"sampler state: epoch={epoch}, position={position} out of range "
                            f"for {len(self.dataset)} records")
        self.epoch, self.position, self._order = epoch, position, None
