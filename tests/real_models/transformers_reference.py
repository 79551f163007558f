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


def reference_logits(model, prompt_ids: list):
    import torch

    with torch.no_grad():
        return model(torch.tensor([prompt_ids])).logits[0].float().numpy()
