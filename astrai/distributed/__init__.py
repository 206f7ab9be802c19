"""Process groups, data parallelism and collectives (Accelerate; FSDP2/ZeRO later)."""

from astrai.distributed.context import DistributedContext, setup_distributed

__all__ = ["DistributedContext", "setup_distributed"]
