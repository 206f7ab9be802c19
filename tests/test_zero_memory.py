"""ZeRO-3 in fp32 keeps one fp32 copy of a rank's parameter partition: the master partition DeepSpeed steps shares
its storage (`astrai.distributed.zero_memory`), and the updates equal plain AdamW's (one process, gloo, ~40 s with
DeepSpeed's comm op already compiled)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

SCRIPT = r'''
import torch
from astrai.distributed import setup_distributed
from astrai.distributed.sharding import prepare_trained
from astrai.models import AutoRegressiveLM, tiny_config

torch.manual_seed(0)
model = AutoRegressiveLM(tiny_config())
plain = AutoRegressiveLM(tiny_config())
plain.load_state_dict(model.state_dict())
ctx = setup_distributed("cpu", "zero3", mixed_precision="no")
adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
constant = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0)
trained = prepare_trained(ctx, "policy", model, optimizer=adamw, scheduler=constant, max_grad_norm=1e9)
zero = trained.optimizer
masters, partitions = zero.fp32_partitioned_groups_flat, zero.fp16_partitioned_groups_flat
assert masters and all(m.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
                       for m, p in zip(masters, partitions)), "the fp32 master is a second copy"
reference = adamw(plain)
ids = torch.randint(3, 200, (4, 3, 16), generator=torch.Generator().manual_seed(1))
for batch in ids:
    with trained.gradient_sync(True):
        logits = trained.module(batch)
        trained.backward(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten()))
    trained.step(1e9, lambda: None)
    logits = plain(batch)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten()).backward()
    reference.step()
    reference.zero_grad()
full = dict(trained.full_weights())
worst = max(float((full[n] - p.detach()).abs().max()) for n, p in plain.named_parameters())
moved = max(float((full[n] - p.detach()).abs().max()) for n, p in AutoRegressiveLM(tiny_config()).named_parameters())
print("worst", worst, "moved", moved)
assert worst < 1e-4 and moved > 1e-2, (worst, moved)  # float rounding of the same updates
from astrai.distributed.context import exit_process
exit_process(0)  # DeepSpeed's process group: no interpreter finalization (a gloo thread can abort it)
'''


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_zero3_fp32_master_shares_the_parameter_partition_and_steps_like_adamw():
    env = dict(os.environ, OMP_NUM_THREADS="1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "astrai-torch-extensions"))
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "worst" in done.stdout
