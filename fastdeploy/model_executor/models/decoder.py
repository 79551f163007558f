"""The one decoder: ERNIE-4.5 (dense and MoE), Llama and Gemma 3, their differences read from the
architecture table (architectures.py): embeddings (scaled for Gemma), RMSNorm (two or four per layer),
GQA attention through the attention backend (RoPE inside it; optional q/k bias and per-head q/k
RMSNorm), SwiGLU or GeGLU MLP or the MoE block (ernie4_5_moe.py), tied or untied LM head.

Weights are held once, under the checkpoint's own names and in its `[out, in]` layout
(`model.layers.N.self_attn.q_proj.weight`), so a loaded tensor can be sliced by name (tensor
parallelism); then, at construction, the projections are packed once into `Linear`s for the
device's GEMM (layers/linear.py), q/k/v and gate/up fused into one GEMM each, their names kept
in the dict as views. That GEMM is row-invariant, so rows need no padding. What a source
stores differently (rotate-half q/k rows, Gemma's norm offset) is converted once at load
(model_loader.to_engine_layout), never in the forward pass.
"""

from __future__ import annotations

import collections
import json
import logging
import os

import numpy as np
import paddle
import paddle.nn.functional as F

from fastdeploy import envs
from fastdeploy.model_executor import model_loader
from fastdeploy.model_executor import tensor_parallel as tp_
from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers.activation import gated_activation
from fastdeploy.model_executor.layers.rms_norm import add_rms_norm, rms_norm
from fastdeploy.model_executor.models.ernie4_5_moe import MoEBlock, is_moe_layer, moe_shapes
from fastdeploy.model_executor.models.gpt_oss_moe import GptOssMoEBlock, gpt_oss_moe_shapes
from fastdeploy.model_executor.layers.linear import fuse_named

WEIGHTS_FILE = "model.safetensors"

def _layer_names(i: int) -> dict:
    p = f"model.layers.{i}."
    return {
        "input_norm": p + "input_layernorm.weight",
        "q": p + "self_attn.q_proj.weight",
        "k": p + "self_attn.k_proj.weight",
        "v": p + "self_attn.v_proj.weight",
        "o": p + "self_attn.o_proj.weight",
        "post_norm": p + "post_attention_layernorm.weight",
        "q_bias": p + "self_attn.q_proj.bias",
        "k_bias": p + "self_attn.k_proj.bias",
        "v_bias": p + "self_attn.v_proj.bias",
        "sinks": p + "self_attn.sinks",
        "o_bias": p + "self_attn.o_proj.bias",
        "q_norm": p + "self_attn.q_norm.weight",
        "k_norm": p + "self_attn.k_norm.weight",
        "pre_ffn_norm": p + "pre_feedforward_layernorm.weight",
        "post_ffn_norm": p + "post_feedforward_layernorm.weight",
        "gate": p + "mlp.gate_proj.weight",
        "up": p + "mlp.up_proj.weight",
        "down": p + "mlp.down_proj.weight",
    }


