"""MoE feed-forward: upcycling keeps the function, routing against a reference loop, the load-balancing loss by
hand, gradient checkpointing, and an sft run whose metrics carry task / auxiliary / weighted auxiliary losses."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from astrai.models import AutoRegressiveLM, tiny_config
from astrai.models.moe import MoEFeedForward, collect_aux_loss, convert_to_moe, load_balancing_loss
from astrai.train import main

REPO = Path(__file__).resolve().parents[1]


def _model():
    torch.manual_seed(0)
    return AutoRegressiveLM(tiny_config(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                        num_key_value_heads=1))


def test_upcycling_keeps_the_dense_function():
    model = _model()
    ids = torch.randint(3, 200, (2, 7))
    before = model(ids)
    convert_to_moe(model, num_experts=4, top_k=2, num_shared_experts=1)
    assert isinstance(model.model.layers[0].mlp, MoEFeedForward)
    torch.testing.assert_close(model(ids), before, rtol=1e-5, atol=1e-5)
    aux, weighted = collect_aux_loss(model)
    assert aux.shape == () and torch.isclose(weighted, 0.01 * aux)
    assert collect_aux_loss(_model()) is None
    with pytest.raises(ValueError, match="top_k"):
        convert_to_moe(_model(), num_experts=2, top_k=3)


def test_routing_matches_a_reference_loop():
    torch.manual_seed(1)
    experts = [torch.nn.Linear(8, 8) for _ in range(3)]
    shared = [torch.nn.Linear(8, 8)]
    moe = MoEFeedForward(experts, shared, hidden_size=8, top_k=2)
    x = torch.randn(2, 5, 8)
    out = moe(x)
    tokens = x.reshape(-1, 8)
    probs = torch.softmax(moe.router(tokens), -1)
    expected = []
    for t, p in zip(tokens, probs):
        g, i = p.topk(2)
        g = g / g.sum()
        expected.append(sum(gi * experts[ii](t) for gi, ii in zip(g, i.tolist())) + shared[0](t))
    torch.testing.assert_close(out.reshape(-1, 8), torch.stack(expected), rtol=1e-5, atol=1e-6)


def test_load_balancing_loss_by_hand():
    uniform = torch.full((4, 2), 0.5)
    assert load_balancing_loss(uniform, torch.tensor([[0], [1], [0], [1]]), 2).item() == pytest.approx(1.0)
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2]])
    # f = (1, 0) (both tokens to expert 0), P = (0.85, 0.15): aux = 2 * 0.85
    assert load_balancing_loss(probs, torch.tensor([[0], [0]]), 2).item() == pytest.approx(1.7)


def test_aux_loss_gradient_survives_gradient_checkpointing():
    grads = []
    for checkpointing in (False, True):
        model = convert_to_moe(_model(), num_experts=3, top_k=1)
        model.train()
        model.gradient_checkpointing = checkpointing
        logits = model(torch.arange(3, 15).reshape(2, 6))
        loss = logits.float().pow(2).mean() + collect_aux_loss(model)[1]
        loss.backward()
        grads.append(model.model.layers[0].mlp.router.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


def test_sft_with_moe_logs_task_and_aux_losses(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    code = main(["--config", str(REPO / "configs/examples/sft.yaml"), "--model.path", str(tiny_model_dir),
                 "--train.output_dir", str(out), "--max_steps", "1", "--train.progress_bar", "false",
                 "--data.max_length", "128", "--model.moe_num_experts", "2", "--model.moe_top_k", "2",
                 "--model.moe_num_shared_experts", "1", "--model.moe_aux_loss_coef", "0.1",
                 "--optim.learning_rate", "1e-3"])
    assert code == 0
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert record["moe/weighted_aux_loss"] == pytest.approx(0.1 * record["moe/aux_loss"], rel=1e-5)
    assert record["train/loss"] > 0
    after = load_file(str(out / "checkpoints/step-00000001/model.safetensors"))
    assert "model.layers.0.mlp.router.weight" in after and "model.layers.1.mlp.shared_experts.0.down_proj.weight" in after
    assert not torch.equal(after["model.layers.0.mlp.router.weight"].abs().sum(), torch.tensor(0.0))


def test_moe_checkpoint_config_describes_the_moe_model_and_loads_again(tmp_path):
    from astrai.checkpoint import Part, publish_checkpoint
    from astrai.config import ConfigError, load_config
    from astrai.models import load_pretrained, tiny_tokenizer
    from astrai.trainer.models import apply_model_options

    model = convert_to_moe(_model(), num_experts=3, top_k=2, num_shared_experts=1, aux_loss_coef=0.05, seed=4)
    path = publish_checkpoint(tmp_path, 1, {"policy": Part(model, "hf_model"),
                                            "tokenizer": Part(tiny_tokenizer(), "hf_tokenizer", required=False)})
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "astrai_llama_moe" and config["architectures"] == ["AstraiLlamaMoeForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["n_shared_experts"]) == (3, 2, 1)
    loaded, _ = load_pretrained(path)
    moe = loaded.model.layers[1].mlp
    assert isinstance(moe, MoEFeedForward) and len(moe.experts) == 3 and moe.top_k == 2 and moe.aux_loss_coef == 0.05
    ids = torch.randint(3, 200, (2, 9))
    torch.testing.assert_close(loaded(ids), model.eval()(ids), rtol=1e-5, atol=1e-5)
    dense = json.loads(json.dumps(_model().config.to_hf_dict()))
    assert dense["model_type"] == "llama" and "num_local_experts" not in dense
    same = load_config(None, ["--model.moe_num_experts", "3", "--model.moe_top_k", "2",
                              "--model.moe_num_shared_experts", "1"])
    assert apply_model_options(same, loaded) is loaded and len(loaded.model.layers[0].mlp.experts) == 3
    with pytest.raises(ConfigError, match="already an MoE model"):
        apply_model_options(load_config(None, ["--model.moe_num_experts", "4"]), loaded)


def test_a_model_built_from_an_moe_config_has_its_experts():
    """`AutoRegressiveLM(config)` with `num_local_experts` builds the MoE layout the config describes (it used to
    build dense feed-forwards silently): the same tensors as a dense model of that shape upcycled, and it saves and
    loads as the config says."""
    config = tiny_config(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                         num_local_experts=3, num_experts_per_tok=2, n_shared_experts=1)
    torch.manual_seed(0)
    built = AutoRegressiveLM(config)
    torch.manual_seed(0)
    dense = AutoRegressiveLM(dataclasses.replace(config, num_local_experts=0))
    convert_to_moe(dense, num_experts=3, top_k=2, num_shared_experts=1)
    assert all(isinstance(layer.mlp, MoEFeedForward) and len(layer.mlp.experts) == 3 for layer in built.model.layers)
    assert built.state_dict().keys() == dense.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(built.state_dict().values(), dense.state_dict().values()))
    assert (built.config.num_local_experts, built.config.num_experts_per_tok, built.config.n_shared_experts) == (3, 2, 1)


def test_the_memory_plan_counts_the_experts_of_an_upcycled_job():
    """A job that upcycles a dense checkpoint (`model.moe_num_experts`) is planned with its experts: the policy's
    parameters are those of the MoE model the job trains, not the checkpoint's."""
    from astrai.config import config_from_dict
    from astrai.trainer.memory_plan import parameter_count, planned_job

    dense = tiny_config()
    job = config_from_dict({"train": {"type": "sft"}, "model": {"moe_num_experts": 4, "moe_top_k": 2}})
    plan, _ = planned_job(job, dense, strategy="ddp", world_size=1, device=torch.device("cpu"))
    policy = next(item for item in plan.items if item.name == "policy parameters")
    moe = parameter_count(dataclasses.replace(dense, num_local_experts=4, num_experts_per_tok=2))
    assert moe > 3 * parameter_count(dense) // 2
    assert policy.bytes == 4 * moe


