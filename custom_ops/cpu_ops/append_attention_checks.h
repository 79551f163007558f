// Input validation of the append_attention op, shared by the CPU op
// (cpu_ops/append_attention.cc) and the CUDA op wrapper
// (gpu_ops/append_attention.cu), so the two cannot drift apart.
//
// Both wrappers call, before anything is written:
//   1. check_inputs(): place, contiguity and dtype of every input, the op's
//      integer attributes, the qkv width, the cache shape [num_blocks, slots,
//      block_size, head_dim] (head_dim / 2 bytes for int4 pages; slots >= kv_heads: a lane of the slot layout,
//      docs/memory_model.md), the key / value pair (one dtype and shape, or k8v4's int8 keys with
//      uint8 int4 values), the scale tensors of quantized caches, the lengths of the int32 vectors, the table rank
//      and dims against [bsz, slots, max_blocks] (or [bsz, max_blocks] in 1-D
//      mode), the rotary tables;
//   2. check_batch() on host copies of the small int32 inputs: cu_seqlens_q
//      is the prefix sum of seq_lens_this_time and fits the rows of qkv,
//      positions fit the rotary tables, head_windows [2, kv_heads] holds each
//      KV head's window and sink (>= 0; window 0 = full attention),
//      kv_head_slots maps the KV heads to
//      distinct slots of the cache, and every table entry the step reads
//      or writes is a valid page (-1 where a page is needed is a scheduler
//      bug, reported with request, head and block index).
// The only differences between devices are in DeviceRules (which place and
// which dtypes); every message starts with the op's name.
//
// It lives next to the CPU sources because the CPU op is compiled on first
// use from this directory (a copy of it is shipped inside the package); the
// CUDA build adds cpu_ops/ to its include path.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kv_quant.h"
#include "paddle/extension.h"

