"""TensorBoard event files beside metrics.jsonl (same keys and values), W&B when asked for, and `astrai.plot`."""

import importlib.machinery
import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch
from PIL import Image

from astrai import plot
from astrai.trainer.reporting import TensorBoardLogger, WandbLogger, build_reporters, scalar_record


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_events(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_have_the_metrics_jsonl_keys_and_values(tiny_ppo_run):
    assert list(tiny_ppo_run.glob("events.out.tfevents.*")), "no event file beside metrics.jsonl"
    records, events = read_metrics(tiny_ppo_run), read_events(tiny_ppo_run)
    keys = set(records[0]) - {"step"}
    assert set(events) == keys
    for record in records:
        for key in keys:
            assert events[key][record["step"]] == pytest.approx(record[key], rel=1e-6, abs=1e-6), key


class FakeTrainer:
    def __init__(self, step=0):
        self.state = types.SimpleNamespace(global_step=step)


def test_tensorboard_logger_purges_redone_steps(tmp_path):
    def run(start, stop, offset):
        trainer = FakeTrainer(start)
        logger = TensorBoardLogger(tmp_path)
        logger.on_train_begin(trainer)
        for step in range(start + 1, stop + 1):
            trainer.state.global_step = step
            logger.on_step_end(trainer, {"rollout/reward_mean": torch.tensor(step + offset)})
        logger.on_train_end(trainer)

    run(0, 4, 0.0)
    run(2, 3, 0.5)  # resumed from step 2: steps 3 and 4 of the first run are hidden
    assert read_events(tmp_path)["rollout/reward_mean"] == {1: 1.0, 2: 2.0, 3: 3.5}


def test_report_to_none_and_disabled_ranks(tmp_path):
    assert build_reporters(["none"], tmp_path, {}, enabled=True) == []
    (reporter,) = build_reporters(["tensorboard"], tmp_path, {}, enabled=False)
    reporter.on_train_begin(FakeTrainer())
    reporter.on_step_end(FakeTrainer(1), {"x": torch.tensor(1.0)})
    reporter.on_train_end(FakeTrainer(1))
    assert not list(tmp_path.iterdir())
    assert scalar_record({"b": torch.tensor(2), "a": torch.tensor([0.5])}) == {"a": 0.5, "b": 2.0}


def test_wandb_asked_but_not_installed(tmp_path, tiny_model_dir, capsys):
    from astrai.train import main

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    with pytest.raises(ValueError, match=r"train.report_to: 'wandb' needs the wandb package.*pip install wandb"):
        build_reporters(["tensorboard", "wandb"], tmp_path, {}, enabled=True)
    code = main(["--config", str(Path(__file__).resolve().parents[1] / "configs/examples/ppo.yaml"), "--model.path", str(tiny_model_dir),
                 "--train.output_dir", str(tmp_path / "run"), "--train.report_to", "wandb"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: train.report_to: 'wandb'") and "\n" not in err
    assert not (tmp_path / "run").exists()


def test_wandb_logger_logs_the_same_record(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, record, step):
            calls.append(("log", record, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kwargs: calls.append(("init", kwargs)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_PROJECT", "proj")
    (reporter,) = build_reporters(["wandb"], tmp_path / "my-run", {"train": {"max_steps": 2}}, enabled=True)
    assert isinstance(reporter, WandbLogger)
    trainer = FakeTrainer()
    reporter.on_train_begin(trainer)
    trainer.state.global_step = 1
    reporter.on_step_end(trainer, {"rollout/kl": torch.tensor(0.25), "policy_version": torch.tensor(1)})
    reporter.on_train_end(trainer)
    assert calls[0] == ("init", {"project": "proj", "name": "my-run", "dir": str(tmp_path / "my-run"),
                                 "config": {"train": {"max_steps": 2}}})
    assert calls[1:] == [("log", {"policy_version": 1.0, "rollout/kl": 0.25}, 1), ("finish",)]


# ------------------------------------------------------------------------------------------------------ plot
def test_plot_main_job_png_size_and_titles(tiny_ppo_run, tmp_path, capsys):
    out = tmp_path / "curves.png"
    assert plot.main([str(tiny_ppo_run), "--output", str(out)]) == 0
    records = read_metrics(tiny_ppo_run)
    expected = [title for key, title in plot.PANELS if any(key in r for r in records)]
    # online_ppo logs every panel's metric (held-out accuracy only with train.eval_steps) but the offline loss
    assert expected == [title for key, title in plot.PANELS if key not in ("eval/accuracy", "train/loss")]
    fig = plot.draw(records)
    assert [ax.get_title() for ax in fig.axes] == expected
    assert all(ax.get_xlabel() == "step" for ax in fig.axes)
    with Image.open(out) as image:
        assert image.format == "PNG"
        rows = math.ceil(len(expected) / plot.COLUMNS)
        assert image.size == (plot.COLUMNS * 400, rows * 300)  # 4 x 3 inch panels at 100 dpi
    assert plot.main([str(tiny_ppo_run)]) == 0 and (tiny_ppo_run / "metrics.png").is_file()


def test_plot_skips_absent_panels_and_torn_lines(tmp_path):
    lines = [json.dumps({"step": s, "rollout/reward_mean": s / 10, "rollout/kl": 0.01 * s, "policy/lr": 1e-6})
             for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 4, "rollout/rew')
    records = plot.read_records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    fig = plot.draw(records)
    assert [ax.get_title() for ax in fig.axes] == ["reward", "KL", "learning rate"]
    assert list(fig.axes[0].lines[0].get_xdata()) == [1, 2, 3]
    assert plot.main([str(tmp_path), "--output", str(tmp_path / "p.png")]) == 0
    with Image.open(tmp_path / "p.png") as image:
        assert image.size == (1200, 300)


def test_plot_draws_held_out_accuracy_at_the_evaluated_steps_first(tmp_path):
    records = [{"step": s, "rollout/reward_mean": s / 10, **({"eval/accuracy": s / 20} if s % 2 == 0 else {})}
               for s in (1, 2, 3, 4)]
    fig = plot.draw(records)
    assert [ax.get_title() for ax in fig.axes] == ["held-out accuracy", "reward"]
    line = fig.axes[0].lines[0]
    assert list(line.get_xdata()) == [2, 4] and list(line.get_ydata()) == [0.1, 0.2]


def test_plot_draws_the_training_loss_of_an_offline_run(tmp_path):
    records = [{"step": s, "train/loss": 2.0 / s, "policy/lr": 1e-5, **({"eval/accuracy": s / 10} if s == 3 else {})}
               for s in (1, 2, 3)]  # an sft run evaluated at its last step
    fig = plot.draw(records)
    assert [ax.get_title() for ax in fig.axes] == ["held-out accuracy", "training loss", "learning rate"]
    assert list(fig.axes[1].lines[0].get_ydata()) == [2.0, 1.0, 2.0 / 3]


def test_plot_minutes_add_up_the_sessions_of_a_resumed_run():
    """`--x minutes`: the elapsed clock restarts at 0 in a resumed session; the sessions before are added on."""
    records = [{"step": 1, "time/elapsed_seconds": 60.0, "rollout/reward_mean": 0.1},
               {"step": 2, "time/elapsed_seconds": 120.0, "rollout/reward_mean": 0.2},
               {"step": 3, "time/elapsed_seconds": 30.0, "rollout/reward_mean": 0.3},  # resumed after step 2
               {"step": 4, "rollout/reward_mean": 0.4},  # no clock: left out of the minutes axis
               {"step": 5, "time/elapsed_seconds": 90.0, "rollout/reward_mean": 0.5}]
    assert plot.training_minutes(records) == {1.0: 1.0, 2.0: 2.0, 3.0: 2.5, 5.0: 3.5}
    # a session that trained for less time than the next one's first step: told by its first step's own time
    short = [{"step": 1, "time/elapsed_seconds": 6.0, "time/step_seconds": 6.0},
             {"step": 2, "time/elapsed_seconds": 12.0, "time/step_seconds": 6.0},
             {"step": 3, "time/elapsed_seconds": 30.0, "time/step_seconds": 30.0},  # resumed: a slow first step
             {"step": 4, "time/elapsed_seconds": 36.0, "time/step_seconds": 6.0}]
    assert plot.training_minutes(short) == {1.0: 0.1, 2.0: 0.2, 3.0: 0.7, 4.0: 0.8}
    assert plot.series(records, "rollout/reward_mean", "minutes") == ([1.0, 2.0, 2.5, 3.5], [0.1, 0.2, 0.3, 0.5])
    assert plot.series(records, "rollout/reward_mean")[0] == [1, 2, 3, 4, 5]
    fig = plot.draw(records, x="minutes")
    assert fig.axes[0].get_xlabel() == "minutes of training"
    assert list(fig.axes[0].lines[0].get_xdata()) == [1.0, 2.0, 2.5, 3.5]


def _eval_run(path, accuracies, seconds_per_step):
    path.mkdir()
    lines = [json.dumps({"step": s, "rollout/reward_mean": a, "time/elapsed_seconds": s * seconds_per_step,
                         "eval/accuracy": a, "eval/accuracy_ci_low": a - 0.1, "eval/accuracy_ci_high": a + 0.1})
             for s, a in enumerate(accuracies, start=1)]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def test_plot_draws_several_runs_over_each_other_with_the_accuracy_interval(tmp_path):
    fast = _eval_run(tmp_path / "bf16", [0.1, 0.3, 0.4], 30.0)
    slow = _eval_run(tmp_path / "fp32", [0.2, 0.3, 0.5], 60.0)
    out = tmp_path / "compare.png"
    assert plot.main([str(fast), str(slow), "--x", "minutes", "--output", str(out)]) == 0
    runs = {"bf16": plot.read_records(fast / "metrics.jsonl"), "fp32": plot.read_records(slow / "metrics.jsonl")}
    fig = plot.draw(runs, x="minutes")
    accuracy, reward = fig.axes
    assert accuracy.get_title() == "held-out accuracy (bars: 95% interval)" and reward.get_title() == "reward"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["bf16", "fp32"]  # once, above the panels
    assert accuracy.get_legend() is None and reward.get_legend() is None
    fast_bars, slow_bars = accuracy.containers  # one errorbar per run: its line, caps and bars
    assert list(fast_bars.lines[0].get_xdata()) == [0.5, 1.0, 1.5]
    assert list(slow_bars.lines[0].get_xdata()) == [1, 2, 3] and list(slow_bars.lines[0].get_ydata()) == [0.2, 0.3, 0.5]
    # each bar spans [ci_low, ci_high] at its evaluation, in its run's colour
    spans = [float(y) for segment in slow_bars.lines[2][0].get_segments() for y in segment[:, 1]]
    assert spans == pytest.approx([0.1, 0.3, 0.2, 0.4, 0.4, 0.6])
    assert slow_bars.lines[0].get_color() != fast_bars.lines[0].get_color()
    assert [line.get_color() for line in reward.lines] == [fast_bars.lines[0].get_color(),
                                                           slow_bars.lines[0].get_color()]
    assert reward.get_xlim() == accuracy.get_xlim()  # one x range for every panel
    with Image.open(out) as image:
        assert image.size == (800, 330)  # two panels and a legend row


def test_plot_names_runs_by_their_last_part_unless_two_share_it():
    assert plot.run_labels(["out/a", "out/b"]) == ["a", "b"]
    assert plot.run_labels(["x/run", "y/run"]) == ["x/run", "y/run"]


def test_plot_of_several_runs_refuses_in_one_line(tmp_path, capsys):
    one = _eval_run(tmp_path / "one", [0.1], 30.0)
    two = tmp_path / "two"
    two.mkdir()
    (two / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/reward_mean": 0.5}) + "\n")  # no clock
    for argv, needle in (([str(one), str(two)], "--output: needed with several run directories (2 given)"),
                         ([str(one), str(tmp_path / "x" / ".." / "one"), "--output", str(tmp_path / "p.png")],
                          "is " + str(one) + " again"),
                         ([str(two), "--x", "minutes"], "metrics.jsonl: no step has time/elapsed_seconds"),
                         ([str(one), "--output", str(one / "metrics.jsonl")], "--output: expected a .png file name"),
                         ([str(one), "--output", ""], "is a directory"),
                         ([str(one), "--dpi", "5"], "--dpi: expected an integer in [10, 1200], got 5"),
                         ([str(one), str(tmp_path / "nope"), "--output", str(tmp_path / "p.png")],
                          "run directory not found")):
        assert plot.main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "p.png").exists() and not (two / "metrics.png").exists()
    assert (one / "metrics.jsonl").read_text().startswith("{")  # not overwritten by a PNG


def test_plot_says_which_run_had_nothing_to_draw_and_leaves_it_out(tmp_path, capsys):
    one = _eval_run(tmp_path / "one", [0.1, 0.2], 30.0)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/reward_mean": 0.5}) + "\n")  # no clock
    assert plot.main([str(one), str(bare), "--x", "minutes", "--output", str(tmp_path / "p.png")]) == 0
    err = capsys.readouterr().err
    assert "warning: bare: nothing to plot (none of the panels' metrics at a step with time/elapsed_seconds); " \
           "left out" in err
    runs = {"one": plot.read_records(one / "metrics.jsonl"), "bare": plot.read_records(bare / "metrics.jsonl")}
    assert [t.get_text() for t in plot.draw(runs, x="minutes").legends[0].get_texts()] == ["one"]


def test_plot_skips_steps_that_are_not_finite_numbers(tmp_path):
    lines = ['{"step": 1, "rollout/reward_mean": 0.1}', '{"step": NaN, "rollout/reward_mean": 0.2}',
             '{"step": 1' + "0" * 400 + ', "rollout/reward_mean": 0.3}', '{"step": true, "rollout/reward_mean": 0.4}']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert [r["step"] for r in plot.read_records(tmp_path / "metrics.jsonl")] == [1]


def test_plot_bad_options_are_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/reward_mean": 0.5}) + "\n")
    (tmp_path / "afile").write_text("x")
    for argv, needle in (([str(tmp_path), "--dpi", "0"], "--dpi: expected an integer in [10, 1200], got 0"),
                         ([str(tmp_path), "--output", str(tmp_path / "afile" / "x.png")], "afile is a file"),
                         ([str(tmp_path), "--output", str(tmp_path)], "is a directory"),
                         ([str(tmp_path / "afile")], "run directory expected, got a file")):
        assert plot.main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "metrics.png").exists()


@pytest.mark.parametrize("content, needle", [
    (None, "run directory not found"),
    ("", "no metrics file"),
    ('{"step": 1, "time/step_seconds": 2.0}\n', "nothing to plot"),
])
def test_plot_bad_input(tmp_path, capsys, content, needle):
    run = tmp_path / "run"
    if content is not None:
        run.mkdir()
        if content:
            (run / "metrics.jsonl").write_text(content)
    assert plot.main([str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_an_error_after_the_progress_bar_is_the_last_line(capsys):
    """A run that fails mid-step: the bar is closed without being redrawn, so the error printed next is the last
    line on the terminal (not glued to a bar that is drawn again after it)."""
    import sys
    from types import SimpleNamespace

    from astrai.trainer.callbacks import ProgressBar

    bar = ProgressBar()
    trainer = SimpleNamespace(state=SimpleNamespace(max_steps=4, global_step=0))
    bar.on_train_begin(trainer)
    bar.on_step_end(trainer, {"rollout/reward_mean": 0.5})
    bar.on_train_abort(trainer)
    print("error: reward.functions.0 (f): returned 1 values for 64 completions", file=sys.stderr)
    bar.on_train_end(trainer)  # nothing left to close or redraw
    err = capsys.readouterr().err
    assert err.replace("\r", "\n").rstrip("\n").splitlines()[-1] == \
        "error: reward.functions.0 (f): returned 1 values for 64 completions"
    assert err.endswith("completions\n")


def test_plot_writes_through_a_link_and_leaves_no_folder_after_a_failed_write(tmp_path, capsys, monkeypatch):
    """A --output that is a symbolic link kept the link and replaced its target (a link to a non-PNG is refused);
    a write that fails removes the folders made for it."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/reward_mean": 0.5}) + "\n")
    target, link = tmp_path / "pngs" / "real.png", tmp_path / "latest.png"
    target.parent.mkdir()
    target.write_bytes(b"old")
    link.symlink_to(target)
    assert plot.main([str(tmp_path), "--output", str(link)]) == 0
    assert link.is_symlink() and target.read_bytes().startswith(b"\x89PNG")
    bad = tmp_path / "to_metrics.png"
    bad.symlink_to(tmp_path / "metrics.jsonl")
    capsys.readouterr()
    assert plot.main([str(tmp_path), "--output", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a link to" in err and "not a .png file" in err and len(err.splitlines()) == 1, err
    assert (tmp_path / "metrics.jsonl").read_text().startswith("{")
    loop, blocked = tmp_path / "loop.png", tmp_path / "blocked.png"
    loop.symlink_to(loop)
    blocked.symlink_to(tmp_path / "metrics.jsonl" / "sub" / "a.png")
    for link, needle in ((loop, "is a symbolic link that does not resolve (a loop)"),
                         (blocked, "metrics.jsonl is a file, not a directory")):
        assert plot.main([str(tmp_path), "--output", str(link)]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
    assert loop.is_symlink() and (tmp_path / "metrics.jsonl").read_text().startswith("{")

    def full_disk(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plot, "write_atomic", full_disk)
    assert plot.main([str(tmp_path), "--output", str(tmp_path / "new" / "deeper" / "p.png")]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert not (tmp_path / "new").exists() and (tmp_path / "pngs").is_dir()
