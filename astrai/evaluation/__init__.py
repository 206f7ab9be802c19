"""astrai.evaluation: accuracy of a policy on question/answer prompts, generated with the rollout engine and scored
by a reward (`accuracy`), for `python -m astrai.evaluate` and during training (`callback`)."""
