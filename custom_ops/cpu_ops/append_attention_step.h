// The CPU AppendAttention step itself (validation, then the three passes described in
// append_attention.cc), as functions on Paddle tensors: the append_attention_cpu op calls it, and
// the whole decoder stack in one op (decoder_stack.cc) calls it for each layer, so both run the
// same code and give the same bits.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#include "append_attention_checks.h"
#include "attention_math.h"
#include "scratch.h"
#include "paddle/extension.h"
#include "work_pool.h"

namespace fd_cpu {
namespace {

using fd_attn::Batch;
using fd_attn::Geometry;
using fd_attn::KeyRuns;
using fd_attn::page_of;
using fd_attn::ScoreMods;
using fd_attn::visible_runs;

// Where the work of a step goes: a row of qkv and the request it belongs to.
struct TokenRef {
  int request;
  int64_t row;
  int64_t pos;  // absolute position of the token
};

// One layer's K and V pages as the step sees them: KeyT and ValueT are float, bf16_bits, int8_t,
// fd_kvq::e4m3 or Int4Pair (a row is row_elements<T>(head_dim) of them), the same type for every page
// format but k8v4 (int8_t keys, Int4Pair values). Quantized lanes also carry one float32 scale per
// (page, row), at the row's index in the page space (page * block_size + row), so a page's scales go
// wherever the page goes. Float lanes have no scales (nullptr).
template <typename KeyT, typename ValueT>
struct KvPages {
  KeyT* keys;
  ValueT* values;
  float* key_scales;
  float* value_scales;
  float* key_scale(int64_t row) const { return key_scales == nullptr ? nullptr : key_scales + row; }
  float* value_scale(int64_t row) const { return value_scales == nullptr ? nullptr : value_scales + row; }
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
// rotated k and raw v written into the cache row of the token's position (quantized pages: their
// codes, and the row's scale into the same (page, row) cell of the scale tensors; int8 and int4 pages
// store the key Hadamard-rotated and the queries are rotated to match, kv_quant.h).
template <typename QkvT, typename KeyT, typename ValueT>
void rope_and_write(const Geometry& g, const Batch& b,
                    const std::vector<TokenRef>& tokens, const QkvT* qkv,
                    const float* cos, const float* sin, const KvPages<KeyT, ValueT>& kv, float* q_rot) {
  const int d = g.head_dim;
  const int64_t key_width = row_elements<KeyT>(d);  // cache elements per row of each lane
  const int64_t value_width = row_elements<ValueT>(d);
  const int64_t stride = int64_t(g.num_heads + 2 * g.kv_heads) * d;
  // int8 / int4 key lanes hold H k; each query then becomes H q / d (kv_quant.h), so q . k is unchanged.
  const PageRotation rotation = page_rotation(g.key_quant, d);
  const bool rotate = rotation.keys;
  const bool rotate_values = rotation.values;  // a measurement knob, off by default
  const float unrotate = 1.f / float(d);  // a power of two: exact
  std::vector<float> k_rot(d), v_row(d);
  for (const TokenRef& tok : tokens) {
    const QkvT* x = qkv + tok.row * stride;
    const float* c = cos + tok.pos * (d / 2);
    const float* s = sin + tok.pos * (d / 2);
    for (int qh = 0; qh < g.num_heads; ++qh) {
      float* q = q_rot + (tok.row * g.num_heads + qh) * d;
      rope_to_float(x + int64_t(qh) * d, c, s, d, q);
      if (rotate) {
        rotate_row(q, d);
        for (int i = 0; i < d; ++i) q[i] *= unrotate;
      }
    }
    const int block = int(tok.pos / g.block_size);
    const int64_t slot = tok.pos % g.block_size;
    for (int h = 0; h < g.kv_heads; ++h) {
      const int64_t row = page_of(g, b, tok.request, h, block) * g.block_size + slot;
      rope_to_float(x + int64_t(g.num_heads + h) * d, c, s, d, k_rot.data());
      if (rotate) rotate_row(k_rot.data(), d);
      const QkvT* v = x + int64_t(g.num_heads + g.kv_heads + h) * d;
      for (int i = 0; i < d; ++i) v_row[i] = to_float(v[i]);
      if (rotate_values) rotate_row(v_row.data(), d);
      store_row(kv.keys + row * key_width, kv.key_scale(row), k_rot.data(), d);
      store_row(kv.values + row * value_width, kv.value_scale(row), v_row.data(), d);
    }
  }
}

// Threads for pass 3: FD_CPU_ATTN_NUM_THREADS (cpu_options.h) if set, else every usable CPU; small steps stay on one
// thread because waking a helper would cost more than it saves (1k key rows x q heads ~ 15
// microseconds of work; the helper is usually still polling from the layer's products). A decode
// step of one request at a few hundred tokens is past that: its three KV heads' pages (read from
// memory: the weights' stream has evicted them) go to both cores.
int pick_threads(int64_t key_rows, int64_t items) {
  constexpr int64_t kMinRowsToSplit = 1024;
  const int asked = cpu_options().attn_threads;
  const int want = asked > 0 ? asked : usable_cpus();
  if (key_rows < kMinRowsToSplit || items < 2) return 1;
  return int(std::max<int64_t>(1, std::min<int64_t>(want, items)));
}

// Pass 3 works on tiles: up to tile_tokens(g) consecutive query tokens of one
// request with one KV head, so every K/V page the tile reads is loaded once
// for all its query heads and tokens (a decode token is a tile of one). Each
// query keeps its own softmax state and takes its keys in the same pieces and
// order as it would alone (attention_tiles.h fixes the arithmetic), so tiling
// changes the speed, never the bits.
constexpr int kTileTokens = 16;
// Quantized pages are dequantized into the tile's scratch once per page visit, so a prefill's cost
// in dequantization is (its tiles) x (pages): bigger tiles for them (the bits do not change).
constexpr int kQuantizedTileTokens = 64;

inline int tile_tokens(const Geometry& g) {
  return g.key_quant == fd_kvq::kFloat ? kTileTokens : kQuantizedTileTokens;
}

struct QueryTile {
  int request;
  int64_t row;  // qkv row of the first token
  int64_t pos;  // position of the first token
  int tokens;
};

std::vector<QueryTile> list_tiles(const Batch& b, int tile) {
  std::vector<QueryTile> tiles;
  for (int r = 0; r < b.bsz; ++r) {
    for (int j = 0; j < b.seq_lens_this_time[r]; j += tile) {
      tiles.push_back({r, int64_t(b.cu_seqlens_q[r]) + j, int64_t(b.seq_lens_decoder[r]) + j,
                       std::min(tile, b.seq_lens_this_time[r] - j)});
    }
  }
  return tiles;
}

// The part of key run [lo, hi) on page [page_lo, page_lo + block_size).
inline bool on_page(int64_t lo, int64_t hi, int64_t page_lo, int block_size, int64_t* a, int64_t* b) {
  *a = std::max(lo, page_lo);
  *b = std::min(hi, page_lo + block_size);
  return *a < *b;
}

// A tile token's keys on one page, in at most two pieces (the sink run's part
// and the window run's part), in position order.
struct PagePieces {
  int n;
  int64_t lo[2], hi[2];
};

// One query of a tile that reads a page. Built field by field: a whole-struct
// copy of one just written (its query heads') stalled on store forwarding,
// ~4% of a prefill's attention.
struct PageReader {
  const PagePieces* pieces;  // its token's
  int token;                 // in the tile
  int query;                 // token * group + head of the group
  bool live[2];              // the piece has a visible key
};

// Items write disjoint output rows and each query's arithmetic is fixed, so
// results depend neither on the thread count nor on the tiling.
template <typename OutT, typename KeyT, typename ValueT>
void attend(const Geometry& g, const Batch& b, const std::vector<TokenRef>& tokens,
            const float* q_rot, const KvPages<KeyT, ValueT>& kv, const ScoreMods& mods, OutT* out) {
  const int d = g.head_dim;
  const int64_t key_width = row_elements<KeyT>(d);  // cache elements per row of each lane
  const int64_t value_width = row_elements<ValueT>(d);
  constexpr bool int4_values = std::is_same<ValueT, Int4Pair>::value;
  // FD_KV_QUANT_ROTATE_VALUES=1 (measurement only): the values were stored rotated; rotate back.
  const bool unrotate_values = page_rotation(g.key_quant, d).values;
  const int tile_max = tile_tokens(g);
  const std::vector<QueryTile> tiles = list_tiles(b, tile_max);
  const int64_t items = int64_t(tiles.size()) * g.kv_heads;
  int64_t key_rows = 0;
  for (const TokenRef& tok : tokens) {
    for (int h = 0; h < g.kv_heads; ++h) {
      const KeyRuns runs = visible_runs(g, b.head[h], tok.pos, tok.pos);
      for (int k = 0; k < runs.n; ++k) key_rows += runs.hi[k] - runs.lo[k];
    }
  }
  const float scale = 1.f / std::sqrt(float(d));
  const int threads = pick_threads(key_rows * g.group, items);
  const int max_queries = tile_max * g.group;

  // Per-worker scratch: the caller's, kept between calls (scratch.h; every tile resets what it reads).
  struct Scratch {
    std::vector<float> scores, ktile, vtile, max, denom, acc, out_row;
    std::vector<KeyRuns> runs;
    std::vector<PagePieces> pieces;
    std::vector<PageReader> readers;
    std::vector<const float*> q, w;
    std::vector<float*> accs;
  };
  thread_local std::vector<Scratch> kept;
  std::vector<Scratch>& scratch = kept;  // what the helpers capture: the caller's vector, not their own
  grown(scratch, size_t(threads));
  for (int t = 0; t < threads; ++t) {
    Scratch& sc = scratch[t];
    grown(sc.scores, size_t(max_queries) * g.block_size);
    grown(sc.ktile, size_t(g.block_size) * d);
    grown(sc.vtile, size_t(g.block_size) * d);
    grown(sc.max, size_t(max_queries));
    grown(sc.denom, size_t(max_queries));
    grown(sc.acc, size_t(max_queries) * d);
    grown(sc.out_row, size_t(d));
    grown(sc.runs, size_t(tile_max));
    grown(sc.pieces, size_t(tile_max));
    grown(sc.readers, size_t(max_queries));
    grown(sc.q, size_t(max_queries));
    grown(sc.w, size_t(kLanes));
    grown(sc.accs, size_t(kLanes));
  }

  WorkPool::instance().run(items, threads, [&](int64_t item, int worker) {
    Scratch& sc = scratch[worker];
    // Head-major: the two cores take neighbouring tiles of one KV head, whose K/V pages (1 MB for
    // 2k tokens at d = 64) then stay in each core's L2 instead of three heads' pages contending
    // (+1.7% prefill on a quiet machine, +10% while the neighbour core was busy; the same bits).
    const QueryTile& tile = tiles[item % int64_t(tiles.size())];
    const int h = int(item / int64_t(tiles.size()));
    const fd_attn::HeadWindow& head = b.head[h];  // this KV head's own window and sink
    const int queries = tile.tokens * g.group;  // query q = token t * group + head j of the group
    std::fill(sc.max.begin(), sc.max.begin() + queries, -std::numeric_limits<float>::infinity());
    std::fill(sc.denom.begin(), sc.denom.begin() + queries, 0.f);
    std::fill(sc.acc.begin(), sc.acc.begin() + int64_t(queries) * d, 0.f);
    const auto q_of = [&](int t, int j) {
      return q_rot + ((tile.row + t) * g.num_heads + int64_t(h) * g.group + j) * d;
    };
    int64_t first_key = std::numeric_limits<int64_t>::max(), last_key = 0;
    for (int t = 0; t < tile.tokens; ++t) {
      sc.runs[t] = visible_runs(g, head, tile.pos + t, tile.pos + t);
      first_key = std::min(first_key, sc.runs[t].lo[0]);
      last_key = std::max(last_key, sc.runs[t].hi[sc.runs[t].n - 1]);
    }
    RowMask mask;
    mask.active = head.slides() && g.visit_all;
    mask.window = head.window;
    mask.sink = head.sink;

    for (int i = int(first_key / g.block_size); int64_t(i) * g.block_size < last_key; ++i) {
      const int64_t page_lo = int64_t(i) * g.block_size;
      // Keys of this page that some query of the tile reads; pages no query
      // reads (recycled ones among them) are never touched.
      int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0, a, e;
      for (int t = 0; t < tile.tokens; ++t)
        for (int k = 0; k < sc.runs[t].n; ++k)
          if (on_page(sc.runs[t].lo[k], sc.runs[t].hi[k], page_lo, g.block_size, &a, &e))
            lo = std::min(lo, a), hi = std::max(hi, e);
      if (lo >= hi) continue;
      // Quantized pages are dequantized here, once per page visit, for all the tile's queries.
      const int64_t row0 = page_of(g, b, tile.request, h, i) * g.block_size + (lo - page_lo);
      const float* kf = rows_as_float(kv.keys + row0 * key_width, kv.key_scale(row0), sc.ktile.data(), hi - lo, d);
      // The queries that read this page and their pieces of it (sink part, window part).
      int readers = 0;
      for (int t = 0; t < tile.tokens; ++t) {
        PagePieces& pc = sc.pieces[t];
        pc.n = 0;
        for (int k = 0; k < sc.runs[t].n; ++k)
          if (on_page(sc.runs[t].lo[k], sc.runs[t].hi[k], page_lo, g.block_size, &a, &e))
            pc.lo[pc.n] = a, pc.hi[pc.n] = e, ++pc.n;
        if (pc.n == 0) continue;
        for (int j = 0; j < g.group; ++j) {
          PageReader& rd = sc.readers[readers];
          rd.pieces = &pc;
          rd.token = t;
          rd.query = t * g.group + j;
          rd.live[0] = rd.live[1] = false;
          sc.q[readers++] = q_of(t, j);
        }
      }
      // Values: into the scratch too, except int4 values for readers that fit one batch (a decode
      // token's query heads), which the weighted sum reads from the page itself (the same bits).
      const bool values_in_place = int4_values && reads_int4_values_in_place(d) && readers <= shared_values_width(d);
      const float* vf = values_in_place ? nullptr
                                        : rows_as_float(kv.values + row0 * value_width, kv.value_scale(row0),
                                                        sc.vtile.data(), hi - lo, d);
      // Scaled scores of every reader over [lo, hi) (keys a reader does not see are never folded).
      scores_rows(sc.q.data(), readers, kf, int(hi - lo), d, scale, sc.scores.data(), g.block_size);
      for (int piece = 0; piece < 2; ++piece) {
        for (int r = 0; r < readers; ++r) {
          PageReader& rd = sc.readers[r];
          const PagePieces& pc = *rd.pieces;
          if (piece >= pc.n) continue;
          const int qi = rd.query;
          mask.query_pos = tile.pos + rd.token;
          rd.live[piece] = softmax_step(sc.scores.data() + int64_t(r) * g.block_size + (pc.lo[piece] - lo),
                                        int(pc.hi[piece] - pc.lo[piece]), d, pc.lo[piece], mask, mods.softcap,
                                        sc.max[qi],
                                        sc.denom[qi], sc.acc.data() + int64_t(qi) * d);
        }
        // Weighted values: readers with the same keys (a token's query heads always; a prefill
        // tile's tokens on the pages below their diagonal) go `width` at a time, each value row
        // loaded once for all of them; each query still takes its keys in order.
        const int width = shared_values_width(d);
        for (int r = 0; r < readers;) {
          const PageReader& rd = sc.readers[r];
          if (piece >= rd.pieces->n || !rd.live[piece]) {
            ++r;
            continue;
          }
          const int64_t ka = rd.pieces->lo[piece], ke = rd.pieces->hi[piece];
          int batched = 0;
          for (; r < readers && batched < width; ++r) {
            const PageReader& other = sc.readers[r];
            if (piece >= other.pieces->n || !other.live[piece]) continue;
            if (other.pieces->lo[piece] != ka || other.pieces->hi[piece] != ke) break;
            sc.w[batched] = sc.scores.data() + int64_t(r) * g.block_size + (ka - lo);
            sc.accs[batched++] = sc.acc.data() + int64_t(other.query) * d;
          }
          if constexpr (int4_values) {
            if (values_in_place) {
              weighted_values_many(sc.w.data(), sc.accs.data(), batched, kv.values + (row0 + ka - lo) * value_width,
                                   kv.value_scale(row0) + (ka - lo), int(ke - ka));
              continue;
            }
          }
          weighted_values_many(sc.w.data(), sc.accs.data(), batched, vf + (ka - lo) * d, int(ke - ka), d);
        }
      }
    }
    for (int t = 0; t < tile.tokens; ++t) {
      OutT* o = out + ((tile.row + t) * g.num_heads + int64_t(h) * g.group) * d;
      for (int j = 0; j < g.group; ++j) {
        const int qi = t * g.group + j;
        const float inv = softmax_norm(sc.denom[qi], sc.max[qi], mods.sink(h * g.group + j));
        if (unrotate_values) {
          for (int i = 0; i < d; ++i) sc.out_row[i] = sc.acc[int64_t(qi) * d + i] * inv;
          rotate_row(sc.out_row.data(), d);
          for (int i = 0; i < d; ++i) store(o + j * d + i, sc.out_row[i] * (1.f / float(d)));
          continue;
        }
        for (int i = 0; i < d; ++i) store(o + j * d + i, sc.acc[int64_t(qi) * d + i] * inv);
      }
    }
  });
}

template <typename QkvT, typename KeyT, typename ValueT>
void run_step(const Geometry& g, const Batch& b, const paddle::Tensor& qkv,
              const paddle::Tensor& cos, const paddle::Tensor& sin,
              const paddle::Tensor& key_cache, const paddle::Tensor& value_cache,
              const paddle::Tensor& key_scales, const paddle::Tensor& value_scales,
              const ScoreMods& mods, paddle::Tensor* out) {
  const int64_t token_num = qkv.shape()[0];
  const std::vector<TokenRef> tokens = list_tokens(b);
  // Cache writes are the op's contract (in-place outputs), hence const_cast.
  const auto writable = [](const paddle::Tensor& t) { return const_cast<void*>(t.data()); };
  const auto scales_of = [&](fd_kvq::Format f, const paddle::Tensor& t) {
    return f != fd_kvq::kFloat ? reinterpret_cast<float*>(writable(t)) : nullptr;
  };
  const KvPages<KeyT, ValueT> kv{reinterpret_cast<KeyT*>(writable(key_cache)),
                                 reinterpret_cast<ValueT*>(writable(value_cache)),
                                 scales_of(g.key_quant, key_scales), scales_of(g.value_quant, value_scales)};
  const QkvT* x = reinterpret_cast<const QkvT*>(qkv.data());
  QkvT* o = reinterpret_cast<QkvT*>(out->data());

  std::vector<float> q_rot(size_t(token_num) * g.num_heads * g.head_dim);
  rope_and_write(g, b, tokens, x, cos.data<float>(), sin.data<float>(), kv, q_rot.data());
  attend(g, b, tokens, q_rot.data(), kv, mods, o);
  // Padding rows past cu_seqlens_q[bsz] carry no token; zero them so every
  // element of the output is defined.
  const int64_t used = b.cu_seqlens_q[b.bsz];
  std::fill(o + used * g.num_heads * g.head_dim,
            o + token_num * g.num_heads * g.head_dim, QkvT(0));
}

// The step with the lanes' element types, by the (key, value) dtype pair the checks accepted: both
// float32, bfloat16, int8, e4m3 or int4 (uint8), or int8 keys with int4 values (k8v4).
template <typename QkvT>
void run_step_for_cache(const Geometry& g, const Batch& b, const paddle::Tensor& qkv,
                        const paddle::Tensor& cos, const paddle::Tensor& sin,
                        const paddle::Tensor& key_cache, const paddle::Tensor& value_cache,
                        const paddle::Tensor& key_scales, const paddle::Tensor& value_scales,
                        const ScoreMods& mods, paddle::Tensor* out) {
  if (g.page_format() == fd_kvq::kK8V4) {
    return run_step<QkvT, int8_t, Int4Pair>(g, b, qkv, cos, sin, key_cache, value_cache, key_scales, value_scales,
                                            mods, out);
  }
  switch (key_cache.dtype()) {  // the value lane has the key lane's dtype
    case paddle::DataType::BFLOAT16:
      return run_step<QkvT, bf16_bits, bf16_bits>(g, b, qkv, cos, sin, key_cache, value_cache, key_scales,
                                                  value_scales, mods, out);
    case paddle::DataType::INT8:
      return run_step<QkvT, int8_t, int8_t>(g, b, qkv, cos, sin, key_cache, value_cache, key_scales, value_scales,
                                            mods, out);
    case paddle::DataType::FLOAT8_E4M3FN:
      return run_step<QkvT, fd_kvq::e4m3, fd_kvq::e4m3>(g, b, qkv, cos, sin, key_cache, value_cache, key_scales,
                                                        value_scales, mods, out);
    case paddle::DataType::UINT8:
      return run_step<QkvT, Int4Pair, Int4Pair>(g, b, qkv, cos, sin, key_cache, value_cache, key_scales,
                                                value_scales, mods, out);
    default:
      return run_step<QkvT, float, float>(g, b, qkv, cos, sin, key_cache, value_cache, key_scales, value_scales,
                                          mods, out);
  }
}

// One layer's step on CPU tensors: every check of the op (docs/op_contract.md), then the passes;
// returns [token_num, num_heads * head_dim] in qkv's dtype.
paddle::Tensor append_attention_step(
    const paddle::Tensor& qkv, const paddle::Tensor& key_cache, const paddle::Tensor& value_cache,
    const paddle::Tensor& seq_lens_encoder, const paddle::Tensor& seq_lens_decoder,
    const paddle::Tensor& seq_lens_this_time, const paddle::Tensor& cu_seqlens_q, const paddle::Tensor& block_tables,
    const paddle::Tensor& rotary_cos, const paddle::Tensor& rotary_sin, const paddle::Tensor& head_windows,
    const paddle::Tensor& kv_head_slots, const paddle::Tensor& key_cache_scales,
    const paddle::Tensor& value_cache_scales, int num_heads, int kv_num_heads, int head_dim, bool visit_all_pages,
    const ScoreMods& mods = ScoreMods()) {
  const fd_attn::CheckedStep step = fd_attn::check_step(
      fd_attn::cpu_rules(), qkv, key_cache, value_cache, seq_lens_encoder, seq_lens_decoder, seq_lens_this_time,
      cu_seqlens_q, block_tables, rotary_cos, rotary_sin, head_windows, kv_head_slots, key_cache_scales,
      value_cache_scales, num_heads, kv_num_heads, head_dim, visit_all_pages);
  const Geometry& g = step.g;
  const Batch& b = step.host.batch;

  const auto& qs = qkv.shape();
  paddle::Tensor out =
      paddle::empty({qs[0], int64_t(num_heads) * head_dim}, qkv.dtype(), qkv.place());
  if (qkv.dtype() == paddle::DataType::BFLOAT16) {
    run_step_for_cache<bf16_bits>(g, b, qkv, rotary_cos, rotary_sin, key_cache, value_cache, key_cache_scales,
                                  value_cache_scales, mods, &out);
  } else {
    run_step_for_cache<float>(g, b, qkv, rotary_cos, rotary_sin, key_cache, value_cache, key_cache_scales,
                              value_cache_scales, mods, &out);
  }
  return out;
}

}  // namespace
}  // namespace fd_cpu
