"""Process groups, data parallelism and collectives (Accelerate), and the choice of engine (ddp, fsdp2, zero1/2/3)."""

from astrai.distributed.context import DistributedContext, run_device, setup_distributed
from astrai.distributed.launch import STRATEGIES, LaunchError, LaunchPlan, resolve_launch

__all__ = ["DistributedContext", "LaunchError", "LaunchPlan", "STRATEGIES", "resolve_launch", "run_device",
           "setup_distributed"]
