"""Item: a fresh run in a used output directory. Each run has an id recorded in its checkpoints; keep_last and
`--checkpoint.resume auto` only consider the current run's checkpoints; a fresh start in a directory holding
checkpoints is refused unless `--overwrite_output_dir true`."""

import json
from pathlib import Path

from astrai.checkpoint import (
    Part,
    apply_retention,
    checkpoints_root,
    find_latest_checkpoint,
    list_checkpoints,
    publish_checkpoint,
)
from astrai.models import AutoRegressiveLM, load_pretrained, tiny_config, tiny_tokenizer
from astrai.train import main

REPO = Path(__file__).resolve().parents[1]


def sft_args(model_dir, out, *extra):
    data = out.parent / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i} + {i}?"},
                                                     {"role": "assistant", "content": f"{2 * i}."}]}) + "\n"
                            for i in range(4)))
    return ["--config", str(REPO / "configs/examples/sft.yaml"), "--model.path", str(model_dir),
            "--data.path", str(data), "--train.output_dir", str(out), "--train.per_device_train_batch_size", "2",
            "--train.gradient_accumulation_steps", "1", "--data.max_length", "64", "--train.progress_bar", "false",
            "--checkpoint.save_steps", "1", "--checkpoint.keep_last", "2", *extra]


def model_parts(policy, tokenizer):
    """The policy and tokenizer as checkpoint parts."""
    return {"policy": Part(policy, "hf_model"), "tokenizer": Part(tokenizer, "hf_tokenizer", required=False)}


def run_id_of(path):
    """The run id in a checkpoint's manifest (None when it records none)."""
    return json.loads((path / "manifest.json").read_text()).get("run_id")


def steps(out):
    return [s for s, _ in list_checkpoints(out)]


def test_new_run_in_a_used_directory_keeps_its_own_checkpoints(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    policy, tokenizer = load_pretrained(tiny_model_dir)
    old = publish_checkpoint(out, 10, model_parts(policy, tokenizer),
                             metadata={"policy_version": 10, "train_type": "sft"})  # an older run, no run id
    assert run_id_of(old) is None

    assert main(sft_args(tiny_model_dir, out, "--max_steps", "3")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "already holds 1 checkpoint(s)" in err and "--overwrite_output_dir" in err

    assert main(sft_args(tiny_model_dir, out, "--max_steps", "3", "--overwrite_output_dir", "true")) == 0
    assert steps(out) == [2, 3, 10]  # retention deleted the new run's step 1, not the old run's step 10
    run = run_id_of(checkpoints_root(out) / "step-00000003")
    assert run and run_id_of(checkpoints_root(out) / "step-00000002") == run
    state = json.loads((checkpoints_root(out) / "step-00000003" / "trainer_state.json").read_text())
    assert state["run_id"] == run and json.loads((out / "run.json").read_text())["run_id"] == run
    capsys.readouterr()

    assert main(sft_args(tiny_model_dir, out, "--max_steps", "4", "--checkpoint.resume", "auto")) == 0
    printed = capsys.readouterr().out
    assert "resuming from " + str(checkpoints_root(out) / "step-00000003") in printed
    assert "done: 1 step (resumed at step 3, now at 4)" in printed  # the steps this run made, not the global step
    assert steps(out) == [3, 4, 10] and run_id_of(checkpoints_root(out) / "step-00000004") == run


def test_resume_auto_with_only_other_runs_starts_fresh(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(sft_args(tiny_model_dir, out, "--max_steps", "1")) == 0  # a run with an id: step 1
    old_run = run_id_of(checkpoints_root(out) / "step-00000001")
    (out / "run.json").write_text(json.dumps({"run_id": "another-run"}))  # since then another run started here
    capsys.readouterr()
    assert main(sft_args(tiny_model_dir, out, "--max_steps", "1", "--checkpoint.resume", "auto")) == 0
    assert "resuming" not in capsys.readouterr().out and steps(out) == [1]
    assert run_id_of(checkpoints_root(out) / "step-00000001") not in (old_run, None)  # the fresh run's step 1


def test_resume_auto_continues_checkpoints_written_before_run_ids(tiny_model_dir, tmp_path, capsys):
    """A directory whose checkpoints all predate run ids (no run.json, none records an id) is one earlier run's
    history: `resume auto` continues its newest checkpoint, under a new run id, rather than dropping the work."""
    out = tmp_path / "run"
    assert main(sft_args(tiny_model_dir, out, "--max_steps", "2")) == 0
    for step in (1, 2):  # as written before run ids: no id in the manifest, no run.json
        manifest = checkpoints_root(out) / f"step-0000000{step}" / "manifest.json"
        manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items() if k != "run_id"}))
    (out / "run.json").unlink()
    capsys.readouterr()
    assert main(sft_args(tiny_model_dir, out, "--max_steps", "3", "--checkpoint.resume", "auto")) == 0
    assert "resuming from " + str(checkpoints_root(out) / "step-00000002") in capsys.readouterr().out
    assert run_id_of(checkpoints_root(out) / "step-00000003") is not None


