"""ModelRunner: one rank's model shard, KV cache and attention backend; StepInput -> StepOutput.

It knows nothing of requests or the scheduler: the engine sends plain step messages
(step_input.py). With tensor_parallel_size 1 the engine calls it in-process; otherwise each
worker process (worker_process.py) holds one, and the ranks meet in the model's collectives.
"""

from __future__ import annotations

import numpy as np
import paddle

from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers.attention import get_attention_backend
from fastdeploy.model_executor.layers.blas_gemm import build_dense_ops
from fastdeploy.model_executor.layers.rotary_embedding import layer_rope_tables
from fastdeploy.model_executor.models.decoder import CausalLM
from fastdeploy.model_executor.tensor_parallel import local_kv_heads
from fastdeploy.worker.device import paddle_device_name
from fastdeploy.worker.host_memory import keep_freed_host_memory
from fastdeploy.worker.prompt_logprobs import capture_prompt_rows
from fastdeploy.worker.step_buffers import StepBufferLayout, StepBuffers
from fastdeploy.worker.step_input import StepInput, StepOutput


class ModelRunner:
    def __init__(self, fd_config, tp_rank: int = 0):
        # Weights, caches, rotary tables and step buffers are all made on this device (worker/device.py).
        device = getattr(fd_config, "device", "cpu")
        paddle.set_device(paddle_device_name(device, tp_rank))
        if device == "cpu":
            keep_freed_host_memory()
            build_dense_ops()
        self.fd_config = fd_config
        model = fd_config.model_config
        self.tp_rank = tp_rank
        self.tp_size = fd_config.parallel_config.tensor_parallel_size
        self.kv_heads = local_kv_heads(model.num_key_value_heads, tp_rank, self.tp_size)
        self.model = CausalLM.load(model, tp_rank, self.tp_size)
        self.attn_backend = get_attention_backend(fd_config, layer_rope_tables(model), tp_rank,
                                                 self.model.attention_sinks())
        # The persistent block table's rows on this rank: 1 in 1-D mode, its KV slots head-wise (slots.py).
        self.buffers = StepBuffers(StepBufferLayout.from_config(fd_config, fd_config.table_rows_per_rank))

    def build_forward_meta(self, step: StepInput) -> ForwardMeta:
        """The step in the fixed buffers (its table updates applied to the persistent block table: those of
        this rank's slots, StepInput.for_rank); on a GPU, one host-to-device copy."""
        t = self.buffers.fill(step)
        return ForwardMeta(
            input_ids=t["input_ids"], seq_lens_encoder=t["seq_lens_encoder"], seq_lens_decoder=t["seq_lens_decoder"],
            seq_lens_this_time=t["seq_lens_this_time"], cu_seqlens_q=t["cu_seqlens_q"],
            block_tables=t["block_tables"], sample_rows=t["sample_rows"], starts=step.starts, lengths=step.lengths,
            slot_ids=step.slot_ids, attn_backend=self.attn_backend)

    def execute_model(self, step: StepInput) -> StepOutput:
        """Run one step on this rank. Every rank returns the same answer (the logits are gathered);
        only rank 0's is sent back."""
        with capture_prompt_rows(self.model, step) as capture:
            logits = self.model.forward(self.build_forward_meta(step))
        end_step = getattr(self.attn_backend, "end_step", None)
        if end_step is not None:
            end_step()
        prompt = capture.logprobs() if capture is not None else None
        greedy = np.full(len(step.greedy), -1, np.int64)
        if len(step.greedy) and step.greedy.all():
            # argmax where the logits are (the GPU): only the tokens cross over. On the CPU numpy's is
            # cheaper than an op call (~15 vs ~45 us); both take the first of equal maxima.
            greedy[:] = np.argmax(logits.numpy(), axis=-1) if logits.place.is_cpu_place() else \
                paddle.argmax(logits, axis=-1).numpy()
            return StepOutput(greedy_tokens=greedy, logits=np.zeros((0, logits.shape[-1]), np.float32),
                              prompt_logprobs=prompt)
        host = logits.numpy()
        if step.greedy.any():
            greedy[step.greedy] = np.argmax(host[step.greedy], axis=-1)
        return StepOutput(greedy_tokens=greedy, logits=np.ascontiguousarray(host[~step.greedy]),
                          prompt_logprobs=prompt)
