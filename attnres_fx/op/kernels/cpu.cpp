// CPU kernels of the AttnRes aggregation (attnres_fx/ops.py defines the operators and their maths).
//
// Every kernel works on rows: a source [..., D] is T = numel / D contiguous rows of D elements, and
// token t of every source is row t. One token at a time, its K rows are read from memory once, for the
// logits; the softmax is then exact over K scalars, and the weighted sum a second look at the same rows,
// now in cache (K * D elements: 147 KB for 9 fp32 sources of 4096), accumulated in registers and stored
// once. (An online softmax folding each row into an fp32 accumulator as it is read was measured too: its
// load-rescale-store of the accumulator per source made it 1.3-2x slower at prefill shapes, and no
// faster for one token.)
// Arithmetic is fp32 whatever the storage type (fp32, bf16, fp16), through at::vec::Vectorized<float>.
//
// The loops over rows live in functions of their own with __restrict pointers, called from the
// at::parallel_for lambdas: written inside the lambdas, the same loops ran 3.8x slower (the captured
// pointers may alias, so the compiler neither keeps them in registers nor vectorises freely).

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/SmallVector.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <mutex>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace attnres_cpu {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
// Tokens per parallel chunk: at least this many elements of work, so that waking a thread pays off
// (decoding shapes, a few tokens, run on the calling thread).
constexpr int64_t kMinChunkElements = 1 << 16;

// The storage types the kernels take; arithmetic is fp32 for all three.
#define ATTNRES_DISPATCH(TYPE, NAME, ...)                    \
  AT_DISPATCH_SWITCH(TYPE, NAME,                             \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// ------------------------------------------------------------------------------------- fp32 loads
template <typename T>
inline Vec load_fp32(const T* p) {
  Vec out;
  at::vec::load_to_float(p, out);  // kLanes elements, converted with vector instructions
  return out;
}
template <>
inline Vec load_fp32<float>(const float* p) {
  return Vec::loadu(p);
}
template <typename T>
inline void store_fp32(T* p, const Vec& v) {
  at::vec::convert_from_float<T>(v, v).store(p, kLanes);
}
template <>
inline void store_fp32<float>(float* p, const Vec& v) {
  v.store(p);
}

inline float sum_lanes(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// ------------------------------------------------------------------------------------- row helpers
// A pseudo-query as a row loop reads it: folded with the key norm's weight into fp32 memory (`Folded`), or
// the two weights themselves, folded as they are read (`Unfolded`: a call too short to pay for a pass that
// writes the folded query out). The same product either way: fp32(p) * fp32(g), rounded once.
struct Folded {
  const float* q;
  Vec vec(int64_t d) const { return Vec::loadu(q + d); }
  float at(int64_t d) const { return q[d]; }
};
template <typename W>
struct Unfolded {
  const W* proj;
  const W* norm;
  Vec vec(int64_t d) const { return load_fp32(proj + d) * load_fp32(norm + d); }
  float at(int64_t d) const { return static_cast<float>(proj[d]) * static_cast<float>(norm[d]); }
};

// q . v and v . v over one row.
template <typename T, typename Query>
inline void dot_and_square(const T* __restrict v, const Query& q, int64_t D, float& dot, float& square) {
  Vec dot0(0.f), dot1(0.f), sq0(0.f), sq1(0.f);
  int64_t d = 0;
  for (; d + 2 * kLanes <= D; d += 2 * kLanes) {
    Vec x0 = load_fp32(v + d), x1 = load_fp32(v + d + kLanes);
    dot0 = at::vec::fmadd(x0, q.vec(d), dot0);
    dot1 = at::vec::fmadd(x1, q.vec(d + kLanes), dot1);
    sq0 = at::vec::fmadd(x0, x0, sq0);
    sq1 = at::vec::fmadd(x1, x1, sq1);
  }
  for (; d + kLanes <= D; d += kLanes) {
    Vec x = load_fp32(v + d);
    dot0 = at::vec::fmadd(x, q.vec(d), dot0);
    sq0 = at::vec::fmadd(x, x, sq0);
  }
  dot = sum_lanes(dot0 + dot1);
  square = sum_lanes(sq0 + sq1);
  for (; d < D; ++d) {
    float x = static_cast<float>(v[d]);
    dot += x * q.at(d);
    square += x * x;
  }
}

// q . v over one row.
template <typename T>
inline float dot(const T* __restrict v, const float* __restrict q, int64_t D) {
  Vec dot0(0.f), dot1(0.f);
  int64_t d = 0;
  for (; d + 2 * kLanes <= D; d += 2 * kLanes) {
    dot0 = at::vec::fmadd(load_fp32(v + d), Vec::loadu(q + d), dot0);
    dot1 = at::vec::fmadd(load_fp32(v + d + kLanes), Vec::loadu(q + d + kLanes), dot1);
  }
  for (; d + kLanes <= D; d += kLanes) dot0 = at::vec::fmadd(load_fp32(v + d), Vec::loadu(q + d), dot0);
  float result = sum_lanes(dot0 + dot1);
  for (; d < D; ++d) result += static_cast<float>(v[d]) * q[d];
  return result;
}

// What a first look at a token's source rows sums: q . v and v . v (the logits), those and g . v (a
// backward that recomputes the logits), or g . v alone (a backward given the forward's logits).
enum Sums { kLogits, kLogitsAndAlong, kAlong };

// The vector registers of the build's instruction set: 32 with AVX-512, 16 with AVX2.
constexpr int kVectorRegisters = kLanes >= 16 ? 32 : 16;

// Accumulator chains per sum in group_dots: two where all of them and the vectors a step loads (q, g and
// a row) fit the registers, else one.
template <int G, Sums What>
constexpr int chains_per_sum() {
  constexpr int sums = What == kLogits ? 2 : What == kLogitsAndAlong ? 3 : 1;
  return 2 * G * sums + 3 <= kVectorRegisters ? 2 : 1;
}

// The sums of `What` over the rows of G sources at once: q (and g) loaded once per vector for all G rows,
// and two independent accumulator chains per sum where the registers hold them (chains_per_sum), over
// the row's even and odd vectors, added at the end (the order dot_and_square sums in, for a call of a few
// tokens). With one chain per sum the first look waited on the FMAs' latency: a forward at 3 to 9 sources
// took 10-20% longer (AVX-512, at [2, 128, 256] and [2, 128, 512] with the rows in cache, 2-10% with them
// in memory); with more chains than registers, AVX2 builds stored accumulators to the stack at every step.
// Source i's sums go to dot[i * stride] (and so on). Every loop over the G rows is unrolled by the
// compiler's early unroller (the pragmas), which lets it keep the accumulator arrays in registers: without
// them GCC 12 stored all eight accumulators to the stack at every step of the row loop, and those stores,
// not the loads, set the speed of the forward's first look.
template <typename T, int G, Sums What>
inline void group_dots(const T* const* __restrict rows, const float* __restrict q, const float* __restrict g,
                       int64_t D, int64_t stride, float* __restrict dot, float* __restrict square,
                       float* __restrict along) {
  constexpr bool kLogit = What != kAlong, kAlong_ = What != kLogits;
  constexpr int C = chains_per_sum<G, What>();
  Vec dots[C][G], squares[C][G], alongs[C][G];
  #pragma GCC unroll 4
  for (int i = 0; i < G; ++i) {
    #pragma GCC unroll 2
    for (int c = 0; c < C; ++c) {
      dots[c][i] = Vec(0.f);
      squares[c][i] = Vec(0.f);
      alongs[c][i] = Vec(0.f);
    }
  }
  int64_t d = 0;
  for (; d + C * kLanes <= D; d += C * kLanes) {
    #pragma GCC unroll 2
    for (int c = 0; c < C; ++c) {
      Vec qv(0.f), gv(0.f);
      if constexpr (kLogit) qv = Vec::loadu(q + d + c * kLanes);
      if constexpr (kAlong_) gv = Vec::loadu(g + d + c * kLanes);
      #pragma GCC unroll 4
      for (int i = 0; i < G; ++i) {
        const Vec x = load_fp32(rows[i] + d + c * kLanes);
        if constexpr (kLogit) {
          dots[c][i] = at::vec::fmadd(x, qv, dots[c][i]);
          squares[c][i] = at::vec::fmadd(x, x, squares[c][i]);
        }
        if constexpr (kAlong_) alongs[c][i] = at::vec::fmadd(x, gv, alongs[c][i]);
      }
    }
  }
  // With two chains, a row of an odd number of vectors leaves one: it goes to the first chain. The step is
  // written out again rather than shared with the loop above through a lambda: with the lambda GCC 12 kept
  // backward_rows' accumulators on the stack (172 vector stores there against 8, AVX-512 build).
  if constexpr (C == 2) {
    if (d + kLanes <= D) {
      Vec qv(0.f), gv(0.f);
      if constexpr (kLogit) qv = Vec::loadu(q + d);
      if constexpr (kAlong_) gv = Vec::loadu(g + d);
      #pragma GCC unroll 4
      for (int i = 0; i < G; ++i) {
        const Vec x = load_fp32(rows[i] + d);
        if constexpr (kLogit) {
          dots[0][i] = at::vec::fmadd(x, qv, dots[0][i]);
          squares[0][i] = at::vec::fmadd(x, x, squares[0][i]);
        }
        if constexpr (kAlong_) alongs[0][i] = at::vec::fmadd(x, gv, alongs[0][i]);
      }
      d += kLanes;
    }
  }
  float dot_[G], square_[G], along_[G];
  #pragma GCC unroll 4
  for (int i = 0; i < G; ++i) {
    if constexpr (C == 2) {
      dots[0][i] = dots[0][i] + dots[1][i];
      squares[0][i] = squares[0][i] + squares[1][i];
      alongs[0][i] = alongs[0][i] + alongs[1][i];
    }
    dot_[i] = kLogit ? sum_lanes(dots[0][i]) : 0.f;
    square_[i] = kLogit ? sum_lanes(squares[0][i]) : 0.f;
    along_[i] = kAlong_ ? sum_lanes(alongs[0][i]) : 0.f;
  }
  for (; d < D; ++d) {
    #pragma GCC unroll 4
    for (int i = 0; i < G; ++i) {
      const float x = static_cast<float>(rows[i][d]);
      if constexpr (kLogit) {
        dot_[i] += x * q[d];
        square_[i] += x * x;
      }
      if constexpr (kAlong_) along_[i] += x * g[d];
    }
  }
  #pragma GCC unroll 4
  for (int i = 0; i < G; ++i) {
    if constexpr (kLogit) {
      dot[i * stride] = dot_[i];
      square[i * stride] = square_[i];
    }
    if constexpr (kAlong_) along[i * stride] = along_[i];
  }
}

// group_dots over K rows, four at a time (the pointers of sums not taken may be null).
template <typename T, Sums What>
inline void row_dots(const T* const* __restrict rows, int64_t K, const float* __restrict q, const float* __restrict g,
                     int64_t D, int64_t stride, float* __restrict dot, float* __restrict square,
                     float* __restrict along) {
  const auto at = [&](float* p, int64_t k) { return p ? p + k * stride : nullptr; };
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) group_dots<T, 4, What>(rows + k, q, g, D, stride, at(dot, k), at(square, k), at(along, k));
  float* const d = at(dot, k);
  float* const s = at(square, k);
  float* const a = at(along, k);
  switch (K - k) {
    case 3: group_dots<T, 3, What>(rows + k, q, g, D, stride, d, s, a); break;
    case 2: group_dots<T, 2, What>(rows + k, q, g, D, stride, d, s, a); break;
    case 1: group_dots<T, 1, What>(rows + k, q, g, D, stride, d, s, a); break;
    default: break;
  }
}

// out = sum_k w[k] * rows[k] (cast to T), accumulated in registers: K loads per store. Four vectors of the
// row at a time: each accumulator is a chain of K dependent FMAs, and with two the loop waited on their
// latency (some 20 us of a 9-source forward at [2, 128, 256]) rather than on its loads.
template <typename T, typename Out>
inline void weighted_rows(const T* const* __restrict rows, const float* __restrict w, int64_t K, int64_t D,
                          Out* __restrict out, int64_t w_stride = 1) {
  int64_t d = 0;
  for (; d + 4 * kLanes <= D; d += 4 * kLanes) {
    const Vec w0(w[0]);
    const T* const first = rows[0] + d;
    Vec acc0 = load_fp32(first) * w0, acc1 = load_fp32(first + kLanes) * w0;
    Vec acc2 = load_fp32(first + 2 * kLanes) * w0, acc3 = load_fp32(first + 3 * kLanes) * w0;
    for (int64_t k = 1; k < K; ++k) {
      const Vec wk(w[k * w_stride]);
      const T* const row = rows[k] + d;
      acc0 = at::vec::fmadd(load_fp32(row), wk, acc0);
      acc1 = at::vec::fmadd(load_fp32(row + kLanes), wk, acc1);
      acc2 = at::vec::fmadd(load_fp32(row + 2 * kLanes), wk, acc2);
      acc3 = at::vec::fmadd(load_fp32(row + 3 * kLanes), wk, acc3);
    }
    store_fp32(out + d, acc0);
    store_fp32(out + d + kLanes, acc1);
    store_fp32(out + d + 2 * kLanes, acc2);
    store_fp32(out + d + 3 * kLanes, acc3);
  }
  for (; d + kLanes <= D; d += kLanes) {
    Vec acc = load_fp32(rows[0] + d) * Vec(w[0]);
    for (int64_t k = 1; k < K; ++k) acc = at::vec::fmadd(load_fp32(rows[k] + d), Vec(w[k * w_stride]), acc);
    store_fp32(out + d, acc);
  }
  for (; d < D; ++d) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) acc += w[k * w_stride] * static_cast<float>(rows[k][d]);
    out[d] = static_cast<Out>(acc);
  }
}

// exp(logit - max) below this is exactly zero: Note [negligible weights] in attnres_fx/aggregation.py
// (NEGLIGIBLE_WEIGHT there; the tests hold the two equal). Saturated softmax weights would otherwise be
// subnormal floats, and so would the gradients they scale, which CPUs compute on many times slower.
constexpr float kNegligibleWeight = 0x1p-32f;

inline float exp_or_zero(float gap) {
  const float e = std::exp(gap);
  return e < kNegligibleWeight ? 0.f : e;
}

inline float key_scale(float square, int64_t D, float eps) {
  return 1.f / std::sqrt(square / static_cast<float>(D) + eps);
}

inline Vec exp_or_zero(const Vec& gap) {
  const Vec e = gap.exp();
  return Vec::blendv(e, Vec(0.f), e < Vec(kNegligibleWeight));
}

inline Vec key_scale(const Vec& square, int64_t D, float eps) {
  return Vec(1.f) / (square / Vec(static_cast<float>(D)) + Vec(eps)).sqrt();
}

// w[k] = exp_or_zero(w[k] - max) over K logits in place: the softmax's numerators over one token's sources.
// Returns (max, their sum).
inline std::pair<float, float> exponentiate(float* __restrict w, int64_t K) {
  float top = -std::numeric_limits<float>::infinity(), total = 0.f;
  for (int64_t k = 0; k < K; ++k) top = std::max(top, w[k]);
  for (int64_t k = 0; k < K; ++k) total += w[k] = exp_or_zero(w[k] - top);
  return {top, total};
}

// The norm a site's only reader applies to its result, done on each result row as it is stored
// (aggregate_normed), in fp32 on the row read back as stored, as the norm module would read it: the RMS
// norm row * rsqrt(mean(row^2) + eps) * weight, or with `centred` the layer norm (row - mean) *
// rsqrt(var + eps) * weight (+ bias, where given). `weight` null: none.
template <typename T>
struct OutputNorm {
  const T* weight = nullptr;
  float eps = 0.f;
  const T* bias = nullptr;
  bool centred = false;
};

// 1 / sqrt(mean(row^2) + eps) over one row, in fp32.
template <typename T>
inline float inverse_rms(const T* __restrict row, int64_t D, float eps) {
  Vec sq0(0.f), sq1(0.f);
  int64_t d = 0;
  for (; d + 2 * kLanes <= D; d += 2 * kLanes) {
    const Vec x0 = load_fp32(row + d), x1 = load_fp32(row + d + kLanes);
    sq0 = at::vec::fmadd(x0, x0, sq0);
    sq1 = at::vec::fmadd(x1, x1, sq1);
  }
  for (; d + kLanes <= D; d += kLanes) {
    const Vec x = load_fp32(row + d);
    sq0 = at::vec::fmadd(x, x, sq0);
  }
  float square = sum_lanes(sq0 + sq1);
  for (; d < D; ++d) square += static_cast<float>(row[d]) * static_cast<float>(row[d]);
  return 1.f / std::sqrt(square / static_cast<float>(D) + eps);
}

// out = x * scale * weight over one row (out may be x).
template <typename T>
inline void scaled_row(const T* x, const T* __restrict weight, float scale, int64_t D, T* out) {
  const Vec scale_v(scale);
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) store_fp32(out + d, load_fp32(x + d) * scale_v * load_fp32(weight + d));
  for (; d < D; ++d) {
    out[d] = static_cast<T>(static_cast<float>(x[d]) * scale * static_cast<float>(weight[d]));
  }
}

