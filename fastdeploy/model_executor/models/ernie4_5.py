"""ERNIE-4.5 decoder in Paddle: embeddings, RMSNorm, GQA attention (through the attention
backend, RoPE inside it), SwiGLU MLP or the MoE block (ernie4_5_moe.py), tied or untied LM head.

Weights are held once, under the checkpoint's own names and in its `[out, in]` layout
(`model.layers.N.self_attn.q_proj.weight`); the projections multiply with `transpose_y`, so a
loaded tensor is used as it is and can be sliced by name (tensor parallelism).
"""

from __future__ import annotations

import json
import os

import numpy as np
import paddle
import paddle.nn.functional as F

from fastdeploy.model_executor import model_loader
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
    from fastdeploy.model_executor.models.ernie4_5_moe import is_moe_layer, moe_shapes

    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_hidden_layers):
        n = _layer_names(i)
        shapes.update({
            n["input_norm"]: (h,), n["post_norm"]: (h,),
            n["q"]: (cfg.num_attention_heads * d, h), n["k"]: (cfg.num_key_value_heads * d, h),
            n["v"]: (cfg.num_key_value_heads * d, h), n["o"]: (h, cfg.num_attention_heads * d),
        })
        if is_moe_layer(cfg, i):
            shapes.update(moe_shapes(cfg, i))
        else:
            shapes.update({n["gate"]: (inter, h), n["up"]: (inter, h), n["down"]: (h, inter)})
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
        if name.endswith("e_score_correction_bias"):
            weights[name] = rng.normal(0, 0.1, shape).astype(np.float32)
        elif len(shape) == 1:
            weights[name] = np.ones(shape, np.float32) + rng.normal(0, 0.05, shape).astype(np.float32)
        elif name == "model.embed_tokens.weight":
            weights[name] = rng.normal(0, 1.0, shape).astype(np.float32)
        else:
            scale = 3.0 if name == "lm_head.weight" else 1.0
            weights[name] = (rng.normal(0, 1.0, shape) * scale / np.sqrt(shape[1])).astype(np.float32)
    return weights


