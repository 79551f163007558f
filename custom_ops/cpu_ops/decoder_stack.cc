// Every decoder layer of a step in one op call: for each layer, norm + q/k/v (decoder_block_ops),
// the paged attention step (append_attention_step.h) and o_proj + residual + norm + MLP, then the
// last residual add; and, where a head is bound, the final norm and the LM head on the sampled rows.
//
// Why: a one-request decode step of SmolLM2 made 91 Paddle op calls (three a layer), each ~12 us of
// dispatch on this machine, plus the Python loop around them: ~1.5 ms of a ~11 ms step in which one
// core waits. The layer's constant operands (weights, norms, KV-cache lanes, rotary tables, each
// head's window and slot, the attributes) are bound once (decoder_stack_bind) and kept here,
// holding the tensors (so their memory lives as long as the binding); a step passes only what
// changes: the hidden rows, the step's lengths and block table, and the rows that sample.
//
// The same functions run in the same order on the same inputs as the op-by-op path
// (norm_qkv_blocks, append_attention_cpu, mlp_blocks, then hidden + pending; rms_norm_rows and the
// LM head's product on the gathered rows), so the outputs have its bits
// (tests/real_models/test_decoder_stack.py), and a row's bits never depend on its batch mates.

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "append_attention_step.h"
#include "decoder_block_ops.h"
#include "paddle/extension.h"
#include "rms_norm_row.h"
#include "scratch.h"