def checkpoint_shapes(cfg) -> dict:
    """Every parameter the checkpoint must hold, with its on-disk `[out, in]` shape."""
    arch = cfg.arch
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_hidden_layers):
        n = _layer_names(i)
        if not arch.post_norms:
            shapes[n["input_norm"]] = (h,)
        if not arch.parallel_block:
            shapes[n["post_norm"]] = (h,)
        shapes.update({
            n["q"]: (cfg.num_attention_heads * d, h), n["k"]: (cfg.num_key_value_heads * d, h),
            n["v"]: (cfg.num_key_value_heads * d, h), n["o"]: (h, cfg.num_attention_heads * d),
        })
        if cfg.qkv_bias:
            shapes.update({n["q_bias"]: (cfg.num_attention_heads * d,), n["k_bias"]: (cfg.num_key_value_heads * d,),
                           n["v_bias"]: (cfg.num_key_value_heads * d,)})
        if cfg.o_bias:
            shapes[n["o_bias"]] = (h,)
        if arch.attention_sinks:
            shapes[n["sinks"]] = (cfg.num_attention_heads,)
        if arch.qk_norm_over_heads:
            shapes.update({n["q_norm"]: (cfg.num_attention_heads * d,), n["k_norm"]: (cfg.num_key_value_heads * d,)})
        elif arch.qk_norm:
            shapes.update({n["q_norm"]: (d,), n["k_norm"]: (d,)})
        if arch.sandwich_norms:
            shapes.update({n["pre_ffn_norm"]: (h,), n["post_ffn_norm"]: (h,)})
        if arch.post_norms:
            shapes[n["post_ffn_norm"]] = (h,)
        if is_moe_layer(cfg, i):
            shapes.update(gpt_oss_moe_shapes(cfg, i) if cfg.moe.style == "gpt_oss" else moe_shapes(cfg, i))
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
        if name.endswith("e_score_correction_bias") or name.endswith("_proj.bias"):
            weights[name] = rng.normal(0, 0.1, shape).astype(np.float32)
        elif len(shape) == 1:
            weights[name] = np.ones(shape, np.float32) + rng.normal(0, 0.05, shape).astype(np.float32)
        elif name == "model.embed_tokens.weight":
            weights[name] = rng.normal(0, 1.0, shape).astype(np.float32)
        else:
            scale = 3.0 if name == "lm_head.weight" else 1.0
            weights[name] = (rng.normal(0, 1.0, shape) * scale / np.sqrt(shape[1])).astype(np.float32)
    return weights