// The mean of one row and 1 / sqrt(variance + eps), in fp32: the variance summed about the mean in a second
// pass (the row in L1), as exact as the layer norm's own.
template <typename T>
inline std::pair<float, float> mean_and_inverse_std(const T* __restrict row, int64_t D, float eps) {
  Vec sum0(0.f), sum1(0.f);
  int64_t d = 0;
  for (; d + 2 * kLanes <= D; d += 2 * kLanes) {
    sum0 = sum0 + load_fp32(row + d);
    sum1 = sum1 + load_fp32(row + d + kLanes);
  }
  for (; d + kLanes <= D; d += kLanes) sum0 = sum0 + load_fp32(row + d);
  float sum = sum_lanes(sum0 + sum1);
  for (; d < D; ++d) sum += static_cast<float>(row[d]);
  const float mean = sum / static_cast<float>(D);
  const Vec mean_v(mean);
  Vec sq0(0.f), sq1(0.f);
  d = 0;
  for (; d + 2 * kLanes <= D; d += 2 * kLanes) {
    const Vec x0 = load_fp32(row + d) - mean_v, x1 = load_fp32(row + d + kLanes) - mean_v;
    sq0 = at::vec::fmadd(x0, x0, sq0);
    sq1 = at::vec::fmadd(x1, x1, sq1);
  }
  for (; d + kLanes <= D; d += kLanes) {
    const Vec x = load_fp32(row + d) - mean_v;
    sq0 = at::vec::fmadd(x, x, sq0);
  }
  float square = sum_lanes(sq0 + sq1);
  for (; d < D; ++d) {
    const float x = static_cast<float>(row[d]) - mean;
    square += x * x;
  }
  return {mean, 1.f / std::sqrt(square / static_cast<float>(D) + eps)};
}

// row = (row - mean) * r * weight (+ bias) over one row (the layer norm's form of normalise_row).
template <typename T>
inline void centred_row(T* __restrict row, const OutputNorm<T>& norm, int64_t D) {
  const auto [mean, r] = mean_and_inverse_std(row, D, norm.eps);
  const Vec mean_v(mean), r_v(r);
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    Vec y = (load_fp32(row + d) - mean_v) * r_v * load_fp32(norm.weight + d);
    if (norm.bias != nullptr) y = y + load_fp32(norm.bias + d);
    store_fp32(row + d, y);
  }
  for (; d < D; ++d) {
    float y = (static_cast<float>(row[d]) - mean) * r * static_cast<float>(norm.weight[d]);
    if (norm.bias != nullptr) y += static_cast<float>(norm.bias[d]);
    row[d] = static_cast<T>(y);
  }
}

template <typename T>
inline void normalise_row(T* __restrict row, const OutputNorm<T>& norm, int64_t D) {
  if (norm.centred) {
    centred_row(row, norm, D);
  } else {
    scaled_row(row, norm.weight, inverse_rms(row, D, norm.eps), D, row);
  }
}

// Tokens per tile of the aggregation's row loops: their per-token softmax runs on vectors across the
// tile's tokens (a chain of scalar divisions, square roots and exponentials per token and source
// otherwise: some 40 ns a token whatever the width). At most kTile tokens, and few enough that the
// tile's source rows stay in L2 between the two looks at them (kTileBytes).
constexpr int64_t kTile = 16;
constexpr int64_t kTileBytes = 1 << 18;
// Calls of at most this many tokens, sources and row width take aggregate_few_tokens.
constexpr int64_t kFewTokens = 8;
constexpr int64_t kFewTokensSources = 16;
constexpr int64_t kFewTokensWidth = 1024;

inline int64_t tile_tokens(int64_t K, int64_t D, int64_t element_size) {
  return std::clamp<int64_t>(kTileBytes / std::max<int64_t>(1, K * D * element_size), 1, kTile);
}

// ------------------------------------------------------------------------------------- row loops
// The logits' parts a backward needs, q . v and the key scale, kept by a forward that records a gradient:
// saved [2][K][T] (the whole of each) from a tile's stats [K][kTile] (tokens first .. first + n). With
// them the backward's first look at a source row sums g . v alone (Note [backward]).
inline void save_logits(float* __restrict saved, const float* __restrict tile, int64_t K, int64_t T, int64_t first,
                        int64_t n) {
  for (int64_t k = 0; k < K; ++k) std::copy(tile + k * kTile, tile + k * kTile + n, saved + k * T + first);
}

// Per tile of tokens: the first look at each token's K rows (from memory) gives the logits; the softmax
// over sources runs on vectors across the tile's tokens; the second look (from cache) gives the weighted
// sum, accumulated in registers and stored once per token. stats: 2 * K * kTile floats.
template <typename T>
void aggregate_rows(const T* const* __restrict sources, int64_t K, const float* __restrict q, int64_t D, float eps,
                    float scale, T* __restrict out, const T** __restrict rows, float* __restrict stats,
                    int64_t begin, int64_t end, float* __restrict saved = nullptr, int64_t T_total = 0,
                    const OutputNorm<T>& out_norm = {}) {
  float* logits = stats;              // [K][kTile]: q . v, then the weights
  float* squares = stats + K * kTile;  // [K][kTile]
  const int64_t tile = tile_tokens(K, D, sizeof(T));
  for (int64_t first = begin; first < end; first += tile) {
    const int64_t n = std::min(tile, end - first);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t k = 0; k < K; ++k) rows[i * K + k] = sources[k] + (first + i) * D;
      row_dots<T, kLogits>(rows + i * K, K, q, nullptr, D, kTile, logits + i, squares + i, nullptr);
    }
    if (saved) save_logits(saved, logits, K, T_total, first, n);
    for (int64_t i = 0; i < n; i += kLanes) {
      Vec top(-std::numeric_limits<float>::infinity());
      for (int64_t k = 0; k < K; ++k) {
        const Vec r = key_scale(Vec::loadu(squares + k * kTile + i), D, eps);
        r.store(squares + k * kTile + i);
        const Vec logit = Vec::loadu(logits + k * kTile + i) * r;
        logit.store(logits + k * kTile + i);
        top = at::vec::maximum(top, logit);
      }
      Vec total(0.f);
      for (int64_t k = 0; k < K; ++k) {
        const Vec e = exp_or_zero(Vec::loadu(logits + k * kTile + i) - top);
        e.store(logits + k * kTile + i);
        total = total + e;
      }
      const Vec inverse = Vec(scale) / total;
      for (int64_t k = 0; k < K; ++k) (Vec::loadu(logits + k * kTile + i) * inverse).store(logits + k * kTile + i);
    }
    if (saved) save_logits(saved + K * T_total, squares, K, T_total, first, n);
    for (int64_t i = 0; i < n; ++i) {
      weighted_rows(rows + i * K, logits + i, K, D, out + (first + i) * D, kTile);
      if (out_norm.weight) normalise_row(out + (first + i) * D, out_norm, D);
    }
  }
}

// The forward for a few tokens (a decoding step's call), one token at a time: its K rows' logits with the
// pseudo-query folded as it is read, the softmax over K scalars, the weighted sum. aggregate_rows' tiles,
// vectorised softmax and folded query in memory pay off over many tokens; for a few, their code and
// scratch are what the call costs, out of cache at every block of a decoding step.
template <typename T>
void aggregate_few_tokens(const T* const* __restrict sources, int64_t K, const T* __restrict proj,
                          const T* __restrict norm, int64_t D, float eps, float scale, T* __restrict out,
                          int64_t tokens, const OutputNorm<T>& out_norm = {}) {
  const T* rows[kFewTokensSources];
  float weights[kFewTokensSources];
  const Unfolded<T> query{proj, norm};
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      rows[k] = sources[k] + t * D;
      float dot, square;
      dot_and_square(rows[k], query, D, dot, square);
      weights[k] = dot * key_scale(square, D, eps);
    }
    const float inverse = scale / exponentiate(weights, K).second;
    for (int64_t k = 0; k < K; ++k) weights[k] *= inverse;
    weighted_rows(rows, weights, K, D, out + t * D);
    if (out_norm.weight) normalise_row(out + t * D, out_norm, D);
  }
}

// The second look of the backward at P consecutive tokens, for G of their sources: dL/dv_k = w_k g + gd_k q
// + c_k v_k written to outs[p * G + k], and sum_k gd_k v_k added to dq. The per-source scalars (token p's
// at p, source k's at stride kTile) are copied into registers first: read through the stats pointer
// inside the loop, they were reloaded after every store (the compiler cannot rule out that a gradient
// row aliases them), which made this loop, not memory, the backward's bottleneck. Groups of at most
// four rows keep the row pointers in registers too. Two tokens at once (where a token has one or two
// sources) load and store dq once for both: at 2 sources dq was a third of the loop's stores. With `Add`,
// the row adds[p * G + k] (a gradient summed so far, possibly outs[p * G + k] itself) is added to each
// dL/dv_k as it is stored: the sum autograd would otherwise make in a pass of its own (Note [gradient
// deposits]), in the same order (what came before, plus this dL/dv_k).
template <typename T, int G, int P = 1, bool Add = false>
inline void source_grads(const T* const* __restrict rows, int64_t row_stride, T* const* __restrict outs,
                         const T* const* adds, const float* __restrict q, const float* const* __restrict g,
                         const float* __restrict weight, const float* __restrict grad_dot,
                         const float* __restrict coefficient, int64_t D, float* __restrict dq) {
  const T* r[P][G];
  T* o[P][G];
  const T* a[P][G];
  const float* gp[P];
  Vec w[P][G], gd[P][G], c[P][G];
  float ws[P][G], gds[P][G], cs[P][G];
  for (int p = 0; p < P; ++p) {
    gp[p] = g[p];
    for (int k = 0; k < G; ++k) {
      r[p][k] = rows[p * row_stride + k];
      o[p][k] = outs[p * G + k];
      a[p][k] = Add ? adds[p * G + k] : nullptr;
      ws[p][k] = weight[k * kTile + p];
      gds[p][k] = grad_dot[k * kTile + p];
      cs[p][k] = coefficient[k * kTile + p];
      w[p][k] = Vec(ws[p][k]);
      gd[p][k] = Vec(gds[p][k]);
      c[p][k] = Vec(cs[p][k]);
    }
  }
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    const Vec qv = Vec::loadu(q + d);
    Vec dqv = Vec::loadu(dq + d);
    for (int p = 0; p < P; ++p) {
      const Vec gv = Vec::loadu(gp[p] + d);
      for (int k = 0; k < G; ++k) {
        const Vec x = load_fp32(r[p][k] + d);
        const Vec grad = at::vec::fmadd(x, c[p][k], at::vec::fmadd(qv, gd[p][k], gv * w[p][k]));
        if constexpr (Add) {
          store_fp32(o[p][k] + d, load_fp32(a[p][k] + d) + grad);
        } else {
          store_fp32(o[p][k] + d, grad);
        }
        dqv = at::vec::fmadd(x, gd[p][k], dqv);
      }
    }
    dqv.store(dq + d);
  }
  for (; d < D; ++d) {
    for (int p = 0; p < P; ++p) {
      for (int k = 0; k < G; ++k) {
        const float x = static_cast<float>(r[p][k][d]);
        const float grad = ws[p][k] * gp[p][d] + gds[p][k] * q[d] + cs[p][k] * x;
        o[p][k][d] = static_cast<T>(Add ? static_cast<float>(a[p][k][d]) + grad : grad);
        dq[d] += gds[p][k] * x;
      }
    }
  }
}

// The backward of the RMS norm a site's only reader applies (attnres_fx/passes/fuse_norms.py), for rows
// begin .. end of x (out = x * r * weight, r = 1 / sqrt(mean(x^2) + eps) per row, given): one pass per row,
// u = g * weight, dx = r * u - x * r^3 * (u . x) / D, and dweight += g * x * r. The module's own ops make
// some six passes forward and ten backward (180-250 us at [2, 128, 128-256], one thread). fp32.
void rms_norm_backward_rows(const float* __restrict grad, const float* __restrict x, const float* __restrict weight,
                            const float* __restrict inverse, int64_t D, float* __restrict dx, float* __restrict dweight,
                            int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const float* g = grad + t * D;
    const float* v = x + t * D;
    Vec along0(0.f), along1(0.f);
    int64_t d = 0;
    for (; d + 2 * kLanes <= D; d += 2 * kLanes) {
      along0 = at::vec::fmadd(Vec::loadu(g + d) * Vec::loadu(weight + d), Vec::loadu(v + d), along0);
      along1 = at::vec::fmadd(Vec::loadu(g + d + kLanes) * Vec::loadu(weight + d + kLanes), Vec::loadu(v + d + kLanes),
                              along1);
    }
    for (; d + kLanes <= D; d += kLanes) {
      along0 = at::vec::fmadd(Vec::loadu(g + d) * Vec::loadu(weight + d), Vec::loadu(v + d), along0);
    }
    float along = sum_lanes(along0 + along1);
    for (; d < D; ++d) along += g[d] * weight[d] * v[d];
    const float r = inverse[t];
    const float c = r * r * r * along / static_cast<float>(D);
    const Vec r_v(r), c_v(c);
    d = 0;
    for (; d + kLanes <= D; d += kLanes) {
      const Vec gv = Vec::loadu(g + d), xv = Vec::loadu(v + d);
      (r_v * gv * Vec::loadu(weight + d) - xv * c_v).store(dx + t * D + d);
      at::vec::fmadd(gv * xv, r_v, Vec::loadu(dweight + d)).store(dweight + d);
    }
    for (; d < D; ++d) {
      dx[t * D + d] = r * g[d] * weight[d] - v[d] * c;
      dweight[d] += g[d] * v[d] * r;
    }
  }
}

// The backward of the layer norm (OutputNorm's `centred`) for one row h, out = xhat * weight (+ bias) with
// xhat = (h - mean) * r: u = g * weight, dh = r * (u - mean(u) - xhat * mean(u * xhat)); dweight += g * xhat
// and, where given, dbias += g. Two passes over the row (in cache) after mean_and_inverse_std's two. fp32.
void layer_norm_backward_row(const float* __restrict grad, const float* __restrict h, const float* __restrict weight,
                             float eps, int64_t D, float* __restrict dh, float* __restrict dweight,
                             float* __restrict dbias) {
  const auto [mean, r] = mean_and_inverse_std(h, D, eps);
  const Vec mean_v(mean), r_v(r);
  Vec u_sum(0.f), ux_sum(0.f);
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    const Vec u = Vec::loadu(grad + d) * Vec::loadu(weight + d);
    u_sum = u_sum + u;
    ux_sum = at::vec::fmadd(u, (Vec::loadu(h + d) - mean_v) * r_v, ux_sum);
  }
  float u_total = sum_lanes(u_sum), ux_total = sum_lanes(ux_sum);
  for (; d < D; ++d) {
    const float u = grad[d] * weight[d];
    u_total += u;
    ux_total += u * ((h[d] - mean) * r);
  }
  const float u_mean = u_total / static_cast<float>(D), ux_mean = ux_total / static_cast<float>(D);
  const Vec u_mean_v(u_mean), ux_mean_v(ux_mean);
  d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    const Vec g = Vec::loadu(grad + d), xhat = (Vec::loadu(h + d) - mean_v) * r_v;
    (r_v * (g * Vec::loadu(weight + d) - u_mean_v - xhat * ux_mean_v)).store(dh + d);
    at::vec::fmadd(g, xhat, Vec::loadu(dweight + d)).store(dweight + d);
    if (dbias != nullptr) (Vec::loadu(dbias + d) + g).store(dbias + d);
  }
  for (; d < D; ++d) {
    const float xhat = (h[d] - mean) * r;
    dh[d] = r * (grad[d] * weight[d] - u_mean - xhat * ux_mean);
    dweight[d] += grad[d] * xhat;
    if (dbias != nullptr) dbias[d] += grad[d];
  }
}

