"""grpo.scale_rewards batch with data parallelism (2 processes, gloo on CPU): every rank divides by the std of all
ranks' rewards, as one process holding the whole rollout would."""

import os
import traceback

import torch
from spawn_ranks import spawn_ranks

WORLD = 2


def _worker(rank, tmp, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank,
                                         world_size=WORLD)
    out = {}
    try:
        from test_grpo import make_experience

        from astrai.trainer.learners.online_grpo import group_rollout

        def all_reduce_sum(t):
            t = t.clone()
            torch.distributed.all_reduce(t)
            return t

        # rank 0 holds groups whose rewards are mostly 1, rank 1 mostly 0: the two ranks' own stds differ
        scores = [[1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0]][rank]
        exp = make_experience(scores, seed=rank)
        for scale in ("batch", "group"):
            out[scale] = group_rollout(exp, group_size=4, std_eps=0.0, scale_rewards=scale,
                                       all_reduce_sum=all_reduce_sum).advantages
        out["alone"] = group_rollout(exp, group_size=4, std_eps=0.0, scale_rewards="batch").advantages
    except Exception:  # noqa: BLE001 - reported to the parent
        out["error"] = traceback.format_exc()
    # plain lists: a tensor crosses the queue as a shared-memory handle that dies with this process
    results.put((rank, {k: v if isinstance(v, str) else v.tolist() for k, v in out.items()}))
    torch.distributed.destroy_process_group()


def test_scale_rewards_batch_uses_every_ranks_rewards(tmp_path):
    from test_grpo import make_experience

    from astrai.trainer.learners.online_grpo import group_rollout

    outs = {rank: {k: v if isinstance(v, str) else torch.tensor(v) for k, v in out.items()}
            for rank, out in spawn_ranks(_worker, tmp_path, WORLD).items()}
    # one process with both ranks' rows: rank 0's eight, then rank 1's
    whole = [make_experience(s, seed=r) for r, s in enumerate(
        [[1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0]])]
    scores = torch.cat([e.scores for e in whole])
    std = scores.std()  # 16 rewards, 7 of them 1: mean 7/16
    for rank, exp in enumerate(whole):
        centered = exp.scores.reshape(-1, 4) - exp.scores.reshape(-1, 4).mean(1, keepdim=True)
        expected = (centered.reshape(-1) / std)[:, None] * exp.sequences.action_mask
        torch.testing.assert_close(outs[rank]["batch"], expected)
        # the rank's own std would give other advantages; group scaling needs no other rank
        assert not torch.allclose(outs[rank]["alone"], expected)
        torch.testing.assert_close(outs[rank]["group"], group_rollout(exp, group_size=4, std_eps=0.0).advantages)
