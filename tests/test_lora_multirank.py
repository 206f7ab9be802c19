"""LoRA under ddp with 2 processes (gloo): wrapping the policy for data parallelism keeps its parameters' storage,
so the KL reference of a LoRA run (the base sharing the policy's frozen tensors) stays a view, not a copy."""

import os
import socket
import traceback

import torch
from spawn_ranks import spawn_ranks

WORLD = 2


def _worker(rank, tmp, results):
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=(tmp / "port").read_text())
    torch.set_num_threads(1)
    out = {}
    try:
        from astrai.distributed import setup_distributed
        from astrai.distributed.sharding import prepare_trained
        from astrai.models import AutoRegressiveLM, tiny_config
        from astrai.trainer.lora import DEFAULT_TARGET_MODULES, LoraSettings, apply_lora, shared_base_model
        from astrai.trainer.optim import build_optimizer, build_scheduler

        ctx = setup_distributed("cpu", "ddp", mixed_precision="no")
        torch.manual_seed(0)
        policy = AutoRegressiveLM(tiny_config())
        reference = shared_base_model(policy)
        apply_lora(policy, LoraSettings(r=4, alpha=8.0, dropout=0.0, target_modules=DEFAULT_TARGET_MODULES,
                                        use_rslora=False, base_model="tiny"))
        trained = prepare_trained(
            ctx, "policy", policy, max_grad_norm=1.0,
            optimizer=lambda m: build_optimizer([p for p in m.parameters() if p.requires_grad], lr=1e-3,
                                                betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0),
            scheduler=lambda o: build_scheduler(o, name="constant", warmup_steps=0, total_steps=2))
        wrapped = type(trained.module).__name__
        policy_ptrs = {n.removeprefix("module.").replace(".base_layer", ""): p.data_ptr()
                       for n, p in trained.module.named_parameters()}
        shared = [n for n, p in reference.named_parameters() if policy_ptrs.get(n) == p.data_ptr()]
        out = {"wrapped": wrapped, "shared": len(shared), "reference": len(list(reference.parameters()))}
    except Exception:  # noqa: BLE001 - reported to the parent
        out["error"] = traceback.format_exc()
    results.put((rank, out))


def test_ddp_wrapping_keeps_the_lora_reference_a_view_of_the_policy(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        (tmp_path / "port").write_text(str(s.getsockname()[1]))
    outs = spawn_ranks(_worker, tmp_path, WORLD)
    for rank, out in outs.items():
        assert out["wrapped"] == "DistributedDataParallel", rank
        assert out["shared"] == out["reference"] > 0, (rank, out)