// Note [backward] of attnres_fx/aggregation.py, per tile of tokens: the first look at each token's K
// source rows gives their logits and g . v; the softmax and the per-source coefficients run on vectors
// across the tile's tokens; the second look (from cache) writes every dL/dv and adds the token's dL/dq,
// one vector of the row at a time for all K sources (q, g and dq loaded once, dq stored once, per
// vector). stats: 6 * K * kTile floats; g_rows: kTile * D floats (the gradient rows of a tile in fp32,
// for bf16 / fp16). `adds`, where given: per source the gradient its dL/dv is added to (source_grads'
// `Add`), or null for none, whose rows read `zero_row` (D zeros) instead.
// With `out_norm` (its weight given; fp32, with `saved`): `grad` is the gradient of the normed result
// (aggregate_normed), whose rows before the norm are not kept: per token, the softmax from the saved
// logits first, then the row recomputed from its sources (read there anyway) into `h_row`, the norm's
// backward giving dL/dh into g_rows (and the norm weight's gradient added to `out_dweight`, a layer norm's
// bias's to `out_dbias` where given), then g . v.
template <typename T>
void backward_rows(const T* __restrict grad, const T* const* __restrict sources, T* const* __restrict grads,
                   int64_t K, const float* __restrict q, int64_t D, float eps, float scale, float* __restrict g_rows,
                   const T** __restrict rows, float* __restrict stats, float* __restrict dq, int64_t begin,
                   int64_t end, const float* __restrict saved = nullptr, int64_t T_total = 0,
                   const T* const* adds = nullptr, const T* zero_row = nullptr, const OutputNorm<float>& out_norm = {},
                   float* __restrict out_dweight = nullptr, float* __restrict h_row = nullptr,
                   float* __restrict out_dbias = nullptr) {
  constexpr bool kFloat = std::is_same_v<T, float>;
  const bool normed = kFloat && out_norm.weight != nullptr;
  const auto add_row = [&](int64_t k, int64_t token) {
    return adds[k] != nullptr ? adds[k] + token * D : zero_row;
  };
  float* dot = stats;                        // [K][kTile] each
  float* scales = stats + K * kTile;         // v . v, then the key scale
  float* along = stats + 2 * K * kTile;      // g . v
  float* weight = stats + 3 * K * kTile;     // s p_k
  float* grad_dot = stats + 4 * K * kTile;   // dL/d(q . v_k)
  float* coefficient = stats + 5 * K * kTile;  // of v_k in dL/dv_k, through its key scale
  const Vec inverse_dim(1.f / static_cast<float>(D));
  const int64_t tile = tile_tokens(K + 1, D, sizeof(T));
  for (int64_t first = begin; first < end; first += tile) {
    const int64_t n = std::min(tile, end - first);
    const auto copy_saved = [&] {
      for (int64_t k = 0; k < K; ++k) {
        std::copy(saved + k * T_total + first, saved + k * T_total + first + n, dot + k * kTile);
        std::copy(saved + (K + k) * T_total + first, saved + (K + k) * T_total + first + n, scales + k * kTile);
      }
    };
    const auto at = [&](float* p, int64_t k, int64_t i) { return p + k * kTile + i; };
    // The softmax over sources for kLanes tokens from i: weight = p_k (the key scale kept in `scales`).
    const auto softmax_at = [&](int64_t i) {
      Vec top(-std::numeric_limits<float>::infinity());
      for (int64_t k = 0; k < K; ++k) {
        const Vec r = saved ? Vec::loadu(at(scales, k, i)) : key_scale(Vec::loadu(at(scales, k, i)), D, eps);
        r.store(at(scales, k, i));
        const Vec logit = Vec::loadu(at(dot, k, i)) * r;
        logit.store(at(weight, k, i));
        top = at::vec::maximum(top, logit);
      }
      Vec total(0.f);
      for (int64_t k = 0; k < K; ++k) {
        const Vec e = exp_or_zero(Vec::loadu(at(weight, k, i)) - top);
        e.store(at(weight, k, i));
        total = total + e;
      }
      for (int64_t k = 0; k < K; ++k) (Vec::loadu(at(weight, k, i)) / total).store(at(weight, k, i));
    };
    // Given the softmax and g . v: each source's dL/d(q . v), its coefficient through the key scale, and
    // weight = s p_k, for kLanes tokens from i.
    const auto coefficients_at = [&](int64_t i) {
      Vec mean_along(0.f);
      for (int64_t k = 0; k < K; ++k) {
        mean_along = at::vec::fmadd(Vec::loadu(at(weight, k, i)), Vec::loadu(at(along, k, i)), mean_along);
      }
      for (int64_t k = 0; k < K; ++k) {
        const Vec p = Vec::loadu(at(weight, k, i)), r = Vec::loadu(at(scales, k, i));
        const Vec grad_logit = Vec(scale) * p * (Vec::loadu(at(along, k, i)) - mean_along);
        (grad_logit * r).store(at(grad_dot, k, i));
        (Vec(0.f) - grad_logit * Vec::loadu(at(dot, k, i)) * r * r * r * inverse_dim).store(at(coefficient, k, i));
        (Vec(scale) * p).store(at(weight, k, i));
      }
    };
    if (normed) {
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t k = 0; k < K; ++k) rows[i * K + k] = sources[k] + (first + i) * D;
      }
      copy_saved();
      for (int64_t i = 0; i < n; i += kLanes) softmax_at(i);
      for (int64_t i = 0; i < n; ++i) {
        // h = s sum_k p_k v_k as the forward made it, the norm's backward from it, then g . v with g = dL/dh.
        weighted_rows(rows + i * K, weight + i, K, D, h_row, kTile);
        if (scale != 1.f) {
          for (int64_t d = 0; d < D; ++d) h_row[d] *= scale;
        }
        float* g = g_rows + i * D;
        const float* grad_row = reinterpret_cast<const float*>(grad) + (first + i) * D;
        if (out_norm.centred) {
          layer_norm_backward_row(grad_row, h_row, out_norm.weight, out_norm.eps, D, g, out_dweight, out_dbias);
        } else {
          const float inverse = inverse_rms(h_row, D, out_norm.eps);
          rms_norm_backward_rows(grad_row, h_row, out_norm.weight, &inverse, D, g, out_dweight, 0, 1);
        }
        row_dots<T, kAlong>(rows + i * K, K, q, g, D, kTile, nullptr, nullptr, along + i);
      }
      for (int64_t i = 0; i < n; i += kLanes) coefficients_at(i);
    } else {
      for (int64_t i = 0; i < n; ++i) {
        const T* grad_row = grad + (first + i) * D;
        const float* g;
        if constexpr (kFloat) {
          g = grad_row;
        } else {
          float* row = g_rows + i * D;
          int64_t e = 0;
          for (; e + kLanes <= D; e += kLanes) load_fp32(grad_row + e).store(row + e);
          for (; e < D; ++e) row[e] = static_cast<float>(grad_row[e]);
          g = row;
        }
        for (int64_t k = 0; k < K; ++k) rows[i * K + k] = sources[k] + (first + i) * D;
        if (saved) {
          row_dots<T, kAlong>(rows + i * K, K, q, g, D, kTile, nullptr, nullptr, along + i);
        } else {
          row_dots<T, kLogitsAndAlong>(rows + i * K, K, q, g, D, kTile, dot + i, scales + i, along + i);
        }
      }
      if (saved) copy_saved();
      for (int64_t i = 0; i < n; i += kLanes) {
        softmax_at(i);
        coefficients_at(i);
      }
    }
    const auto g_row = [&](int64_t i) {
      return kFloat && !normed ? reinterpret_cast<const float*>(grad + (first + i) * D) : g_rows + i * D;
    };
    const int64_t pairs = K <= 2 ? n / 2 * 2 : 0;  // tokens taken two at a time
    // source_grads for G rows (of P tokens), with or without the gradients they are added to.
    const auto second_look = [&](auto group, auto tokens, const T* const* token_rows, T* const* outs,
                                 const T* const* add_rows, const float* const* gs, int64_t j) {
      constexpr int G = decltype(group)::value, P = decltype(tokens)::value;
      if (adds != nullptr) {
        source_grads<T, G, P, true>(token_rows, K, outs, add_rows, q, gs, weight + j, grad_dot + j, coefficient + j,
                                    D, dq);
      } else {
        source_grads<T, G, P>(token_rows, K, outs, nullptr, q, gs, weight + j, grad_dot + j, coefficient + j, D, dq);
      }
    };
    using One = std::integral_constant<int, 1>;
    using Two = std::integral_constant<int, 2>;
    for (int64_t i = 0; i < pairs; i += 2) {
      T* outs[4];
      const T* add_rows[4];
      for (int64_t p = 0; p < 2; ++p) {
        for (int64_t k = 0; k < K; ++k) {
          outs[p * K + k] = grads[k] + (first + i + p) * D;
          if (adds != nullptr) add_rows[p * K + k] = add_row(k, first + i + p);
        }
      }
      const float* gs[2] = {g_row(i), g_row(i + 1)};
      if (K == 2) {
        second_look(Two(), Two(), rows + i * K, outs, add_rows, gs, i);
      } else {
        second_look(One(), Two(), rows + i * K, outs, add_rows, gs, i);
      }
    }
    for (int64_t i = pairs; i < n; ++i) {
      const float* g = g_row(i);
      for (int64_t k = 0; k < K; k += 4) {
        T* outs[4];
        const T* add_rows[4];
        const int64_t G = std::min<int64_t>(4, K - k);
        for (int64_t j = 0; j < G; ++j) {
          outs[j] = grads[k + j] + (first + i) * D;
          if (adds != nullptr) add_rows[j] = add_row(k + j, first + i);
        }
        const T* const* token_rows = rows + i * K + k;
        const int64_t j = k * kTile + i;
        switch (G) {
          case 4: second_look(std::integral_constant<int, 4>(), One(), token_rows, outs, add_rows, &g, j); break;
          case 3: second_look(std::integral_constant<int, 3>(), One(), token_rows, outs, add_rows, &g, j); break;
          case 2: second_look(Two(), One(), token_rows, outs, add_rows, &g, j); break;
          default: second_look(One(), One(), token_rows, outs, add_rows, &g, j); break;
        }
      }
    }
  }
}

// Phase 1 of the two-phase schedule: S queries against the K completed blocks. Per token the blocks'
// rows are read from memory once, each block's key scale computed once for all S queries; the states
// stay un-normalised: acc [S, T, D] (the exponentials relative to the max), max and sum [S, T].
template <typename T>
void phase1_rows(const T* const* __restrict blocks, int64_t K, const float* __restrict queries, int64_t S, int64_t D,
                 int64_t T_total, float eps, float* __restrict acc, float* __restrict top, float* __restrict sum,
                 const T** __restrict rows, float* __restrict logits, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      rows[k] = blocks[k] + t * D;
      float first_dot, square;
      dot_and_square(rows[k], Folded{queries}, D, first_dot, square);
      const float r = key_scale(square, D, eps);
      logits[k] = first_dot * r;
      for (int64_t s = 1; s < S; ++s) logits[s * K + k] = dot(rows[k], queries + s * D, D) * r;
    }
    for (int64_t s = 0; s < S; ++s) {
      float* w = logits + s * K;
      std::tie(top[s * T_total + t], sum[s * T_total + t]) = exponentiate(w, K);
      weighted_rows(rows, w, K, D, acc + (s * T_total + t) * D);
    }
  }
}

// Phase 2: merge the partial sum into one query's phase-1 state; out in T.
template <typename T>
void phase2_rows(const float* __restrict acc, const float* __restrict top, const float* __restrict sum,
                 const T* __restrict partial, const float* __restrict q, int64_t D, float eps, float scale,
                 T* __restrict out, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const T* v = partial + t * D;
    float dot, square;
    dot_and_square(v, Folded{q}, D, dot, square);
    const float z = dot * key_scale(square, D, eps);
    const float m = std::max(top[t], z);
    const float a = exp_or_zero(top[t] - m), c = exp_or_zero(z - m);
    const float inverse = scale / (a * sum[t] + c);
    const Vec va(a * inverse), vc(c * inverse);
    const float* row = acc + t * D;
    T* o = out + t * D;
    int64_t d = 0;
    for (; d + kLanes <= D; d += kLanes) store_fp32(o + d, at::vec::fmadd(load_fp32(v + d), vc, Vec::loadu(row + d) * va));
    for (; d < D; ++d) o[d] = static_cast<T>(row[d] * a * inverse + static_cast<float>(v[d]) * c * inverse);
  }
}

// ------------------------------------------------------------------------------------- operators
struct Rows {
  int64_t count;  // T
  int64_t dim;    // D
};

Rows check_sources(const at::TensorList sources, const char* what) {
  TORCH_CHECK(!sources.empty(), what, ": needs at least one source");
  const at::Tensor& first = sources[0];
  TORCH_CHECK(first.dim() >= 1 && first.size(-1) > 0, what, ": sources must be [..., D] with D > 0, got shape ",
              first.sizes());
  for (const auto& source : sources) {
    TORCH_CHECK(source.device().is_cpu(), what, ": a source is on ", source.device(), ", expected the CPU");
    TORCH_CHECK(source.sizes() == first.sizes(), what, ": every source must have the shape of the first, ",
                first.sizes(), ", got ", source.sizes());
    TORCH_CHECK(source.scalar_type() == first.scalar_type(), what, ": every source must have the dtype of the "
                "first, ", first.scalar_type(), ", got ", source.scalar_type());
  }
  TORCH_CHECK(first.scalar_type() == at::kFloat || first.scalar_type() == at::kBFloat16 ||
                  first.scalar_type() == at::kHalf,
              what, ": sources must be float32, bfloat16 or float16, got ", first.scalar_type());
  const int64_t D = first.size(-1);
  return {first.numel() / D, D};
}

// The pseudo-query with the key norm's weight folded in, fp32 [D] (attnres_fx/aggregation.py), written to
// `out` with a loop of its own: the few ATen ops it would otherwise take cost microseconds, a decoding
// step's whole budget.
void fold_query(const at::Tensor& proj_weight, const at::Tensor& norm_weight, int64_t D, const char* what,
                float* out) {
  TORCH_CHECK(proj_weight.numel() == D && norm_weight.numel() == D, what, ": proj_weight [1, D] and norm_weight [D] "
              "must have D = ", D, " elements, got ", proj_weight.sizes(), " and ", norm_weight.sizes());
  // Weights of two dtypes (rare: both are one module's parameters) are read as fp32.
  const bool same = proj_weight.scalar_type() == norm_weight.scalar_type();
  const at::Tensor proj = (same ? proj_weight : proj_weight.to(at::kFloat)).contiguous();
  const at::Tensor norm = (same ? norm_weight : norm_weight.to(at::kFloat)).contiguous();
  ATTNRES_DISPATCH(proj.scalar_type(), "attnres_fold_query", [&] {
    const scalar_t* p = proj.const_data_ptr<scalar_t>();
    const scalar_t* g = norm.const_data_ptr<scalar_t>();
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(p[d]) * static_cast<float>(g[d]);
  });
}

at::Tensor folded_query(const at::Tensor& proj_weight, const at::Tensor& norm_weight, int64_t D, const char* what) {
  at::Tensor query = at::empty({D}, proj_weight.options().dtype(at::kFloat));
  fold_query(proj_weight, norm_weight, D, what, query.mutable_data_ptr<float>());
  return query;
}

int64_t grain(int64_t elements_per_row) {
  return std::max<int64_t>(1, kMinChunkElements / std::max<int64_t>(1, elements_per_row));
}

std::vector<at::Tensor> contiguous(const at::TensorList tensors) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back(t.contiguous());
  return out;
}

// Inline capacities of the forward's scratch (larger calls take the heap): the folded query of a width up
// to kInlineWidth, the row pointers and softmax stats of up to kInlineSources sources.
constexpr int64_t kInlineWidth = 4096;
constexpr int64_t kInlineSources = 16;

// The forward; with `save`, also the logits' parts the backward needs ([2, K, T] fp32: save_logits).
// A decoding step calls it with a few tokens, after the step's weights have pushed its code and data out of
// the caches, so each call pays for every allocation and helper it runs (one call at [1, 1, 256] after
// streaming 32 MB: an ATen allocation through the dispatcher 11-14 us, through at::detail 6 us; the whole
// call 49-65 us with three of them, 36-48 us as here). Hence: the output (and saved logits) are its only
// allocations, made below the dispatcher; the query and the scratch live on the stack; contiguous sources
// (every call the stream makes) are not copied. (at::parallel_for runs a chunk of work or less on this
// thread at no measurable cost.)
// With `out_norm_weight` (defined), each result row normalised as it is stored (normalise_row): the RMS
// norm, or with `out_norm_centred` the layer norm, plus `out_norm_bias` where defined.
std::tuple<at::Tensor, at::Tensor> forward(at::TensorList sources_in, const at::Tensor& proj_weight,
                                           const at::Tensor& norm_weight, double eps, bool preserve_scale, bool save,
                                           const at::Tensor& out_norm_weight = at::Tensor(), double out_norm_eps = 0.0,
                                           const at::Tensor& out_norm_bias = at::Tensor(),
                                           bool out_norm_centred = false) {
  const Rows rows = check_sources(sources_in, "attnres::aggregate");
  const bool normed = out_norm_weight.defined();
  TORCH_CHECK(!normed || (out_norm_weight.numel() == rows.dim && out_norm_weight.is_contiguous() &&
                          out_norm_weight.scalar_type() == sources_in[0].scalar_type()),
              "attnres::aggregate_normed: out_norm_weight must be a contiguous [D] tensor of the sources' dtype, "
              "got ", out_norm_weight.sizes());
  const bool biased = normed && out_norm_bias.defined();
  TORCH_CHECK(!out_norm_bias.defined() || (normed && out_norm_centred && out_norm_bias.numel() == rows.dim &&
                                           out_norm_bias.is_contiguous() &&
                                           out_norm_bias.scalar_type() == sources_in[0].scalar_type()),
              "attnres::aggregate_normed: out_norm_bias is a layer norm's (out_norm_centred), a contiguous [D] "
              "tensor of the sources' dtype, got ", out_norm_bias.sizes());
  const bool dense =
      std::all_of(sources_in.begin(), sources_in.end(), [](const at::Tensor& s) { return s.is_contiguous(); });
  const std::vector<at::Tensor> copies = dense ? std::vector<at::Tensor>() : contiguous(sources_in);
  const at::TensorList sources = dense ? sources_in : at::TensorList(copies);
  const int64_t K = static_cast<int64_t>(sources.size()), D = rows.dim;
  const float scale = preserve_scale ? static_cast<float>(K) : 1.f;
  const at::ScalarType type = sources[0].scalar_type();
  if (!save && rows.count <= kFewTokens && K <= kFewTokensSources && D <= kFewTokensWidth &&
      proj_weight.scalar_type() == type && norm_weight.scalar_type() == type && proj_weight.numel() == D &&
      norm_weight.numel() == D && proj_weight.is_contiguous() && norm_weight.is_contiguous()) {
    at::Tensor out(at::detail::empty_cpu(sources[0].sizes(), type));
    ATTNRES_DISPATCH(type, "attnres_aggregate_few_tokens", [&] {
      const scalar_t* pointers[kFewTokensSources];
      for (int64_t k = 0; k < K; ++k) pointers[k] = sources[k].const_data_ptr<scalar_t>();
      const OutputNorm<scalar_t> out_norm{normed ? out_norm_weight.const_data_ptr<scalar_t>() : nullptr,
                                          static_cast<float>(out_norm_eps),
                                          biased ? out_norm_bias.const_data_ptr<scalar_t>() : nullptr,
                                          out_norm_centred};
      aggregate_few_tokens(pointers, K, proj_weight.const_data_ptr<scalar_t>(), norm_weight.const_data_ptr<scalar_t>(),
                           D, static_cast<float>(eps), scale, out.mutable_data_ptr<scalar_t>(), rows.count, out_norm);
    });
    return {out, at::Tensor()};
  }
  c10::SmallVector<float, kInlineWidth> query(D);
  fold_query(proj_weight, norm_weight, D, "attnres::aggregate", query.data());
  // at::detail::empty_cpu: what at::empty's CPU kernel allocates with (the same in torch 2.11 to 2.14),
  // without the dispatcher's way there; every element of both is written below.
  at::Tensor out(at::detail::empty_cpu(sources[0].sizes(), sources[0].scalar_type()));
  at::Tensor saved = save ? at::Tensor(at::detail::empty_cpu({2, K, rows.count}, at::kFloat)) : at::Tensor();
  ATTNRES_DISPATCH(out.scalar_type(), "attnres_aggregate", [&] {
    c10::SmallVector<const scalar_t*, kInlineSources> pointers;
    for (const auto& s : sources) pointers.push_back(s.const_data_ptr<scalar_t>());
    const scalar_t* const* src = pointers.data();
    const float* q = query.data();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    float* kept = save ? saved.mutable_data_ptr<float>() : nullptr;
    const OutputNorm<scalar_t> out_norm{normed ? out_norm_weight.const_data_ptr<scalar_t>() : nullptr,
                                        static_cast<float>(out_norm_eps),
                                        biased ? out_norm_bias.const_data_ptr<scalar_t>() : nullptr, out_norm_centred};
    at::parallel_for(0, rows.count, grain(K * D), [&](int64_t begin, int64_t end) {
      c10::SmallVector<const scalar_t*, kInlineSources * kTile> rows_of_tile(kTile * K);
      c10::SmallVector<float, 2 * kInlineSources * kTile> stats(2 * K * kTile, 0.f);
      aggregate_rows(src, K, q, D, static_cast<float>(eps), scale, o, rows_of_tile.data(), stats.data(), begin,
                     end, kept, rows.count, out_norm);
    });
  });
  return {out, saved};
}

