"""`python -m astrai.evaluate --model PATH --data FILE [...]`: the evaluator's command line
(`astrai.evaluation.cli`; accuracy, pass@k and their intervals: `astrai.evaluation.accuracy`, docs/evaluation.md)."""

import sys
from typing import Optional, Sequence

from astrai.evaluation import cli

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`astrai.evaluation.cli.main` with the multi-turn episodes of a job's `rollout.tools` / `rollout.environment`
    (`astrai.experience.build.build_episode_player`); returns the exit code."""
    from astrai.experience.build import build_episode_player

    return cli.main(argv, make_player=build_episode_player)


if __name__ == "__main__":
    import warnings

    from astrai.outputs import show_warning

    warnings.showwarning = show_warning  # "warning: MESSAGE" in one line, as python -m astrai.train says them
    sys.exit(main())
