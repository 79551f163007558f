"""Offline API: `LLM(model=None, **engine_args).generate(prompts, sampling_params)` and `.chat(messages, ...)`."""

from __future__ import annotations

import itertools
from typing import Optional, Sequence, Union

from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.engine import LLMEngine
from fastdeploy.engine.request import SamplingParams
from fastdeploy.input.chat_template import with_turn_stops

Prompt = Union[str, Sequence[int]]


class LLM:
    def __init__(self, model: Optional[str] = None, **engine_args):
        self.engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model=model, **engine_args))
        self._ids = itertools.count()

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 use_tqdm: bool = True) -> list:
        """One RequestOutput per prompt, in order. Prompts are strings or lists of token ids.

        Every prompt is validated before any runs: a bad one raises ValueError and nothing is queued.
        """
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(rid, prompt, p)
        except ValueError as exc:
            for rid in ids:
                self.engine.abort_request(rid)
            raise ValueError(f"prompt {ids.index(rid)}: {exc}") from None

        final: dict = {}
        bar = _progress(len(ids), use_tqdm)
        wanted = set(ids)
        while wanted - final.keys():
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    final[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [final[rid] for rid in ids]


    def chat(self, messages: Union[list, Sequence[list]],
             sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"}) or a list of them,
        rendered with the checkpoint's chat template; one RequestOutput per conversation."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of messages, or a list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts = [tokenizer.encode_chat(list(c), add_generation_prompt) for c in conversations]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        sampling_params = [with_turn_stops(p, tokenizer.chat_template) for p in sampling_params]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError("prompts must be a string, a list of token ids, or a list of those")
    return list(prompts)


def _progress(total: int, enabled: bool):
    if not enabled or total < 2:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req", dynamic_ncols=True)