at::Tensor aggregate(at::TensorList sources, const at::Tensor& proj_weight, const at::Tensor& norm_weight, double eps,
                     bool preserve_scale) {
  return std::get<0>(forward(sources, proj_weight, norm_weight, eps, preserve_scale, false));
}

std::tuple<at::Tensor, at::Tensor> aggregate_saving_logits(at::TensorList sources, const at::Tensor& proj_weight,
                                                           const at::Tensor& norm_weight, double eps,
                                                           bool preserve_scale) {
  return forward(sources, proj_weight, norm_weight, eps, preserve_scale, true);
}

// The aggregation and the norm that alone reads its result, at once, for calls that record no gradient
// (attnres_fx/passes/fuse_norms.py): rms_norm(aggregate(...), out_norm_weight, out_norm_eps), or with
// out_norm_centred layer_norm(aggregate(...), out_norm_weight, out_norm_bias, out_norm_eps). The norm reads
// the result rows while they are in cache, and a decoding step makes one call where it made some seven.
at::Tensor aggregate_normed(at::TensorList sources, const at::Tensor& proj_weight, const at::Tensor& norm_weight,
                            double eps, bool preserve_scale, const at::Tensor& out_norm_weight, double out_norm_eps,
                            const std::optional<at::Tensor>& out_norm_bias, bool out_norm_centred) {
  return std::get<0>(forward(sources, proj_weight, norm_weight, eps, preserve_scale, false, out_norm_weight,
                             out_norm_eps, out_norm_bias.value_or(at::Tensor()), out_norm_centred));
}

// A [D] fp32 sum over a call's tokens, taken in chunks (a thread's each): one partial sum per chunk, added
// in chunk order at the end (deterministic, no atomics); a single chunk (one thread, or few tokens) sums
// straight into the result. Allocated below the dispatcher, as the backward's other results.
class ChunkSums {
 public:
  ChunkSums(int64_t chunks, int64_t D)
      : D_(D), result_(at::detail::empty_cpu({D}, at::kFloat)), partial_(chunks > 1 ? chunks * D : 0, 0.f) {
    if (chunks == 1) std::fill(result(), result() + D, 0.f);
  }
  float* chunk(int64_t c) { return partial_.empty() ? result() : partial_.data() + c * D_; }
  at::Tensor total() {
    if (!partial_.empty()) {
      std::copy(partial_.begin(), partial_.begin() + D_, result());
      for (size_t c = 1; c < partial_.size() / D_; ++c) {
        for (int64_t d = 0; d < D_; ++d) result()[d] += partial_[c * D_ + d];
      }
    }
    return result_;
  }

 private:
  float* result() { return result_.mutable_data_ptr<float>(); }
  int64_t D_;
  at::Tensor result_;
  std::vector<float> partial_;
};

// Work counts for tests (deposit_counts, Note [gradient deposits]): gradients deposited, and sums a
// site's kernel wrote over in place.
std::atomic<int64_t> deposits_made{0};
std::atomic<int64_t> sums_written_over{0};

// The backward; given `saved` (the forward's save_logits), without recomputing the logits. As in the
// forward, a training step's backward at a few tokens pays for every allocation and helper: the results
// are allocated below the dispatcher, the query and the scratch live on the stack, and inputs already
// contiguous and of the sources' dtype (every call autograd makes) are not copied.
//
// `into`, where given (a deposit's sums, Note [gradient deposits]): per source a gradient (or an undefined
// tensor) that the source's dL/dv is added to; the result is that sum, written over `into[k]` itself
// where nothing else can see it (the vector holds its only reference and it shares no storage), into a new
// tensor otherwise.
//
// `out_norm_weight`, where defined: the backward of aggregate_normed, `grad_in` the normed result's gradient
// (fp32, given `saved`; backward_rows' `out_norm`), with the norm weight's gradient in `grad_out_norm_weight`
// and, for a layer norm (`out_norm_centred`), the gradient of a bias after it in `grad_out_norm_bias`.
std::tuple<std::vector<at::Tensor>, at::Tensor> backward(const at::Tensor& grad_in, at::TensorList sources_in,
                                                         const at::Tensor& saved_in, const at::Tensor& proj_weight,
                                                         const at::Tensor& norm_weight, double eps,
                                                         bool preserve_scale,
                                                         std::vector<at::Tensor>* into = nullptr,
                                                         const at::Tensor& out_norm_weight = at::Tensor(),
                                                         double out_norm_eps = 0.0,
                                                         at::Tensor* grad_out_norm_weight = nullptr,
                                                         bool out_norm_centred = false,
                                                         at::Tensor* grad_out_norm_bias = nullptr) {
  const Rows rows = check_sources(sources_in, "attnres::aggregate_backward");
  TORCH_CHECK(!saved_in.defined() || (saved_in.scalar_type() == at::kFloat &&
                                      saved_in.sizes() == at::IntArrayRef({2, static_cast<int64_t>(sources_in.size()),
                                                                           rows.count})),
              "attnres::aggregate_backward: the saved logits must be float32 [2, K, T] = [2, ", sources_in.size(), ", ",
              rows.count, "], got ", saved_in.scalar_type(), " ", saved_in.sizes());
  const at::Tensor saved = !saved_in.defined() || saved_in.is_contiguous() ? saved_in : saved_in.contiguous();
  TORCH_CHECK(grad_in.sizes() == sources_in[0].sizes(), "attnres::aggregate_backward: grad must have the sources' "
              "shape ", sources_in[0].sizes(), ", got ", grad_in.sizes());
  const bool dense =
      std::all_of(sources_in.begin(), sources_in.end(), [](const at::Tensor& s) { return s.is_contiguous(); });
  const std::vector<at::Tensor> copies = dense ? std::vector<at::Tensor>() : contiguous(sources_in);
  const at::TensorList sources = dense ? sources_in : at::TensorList(copies);
  const at::ScalarType dtype = sources[0].scalar_type();
  const at::Tensor grad =
      grad_in.scalar_type() == dtype && grad_in.is_contiguous() ? grad_in : grad_in.to(dtype).contiguous();
  const int64_t K = static_cast<int64_t>(sources.size()), D = rows.dim, T = rows.count;
  const bool normed = out_norm_weight.defined();
  TORCH_CHECK(!normed || (saved.defined() && dtype == at::kFloat && out_norm_weight.scalar_type() == at::kFloat &&
                          out_norm_weight.is_contiguous() && out_norm_weight.numel() == D),
              "attnres::aggregate_normed_backward: float32 sources, the saved logits and a contiguous float32 [D] "
              "norm weight, got ", dtype, " sources and a ", out_norm_weight.scalar_type(), " ",
              out_norm_weight.sizes(), " weight");
  c10::SmallVector<float, kInlineWidth> query(D);
  fold_query(proj_weight, norm_weight, D, "attnres::aggregate_backward", query.data());
  const float scale = preserve_scale ? static_cast<float>(K) : 1.f;
  std::vector<at::Tensor> grads, addends;
  grads.reserve(K);
  bool adding = false;
  if (into != nullptr) {
    TORCH_CHECK(static_cast<int64_t>(into->size()) == K, "attnres::aggregate_backward: one sum per source");
    addends.resize(K);
    for (int64_t k = 0; k < K; ++k) {
      at::Tensor& sum = (*into)[k];
      if (!sum.defined()) continue;
      TORCH_CHECK(sum.sizes() == sources[0].sizes(), "attnres::aggregate_backward: a gradient sum must have the "
                  "sources' shape ", sources[0].sizes(), ", got ", sum.sizes());
      addends[k] = sum.scalar_type() == dtype && sum.is_contiguous() ? sum : sum.to(dtype).contiguous();
      adding = true;
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    // Referenced by `into` and `addends` alone: no one else sees it written over.
    const at::Tensor* sum = into != nullptr ? &(*into)[k] : nullptr;
    const bool overwrite = sum != nullptr && sum->defined() && addends[k].is_same(*sum) && sum->use_count() == 2 &&
                           sum->storage().use_count() == 1 && !sum->is_inference() && !sum->requires_grad() &&
                           sum->key_set().has(c10::DispatchKey::CPU) && !sum->is_view();
    grads.emplace_back(overwrite ? *sum : at::Tensor(at::detail::empty_cpu(sources[0].sizes(), dtype)));
    if (overwrite) ++sums_written_over;
  }
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), T / grain(K * D)));
  ChunkSums dq(chunks, D);
  std::optional<ChunkSums> dweight, dbias;  // the norm weight's gradient, a layer norm's bias's
  if (normed) dweight.emplace(chunks, D);
  if (normed && out_norm_centred) dbias.emplace(chunks, D);
  const OutputNorm<float> out_norm{normed ? out_norm_weight.const_data_ptr<float>() : nullptr,
                                   static_cast<float>(out_norm_eps), nullptr, out_norm_centred};
  ATTNRES_DISPATCH(dtype, "attnres_aggregate_backward", [&] {
    c10::SmallVector<const scalar_t*, kInlineSources> src, add;
    c10::SmallVector<scalar_t*, kInlineSources> dst;
    for (int64_t k = 0; k < K; ++k) {
      src.push_back(sources[k].const_data_ptr<scalar_t>());
      dst.push_back(grads[k].mutable_data_ptr<scalar_t>());
      if (adding) add.push_back(addends[k].defined() ? addends[k].const_data_ptr<scalar_t>() : nullptr);
    }
    const std::vector<scalar_t> zero_row(adding ? D : 0, scalar_t(0));
    const scalar_t* const* s = src.data();
    scalar_t* const* gs = dst.data();
    const scalar_t* g = grad.const_data_ptr<scalar_t>();
    const float* q = query.data();
    const float* kept = saved.defined() ? saved.const_data_ptr<float>() : nullptr;
    at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
      std::vector<float> g_rows(std::is_same_v<scalar_t, float> && !normed ? 0 : kTile * D);
      std::vector<float> h_row(normed ? D : 0);
      c10::SmallVector<float, 6 * kInlineSources * kTile> stats(6 * K * kTile, 0.f);
      c10::SmallVector<const scalar_t*, kInlineSources * kTile> rows_of_tile(kTile * K);
      for (int64_t c = first; c < last; ++c) {
        backward_rows(g, s, gs, K, q, D, static_cast<float>(eps), scale, g_rows.data(), rows_of_tile.data(),
                      stats.data(), dq.chunk(c), c * T / chunks, (c + 1) * T / chunks, kept, T,
                      adding ? add.data() : nullptr, zero_row.data(), out_norm, normed ? dweight->chunk(c) : nullptr,
                      h_row.data(), dbias ? dbias->chunk(c) : nullptr);
      }
    });
  });
  if (normed) *grad_out_norm_weight = dweight->total();
  if (dbias && grad_out_norm_bias != nullptr) *grad_out_norm_bias = dbias->total();
  return {grads, dq.total()};
}

std::tuple<std::vector<at::Tensor>, at::Tensor> aggregate_backward(const at::Tensor& grad, at::TensorList sources,
                                                                   const at::Tensor& proj_weight,
                                                                   const at::Tensor& norm_weight, double eps,
                                                                   bool preserve_scale) {
  return backward(grad, sources, at::Tensor(), proj_weight, norm_weight, eps, preserve_scale);
}

std::tuple<std::vector<at::Tensor>, at::Tensor> aggregate_backward_saved(const at::Tensor& grad, at::TensorList sources,
                                                                         const at::Tensor& saved,
                                                                         const at::Tensor& proj_weight,
                                                                         const at::Tensor& norm_weight, double eps,
                                                                         bool preserve_scale) {
  return backward(grad, sources, saved, proj_weight, norm_weight, eps, preserve_scale);
}

// aggregate_normed for a call that records a gradient: the normed result and the logits' parts its
// backward needs. The rows before the norm are not kept: aggregate_normed_backward_saved recomputes each
// from its sources, which the aggregation's backward reads anyway, so that a site fused with its norm
// keeps no stream tensor of its own for the backward (unfused, the norm keeps its input).
std::tuple<at::Tensor, at::Tensor> aggregate_normed_saving_logits(at::TensorList sources, const at::Tensor& proj_weight,
                                                                  const at::Tensor& norm_weight, double eps,
                                                                  bool preserve_scale, const at::Tensor& out_norm_weight,
                                                                  double out_norm_eps,
                                                                  const std::optional<at::Tensor>& out_norm_bias,
                                                                  bool out_norm_centred) {
  return forward(sources, proj_weight, norm_weight, eps, preserve_scale, true, out_norm_weight, out_norm_eps,
                 out_norm_bias.value_or(at::Tensor()), out_norm_centred);
}

// The fourth result: a layer norm's bias gradient ([D], out_norm_centred), else an empty tensor.
std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor> aggregate_normed_backward_saved(
    const at::Tensor& grad, at::TensorList sources, const at::Tensor& saved, const at::Tensor& proj_weight,
    const at::Tensor& norm_weight, double eps, bool preserve_scale, const at::Tensor& out_norm_weight,
    double out_norm_eps, bool out_norm_centred) {
  at::Tensor grad_out_norm_weight, grad_out_norm_bias;
  auto [grads, grad_query] = backward(grad, sources, saved, proj_weight, norm_weight, eps, preserve_scale, nullptr,
                                      out_norm_weight, out_norm_eps, &grad_out_norm_weight, out_norm_centred,
                                      &grad_out_norm_bias);
  if (!grad_out_norm_bias.defined()) grad_out_norm_bias = at::detail::empty_cpu({0}, at::kFloat);
  return {std::move(grads), std::move(grad_query), std::move(grad_out_norm_weight), std::move(grad_out_norm_bias)};
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>> phase1(
    at::TensorList blocks_in, at::TensorList proj_weights,
                                                      at::TensorList norm_weights, double eps) {
  const Rows rows = check_sources(blocks_in, "attnres::phase1");
  const auto blocks = contiguous(blocks_in);
  const int64_t K = static_cast<int64_t>(blocks.size()), D = rows.dim, T = rows.count;
  TORCH_CHECK(!proj_weights.empty() && proj_weights.size() == norm_weights.size(),
              "attnres::phase1: one proj_weight and one norm_weight per query, got ", proj_weights.size(), " and ",
              norm_weights.size());
  const int64_t S = static_cast<int64_t>(proj_weights.size());
  at::Tensor queries = at::empty({S, D}, blocks[0].options().dtype(at::kFloat));
  for (int64_t s = 0; s < S; ++s) {
    fold_query(proj_weights[s], norm_weights[s], D, "attnres::phase1", queries.mutable_data_ptr<float>() + s * D);
  }
  auto leading = blocks[0].sizes().vec();
  std::vector<int64_t> acc_shape{S}, stat_shape{S};
  acc_shape.insert(acc_shape.end(), leading.begin(), leading.end());
  stat_shape.insert(stat_shape.end(), leading.begin(), leading.end() - 1);
  stat_shape.push_back(1);
  const auto options = blocks[0].options().dtype(at::kFloat);
  at::Tensor acc = at::empty(acc_shape, options), top = at::empty(stat_shape, options), sum = at::empty(stat_shape, options);
  ATTNRES_DISPATCH(blocks[0].scalar_type(), "attnres_phase1", [&] {
    std::vector<const scalar_t*> pointers;
    for (const auto& b : blocks) pointers.push_back(b.const_data_ptr<scalar_t>());
    const scalar_t* const* src = pointers.data();
    const float* q = queries.const_data_ptr<float>();
    float* a = acc.mutable_data_ptr<float>();
    float* m = top.mutable_data_ptr<float>();
    float* l = sum.mutable_data_ptr<float>();
    at::parallel_for(0, T, grain(K * D * S), [&](int64_t begin, int64_t end) {
      std::vector<const scalar_t*> rows_of_token(K);
      std::vector<float> logits(K * S);
      phase1_rows(src, K, q, S, D, T, static_cast<float>(eps), a, m, l, rows_of_token.data(), logits.data(), begin,
                  end);
    });
  });
  return {top.unbind(0), sum.unbind(0), acc.unbind(0)};
}

at::Tensor phase2(const at::Tensor& acc_in, const at::Tensor& top_in, const at::Tensor& sum_in,
                  const at::Tensor& partial_in, const at::Tensor& proj_weight, const at::Tensor& norm_weight,
                  double eps, double scale, at::ScalarType dtype) {
  const Rows rows = check_sources({partial_in}, "attnres::phase2");
  TORCH_CHECK(acc_in.sizes() == partial_in.sizes() && acc_in.scalar_type() == at::kFloat,
              "attnres::phase2: the state's acc must be float32 of the partial's shape ", partial_in.sizes(),
              ", got ", acc_in.scalar_type(), " ", acc_in.sizes());
  TORCH_CHECK(top_in.numel() == rows.count && sum_in.numel() == rows.count, "attnres::phase2: the state's max and sum "
              "must have one element per token (", rows.count, ")");
  const at::Tensor acc = acc_in.contiguous(), top = top_in.to(at::kFloat).contiguous(),
                   sum = sum_in.to(at::kFloat).contiguous(), partial = partial_in.contiguous();
  const int64_t D = rows.dim;
  const at::Tensor query = folded_query(proj_weight, norm_weight, D, "attnres::phase2");
  TORCH_CHECK(dtype == partial.scalar_type(), "attnres::phase2: the result dtype must be the partial's, ",
              partial.scalar_type(), ", got ", dtype);
  at::Tensor out = at::empty_like(partial);
  ATTNRES_DISPATCH(partial.scalar_type(), "attnres_phase2", [&] {
    const scalar_t* p = partial.const_data_ptr<scalar_t>();
    const float* a = acc.const_data_ptr<float>();
    const float* m = top.const_data_ptr<float>();
    const float* l = sum.const_data_ptr<float>();
    const float* q = query.const_data_ptr<float>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows.count, grain(3 * D), [&](int64_t begin, int64_t end) {
      phase2_rows(a, m, l, p, q, D, static_cast<float>(eps), static_cast<float>(scale), o, begin, end);
    });
  });
  return out;
}

