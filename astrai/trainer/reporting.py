"""Metric reporters besides metrics.jsonl: TensorBoard event files and Weights & Biases, per `train.report_to`.

Both receive, once per optimizer step, the same scalars as a metrics.jsonl record (every metric key, including
`policy_version`) at `global_step`. They run on the main process only. `tensorboard` and `wandb` are optional
packages, imported when a reporter is built: TensorBoard is on by default when installed (`astrai[tensorboard]`);
W&B only when `train.report_to` names it.

With `train.log_completions`, both also receive each logged rollout's samples (`log_completions`, from
`callbacks.CompletionsLogger`): TensorBoard as a markdown table under the text tag `completions`, W&B as a
`wandb.Table` under the key `completions`; `completion_table` builds the rows both show.
"""

from __future__ import annotations

import html
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from astrai.deps import unavailable_reason
from astrai.outputs import OutputWriteError
from astrai.trainer.loop import Callback

__all__ = ["scalar_record", "completion_table", "completions_markdown", "TensorBoardLogger", "WandbLogger",
           "build_reporters"]

COMPLETIONS_TAG = "completions"
"""The TensorBoard text tag and W&B key of the logged completions."""


def scalar_record(metrics: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Detached 0-dim tensors -> `{key: float}` with one host transfer (keys as in metrics.jsonl, sorted)."""
    names = sorted(metrics)
    if not names:
        return {}
    values = torch.stack([metrics[k].detach().float().cpu().reshape(()) for k in names]).tolist()
    return dict(zip(names, values))


def completion_table(records: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """completions.jsonl records (`callbacks.COMPLETION_FIELDS`) -> `(columns, rows)`, one row per record: the
    record's fields in order, with `rewards` spread into one `rewards/<name>` column per reward function (the names of
    all records, first seen first; None where a function does not apply or a record lacks it)."""
    names = list(dict.fromkeys(name for record in records for name in record.get("rewards", {})))
    columns = ["step", "policy_version", "prompt", "completion", "score", *[f"rewards/{n}" for n in names],
               "advantage", "response_length"]
    rows = [[record["step"], record["policy_version"], record["prompt"], _shown(record["completion"]), record["score"],
             *[record.get("rewards", {}).get(n) for n in names], record["advantage"], record["response_length"]]
            for record in records]
    return columns, rows


def _shown(completion: Any) -> Any:
    """A completion as a table cell: text as it is, an episode's messages (a list) as JSON."""
    return completion if isinstance(completion, str) else json.dumps(completion, ensure_ascii=False, default=str)


_MARKDOWN_SPECIAL = re.compile(r"([\\`*_|~\[\]])")
"""Characters a markdown table cell would read as markup (emphasis, code, links, a cell boundary)."""


