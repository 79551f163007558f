// The two products of the CPU attention op — scores q . k and the weighted
// value sum — in ONE fixed order of arithmetic per query, so a query gets the
// same bits whether it runs alone (a decode step), in a tile of a prefill
// chunk, next to any tile mates, or after a preemption recomputes it. This is
// the attention half of the engine's promise that a request's tokens never
// depend on its batch mates (the dense layers keep it in linear_packed.cc).
//
// Score order: lane l (0..15) sums q[i] * k[i] for i = l, l + 16, l + 32, ...
// by fused multiply-adds from +0; the 16 lanes then add as the fixed tree
// (l, l + 8), (l, l + 4), (l, l + 2), (l, l + 1), and the sum is multiplied by
// the softmax scale 1 / sqrt(head_dim) (its own rounding). Weighted values: every
// output element is one chain of fused multiply-adds over the keys in order.
// The portable kernels (attention_tiles_portable.h), the AVX-512 ones (attention_tiles_avx512.h) and the
// AVX2 ones (attention_tiles_avx2.h) follow the same order (FMA is correctly rounded, additions commute),
// so they agree too, and this header picks one for the process.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "attention_tiles_avx2.h"
#include "attention_tiles_avx512.h"
#include "attention_tiles_portable.h"
#include "cpu_isa.h"

namespace fd_cpu {

// The attention kernels' instruction set: the process's (cpu_isa.h; FD_CPU_LINEAR_ISA caps it), or the
// portable kernels alone with FD_CPU_ATTN_ISA=generic (cpu_options.h). Read once, at the first step.
inline Isa attention_isa() {
  static const Isa isa = cpu_options().attn_generic ? Isa::kScalar : kernels_isa();
  return isa;
}

inline bool attention_uses_avx512() { return attention_isa() == Isa::kAvx512; }

inline float max_score(const float* s, int n) {
  switch (attention_isa()) {
    case Isa::kAvx512: return max_of_avx512(s, n);
    case Isa::kAvx2: return max_of_avx2(s, n);
    default: return max_of(s, n);
  }
}

inline void soft_cap_scores(float* s, int n, float cap) {
  switch (attention_isa()) {
    case Isa::kAvx512: return soft_caps_avx512(s, n, cap);
    case Isa::kAvx2: return soft_caps_avx2(s, n, cap);
    default: return soft_caps(s, n, cap);
  }
}

inline float exp_and_sum(float* s, int n, float max) {
  switch (attention_isa()) {
    case Isa::kAvx512: return softmax_weights_avx512(s, n, max);
    case Isa::kAvx2: return softmax_weights_avx2(s, n, max);
    default: return softmax_weights(s, n, max);
  }
}

// Scaled scores of nq queries (pointers qs) against the same n keys, one row of out (stride ldo) each.
// Head sizes other than 64, 128 and 256 take the portable kernel (the same bits, slower).
inline void scores_rows(const float* const* qs, int nq, const float* k, int n, int d, float scale, float* out,
                        int ldo) {
  const Isa isa = attention_isa();
  if (isa == Isa::kAvx512 && (d == 64 || d == 128 || d == 256)) {
    if (d == 64) return scores_rows_fixed<4>(qs, nq, k, n, scale, out, ldo);
    if (d == 128) return scores_rows_fixed<8>(qs, nq, k, n, scale, out, ldo);
    return scores_rows_fixed<16>(qs, nq, k, n, scale, out, ldo);
  }
  if (isa == Isa::kAvx2 && (d == 64 || d == 128 || d == 256)) {
    if (d == 64) return scores_rows_fixed_avx2<4>(qs, nq, k, n, scale, out, ldo);
    if (d == 128) return scores_rows_fixed_avx2<8>(qs, nq, k, n, scale, out, ldo);
    return scores_rows_fixed_avx2<16>(qs, nq, k, n, scale, out, ldo);
  }
  for (int q = 0; q < nq; ++q) scores_generic(qs[q], k, n, d, scale, out + int64_t(q) * ldo);
}

inline void weighted_values(const float* w, const float* v, int n, int d, float* acc) {
  const Isa isa = attention_isa();
  if (isa == Isa::kAvx512) return weighted_values_avx512(w, v, n, d, acc);
  if (isa == Isa::kAvx2 && d % kAvx2Width == 0) return weighted_values_shared_avx2<1>(&w, &acc, v, n, d);
  weighted_values_generic(w, v, n, d, acc);
}

// How many queries weighted_values_many takes at once for head_dim d (1: no gain).
inline int shared_values_width(int d) {
  switch (attention_isa()) {
    case Isa::kAvx512: return d == 64 ? 4 : d == 128 ? 2 : 1;
    case Isa::kAvx2: return d % kAvx2Width == 0 ? kAvx2ValueQueries : 1;
    default: return 1;
  }
}

// weighted_values(ws[r], v, n, d, accs[r]) for r < nr (nr <= shared_values_width(d)): same bits.
inline void weighted_values_many(const float* const* ws, float* const* accs, int nr, const float* v, int n,
                                 int d) {
  const Isa isa = attention_isa();
  if (isa == Isa::kAvx512 && d == 64) {
    switch (nr) {
      case 4: return weighted_values_shared<4, 4>(ws, accs, v, n);
      case 3: return weighted_values_shared<4, 3>(ws, accs, v, n);
      case 2: return weighted_values_shared<4, 2>(ws, accs, v, n);
      default: break;
    }
  }
  if (isa == Isa::kAvx512 && d == 128 && nr == 2) return weighted_values_shared<8, 2>(ws, accs, v, n);
  if (isa == Isa::kAvx2 && d % kAvx2Width == 0) {
    if (nr == 3) return weighted_values_shared_avx2<3>(ws, accs, v, n, d);
    if (nr == 2) return weighted_values_shared_avx2<2>(ws, accs, v, n, d);
  }
  for (int r = 0; r < nr; ++r) weighted_values(ws[r], v, n, d, accs[r]);
}

}  // namespace fd_cpu