def test_layout_filters_by_run_id(tmp_path):
    model, tok = AutoRegressiveLM(tiny_config(num_hidden_layers=1)), tiny_tokenizer()
    objects = model_parts(model, tok)
    for step, run in ((1, "a"), (2, "b"), (3, "a"), (4, None), (5, "b")):
        publish_checkpoint(tmp_path, step, objects, metadata={"policy_version": step}, run_id=run)
    assert [s for s, _ in list_checkpoints(tmp_path, run_id="a")] == [1, 3]
    assert find_latest_checkpoint(tmp_path, run_id="a").name == "step-00000003"
    assert find_latest_checkpoint(tmp_path, run_id="c") is None
    assert find_latest_checkpoint(tmp_path).name == "step-00000005"
    apply_retention(tmp_path, 1, protect=checkpoints_root(tmp_path) / "step-00000005", run_id="b")
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 3, 4, 5]
    publish_checkpoint(tmp_path, 6, objects, metadata={"policy_version": 6}, run_id="a", keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4, 5, 6]


def test_a_start_that_fails_while_building_leaves_the_run_as_it_was(tiny_model_dir, tmp_path, capsys):
    """Item 8's defect: a fresh start with `--overwrite_output_dir true` that fails after the config is read (a
    model path that holds no model, a data file that does not parse) used to record its new run id in run.json
    first, so the next `--checkpoint.resume auto` found no checkpoint of "the current run" and retrained from step
    0. Now run.json changes only once the job has built."""
    out = tmp_path / "run"
    assert main(sft_args(tiny_model_dir, out, "--max_steps", "2")) == 0
    run = json.loads((out / "run.json").read_text())["run_id"]
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    bad_data = tmp_path / "bad.jsonl"
    bad_data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"\n')
    capsys.readouterr()
    for failing in (("--model.path", str(not_a_model)), ("--data.path", str(bad_data))):
        assert main(sft_args(tiny_model_dir, out, "--max_steps", "3", "--overwrite_output_dir", "true",
                             *failing)) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
        assert json.loads((out / "run.json").read_text())["run_id"] == run
    assert main(sft_args(tiny_model_dir, out, "--max_steps", "3", "--checkpoint.resume", "auto")) == 0
    assert "resuming from " + str(checkpoints_root(out) / "step-00000002") in capsys.readouterr().out
    assert steps(out) == [2, 3] and run_id_of(checkpoints_root(out) / "step-00000003") == run


def test_an_output_dir_under_a_file_is_refused_by_the_check_and_the_run(tiny_model_dir, tmp_path, capsys):
    in_the_way = tmp_path / "afile"
    in_the_way.write_text("x")
    for extra in (("--check",), ()):
        assert main([*extra, *sft_args(tiny_model_dir, tmp_path / "run", "--max_steps", "1", "--train.output_dir",
                                        str(in_the_way / "sub"))]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert f"train.output_dir: {in_the_way} is a file, not a directory" in line
