"""The model really slides, checkpoints round-trip, and bad input never stops the engine."""

import json

import numpy as np
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.engine import LLMEngine

ALL_SWA = {"sliding_window": 16, "sink_size": 4, "swa_kv_heads": [0, 1, 2, 3]}


def next_token_logprobs(llm, prompt):
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=20), use_tqdm=False)[0]
    return out.outputs.logprobs[0]


@pytest.mark.parametrize("backend,head_wise", [("APPEND_ATTN", "1"), ("APPEND_ATTN", "0"), ("NATIVE_ATTN", "0")])
def test_tokens_outside_every_heads_receptive_field_do_not_matter(monkeypatch, backend, head_wise):
    monkeypatch.setenv("FD_ATTENTION_BACKEND", backend)
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", head_wise)
    llm = LLM(block_size=8, num_gpu_blocks_override=128, max_model_len=256, head_wise_swa_config=ALL_SWA)
    prompt = [3 + (i * 31) % 200 for i in range(100)]
    base = next_token_logprobs(llm, prompt)
    # Two layers of window 16: the last query (t=99) reaches back to position 69, plus sink 0..3.
    outside = list(prompt)
    outside[30] = 250
    assert next_token_logprobs(llm, outside) == base  # exactly: those keys are never read
    inside = list(prompt)
    inside[90] = 250
    assert next_token_logprobs(llm, inside) != base
    sink = list(prompt)
    sink[2] = 250
    assert next_token_logprobs(llm, sink) != base


def test_saved_preset_loads_back_with_the_same_tokens(monkeypatch, tmp_path):
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "1")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(block_size=16, num_gpu_blocks_override=64, max_model_len=512)
    expected = [o.outputs.token_ids for o in llm.generate(["save me", [9] * 200], params, use_tqdm=False)]
    llm.engine.runner.model.save_pretrained(str(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["head_wise_swa"] == {"sliding_window": 128, "sink_size": 16, "swa_kv_heads": [0]}
    reloaded = LLM(model=str(tmp_path), block_size=16, num_gpu_blocks_override=64, max_model_len=512)
    got = [o.outputs.token_ids for o in reloaded.generate(["save me", [9] * 200], params, use_tqdm=False)]
    assert got == expected


def test_checkpoint_with_a_wrong_shape_is_a_clear_error(monkeypatch, tmp_path):
    from safetensors.numpy import load_file, save_file

    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "0")
    llm = LLM(block_size=16, num_gpu_blocks_override=16, max_model_len=256)
    llm.engine.runner.model.save_pretrained(str(tmp_path))
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["model.norm.weight"] = np.ones(3, np.float32)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        LLM(model=str(tmp_path), block_size=16, num_gpu_blocks_override=16, max_model_len=256)


@pytest.fixture(scope="module")
def engine():
    mp = pytest.MonkeyPatch()
    mp.setenv("FD_HEAD_WISE_KV_CACHE", "1")
    try:
        yield LLMEngine.from_engine_args(EngineArgs(block_size=16, num_gpu_blocks_override=64, max_model_len=256))
    finally:
        mp.undo()


@pytest.mark.parametrize("prompt,params,message", [
    ("", SamplingParams(), "prompt is empty"),
    ([], SamplingParams(), "non-empty"),
    ([5] * 256, SamplingParams(), "max_model_len is 256"),
    ([5] * 200, SamplingParams(max_tokens=100), "exceeds max_model_len=256"),
    ([5, 6], SamplingParams(max_tokens=0), "max_tokens"),
    ([5, 6], SamplingParams(max_tokens=-3), "max_tokens"),
    ([5, 100000], SamplingParams(), "outside the vocabulary"),
    ([5, -1], SamplingParams(), "outside the vocabulary"),
    ([5, "x"], SamplingParams(), "outside the vocabulary"),
    ([5], SamplingParams(temperature=-1), "temperature"),
    ([5], SamplingParams(top_p=0), "top_p"),
    ([5], SamplingParams(min_tokens=9, max_tokens=3), "min_tokens"),
    ([5], SamplingParams(logprobs=99), "logprobs"),
])
def test_bad_requests_raise_and_the_engine_keeps_serving(engine, prompt, params, message):
    engine.add_request("good", "still served", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"] and len(finished[0].outputs.token_ids) == 4
    stats = engine.get_stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_duplicate_request_id_is_rejected(engine):
    engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    engine.abort_request("dup")
    engine.abort_request("dup")  # idempotent
    assert not engine.has_unfinished_requests()


def test_sampling_is_reproducible_with_a_seed_and_respects_min_tokens(engine):
    def run(seed):
        engine.add_request("s", "abc", SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=seed,
                                                      max_tokens=16, min_tokens=16))
        out = None
        while engine.has_unfinished_requests():
            out = [o for o in engine.step() if o.finished] or out
        return out[0].outputs.token_ids

    a, b, c = run(7), run(7), run(8)
    assert a == b and a != c and len(a) == 16


def test_llm_generate_rejects_a_bad_prompt_before_running_any(monkeypatch):
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "0")
    llm = LLM(block_size=16, num_gpu_blocks_override=16, max_model_len=128)
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate("fine", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs.token_ids) == 3 and isinstance(out[0].outputs.text, str)


