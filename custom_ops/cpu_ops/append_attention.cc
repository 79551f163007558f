// CPU AppendAttention: one layer's attention step for a mixed batch of
// prefill chunks and decodes over a paged KV cache, addressed through either a
// 1-D block table [bsz, max_blocks] or a head-wise page table
// [bsz, kv_heads, max_blocks] (page p = cache[p / H, p % H]).
//
// The step runs in three passes:
//   1. validate every shape and every table entry the step will touch, so a
//      scheduler bug (-1 where a page is needed) is a clear error raised
//      before anything is written, never a wild read;
//   2. rotate q/k (interleaved RoPE) and write the new K/V rows in place;
//   3. attention per (token, KV head): the query heads of the group share each
//      K/V row; a SWA head visits only the sink pages and the pages that
//      overlap its window, so its cost is O(window + sink), not O(sequence).
// The argument layout is pinned in the project's op contract.

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "attention_math.h"
#include "paddle/extension.h"
#include "work_pool.h"

namespace fd_cpu {
namespace {

struct Geometry {
  int num_heads = 0;
  int kv_heads = 0;
  int group = 0;  // q heads per KV head
  int head_dim = 0;
  int block_size = 0;
  int64_t num_pages = 0;  // num_blocks * kv_heads
  int max_blocks = 0;     // table columns
  bool head_wise = false;
  int64_t window = 0;
  int64_t sink = 0;
  bool visit_all = false;
  int64_t max_position = 0;  // rows of the rotary tables
};

struct Batch {
  int bsz = 0;
  const int32_t* seq_lens_decoder = nullptr;
  const int32_t* seq_lens_this_time = nullptr;
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* table = nullptr;
  const int32_t* swa = nullptr;
};

// Page id of block `i` of KV head `h` of request `r`; a 1-D block b is page
// b * H + h, so both table kinds share every line of the attention code (this
// is what makes the two paths bit-identical on the same pages).
inline int64_t page_of(const Geometry& g, const Batch& b, int r, int h, int i) {
  if (g.head_wise) {
    return b.table[(int64_t(r) * g.kv_heads + h) * g.max_blocks + i];
  }
  const int32_t block = b.table[int64_t(r) * g.max_blocks + i];
  return block < 0 ? int64_t(block) : int64_t(block) * g.kv_heads + h;
}

// Keys [lo, hi) a query reads, as at most two disjoint runs (sink, window).
struct KeyRuns {
  int n = 0;
  int64_t lo[2] = {0, 0};
  int64_t hi[2] = {0, 0};
};

// `last` is the last key position needed (the query position, or the end of
// the step when validating the whole step from its first query `first`).
inline KeyRuns visible_runs(const Geometry& g, bool swa, int64_t first,
                            int64_t last) {
  KeyRuns runs;
  const int64_t win_lo = std::max<int64_t>(0, first - g.window + 1);
  const int64_t sink_hi = std::min<int64_t>(g.sink, first + 1);
  if (!swa || g.visit_all || win_lo <= sink_hi) {
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

std::string where(int r, int h, int i) {
  return "request " + std::to_string(r) + ", kv head " + std::to_string(h) +
         ", block index " + std::to_string(i);
}

// Pass 1 for the tables: every page the step reads or writes must exist.
void check_pages(const Geometry& g, const Batch& b) {
  for (int r = 0; r < b.bsz; ++r) {
    const int64_t c = b.seq_lens_this_time[r];
    if (c == 0) continue;
    const int64_t n = b.seq_lens_decoder[r];
    for (int h = 0; h < g.kv_heads; ++h) {
      const KeyRuns runs = visible_runs(g, b.swa[h] != 0, n, n + c - 1);
      for (int k = 0; k < runs.n; ++k) {
        const int first = int(runs.lo[k] / g.block_size);
        const int last = int((runs.hi[k] - 1) / g.block_size);
        PD_CHECK(last < g.max_blocks, "append_attention: request ", r,
                 " needs block index ", last, " (positions up to ",
                 runs.hi[k] - 1, ") but block_tables has only ", g.max_blocks,
                 " columns");
        for (int i = first; i <= last; ++i) {
          const int64_t page = page_of(g, b, r, h, i);
          if (page < 0) {
            PD_THROW("append_attention: block table entry is ", page, " at ",
                     where(r, h, i), ", but the step needs it (positions [",
                     int64_t(i) * g.block_size, ", ",
                     int64_t(i + 1) * g.block_size, "), seq_lens_decoder=", n,
                     ", seq_lens_this_time=", c,
                     g.visit_all ? "; visit_all_pages=True reads every page "
                                   "[0, t], so it needs a table without "
                                   "recycled entries)"
                                 : ")");
          }
          PD_CHECK(page < g.num_pages, "append_attention: page id ", page,
                   " at ", where(r, h, i), " is out of range (the cache has ",
                   g.num_pages, g.head_wise ? " pages)" : " pages; 1-D block ",
                   g.head_wise ? "" : std::to_string(page / g.kv_heads),
                   g.head_wise ? "" : " >= num_blocks)");
        }
      }
    }
  }
}

void check_batch(const Geometry& g, const Batch& b, int64_t token_num) {
  PD_CHECK(b.cu_seqlens_q[0] == 0, "append_attention: cu_seqlens_q[0] must be 0, got ",
           b.cu_seqlens_q[0]);
  for (int r = 0; r < b.bsz; ++r) {
    const int64_t c = b.seq_lens_this_time[r];
    const int64_t n = b.seq_lens_decoder[r];
    PD_CHECK(c >= 0 && n >= 0, "append_attention: request ", r,
             " has negative seq_lens_this_time (", c, ") or seq_lens_decoder (",
             n, ")");
    PD_CHECK(b.cu_seqlens_q[r + 1] - b.cu_seqlens_q[r] == c,
             "append_attention: cu_seqlens_q is not the prefix sum of "
             "seq_lens_this_time at request ",
             r, " (cu[", r, "]=", b.cu_seqlens_q[r], ", cu[", r + 1,
             "]=", b.cu_seqlens_q[r + 1], ", this_time=", c, ")");
    PD_CHECK(c == 0 || n + c <= g.max_position, "append_attention: request ",
             r, " reaches position ", n + c - 1,
             " but rotary_cos/rotary_sin have only ", g.max_position, " rows");
  }
  PD_CHECK(b.cu_seqlens_q[b.bsz] <= token_num, "append_attention: cu_seqlens_q[bsz]=",
           b.cu_seqlens_q[b.bsz], " exceeds the ", token_num, " rows of qkv");
  check_pages(g, b);
}

// Where the work of a step goes: a row of qkv and the request it belongs to.
struct TokenRef {
  int request;
  int64_t row;
  int64_t pos;  // absolute position of the token
};

std::vector<TokenRef> list_tokens(const Batch& b) {
  std::vector<TokenRef> tokens;
  for (int r = 0; r < b.bsz; ++r) {
    for (int j = 0; j < b.seq_lens_this_time[r]; ++j) {
      tokens.push_back({r, int64_t(b.cu_seqlens_q[r]) + j,
                        int64_t(b.seq_lens_decoder[r]) + j});
    }
  }
  return tokens;
}

// Pass 2: q heads rotated into `q_rot` [token_num, num_heads, head_dim] fp32;
// rotated k and raw v written into the cache row of the token's position.
template <typename QkvT, typename CacheT>
void rope_and_write(const Geometry& g, const Batch& b,
                    const std::vector<TokenRef>& tokens, const QkvT* qkv,
                    const float* cos, const float* sin, CacheT* key_cache,
                    CacheT* value_cache, float* q_rot) {
  const int d = g.head_dim;
  const int64_t stride = int64_t(g.num_heads + 2 * g.kv_heads) * d;
  std::vector<float> k_rot(d);
  for (const TokenRef& tok : tokens) {
    const QkvT* x = qkv + tok.row * stride;
    const float* c = cos + tok.pos * (d / 2);
    const float* s = sin + tok.pos * (d / 2);
    for (int qh = 0; qh < g.num_heads; ++qh) {
      rope_to_float(x + int64_t(qh) * d, c, s, d,
                    q_rot + (tok.row * g.num_heads + qh) * d);
    }
    const int block = int(tok.pos / g.block_size);
    const int64_t slot = tok.pos % g.block_size;
    for (int h = 0; h < g.kv_heads; ++h) {
      const int64_t page = page_of(g, b, tok.request, h, block);
      const int64_t dst = (page * g.block_size + slot) * d;
      rope_to_float(x + int64_t(g.num_heads + h) * d, c, s, d, k_rot.data());
      const QkvT* v = x + int64_t(g.num_heads + g.kv_heads + h) * d;
      for (int i = 0; i < d; ++i) {
        store(key_cache + dst + i, k_rot[i]);
        store(value_cache + dst + i, to_float(v[i]));
      }
    }
  }
}

// Threads for pass 3: FD_CPU_ATTN_NUM_THREADS if set, else every usable CPU;
// small steps stay on one thread because waking a helper would cost more than
// it saves (8k key rows x q heads ~ 100 microseconds of work).
int pick_threads(int64_t key_rows, int64_t items) {
  constexpr int64_t kMinRowsToSplit = 8192;
  if (key_rows < kMinRowsToSplit || items < 2) return 1;
  int want = usable_cpus();
  if (const char* env = std::getenv("FD_CPU_ATTN_NUM_THREADS")) {
    const int v = std::atoi(env);
    if (v > 0) want = v;
  }
  return int(std::max<int64_t>(1, std::min<int64_t>(want, items)));
}

// Pass 3: one work item per (token, KV head); the group's q heads share every
// K/V row the item reads. Items write disjoint output rows and each has a fixed
// summation order, so results do not depend on the thread count.
template <typename OutT, typename CacheT>
void attend(const Geometry& g, const Batch& b,
            const std::vector<TokenRef>& tokens, const float* q_rot,
            const CacheT* key_cache, const CacheT* value_cache, OutT* out) {
  const int d = g.head_dim;
  const int64_t items = int64_t(tokens.size()) * g.kv_heads;
  int64_t key_rows = 0;
  for (const TokenRef& tok : tokens) {
    for (int h = 0; h < g.kv_heads; ++h) {
      const KeyRuns runs = visible_runs(g, b.swa[h] != 0, tok.pos, tok.pos);
      for (int k = 0; k < runs.n; ++k) key_rows += runs.hi[k] - runs.lo[k];
    }
  }
  const float scale = 1.f / std::sqrt(float(d));
  const int threads = pick_threads(key_rows * g.group, items);

  // Per-worker scratch, sized once per step.
  struct Scratch {
    std::vector<float> scores, ktile, vtile, max, denom, acc;
  };
  std::vector<Scratch> scratch(threads);
  for (Scratch& sc : scratch) {
    sc.scores.resize(size_t(g.group) * g.block_size);
    sc.ktile.resize(size_t(g.block_size) * d);
    sc.vtile.resize(size_t(g.block_size) * d);
    sc.max.resize(g.group);
    sc.denom.resize(g.group);
    sc.acc.resize(size_t(g.group) * d);
  }

  WorkPool::instance().run(items, threads, [&](int64_t item, int worker) {
    Scratch& sc = scratch[worker];
    const TokenRef& tok = tokens[item / g.kv_heads];
    const int h = int(item % g.kv_heads);
    const bool swa = b.swa[h] != 0;
    std::fill(sc.max.begin(), sc.max.end(), -std::numeric_limits<float>::infinity());
    std::fill(sc.denom.begin(), sc.denom.end(), 0.f);
    std::fill(sc.acc.begin(), sc.acc.end(), 0.f);
    const SoftmaxState st{sc.max.data(), sc.denom.data(), sc.acc.data()};
    RowMask mask;
    mask.active = swa && g.visit_all;
    mask.query_pos = tok.pos;
    mask.window = g.window;
    mask.sink = g.sink;
    const float* q = q_rot + (tok.row * g.num_heads + int64_t(h) * g.group) * d;

    const KeyRuns runs = visible_runs(g, swa, tok.pos, tok.pos);
    for (int k = 0; k < runs.n; ++k) {
      for (int64_t lo = runs.lo[k]; lo < runs.hi[k];) {
        const int i = int(lo / g.block_size);
        const int64_t page_start = int64_t(i) * g.block_size;
        const int64_t hi = std::min(runs.hi[k], page_start + g.block_size);
        const int64_t page = page_of(g, b, tok.request, h, i);
        const int64_t row0 = (page * g.block_size + (lo - page_start)) * d;
        attend_rows(q, g.group, d, scale, key_cache + row0, value_cache + row0,
                    int(hi - lo), lo, mask, sc.scores.data(), sc.ktile.data(),
                    sc.vtile.data(), st);
        lo = hi;
      }
    }
    OutT* o = out + (tok.row * g.num_heads + int64_t(h) * g.group) * d;
    for (int qg = 0; qg < g.group; ++qg) {
      const float inv = 1.f / sc.denom[qg];
      for (int i = 0; i < d; ++i) store(o + qg * d + i, sc.acc[qg * d + i] * inv);
    }
  });
}

template <typename QkvT, typename CacheT>
void run_step(const Geometry& g, const Batch& b, const paddle::Tensor& qkv,
              const paddle::Tensor& cos, const paddle::Tensor& sin,
              const paddle::Tensor& key_cache, const paddle::Tensor& value_cache,
              paddle::Tensor* out) {
  const int64_t token_num = qkv.shape()[0];
  const std::vector<TokenRef> tokens = list_tokens(b);
  // Cache writes are the op's contract (in-place outputs), hence const_cast.
  CacheT* kc = reinterpret_cast<CacheT*>(const_cast<void*>(key_cache.data()));
  CacheT* vc = reinterpret_cast<CacheT*>(const_cast<void*>(value_cache.data()));
  const QkvT* x = reinterpret_cast<const QkvT*>(qkv.data());
  QkvT* o = reinterpret_cast<QkvT*>(out->data());

  std::vector<float> q_rot(size_t(token_num) * g.num_heads * g.head_dim);
  rope_and_write(g, b, tokens, x, cos.data<float>(), sin.data<float>(), kc, vc,
                 q_rot.data());
  attend(g, b, tokens, q_rot.data(), kc, vc, o);
  // Padding rows past cu_seqlens_q[bsz] carry no token; zero them so every
  // element of the output is defined.
  const int64_t used = b.cu_seqlens_q[b.bsz];
  std::fill(o + used * g.num_heads * g.head_dim,
            o + token_num * g.num_heads * g.head_dim, QkvT(0));
}

bool is_float_or_bf16(paddle::DataType t) {
  return t == paddle::DataType::FLOAT32 || t == paddle::DataType::BFLOAT16;
}

void check_int32_vector(const paddle::Tensor& t, const char* name, int64_t len) {
  PD_CHECK(t.dtype() == paddle::DataType::INT32, "append_attention: ", name,
           " must be int32");
  PD_CHECK(t.shape().size() == 1 && t.shape()[0] == len, "append_attention: ",
           name, " must have shape [", len, "]");
}

}  // namespace
}  // namespace fd_cpu

std::vector<paddle::Tensor> AppendAttentionCpu(
    const paddle::Tensor& qkv, const paddle::Tensor& key_cache,
    const paddle::Tensor& value_cache, const paddle::Tensor& seq_lens_encoder,
    const paddle::Tensor& seq_lens_decoder,
    const paddle::Tensor& seq_lens_this_time,
    const paddle::Tensor& cu_seqlens_q, const paddle::Tensor& block_tables,
    const paddle::Tensor& rotary_cos, const paddle::Tensor& rotary_sin,
    const paddle::Tensor& swa_head_mask, int num_heads, int kv_num_heads,
    int head_dim, int sliding_window, int sink_size, bool visit_all_pages) {
  using fd_cpu::bf16_bits;
  for (const paddle::Tensor* t :
       {&qkv, &key_cache, &value_cache, &seq_lens_encoder, &seq_lens_decoder,
        &seq_lens_this_time, &cu_seqlens_q, &block_tables, &rotary_cos,
        &rotary_sin, &swa_head_mask}) {
    PD_CHECK(t->is_cpu() && t->is_contiguous(),
             "append_attention (CPU op): every input must be a contiguous CPU tensor");
  }
  PD_CHECK(num_heads > 0 && kv_num_heads > 0 && num_heads % kv_num_heads == 0,
           "append_attention: num_heads (", num_heads,
           ") must be a positive multiple of kv_num_heads (", kv_num_heads, ")");
  PD_CHECK(head_dim > 0 && head_dim % 2 == 0,
           "append_attention: head_dim must be positive and even, got ", head_dim);
  PD_CHECK(sliding_window >= 1, "append_attention: sliding_window must be >= 1, got ",
           sliding_window);
  PD_CHECK(sink_size >= 0, "append_attention: sink_size must be >= 0, got ", sink_size);

  const auto& qs = qkv.shape();
  PD_CHECK(fd_cpu::is_float_or_bf16(qkv.dtype()), "append_attention: qkv must be float32 or bfloat16");
  PD_CHECK(qs.size() == 2 && qs[1] == int64_t(num_heads + 2 * kv_num_heads) * head_dim,
           "append_attention: qkv must be [token_num, (num_heads + 2 * kv_num_heads) * "
           "head_dim] = [*, ", (num_heads + 2 * kv_num_heads) * head_dim, "]");

  const auto& cs = key_cache.shape();
  PD_CHECK(cs.size() == 4 && cs[1] == kv_num_heads && cs[3] == head_dim && cs[2] > 0,
           "append_attention: key_cache must be [num_blocks, kv_num_heads=", kv_num_heads,
           ", block_size, head_dim=", head_dim, "]");
  PD_CHECK(value_cache.shape() == cs && value_cache.dtype() == key_cache.dtype(),
           "append_attention: value_cache must match key_cache in shape and dtype");
  PD_CHECK(fd_cpu::is_float_or_bf16(key_cache.dtype()),
           "append_attention: caches must be float32 or bfloat16");

  const int64_t bsz = seq_lens_this_time.shape().empty() ? -1 : seq_lens_this_time.shape()[0];
  fd_cpu::check_int32_vector(seq_lens_this_time, "seq_lens_this_time", bsz);
  fd_cpu::check_int32_vector(seq_lens_encoder, "seq_lens_encoder", bsz);
  fd_cpu::check_int32_vector(seq_lens_decoder, "seq_lens_decoder", bsz);
  fd_cpu::check_int32_vector(cu_seqlens_q, "cu_seqlens_q", bsz + 1);
  fd_cpu::check_int32_vector(swa_head_mask, "swa_head_mask", kv_num_heads);

  const auto& ts = block_tables.shape();
  PD_CHECK(block_tables.dtype() == paddle::DataType::INT32,
           "append_attention: block_tables must be int32");
  PD_CHECK((ts.size() == 2 && ts[0] == bsz) ||
               (ts.size() == 3 && ts[0] == bsz && ts[1] == kv_num_heads),
           "append_attention: block_tables must be [bsz, max_blocks] (1-D) or "
           "[bsz, kv_num_heads, max_blocks] (head-wise) with bsz=", bsz,
           ", kv_num_heads=", kv_num_heads);

  for (const paddle::Tensor* t : {&rotary_cos, &rotary_sin}) {
    PD_CHECK(t->dtype() == paddle::DataType::FLOAT32 && t->shape().size() == 2 &&
                 t->shape()[1] == head_dim / 2,
             "append_attention: rotary_cos/rotary_sin must be float32 [max_position, "
             "head_dim/2=", head_dim / 2, "]");
  }
  PD_CHECK(rotary_cos.shape() == rotary_sin.shape(),
           "append_attention: rotary_cos and rotary_sin must have the same shape");

  fd_cpu::Geometry g;
  g.num_heads = num_heads;
  g.kv_heads = kv_num_heads;
  g.group = num_heads / kv_num_heads;
  g.head_dim = head_dim;
  g.block_size = int(cs[2]);
  g.num_pages = cs[0] * kv_num_heads;
  g.head_wise = ts.size() == 3;
  g.max_blocks = int(ts.back());
  g.window = sliding_window;
  g.sink = sink_size;
  g.visit_all = visit_all_pages;
  g.max_position = rotary_cos.shape()[0];

  fd_cpu::Batch b;
  b.bsz = int(bsz);
  b.seq_lens_decoder = seq_lens_decoder.data<int32_t>();
  b.seq_lens_this_time = seq_lens_this_time.data<int32_t>();
  b.cu_seqlens_q = cu_seqlens_q.data<int32_t>();
  b.table = block_tables.data<int32_t>();
  b.swa = swa_head_mask.data<int32_t>();

  fd_cpu::check_batch(g, b, qs[0]);

  paddle::Tensor out =
      paddle::empty({qs[0], int64_t(num_heads) * head_dim}, qkv.dtype(), qkv.place());
  const bool qkv_bf16 = qkv.dtype() == paddle::DataType::BFLOAT16;
  const bool cache_bf16 = key_cache.dtype() == paddle::DataType::BFLOAT16;
  if (!qkv_bf16 && !cache_bf16) {
    fd_cpu::run_step<float, float>(g, b, qkv, rotary_cos, rotary_sin, key_cache, value_cache, &out);
  } else if (!qkv_bf16 && cache_bf16) {
    fd_cpu::run_step<float, bf16_bits>(g, b, qkv, rotary_cos, rotary_sin, key_cache, value_cache, &out);
  } else if (qkv_bf16 && !cache_bf16) {
    fd_cpu::run_step<bf16_bits, float>(g, b, qkv, rotary_cos, rotary_sin, key_cache, value_cache, &out);
  } else {
    fd_cpu::run_step<bf16_bits, bf16_bits>(g, b, qkv, rotary_cos, rotary_sin, key_cache, value_cache, &out);
  }
  return {out};
}

std::vector<std::vector<int64_t>> AppendAttentionCpuInferShape(
    const std::vector<int64_t>& qkv_shape, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, int num_heads, int, int head_dim, int, int,
    bool) {
  return {{qkv_shape[0], int64_t(num_heads) * head_dim}};
}

std::vector<paddle::DataType> AppendAttentionCpuInferDtype(
    const paddle::DataType& qkv_dtype, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&) {
  return {qkv_dtype};
}

PD_BUILD_OP(append_attention_cpu)
    .Inputs({"qkv", "key_cache", "value_cache", "seq_lens_encoder",
             "seq_lens_decoder", "seq_lens_this_time", "cu_seqlens_q",
             "block_tables", "rotary_cos", "rotary_sin", "swa_head_mask"})
    .Outputs({"out", "key_cache_out", "value_cache_out"})
    .SetInplaceMap({{"key_cache", "key_cache_out"},
                    {"value_cache", "value_cache_out"}})
    .Attrs({"num_heads: int", "kv_num_heads: int", "head_dim: int",
            "sliding_window: int", "sink_size: int", "visit_all_pages: bool"})
    .SetKernelFn(PD_KERNEL(AppendAttentionCpu))
    .SetInferShapeFn(PD_INFER_SHAPE(AppendAttentionCpuInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(AppendAttentionCpuInferDtype));
