"""train.max_minutes (issue 29 part 2): a wall-clock limit on training that stops at the first optimizer-step
boundary after it, publishes a checkpoint (even with checkpoint.save_at_end false) and exits 0; the time is never
checked before the first step, so a run trains at least one step."""

from types import SimpleNamespace

import torch
from fault_jobs import checkpoint_steps, sft_args, steps_of, write_chats

from astrai.config import ConfigError, load_config
from astrai.train import main
from astrai.trainer import faults
from astrai.trainer.faults import StepBoundary, StopSignals

ONE_PROCESS = SimpleNamespace(world_size=1, device=torch.device("cpu"))


def test_the_boundary_says_out_of_time_after_max_minutes_only_when_timed(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(faults.time, "monotonic", lambda: now[0])
    boundary = StepBoundary(StopSignals(), max_minutes=0.5)
    boundary.start()
    now[0] += 29.0
    assert boundary.agree(ONE_PROCESS) == (False, False) and not boundary.out_of_time
    now[0] += 1.0
    assert boundary.agree(ONE_PROCESS, timed=False) == (False, False)
    assert boundary.agree(ONE_PROCESS) == (True, False)
    assert boundary.out_of_time and not boundary.stop  # out of time, no signal
    assert StepBoundary(StopSignals()).agree(ONE_PROCESS) == (False, False)  # no limit


def test_max_minutes_must_be_positive():
    assert load_config(None, ["--train.max_minutes", "2.5"]).train.max_minutes == 2.5
    assert load_config(None).train.max_minutes is None
    try:
        load_config(None, ["--train.max_minutes", "0"])
    except ConfigError as err:
        assert "train.max_minutes" in str(err)
    else:
        raise AssertionError("train.max_minutes 0 was accepted")


def test_a_run_out_of_time_stops_after_one_step_with_a_checkpoint_and_exit_0(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    chats = write_chats(tmp_path / "chats.jsonl")
    code = main(sft_args(tiny_model_dir, out, chats, "--max_steps", 50, "--train.max_minutes", 1e-9,
                         "--checkpoint.save_at_end", "false"))
    assert code == 0
    assert steps_of(out) == [1] and checkpoint_steps(out) == [1]
    assert "stopped at train.max_minutes (1e-09 minutes of training) after 1 step" in capsys.readouterr().out