def test_a_model_directory_with_tokenizer_json_uses_it(monkeypatch, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "1")
    LLM(block_size=16, num_gpu_blocks_override=16, max_model_len=256).engine.runner.model.save_pretrained(
        str(tmp_path))
    words = ["[UNK]", "<s>", "</s>"] + [f"w{i}" for i in range(256)]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.save(str(tmp_path / "tokenizer.json"))

    llm = LLM(model=str(tmp_path), block_size=16, num_gpu_blocks_override=16, max_model_len=256)
    assert llm.engine.tokenizer.encode("w0 w5 w9") == [3, 8, 12]
    out = llm.generate("w0 w5 w9", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == [3, 8, 12]
    assert out.outputs.text == tok.decode([t for t in out.outputs.token_ids if t != 2])  # </s> is not text


def test_engine_steps_total_counts_model_steps_only(engine):
    before = engine.get_stats()["engine_steps_total"]
    engine.step()  # nothing queued: no model step
    engine.add_request("steps", [5] * 10, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    # One prefill step that samples the first token, then one decode step per further token.
    assert engine.get_stats()["engine_steps_total"] - before == 6


def test_logit_bias_shifts_greedy_choices_and_leaves_logprobs_unbiased(engine):
    def run(bias):
        engine.add_request("bias", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                             logprobs=1, logit_bias=bias))
        out = None
        while engine.has_unfinished_requests():
            out = [o for o in engine.step() if o.finished] or out
        return out[0].outputs

    plain = run(None)
    forced = run({42: 100.0})
    assert forced.token_ids == [42, 42, 42]
    assert plain.token_ids[0] != 42
    # Logprobs describe the model's distribution: the first step's top entry is unchanged by the bias.
    assert max(forced.logprobs[0], key=forced.logprobs[0].get) == plain.token_ids[0]
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("bad", [5], SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("bad", [5], SamplingParams(logit_bias={4: 1000.0}))


ABC_ONLY = {3 + ord(c): 100.0 for c in "abc"}  # byte b is token id b + 3: outputs are letters a, b, c


def _finish(engine, request_id, prompt, params):
    engine.add_request(request_id, prompt, params)
    seen, last = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(out.outputs.text)
            last = out
    return last, seen


def test_stop_string_ends_the_output_before_it_and_frees_the_pages(engine):
    params = dict(temperature=0, max_tokens=24, ignore_eos=True, logit_bias=ABC_ONLY)
    full, _ = _finish(engine, "free", "stop test", SamplingParams(**params))
    text = full.outputs.text
    stop = text[8:10]
    cut = text.index(stop)
    out, seen = _finish(engine, "stopped", "stop test", SamplingParams(stop=[stop, "zzz"], **params))
    assert out.finished and out.outputs.finish_reason == "stop"
    assert out.outputs.text == text[:cut]
    assert len(out.outputs.token_ids) == cut + len(stop)  # the stop string's tokens were generated
    # Every intermediate text is a prefix of the answer: nothing shown was taken back.
    assert all(out.outputs.text.startswith(t) for t in seen)
    stats = engine.get_stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_stop_strings_wait_for_min_tokens(engine):
    params = dict(temperature=0, max_tokens=16, ignore_eos=True, logit_bias=ABC_ONLY)
    full, _ = _finish(engine, "free", "stop test", SamplingParams(**params))
    text = full.outputs.text
    first = text[0]
    out, _ = _finish(engine, "held", "stop test", SamplingParams(stop=[first], min_tokens=4, **params))
    # The 4th token may itself be the stop string (it ends the output after min_tokens tokens).
    later = text.find(first, 3)
    assert out.outputs.text == (text[:later] if later >= 0 else text)
    assert len(out.outputs.token_ids) >= 4


def test_bad_stop_strings_are_rejected(engine):
    with pytest.raises(ValueError, match="stop"):
        engine.add_request("bad", [5], SamplingParams(stop=[""]))
    with pytest.raises(ValueError, match="stop"):
        engine.add_request("bad", [5], SamplingParams(stop=["ok", 7]))
    with pytest.raises(ValueError, match="stop"):
        engine.add_request("bad", [5], SamplingParams(stop=["x" * 257]))
    with pytest.raises(ValueError, match="stop"):
        engine.add_request("bad", [5], SamplingParams(stop=[str(i) for i in range(17)]))
    assert SamplingParams(stop="abc").stop == ["abc"]  # one string, as vLLM takes it


def test_a_request_whose_sampling_fails_is_aborted_and_the_batch_goes_on(engine, monkeypatch):
    import fastdeploy.engine.step_runner as step_runner

    # Validation leaves no known input that breaks sampling, so a failure is injected for one request.
    real_sample_one = step_runner.sample_one

    def failing_for_doomed(logits, request, eos_token_id, banned=None):
        if request.request_id == "doomed":
            raise FloatingPointError("injected")
        return real_sample_one(logits, request, eos_token_id, banned)

    monkeypatch.setattr(step_runner, "sample_one", failing_for_doomed)
    engine.add_request("ok", [5, 6], SamplingParams(temperature=0.7, seed=1, max_tokens=4, ignore_eos=True))
    engine.add_request("doomed", [5, 6], SamplingParams(temperature=0.7, max_tokens=4))
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert final["doomed"].outputs.finish_reason == "abort" and final["doomed"].outputs.token_ids == []
    assert final["ok"].outputs.finish_reason == "length" and len(final["ok"].outputs.token_ids) == 4
    stats = engine.get_stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_min_tokens_with_every_token_a_stop_token_is_rejected_up_front(engine):
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match="nothing to sample"):
        engine.add_request("impossible", [5, 6], SamplingParams(min_tokens=2, stop_token_ids=list(range(vocab))))
    # Without min_tokens the same stop set is fine: the first token simply stops the request.
    engine.add_request("stops", [5, 6], SamplingParams(temperature=0, max_tokens=4, stop_token_ids=list(range(vocab))))
    final = []
    while engine.has_unfinished_requests():
        final += [o for o in engine.step() if o.finished]
    assert final[0].outputs.finish_reason == "stop" and len(final[0].outputs.token_ids) == 1
