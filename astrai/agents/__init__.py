"""astrai.agents: multi-turn rollouts with tools and environments (issue 39): the units the episode loop
(`astrai.experience.episodes`) runs on.

`tools`: the `Tool` record, its JSON schema derived from type hints and docstring, and the job's tools loaded by
reference. `environments`: environment classes loaded and checked, their public methods as tools, and what their
reset / step / get_reward may return. `tool_calls`: the Hermes-style `<tool_call>` text format for chat templates
without tool support, parsed without ever raising on model output, and calling a tool with its errors turned into
text. `chat`: token-exact incremental rendering (the ids of new non-assistant messages as a template suffix, the
turn separator apart) and the start-up check that a chat template preserves prefixes.
"""
