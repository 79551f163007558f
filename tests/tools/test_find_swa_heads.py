"""The head finder and the SWA quality evaluation, on tiny random models (no real checkpoint).

- a planted long-range head (it attends one early token from everywhere) is what every scorer
  ranks highest in its layer, and the finder keeps it full;
- the finder's output is a head_wise_swa section the engine loads;
- the evaluation's positions below sink + window match full attention bit for bit on the real
  paged path with recycling on (and the masked reference), and past them they do not.
"""

import importlib.util
import json
import os

import numpy as np
import pytest

from fastdeploy.model_executor.models.tiny_preset import TINY_PRESET_CONFIG

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WINDOW, SINK = 64, 16
PLANT_LAYER, PLANT_HEAD, PLANT_TOKEN, PLANT_AT = 0, 2, 7, 20


def _write_model(path, plant: bool) -> str:
    """The dense tiny preset's shapes with full attention everywhere (no head_wise_swa section).
    plant=True gives KV head PLANT_HEAD of layer PLANT_LAYER a retrieval head's behaviour: every query
    attends the key of token PLANT_TOKEN wherever it is, through the lowest-frequency RoPE pair
    (nearly position-independent over a few hundred tokens)."""
    from safetensors.numpy import save_file

    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.models.decoder import random_checkpoint

    raw = {k: v for k, v in TINY_PRESET_CONFIG.items() if k != "head_wise_swa"}
    raw["fastdeploy_byte_tokenizer"] = True
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    weights = random_checkpoint(ModelConfig.create(None, None, None))
    if plant:
        d, group = raw["head_dim"], raw["num_attention_heads"] // raw["num_key_value_heads"]
        emb = weights["model.embed_tokens.weight"]
        emb[:, 0], emb[:, 1] = 0.0, 3.0            # dim 1: present in every token; dim 0: only in the planted one
        emb[PLANT_TOKEN, 0] = 30.0
        p = f"model.layers.{PLANT_LAYER}.self_attn."
        k, q, v = weights[p + "k_proj.weight"], weights[p + "q_proj.weight"], weights[p + "v_proj.weight"]
        last = d - 2                                # the slowest-rotating RoPE pair: dims d-2, d-1
        k[PLANT_HEAD * d + last:PLANT_HEAD * d + d] = 0.0
        k[PLANT_HEAD * d + last, 0] = 3.0
        for qh in range(PLANT_HEAD * group, (PLANT_HEAD + 1) * group):
            q[qh * d + last:qh * d + d] = 0.0
            q[qh * d + last, 1] = 3.0
        v[PLANT_HEAD * d:(PLANT_HEAD + 1) * d, 0] = 4.0  # what it fetches is visible downstream
    save_file(weights, os.path.join(path, "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def planted_model(tmp_path_factory):
    return _write_model(tmp_path_factory.mktemp("planted"), plant=True)


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    return _write_model(tmp_path_factory.mktemp("plain"), plant=False)


def _segments(n=2, length=320, seed=0):
    rng = np.random.default_rng(seed)
    segs = []
    for _ in range(n):
        seg = rng.integers(40, 250, size=length).tolist()  # never the planted token ...
        seg[PLANT_AT] = PLANT_TOKEN                        # ... but once, past the sink
        segs.append(seg)
    return segs


def _native_llm(model, max_len=400):
    os.environ.update(FD_ATTENTION_BACKEND="NATIVE_ATTN", FD_HEAD_WISE_KV_CACHE="0", FD_LOG_INTERVAL="0")
    from fastdeploy import LLM

    return LLM(model=model, max_model_len=max_len, max_num_seqs=1, max_num_batched_tokens=128,
               enable_prefix_caching=False)


def test_every_scorer_ranks_a_planted_retrieval_head_highest_in_its_layer(planted_model):
    from fastdeploy.tools import swa_patterns
    from fastdeploy.tools.head_scores import ablation_kl_scores, one_pass_scores

    llm = _native_llm(planted_model)
    segs = _segments()
    scores = one_pass_scores(llm, segs, WINDOW, SINK, log=lambda m: None)
    scores["ablation_kl"] = ablation_kl_scores(llm, segs, WINDOW, SINK, log=lambda m: None)
    for name, s in scores.items():
        assert int(np.argmax(s[PLANT_LAYER])) == PLANT_HEAD, (name, s[PLANT_LAYER])
        keep_one_full = swa_patterns.lowest_per_layer(s, s.shape[1] - 1)[PLANT_LAYER]
        assert PLANT_HEAD not in keep_one_full, name
    # it takes almost all of its attention from the planted token, far outside the window
    assert scores["outside_mass"][PLANT_LAYER, PLANT_HEAD] > 0.9


def test_the_same_scorers_see_no_planted_head_in_the_plain_model(plain_model):
    """The check above can fail: without the plant, the planted pair has no outsized score."""
    from fastdeploy.tools.head_scores import one_pass_scores

    s = one_pass_scores(_native_llm(plain_model), _segments(), WINDOW, SINK, log=lambda m: None)["outside_mass"]
    assert s[PLANT_LAYER, PLANT_HEAD] < 0.9


def _engine_takes_per_layer_lists() -> bool:
    from fastdeploy.config import HeadWiseSWAConfig

    try:
        HeadWiseSWAConfig.from_dict({"sliding_window": 8, "sink_size": 0, "swa_kv_heads": [[0], [1]]}, 4)
    except ValueError:
        return False
    return True


def test_finder_writes_a_head_wise_swa_section_the_engine_loads(planted_model, tmp_path):
    from fastdeploy.engine.args_utils import EngineArgs
    from fastdeploy.tools.find_swa_heads import main

    out = tmp_path / "found.json"
    assert main(["--model", planted_model, "--window", str(WINDOW), "--sink", str(SINK), "--swa-heads-per-layer",
                 "2", "--segments", "1", "--segment-tokens", "200", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    section = doc["head_wise_swa"]
    assert (section["sliding_window"], section["sink_size"]) == (WINDOW, SINK)
    layers = section["swa_kv_heads"]
    layers = layers if isinstance(layers[0], list) else [layers] * 2
    assert [len(h) for h in layers] == [2, 2]
    assert sum(len(h) for h in doc["global_ranking"]["head_wise_swa"]["swa_kv_heads"]) == 4
    assert np.array(doc["scores"]["outside_mass"]).shape == (2, 4)
    if isinstance(section["swa_kv_heads"][0], list) and not _engine_takes_per_layer_lists():
        pytest.skip("per-layer swa_kv_heads are served once the per-layer SWA heads change (branch perlayer) is in")
    os.environ.update(FD_HEAD_WISE_KV_CACHE="1", FD_ATTENTION_BACKEND="APPEND_ATTN")
    fd = EngineArgs(model=planted_model, head_wise_swa_config=section).create_engine_config()
    assert fd.model_config.head_wise_swa.sliding_window == WINDOW


def test_finder_rejects_text_too_short_to_reach_past_the_window(planted_model, tmp_path, capsys):
    from fastdeploy.tools.find_swa_heads import main

    assert main(["--model", planted_model, "--window", "256", "--sink", "16", "--swa-heads-per-layer", "1",
                 "--segment-tokens", "200", "--out", str(tmp_path / "x.json")]) == 2
    assert "--segment-tokens 200 must exceed window + sink" in capsys.readouterr().err


def _eval_module():
    spec = importlib.util.spec_from_file_location("eval_swa_quality",
                                                  os.path.join(REPO, "benchmarks", "eval_swa_quality.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("path", ["paged", "native"])
def test_eval_is_exact_below_sink_plus_window_and_differs_past_it(planted_model, path):
    ev = _eval_module()
    ev.CHUNK = 128
    segs = _segments(n=1, length=300)
    spec = {"sliding_window": WINDOW, "sink_size": SINK, "swa_kv_heads": [PLANT_HEAD]}
    ref_path = "full" if path == "paged" else "native-full"
    llm, _ = ev.build_llm(planted_model, None, ref_path, 400, prefix_caching=False)
    ref = [ev.text_logprobs(llm, s) for s in segs]
    llm, ran = ev.build_llm(planted_model, spec, path, 400, prefix_caching=False)
    assert ran == path
    if path == "paged":
        assert llm.engine.fd_config.head_wise_kv_cache and llm.engine.fd_config.swa_recycle_active
    lps = [ev.text_logprobs(llm, s) for s in segs]
    m = ev.text_metrics(lps, segs, ref, SINK + WINDOW)
    assert m["exact_below_window"] and m["max_abs_logprob_diff_below_window"] == 0.0
    below = m["buckets"][0]
    assert below["positions"] == [0, SINK + WINDOW] and below["kl"] == 0.0 and below["top1"] == 1.0
    assert m["kl_mean_past_window"] > 1e-3  # sliding the planted head changes what comes after the window


def test_the_shipped_smollm2_configuration_has_a_window_per_head_and_its_memory_gain():
    """What ships with `smollm2-135m-instruct` (docs/swa_quality.md, "Held out"): a valid section for its 30
    layers x 3 KV heads with a window per sliding head from the menu, chosen with calibration retrieval in
    the score, holding 1/2 of full attention's pages at a 3968 + 128-token request's peak over its decode;
    the configurations shipped before stay by name with their own gains."""
    from fastdeploy.config import HeadWiseSWAConfig
    from fastdeploy.model_executor.models.named_models import CALIBRATED_DIR, NAMED_MODELS

    model = NAMED_MODELS["smollm2-135m-instruct"]
    section = model.calibrated_head_wise_swa()
    spec = HeadWiseSWAConfig.from_dict(section, 3, 30)
    assert {w for layer in section["head_windows"] for w in layer} <= {256, 512, 1024, 2048}
    assert spec.to_dict()["head_windows"] == section["head_windows"]
    ev = _eval_module()
    decode_peak = lambda s: ev.page_need_ceiling(s, 30, 3, [4096], 64, at="decode")["4096"]  # noqa: E731
    assert decode_peak(section) >= 2.0
    with open(os.path.join(CALIBRATED_DIR, "smollm2-135m-instruct.json"), encoding="utf-8") as f:
        doc = json.load(f)
    assert doc["calibration"]["retrieval"]["split"] == "calibration" and doc["decode_tokens"] == 128
    assert model.calibrated_head_wise_swa(doc["configuration"]) == section
    for name, info in doc["named_configurations"].items():  # the file's ceilings are the peak over the decode
        if "page_need_ceiling_decode_4096" in info:
            assert abs(decode_peak(info["head_wise_swa"]) - info["page_need_ceiling_decode_4096"]) < 1e-3, name
    assert decode_peak(model.calibrated_head_wise_swa("window-menu-1.7x")) >= 1.65  # shipped 2026-12-03 to -05
    old = model.calibrated_head_wise_swa("one-head-per-layer-w512")
    assert [len(h) for h in HeadWiseSWAConfig.from_dict(old, 3, 30).layer_kv_heads] == [1] * 30
    assert ev.page_need_ceiling(old, 30, 3, [4096], 64)["4096"] >= 1.3


def test_page_need_ceiling_uses_the_engines_layout_with_every_window_recycling():
    """Per-head windows: the ceiling counts each sliding pair with its own window, at the prefill peak and
    once decoding, and equals a pair-by-pair count (a page is one slot's tokens in every lane)."""
    from fastdeploy.cache_manager.head_wise import num_dead_blocks, table_length

    ev = _eval_module()
    bs, n = 16, 4096
    spec = {"sliding_window": 256, "sink_size": 4, "swa_kv_heads": [[0, 2], [1]], "head_windows": [[64, 512], [128]]}
    off, on = ev.page_need_layouts(spec, 2, 3, bs)
    assert len(on.recycling_groups) == 3 and not off.recycling_groups

    def pair_pages(window, t):  # the step computing token t: what a pair holds then
        return table_length(t + 1, bs) - (num_dead_blocks(t, window, 4, bs) if window else 0)

    pairs = [64, 512, 0, 0, 128, 0]
    decode = ev.page_need_ceiling(spec, 2, 3, [n], bs, at="decode")[str(n)]
    steps = range(n - ev.DECODE_TOKENS, n)  # the request's decode: its most pages at any of its steps
    peak_on = max(sum(pair_pages(w, t) for w in pairs) for t in steps)
    assert decode == pytest.approx(6 * pair_pages(0, n - 1) / peak_on)
    assert peak_on > sum(pair_pages(w, n - 1) for w in pairs)  # W 128 and 512 cross a block edge on the way
    prefill = ev.page_need_ceiling(spec, 2, 3, [n], bs)[str(n)]
    assert 1.0 < prefill < decode  # the last prefill chunk holds CHUNK more tokens in every sliding pair


def test_below_window_check_tolerates_only_the_rounding_a_head_permutation_causes():
    ev = _eval_module()
    text = {"exact_below_window": False, "max_abs_logprob_diff_below_window": 1e-4,
            "buckets": [{"positions": [0, 80], "kl": 1e-9, "top1": 1.0}]}
    assert ev.below_window_check(text, permuted_heads=True) == "rounding (permuted heads)"
    assert ev.below_window_check(text, permuted_heads=False) == "FAIL"
    text["buckets"][0]["top1"] = 0.99
    assert ev.below_window_check(text, permuted_heads=True) == "FAIL"
    assert ev.below_window_check({**text, "exact_below_window": True}, permuted_heads=False) == "exact"


def test_eval_runs_a_quantized_pages_arm_against_the_float32_pages_reference(planted_model):
    """--kv-cache-quant-type: the same paged path with int8 pages, compared with float32 pages; the
    positions below any window differ too (nothing is exact), so that check reads n/a."""
    ev = _eval_module()
    ev.CHUNK = 128
    segs = _segments(n=1, length=300)
    llm, _ = ev.build_llm(planted_model, None, "full", 400, prefix_caching=False)
    ref = [ev.text_logprobs(llm, s) for s in segs]
    llm, ran = ev.build_llm(planted_model, None, "full", 400, prefix_caching=False, quant="int8")
    assert ran == "full" and llm.engine.fd_config.cache_config.kv_cache_quant_type == "int8"
    m = ev.text_metrics([ev.text_logprobs(llm, s) for s in segs], segs, ref, 0)
    assert 0 < m["kl_mean_past_window"] < 1e-2 and m["top1_past_window"] > 0.9
    assert not m["exact_below_window"]
    assert ev.below_window_check(m, permuted_heads=False, quantized=True) == "n/a (quantized pages)"


def test_the_evaluations_exact_span_is_the_smallest_window_and_sink_of_any_sliding_head():
    """Below it every sliding head sees every key, so the evaluation checks those positions bit for bit."""
    ev = _eval_module()
    one = {"sliding_window": 512, "sink_size": 64, "swa_kv_heads": [0]}
    per_head = {"sliding_window": 512, "sink_size": 64, "swa_kv_heads": [[0, 2], [1]],
                "head_windows": [[1024, 256], [2048]], "head_sinks": [[64, 8], [0]]}
    assert ev.exact_span(one, 2, 3) == 576
    assert ev.exact_span(per_head, 2, 3) == 264


def test_kl_from_weighs_the_buckets_from_that_position_on_by_their_lengths():
    """`--table --kl-from N`: every configuration's KL and top-1 over the same positions (those from N on)."""
    ev = _eval_module()
    text = {"buckets": [{"positions": [0, 100], "kl": 9.0, "top1": 0.0},
                        {"positions": [100, 200], "kl": 1.0, "top1": 1.0},
                        {"positions": [200, 500], "kl": 3.0, "top1": 0.5}]}
    assert ev.text_from(text, 100) == pytest.approx((2.5, 0.625))
    assert all(np.isnan(v) for v in ev.text_from(text, 600))


def test_the_table_recomputes_both_ceilings_of_every_row_at_the_lengths_asked(planted_model):
    """`--table --model M --lengths ...`: the ceilings are arithmetic on each row's spec, recomputed at
    the lengths asked (prefill peak and once decoding); full attention stays at 1."""
    ev = _eval_module()
    spec = {"sliding_window": WINDOW, "sink_size": SINK, "swa_kv_heads": [0]}
    rows = {"full": {"head_wise_swa": None}, "sliding": {"head_wise_swa": spec, "page_need_ceiling": {"4096": 9.9}}}
    ev.recompute_ceilings(rows, planted_model, [256, 1024], 16)
    assert rows["full"]["page_need_ceiling"] == rows["full"]["page_need_ceiling_decode"] == {"256": 1.0, "1024": 1.0}
    sliding = rows["sliding"]
    assert set(sliding["page_need_ceiling"]) == set(sliding["page_need_ceiling_decode"]) == {"256", "1024"}
    # once decoding a sliding slot holds sink + window; at the prefill peak a chunk more
    assert 1.0 < sliding["page_need_ceiling"]["1024"] < sliding["page_need_ceiling_decode"]["1024"]
    assert sliding["page_need_ceiling"]["256"] < sliding["page_need_ceiling"]["1024"]  # more tokens, more recycled