// dL/dproj = dL/dq * norm.weight and dL/dnorm = dL/dq * proj.weight (the folded query is their product),
// each in its weight's dtype and shape: one loop where the same through ATen ops took six calls (some
// 7 us, per aggregation of a training step's backward).
std::tuple<at::Tensor, at::Tensor> weight_grads(const at::Tensor& grad_query_in, const at::Tensor& proj_weight,
                                                const at::Tensor& norm_weight) {
  const int64_t D = grad_query_in.numel();
  TORCH_CHECK(grad_query_in.scalar_type() == at::kFloat && proj_weight.numel() == D && norm_weight.numel() == D,
              "attnres_cpu::weight_grads: a float32 dL/dq and weights of as many elements (", D, "), got ",
              grad_query_in.scalar_type(), ", ", proj_weight.sizes(), " and ", norm_weight.sizes());
  const at::Tensor grad_query = grad_query_in.contiguous();
  const auto as_float = [](const at::Tensor& w) {
    return w.scalar_type() == at::kFloat && w.is_contiguous() ? w : w.to(at::kFloat).contiguous();
  };
  const at::Tensor proj = as_float(proj_weight), norm = as_float(norm_weight);
  at::Tensor grad_proj(at::detail::empty_cpu(proj_weight.sizes(), at::kFloat));
  at::Tensor grad_norm(at::detail::empty_cpu(norm_weight.sizes(), at::kFloat));
  const float* dq = grad_query.const_data_ptr<float>();
  const float* p = proj.const_data_ptr<float>();
  const float* g = norm.const_data_ptr<float>();
  float* gp = grad_proj.mutable_data_ptr<float>();
  float* gn = grad_norm.mutable_data_ptr<float>();
  for (int64_t d = 0; d < D; ++d) {
    gp[d] = dq[d] * g[d];
    gn[d] = dq[d] * p[d];
  }
  const auto as_weight = [](const at::Tensor& grad, const at::Tensor& w) {
    return w.scalar_type() == at::kFloat ? grad : grad.to(w.scalar_type());
  };
  return {as_weight(grad_proj, proj_weight), as_weight(grad_norm, norm_weight)};
}

std::tuple<at::Tensor, at::Tensor> weight_grads_meta(const at::Tensor& grad_query, const at::Tensor& proj_weight,
                                                     const at::Tensor& norm_weight) {
  return {at::empty_like(proj_weight), at::empty_like(norm_weight)};
}

// ------------------------------------------------------------------------------------- autograd

// The operators through the dispatcher (below autograd, under the guards the callers set): whatever
// implements them for the tensors' device, and whatever dispatch modes are active, see the calls. Each
// operator's handle is found once; `Kernel`, its CPU implementation here, gives the handle its type.
template <auto& Kernel>
const auto& dispatched(const char* name) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<std::remove_reference_t<decltype(Kernel)>>();
  return op;
}

const auto& aggregate_op() { return dispatched<aggregate>("attnres_cpu::aggregate"); }
const auto& normed_op() { return dispatched<aggregate_normed>("attnres_cpu::aggregate_normed"); }
const auto& saving_op() { return dispatched<aggregate_saving_logits>("attnres_cpu::aggregate_saving_logits"); }
const auto& backward_op() { return dispatched<aggregate_backward_saved>("attnres_cpu::aggregate_backward_saved"); }
const auto& normed_saving_op() {
  return dispatched<aggregate_normed_saving_logits>("attnres_cpu::aggregate_normed_saving_logits");
}
const auto& normed_backward_op() {
  return dispatched<aggregate_normed_backward_saved>("attnres_cpu::aggregate_normed_backward_saved");
}
const auto& weight_grads_op() { return dispatched<weight_grads>("attnres_cpu::weight_grads"); }

// Shapes only, for fake tensors (torch.library.opcheck, FakeTensorMode), symbolic sizes included: the
// checks of check_sources on sym_sizes.
void check_meta_sources(const at::TensorList sources, const at::Tensor& proj_weight, const at::Tensor& norm_weight,
                        const char* what) {
  TORCH_CHECK(!sources.empty(), what, ": needs at least one source");
  const at::Tensor& first = sources[0];
  TORCH_CHECK(first.dim() >= 1, what, ": sources must be [..., D] with D > 0");
  for (const auto& source : sources) {
    TORCH_CHECK(source.sym_sizes() == first.sym_sizes() && source.scalar_type() == first.scalar_type(), what,
                ": every source must have the shape and dtype of the first");
  }
  TORCH_CHECK(first.scalar_type() == at::kFloat || first.scalar_type() == at::kBFloat16 ||
                  first.scalar_type() == at::kHalf,
              what, ": sources must be float32, bfloat16 or float16, got ", first.scalar_type());
  const c10::SymInt& dim = first.sym_sizes().back();
  TORCH_CHECK(proj_weight.sym_numel() == dim && norm_weight.sym_numel() == dim, what,
              ": proj_weight [1, D] and norm_weight [D] must have D elements");
}

at::Tensor aggregate_meta(at::TensorList sources, const at::Tensor& proj_weight, const at::Tensor& norm_weight,
                          double eps, bool preserve_scale) {
  check_meta_sources(sources, proj_weight, norm_weight, "attnres::aggregate");
  return at::empty_like(sources[0]);
}

std::tuple<std::vector<at::Tensor>, at::Tensor> aggregate_backward_meta(const at::Tensor& grad, at::TensorList sources,
                                                                        const at::Tensor& proj_weight,
                                                                        const at::Tensor& norm_weight, double eps,
                                                                        bool preserve_scale) {
  check_meta_sources(sources, proj_weight, norm_weight, "attnres::aggregate_backward");
  std::vector<at::Tensor> grads;
  for (const auto& s : sources) grads.push_back(at::empty_like(s));
  return {grads, at::empty_symint({sources[0].sym_sizes().back()}, sources[0].options().dtype(at::kFloat))};
}

at::Tensor aggregate_normed_meta(at::TensorList sources, const at::Tensor& proj_weight, const at::Tensor& norm_weight,
                                 double eps, bool preserve_scale, const at::Tensor& out_norm_weight,
                                 double out_norm_eps, const std::optional<at::Tensor>& out_norm_bias,
                                 bool out_norm_centred) {
  check_meta_sources(sources, proj_weight, norm_weight, "attnres::aggregate_normed");
  return at::empty_like(sources[0]);
}

std::tuple<at::Tensor, at::Tensor> aggregate_saving_logits_meta(at::TensorList sources, const at::Tensor& proj_weight,
                                                                const at::Tensor& norm_weight, double eps,
                                                                bool preserve_scale) {
  check_meta_sources(sources, proj_weight, norm_weight, "attnres::aggregate");
  const c10::SymInt tokens = sources[0].sym_numel() / sources[0].sym_sizes().back();
  return {at::empty_like(sources[0]),
          at::empty_symint({c10::SymInt(2), c10::SymInt(static_cast<int64_t>(sources.size())), tokens},
                           sources[0].options().dtype(at::kFloat))};
}

std::tuple<at::Tensor, at::Tensor> aggregate_normed_saving_logits_meta(
    at::TensorList sources, const at::Tensor& proj_weight, const at::Tensor& norm_weight, double eps,
    bool preserve_scale, const at::Tensor& out_norm_weight, double out_norm_eps,
    const std::optional<at::Tensor>& out_norm_bias, bool out_norm_centred) {
  return aggregate_saving_logits_meta(sources, proj_weight, norm_weight, eps, preserve_scale);
}

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor> aggregate_normed_backward_saved_meta(
    const at::Tensor& grad, at::TensorList sources, const at::Tensor& saved, const at::Tensor& proj_weight,
    const at::Tensor& norm_weight, double eps, bool preserve_scale, const at::Tensor& out_norm_weight,
    double out_norm_eps, bool out_norm_centred) {
  auto [grads, grad_query] = aggregate_backward_meta(grad, sources, proj_weight, norm_weight, eps, preserve_scale);
  return {std::move(grads), std::move(grad_query), at::empty_like(out_norm_weight),
          out_norm_centred ? at::empty_like(out_norm_weight) : at::empty({0}, out_norm_weight.options())};
}

std::tuple<std::vector<at::Tensor>, at::Tensor> aggregate_backward_saved_meta(
    const at::Tensor& grad, at::TensorList sources, const at::Tensor& saved, const at::Tensor& proj_weight,
    const at::Tensor& norm_weight, double eps, bool preserve_scale) {
  return aggregate_backward_meta(grad, sources, proj_weight, norm_weight, eps, preserve_scale);
}

// Whether a call the dispatcher would send straight to the CPU kernel may go there itself: no gradient
// recorded, no dispatch key included for this thread (a TorchDispatchMode, functorch's transforms), no
// RecordFunction callback (the profiler records the dispatcher's calls), and tensors with a dense CPU
// tensor's dispatch keys only (no subclass, wrapper, conjugate or negative bit). A decoding step's
// aggregation then skips two passes through the dispatcher and the autograd kernel: their code, some
// 150 lines, is out of cache at every block of a decoding step, after its weights streamed through. A
// site's backward that deposits (Note [gradient deposits]) calls its kernel itself only where this holds.
bool dispatches_to_kernel(const std::vector<at::Tensor>& sources, const at::Tensor& proj_weight,
                          const at::Tensor& norm_weight) {
  static const c10::DispatchKeySet dense_cpu =
      c10::DispatchKeySet(c10::DispatchKey::CPU) |
      c10::getAutogradRelatedKeySetFromBackend(c10::BackendComponent::CPUBit) |
      c10::getAutocastRelatedKeySetFromBackend(c10::BackendComponent::CPUBit);
  if (at::GradMode::is_enabled() ||
      !(c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set).empty() ||
      at::getStepCallbacksUnlessEmpty(at::RecordScope::FUNCTION).has_value()) {
    return false;
  }
  const auto plain = [](const at::Tensor& t) { return dense_cpu.isSupersetOf(t.key_set()); };
  return plain(proj_weight) && plain(norm_weight) && std::all_of(sources.begin(), sources.end(), plain);
}

// ------------------------------------------------------------------------------------- stream edges
// The two autograd nodes of a layer-routed stream, _Bundle and _Unbundle of attnres_fx/routing/state.py
// (which documents them; the Python classes remain for what these entries do not take: tensor subclasses,
// TorchDynamo's traces), here as C++ Functions: the same forward, the same outputs (torch::autograd's
// _wrap_outputs treats them as Python's does), backwards that run without the GIL. As Python Functions
// they cost some 140 us a block of a training step (d=128, 24 layers), forward and backward, their
// Python running with cold caches between the blocks' kernels.

// Note [gradient deposits]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A block reads the completed block sums through its unbundle node's outputs, at each of its sites and in
// its bundle node (which hands them on to the next block), so each such output receives a gradient from
// every site of the block and one from the bundle node, and autograd sums them before the unbundle node
// runs: a pass over the stream per term (two reads, one write) and a new tensor per term, the largest
// share of what a training step's backward adds after the kernels. Instead those nodes *deposit* their
// gradient for such an output into the sum the unbundle node would make (its holder, at that output's
// slot): the bundle node, first to run in the block's backward, its gradient as it is; each site's
// backward kernel adds its dL/dv to the sum as it writes it (one read, one write: source_grads' `Add`),
// over the sum itself where nothing else holds it. That is the order autograd would sum them in. The
// node returns no gradient for that output; the unbundle node, which autograd runs only after every node
// that reads its outputs, takes the deposits in with whatever else came through autograd. Deposits are
// made only where that holds, and the nodes return their gradients as before otherwise:
//   - in a backward that runs every node it reaches (no `inputs`: Tensor.backward, what training calls);
//     torch.autograd.grad runs only the nodes on its inputs' paths, a site's perhaps but not the unbundle
//     node that would take its deposit;
//   - where no graph of the backward is recorded (create_graph=False): the sums are not differentiable;
//   - for a site, where its kernel is what the dispatcher would call (dispatches_to_kernel: no dispatch
//     mode or profiler sees the call otherwise).
// The holder keeps deposits per backward (graph task): one that stopped half-way (an exception) leaves its
// own behind, which no other backward reads, and two backwards of one graph on two threads each take in
// their own. What a backward runs and which it is come from
// torch/csrc/autograd/graph_task.h (get_current_graph_task_exec_info, get_current_graph_task_id: the same
// in torch 2.11 to 2.14).

// The gradients the blocks that read a stream state's tensors sent back, summed as they come (the first
// kept as they are), until the node of the block that made the state takes them; and the zeros an
// unbundle node sent for a carrier nothing read, which that bundle node then drops. Shared by the state
// (a capsule, attnres_fx/routing/state.py's StreamState.holder) and both nodes. `deposits`: what the
// nodes reading an unbundle node's outputs deposited (Note [gradient deposits]), per backward (graph task
// id), until that backward's unbundle node takes them in with its other gradients (`add`).
struct StateGrads : torch::CustomClassHolder {
  std::mutex lock;
  std::vector<at::Tensor> grads;
  at::Tensor unread;
  std::vector<std::pair<int, std::vector<at::Tensor>>> deposits;

  // grads[k] += incoming[first + k] where defined, with this backward's deposits.
  void add(const std::vector<at::Tensor>& incoming, size_t first) {
    const std::lock_guard<std::mutex> guard(lock);
    std::vector<at::Tensor> sums(incoming.begin() + static_cast<std::ptrdiff_t>(first), incoming.end());
    const int task = torch::autograd::get_current_graph_task_id();
    const auto own = std::find_if(deposits.begin(), deposits.end(), [&](const auto& d) { return d.first == task; });
    if (own != deposits.end()) {
      std::vector<at::Tensor>& deposited = own->second;
      if (sums.size() < deposited.size()) sums.resize(deposited.size());
      for (size_t k = 0; k < deposited.size(); ++k) {
        if (!deposited[k].defined()) continue;
        sums[k] = sums[k].defined() ? deposited[k] + sums[k] : std::move(deposited[k]);
      }
      deposits.erase(own);
    }
    if (grads.empty()) {
      grads = std::move(sums);
      return;
    }
    if (grads.size() < sums.size()) grads.resize(sums.size());
    for (size_t k = 0; k < sums.size(); ++k) {
      if (!sums[k].defined()) continue;
      grads[k] = grads[k].defined() ? grads[k] + sums[k] : std::move(sums[k]);
    }
  }

  // This backward's deposit at `slot` so far, moved out (undefined where none), for the caller to add to
  // and give back (`deposit`). Lock held, for each of the two.
  at::Tensor withdraw(size_t slot) { return std::move(this_backwards(slot)[slot]); }

  void deposit(size_t slot, at::Tensor sum) { this_backwards(slot)[slot] = std::move(sum); }

  // This backward's deposits, with room for `slot`.
  std::vector<at::Tensor>& this_backwards(size_t slot) {
    const int task = torch::autograd::get_current_graph_task_id();
    auto own = std::find_if(deposits.begin(), deposits.end(), [&](const auto& d) { return d.first == task; });
    if (own == deposits.end()) own = deposits.emplace(deposits.end(), task, std::vector<at::Tensor>());
    if (own->second.size() <= slot) own->second.resize(slot + 1);
    return own->second;
  }

  std::vector<at::Tensor> take(size_t count) {
    const std::lock_guard<std::mutex> guard(lock);
    std::vector<at::Tensor> taken;
    taken.swap(grads);
    taken.resize(count);
    return taken;
  }
};

c10::intrusive_ptr<StateGrads> holder_of(torch::autograd::AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<StateGrads>(ctx->saved_data["grads"].toCapsule());
}

// A stream state's tensors, handed to UnbundleFunction outside its inputs: their gradients go to the
// holder, not along autograd edges of this node.
struct StateTensors {
  std::vector<at::Tensor> tensors;
};

