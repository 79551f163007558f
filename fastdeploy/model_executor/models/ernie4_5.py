"""ERNIE-4.5 dense decoder in Paddle: embeddings, RMSNorm, GQA attention (through the attention
backend, RoPE inside it), SwiGLU MLP, tied or untied LM head.

Checkpoints use the Hugging Face parameter names of ERNIE-4.5 (`model.layers.N.self_attn.q_proj.weight`,
stored `[out, in]`); in memory q/k/v and gate/up are fused and transposed to Paddle's `[in, out]`.
"""

from __future__ import annotations

import json
import os

import numpy as np
import paddle
import paddle.nn.functional as F

from fastdeploy.model_executor import tensor_parallel as tp_
from fastdeploy.model_executor.forward_meta import ForwardMeta

WEIGHTS_FILE = "model.safetensors"

# CPU GEMM kernels give a row bit-identical results only when the row count is a multiple of
# this; otherwise the remainder rows take another code path. Padding every step's rows to it
# makes a request's tokens independent of which other requests share its batch, so recycling
# ON and OFF (different batch mixes) produce identical greedy tokens.
ROW_ALIGN = 8


def _aligned(rows: int) -> int:
    return -(-rows // ROW_ALIGN) * ROW_ALIGN


def _pad_rows(x: paddle.Tensor, rows: int) -> paddle.Tensor:
    extra = rows - x.shape[0]
    if extra == 0:
        return x
    return paddle.concat([x, paddle.zeros([extra] + list(x.shape[1:]), dtype=x.dtype)], axis=0)


def _layer_names(i: int) -> dict:
    p = f"model.layers.{i}."
    return {
        "input_norm": p + "input_layernorm.weight",
        "q": p + "self_attn.q_proj.weight",
        "k": p + "self_attn.k_proj.weight",
        "v": p + "self_attn.v_proj.weight",
        "o": p + "self_attn.o_proj.weight",
        "post_norm": p + "post_attention_layernorm.weight",
        "gate": p + "mlp.gate_proj.weight",
        "up": p + "mlp.up_proj.weight",
        "down": p + "mlp.down_proj.weight",
    }


def checkpoint_shapes(cfg) -> dict:
    """Every parameter the checkpoint must hold, with its on-disk `[out, in]` shape."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_hidden_layers):
        n = _layer_names(i)
        shapes.update({
            n["input_norm"]: (h,), n["post_norm"]: (h,),
            n["q"]: (cfg.num_attention_heads * d, h), n["k"]: (cfg.num_key_value_heads * d, h),
            n["v"]: (cfg.num_key_value_heads * d, h), n["o"]: (h, cfg.num_attention_heads * d),
            n["gate"]: (inter, h), n["up"]: (inter, h), n["down"]: (h, inter),
        })
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def random_checkpoint(cfg) -> dict:
    """Deterministic weights from the config's seed: the tiny preset's parameters.

    The LM head is scaled so logits spread over a few units: greedy argmax then has clear
    winners, so float rounding differences between backends do not flip tokens.
    """
    rng = np.random.default_rng(cfg.seed)
    weights = {}
    for name, shape in checkpoint_shapes(cfg).items():
        if len(shape) == 1:
            weights[name] = np.ones(shape, np.float32) + rng.normal(0, 0.05, shape).astype(np.float32)
        elif name == "model.embed_tokens.weight":
            weights[name] = rng.normal(0, 1.0, shape).astype(np.float32)
        else:
            scale = 3.0 if name == "lm_head.weight" else 1.0
            weights[name] = (rng.normal(0, 1.0, shape) * scale / np.sqrt(shape[1])).astype(np.float32)
    return weights


class Ernie4_5ForCausalLM:
    """Under tensor parallelism (`tp_size` > 1) this object is rank `tp_rank`'s shard: the
    checkpoint is permuted to the load-time KV-head order, then sliced (tensor_parallel.py)."""

    def __init__(self, model_config, checkpoint: dict, tp_rank: int = 0, tp_size: int = 1):
        self.config = cfg = model_config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        expected = checkpoint_shapes(cfg)
        missing = sorted(set(expected) - set(checkpoint))
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} parameter(s), e.g. {missing[:3]}")
        for name, shape in expected.items():
            if tuple(checkpoint[name].shape) != shape:
                raise ValueError(f"checkpoint parameter {name} has shape {tuple(checkpoint[name].shape)}, "
                                 f"expected {shape}")
        full = {k: np.asarray(checkpoint[k], np.float32) for k in expected}
        # A shard does not keep the whole checkpoint: that would undo what sharding saves.
        self.checkpoint = full if tp_size == 1 else None
        ck = tp_.shard_weights(tp_.permute_kv_heads(full, cfg, cfg.kv_head_order), cfg, tp_rank, tp_size)
        self.vocab_start = tp_.vocab_slice(cfg.vocab_size, tp_rank, tp_size)[0] if tp_size > 1 else 0

        def t(a: np.ndarray) -> paddle.Tensor:
            return paddle.to_tensor(np.ascontiguousarray(a, dtype=np.float32))

        self.embed = t(ck["model.embed_tokens.weight"])
        self.final_norm = t(ck["model.norm.weight"])
        self.lm_head = t((ck["model.embed_tokens.weight"] if cfg.tie_word_embeddings else ck["lm_head.weight"]).T)
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            n = _layer_names(i)
            self.layers.append({
                "input_norm": t(ck[n["input_norm"]]),
                "qkv": t(np.concatenate([ck[n["q"]], ck[n["k"]], ck[n["v"]]], axis=0).T),
                "o": t(ck[n["o"]].T),
                "post_norm": t(ck[n["post_norm"]]),
                "gate_up": t(np.concatenate([ck[n["gate"]], ck[n["up"]]], axis=0).T),
                "down": t(ck[n["down"]].T),
            })

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def load(cls, model_config, tp_rank: int = 0, tp_size: int = 1) -> "Ernie4_5ForCausalLM":
        """The tiny preset when `model_config.model` is None, else `model.safetensors` of the directory."""
        if model_config.model is None:
            return cls(model_config, random_checkpoint(model_config), tp_rank, tp_size)
        path = os.path.join(model_config.model, WEIGHTS_FILE)
        if not os.path.isfile(path):
            raise ValueError(f"model: {model_config.model!r} has no {WEIGHTS_FILE}")
        from safetensors.numpy import load_file

        return cls(model_config, load_file(path), tp_rank, tp_size)

    def save_pretrained(self, path: str) -> None:
        """Write config.json (with the head_wise_swa section) and model.safetensors."""
        from safetensors.numpy import save_file

        if self.checkpoint is None:
            raise ValueError("save_pretrained: this is one tensor-parallel rank's shard, not the whole model")
        os.makedirs(path, exist_ok=True)
        cfg = self.config
        raw = {k: v for k, v in cfg.raw.items() if k != "head_wise_swa"}
        raw.update(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                   num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                   head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
                   tie_word_embeddings=cfg.tie_word_embeddings, eos_token_id=cfg.eos_token_id)
        if cfg.head_wise_swa is not None:
            raw["head_wise_swa"] = cfg.head_wise_swa.to_dict()
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(raw, f, indent=2)
        save_file(self.checkpoint, os.path.join(path, WEIGHTS_FILE))

    # -- compute -------------------------------------------------------------------------------
    def _rms_norm(self, x: paddle.Tensor, weight: paddle.Tensor) -> paddle.Tensor:
        variance = (x * x).mean(axis=-1, keepdim=True)
        return x * paddle.rsqrt(variance + self.config.rms_norm_eps) * weight

    @paddle.no_grad()
    def forward(self, meta: ForwardMeta) -> paddle.Tensor:
        """Logits [num_sampled, vocab] for the last token of every request that samples this step."""
        num_tokens = meta.input_ids.shape[0]
        rows = _aligned(num_tokens)
        hidden = self._embed(_pad_rows(meta.input_ids, rows))
        for layer_id, w in enumerate(self.layers):
            x = self._rms_norm(hidden, w["input_norm"])
            qkv = paddle.matmul(x, w["qkv"])
            attn = meta.attn_backend.forward(layer_id, qkv[:num_tokens] if rows != num_tokens else qkv, meta)
            hidden = hidden + tp_.all_reduce(paddle.matmul(_pad_rows(attn, rows), w["o"]), self.tp_size)
            x = self._rms_norm(hidden, w["post_norm"])
            gate, up = paddle.chunk(paddle.matmul(x, w["gate_up"]), 2, axis=-1)
            hidden = hidden + tp_.all_reduce(paddle.matmul(F.silu(gate) * up, w["down"]), self.tp_size)
        num_sampled = meta.sample_rows.shape[0]
        if num_sampled == 0:
            return paddle.zeros([0, self.config.vocab_size], dtype="float32")
        last = paddle.gather(hidden, _pad_rows(meta.sample_rows, _aligned(num_sampled)))
        logits = paddle.matmul(self._rms_norm(last, self.final_norm), self.lm_head)
        logits = tp_.all_gather_last_axis(logits, self.tp_size)
        return logits[:num_sampled, :self.config.vocab_size]

    def _embed(self, ids: paddle.Tensor) -> paddle.Tensor:
        """Vocab-parallel lookup: each rank embeds the ids of its slice (zeros elsewhere), summed."""
        if self.tp_size == 1:
            return F.embedding(ids, self.embed)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.embed.shape[0])
        out = F.embedding(paddle.where(mine, local, paddle.zeros_like(local)), self.embed)
        out = out * mine.astype(out.dtype).unsqueeze(-1)
        return tp_.all_reduce(out, self.tp_size)
