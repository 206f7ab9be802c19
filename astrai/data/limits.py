"""Start-up checks of the job's length budgets and vocabulary against the loaded model.

Run once, right after the model loads, so that a job that cannot fit stops at once with one line naming the
fields, instead of failing later in a rollout (a long prompt) or in the rotary table / embedding (`IndexError`):

- the longest sequence a train type builds must fit the model's `max_position_embeddings`: online train types
  `data.max_prompt_length + rollout.max_new_tokens`, the others `data.max_length` (prompt and response
  together for dpo and offline grpo, a row for sft and seq);
- the tokenizer may not produce ids the embedding does not have (`tokenizer.vocab_size <= vocab_size`; a larger
  embedding, padded for speed, is normal).
"""

from __future__ import annotations

from astrai.config_schema import ConfigError

__all__ = ["ONLINE_TRAIN_TYPES", "check_model_limits"]

ONLINE_TRAIN_TYPES = ("online_ppo", "online_grpo")


def check_model_limits(config, model_config, tokenizer) -> None:
    """Check `config` (an `astrai.config.Config`) against the loaded model's `ModelConfig` and tokenizer.

    Raises:
        ConfigError: one line naming the fields, their values and the model's limit.
    """
    limit = model_config.max_position_embeddings
    d, source = config.data, config.model.path
    if config.train.type in ONLINE_TRAIN_TYPES:
        need = d.max_prompt_length + config.rollout.max_new_tokens
        if need > limit:
            raise ConfigError(f"data.max_prompt_length ({d.max_prompt_length}) + rollout.max_new_tokens "
                              f"({config.rollout.max_new_tokens}) = {need} exceeds max_position_embeddings "
                              f"({limit}) of model {source}")
    elif d.max_length > limit:
        raise ConfigError(f"data.max_length ({d.max_length}) exceeds max_position_embeddings ({limit}) of "
                          f"model {source}")
    critic_layers = config.ppo.critic_layers if config.train.type == "online_ppo" else None
    if critic_layers is not None and critic_layers > model_config.num_hidden_layers:
        raise ConfigError(f"ppo.critic_layers ({critic_layers}) exceeds the {model_config.num_hidden_layers} "
                          f"decoder layers of model {source}")
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ConfigError(f"model.path {source}: the tokenizer has {tokenizer.vocab_size} tokens but the model's "
                          f"embedding has vocab_size={model_config.vocab_size} rows (ids >= "
                          f"{model_config.vocab_size} cannot be embedded; resize the embedding)")