// A block's view of the carrier it was given and of the state's tensors, all outputs of one node on the
// carrier. Backward: the state's gradients to the holder, the carrier's to the carrier (zeros where nothing
// read it, so that hooks on the carrier's gradient fire).
class UnbundleFunction : public torch::autograd::Function<UnbundleFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const c10::intrusive_ptr<StateGrads>& holder,
                                                const at::Tensor& carrier, const StateTensors& state) {
    ctx->saved_data["grads"] = c10::IValue::make_capsule(holder);
    ctx->saved_data["sizes"] = carrier.sizes().vec();
    ctx->saved_data["dtype"] = carrier.scalar_type();
    ctx->saved_data["device"] = carrier.device();
    ctx->set_materialize_grads(false);
    torch::autograd::variable_list out;
    out.reserve(state.tensors.size() + 1);
    out.push_back(carrier.view_as(carrier));
    for (const at::Tensor& t : state.tensors) out.push_back(t.view_as(t));
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto holder = holder_of(ctx);
    holder->add(grad_outputs, 1);
    at::Tensor grad_carrier = grad_outputs[0];
    if (!grad_carrier.defined()) {
      const auto options = at::TensorOptions()
                               .dtype(ctx->saved_data["dtype"].toScalarType())
                               .device(ctx->saved_data["device"].toDevice());
      grad_carrier = at::zeros({}, options).expand(ctx->saved_data["sizes"].toIntVector());
      const std::lock_guard<std::mutex> guard(holder->lock);
      holder->unread = grad_carrier;
    }
    return {at::Tensor(), grad_carrier, at::Tensor()};
  }
};

// Where a node deposits its gradient for each of its inputs (Note [gradient deposits]): the holder of the
// unbundle node whose output the input is, and that output's slot among the state's tensors; no holder
// for an input that is no such output.
struct Deposits : torch::CustomClassHolder {
  std::vector<c10::intrusive_ptr<StateGrads>> holders;
  std::vector<size_t> slots;

  // Input k's sum so far in this backward, moved out of its holder (undefined where none).
  at::Tensor withdraw(size_t k) const {
    const std::lock_guard<std::mutex> guard(holders[k]->lock);
    return holders[k]->withdraw(slots[k]);
  }

  void deposit(size_t k, at::Tensor sum) const {
    const std::lock_guard<std::mutex> guard(holders[k]->lock);
    holders[k]->deposit(slots[k], std::move(sum));
    ++deposits_made;
  }
};

// The deposits for `inputs`, or null where none is an unbundle node's output of a state tensor. An output
// given twice deposits once (its first place), so that its sum is withdrawn once at a time.
c10::intrusive_ptr<Deposits> deposits_for(at::TensorList inputs) {
  c10::intrusive_ptr<Deposits> found;
  for (size_t k = 0; k < inputs.size(); ++k) {
    const auto& fn = inputs[k].grad_fn();
    auto* node = dynamic_cast<torch::autograd::CppNode<UnbundleFunction>*>(fn.get());
    if (node == nullptr || inputs[k].output_nr() == 0) continue;  // output 0: the carrier
    auto holder = holder_of(&node->ctx_);
    const size_t slot = inputs[k].output_nr() - 1;
    if (!found) {
      found = c10::make_intrusive<Deposits>();
      found->holders.resize(inputs.size());
      found->slots.resize(inputs.size());
    }
    bool twice = false;
    for (size_t j = 0; j < k; ++j) twice = twice || (found->holders[j] == holder && found->slots[j] == slot);
    if (twice) continue;
    found->holders[k] = std::move(holder);
    found->slots[k] = slot;
  }
  return found;
}

void keep_deposits(torch::autograd::AutogradContext* ctx, at::TensorList inputs) {
  if (auto deposits = deposits_for(inputs)) ctx->saved_data["deposits"] = c10::IValue::make_capsule(deposits);
}

// The node's deposits where this backward may make them (Note [gradient deposits]), else null.
c10::intrusive_ptr<Deposits> deposits_now(torch::autograd::AutogradContext* ctx) {
  const auto kept = ctx->saved_data.find("deposits");
  if (kept == ctx->saved_data.end() || at::GradMode::is_enabled()) return {};
  const auto* runs = torch::autograd::get_current_graph_task_exec_info();
  if (runs == nullptr || !runs->empty()) return {};  // a backward that runs only some of the nodes
  return c10::static_intrusive_pointer_cast<Deposits>(kept->second.toCapsule());
}

// The carrier a block returns, its state's tensors inputs too (a new tensor sharing the carrier's storage,
// no view of it). Backward: the carrier's gradient (none where it is the unread zeros), and what the
// following blocks sent back for the tensors, deposited where a tensor is the block's view of a state
// tensor (Note [gradient deposits]).
class BundleFunction : public torch::autograd::Function<BundleFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const c10::intrusive_ptr<StateGrads>& holder,
                            const at::Tensor& carrier, at::TensorList tensors) {
    ctx->saved_data["grads"] = c10::IValue::make_capsule(holder);
    ctx->saved_data["count"] = static_cast<int64_t>(tensors.size());
    ctx->set_materialize_grads(false);
    keep_deposits(ctx, tensors);
    return carrier.detach();
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto holder = holder_of(ctx);
    at::Tensor grad = grad_outputs[0];
    {
      const std::lock_guard<std::mutex> guard(holder->lock);
      if (grad.defined() && holder->unread.defined() && grad.is_same(holder->unread)) {
        grad = at::Tensor();  // nothing read the carrier: no pass over these zeros in the block's adds
        holder->unread = at::Tensor();
      }
    }
    std::vector<at::Tensor> taken = holder->take(static_cast<size_t>(ctx->saved_data["count"].toInt()));
    if (const auto deposits = deposits_now(ctx)) {
      for (size_t k = 0; k < taken.size(); ++k) {
        if (!deposits->holders[k] || !taken[k].defined()) continue;
        const at::Tensor sum = deposits->withdraw(k);
        deposits->deposit(k, sum.defined() ? sum + taken[k] : std::move(taken[k]));
        taken[k] = at::Tensor();
      }
    }
    torch::autograd::variable_list out;
    out.reserve(taken.size() + 2);
    out.emplace_back();  // the holder
    out.push_back(std::move(grad));
    for (at::Tensor& t : taken) out.push_back(std::move(t));
    return out;
  }
};

// The aggregation (and the fused norm, where `out_norm_weight` is defined: the RMS norm, or with `centred`
// the layer norm, its bias aside) in differentiable ATen ops,
// the arithmetic of attnres_fx/op/aggregation.py's `fusable` (negligible weights zero, their gradients
// too): what a backward that records its own graph (create_graph=True, gradients of gradients)
// differentiates, the kernels' backward having no derivative of its own.
at::Tensor differentiable_aggregate(const std::vector<at::Tensor>& sources, const at::Tensor& proj_weight,
                                    const at::Tensor& norm_weight, double eps, bool preserve_scale,
                                    const at::Tensor& out_norm_weight, double out_norm_eps, bool centred) {
  const at::Tensor query = proj_weight.reshape({-1}).to(at::kFloat) * norm_weight.to(at::kFloat);
  std::vector<at::Tensor> values, logits;
  for (const auto& source : sources) {
    const at::Tensor value = source.to(at::kFloat);
    const at::Tensor scale = at::rsqrt(value.square().mean({-1}, true) + eps);
    logits.push_back(at::matmul(value, query).unsqueeze(-1) * scale);
    values.push_back(value);
  }
  at::Tensor top = logits[0];
  for (size_t k = 1; k < logits.size(); ++k) top = at::maximum(top, logits[k]);
  std::vector<at::Tensor> exps;
  at::Tensor total;
  for (const auto& logit : logits) {
    const at::Tensor e = at::exp(logit - top);
    exps.push_back(at::where(e < kNegligibleWeight, at::zeros_like(e), e));
    total = total.defined() ? total + exps.back() : exps.back();
  }
  const at::Tensor inverse = (preserve_scale ? static_cast<double>(sources.size()) : 1.0) / total;
  at::Tensor out = exps[0] * inverse * values[0];
  for (size_t k = 1; k < values.size(); ++k) out = out + exps[k] * inverse * values[k];
  if (out_norm_weight.defined() && centred) {
    out = at::layer_norm(out, {out.size(-1)}, out_norm_weight.to(at::kFloat), {}, out_norm_eps);
  } else if (out_norm_weight.defined()) {
    out = out * at::rsqrt(out.square().mean({-1}, true) + out_norm_eps) * out_norm_weight.to(at::kFloat);
  }
  return out.to(sources[0].scalar_type());
}

// The operator's gradient, registered here (Autograd key) rather than in Python: a training step calls
// the aggregation at every site, and a Python autograd Function costs tens of microseconds per call and
// per backward, a third of what the aggregation added to a narrow model's step. The maths is
// aggregate_backward's (Note [backward] of attnres_fx/op/aggregation.py). Saved, through save_for_backward
// (so saved_tensors_hooks, activation offloading and checkpointing see them): the inputs, and the logits'
// parts, q . v and the key scale of each token and source (2 / D of the sources' size), with which the
// backward's first look at each source row sums g . v alone instead of three sums: a third of the
// backward's arithmetic. Also aggregate_normed's node, given the norm's weight (a site and the RMS or layer
// norm that alone reads its result, attnres_fx/passes/fuse_norms.py): it keeps that weight besides, and not
// the rows between the aggregation and the norm, which its backward recomputes from the sources
// (aggregate_normed_backward_saved), where the norm's own node would keep its input, a stream tensor.
class AggregateFunction : public torch::autograd::Function<AggregateFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList sources,
                            const at::Tensor& proj_weight, const at::Tensor& norm_weight, double eps,
                            bool preserve_scale, const std::optional<at::Tensor>& out_norm_weight,
                            double out_norm_eps, const std::optional<at::Tensor>& out_norm_bias,
                            bool out_norm_centred) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const bool normed = out_norm_weight.has_value();
    auto [out, logits] = normed ? normed_saving_op().call(sources, proj_weight, norm_weight, eps, preserve_scale,
                                                          *out_norm_weight, out_norm_eps, out_norm_bias,
                                                          out_norm_centred)
                                : saving_op().call(sources, proj_weight, norm_weight, eps, preserve_scale);
    std::vector<at::Tensor> saved(sources.begin(), sources.end());
    saved.push_back(logits);
    saved.push_back(proj_weight);
    saved.push_back(norm_weight);
    if (normed) saved.push_back(*out_norm_weight);
    ctx->save_for_backward(saved);
    ctx->saved_data["normed"] = normed;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["preserve_scale"] = preserve_scale;
    ctx->saved_data["out_norm_eps"] = out_norm_eps;
    ctx->saved_data["out_norm_centred"] = out_norm_centred;
    ctx->saved_data["out_norm_biased"] = out_norm_bias.has_value();
    keep_deposits(ctx, sources);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto saved = ctx->get_saved_variables();
    const bool normed = ctx->saved_data["normed"].toBool();
    at::Tensor out_norm_weight;
    if (normed) {
      out_norm_weight = saved.back();
      saved.pop_back();
    }
    const at::Tensor norm_weight = saved.back();
    saved.pop_back();
    const at::Tensor proj_weight = saved.back();
    saved.pop_back();
    const at::Tensor logits = saved.back();
    saved.pop_back();
    const size_t K = saved.size();
    const double eps = ctx->saved_data["eps"].toDouble();
    const bool preserve_scale = ctx->saved_data["preserve_scale"].toBool();
    const double out_norm_eps = ctx->saved_data["out_norm_eps"].toDouble();
    const bool centred = ctx->saved_data["out_norm_centred"].toBool();
    const bool biased = ctx->saved_data["out_norm_biased"].toBool();
    if (at::GradMode::is_enabled() && grad_outputs[0].defined()) {
      // A backward recording its graph (create_graph=True): the gradients of the ATen formulation, with
      // theirs. The kernels' backward would give gradients without a derivative (zero gradients of gradients).
      // Each input through an alias of its own: a source computed from another (a block's sum from the
      // blocks before it) would otherwise get, through that other, the total derivative, not its own.
      std::vector<at::Tensor> inputs(saved);
      inputs.push_back(proj_weight);
      inputs.push_back(norm_weight);
      if (normed) inputs.push_back(out_norm_weight);
      std::vector<at::Tensor> aliases, wanted;
      for (const auto& input : inputs) {
        aliases.push_back(input.requires_grad() ? input.view_as(input) : input);
        if (input.requires_grad()) wanted.push_back(aliases.back());
      }
      const std::vector<at::Tensor> sources(aliases.begin(), aliases.begin() + K);
      const at::Tensor out = differentiable_aggregate(sources, aliases[K], aliases[K + 1], eps, preserve_scale,
                                                      normed ? aliases[K + 2] : at::Tensor(), out_norm_eps, centred);
      const auto grads = wanted.empty() ? torch::autograd::variable_list()
                                        : torch::autograd::grad({out}, wanted, {grad_outputs[0]}, true, true, true);
      std::vector<at::Tensor> per_input(inputs.size());  // undefined where no gradient is asked
      for (size_t i = 0, next = 0; i < inputs.size(); ++i) {
        if (inputs[i].requires_grad()) per_input[i] = grads[next++];
      }
      torch::autograd::variable_list result(per_input.begin(), per_input.begin() + K + 2);  // sources, proj, norm
      result.resize(K + 4);                                        // eps, preserve_scale
      result.push_back(normed ? per_input[K + 2] : at::Tensor());  // out_norm_weight
      result.emplace_back();                                       // out_norm_eps
      // A bias after the norm: its gradient is the result's, summed over the tokens.
      result.push_back(biased && ctx->needs_input_grad(K + 3)
                           ? grad_outputs[0].reshape({-1, grad_outputs[0].size(-1)}).sum(0)
                           : at::Tensor());
      result.emplace_back();  // out_norm_centred
      return result;
    }
    // Below autograd where no graph of the backward is recorded (create_graph=False, the usual case): the
    // operators have no Autograd kernel, and the fallback that would otherwise run for each of them boxes
    // every argument to check that none requires a gradient. With a graph recorded, that fallback marks
    // the results as not differentiable twice.
    std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
    if (!at::GradMode::is_enabled()) below_autograd.emplace();
    std::vector<at::Tensor> grads;
    at::Tensor grad_query, grad_out_norm_weight, grad_out_norm_bias;
    auto deposits = deposits_now(ctx);
    if (deposits) {
      std::vector<at::Tensor> read(saved);
      read.push_back(grad_outputs[0]);
      read.push_back(logits);
      if (normed) read.push_back(out_norm_weight);
      if (!dispatches_to_kernel(read, proj_weight, norm_weight)) deposits.reset();
    }
    if (deposits) {
      // Each deposited source's dL/dv added to its sum so far by the kernel (Note [gradient deposits]).
      std::vector<at::Tensor> into(K);
      for (size_t k = 0; k < K; ++k) {
        if (deposits->holders[k]) into[k] = deposits->withdraw(k);
      }
      std::tie(grads, grad_query) = attnres_cpu::backward(grad_outputs[0], saved, logits, proj_weight, norm_weight,
                                                          eps, preserve_scale, &into, out_norm_weight, out_norm_eps,
                                                          &grad_out_norm_weight, centred, &grad_out_norm_bias);
      into.clear();  // the sums written over are referenced by `grads` alone again
      for (size_t k = 0; k < K; ++k) {
        if (!deposits->holders[k]) continue;
        deposits->deposit(k, std::move(grads[k]));
        grads[k] = at::Tensor();
      }
    } else if (normed) {
      std::tie(grads, grad_query, grad_out_norm_weight, grad_out_norm_bias) = normed_backward_op().call(
          grad_outputs[0], saved, logits, proj_weight, norm_weight, eps, preserve_scale, out_norm_weight, out_norm_eps,
          centred);
    } else {
      std::tie(grads, grad_query) =
          backward_op().call(grad_outputs[0], saved, logits, proj_weight, norm_weight, eps, preserve_scale);
    }
    torch::autograd::variable_list out(grads.begin(), grads.end());
    const bool wants_proj = ctx->needs_input_grad(K), wants_norm = ctx->needs_input_grad(K + 1);
    if (wants_proj || wants_norm) {
      auto [grad_proj, grad_norm] = weight_grads_op().call(grad_query, proj_weight, norm_weight);
      out.push_back(wants_proj ? grad_proj : at::Tensor());
      out.push_back(wants_norm ? grad_norm : at::Tensor());
    } else {
      out.emplace_back();
      out.emplace_back();
    }
    out.emplace_back();  // eps
    out.emplace_back();  // preserve_scale
    out.push_back(normed && ctx->needs_input_grad(K + 2) ? grad_out_norm_weight : at::Tensor());  // its edge: K + 2
    out.emplace_back();  // out_norm_eps
    out.push_back(biased && ctx->needs_input_grad(K + 3) ? grad_out_norm_bias : at::Tensor());  // its edge: K + 3
    out.emplace_back();  // out_norm_centred
    return out;
  }
};

at::Tensor aggregate_autograd(at::TensorList sources, const at::Tensor& proj_weight, const at::Tensor& norm_weight,
                              double eps, bool preserve_scale) {
  bool wants_grad = false;
  if (at::GradMode::is_enabled()) {
    wants_grad = proj_weight.requires_grad() || norm_weight.requires_grad();
    for (const auto& s : sources) wants_grad = wants_grad || s.requires_grad();
  }
  if (!wants_grad) {  // no graph to record: the kernel alone (a decoding step's budget is microseconds)
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return aggregate_op().call(sources, proj_weight, norm_weight, eps, preserve_scale);
  }
  return AggregateFunction::apply(sources, proj_weight, norm_weight, eps, preserve_scale, std::nullopt, 0.0,
                                  std::nullopt, false);
}