def _markdown_cell(value: Any) -> str:
    """One markdown table cell showing `value` as it is: numbers to 4 significant digits, None empty, HTML (a
    `<think>` tag) and markdown characters escaped, line breaks as <br>."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    text = _MARKDOWN_SPECIAL.sub(r"\\\1", html.escape(str(value), quote=False))
    return text.replace("\r\n", "\n").replace("\n", "<br>")


def completions_markdown(records: Sequence[Mapping[str, Any]]) -> str:
    """The rows of `completion_table` as one markdown table (what TensorBoard's text tab renders)."""
    columns, rows = completion_table(records)
    lines = ["| " + " | ".join(map(_markdown_cell, columns)) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_markdown_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class TensorBoardLogger(Callback):
    """Writes every step's metrics as TensorBoard scalars (tag = metrics.jsonl key) into `log_dir`.

    `log_dir` is the run's output_dir, so `tensorboard --logdir outputs` lists each run by its directory. Events
    already in `log_dir` at steps after the one training starts from are purged (hidden by TensorBoard): on a
    resumed run those steps are redone, and a fresh run replaces an earlier run's curves.

    An event file that cannot be written (a full disk ...) raises `OutputWriteError` naming it, from the call that
    finds out (the writer writes in a thread of its own: at the latest the step's flush); the writer's thread then
    prints no traceback of its own (`_quiet_event_writer_thread`). TensorBoard's reader skips a torn last record.

    Raises:
        ValueError: from construction when the `tensorboard` package is missing (one line, with the pip fix) or
            fails to import (the import error's first line).
    """

    def __init__(self, log_dir: str | os.PathLike, *, enabled: bool = True, flush_steps: int = 1):
        reason = unavailable_reason("torch.utils.tensorboard", package="tensorboard",
                                    needed_by="train.report_to: 'tensorboard'",
                                    install="pip install 'astrai[tensorboard]', or set --train.report_to none")
        if reason is not None:
            raise ValueError(reason)
        self.log_dir, self.enabled = Path(log_dir), enabled
        self.flush_steps = flush_steps
        self.writer = None

    def on_train_begin(self, trainer) -> None:
        if not self.enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        _quiet_event_writer_thread()
        try:
            self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=trainer.state.global_step + 1)
        except OSError as err:
            raise OutputWriteError.of(self.log_dir, err) from None

    def _guarded(self, call, *args, **kwargs) -> None:
        """`call(*args, **kwargs)` on the writer; a failed write closes it and raises `OutputWriteError`."""
        try:
            call(*args, **kwargs)
        except OSError as err:
            writer, self.writer = self.writer, None
            path = getattr(getattr(getattr(writer, "file_writer", None), "event_writer", None), "_file_name",
                           self.log_dir)
            try:
                writer.close()
            except OSError:
                pass
            raise OutputWriteError.of(path, err) from None

    def on_step_end(self, trainer, metrics) -> None:
        if self.writer is None:
            return
        step = trainer.state.global_step
        for key, value in scalar_record(metrics).items():
            self._guarded(self.writer.add_scalar, key, value, global_step=step)
        if step % self.flush_steps == 0:
            self._guarded(self.writer.flush)

    def on_log(self, trainer, metrics) -> None:
        """The step-0 record, as a step's."""
        self.on_step_end(trainer, metrics)

    def log_completions(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """One rollout's logged samples as a markdown table (`completions_markdown`) under the text tag
        `completions` at `step`."""
        if self.writer is not None:
            self._guarded(self.writer.add_text, COMPLETIONS_TAG, completions_markdown(records), global_step=step)

    def on_train_end(self, trainer) -> None:
        if self.writer is not None:
            self._guarded(self.writer.close)
            self.writer = None

    def on_train_abort(self, trainer) -> None:
        """The run failed: close the event file (a full disk may refuse the last events: nothing more to do)."""
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.close()
            except OSError:
                pass


def _quiet_event_writer_thread() -> None:
    """TensorBoard writes events in a thread of its own; when a write fails there, the thread prints the exception's
    traceback and the writer raises it again at its next call, which `TensorBoardLogger` says in one line. This
    wraps `threading.excepthook` (once per process) so that that thread's OSError prints nothing; everything else
    goes to the previous hook."""
    import threading

    previous = threading.excepthook
    if getattr(previous, "astrai_event_writer", False):
        return

    def excepthook(args) -> None:
        if isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread":
            return
        previous(args)

    excepthook.astrai_event_writer = True
    threading.excepthook = excepthook


class WandbLogger(Callback):
    """Logs every step's metrics to Weights & Biases (`wandb.log(record, step=global_step)`).

    The run is named after the output directory; `WANDB_PROJECT` picks the project (default "astrai") and the
    usual `WANDB_*` variables apply. The resolved config is attached as the run's config.

    Raises:
        ValueError: from construction when `wandb` is not installed (one line, with the pip fix) or fails to import.
    """

    def __init__(self, output_dir: str | os.PathLike, config: Mapping[str, Any], *, enabled: bool = True):
        reason = unavailable_reason("wandb", needed_by="train.report_to: 'wandb'",
                                    install="pip install wandb, or drop 'wandb' from train.report_to")
        if reason is not None:
            raise ValueError(reason)
        self.output_dir, self.config, self.enabled = Path(output_dir), dict(config), enabled
        self.run = None

    def on_train_begin(self, trainer) -> None:
        if not self.enabled:
            return
        import wandb

        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise OutputWriteError.of(self.output_dir, err) from None
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "astrai"), name=self.output_dir.name,
                              dir=str(self.output_dir), config=self.config)

    def on_step_end(self, trainer, metrics) -> None:
        if self.run is not None:
            self.run.log(scalar_record(metrics), step=trainer.state.global_step)

    def on_log(self, trainer, metrics) -> None:
        """The step-0 record, as a step's."""
        self.on_step_end(trainer, metrics)

    def log_completions(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """One rollout's logged samples as a `wandb.Table` (`completion_table`) under the key `completions` at
        `step`."""
        if self.run is not None:
            import wandb

            columns, rows = completion_table(records)
            self.run.log({COMPLETIONS_TAG: wandb.Table(columns=columns, data=rows)}, step=step)

    def on_train_end(self, trainer) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def build_reporters(report_to: list[str], output_dir: str | os.PathLike, config: Mapping[str, Any], *,
                    enabled: bool) -> list[Callback]:
    """The reporter callbacks `report_to` (`train.report_to`) asks for, in its order; [] for ['none'].

    Args:
        report_to: items among 'tensorboard', 'wandb', 'none' (validated by the config).
        output_dir: the run's output directory (event files go there, beside metrics.jsonl).
        config: the resolved config as a plain dict (attached to the W&B run).
        enabled: False on non-main processes (the callbacks then do nothing).

    Raises:
        ValueError: one line naming `train.report_to` when an asked-for package is not installed.
    """
    reporters: list[Callback] = []
    for name in report_to:
        if name == "tensorboard":
            reporters.append(TensorBoardLogger(output_dir, enabled=enabled))
        elif name == "wandb":
            reporters.append(WandbLogger(output_dir, config, enabled=enabled))
    return reporters
