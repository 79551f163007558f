"""One greedy run of the real engine under a chosen attention backend and memory mode, shared by the
end-to-end tests that compare memory modes with the dense NATIVE_ATTN oracle."""

from fastdeploy import LLM, SamplingParams

# name -> (FD_HEAD_WISE_KV_CACHE, FD_HEAD_WISE_SWA_RECYCLE)
MODES = {"1d": ("0", "1"), "head_wise_recycle_off": ("1", "0"), "head_wise_recycle_on": ("1", "1")}


def greedy_tokens(monkeypatch, prompts, max_tokens, backend, head_wise="0", recycle="1", reserve="1",
                  logprobs=None, **engine_args):
    """(token ids per prompt, the engine) of `max_tokens` greedy tokens for every prompt, eos ignored;
    with `logprobs=k`, (token ids, their top-k logprobs) per prompt: the bits of every step's logits."""
    monkeypatch.setenv("FD_ATTENTION_BACKEND", backend)
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", head_wise)
    monkeypatch.setenv("FD_HEAD_WISE_SWA_RECYCLE", recycle)
    monkeypatch.setenv("FD_RESERVE_OUTPUT_PAGES", reserve)
    llm = LLM(**engine_args)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                logprobs=logprobs), use_tqdm=False)
    if logprobs is None:
        return [o.outputs.token_ids for o in outs], llm.engine
    return [(o.outputs.token_ids, o.outputs.logprobs) for o in outs], llm.engine
