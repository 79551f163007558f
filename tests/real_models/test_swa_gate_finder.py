"""The optimizing head finder (fastdeploy/tools/optimize_swa_gates.py) on a tiny random Llama saved as a
Hugging Face directory with SmolLM2's tokenizer: it lowers its objective, a larger L1 weight slides more
(the sparsity sweep), each fraction's section slides that share of the heads, a run resumes from its
checkpoint, and the section it writes is served by the engine with FD_HEAD_WISE_KV_CACHE=1."""

import json

import numpy as np
import pytest

from fastdeploy import LLM, SamplingParams, envs

WINDOW, SINK, SEQ = 48, 4, 192
LAYERS, KV_HEADS = 3, 2


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_reference):
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=KV_HEADS,
                                      max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=True,
                                      initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gate_llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    smollm2_reference[0].save_pretrained(path)
    return str(path)


def _run(tiny_dir, out, *extra):
    from fastdeploy.tools.optimize_swa_gates import main

    code = main(["--model", tiny_dir, "--window", str(WINDOW), "--sink", str(SINK), "--seq-tokens", str(SEQ),
                 "--threads", "2", "--out", str(out), *extra])
    assert code == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def pushed(tiny_dir, tmp_path_factory):
    return _run(tiny_dir, tmp_path_factory.mktemp("pushed") / "gates.json", "--steps", "12", "--l1", "0.5",
                "--lr", "0.1")


def test_training_lowers_the_objective(pushed):
    losses = [h["loss"] for h in pushed["history"]]
    assert losses[0] == pytest.approx(0.5)  # every gate 1: the full model, distill 0, the whole L1 term
    assert np.mean(losses[-3:]) < losses[0]


def test_a_larger_l1_weight_slides_more_heads(tiny_dir, tmp_path, pushed):
    free = _run(tiny_dir, tmp_path / "free.json", "--steps", "3", "--l1", "0")
    assert np.allclose(free["gates"], 1.0)  # nothing asks a head to stream: the full model is the optimum
    assert np.mean(pushed["gates"]) < 0.99
    assert pushed["history"][-1]["mean_gate"] == pytest.approx(np.mean(pushed["gates"]), abs=1e-5)


def test_each_fraction_slides_that_share_of_the_lowest_gates(pushed):
    gates = np.array(pushed["gates"])
    assert gates.shape == (LAYERS, KV_HEADS)
    for fraction, section in pushed["sections"].items():
        chosen = section["swa_kv_heads"]
        chosen = chosen if isinstance(chosen[0], list) else [chosen] * LAYERS
        picked = [(layer, h) for layer, heads in enumerate(chosen) for h in heads]
        assert len(picked) == max(1, round(float(fraction) * LAYERS * KV_HEADS))
        rest = [gates[layer, h] for layer in range(LAYERS) for h in range(KV_HEADS) if (layer, h) not in picked]
        assert max(gates[p] for p in picked) <= min(rest, default=np.inf)
        assert (section["sliding_window"], section["sink_size"]) == (WINDOW, SINK)


def test_a_run_resumes_from_its_checkpoint(tiny_dir, tmp_path, capsys):
    out = tmp_path / "g.json"
    first = _run(tiny_dir, out, "--steps", "2", "--save-every", "1", "--l1", "0.5")
    second = _run(tiny_dir, out, "--steps", "4", "--save-every", "1", "--l1", "0.5")
    assert "resumed from" in capsys.readouterr().out
    assert second["history"][:2] == first["history"] and len(second["history"]) == 4


def test_bad_arguments_are_one_line_errors(tiny_dir, tmp_path, capsys):
    from fastdeploy.tools.optimize_swa_gates import main

    assert main(["--model", tiny_dir, "--window", "512", "--sink", "64", "--seq-tokens", "300",
                 "--out", str(tmp_path / "x.json")]) == 2
    assert "must exceed window + sink" in capsys.readouterr().err


def test_the_written_section_is_served_by_the_engine(tiny_dir, pushed):
    section = pushed["head_wise_swa"]
    with envs.override(FD_HEAD_WISE_KV_CACHE=1):
        llm = LLM(model=tiny_dir, head_wise_swa_config=section, max_model_len=256, max_num_seqs=2, block_size=16)
        assert llm.engine.model_config.head_wise_swa.sliding_window == WINDOW
        out = llm.generate([list(range(100, 300))], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(out[0].outputs.token_ids) == 8
    assert llm.engine.scheduler.kv_cache_manager.swa_pages_recycled_total > 0  # the sliding heads' pages came back


def test_among_gates_clamped_at_zero_the_head_let_go_of_sooner_slides_first():
    from fastdeploy.tools.optimize_swa_gates import sections

    gates = np.array([[0.0, 0.0, 0.7], [0.0, 0.3, 0.0]])
    mean_gates = np.array([[0.4, 0.1, 0.9], [0.2, 0.6, 0.5]])
    candidates = [(layer, h) for layer in range(2) for h in range(3)]
    got = sections(gates, candidates, [2 / 6, 4 / 6, 5 / 6], 8, 2, mean_gates)
    assert got["0.3333"]["swa_kv_heads"] == [[1], [0]]            # mean gates 0.1 and 0.2 of the four zeros
    assert got["0.6667"]["swa_kv_heads"] == [[0, 1], [0, 2]]      # every zero before any open gate
    assert got["0.8333"]["swa_kv_heads"] == [[0, 1], [0, 1, 2]]   # then the lowest open gate (0.3)
