"""astrai.evaluation: how well a policy does on held-out prompts, generated with the rollout engine and scored by
the job's rewards (`accuracy`), for `python -m astrai.evaluate` (`cli`) and during training
(`astrai.trainer.evaluation_callback`)."""