at::Tensor aggregate_normed_autograd(at::TensorList sources, const at::Tensor& proj_weight,
                                    const at::Tensor& norm_weight, double eps, bool preserve_scale,
                                    const at::Tensor& out_norm_weight, double out_norm_eps,
                                    const std::optional<at::Tensor>& out_norm_bias, bool out_norm_centred) {
  bool wants_grad = false;
  if (at::GradMode::is_enabled()) {
    wants_grad = proj_weight.requires_grad() || norm_weight.requires_grad() || out_norm_weight.requires_grad() ||
                 (out_norm_bias.has_value() && out_norm_bias->requires_grad());
    for (const auto& s : sources) wants_grad = wants_grad || s.requires_grad();
  }
  if (!wants_grad) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return normed_op().call(sources, proj_weight, norm_weight, eps, preserve_scale, out_norm_weight, out_norm_eps,
                            out_norm_bias, out_norm_centred);
  }
  TORCH_CHECK(!sources.empty() && sources[0].scalar_type() == at::kFloat,
              "attnres_cpu::aggregate_normed records a gradient for float32 sources only, got ",
              sources.empty() ? "no sources" : c10::toString(sources[0].scalar_type()),
              ": call attnres_cpu::aggregate and the norm apart");
  return AggregateFunction::apply(sources, proj_weight, norm_weight, eps, preserve_scale,
                                  std::optional<at::Tensor>(out_norm_weight), out_norm_eps, out_norm_bias,
                                  out_norm_centred);
}

}  // namespace attnres_cpu

TORCH_LIBRARY(attnres_cpu, m) {
  m.def("aggregate(Tensor[] sources, Tensor proj_weight, Tensor norm_weight, float eps, bool preserve_scale) -> Tensor");
  m.def("aggregate_backward(Tensor grad, Tensor[] sources, Tensor proj_weight, Tensor norm_weight, float eps, "
        "bool preserve_scale) -> (Tensor[], Tensor)");
  m.def("aggregate_saving_logits(Tensor[] sources, Tensor proj_weight, Tensor norm_weight, float eps, "
        "bool preserve_scale) -> (Tensor, Tensor)");
  m.def("aggregate_backward_saved(Tensor grad, Tensor[] sources, Tensor saved, Tensor proj_weight, "
        "Tensor norm_weight, float eps, bool preserve_scale) -> (Tensor[], Tensor)");
  m.def("aggregate_normed(Tensor[] sources, Tensor proj_weight, Tensor norm_weight, float eps, bool preserve_scale, "
        "Tensor out_norm_weight, float out_norm_eps, Tensor? out_norm_bias=None, bool out_norm_centred=False) -> "
        "Tensor");
  m.def("aggregate_normed_saving_logits(Tensor[] sources, Tensor proj_weight, Tensor norm_weight, float eps, "
        "bool preserve_scale, Tensor out_norm_weight, float out_norm_eps, Tensor? out_norm_bias=None, "
        "bool out_norm_centred=False) -> (Tensor, Tensor)");
  m.def("aggregate_normed_backward_saved(Tensor grad, Tensor[] sources, Tensor saved, Tensor proj_weight, "
        "Tensor norm_weight, float eps, bool preserve_scale, Tensor out_norm_weight, float out_norm_eps, "
        "bool out_norm_centred=False) -> (Tensor[], Tensor, Tensor, Tensor)");
  m.def("weight_grads(Tensor grad_query, Tensor proj_weight, Tensor norm_weight) -> (Tensor, Tensor)");
  m.def("phase1(Tensor[] blocks, Tensor[] proj_weights, Tensor[] norm_weights, float eps) -> (Tensor[], Tensor[], "
        "Tensor[])");
  m.def("phase2(Tensor acc, Tensor max, Tensor sum, Tensor partial, Tensor proj_weight, Tensor norm_weight, "
        "float eps, float scale, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnres_cpu, CPU, m) {
  m.impl("aggregate", &attnres_cpu::aggregate);
  m.impl("aggregate_backward", &attnres_cpu::aggregate_backward);
  m.impl("aggregate_saving_logits", &attnres_cpu::aggregate_saving_logits);
  m.impl("aggregate_normed", &attnres_cpu::aggregate_normed);
  m.impl("aggregate_normed_saving_logits", &attnres_cpu::aggregate_normed_saving_logits);
  m.impl("aggregate_normed_backward_saved", &attnres_cpu::aggregate_normed_backward_saved);
  m.impl("aggregate_backward_saved", &attnres_cpu::aggregate_backward_saved);
  m.impl("weight_grads", &attnres_cpu::weight_grads);
  m.impl("phase1", &attnres_cpu::phase1);
  m.impl("phase2", &attnres_cpu::phase2);
}

TORCH_LIBRARY_IMPL(attnres_cpu, Autograd, m) {
  m.impl("aggregate", &attnres_cpu::aggregate_autograd);
  m.impl("aggregate_normed", &attnres_cpu::aggregate_normed_autograd);
  // No backward: a gradient asked of its result is an error, not a silent zero.
  m.impl("aggregate_normed_saving_logits", torch::autograd::autogradNotImplementedFallback());
  m.impl("aggregate_normed_backward_saved", torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(attnres_cpu, Meta, m) {
  m.impl("aggregate", &attnres_cpu::aggregate_meta);
  m.impl("aggregate_backward", &attnres_cpu::aggregate_backward_meta);
  m.impl("aggregate_saving_logits", &attnres_cpu::aggregate_saving_logits_meta);
  m.impl("aggregate_normed", &attnres_cpu::aggregate_normed_meta);
  m.impl("aggregate_normed_saving_logits", &attnres_cpu::aggregate_normed_saving_logits_meta);
  m.impl("aggregate_normed_backward_saved", &attnres_cpu::aggregate_normed_backward_saved_meta);
  m.impl("aggregate_backward_saved", &attnres_cpu::aggregate_backward_saved_meta);
  m.impl("weight_grads", &attnres_cpu::weight_grads_meta);
}


// ------------------------------------------------------------------------------------- Python entries
// Functions for Python callers, written against CPython's vectorcall convention (METH_FASTCALL)
// rather than pybind11, whose argument conversion and exception set-up cost some 5 K instructions a
// call (a decoding step makes two aggregations a block, each a few microseconds of arithmetic):
//
//   aggregate(sources, proj_weight, norm_weight, eps, preserve_scale)
//       The dispatcher call torch.ops.attnres_cpu.aggregate makes (autograd and dispatch modes
//       included) without that path's boxing of every argument against the schema. For tensors
//       without __torch_function__ (the caller checks).
//   run_site(site_class, module, entered, sources)
//       attnres_fx/op/module.py's run_site where nothing but the operator is needed: `module` is
//       exactly `site_class` (BlockAttnRes), has no hook of its own or global (the dicts `configure`
//       named) and no instance `forward`, its weights are plain parameters, every source is a plain
//       CPU tensor and no __torch_function__ mode is active. Then the operator's result; else None,
//       and the caller takes its Python path, which handles everything else (including the errors).
//
// Both release the GIL around the operator, as torch.ops does, for all but the smallest calls.
namespace {

// What `configure` was given, and interned names; kept in the module object's state.
struct EntryState {
  PyObject* hook_names;    // tuple of str: instance attributes holding a module's hook dicts
  PyObject* global_hooks;  // tuple of dict: the process-wide module hooks
  PyObject* modules;       // "_modules"
  PyObject* parameters;    // "_parameters"
  PyObject* forward;       // "forward"
  PyObject* proj;          // "proj"
  PyObject* norm;          // "norm"
  PyObject* weight;        // "weight"
  PyObject* eps;           // "eps"
  PyObject* preserve_scale;  // "preserve_scale"
  PyObject* holder;          // "holder"
  PyObject* grads;           // "grads"
  PyObject* unread;          // "unread"
};

EntryState* entry_state(PyObject* self) {
  return static_cast<EntryState*>(PyModule_GetState(self));
}

// Borrowed: the item `name` of `object`'s instance dict, or nullptr.
PyObject* instance_item(PyObject* object, PyObject* name) {
  PyObject* dict = PyObject_GenericGetDict(object, nullptr);
  if (dict == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  PyObject* item = PyDict_GetItemWithError(dict, name);
  Py_DECREF(dict);  // the object keeps its dict, and the dict its item
  return item;
}

bool empty_dict(PyObject* object) {
  return object != nullptr && PyDict_Check(object) && PyDict_GET_SIZE(object) == 0;
}

// A plain tensor (torch.Tensor or nn.Parameter, no subclass) on the CPU.
bool plain_cpu_tensor(PyObject* object) {
  return THPVariable_CheckExact(object) && THPVariable_Unpack(object).is_cpu();
}

// The GIL released for a scope, with CPython's own calls (pybind11's gil_scoped_release looks up its
// internals first: some 3.8 K instructions a call from this library).
class ReleasedGil {
 public:
  ReleasedGil() : state_(PyEval_SaveThread()) {}
  ~ReleasedGil() { PyEval_RestoreThread(state_); }
  ReleasedGil(const ReleasedGil&) = delete;
  ReleasedGil& operator=(const ReleasedGil&) = delete;

 private:
  PyThreadState* state_;
};

// Below this many source elements in all, a call keeps the GIL: handing it over and taking it back (some
// 2.5 K instructions, two mutexes and a condition variable) costs more than another thread could do
// meanwhile (a decoding step's aggregation of one token is about a microsecond of arithmetic).
constexpr int64_t kReleaseGilElements = 1 << 15;

// The sources of one call, read from their Python objects without a reference of their own: a copy of a
// tensor that only its Python object holds takes a reference to that object through the interpreter (the
// GIL taken again: some 600 instructions a tensor, as many to let it go), several a decoding step's
// aggregation. The Python objects that hold them (the call's arguments) keep them alive while the GIL is
// held; a call that releases it owns them instead (run_operator).
class BorrowedSources {
 public:
  BorrowedSources() { tensors_.reserve(8); }
  ~BorrowedSources() {
    for (at::Tensor& tensor : tensors_) c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(tensor);
  }
  BorrowedSources(const BorrowedSources&) = delete;
  BorrowedSources& operator=(const BorrowedSources&) = delete;

  void push(const at::Tensor& tensor) {
    tensors_.push_back(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(tensor));
  }
  const std::vector<at::Tensor>& tensors() const { return tensors_; }

 private:
  std::vector<at::Tensor> tensors_;
};

at::Tensor run_operator(const BorrowedSources& borrowed, const at::Tensor& proj_weight,
                        const at::Tensor& norm_weight, double eps, bool preserve_scale) {
  const std::vector<at::Tensor>& sources = borrowed.tensors();
  if (!sources.empty() && sources[0].numel() * static_cast<int64_t>(sources.size()) < kReleaseGilElements) {
    if (attnres_cpu::dispatches_to_kernel(sources, proj_weight, norm_weight)) {
      return attnres_cpu::aggregate(sources, proj_weight, norm_weight, eps, preserve_scale);
    }
    return attnres_cpu::aggregate_op().call(sources, proj_weight, norm_weight, eps, preserve_scale);
  }
  // Owned while another thread may run (and change the lists that held them); let go with the GIL held.
  const std::vector<at::Tensor> owned(sources.begin(), sources.end());
  const at::Tensor proj(proj_weight), norm(norm_weight);
  ReleasedGil no_gil;
  return attnres_cpu::aggregate_op().call(owned, proj, norm, eps, preserve_scale);
}

// run_operator for attnres_cpu::aggregate_normed (`out_bias` undefined: none).
at::Tensor run_normed_operator(const BorrowedSources& borrowed, const at::Tensor& proj_weight,
                               const at::Tensor& norm_weight, double eps, bool preserve_scale,
                               const at::Tensor& out_weight, double out_eps, const at::Tensor& out_bias,
                               bool centred) {
  const std::vector<at::Tensor>& sources = borrowed.tensors();
  const std::optional<at::Tensor> bias = out_bias.defined() ? std::optional<at::Tensor>(out_bias) : std::nullopt;
  if (sources[0].numel() * static_cast<int64_t>(sources.size()) < kReleaseGilElements) {
    if (attnres_cpu::dispatches_to_kernel(sources, proj_weight, norm_weight)) {
      return attnres_cpu::aggregate_normed(sources, proj_weight, norm_weight, eps, preserve_scale, out_weight, out_eps,
                                           bias, centred);
    }
    return attnres_cpu::normed_op().call(sources, proj_weight, norm_weight, eps, preserve_scale, out_weight, out_eps,
                                         bias, centred);
  }
  const std::vector<at::Tensor> owned(sources.begin(), sources.end());
  const at::Tensor proj(proj_weight), norm(norm_weight), weight(out_weight);
  ReleasedGil no_gil;
  return attnres_cpu::normed_op().call(owned, proj, norm, eps, preserve_scale, weight, out_eps, bias, centred);
}

PyObject* python_aggregate(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 5 || !PyList_Check(args[0]) || !THPVariable_Check(args[1]) || !THPVariable_Check(args[2]) ||
      !PyFloat_Check(args[3]) || !PyBool_Check(args[4])) {
    PyErr_SetString(PyExc_TypeError,
                    "aggregate(sources: list[Tensor], proj_weight: Tensor, norm_weight: Tensor, eps: float, "
                    "preserve_scale: bool)");
    return nullptr;
  }
  const Py_ssize_t count = PyList_GET_SIZE(args[0]);
  BorrowedSources sources;
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* item = PyList_GET_ITEM(args[0], i);
    if (!THPVariable_Check(item)) {
      PyErr_SetString(PyExc_TypeError, "aggregate: every source must be a tensor");
      return nullptr;
    }
    sources.push(THPVariable_Unpack(item));
  }
  return THPVariable_Wrap(run_operator(sources, THPVariable_Unpack(args[1]), THPVariable_Unpack(args[2]),
                                       PyFloat_AS_DOUBLE(args[3]), args[4] == Py_True));
  END_HANDLE_TH_ERRORS
}

// Borrowed: module.<child>._parameters["weight"] where it is a plain CPU tensor, else nullptr.
PyObject* child_weight(const EntryState& names, PyObject* children, PyObject* child_name) {
  PyObject* child = PyDict_GetItemWithError(children, child_name);
  if (child == nullptr) return nullptr;
  PyObject* parameters = instance_item(child, names.parameters);
  if (parameters == nullptr || !PyDict_Check(parameters)) return nullptr;
  PyObject* weight = PyDict_GetItemWithError(parameters, names.weight);
  return weight != nullptr && plain_cpu_tensor(weight) ? weight : nullptr;
}

// Appends the tensors of a tuple or list, borrowed; false where one is not a plain tensor (torch.Tensor or
// nn.Parameter, no subclass), or not on the CPU where `cpu_only`.
bool append_plain(PyObject* sequence, BorrowedSources& out, bool cpu_only) {
  if (!PyTuple_Check(sequence) && !PyList_Check(sequence)) return false;
  const Py_ssize_t count = PySequence_Fast_GET_SIZE(sequence);
  PyObject** items = PySequence_Fast_ITEMS(sequence);
  for (Py_ssize_t i = 0; i < count; ++i) {
    if (!(cpu_only ? plain_cpu_tensor(items[i]) : THPVariable_CheckExact(items[i]))) return false;
    out.push(THPVariable_Unpack(items[i]));
  }
  return true;
}

// Whether a module's call runs nothing but its class's forward: no instance `forward`, no hook of its own
// (the dicts `configure` named). `dict`: the module's instance dict.
bool runs_plain_forward(const EntryState& names, PyObject* dict) {
  if (PyDict_GetItemWithError(dict, names.forward) != nullptr) return false;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names.hook_names); ++i) {
    if (!empty_dict(PyDict_GetItemWithError(dict, PyTuple_GET_ITEM(names.hook_names, i)))) return false;
  }
  return true;
}

// The module's instance dict, borrowed: the module keeps it alive for the rest of the call (the GIL is
// held until the operator runs, and the values read from it are copied into tensors or doubles by then).
PyObject* borrowed_dict(PyObject* module) {
  PyObject* dict = PyObject_GenericGetDict(module, nullptr);
  if (dict != nullptr) Py_DECREF(dict);
  return dict;
}

// What run_site's C path takes of a site: its module's weights (borrowed), eps and preserve_scale; the
// sources go to a BorrowedSources the caller holds.
struct SiteOperands {
  PyObject* proj = nullptr;
  PyObject* norm = nullptr;
  double eps = 0.0;
  bool preserve_scale = false;
};

// Whether run_site's C path may aggregate `module`'s sources (`entered`, then `given`), filling `site` and
// `sources`; false (with a Python error set only where reading an attribute raised) where it may not.
bool site_operands(const EntryState& names, PyObject* site_class, PyObject* module, PyObject* entered,
                   PyObject* given, SiteOperands& site, BorrowedSources& sources) {
  if (names.hook_names == nullptr || reinterpret_cast<PyObject*>(Py_TYPE(module)) != site_class ||
      at::impl::torch_function_mode_enabled()) {
    return false;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names.global_hooks); ++i) {
    if (PyDict_GET_SIZE(PyTuple_GET_ITEM(names.global_hooks, i)) != 0) return false;
  }
  PyObject* dict = borrowed_dict(module);
  if (dict == nullptr || !runs_plain_forward(names, dict)) return false;
  PyObject* children = PyDict_GetItemWithError(dict, names.modules);
  PyObject* eps = PyDict_GetItemWithError(dict, names.eps);
  PyObject* preserve_scale = PyDict_GetItemWithError(dict, names.preserve_scale);
  if (children == nullptr || !PyDict_Check(children) || eps == nullptr || !PyFloat_Check(eps) ||
      preserve_scale == nullptr || !PyBool_Check(preserve_scale)) {
    return false;
  }
  site.proj = child_weight(names, children, names.proj);
  site.norm = site.proj == nullptr ? nullptr : child_weight(names, children, names.norm);
  site.eps = PyFloat_AS_DOUBLE(eps);
  site.preserve_scale = preserve_scale == Py_True;
  return site.norm != nullptr && append_plain(entered, sources, true) && append_plain(given, sources, true) &&
         !sources.tensors().empty();
}

