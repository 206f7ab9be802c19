"""`python tests/nan_driver.py ARGS`: `astrai.train` with a NaN injected into the loss of chosen optimizer steps, for
the non-finite guard tests (a launched rank cannot be monkeypatched from the test).

ASTRAI_TEST_NAN="STEPS@RANK" (e.g. "2@1": loop step 2 on rank 1; "2-99@0": steps 2 to 99 on rank 0) multiplies the
loss of every micro-batch of those steps by NaN on that rank, inside `Trainer.accumulate_and_step`'s loss function:
what an overflowing forward would give.
"""

import os
import sys

from astrai.trainer.loop import Trainer


def poisoned(spec: str):
    steps, _, rank = spec.partition("@")
    first, _, last = steps.partition("-")
    lo, hi, rank = int(first), int(last or first), int(rank or 0)
    step = Trainer.accumulate_and_step

    def accumulate_and_step(self, trained, micro_batches, loss_fn, *, count):
        if lo <= self.state.global_step + 1 <= hi and self.dist.rank == rank:
            def nan_loss(micro, num_units):
                loss, metrics = loss_fn(micro, num_units)
                return loss * float("nan"), metrics
            return step(self, trained, micro_batches, nan_loss, count=count)
        return step(self, trained, micro_batches, loss_fn, count=count)

    return accumulate_and_step


if __name__ == "__main__":
    Trainer.accumulate_and_step = poisoned(os.environ["ASTRAI_TEST_NAN"])
    from astrai.train import main

    sys.exit(main(sys.argv[1:]))
