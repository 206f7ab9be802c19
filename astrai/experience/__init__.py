"""astrai.experience: what the rollout-replaying train types learn from. The rollout runner turns prompts into
scored samples with a generation engine (`runner`), experience sources draw them batch after batch (`sources`,
built from the job by `build` with the prompts of `prompts`), the train type pins its targets on them (`result`)
and replays them in minibatches (`replay`)."""