namespace {

// Per layer, the tensors in this order (an absent u4 offset is a tensor with no elements):
enum LayerTensor {
  kInputNorm, kQkvQ, kQkvScale, kQkvOffset, kOQ, kOScale, kOOffset, kPostNorm, kGuQ, kGuScale, kGuOffset, kDownQ,
  kDownScale, kDownOffset, kKeyCache, kValueCache, kKeyScales, kValueScales, kCos, kSin, kHeadWindows,
  kKvHeadSlots, kTensorsPerLayer
};
// ... and the integers in this order:
enum LayerInt {
  kQkvN, kQkvGroup, kQkvKind, kOGroup, kOKind, kGuN, kGuGroup, kGuKind, kDownGroup, kDownKind, kNumHeads,
  kKvHeads, kHeadDim, kVisitAll, kIntsPerLayer
};

// A u4 weight's offset, or none for an i8 weight (bound as a tensor with no elements).
paddle::optional<paddle::Tensor> offset_of(const paddle::Tensor& bound) {
  if (bound.numel() == 0) return paddle::none;
  return bound;
}

struct Layer {
  std::vector<paddle::Tensor> t;  // kTensorsPerLayer
  std::vector<int64_t> i;         // kIntsPerLayer
  paddle::optional<paddle::Tensor> offset(LayerTensor k) const { return offset_of(t[k]); }
};

// The final norm and the LM head (a GGUF-block weight: q, scale, offset; n, group, kind).
enum HeadTensor { kHeadNorm, kHeadQ, kHeadScale, kHeadOffset, kHeadTensors };
enum HeadInt { kHeadN, kHeadGroup, kHeadKind, kHeadInts };

struct Stack {
  std::vector<Layer> layers;
  std::vector<paddle::Tensor> head;  // kHeadTensors, or empty: no head bound
  std::vector<int64_t> head_ints;
  float eps;
  int act;
};

// Bindings by id; never destroyed (their tensors must not be freed during static teardown).
struct Registry {
  std::mutex mutex;
  int64_t next = 1;
  std::map<int64_t, std::shared_ptr<const Stack>> stacks;
};

Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

int64_t handle_of(const paddle::Tensor& handle) {
  PD_CHECK(handle.is_cpu() && handle.dtype() == paddle::DataType::INT64 && handle.numel() == 1,
           "decoder_stack: the handle must be the int64 [1] tensor decoder_stack_bind returned");
  return handle.data<int64_t>()[0];
}

std::shared_ptr<const Stack> find(const paddle::Tensor& handle) {
  const int64_t id = handle_of(handle);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.stacks.find(id);
  PD_CHECK(it != r.stacks.end(), "decoder_stack: no binding ", id, " (released, or never bound)");
  return it->second;
}

std::vector<paddle::Tensor> DecoderStackBind(const std::vector<paddle::Tensor>& tensors,
                                             const std::vector<paddle::Tensor>& head,
                                             const std::vector<int64_t>& ints, const std::vector<int64_t>& head_ints,
                                             float eps, int act) {
  PD_CHECK(!tensors.empty() && tensors.size() % kTensorsPerLayer == 0,
           "decoder_stack_bind: ", kTensorsPerLayer, " tensors per layer, got ", tensors.size());
  const size_t layers = tensors.size() / kTensorsPerLayer;
  PD_CHECK(ints.size() == layers * kIntsPerLayer, "decoder_stack_bind: ", kIntsPerLayer,
           " integers per layer, got ", ints.size(), " for ", layers, " layers");
  PD_CHECK(act == 0 || act == 1, "decoder_stack_bind: act must be 0 (silu) or 1 (gelu_tanh), got ", act);
  auto stack = std::make_shared<Stack>();
  stack->eps = eps;
  stack->act = act;
  for (size_t l = 0; l < layers; ++l) {
    Layer layer;
    layer.t.assign(tensors.begin() + l * kTensorsPerLayer, tensors.begin() + (l + 1) * kTensorsPerLayer);
    layer.i.assign(ints.begin() + l * kIntsPerLayer, ints.begin() + (l + 1) * kIntsPerLayer);
    for (const paddle::Tensor& t : layer.t)
      PD_CHECK(t.is_cpu(), "decoder_stack_bind: layer ", l, ": every tensor must be on the CPU");
    stack->layers.push_back(std::move(layer));
  }
  // No head: head_ints empty (the tensors given are then placeholders, not kept).
  PD_CHECK(head_ints.empty() || (head.size() == kHeadTensors && head_ints.size() == kHeadInts),
           "decoder_stack_bind: a head is ", int(kHeadTensors), " tensors (norm, q, scale, offset) and ",
           int(kHeadInts), " integers (n, group, kind)");
  if (!head_ints.empty()) {
    stack->head = head;
    stack->head_ints = head_ints;
  }
  Registry& r = registry();
  paddle::Tensor handle = paddle::empty({1}, paddle::DataType::INT64, paddle::CPUPlace());
  std::lock_guard<std::mutex> lock(r.mutex);
  handle.data<int64_t>()[0] = r.next;
  r.stacks[r.next++] = std::move(stack);
  return {handle};
}

std::vector<paddle::Tensor> DecoderStackRelease(const paddle::Tensor& handle) {
  const int64_t id = handle_of(handle);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.stacks.erase(id);
  return {paddle::empty({0}, paddle::DataType::INT64, paddle::CPUPlace())};
}

// Logits [rows, n] of the sampled rows: rms_norm_rows' norm_row on each, then the LM head's product
// (what the model's lm_logits runs on the gathered rows); [0, 0] without a head or rows.
paddle::Tensor head_logits(const Stack& stack, const paddle::Tensor& hidden, const paddle::Tensor& sample_rows) {
  if (stack.head.empty() || sample_rows.numel() == 0)
    return paddle::empty({0, 0}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const bool int32 = sample_rows.dtype() == paddle::DataType::INT32;
  PD_CHECK(sample_rows.is_cpu() && (int32 || sample_rows.dtype() == paddle::DataType::INT64),
           "decoder_stack_forward: sample_rows must be a CPU int32 or int64 tensor");
  const auto& h = stack.head;
  const auto& i = stack.head_ints;
  const int64_t rows = sample_rows.numel(), tokens = hidden.shape()[0], d = hidden.shape()[1];
  PD_CHECK(h[kHeadNorm].numel() == d, "decoder_stack_forward: the final norm has ", h[kHeadNorm].numel(),
           " elements, hidden ", d);
  thread_local std::vector<float> normed_buf;
  float* normed = fd_cpu::grown(normed_buf, size_t(rows * d));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = int32 ? int64_t(sample_rows.data<int32_t>()[r]) : sample_rows.data<int64_t>()[r];
    PD_CHECK(row >= 0 && row < tokens, "decoder_stack_forward: sample row ", row, " out of [0, ", tokens, ")");
    fd_cpu::norm_row(hidden.data<float>() + row * d, h[kHeadNorm].data<float>(), d, stack.eps,
                     normed + r * d);
  }
  paddle::Tensor logits = paddle::empty({rows, i[kHeadN]}, paddle::DataType::FLOAT32, hidden.place());
  fd_cpu::decoder::block_weight_product(h[kHeadQ], h[kHeadScale], offset_of(h[kHeadOffset]), i[kHeadN],
                                        i[kHeadGroup], i[kHeadKind], normed, rows, d, logits.data<float>());
  return logits;
}

std::vector<paddle::Tensor> DecoderStackForward(const paddle::Tensor& handle, const paddle::Tensor& hidden_in,
                                                const paddle::Tensor& seq_lens_encoder,
                                                const paddle::Tensor& seq_lens_decoder,
                                                const paddle::Tensor& seq_lens_this_time,
                                                const paddle::Tensor& cu_seqlens_q,
                                                const paddle::Tensor& block_tables,
                                                const paddle::Tensor& sample_rows) {
  const std::shared_ptr<const Stack> stack = find(handle);  // alive for the call even if released meanwhile
  paddle::Tensor hidden = hidden_in;
  paddle::optional<paddle::Tensor> pending;
  for (const Layer& L : stack->layers) {
    const auto& t = L.t;
    const auto& i = L.i;
    std::vector<paddle::Tensor> normed = fd_cpu::decoder::NormQkvBlocks(
        hidden, pending, t[kInputNorm], t[kQkvQ], t[kQkvScale], L.offset(kQkvOffset), i[kQkvN], i[kQkvGroup],
        i[kQkvKind], stack->eps);
    const paddle::Tensor attn = fd_cpu::append_attention_step(
        normed[1], t[kKeyCache], t[kValueCache], seq_lens_encoder, seq_lens_decoder, seq_lens_this_time,
        cu_seqlens_q, block_tables, t[kCos], t[kSin], t[kHeadWindows], t[kKvHeadSlots], t[kKeyScales],
        t[kValueScales], int(i[kNumHeads]), int(i[kKvHeads]), int(i[kHeadDim]), i[kVisitAll] != 0);
    std::vector<paddle::Tensor> out = fd_cpu::decoder::MlpBlocks(
        attn, normed[0], t[kOQ], t[kOScale], L.offset(kOOffset), t[kPostNorm], t[kGuQ], t[kGuScale],
        L.offset(kGuOffset), t[kDownQ], t[kDownScale], L.offset(kDownOffset), i[kOGroup], i[kOKind], i[kGuN],
        i[kGuGroup], i[kGuKind], i[kDownGroup], i[kDownKind], stack->eps, stack->act);
    hidden = out[0];
    pending = out[1];
  }
  if (pending) {
    // The last MLP output joins the residual here, as `hidden + pending` does after the op-by-op loop.
    paddle::Tensor sum = paddle::empty(hidden.shape(), paddle::DataType::FLOAT32, hidden.place());
    const float* a = hidden.data<float>();
    const float* b = pending->data<float>();
    float* s = sum.data<float>();
    for (int64_t k = 0; k < sum.numel(); ++k) s[k] = a[k] + b[k];
    hidden = sum;
  }
  return {hidden, head_logits(*stack, hidden, sample_rows)};
}

}  // namespace

PD_BUILD_OP(decoder_stack_bind)
    .Inputs({paddle::Vec("tensors"), paddle::Vec("head")})
    .Outputs({"handle"})
    .Attrs({"ints: std::vector<int64_t>", "head_ints: std::vector<int64_t>", "eps: float", "act: int"})
    .SetKernelFn(PD_KERNEL(DecoderStackBind));

PD_BUILD_OP(decoder_stack_release)
    .Inputs({"handle"})
    .Outputs({"none"})
    .SetKernelFn(PD_KERNEL(DecoderStackRelease));

PD_BUILD_OP(decoder_stack_forward)
    .Inputs({"handle", "hidden", "seq_lens_encoder", "seq_lens_decoder", "seq_lens_this_time", "cu_seqlens_q",
             "block_tables", "sample_rows"})
    .Outputs({"hidden_out", "logits"})
    .SetKernelFn(PD_KERNEL(DecoderStackForward));