namespace fd_attn {

struct Geometry {
  int num_heads = 0;
  int kv_heads = 0;
  int slots = 0;  // dim 1 of the caches and of a head-wise table (G); >= kv_heads
  int group = 0;  // q heads per KV head
  int head_dim = 0;
  int block_size = 0;
  int64_t num_blocks = 0;
  int64_t num_pages = 0;  // num_blocks * slots
  int max_blocks = 0;     // table columns
  bool head_wise = false;
  bool visit_all = false;
  int64_t max_position = 0;  // rows of the rotary tables
  int64_t token_num = 0;     // rows of qkv
  int bsz = 0;
  // The format of each lane, from the caches' dtypes: alike, or int8 keys with int4 values (k8v4).
  fd_kvq::Format key_quant = fd_kvq::kFloat;
  fd_kvq::Format value_quant = fd_kvq::kFloat;
  int page_format() const { return fd_kvq::page_format_of(key_quant, value_quant); }  // AppendAttnCacheQuant
};

// The keys a KV head's queries see (docs/op_contract.md): window 0 = every earlier key (a full
// head); window W >= 1 with sink S = keys j <= t with j < S or j > t - W.
struct HeadWindow {
  int64_t window = 0;
  int64_t sink = 0;
  bool slides() const { return window > 0; }
};

// Host pointers to the step's int32 inputs.
struct Batch {
  int bsz = 0;
  const int32_t* seq_lens_decoder = nullptr;
  const int32_t* seq_lens_this_time = nullptr;
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* table = nullptr;
  const int32_t* windows = nullptr;    // head_windows [2, kv_heads]: row 0 windows, row 1 sinks
  const int32_t* head_slot = nullptr;  // [kv_heads]: slot (table row, cache slot) of each KV head
  const HeadWindow* head = nullptr;    // [kv_heads]: each KV head's window and sink (from windows)
};

// Page id of block `i` of KV head `h` of request `r`: the head reads table row
// head_slot[h] (slot s holds page lane[p / G, p % G]); a 1-D block b is page
// b * G + head_slot[h], so both table kinds share every line of the attention
// code (this is what makes the two paths bit-identical on the same pages).
inline int64_t page_of(const Geometry& g, const Batch& b, int r, int h, int i) {
  const int slot = b.head_slot[h];
  if (g.head_wise) {
    return b.table[(int64_t(r) * g.slots + slot) * g.max_blocks + i];
  }
  const int32_t block = b.table[int64_t(r) * g.max_blocks + i];
  return block < 0 ? int64_t(block) : int64_t(block) * g.slots + slot;
}

// Keys [lo, hi) a query reads, as at most two disjoint runs (sink, window).
struct KeyRuns {
  int n = 0;
  int64_t lo[2] = {0, 0};
  int64_t hi[2] = {0, 0};
};

// `last` is the last key position needed (the query position, or the end of
// the step when validating the whole step from its first query `first`).
// `head` is the KV head's own window and sink.
inline KeyRuns visible_runs(const Geometry& g, const HeadWindow& head, int64_t first, int64_t last) {
  KeyRuns runs;
  const int64_t win_lo = std::max<int64_t>(0, first - head.window + 1);
  const int64_t sink_hi = std::min<int64_t>(head.sink, first + 1);
  if (!head.slides() || g.visit_all || win_lo <= sink_hi) {
    runs.n = 1;
    runs.lo[0] = 0;
    runs.hi[0] = last + 1;
    return runs;
  }
  if (sink_hi > 0) {
    runs.lo[runs.n] = 0;
    runs.hi[runs.n] = sink_hi;
    ++runs.n;
  }
  runs.lo[runs.n] = win_lo;
  runs.hi[runs.n] = last + 1;
  ++runs.n;
  return runs;
}

// What differs between the CPU op and the CUDA wrapper.
struct DeviceRules {
  const char* op;      // message prefix
  const char* device;  // "CPU" / "GPU", for messages
  bool gpu;            // inputs must be GPU (else CPU) tensors
  bool check_place;    // false only for the validate-only test op, whose inputs are CPU tensors
  bool qkv_fp32, qkv_bf16, qkv_fp16;
  bool cache_matches_qkv;  // the CUDA kernels need float caches of qkv's dtype
  bool cache_fp32, cache_bf16, cache_fp16;
  bool quantized_needs_bf16;  // the CUDA kernels read quantized pages with bfloat16 qkv only
};

inline DeviceRules cpu_rules() {
  return {"append_attention", "CPU", false, true, true, true, false, false, true, true, false, false};
}

inline DeviceRules gpu_rules() {
  return {"append_attention_gpu", "GPU", true, true, false, true, true, true, false, true, true, true};
}

// int8, e4m3fn and uint8 (int4 pairs) caches are quantized lanes.
inline fd_kvq::Format page_format(paddle::DataType t) {
  if (t == paddle::DataType::INT8) return fd_kvq::kInt8;
  if (t == paddle::DataType::FLOAT8_E4M3FN) return fd_kvq::kE4M3;
  if (t == paddle::DataType::UINT8) return fd_kvq::kInt4;
  return fd_kvq::kFloat;
}

inline const char* format_name(fd_kvq::Format f) {
  return f == fd_kvq::kInt8 ? "int8" : f == fd_kvq::kE4M3 ? "float8_e4m3fn" : "uint8 (int4 pairs)";
}

// Cache elements of a row of head_dim values in a lane of this format: int4 lanes hold two per byte.
inline int64_t lane_row_width(fd_kvq::Format f, int head_dim) {
  return f == fd_kvq::kInt4 ? head_dim / 2 : head_dim;
}

// A tensor's dtype as the messages name it.
inline const char* dtype_name(paddle::DataType t) {
  switch (t) {
    case paddle::DataType::FLOAT32: return "float32";
    case paddle::DataType::BFLOAT16: return "bfloat16";
    case paddle::DataType::FLOAT16: return "float16";
    case paddle::DataType::INT8: return "int8";
    case paddle::DataType::UINT8: return "uint8";
    case paddle::DataType::FLOAT8_E4M3FN: return "float8_e4m3fn";
    default: return "an unsupported dtype";
  }
}

// A quantized lane's scales: float32 [num_blocks, slots, block_size], one per row of every page. Float
// lanes have no scales: a 1-element float32 placeholder keeps the op's arity fixed.
inline void check_scales(const DeviceRules& rules, fd_kvq::Format quant, const std::vector<int64_t>& cache_shape,
                         const paddle::Tensor& scales, const char* name) {
  PD_CHECK(scales.dtype() == paddle::DataType::FLOAT32, rules.op, ": ", name, " must be float32");
  if (quant == fd_kvq::kFloat) {
    PD_CHECK(scales.numel() == 1, rules.op, ": ", name,
             " must be a 1-element placeholder for float caches (scales belong to int8 / "
             "float8_e4m3fn caches)");
  } else {
    PD_CHECK(scales.shape() == std::vector<int64_t>(cache_shape.begin(), cache_shape.end() - 1), rules.op,
             ": ", name, " must be [num_blocks=", cache_shape[0], ", slots=", cache_shape[1],
             ", block_size=", cache_shape[2], "] (one scale per row of every page) for ",
             format_name(quant), " caches");
  }
}

inline std::string dtype_list(bool fp32, bool bf16, bool fp16) {
  std::string s;
  for (const auto& [ok, name] : {std::pair<bool, const char*>{fp32, "float32"},
                                 {bf16, "bfloat16"},
                                 {fp16, "float16"}}) {
    if (!ok) continue;
    if (!s.empty()) s += " or ";
    s += name;
  }
  return s;
}

inline bool dtype_allowed(paddle::DataType t, bool fp32, bool bf16, bool fp16) {
  return (fp32 && t == paddle::DataType::FLOAT32) || (bf16 && t == paddle::DataType::BFLOAT16) ||
         (fp16 && t == paddle::DataType::FLOAT16);
}

// "[2, 4]": a shape as the messages print it.
inline std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

inline void check_int32_vector(const DeviceRules& rules, const paddle::Tensor& t, const char* name,
                               int64_t len) {
  PD_CHECK(t.dtype() == paddle::DataType::INT32, rules.op, ": ", name, " must be int32");
  PD_CHECK(t.shape().size() == 1 && t.shape()[0] == len, rules.op, ": ", name,
           " must have shape [", len, "]");
}

// Everything that does not need the values of the int32 inputs.
inline Geometry check_inputs(const DeviceRules& rules, const paddle::Tensor& qkv,
                             const paddle::Tensor& key_cache, const paddle::Tensor& value_cache,
                             const paddle::Tensor& seq_lens_encoder,
                             const paddle::Tensor& seq_lens_decoder,
                             const paddle::Tensor& seq_lens_this_time,
                             const paddle::Tensor& cu_seqlens_q,
                             const paddle::Tensor& block_tables,
                             const paddle::Tensor& rotary_cos, const paddle::Tensor& rotary_sin,
                             const paddle::Tensor& head_windows,
                             const paddle::Tensor& kv_head_slots,
                             const paddle::Tensor& key_cache_scales,
                             const paddle::Tensor& value_cache_scales, int num_heads,
                             int kv_num_heads, int head_dim, bool visit_all_pages) {
  const std::pair<const paddle::Tensor*, const char*> inputs[] = {
      {&qkv, "qkv"},
      {&key_cache, "key_cache"},
      {&value_cache, "value_cache"},
      {&seq_lens_encoder, "seq_lens_encoder"},
      {&seq_lens_decoder, "seq_lens_decoder"},
      {&seq_lens_this_time, "seq_lens_this_time"},
      {&cu_seqlens_q, "cu_seqlens_q"},
      {&block_tables, "block_tables"},
      {&rotary_cos, "rotary_cos"},
      {&rotary_sin, "rotary_sin"},
      {&head_windows, "head_windows"},
      {&kv_head_slots, "kv_head_slots"},
      {&key_cache_scales, "key_cache_scales"},
      {&value_cache_scales, "value_cache_scales"}};
  for (const auto& [t, name] : inputs) {
    PD_CHECK(t->initialized(), rules.op, ": ", name, " is not initialized");
    if (rules.check_place) {
      PD_CHECK(rules.gpu ? t->is_gpu() : t->is_cpu(), rules.op, ": every input must be a ",
               rules.device, " tensor, but ", name, " is on ", t->place().DebugString());
    }
    PD_CHECK(t->is_contiguous(), rules.op, ": ", name, " must be contiguous");
  }
  PD_CHECK(num_heads > 0 && kv_num_heads > 0 && num_heads % kv_num_heads == 0, rules.op,
           ": num_heads (", num_heads, ") must be a positive multiple of kv_num_heads (",
           kv_num_heads, ")");
  PD_CHECK(head_dim > 0 && head_dim % 2 == 0, rules.op,
           ": head_dim must be positive and even, got ", head_dim);

  const auto& qs = qkv.shape();
  PD_CHECK(dtype_allowed(qkv.dtype(), rules.qkv_fp32, rules.qkv_bf16, rules.qkv_fp16), rules.op,
           ": qkv must be ", dtype_list(rules.qkv_fp32, rules.qkv_bf16, rules.qkv_fp16));
  const int64_t width = int64_t(num_heads + 2 * kv_num_heads) * head_dim;
  PD_CHECK(qs.size() == 2 && qs[1] == width, rules.op,
           ": qkv must be [token_num, (num_heads + 2 * kv_num_heads) * head_dim] = [*, ", width,
           "], got rank ", qs.size(), qs.size() == 2 ? " width " : "",
           qs.size() == 2 ? std::to_string(qs[1]) : "");

  const auto& cs = key_cache.shape();
  const fd_kvq::Format key_quant = page_format(key_cache.dtype());
  const fd_kvq::Format value_quant = page_format(value_cache.dtype());
  // An int4 row is head_dim / 2 bytes, two codes each.
  const int64_t row_width = lane_row_width(key_quant, head_dim);
  PD_CHECK(cs.size() == 4 && cs[1] >= kv_num_heads && cs[3] == row_width && cs[2] > 0, rules.op,
           ": key_cache must be [num_blocks, slots >= kv_num_heads=", kv_num_heads, ", block_size, ",
           key_quant == fd_kvq::kInt4 ? "head_dim / 2=" : "head_dim=", row_width, "]");
  // The lanes are one page format: the same dtype and shape, or k8v4's int8 keys beside uint8 int4
  // values of half the row. Float lanes must share their dtype too (page_format says float for both).
  std::vector<int64_t> value_shape = cs;
  value_shape[3] = lane_row_width(value_quant, head_dim);
  const bool known_pair = value_cache.dtype() == key_cache.dtype() ||
                          fd_kvq::page_format_of(key_quant, value_quant) == fd_kvq::kK8V4;
  PD_CHECK(known_pair && value_cache.shape() == value_shape, rules.op,
           ": value_cache must match key_cache in shape and dtype, or hold the uint8 int4 values of k8v4 pages "
           "[num_blocks, slots, block_size, head_dim / 2] beside int8 keys [num_blocks, slots, block_size, "
           "head_dim]; got key_cache ", dtype_name(key_cache.dtype()), " ", shape_text(cs), " and value_cache ",
           dtype_name(value_cache.dtype()), " ", shape_text(value_cache.shape()));
  if (key_quant != fd_kvq::kFloat) {
    PD_CHECK(!rules.quantized_needs_bf16 || qkv.dtype() == paddle::DataType::BFLOAT16, rules.op,
             ": int8 / float8_e4m3fn caches and uint8 int4 caches (quantized pages) need bfloat16 qkv");
  } else if (rules.cache_matches_qkv) {
    PD_CHECK(key_cache.dtype() == qkv.dtype(), rules.op,
             ": caches must have qkv's dtype, or be int8 / float8_e4m3fn / uint8 int4 (quantized pages)");
  } else {
    PD_CHECK(dtype_allowed(key_cache.dtype(), rules.cache_fp32, rules.cache_bf16, rules.cache_fp16),
             rules.op, ": caches must be ",
             dtype_list(rules.cache_fp32, rules.cache_bf16, rules.cache_fp16),
             ", or int8 / float8_e4m3fn / uint8 int4 (quantized pages)");
  }
  check_scales(rules, key_quant, cs, key_cache_scales, "key_cache_scales");
  check_scales(rules, value_quant, cs, value_cache_scales, "value_cache_scales");

  const int64_t bsz = seq_lens_this_time.shape().size() == 1 ? seq_lens_this_time.shape()[0] : -1;
  PD_CHECK(bsz >= 0, rules.op, ": seq_lens_this_time must be 1-D [bsz]");
  check_int32_vector(rules, seq_lens_this_time, "seq_lens_this_time", bsz);
  check_int32_vector(rules, seq_lens_encoder, "seq_lens_encoder", bsz);
  check_int32_vector(rules, seq_lens_decoder, "seq_lens_decoder", bsz);
  check_int32_vector(rules, cu_seqlens_q, "cu_seqlens_q", bsz + 1);
  const auto& ws = head_windows.shape();
  PD_CHECK(head_windows.dtype() == paddle::DataType::INT32, rules.op, ": head_windows must be int32");
  PD_CHECK(ws.size() == 2 && ws[0] == 2 && ws[1] == kv_num_heads, rules.op,
           ": head_windows must be [2, kv_num_heads=", kv_num_heads,
           "] (row 0 the window of each KV head, 0 = full attention; row 1 its sink), got ", shape_text(ws),
           ws.size() == 1 ? " (the [kv_num_heads] form of 0 / 1 flags is no longer accepted: give every KV "
                            "head its window and sink)"
                          : "");
  check_int32_vector(rules, kv_head_slots, "kv_head_slots", kv_num_heads);

  const auto& ts = block_tables.shape();
  PD_CHECK(block_tables.dtype() == paddle::DataType::INT32, rules.op,
           ": block_tables must be int32");
  PD_CHECK((ts.size() == 2 && ts[0] == bsz) ||
               (ts.size() == 3 && ts[0] == bsz && ts[1] == cs[1]),
           rules.op,
           ": block_tables must be [bsz, max_blocks] (1-D) or [bsz, slots, max_blocks] "
           "(head-wise) with bsz=",
           bsz, ", slots=", cs[1], " (dim 1 of the caches), got rank ", ts.size());
  PD_CHECK(ts.back() > 0 || bsz == 0, rules.op, ": block_tables has no columns");

  for (const paddle::Tensor* t : {&rotary_cos, &rotary_sin}) {
    PD_CHECK(t->dtype() == paddle::DataType::FLOAT32 && t->shape().size() == 2 &&
                 t->shape()[1] == head_dim / 2,
             rules.op, ": rotary_cos/rotary_sin must be float32 [max_position, head_dim/2=",
             head_dim / 2, "]");
  }
  PD_CHECK(rotary_cos.shape() == rotary_sin.shape(), rules.op,
           ": rotary_cos and rotary_sin must have the same shape");

  Geometry g;
  g.num_heads = num_heads;
  g.kv_heads = kv_num_heads;
  g.slots = int(cs[1]);
  g.group = num_heads / kv_num_heads;
  g.head_dim = head_dim;
  g.block_size = int(cs[2]);
  g.num_blocks = cs[0];
  g.num_pages = cs[0] * cs[1];
  g.head_wise = ts.size() == 3;
  g.max_blocks = int(ts.back());
  g.visit_all = visit_all_pages;
  g.max_position = rotary_cos.shape()[0];
  g.token_num = qs[0];
  g.bsz = int(bsz);
  g.key_quant = key_quant;
  g.value_quant = value_quant;
  return g;
}

// The int32 inputs as a Batch of host pointers. Inputs on a device are copied to the host first
// (`keep` owns the copies): a few hundred bytes plus the table, one sync per call.
struct HostBatch {
  std::vector<paddle::Tensor> keep;
  std::vector<HeadWindow> heads;  // Batch::head
  Batch batch;
};

inline HostBatch host_batch(const Geometry& g, const paddle::Tensor& seq_lens_decoder,
                            const paddle::Tensor& seq_lens_this_time,
                            const paddle::Tensor& cu_seqlens_q, const paddle::Tensor& block_tables,
                            const paddle::Tensor& head_windows,
                            const paddle::Tensor& kv_head_slots) {
  HostBatch h;
  for (const paddle::Tensor* t : {&seq_lens_decoder, &seq_lens_this_time, &cu_seqlens_q,
                                  &block_tables, &head_windows, &kv_head_slots}) {
    h.keep.push_back(t->is_cpu() ? *t : t->copy_to(paddle::CPUPlace(), true));
  }
  h.batch.bsz = g.bsz;
  h.batch.seq_lens_decoder = h.keep[0].data<int32_t>();
  h.batch.seq_lens_this_time = h.keep[1].data<int32_t>();
  h.batch.cu_seqlens_q = h.keep[2].data<int32_t>();
  h.batch.table = h.keep[3].data<int32_t>();
  h.batch.windows = h.keep[4].data<int32_t>();
  h.batch.head_slot = h.keep[5].data<int32_t>();
  // One (window, sink) per head: row 0 and row 1 of head_windows (check_batch checks the values).
  h.heads.resize(g.kv_heads);
  for (int k = 0; k < g.kv_heads; ++k) {
    h.heads[k].window = h.batch.windows[k];
    h.heads[k].sink = h.batch.windows[g.kv_heads + k];
  }
  h.batch.head = h.heads.data();
  return h;
}

inline std::string where(int r, int h, int i) {
  return "request " + std::to_string(r) + ", kv head " + std::to_string(h) + ", block index " +
         std::to_string(i);
}

// Every page the step reads or writes must exist.
inline void check_pages(const DeviceRules& rules, const Geometry& g, const Batch& b) {
  for (int r = 0; r < b.bsz; ++r) {
    const int64_t c = b.seq_lens_this_time[r];
    if (c == 0) continue;
    const int64_t n = b.seq_lens_decoder[r];
    for (int h = 0; h < g.kv_heads; ++h) {
      const KeyRuns runs = visible_runs(g, b.head[h], n, n + c - 1);
      for (int k = 0; k < runs.n; ++k) {
        const int first = int(runs.lo[k] / g.block_size);
        const int last = int((runs.hi[k] - 1) / g.block_size);
        PD_CHECK(last < g.max_blocks, rules.op, ": request ", r, " needs block index ", last,
                 " (positions up to ", runs.hi[k] - 1, ") but block_tables has only ",
                 g.max_blocks, " columns");
        for (int i = first; i <= last; ++i) {
          const int64_t page = page_of(g, b, r, h, i);
          if (page < 0) {
            PD_THROW(rules.op, ": block table entry is ", page, " at ", where(r, h, i),
                     ", but the step needs it (positions [", int64_t(i) * g.block_size, ", ",
                     int64_t(i + 1) * g.block_size, "), seq_lens_decoder=", n,
                     ", seq_lens_this_time=", c,
                     g.visit_all ? "; visit_all_pages=True reads every page [0, t], so it needs "
                                   "a table without recycled entries)"
                                 : ")");
          }
          PD_CHECK(page < g.num_pages, rules.op, ": page id ", page, " at ", where(r, h, i),
                   " is out of range (the cache has ", g.num_pages,
                   g.head_wise ? " pages)" : " pages; 1-D block ",
                   g.head_wise ? "" : std::to_string(page / g.slots),
                   g.head_wise ? "" : " >= num_blocks)");
        }
      }
    }
  }
}

// Everything that needs the values of the int32 inputs (host pointers).
inline void check_batch(const DeviceRules& rules, const Geometry& g, const Batch& b) {
  PD_CHECK(b.bsz == 0 || b.cu_seqlens_q[0] == 0, rules.op, ": cu_seqlens_q[0] must be 0, got ",
           b.cu_seqlens_q[0]);
  for (int h = 0; h < g.kv_heads; ++h) {
    PD_CHECK(b.windows[h] >= 0, rules.op, ": head_windows[0][", h, "] (the window of KV head ", h,
             ") must be >= 0 (0 = full attention), got ", b.windows[h]);
    PD_CHECK(b.windows[g.kv_heads + h] >= 0, rules.op, ": head_windows[1][", h, "] (the sink of KV head ", h,
             ") must be >= 0, got ", b.windows[g.kv_heads + h]);
    PD_CHECK(b.head_slot[h] >= 0 && b.head_slot[h] < g.slots, rules.op, ": kv_head_slots[", h,
             "] = ", b.head_slot[h], " is not a slot of the cache (0..", g.slots - 1, ")");
    for (int other = 0; other < h; ++other) {
      PD_CHECK(b.head_slot[other] != b.head_slot[h], rules.op, ": kv_head_slots maps KV heads ",
               other, " and ", h, " to the same slot ", b.head_slot[h],
               " (they would overwrite each other's cache)");
    }
  }
  for (int r = 0; r < b.bsz; ++r) {
    const int64_t c = b.seq_lens_this_time[r];
    const int64_t n = b.seq_lens_decoder[r];
    PD_CHECK(c >= 0 && n >= 0, rules.op, ": request ", r, " has negative seq_lens_this_time (",
             c, ") or seq_lens_decoder (", n, ")");
    PD_CHECK(b.cu_seqlens_q[r + 1] - b.cu_seqlens_q[r] == c, rules.op,
             ": cu_seqlens_q is not the prefix sum of seq_lens_this_time at request ", r,
             " (cu[", r, "]=", b.cu_seqlens_q[r], ", cu[", r + 1, "]=", b.cu_seqlens_q[r + 1],
             ", this_time=", c, ")");
    PD_CHECK(c == 0 || n + c <= g.max_position, rules.op, ": request ", r,
             " reaches position ", n + c - 1, " but rotary_cos/rotary_sin have only ",
             g.max_position, " rows");
  }
  PD_CHECK(b.cu_seqlens_q[b.bsz] <= g.token_num, rules.op, ": cu_seqlens_q[bsz]=",
           b.cu_seqlens_q[b.bsz], " exceeds the ", g.token_num, " rows of qkv");
  check_pages(rules, g, b);
}

// Both checks of a step and the host batch they read, in the order every CPU entry runs them (the
// attention op, its validate-only twin, the whole decoder stack): the shapes, then the values.
struct CheckedStep {
  Geometry g;
  HostBatch host;
};

// What a step does to the scores besides the window (docs/op_contract.md): a learned sink logit per
// query head that joins each softmax's denominator (gpt-oss), and soft-capping, each scaled score
// becoming softcap * tanh(score / softcap) (Gemma 2). The op's `attention_sinks` is float32
// [num_heads], or empty ([0]) for none; `softcap` 0 is none.
struct ScoreMods {
  const float* sinks = nullptr;  // [num_heads] on the op's device, or nullptr
  float softcap = 0.f;
  float sink(int q_head) const {
    return sinks == nullptr ? -std::numeric_limits<float>::infinity() : sinks[q_head];
  }
};

inline ScoreMods check_score_mods(const DeviceRules& rules, const paddle::Tensor& attention_sinks, double softcap,
                                  int num_heads) {
  const bool none = attention_sinks.numel() == 0;  // an empty tensor holds no allocation, hence no place
  PD_CHECK(none || attention_sinks.initialized(), rules.op, ": attention_sinks is not initialized");
  if (rules.check_place && !none) {
    PD_CHECK(rules.gpu ? attention_sinks.is_gpu() : attention_sinks.is_cpu(), rules.op,
             ": every input must be a ", rules.device, " tensor, but attention_sinks is on ",
             attention_sinks.place().DebugString());
  }
  PD_CHECK(attention_sinks.dtype() == paddle::DataType::FLOAT32, rules.op, ": attention_sinks must be float32");
  const auto& s = attention_sinks.shape();
  PD_CHECK(s.size() == 1 && (s[0] == 0 || s[0] == num_heads), rules.op,
           ": attention_sinks must be [num_heads] = [", num_heads, "] (one logit per query head) or empty [0] "
           "(no sinks), got ", s.size() == 1 ? std::to_string(s[0]) : std::string("rank ") + std::to_string(s.size()));
  PD_CHECK(std::isfinite(softcap) && softcap >= 0.0, rules.op, ": softcap must be >= 0 (0 = no soft-capping), got ",
           softcap);
  ScoreMods mods;
  mods.sinks = none ? nullptr : attention_sinks.data<float>();
  mods.softcap = float(softcap);
  return mods;
}

inline CheckedStep check_step(const DeviceRules& rules, const paddle::Tensor& qkv, const paddle::Tensor& key_cache,
                              const paddle::Tensor& value_cache, const paddle::Tensor& seq_lens_encoder,
                              const paddle::Tensor& seq_lens_decoder, const paddle::Tensor& seq_lens_this_time,
                              const paddle::Tensor& cu_seqlens_q, const paddle::Tensor& block_tables,
                              const paddle::Tensor& rotary_cos, const paddle::Tensor& rotary_sin,
                              const paddle::Tensor& head_windows, const paddle::Tensor& kv_head_slots,
                              const paddle::Tensor& key_cache_scales, const paddle::Tensor& value_cache_scales,
                              int num_heads, int kv_num_heads, int head_dim, bool visit_all_pages) {
  CheckedStep step;
  step.g = check_inputs(rules, qkv, key_cache, value_cache, seq_lens_encoder, seq_lens_decoder, seq_lens_this_time,
                        cu_seqlens_q, block_tables, rotary_cos, rotary_sin, head_windows, kv_head_slots,
                        key_cache_scales, value_cache_scales, num_heads, kv_num_heads, head_dim, visit_all_pages);
  step.host = host_batch(step.g, seq_lens_decoder, seq_lens_this_time, cu_seqlens_q, block_tables, head_windows,
                         kv_head_slots);
  check_batch(rules, step.g, step.host.batch);
  return step;
}

}  // namespace fd_attn
