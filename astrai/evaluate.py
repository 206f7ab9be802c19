"""`python -m astrai.evaluate --model PATH --data FILE [...]`: the evaluator's command line
(`astrai.evaluation.cli`; accuracy, pass@k and their intervals: `astrai.evaluation.accuracy`, docs/evaluation.md)."""

import sys

from astrai.evaluation.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