PyObject* python_run_site(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "run_site(site_class, module, entered, sources)");
    return nullptr;
  }
  SiteOperands site;
  BorrowedSources sources;
  if (!site_operands(*entry_state(self), args[0], args[1], args[2], args[3], site, sources)) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  try {
    return THPVariable_Wrap(run_operator(sources, THPVariable_Unpack(site.proj), THPVariable_Unpack(site.norm),
                                         site.eps, site.preserve_scale));
  } catch (const c10::Error&) {
    Py_RETURN_NONE;  // sources the operator refuses (mixed shapes or dtypes): the Python path decides
  }
  END_HANDLE_TH_ERRORS
}

//   run_site_normed(site_class, module, entered, sources, norm, norm_class, norm_forward, weight_name, eps_name,
//                   weight_offset, bias_name, centred)
//       attnres_fx/op/module.py's site_normed: norm(run_site(module, entered, *sources)) as one operator call
//       (attnres_cpu::aggregate_normed; where a gradient is recorded, one AggregateFunction node)
//       where run_site's C path would run, `norm` is exactly `norm_class`, whose forward is still
//       `norm_forward` (the norm that was matched), without hooks or an instance forward, its parameter
//       `weight_name` and its float attribute `eps_name` in place, and sources and weight are fp32 (where the
//       fused norm rounds as the module does); else None. The norm scales by weight + weight_offset (a float;
//       Gemma's 1 + weight), added as the module adds it, in fp32 (its own node where a gradient is recorded).
//       With `centred` (a bool) the norm is a layer norm, plus its parameter `bias_name` where that is a str
//       (None: it has none): a module without that parameter in place is declined.
PyObject* python_run_site_normed(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 12 || !PyUnicode_Check(args[7]) || !PyUnicode_Check(args[8]) || !PyFloat_Check(args[9]) ||
      !(args[10] == Py_None || PyUnicode_Check(args[10])) || !PyBool_Check(args[11])) {
    PyErr_SetString(PyExc_TypeError, "run_site_normed(site_class, module, entered, sources, norm, norm_class, "
                                     "norm_forward, weight_name: str, eps_name: str, weight_offset: float, "
                                     "bias_name: str | None, centred: bool)");
    return nullptr;
  }
  if (reinterpret_cast<PyObject*>(Py_TYPE(args[4])) != args[5]) Py_RETURN_NONE;
  const EntryState& names = *entry_state(self);
  SiteOperands site;
  BorrowedSources sources;
  if (!site_operands(names, args[0], args[1], args[2], args[3], site, sources)) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  PyObject* dict = borrowed_dict(args[4]);
  if (dict == nullptr || !runs_plain_forward(names, dict)) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  PyObject* forward = PyObject_GetAttr(args[5], names.forward);
  if (forward == nullptr) return nullptr;
  Py_DECREF(forward);  // the class keeps it; only its identity is read
  PyObject* parameters = PyDict_GetItemWithError(dict, names.parameters);
  PyObject* weight = parameters != nullptr && PyDict_Check(parameters) ? PyDict_GetItemWithError(parameters, args[7])
                                                                        : nullptr;
  PyObject* bias = args[10] != Py_None && parameters != nullptr && PyDict_Check(parameters)
                       ? PyDict_GetItemWithError(parameters, args[10])
                       : nullptr;
  PyObject* eps = PyDict_GetItemWithError(dict, args[8]);
  if (PyErr_Occurred()) return nullptr;
  if (forward != args[6] || weight == nullptr || !plain_cpu_tensor(weight) || eps == nullptr || !PyFloat_Check(eps) ||
      (args[10] != Py_None && (bias == nullptr || !plain_cpu_tensor(bias)))) {
    Py_RETURN_NONE;
  }
  const at::Tensor& out_weight = THPVariable_Unpack(weight);
  const at::Tensor out_bias = bias != nullptr ? THPVariable_Unpack(bias) : at::Tensor();
  const at::Tensor& first = sources.tensors()[0];
  const auto fits = [&](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 1 && t.numel() == first.size(-1);
  };
  if (first.scalar_type() != at::kFloat || first.dim() == 0 || !fits(out_weight) ||
      (out_bias.defined() && !fits(out_bias))) {
    Py_RETURN_NONE;
  }
  try {
    const double offset = PyFloat_AS_DOUBLE(args[9]);
    // With gradients recorded, one autograd node for both (AggregateFunction).
    return THPVariable_Wrap(run_normed_operator(sources, THPVariable_Unpack(site.proj), THPVariable_Unpack(site.norm),
                                                site.eps, site.preserve_scale,
                                                offset == 0.0 ? out_weight : out_weight + offset,
                                                PyFloat_AS_DOUBLE(eps), out_bias, args[11] == Py_True));
  } catch (const c10::Error&) {
    Py_RETURN_NONE;  // sources the operator refuses (mixed shapes or dtypes): the Python path decides
  }
  END_HANDLE_TH_ERRORS
}

// ------------------------------------------------------------------------------------- stream edges
//   bundle(state, carrier, tensors) / unbundle(state, carrier, tensors)
//       attnres_fx/routing/state.py's bundle and unbundle: the carrier alone (bundle) or the carrier and
//       `tensors` as they are (unbundle) where no gradient is recorded; else the node's output(s), with
//       the state's gradient holder (its attribute `holder`, made here where it is None). None where an
//       argument is not a plain tensor (a subclass: the Python Functions take it).
//   add_grads(holder, grads) / take_grads(holder, count)
//       StreamState's, for a state whose gradients the holder keeps.
constexpr const char* kHolderCapsule = "attnres_fx.StateGrads";

void release_holder(PyObject* capsule) {
  auto* raw = static_cast<attnres_cpu::StateGrads*>(PyCapsule_GetPointer(capsule, kHolderCapsule));
  if (raw != nullptr) c10::intrusive_ptr<attnres_cpu::StateGrads>::reclaim(raw);  // drops the capsule's share
}

c10::intrusive_ptr<attnres_cpu::StateGrads> unpack_holder(PyObject* capsule) {
  auto* raw = static_cast<attnres_cpu::StateGrads*>(PyCapsule_GetPointer(capsule, kHolderCapsule));
  if (raw == nullptr) throw python_error();
  return c10::intrusive_ptr<attnres_cpu::StateGrads>::reclaim_copy(raw);
}

// Moves what a Python node kept for the state (`state.grads`, `state.unread`) into a holder made for it: a
// block whose node is Python (its carrier a tensor subclass, or recomputed by reentrant checkpointing in
// its backward) sent gradients before the node that made the state took the C++ path.
void adopt_python_grads(const EntryState& names, PyObject* state, attnres_cpu::StateGrads& holder) {
  PyObject* grads = PyObject_GetAttr(state, names.grads);
  if (grads == nullptr) throw python_error();
  const bool kept = (PyList_Check(grads) || PyTuple_Check(grads)) && PySequence_Fast_GET_SIZE(grads) > 0;
  if (kept) {
    std::vector<at::Tensor> tensors;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(grads); ++i) {
      PyObject* item = PySequence_Fast_GET_ITEM(grads, i);
      tensors.push_back(THPVariable_Check(item) ? THPVariable_Unpack(item) : at::Tensor());
    }
    holder.add(tensors, 0);
  }
  Py_DECREF(grads);
  PyObject* unread = PyObject_GetAttr(state, names.unread);
  if (unread == nullptr) throw python_error();
  if (THPVariable_Check(unread)) holder.unread = THPVariable_Unpack(unread);
  Py_DECREF(unread);
  if (kept) {
    PyObject* none_kept = PyTuple_New(0);
    const int failed = none_kept == nullptr ? -1 : PyObject_SetAttr(state, names.grads, none_kept);
    Py_XDECREF(none_kept);
    if (failed != 0) throw python_error();
  }
}

// The holder `state.holder`, made and set where it is None.
c10::intrusive_ptr<attnres_cpu::StateGrads> holder_for(const EntryState& names, PyObject* state) {
  PyObject* held = PyObject_GetAttr(state, names.holder);
  if (held == nullptr) throw python_error();
  if (held == Py_None) {
    Py_DECREF(held);
    auto made = c10::make_intrusive<attnres_cpu::StateGrads>();
    adopt_python_grads(names, state, *made);
    held = PyCapsule_New(made.get(), kHolderCapsule, release_holder);
    if (held == nullptr) throw python_error();
    made.release();  // the capsule's share
    if (PyObject_SetAttr(state, names.holder, held) != 0) {
      Py_DECREF(held);
      throw python_error();
    }
  }
  auto holder = unpack_holder(held);
  Py_DECREF(held);
  return holder;
}

// What bundle and unbundle make of their arguments (state, carrier, tensors), the tensors borrowed into `tensors`.
enum class EdgeCall { kFailed, kNotPlain, kNotRecorded, kRecorded };

EdgeCall edge_call(const char* usage, PyObject* const* args, Py_ssize_t nargs, BorrowedSources& tensors) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, usage);
    return EdgeCall::kFailed;
  }
  if (!THPVariable_CheckExact(args[1]) || !append_plain(args[2], tensors, false)) return EdgeCall::kNotPlain;
  if (!at::GradMode::is_enabled()) return EdgeCall::kNotRecorded;
  const auto& listed = tensors.tensors();
  const bool wanted = THPVariable_Unpack(args[1]).requires_grad() ||
                      std::any_of(listed.begin(), listed.end(), [](const at::Tensor& t) { return t.requires_grad(); });
  return wanted ? EdgeCall::kRecorded : EdgeCall::kNotRecorded;
}

PyObject* python_bundle(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  BorrowedSources tensors;
  switch (edge_call("bundle(state, carrier, tensors)", args, nargs, tensors)) {
    case EdgeCall::kFailed: return nullptr;
    case EdgeCall::kNotPlain: Py_RETURN_NONE;
    case EdgeCall::kNotRecorded: Py_INCREF(args[1]); return args[1];
    case EdgeCall::kRecorded: break;
  }
  const at::Tensor& carrier = THPVariable_Unpack(args[1]);
  const auto holder = holder_for(*entry_state(self), args[0]);
  return THPVariable_Wrap(attnres_cpu::BundleFunction::apply(holder, carrier, at::TensorList(tensors.tensors())));
  END_HANDLE_TH_ERRORS
}

PyObject* python_unbundle(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  BorrowedSources tensors;
  switch (edge_call("unbundle(state, carrier, tensors)", args, nargs, tensors)) {
    case EdgeCall::kFailed: return nullptr;
    case EdgeCall::kNotPlain: Py_RETURN_NONE;
    case EdgeCall::kNotRecorded: return PyTuple_Pack(2, args[1], args[2]);
    case EdgeCall::kRecorded: break;
  }
  const at::Tensor& carrier = THPVariable_Unpack(args[1]);
  const auto holder = holder_for(*entry_state(self), args[0]);
  const attnres_cpu::StateTensors state{std::vector<at::Tensor>(tensors.tensors().begin(), tensors.tensors().end())};
  const torch::autograd::variable_list views = attnres_cpu::UnbundleFunction::apply(holder, carrier, state);
  PyObject* viewed = PyTuple_New(static_cast<Py_ssize_t>(views.size()) - 1);
  if (viewed == nullptr) return nullptr;
  for (size_t k = 1; k < views.size(); ++k) PyTuple_SET_ITEM(viewed, k - 1, THPVariable_Wrap(views[k]));
  PyObject* first = THPVariable_Wrap(views[0]);
  PyObject* result = PyTuple_Pack(2, first, viewed);
  Py_DECREF(first);
  Py_DECREF(viewed);
  return result;
  END_HANDLE_TH_ERRORS
}

PyObject* python_add_grads(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 2 || (!PyTuple_Check(args[1]) && !PyList_Check(args[1]))) {
    PyErr_SetString(PyExc_TypeError, "add_grads(holder, grads: list[Tensor | None])");
    return nullptr;
  }
  const auto holder = unpack_holder(args[0]);
  std::vector<at::Tensor> grads;
  const Py_ssize_t count = PySequence_Fast_GET_SIZE(args[1]);
  PyObject** items = PySequence_Fast_ITEMS(args[1]);
  for (Py_ssize_t i = 0; i < count; ++i) {
    if (items[i] == Py_None) {
      grads.emplace_back();
    } else if (THPVariable_Check(items[i])) {
      grads.push_back(THPVariable_Unpack(items[i]));
    } else {
      PyErr_SetString(PyExc_TypeError, "add_grads: every gradient must be a tensor or None");
      return nullptr;
    }
  }
  holder->add(grads, 0);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* python_take_grads(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 2 || !PyLong_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "take_grads(holder, count: int)");
    return nullptr;
  }
  const size_t count = PyLong_AsSize_t(args[1]);
  if (PyErr_Occurred()) return nullptr;  // a negative count
  const auto holder = unpack_holder(args[0]);
  const std::vector<at::Tensor> taken = holder->take(count);
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(taken.size()));
  if (out == nullptr) return nullptr;
  for (size_t k = 0; k < taken.size(); ++k) {
    PyObject* item = taken[k].defined() ? THPVariable_Wrap(taken[k]) : (Py_INCREF(Py_None), Py_None);
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(k), item);
  }
  return out;
  END_HANDLE_TH_ERRORS
}

// deposit_counts(): (gradients deposited, sums written over in place) since the library was loaded.
PyObject* python_deposit_counts(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return Py_BuildValue("(LL)", static_cast<long long>(attnres_cpu::deposits_made.load()),
                       static_cast<long long>(attnres_cpu::sums_written_over.load()));
}

// configure(hook_names, global_hooks): what run_site checks to be empty (attnres_fx/compat names them).
PyObject* python_configure(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyTuple_Check(args[0]) || !PyTuple_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "configure(hook_names: tuple[str, ...], global_hooks: tuple[dict, ...])");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[1]); ++i) {
    if (!PyDict_Check(PyTuple_GET_ITEM(args[1], i))) {
      PyErr_SetString(PyExc_TypeError, "configure: global_hooks must be dicts");
      return nullptr;
    }
  }
  EntryState& state = *entry_state(self);
  Py_INCREF(args[0]);
  Py_INCREF(args[1]);
  Py_XSETREF(state.hook_names, args[0]);
  Py_XSETREF(state.global_hooks, args[1]);
  Py_RETURN_NONE;
}

PyMethodDef entry_methods[] = {
    {"aggregate", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(python_aggregate)), METH_FASTCALL,
     "The operator attnres_cpu::aggregate through the dispatcher, for plain tensors."},
    {"run_site", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(python_run_site)), METH_FASTCALL,
     "The aggregation of a BlockAttnRes without hooks on plain CPU tensors, or None."},
    {"run_site_normed", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(python_run_site_normed)),
     METH_FASTCALL, "A site's aggregation and the norm that alone reads it, as one call, or None."},
    {"bundle", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(python_bundle)), METH_FASTCALL,
     "attnres_fx/routing/state.py's bundle as a C++ autograd node, for plain tensors; else None."},
    {"unbundle", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(python_unbundle)), METH_FASTCALL,
     "attnres_fx/routing/state.py's unbundle as a C++ autograd node, for plain tensors; else None."},
    {"add_grads", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(python_add_grads)), METH_FASTCALL,
     "Gradients for a state's tensors, added to its holder."},
    {"take_grads", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(python_take_grads)), METH_FASTCALL,
     "The gradients a state's holder kept (count of them, None where none came), emptying it."},
    {"deposit_counts", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(python_deposit_counts)),
     METH_FASTCALL, "(gradients deposited, sums written over in place) so far: Note [gradient deposits]."},
    {"configure", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(python_configure)), METH_FASTCALL,
     "The hook attributes and global hook dicts run_site checks."},
    {nullptr, nullptr, 0, nullptr}};

int entry_traverse(PyObject* self, visitproc visit, void* arg) {
  const EntryState* state = entry_state(self);
  Py_VISIT(state->hook_names);
  Py_VISIT(state->global_hooks);
  return 0;
}

int entry_clear(PyObject* self) {
  EntryState* state = entry_state(self);
  for (PyObject** slot : {&state->hook_names, &state->global_hooks, &state->modules, &state->parameters,
                          &state->forward, &state->proj, &state->norm, &state->weight, &state->eps,
                          &state->preserve_scale, &state->holder, &state->grads,
                          &state->unread}) {
    Py_CLEAR(*slot);
  }
  return 0;
}

#define ATTNRES_STRINGIFY(x) #x
#define ATTNRES_NAME(x) ATTNRES_STRINGIFY(x)

PyModuleDef entry_module = {PyModuleDef_HEAD_INIT,
                            ATTNRES_NAME(TORCH_EXTENSION_NAME),
                            "Python entries of the AttnRes CPU operator.",
                            sizeof(EntryState),
                            entry_methods,
                            nullptr,
                            entry_traverse,
                            entry_clear,
                            nullptr};

}  // namespace

#define ATTNRES_INIT_NAME2(name) PyInit_##name
#define ATTNRES_INIT_NAME(name) ATTNRES_INIT_NAME2(name)

PyMODINIT_FUNC ATTNRES_INIT_NAME(TORCH_EXTENSION_NAME)(void) {
  PyObject* module = PyModule_Create(&entry_module);
  if (module == nullptr) return nullptr;
  EntryState& state = *entry_state(module);
  state = EntryState{};
  const std::pair<PyObject**, const char*> names[] = {
      {&state.modules, "_modules"}, {&state.parameters, "_parameters"}, {&state.forward, "forward"},
      {&state.proj, "proj"},        {&state.norm, "norm"},              {&state.weight, "weight"},
      {&state.eps, "eps"},          {&state.preserve_scale, "preserve_scale"}, {&state.holder, "holder"},
      {&state.grads, "grads"},      {&state.unread, "unread"}};
  for (const auto& [slot, text] : names) {
    *slot = PyUnicode_InternFromString(text);
    if (*slot == nullptr) {
      Py_DECREF(module);
      return nullptr;
    }
  }
  return module;
}