class CausalLM:
    # Kept float32 whatever the compute dtype (PaddleFormers' `_keep_in_fp32_modules`): the router.
    KEEP_FLOAT32 = ("mlp.gate.weight", "e_score_correction_bias", "self_attn.sinks")

    def __init__(self, model_config, weights: dict, tp_rank: int = 0, tp_size: int = 1):
        """`weights`: checkpoint name -> Paddle tensor, already checked against `checkpoint_shapes`.

        Under tensor parallelism (`tp_size` > 1) this object is rank `tp_rank`'s shard: `load`
        permutes each tensor to the load-time KV-head order and slices it by name as it is read
        (tensor_parallel.py); the row-parallel outputs (o_proj, the MLP or MoE block) are
        all-reduced in forward."""
        self.config = cfg = model_config
        if (cfg.arch.qk_norm_over_heads or cfg.arch.attention_sinks) and tp_size > 1:
            why = "its q/k norm spans the heads every rank would split" if cfg.arch.qk_norm_over_heads else \
                "its sinks, o_proj bias and stacked experts are not split across ranks"
            raise ValueError(f"{cfg.arch.name}: tensor parallelism is not supported ({why}); serve it with "
                             f"--tensor-parallel-size 1")
        self.dtype = cfg.dtype
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weights = weights
        self.vocab_start = tp_.vocab_slice(cfg.vocab_size, tp_rank, tp_size)[0] if tp_size > 1 else 0
        self.lm_head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        block = GptOssMoEBlock if cfg.moe is not None and cfg.moe.style == "gpt_oss" else MoEBlock
        self.moe = {i: block(cfg, i, weights) for i in range(cfg.num_hidden_layers) if is_moe_layer(cfg, i)}
        # Called as observer(meta, hidden) with the final hidden states of every row of a step, before
        # the sampled rows are picked: how a tool reads prompt logits off the real path (lm_logits).
        self.hidden_observer = None
        self.arch = cfg.arch
        self.local_heads = cfg.num_attention_heads // tp_size
        self.local_kv_heads = cfg.num_key_value_heads // tp_size
        # Gemma: embeddings scaled by sqrt(hidden), rounded to the weights' dtype as the reference does.
        self.embed_scale = float(np.float32(cfg.hidden_size ** 0.5)) if cfg.arch.embed_scale else None
        self.layer_names = names = [_layer_names(i) for i in range(cfg.num_hidden_layers)]  # built once, not per step
        self.qkv = [fuse_named(weights, [n["q"], n["k"], n["v"]]) for n in names]
        self.o = [fuse_named(weights, [n["o"]]) for n in names]
        self.gate_up = {i: fuse_named(weights, [n["gate"], n["up"]]) for i, n in enumerate(names) if i not in self.moe}
        self.down = {i: fuse_named(weights, [n["down"]]) for i, n in enumerate(names) if i not in self.moe}
        self.lm_head = fuse_named(weights, [self.lm_head_name])  # tied: the embedding reads its rows
        # Per layer, the norm weights the forward pass reads, looked up once.
        # (OLMo has no input norm, Cohere no post-attention norm)
        self.layer_norms = [(weights.get(n["input_norm"]), weights.get(n["post_norm"])) for n in names]
        self.plain_qkv = not (cfg.qkv_bias or self.arch.qk_norm or cfg.attn_scale_ratio != 1.0)
        self._bind_cpu_float32_ops()
        self._norm = self._layer_norm if self.arch.layer_norm else self._rms_norm  # a layer's norms, the final one
        logging.getLogger("fastdeploy.model").info("dense layers: %s", self.dense_layer_storage())

    def attention_sinks(self):
        """Per layer the learned sink logits of this rank's query heads, float32 [heads] (gpt-oss), or None for
        a model without them: what the attention backend adds to each softmax's denominator."""
        if not self.arch.attention_sinks:
            return None
        return [self.weights[n["sinks"]].astype("float32") for n in self.layer_names]

    def dense_layers(self) -> list:
        return [*self.qkv, *self.o, *self.gate_up.values(), *self.down.values(), self.lm_head]

    def dense_layer_bytes(self) -> int:
        """Bytes of every dense layer's weight as held (what a decode step reads)."""
        return sum(layer.nbytes for layer in self.dense_layers())

    def dense_layer_storage(self) -> str:
        """How the dense layers' weights are held, e.g. "181 x gguf Q4_1, 1 x gguf Q8_0: 112.0 MB"."""
        layers = self.dense_layers()
        kinds = collections.Counter(layer.storage for layer in layers)
        return ", ".join(f"{n} x {k}" for k, n in kinds.most_common()) + \
            f": {sum(layer.nbytes for layer in layers) / 1e6:.1f} MB"

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def load(cls, model_config, tp_rank: int = 0, tp_size: int = 1) -> "CausalLM":
        """A preset's seeded random weights when `model_config.model` is None, else the GGUF file's or the
        directory's checkpoint, converted to the engine's layout as each tensor arrives."""
        def mine(name: str, tensor: paddle.Tensor) -> paddle.Tensor:  # this rank's part, as each tensor arrives
            return tp_.rank_tensor(name, model_loader.to_engine_layout(name, tensor, model_config),
                                   model_config, tp_rank, tp_size)

        if model_config.model is None:
            weights = {name: mine(name, paddle.to_tensor(a).astype(
                "float32" if any(k in name for k in cls.KEEP_FLOAT32) else model_config.dtype))
                for name, a in random_checkpoint(model_config).items()}
            return cls(model_config, weights, tp_rank, tp_size)
        if model_config.gguf_file is not None:
            from fastdeploy.model_executor.gguf_loader import iter_gguf_checkpoint

            tensors = iter_gguf_checkpoint(model_config, cls.KEEP_FLOAT32)
        else:
            tensors = model_loader.iter_checkpoint(model_config.model, model_config.dtype, cls.KEEP_FLOAT32)
        return cls(model_config, model_loader.check_checkpoint(tensors, checkpoint_shapes(model_config), mine),
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
    def _bind_cpu_float32_ops(self) -> None:
        """On the CPU in float32 (every tensor of a step is then a CPU float32 tensor), the norm and
        activation ops are bound here once instead of each call checking dtypes and places: those
        checks were ~0.7 ms of host time in a 30-layer decode step. Elsewhere the generic entries."""
        norm = self.weights["model.norm.weight"]
        self.cpu_float32 = (str(self.dtype).replace("paddle.", "") == "float32" and norm.dtype == paddle.float32
                            and norm.place.is_cpu_place())
        self.fused_layers = None
        if not self.cpu_float32:
            return
        from fastdeploy.model_executor.layers.activation import ACTIVATIONS
        from fastdeploy.model_executor.layers.blas_gemm import add_rms_norm_rows, gated_activation_rows, \
            rms_norm_rows

        eps, act = float(self.config.rms_norm_eps), ACTIVATIONS.get(self.arch.activation)
        norm_op, add_norm_op, act_op = rms_norm_rows(), add_rms_norm_rows(), gated_activation_rows()
        self._rms_norm = lambda x, weight: norm_op(x, weight, eps)
        self._add_norm_rows = lambda hidden, delta, weight: tuple(add_norm_op(hidden, delta, weight, eps))
        if act is not None:
            self._gated = lambda gate_up: act_op(gate_up, act)
        self._bind_fused_layers(eps, act)

    def _bind_fused_layers(self, eps: float, act) -> None:
        """Every layer's dense work as two op calls (decoder_block_ops.cc), where each of its weights is
        GGUF blocks and the layer is the plain kind (one rank, no MoE, no bias / q-k norm / sandwich
        norms): the bits of the op-by-op path, ~5 fewer Paddle op calls per layer; and those layers'
        operands for the whole stack in one call (_decoder_stack)."""
        self.fused_layers = None
        self._stack_layers, self._stack = None, None
        # FD_CPU_FUSED_LAYERS, read once here (the model is built at start-up); a measurement that compares
        # the levels in one engine sets this attribute between steps.
        self.fused_layers_level = envs.FD_CPU_FUSED_LAYERS
        if (self.fused_layers_level == 0 or act is None or self.tp_size > 1 or self.moe or not self.plain_qkv
                or self.arch.sandwich_norms or self.arch.post_norms or self.arch.layer_norm
                or self.arch.parallel_block or self.arch.attention_sinks or self.config.attn_logit_softcapping
                or self.config.final_logit_softcapping):
            return
        operands = [(self.qkv[i].block_operand, self.o[i].block_operand, self.gate_up[i].block_operand,
                     self.down[i].block_operand) for i in range(self.config.num_hidden_layers)]
        if any(op is None for layer in operands for op in layer):
            return
        from fastdeploy.model_executor.layers.blas_gemm import decoder_block_ops

        norm_qkv_op, mlp_op = decoder_block_ops()
        self.fused_layers = []
        for (input_norm, post_norm), (qkv, o, gu, down) in zip(self.layer_norms, operands):
            qkv_args = (input_norm, *qkv[:3], qkv[3], qkv[4], qkv[5], eps)
            mlp_args = (*o[:3], post_norm, *gu[:3], *down[:3], o[4], o[5], gu[3], gu[4], gu[5], down[4], down[5], eps,
                        act)
            self.fused_layers.append((
                lambda hidden, pending, a=qkv_args: norm_qkv_op(hidden, pending, *a),
                lambda attn, hidden, a=mlp_args: mlp_op(attn, hidden, *a)))
        # For the whole stack in one call: bound to the attention backend's lanes at its first step; the
        # LM head too where it is GGUF blocks (one rank: its logits are the whole vocabulary).
        head = self.lm_head.block_operand
        self._stack_layers = ([(*norms, *ops) for norms, ops in zip(self.layer_norms, operands)],
                              None if head is None else (self.weights["model.norm.weight"], head), eps, act)

    def _decoder_stack(self, backend):
        """Every layer of a step in one op call (models/decoder_stack.py), where the backend's attention
        is the CPU op and FD_CPU_FUSED_LAYERS is 2; None otherwise (the per-layer calls then run)."""
        if (self._stack_layers is None or self.fused_layers_level < 2
                or not getattr(backend, "runs_cpu_op", lambda: False)()):
            return None
        if self._stack is None or self._stack.backend() is not backend:
            from fastdeploy.model_executor.models.decoder_stack import DecoderStack

            layers, head, eps, act = self._stack_layers
            self._stack = DecoderStack(layers, head, backend, eps, act)
        return self._stack

    def _rms_norm(self, x: paddle.Tensor, weight: paddle.Tensor) -> paddle.Tensor:
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def _add_norm_rows(self, hidden: paddle.Tensor, delta: paddle.Tensor, weight: paddle.Tensor) -> tuple:
        return add_rms_norm(hidden, delta, weight, self.config.rms_norm_eps)

    def _layer_norm(self, x: paddle.Tensor, weight: paddle.Tensor) -> paddle.Tensor:
        """Cohere's LayerNorm: mean and variance over the last axis, times the weight, no bias."""
        return F.layer_norm(x, x.shape[-1:], weight=weight, epsilon=self.config.rms_norm_eps)

    def _gated(self, gate_up: paddle.Tensor) -> paddle.Tensor:
        return gated_activation(gate_up, self.arch.activation)

    def _add_norm(self, hidden: paddle.Tensor, delta, weight: paddle.Tensor) -> tuple:
        """(hidden + delta, its norm); delta None: (hidden, its norm). RMSNorm's add is fused with it."""
        if delta is None:
            return hidden, self._norm(hidden, weight)
        if self.arch.layer_norm:
            hidden = hidden + delta
            return hidden, self._norm(hidden, weight)
        return self._add_norm_rows(hidden, delta, weight)

    def _ffn(self, x: paddle.Tensor, layer_id: int, num_tokens: int) -> paddle.Tensor:
        """The layer's MoE block or dense MLP, all-reduced over the ranks."""
        moe = self.moe.get(layer_id)
        return tp_.all_reduce(moe(x, num_tokens) if moe is not None else self._dense_mlp(x, layer_id), self.tp_size)

    def _dense_mlp(self, x: paddle.Tensor, layer_id: int) -> paddle.Tensor:
        # The fused weight is [gate; up] with equal halves, as gated_activation reads it.
        return self.down[layer_id](self._gated(self.gate_up[layer_id](x)))

    def _qkv(self, x: paddle.Tensor, layer_id: int, n: dict) -> paddle.Tensor:
        """[rows, (heads + 2 kv_heads) * head_dim]: q, k, v side by side, as the attention op reads them
        (biases added, and Gemma's per-head q/k RMSNorm and query scale applied before its RoPE)."""
        fused = self.qkv[layer_id]
        qkv = fused(x)
        if self.plain_qkv:
            return qkv
        w, d = self.weights, self.config.head_dim
        q, k, v = fused.split(qkv)
        if self.config.qkv_bias:
            q, k, v = q + w[n["q_bias"]], k + w[n["k_bias"]], v + w[n["v_bias"]]
        if self.arch.qk_norm_over_heads:
            q, k = self._rms_norm(q, w[n["q_norm"]]), self._rms_norm(k, w[n["k_norm"]])
        elif self.arch.qk_norm:
            rows = q.shape[0]
            q = self._rms_norm(q.reshape([rows, self.local_heads, d]), w[n["q_norm"]]).reshape([rows, -1])
            k = self._rms_norm(k.reshape([rows, self.local_kv_heads, d]), w[n["k_norm"]]).reshape([rows, -1])
        if self.config.attn_scale_ratio != 1.0:  # the op scales by head_dim ** -0.5
            q = q * self.config.attn_scale_ratio
        return paddle.concat([q, k, v], axis=-1)

    @paddle.no_grad()
    def forward(self, meta: ForwardMeta) -> paddle.Tensor:
        """Logits [num_sampled, vocab] of the sampled rows (`meta.sample_rows`): the last token of every
        request that samples this step, every row of a piece that verifies drafts."""
        w = self.weights
        num_tokens = meta.input_ids.shape[0]
        hidden = self._embed(meta.input_ids)
        # Each residual add is fused with the norm that reads its sum (add_rms_norm); the last MLP
        # output is added after the loop, the final norm runs on the sampled rows only.
        pending = None
        tp, sandwich, attention = self.tp_size, self.arch.sandwich_norms, meta.attn_backend.forward
        post, parallel = self.arch.post_norms, self.arch.parallel_block
        stack = self._decoder_stack(meta.attn_backend) if self.fused_layers is not None else None
        if stack is not None:  # every layer in one op call (and the LM head on the sampled rows), same bits
            hidden, logits = stack(hidden, meta, with_head=self.hidden_observer is None)
            if logits is not None:
                return logits
        elif self.fused_layers is not None:  # two op calls per layer around its attention, same bits
            for layer_id, (norm_qkv, mlp) in enumerate(self.fused_layers):
                hidden, qkv = norm_qkv(hidden, pending)
                hidden, pending = mlp(attention(layer_id, qkv, meta), hidden)
        else:
            for layer_id in range(self.config.num_hidden_layers):
                n = self.layer_names[layer_id]
                input_norm, post_norm = self.layer_norms[layer_id]
                if post:  # OLMo: a layer reads the residual stream itself
                    hidden = x = hidden if pending is None else hidden + pending
                else:
                    hidden, x = self._add_norm(hidden, pending, input_norm)
                attn = tp_.all_reduce(self.o[layer_id](attention(layer_id, self._qkv(x, layer_id, n), meta)), tp)
                if self.config.o_bias:  # gpt-oss (one rank)
                    attn = attn + w[n["o_bias"]]
                if parallel:  # Cohere: the MLP reads the attention's input; both outputs join the residual
                    pending = attn + self._ffn(x, layer_id, num_tokens)
                    continue
                if sandwich:  # Gemma: norm the attention output, then norm again before the MLP
                    hidden, x = self._add_norm(hidden, self._norm(attn, post_norm), w[n["pre_ffn_norm"]])
                elif post:
                    hidden = x = hidden + self._norm(attn, post_norm)
                else:
                    hidden, x = self._add_norm(hidden, attn, post_norm)
                ffn = self._ffn(x, layer_id, num_tokens)
                pending = self._norm(ffn, w[n["post_ffn_norm"]]) if sandwich or post else ffn
        if pending is not None:
            hidden = hidden + pending
        if self.hidden_observer is not None:
            self.hidden_observer(meta, hidden[:num_tokens])
        num_sampled = meta.sample_rows.shape[0]
        if num_sampled == 0:
            return paddle.zeros([0, self.config.vocab_size], dtype="float32")
        # Every row sampled (a decode step without drafts): sample_rows is 0..n-1, no gather needed.
        return self.lm_logits(hidden if num_sampled == hidden.shape[0] else paddle.gather(hidden, meta.sample_rows))

    def lm_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """float32 logits [rows, vocab] of final hidden states."""
        logits = self.lm_head(self._norm(hidden, self.weights["model.norm.weight"]))
        if self.config.logit_scale != 1.0:  # Cohere
            logits = logits * self.config.logit_scale
        cap = self.config.final_logit_softcapping
        if cap:  # Gemma 2
            logits = paddle.tanh(logits / cap) * cap
        logits = tp_.all_gather_last_axis(logits, self.tp_size)
        if logits.shape[-1] != self.config.vocab_size:  # vocab-parallel shards are padded
            logits = logits[:, :self.config.vocab_size]
        return logits if logits.dtype == paddle.float32 else logits.astype("float32")

    def _embed(self, ids: paddle.Tensor) -> paddle.Tensor:
        """Vocab-parallel lookup: each rank embeds the ids of its slice (zeros elsewhere), summed."""
        table = self.weights["model.embed_tokens.weight"]
        lookup = self.lm_head.rows if self.config.tie_word_embeddings else (lambda i: F.embedding(i, table))
        if self.tp_size == 1:
            out = lookup(ids)
        else:
            local = ids - self.vocab_start
            mine = (local >= 0) & (local < table.shape[0])
            out = lookup(paddle.where(mine, local, paddle.zeros_like(local)))
            out = tp_.all_reduce(out * mine.astype(out.dtype).unsqueeze(-1), self.tp_size)
        return out if self.embed_scale is None else out * self.embed_scale