@pytest.mark.parametrize("fields, message", [
    (dict(num_local_experts=-2), "num_local_experts must be an integer >= 0, got -2"),
    (dict(num_local_experts=2.5), "num_local_experts must be an integer >= 0, got 2.5"),
    (dict(num_local_experts=True, num_experts_per_tok=1), "num_local_experts must be an integer >= 0, got True"),
    (dict(num_local_experts=2, n_shared_experts=-1), "n_shared_experts must be an integer >= 0, got -1"),
    (dict(num_local_experts=2, router_aux_loss_coef=-1.0), "router_aux_loss_coef must be a number >= 0, got -1.0"),
    (dict(num_local_experts=2, num_experts_per_tok=3), "num_experts_per_tok 3 must be in [1, num_local_experts 2]"),
])
def test_bad_moe_fields_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError) as raised:
        tiny_config(**fields)
    assert str(raised.value) == message


def test_upcycling_seeds_only_the_cpu_generator_and_puts_it_back(monkeypatch):
    """The router's seed does not reach CUDA's generators (a model built from an MoE config, or the memory plan
    counting one, must not reseed a job's GPU randomness) and the CPU generator is put back as it was."""
    model = _model()
    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    state = torch.random.get_rng_state()
    convert_to_moe(model, num_experts=2, top_k=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    AutoRegressiveLM(tiny_config(num_local_experts=2, num_experts_per_tok=1))
    assert seeded == []
    torch.random.set_rng_state(state)
