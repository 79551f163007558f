"""transformers as the oracle: greedy continuations and logits of one prompt at a time."""


def reference_greedy(model, prompt_ids: list, max_new_tokens: int, stop_ids) -> list:
    """transformers' greedy continuation of one prompt (no batching: no padding to disagree about)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=list(stop_ids), pad_token_id=list(stop_ids)[0])
    new = out[0, len(prompt_ids):].tolist()
    ends = [i for i, t in enumerate(new) if t in stop_ids]
    return new[:ends[0] + 1] if ends else new  # nothing after the first stop token (no padding)


def logprob_diff(llm, model, prompt_ids: list) -> tuple:
    """(max |engine - transformers| log-prob over every position and token of one prompt, the engine's
    log-probs, transformers' log-probs), float64 [n, vocab]; row i predicts token i + 1 on both sides.
    The engine must be built with prefix caching off (every position computed)."""
    import numpy as np

    from fastdeploy.tools.prompt_logits import full_prompt_logprobs, log_softmax

    ref = log_softmax(reference_logits(model, prompt_ids).astype(np.float64))
    ours = full_prompt_logprobs(llm, prompt_ids).astype(np.float64)
    return float(np.abs(ours - ref).max()), ours, ref


def assert_greedy_equal(llm, model, prompts: list, max_tokens: int) -> None:
    """The engine's greedy continuation of every prompt equals transformers' (no stop token)."""
    from fastdeploy import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert list(out.outputs.token_ids) == reference_greedy(model, ids, max_tokens, [-1])


def reference_logits(model, prompt_ids: list):
    import torch

    with torch.no_grad():
        return model(torch.tensor([prompt_ids])).logits[0].float().numpy()


def write_gguf(path, model, arch: str, tokenizer_gguf: str, interleave_qk: bool, extra_tensors=None) -> None:
    """A GGUF of a transformers model's float32 weights, written with the `gguf` package the way llama.cpp's
    converter (convert_hf_to_gguf.py) lays out `arch`, with the tokenizer fields of another GGUF file.

    Tensor names come from the `gguf` package's own map for `arch` (the converter's), a tied LM head is left
    out (llama.cpp reads token_embd.weight for it). `interleave_qk`: q/k rows in interleaved pairs, as the
    converter permutes them for `llama`; Qwen, Gemma 2 and Cohere2 keep the checkpoint's rows. Per architecture,
    the metadata the converter writes: `gemma2` (Gemma2Model) has RMSNorm weights stored as 1 + w, the two
    soft-caps and the window, and no RoPE base (llama.cpp's default, 10000, applies); `cohere2` (Cohere2Model)
    has a LayerNorm epsilon, the logit scale, the window, the rotary dimension count and a rope scaling type of
    none, and no bias tensors (the converter drops them when zero)."""
    import gguf
    import numpy as np

    config = model.config
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    source = gguf.GGUFReader(tokenizer_gguf)
    field = lambda key: source.fields[key]  # noqa: E731
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch != "gemma2":
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        writer.add_vocab_size(config.vocab_size)
    if arch == "cohere2":
        writer.add_layer_norm_eps(config.layer_norm_eps)
        writer.add_logit_scale(config.logit_scale)
        writer.add_sliding_window(config.sliding_window)
        rotary_pct = getattr(config, "rotary_pct", 1.0)  # transformers' Cohere2Config has none: all of each head
        writer.add_rope_dimension_count(int(rotary_pct * (config.hidden_size // heads)))
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    else:
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(bytes(field("tokenizer.ggml.pre").parts[-1]).decode())
    writer.add_token_list([bytes(field("tokenizer.ggml.tokens").parts[i]).decode("utf-8", "replace")
                           for i in field("tokenizer.ggml.tokens").data])
    writer.add_token_types([int(field("tokenizer.ggml.token_type").parts[i][0])
                            for i in field("tokenizer.ggml.token_type").data])
    writer.add_token_merges([bytes(field("tokenizer.ggml.merges").parts[i]).decode()
                             for i in field("tokenizer.ggml.merges").data])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and (arch == "gemma2" or config.tie_word_embeddings):
            continue  # Gemma2Model skips it always; a tied head is not in the checkpoint the converter reads
        array = tensor.float().numpy()
        if arch == "cohere2" and name.endswith(".bias"):
            assert not array.any()  # the converter drops zero biases and refuses others
            continue
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ValueError(f"{name} has no GGUF name for {arch}")
        if arch == "gemma2" and name.endswith("norm.weight"):
            array = array + 1.0
        if interleave_qk and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            n = heads if "q_proj" in name else kv_heads
            array = array.reshape(n, 2, head_dim // 2, -1).transpose(0, 2, 1, 3).reshape(array.shape)
        writer.add_tensor(target, np.ascontiguousarray(array, dtype=np.float32))
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
