"""build_optimizer: fused AdamW where every parameter allows it, the same update as the default implementation up to
float rounding, and a checkpointed state that loads and continues exactly."""

import io

import torch

from astrai.models import AutoRegressiveLM, tiny_config
from astrai.trainer.optim import build_optimizer, fused_supported

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def model(seed=0):
    torch.manual_seed(seed)
    return AutoRegressiveLM(tiny_config(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                        num_key_value_heads=1))


def steps(m, optimizer, n, seed=1):
    """`n` optimizer steps on random-token next-token losses."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.randint(0, m.config.vocab_size, (2, 6), generator=g)
        logits = m(ids)
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_fused_is_chosen_for_plain_tensors_and_steps_like_foreach():
    fused_model, foreach_model = model(), model()
    fused = build_optimizer(fused_model.parameters(), **HYPER)
    foreach = build_optimizer(foreach_model.parameters(), **HYPER, fused=False)
    assert fused.param_groups[0]["fused"] is True and not foreach.param_groups[0]["fused"]
    steps(fused_model, fused, 3)
    steps(foreach_model, foreach, 3)
    for (name, a), b in zip(fused_model.named_parameters(), foreach_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert not torch.equal(a, model().get_parameter(name))  # every parameter moved


def test_tensor_subclasses_and_mixed_devices_fall_back():
    class Shard(torch.Tensor):  # stands for FSDP2's DTensor shards
        pass

    plain = torch.nn.Parameter(torch.zeros(3))
    sub = torch.nn.Parameter(torch.zeros(3).as_subclass(Shard))
    assert fused_supported([plain]) and not fused_supported([plain, sub]) and not fused_supported([])
    assert not fused_supported([torch.nn.Parameter(torch.zeros(3, dtype=torch.long), requires_grad=False)])
    assert build_optimizer([plain, sub], **HYPER).param_groups[0]["fused"] is None


def test_checkpointed_fused_state_loads_and_continues_exactly():
    a = model()
    opt_a = build_optimizer(a.parameters(), **HYPER)
    steps(a, opt_a, 2)
    buffer = io.BytesIO()
    torch.save({"model": a.state_dict(), "optimizer": opt_a.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    b = model(seed=5)
    b.load_state_dict(state["model"])
    opt_b = build_optimizer(b.parameters(), **HYPER)
    opt_b.load_state_dict(state["optimizer"])
    steps(a, opt_a, 2, seed=7)
    steps(b, opt_b, 2, seed=7)
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)
    # a state saved by the default implementation (checkpoints written before fused) loads too, and keeps it
    c = model()
    opt_c = build_optimizer(c.parameters(), **HYPER, fused=False)
    steps(c, opt_c, 1)
    opt_d = build_optimizer(model().parameters(), **HYPER)
    opt_d.load_state_dict(opt_c.state_dict())
    assert not opt_d.param_groups[0]["fused"]
