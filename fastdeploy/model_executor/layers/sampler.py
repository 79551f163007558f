"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, min_tokens, logit_bias,
penalties, top-k logprobs (of the model's own distribution, before bias, penalties and bans)."""

from __future__ import annotations

from typing import Optional

import numpy as np

# Below this temperature sampling is greedy (as in vLLM): dividing by a tinier one only overflows.
GREEDY_TEMPERATURE = 1e-5


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def sample_one(logits: np.ndarray, request, eos_token_id, banned: Optional[np.ndarray] = None) -> tuple:
    """(token, logprobs dict or None) for one request's logits [vocab] (float32, not modified).
    `banned`: bool [vocab], the tokens a grammar forbids here (guided decoding)."""
    params = request.sampling_params
    scores = logits.astype(np.float64)
    if params.logit_bias:
        ids = np.fromiter(params.logit_bias.keys(), np.int64, len(params.logit_bias))
        scores[ids] += np.fromiter(params.logit_bias.values(), np.float64, len(params.logit_bias))
    if has_penalties(params):
        _apply_penalties(scores, request)
    # A tiny repetition penalty can push a logit to +inf, which would turn the softmax into NaN.
    np.nan_to_num(scores, copy=False, nan=-np.inf, posinf=np.finfo(np.float64).max, neginf=-np.inf)
    if len(request.output_token_ids) < params.min_tokens:
        scores[[t for t in min_tokens_bans(params, eos_token_id) if 0 <= t < scores.shape[0]]] = -np.inf
    if banned is not None:
        np.putmask(scores, banned, -np.inf)  # several times faster than boolean indexing
    if np.isneginf(scores).all():
        raise ValueError("every token is banned (min_tokens with stop_token_ids covering the vocabulary, or a "
                         "grammar that allows only the end before min_tokens)")
    if is_greedy(params):
        token = int(np.argmax(scores))
    else:
        token = _draw(scores, params.temperature, params.top_k, params.top_p, request.generator)
    logprobs = None
    if params.logprobs is not None:
        lp = log_softmax(logits.astype(np.float64))
        top = np.argsort(-lp, kind="stable")[: params.logprobs]
        logprobs = {int(t): float(lp[t]) for t in top}
        logprobs[token] = float(lp[token])
    return token, logprobs


def min_tokens_bans(params, eos_token_id) -> set:
    """Tokens that cannot be drawn before min_tokens: they would stop the request (eos: one id or several)."""
    eos = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    return {*eos, *(params.stop_token_ids or ())}


def is_greedy(params) -> bool:
    return params.temperature < GREEDY_TEMPERATURE or params.top_k == 1


def has_penalties(params) -> bool:
    return params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1


def _apply_penalties(scores: np.ndarray, request) -> None:
    params, vocab = request.sampling_params, scores.shape[0]
    if request.output_token_ids:
        counts = np.bincount(request.output_token_ids, minlength=vocab)[:vocab]
        scores -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    if params.repetition_penalty != 1:
        seen = np.unique(np.concatenate([request.prompt_token_ids, request.output_token_ids]).astype(np.int64))
        seen = seen[seen < vocab]
        # A tiny penalty may overflow a positive logit to +inf: expected, and clamped by the caller
        # (np.nan_to_num in sample_one), so numpy's overflow warning would only be noise.
        with np.errstate(over="ignore"):
            scores[seen] = np.where(scores[seen] > 0, scores[seen] / params.repetition_penalty,
                                    scores[seen] * params.repetition_penalty)


def _draw(scores: np.ndarray, temperature: float, top_k: int, top_p: float, generator: np.random.Generator) -> int:
    order = np.argsort(-scores, kind="stable")
    if top_k and top_k > 0:
        order = order[:top_k]
    kept = scores[order]
    # Shift before scaling: the largest term is exp(0) = 1 and nothing overflows.
    probs = np.exp((kept - kept.max()) / temperature)
    probs /= probs.sum()
    if top_p < 1.0:
        # Smallest prefix of the sorted distribution whose mass reaches top_p (always >= 1 token).
        cutoff = int(np.searchsorted(np.cumsum(probs), top_p) + 1)
        order, probs = order[:cutoff], probs[:cutoff] / probs[:cutoff].sum()
    return int(order[generator.choice(len(order), p=probs)])
