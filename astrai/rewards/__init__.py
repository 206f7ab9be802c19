"""astrai.rewards: what scores a completion. Reward functions in TRL's convention (`functions`: the user's own, run
in worker processes with timeouts by `workers`; the built-ins, one table `builtins.BUILTIN_REWARDS`; the sandboxed
code-test reward of `code`; a trained reward model, `reward_model`), and the reward of a job built from its config
for training and evaluation (`build`)."""
