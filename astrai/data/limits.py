"""Start-up checks of the job's length budgets and vocabulary against the loaded model.

Run once, right after the model loads, so that a job that cannot fit stops at once with one line naming the
fields, instead of failing later in a rollout (a long prompt) or in the rotary table / embedding (`IndexError`):

- the longest sequence a train type builds must fit the model's `max_position_embeddings`: train types that
  sample online (`TrainType.online`) `data.max_prompt_length + rollout.max_new_tokens`, the others
  `data.max_length` (prompt and response together for dpo and offline grpo, a row for sft and seq);
- the train type's own limits (`TrainType.check_model`, e.g. the critic's layers);
- the tokenizer may not produce ids the embedding does not have (`tokenizer.vocab_size <= vocab_size`; a larger
  embedding, padded for speed, is normal).
"""

from __future__ import annotations

from astrai import train_types
from astrai.config_schema import ConfigError

__all__ = ["check_model_limits"]


def check_model_limits(config, model_config, tokenizer) -> None:
    """Check `config` (an `astrai.config.Config`) against the loaded model's `ModelConfig` and tokenizer.

    Raises:
        ConfigError: one line naming the fields, their values and the model's limit.
    """
    limit = model_config.max_position_embeddings
    d, source = config.data, config.model.path
    spec = train_types.get(config.train.type)
    if spec.online:
        need = d.max_prompt_length + config.rollout.max_new_tokens
        if need > limit:
            raise ConfigError(f"data.max_prompt_length ({d.max_prompt_length}) + rollout.max_new_tokens "
                              f"({config.rollout.max_new_tokens}) = {need} exceeds max_position_embeddings "
                              f"({limit}) of model {source}")
    elif d.max_length > limit:
        raise ConfigError(f"data.max_length ({d.max_length}) exceeds max_position_embeddings ({limit}) of "
                          f"model {source}")
    spec.check_model(config, model_config)
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ConfigError(f"model.path {source}: the tokenizer has {tokenizer.vocab_size} tokens but the model's "
                          f"embedding has vocab_size={model_config.vocab_size} rows (ids >= "
                          f"{model_config.vocab_size} cannot be embedded; resize the embedding)")