class Ernie4_5ForCausalLM:
    # Kept float32 whatever the compute dtype (PaddleFormers' `_keep_in_fp32_modules`): the router.
    KEEP_FLOAT32 = ("mlp.gate.weight", "e_score_correction_bias")

    def __init__(self, model_config, weights: dict, tp_rank: int = 0, tp_size: int = 1):
        """`weights`: checkpoint name -> Paddle tensor, already checked against `checkpoint_shapes`.

        Under tensor parallelism (`tp_size` > 1) this object is rank `tp_rank`'s shard: `load`
        permutes each tensor to the load-time KV-head order and slices it by name as it is read
        (tensor_parallel.py); the row-parallel outputs (o_proj, the MLP or MoE block) are
        all-reduced in forward."""
        from fastdeploy.model_executor.models.ernie4_5_moe import MoEBlock, is_moe_layer

        self.config = cfg = model_config
        self.dtype = cfg.dtype
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weights = weights
        self.vocab_start = tp_.vocab_slice(cfg.vocab_size, tp_rank, tp_size)[0] if tp_size > 1 else 0
        self.lm_head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        self.moe = {i: MoEBlock(cfg, i, weights) for i in range(cfg.num_hidden_layers) if is_moe_layer(cfg, i)}
        # Called as observer(meta, hidden) with the final hidden states of every row of a step, before
        # the sampled rows are picked: how a tool reads prompt logits off the real path (lm_logits).
        self.hidden_observer = None

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def load(cls, model_config, tp_rank: int = 0, tp_size: int = 1) -> "Ernie4_5ForCausalLM":
        """A preset's seeded random weights when `model_config.model` is None, else the directory's checkpoint."""
        def mine(name: str, tensor: paddle.Tensor) -> paddle.Tensor:  # this rank's part, as each tensor arrives
            return tp_.rank_tensor(name, tensor, model_config, tp_rank, tp_size)

        if model_config.model is None:
            weights = {name: mine(name, paddle.to_tensor(a).astype(
                "float32" if any(k in name for k in cls.KEEP_FLOAT32) else model_config.dtype))
                for name, a in random_checkpoint(model_config).items()}
            return cls(model_config, weights, tp_rank, tp_size)
        return cls(model_config, model_loader.load_checkpoint(model_config.model, checkpoint_shapes(model_config),
                                                              model_config.dtype, cls.KEEP_FLOAT32, transform=mine),
                   tp_rank, tp_size)

    def weight_bytes(self) -> int:
        return sum(int(np.prod(t.shape)) * t.element_size() for t in self.weights.values())

    def save_pretrained(self, path: str) -> None:
        """Write config.json (with the head_wise_swa section) and model.safetensors (float32)."""
        from safetensors.numpy import save_file

        if self.tp_size > 1:
            raise ValueError("save_pretrained: this is one tensor-parallel rank's shard, not the whole model")
        os.makedirs(path, exist_ok=True)
        cfg = self.config
        raw = {k: v for k, v in cfg.raw.items() if k != "head_wise_swa"}
        raw.update(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                   num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                   head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size, rms_norm_eps=cfg.rms_norm_eps,
                   tie_word_embeddings=cfg.tie_word_embeddings, eos_token_id=cfg.eos_token_id)
        if cfg.head_wise_swa is not None:
            raw["head_wise_swa"] = cfg.head_wise_swa.to_dict()
        if cfg.preset is not None:  # no tokenizer file to save: reload with the preset's byte tokenizer
            raw["fastdeploy_byte_tokenizer"] = True
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(raw, f, indent=2)
        save_file({k: v.astype("float32").numpy() for k, v in self.weights.items()}, os.path.join(path, WEIGHTS_FILE))

    # -- compute -------------------------------------------------------------------------------
    def _rms_norm(self, x: paddle.Tensor, weight: paddle.Tensor) -> paddle.Tensor:
        # PaddleFormers normalises in float32 and scales in the weight's dtype.
        x32 = x if x.dtype == paddle.float32 else x.astype("float32")
        variance = (x32 * x32).mean(axis=-1, keepdim=True)
        normed = x32 * paddle.rsqrt(variance + self.config.rms_norm_eps)
        return (normed if normed.dtype == weight.dtype else normed.astype(weight.dtype)) * weight

    def _linear(self, x: paddle.Tensor, name: str) -> paddle.Tensor:
        return paddle.matmul(x, self.weights[name], transpose_y=True)

    def _dense_mlp(self, x: paddle.Tensor, n: dict) -> paddle.Tensor:
        return self._linear(F.silu(self._linear(x, n["gate"])) * self._linear(x, n["up"]), n["down"])

    @paddle.no_grad()
    def forward(self, meta: ForwardMeta) -> paddle.Tensor:
        """Logits [num_sampled, vocab] for the last token of every request that samples this step."""
        w = self.weights
        num_tokens = meta.input_ids.shape[0]
        rows = _aligned(num_tokens)
        hidden = self._embed(_pad_rows(meta.input_ids, rows))
        for layer_id in range(self.config.num_hidden_layers):
            n = _layer_names(layer_id)
            x = self._rms_norm(hidden, w[n["input_norm"]])
            qkv = paddle.concat([self._linear(x, n["q"]), self._linear(x, n["k"]), self._linear(x, n["v"])], axis=-1)
            attn = meta.attn_backend.forward(layer_id, qkv[:num_tokens] if rows != num_tokens else qkv, meta)
            hidden = hidden + tp_.all_reduce(self._linear(_pad_rows(attn, rows), n["o"]), self.tp_size)
            x = self._rms_norm(hidden, w[n["post_norm"]])
            moe = self.moe.get(layer_id)
            ffn = moe(x, num_tokens) if moe is not None else self._dense_mlp(x, n)
            hidden = hidden + tp_.all_reduce(ffn, self.tp_size)
        if self.hidden_observer is not None:
            self.hidden_observer(meta, hidden[:num_tokens])
        num_sampled = meta.sample_rows.shape[0]
        if num_sampled == 0:
            return paddle.zeros([0, self.config.vocab_size], dtype="float32")
        last = paddle.gather(hidden, _pad_rows(meta.sample_rows, _aligned(num_sampled)))
        return self.lm_logits(last)[:num_sampled]

    def lm_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """float32 logits [rows, vocab] of final hidden states (rows a multiple of ROW_ALIGN keep them
        independent of the batch)."""
        logits = self._linear(self._rms_norm(hidden, self.weights["model.norm.weight"]), self.lm_head_name)
        logits = tp_.all_gather_last_axis(logits, self.tp_size)[:, :self.config.vocab_size]
        return logits if logits.dtype == paddle.float32 else logits.astype("float32")

    def _embed(self, ids: paddle.Tensor) -> paddle.Tensor:
        """Vocab-parallel lookup: each rank embeds the ids of its slice (zeros elsewhere), summed."""
        table = self.weights["model.embed_tokens.weight"]
        if self.tp_size == 1:
            return F.embedding(ids, table)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < table.shape[0])
        out = F.embedding(paddle.where(mine, local, paddle.zeros_like(local)), table)
        out = out * mine.astype(out.dtype).unsqueeze(-1)
        return tp_.all_reduce(out, self.tp_size)
