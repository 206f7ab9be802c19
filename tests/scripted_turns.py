"""Scripting some turns of a real paged engine (the tiny random model never calls a tool or says what a game wants):
`script_turns` patches an engine in place so that the turns a rule picks are answered with given token ids, on
both the turn-synchronous path (`generate`) and the streaming one (`add_request` / `step`), the same way."""

import dataclasses
from typing import Callable, Optional, Sequence

import torch

from astrai.rollout.streaming import StepOutput


def script_turns(engine, respond: Callable[[object], Optional[Sequence[int]]], logprob: float = -1.0):
    """Patch `engine` (a `PagedGenerationEngine`) in place and return it: a turn for which `respond(params)` (its
    `SamplingParams`) gives ids is answered with them (each with behaviour log-prob `logprob`, the turn finished,
    as if its last id were a stop token); others are the engine's own samples. A scripted turn's prompt is still
    prefilled (one token sampled and dropped), so its blocks enter the prefix cache as a real turn's would."""
    generate, add_request, step = engine.generate, engine.add_request, engine.step
    scripted: dict[int, list[int]] = {}

    def scripted_generate(prompts, params, generator=None, **kwargs):
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        answers = [respond(p) for p in params]
        out = generate(prompts, [p if a is None else dataclasses.replace(p, max_new_tokens=1)
                                 for a, p in zip(answers, params)], generator, **kwargs)
        rows, lps = [], []
        for a, ids, mask, lp in zip(answers, out.response_ids.tolist(), out.action_mask.tolist(),
                                    out.old_logprobs.tolist()):
            rows.append([t for t, m in zip(ids, mask) if m] if a is None else list(a))
            lps.append([v for v, m in zip(lp, mask) if m] if a is None else [logprob] * len(a))
        width = max(map(len, rows))
        return dataclasses.replace(
            out, response_ids=torch.tensor([r + [engine.pad_token_id] * (width - len(r)) for r in rows]),
            action_mask=torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in rows]),
            old_logprobs=torch.tensor([v + [0.0] * (width - len(v)) for v in lps]),
            finished=torch.tensor([bool(d) if a is None else True for a, d in zip(answers, out.finished.tolist())]))

    def scripted_add_request(prompt_ids, params, **kwargs):
        answer = respond(params)
        if answer is None:
            return add_request(prompt_ids, params, **kwargs)
        request = add_request(prompt_ids, dataclasses.replace(params, max_new_tokens=1), **kwargs)
        scripted[request] = list(answer)
        return request

    def scripted_step():
        out = []
        for o in step():
            answer = scripted.pop(o.request_id, None)
            if answer is None:
                out.append(o)
                continue
            last = len(answer) - 1
            out += [StepOutput(o.request_id, o.choice, t, logprob, (), k == last, k == last, o.cached_tokens)
                    for k, t in enumerate(answer)]
        return out

    engine.generate, engine.add_request, engine.step = scripted_generate, scripted_add_request, scripted_step
    return engine


def register_calculator_engine(name: str, model_dir, *, budget: int = 160) -> None:
    """Register the engine `name` (`rollout.engine`): the paged engine whose first turn of each episode (the whole
    `budget` of `rollout.max_new_tokens` still left) answers with a calculator call `12 * 34`, in the tokens of the
    tokenizer of `model_dir`; later turns are the model's own."""
    from astrai.agents.tool_calls import format_tool_call
    from astrai.models import Tokenizer
    from astrai.rollout import engine as engines

    paged = engines.engine_factory("paged")

    def scripted(model, **kwargs):
        tok = Tokenizer.from_dir(model_dir)
        call = tok.encode(format_tool_call("calculator", {"expression": "12 * 34"})) + [tok.eos_token_id]
        return script_turns(paged(model, **kwargs), lambda params: call if params.max_new_tokens == budget else None)

    engines.register_engine(name, scripted)
