// Flash-style attention on the CPU for flax_attention, called through jax.ffi.
//
// Shape legend (as in flax_attention/core.py): b batch (leading axes flattened), t query tokens,
// s key tokens, h heads, d features per head (dk for queries and keys, dv for values).
//
// Layout: queries (b, t, h, dk), keys (b, s, hkv, dk), values (b, s, hkv, dv), all float32 and
// read in place with strides (row stride h * d or hkv * d): nothing is transposed or repeated.
// hkv divides h: query head hd reads key and value head hd / (h / hkv) (grouped-query
// attention; hkv = h otherwise). The caller's keep-mask is (b|1, h|1, t|1, s|1) booleans, a
// size-1 axis broadcast (stride 0).
//
// Forward, per (batch, head, block of bq queries), one task of XLA's thread pool, over the keys
// the causal mask and the sliding window leave ([kbegin, kend): the block's first row's window
// start to its last row's causal end; the tiles before and after are never computed) in tiles
// of bk keys:
//   S = Q K^T / sqrt(dk)            one product per tile
//   per row: fill the masked scores, row max m, p = exp(s - m), l = sum p  (two fused passes);
//   over several tiles an online softmax: the running m, l and output rescaled as m grows
//   O = (P * dropout keep / (1 - rate)) V / l     one product per tile, accumulated
// The rows' m and l are returned apart (not as m + log l): with document 001's -1e10 fill a
// fully masked row has m = -1e10, where m + log l would round log l away.
//
// Backward, per (batch, key head), one task: the key head's query heads in turn, each its query
// blocks in order over their key tiles, dK and dV accumulated in the task's own output rows (no
// two tasks write the same rows: the query heads sharing a key head run in one task):
//   recompute P = exp(S - m) / l (final per tile, from the forward's m and l),  dP = dO V^T,
//   delta = rowsum(dO * O)
//   dV += (P * D)^T dO,  dS = P * (dP * D - delta) (0 where the caller's mask filled the score),
//   dQ = dS K / sqrt(dk),  dK += dS^T Q / sqrt(dk)
// where D is the dropout keep-mask times 1 / (1 - rate), regenerated from the same hash.
//
// The products: the kernel's own micro-kernel (MicroGemm, below) where dk and dv are multiples
// of 16 and MicroKernel allows it (by default on CPUs with AVX-512; on every CPU when the
// call's `products` attribute asks for it), scipy-openblas32's sgemm otherwise.
//
// Masking semantics (those of the reference): the caller's mask fills a score with fill_value
// (-inf, or document 001's -1e10); a key the causal mask or the window (a key window or more
// positions before the query) hides stays -inf (it is skipped), so
// a row the caller masks entirely is uniform over its causally visible keys with -1e10 and NaN
// (0 / 0, as softmax) with -inf. Filled scores get no gradient.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "cblas.h"  // scipy-openblas32: the symbols carry a scipy_ prefix
#include "xla/ffi/api/ffi.h"
#include "parallel.h"  // ParallelFor

namespace ffi = xla::ffi;
using F32x4 = ffi::Buffer<ffi::F32, 4>;
using F32x3 = ffi::Buffer<ffi::F32, 3>;
using Mask = ffi::Buffer<ffi::PRED, 4>;
using Offset = ffi::Buffer<ffi::S32, 0>;
using Seed = ffi::Buffer<ffi::U32, 0>;
using Index = ffi::Buffer<ffi::U32, 1>;  // global batch / head numbers of the local ones

// The call's attributes, decoded by name into one struct (the Python side's _Config).
struct Options {
  bool is_causal;
  bool has_mask;
  float fill_value;
  uint32_t drop_threshold;
  float drop_scale;
  int64_t block_q;
  int64_t block_k;
  int32_t products;  // 0 the default for this CPU, 1 the BLAS, 2 the micro-kernel
  int64_t window;    // the sliding window (keys); 0: none
};

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(Options, ffi::StructMember<bool>("is_causal"),
                                      ffi::StructMember<bool>("has_mask"),
                                      ffi::StructMember<float>("fill_value"),
                                      ffi::StructMember<uint32_t>("drop_threshold"),
                                      ffi::StructMember<float>("drop_scale"),
                                      ffi::StructMember<int64_t>("block_q"),
                                      ffi::StructMember<int64_t>("block_k"),
                                      ffi::StructMember<int32_t>("products"),
                                      ffi::StructMember<int64_t>("window"));

namespace {

using flax_attention::ParallelFor;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- dropout: a counter-based hash of (seed, batch, head, query, key) ------------------------
// The same function in pure JAX: flax_attention/kernels/dropout_hash.py.

inline uint32_t Fmix32(uint32_t x) {  // murmur3's finaliser
  x ^= x >> 16;
  x *= 0x85ebca6bu;
  x ^= x >> 13;
  x *= 0xc2b2ae35u;
  x ^= x >> 16;
  return x;
}

inline uint32_t Mix(uint32_t state, uint32_t counter) {
  return Fmix32(state ^ (counter * 0x9e3779b9u));
}

// ---- exp: Cephes' expf polynomial, vectorisable; exp(x < -87.3) = 0 exactly (-inf -> 0) ------

inline float Exp(float x) {
  float clamped = x < -87.3f ? -87.3f : x;
  clamped = clamped > 88.3f ? 88.3f : clamped;
  const float n = (clamped * 1.44269504f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.3f ? 0.0f : p * scale;
}

// ---- the problem, as the handlers decode it ------------------------------------------------

struct Attention {
  int64_t batch, t, s, heads, dk, dv, bq, bk;  // bq query rows, bk keys per tile
  int64_t kv_heads, group;  // key and value heads; query heads per key head (heads / kv_heads)
  int64_t window;           // sliding window (keys), 0: none
  const float *q, *k, *v;
  const bool* mask;        // nullptr without a mask
  int64_t mask_stride[4];  // (b, h, t, s), 0 on a broadcast axis
  bool causal;
  float fill, scale;
  int32_t offset;
  uint32_t seed, drop_threshold;  // keep a weight where its hash >= drop_threshold
  float drop_scale;               // 1 / (1 - rate)
  const uint32_t *batch_index, *head_index;  // the hash's (global) batch and head numbers
  // The micro-kernel's products (MicroGemm) where set, else the BLAS's; kt and vt: the keys and
  // values transposed, (b, h, dk | dv, sp), sp >= s + kLanes columns (zero past s).
  bool micro = false;
  const float *kt = nullptr, *vt = nullptr;
  int64_t sp = 0;

  // Q by query head; K, V, KT, VT by query head hd too (its key head hd / group).
  const float* Q(int64_t b, int64_t i, int64_t hd) const { return q + ((b * t + i) * heads + hd) * dk; }
  const float* K(int64_t b, int64_t j, int64_t hd) const { return k + ((b * s + j) * kv_heads + hd / group) * dk; }
  const float* V(int64_t b, int64_t j, int64_t hd) const { return v + ((b * s + j) * kv_heads + hd / group) * dv; }
  const float* KT(int64_t b, int64_t hd) const { return kt + (b * kv_heads + hd / group) * dk * sp; }
  const float* VT(int64_t b, int64_t hd) const { return vt + (b * kv_heads + hd / group) * dv * sp; }
  const bool* MaskRow(int64_t b, int64_t hd, int64_t i) const {
    return mask + b * mask_stride[0] + hd * mask_stride[1] + i * mask_stride[2];
  }
  // Keys query i sees at all: [Begin(i), Visible(i)): every key, or keys j <= offset + i, and
  // with a window keys offset + i - j < window only.
  int64_t Visible(int64_t i) const {
    return causal ? std::clamp<int64_t>(int64_t{offset} + i + 1, 0, s) : s;
  }
  int64_t Begin(int64_t i) const {
    return window > 0 ? std::clamp<int64_t>(int64_t{offset} + i - window + 1, 0, s) : 0;
  }
  bool Dropout() const { return drop_threshold != 0; }
  uint32_t RowHash(int64_t b, int64_t hd, int64_t i) const {
    return Mix(Mix(Mix(seed, batch_index[b]), head_index[hd]), uint32_t(i));
  }
};

// Rows of scores are padded to a multiple of kLanes (the padding holds -inf, so its weight is 0):
// the row loops below run over whole vectors.
constexpr int64_t kLanes = 16;

// Query rows per tile at most (block_q larger than this is refused).
constexpr int64_t kMaxRows = 1024;

int64_t Padded(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// One row's scores as the softmax sees them: the caller-masked keys of [begin, n) filled, the
// keys before begin (outside the window) and from n on (hidden by causality, or padding) -inf.
void MaskRow(const Attention& a, const bool* keep, float* row, int64_t begin, int64_t n,
             int64_t ld) {
  std::fill(row, row + begin, kNegInf);
  if (keep) {
    const int64_t step = a.mask_stride[3];
    for (int64_t j = begin; j < n; ++j)
      if (!keep[j * step]) row[j] = a.fill;
  }
  std::fill(row + n, row + ld, kNegInf);
}

float RowMax(const float* row, int64_t ld) {
  float m = kNegInf;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < ld; ++j) m = row[j] > m ? row[j] : m;
  return m;
}

// row <- exp(row - m) * scale; returns the sum of exp(row - m).
float ExpRow(float* row, int64_t ld, float m, float scale) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < ld; ++j) {
    const float p = Exp(row[j] - m);
    sum += p;
    row[j] = p * scale;
  }
  return sum;
}

// keep[j] <- the dropout factor of key j0 + j: 1 / (1 - rate) where the hash keeps it, else 0.
void DropoutRow(const Attention& a, uint32_t row_hash, int64_t j0, float* keep, int64_t ld) {
  const uint32_t threshold = a.drop_threshold;
  const float kept = a.drop_scale;
#pragma omp simd
  for (int64_t j = 0; j < ld; ++j)
    keep[j] = Mix(row_hash, uint32_t(j0 + j)) >= threshold ? kept : 0.0f;
}

// ---- the widest vectors this CPU has, chosen when the library is loaded ----------------------
// One library for every x86-64 machine: the compiler builds each function marked WIDEST_VECTORS
// three times, for x86-64-v4 (AVX-512), x86-64-v3 (AVX2, FMA) and baseline x86-64, with the row
// passes above inlined into each copy (flatten), and the dynamic loader picks the widest copy
// this CPU runs once, at load (an ifunc). The BLAS dispatches on its own. setup.py defines
// FLAX_ATTENTION_ONE_ARCH when FLAX_ATTENTION_MARCH names one -march: then one plain copy, as
// with compilers before GCC 12 (no x86-64-v3/v4 clones), clang, and other machines.
#if defined(__x86_64__) && defined(__GLIBC__) && !defined(__clang__) && __GNUC__ >= 12 && \
    !defined(FLAX_ATTENTION_ONE_ARCH)
#define FLAX_ATTENTION_CLONES 1
#define WIDEST_VECTORS \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"), flatten))
#else
#define FLAX_ATTENTION_CLONES 0
#define WIDEST_VECTORS
#endif

thread_local std::vector<float> scratch;  // per thread: one task's tiles

float* Scratch(size_t size) {
  if (scratch.size() < size) scratch.resize(size);
  return scratch.data();
}

// ---- products: a register-blocked micro-kernel for the heads' short products --------------
// The tiles' products contract over a head's 64 features or a tile's rows: too short for a
// BLAS, which packs both operands on every call and stores C after each 64-long panel
// (docs/performance.md, "The native kernel's products"). Here every product is one form,
//   C[i][n] = alpha * sum_k A[i * am + k * ak] * B[k * ldb + n]  (+ C[i][n] when accumulating)
// with B's rows contiguous over n (N, the scores' padded row, dk or dv, a multiple of 16): C in
// blocks of 6 rows x 64 columns, per k one vector load of B per vector of columns and one
// broadcast of A per row. The scores' product reads the keys transposed, (dk, s), made once per
// head before the tiles.
//
// Written once, with GCC / Clang vector extensions over a vector type Vec of W floats, so that
// the same source compiles for every CPU: W = 16 on x86-64-v4 (AVX-512: the 6 x 64 block is 24
// of the 32 vector registers); 8 on x86-64-v3 (AVX2) and 4 elsewhere, with blocks of 6 x 16 (12
// of the 16 registers: a 6 x 64 block would want 48 and spill).
// The portable x86-64 build compiles one copy per level (function multiversioning: the loader
// picks the widest this CPU runs, as for WIDEST_VECTORS); a one-arch build, one copy for its
// -march. MicroKernel, below, says where it runs.

#if defined(__GNUC__) && defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)  // GCC 12 and later, clang
#define FLAX_ATTENTION_MICRO 1
#endif
#endif
#ifndef FLAX_ATTENTION_MICRO
#define FLAX_ATTENTION_MICRO 0
#endif

#if FLAX_ATTENTION_MICRO
typedef float Vec16 __attribute__((vector_size(64)));
typedef float Vec8 __attribute__((vector_size(32)));
typedef float Vec4 __attribute__((vector_size(16)));

template <typename Vec>
constexpr int kWidth = sizeof(Vec) / sizeof(float);

// Unaligned loads and stores (one vector move each). Vectors go by reference, never by value:
// these helpers are inlined into copies for different targets.
template <typename Vec>
inline void Load(Vec& v, const float* p) { std::memcpy(&v, p, sizeof(Vec)); }
template <typename Vec>
inline void Store(float* p, const Vec& v) { std::memcpy(p, &v, sizeof(Vec)); }

template <typename Vec, int R, int G>  // R rows of C, G groups of 16 columns
inline void MicroBlock(int64_t k_len, const float* A, int64_t am, int64_t ak, const float* B,
                       int64_t ldb, float* C, int64_t ldc, float alpha, bool accumulate) {
  constexpr int W = kWidth<Vec>, V = G * 16 / W;  // a row of the block: V vectors of W floats
  Vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = Vec{};
  for (int64_t k = 0; k < k_len; ++k) {
    const float* b = B + k * ldb;
    Vec bv[V];
    for (int v = 0; v < V; ++v) Load(bv[v], b + W * v);
    const float* a = A + k * ak;
    for (int r = 0; r < R; ++r) {
      const float ar = a[r * am];  // broadcast to every lane by the product below
      for (int v = 0; v < V; ++v) acc[r][v] += ar * bv[v];  // one FMA where the target has FMA
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      float* c = C + r * ldc + W * v;
      Vec out = acc[r][v] * alpha;
      if (accumulate) {
        Vec old;
        Load(old, c);
        out = acc[r][v] * alpha + old;
      }
      Store(c, out);
    }
}

template <typename Vec, int G>
inline void MicroColumns(int64_t m, int64_t k_len, const float* A, int64_t am, int64_t ak,
                         const float* B, int64_t ldb, float* C, int64_t ldc, float alpha,
                         bool accumulate) {
  int64_t i = 0;
  for (; i + 6 <= m; i += 6)
    MicroBlock<Vec, 6, G>(k_len, A + i * am, am, ak, B, ldb, C + i * ldc, ldc, alpha, accumulate);
  const float* a = A + i * am;
  float* c = C + i * ldc;
  switch (m - i) {
    case 5: MicroBlock<Vec, 5, G>(k_len, a, am, ak, B, ldb, c, ldc, alpha, accumulate); break;
    case 4: MicroBlock<Vec, 4, G>(k_len, a, am, ak, B, ldb, c, ldc, alpha, accumulate); break;
    case 3: MicroBlock<Vec, 3, G>(k_len, a, am, ak, B, ldb, c, ldc, alpha, accumulate); break;
    case 2: MicroBlock<Vec, 2, G>(k_len, a, am, ak, B, ldb, c, ldc, alpha, accumulate); break;
    case 1: MicroBlock<Vec, 1, G>(k_len, a, am, ak, B, ldb, c, ldc, alpha, accumulate); break;
    default: break;
  }
}

// C (m x n, n a multiple of 16) = alpha A B (+ C): column blocks of 64 outside, so a block of B
// (k_len x 64) stays in L1 while every row block of C passes over it.
template <typename Vec>
inline void MicroGemmOf(int64_t m, int64_t n, int64_t k_len, const float* A, int64_t am,
                        int64_t ak, const float* B, int64_t ldb, float* C, int64_t ldc,
                        float alpha, bool accumulate) {
  int64_t j = 0;
  if constexpr (kWidth<Vec> < 16) {
    // 16 vector registers (AVX2 and below): 6 x 64 would need 48 accumulators; 6 x 16, 12.
    for (; j < n; j += 16)
      MicroColumns<Vec, 1>(m, k_len, A, am, ak, B + j, ldb, C + j, ldc, alpha, accumulate);
    return;
  }
  for (; j + 64 <= n; j += 64)
    MicroColumns<Vec, 4>(m, k_len, A, am, ak, B + j, ldb, C + j, ldc, alpha, accumulate);
  switch ((n - j) / 16) {
    case 3:
      MicroColumns<Vec, 3>(m, k_len, A, am, ak, B + j, ldb, C + j, ldc, alpha, accumulate);
      break;
    case 2:
      MicroColumns<Vec, 2>(m, k_len, A, am, ak, B + j, ldb, C + j, ldc, alpha, accumulate);
      break;
    case 1:
      MicroColumns<Vec, 1>(m, k_len, A, am, ak, B + j, ldb, C + j, ldc, alpha, accumulate);
      break;
    default: break;
  }
}

// low, high <- a and b interleaved lane by lane: their first halves, their second halves.
template <typename Vec, size_t... I>
inline void Interleave(Vec& low, Vec& high, const Vec& a, const Vec& b, std::index_sequence<I...>) {
  constexpr size_t W = kWidth<Vec>;
  low = __builtin_shufflevector(a, b, (I % 2 ? W + I / 2 : I / 2)...);
  high = __builtin_shufflevector(a, b, (I % 2 ? W + W / 2 + I / 2 : W / 2 + I / 2)...);
}

// x (s rows of `count` features, row stride ld; count a multiple of 16) -> xt (count x sp),
// zero from column s on: W x W blocks transposed in registers, in log2(W) rounds that interleave
// row i with row i + W / 2 into rows 2i and 2i + 1 (after them, row c holds column c).
template <typename Vec>
inline void TransposeOf(const float* x, int64_t s, int64_t count, int64_t ld, float* xt,
                        int64_t sp) {
  constexpr int W = kWidth<Vec>;
  for (int64_t j0 = 0; j0 < s; j0 += W) {
    const int64_t jn = std::min<int64_t>(W, s - j0);
    for (int64_t c0 = 0; c0 < count; c0 += W) {
      Vec r[W], t[W];
      for (int i = 0; i < W; ++i) {
        r[i] = Vec{};
        if (i < jn) Load(r[i], x + (j0 + i) * ld + c0);
      }
#pragma GCC unroll 4
      for (int round = 1; round < W; round *= 2) {
#pragma GCC unroll 8
        for (int i = 0; i < W / 2; ++i)
          Interleave(t[2 * i], t[2 * i + 1], r[i], r[i + W / 2], std::make_index_sequence<W>());
#pragma GCC unroll 16
        for (int i = 0; i < W; ++i) r[i] = t[i];
      }
      for (int c = 0; c < W; ++c) Store(xt + (c0 + c) * sp + j0, r[c]);
    }
  }
  const int64_t zero_from = (s + W - 1) / W * W;
  for (int64_t c = 0; c < count; ++c) std::fill(xt + c * sp + zero_from, xt + (c + 1) * sp, 0.0f);
}

// A copy of the products with Vec's lanes, as `name`.
#define FLAX_ATTENTION_GEMM_COPY(attributes, Vec, name)                                         \
  attributes void name(int64_t m, int64_t n, int64_t k_len, const float* A, int64_t am,        \
                       int64_t ak, const float* B, int64_t ldb, float* C, int64_t ldc,         \
                       float alpha, bool accumulate) {                                         \
    MicroGemmOf<Vec>(m, n, k_len, A, am, ak, B, ldb, C, ldc, alpha, accumulate);               \
  }

// The copies: MicroGemm and Transpose with Vec's lanes, and MicroWidth, W.
#define FLAX_ATTENTION_MICRO_COPY(attributes, Vec)                                              \
  FLAX_ATTENTION_GEMM_COPY(attributes, Vec, MicroGemm)                                         \
  attributes void Transpose(const float* x, int64_t s, int64_t count, int64_t ld, float* xt,   \
                            int64_t sp) {                                                      \
    TransposeOf<Vec>(x, s, count, ld, xt, sp);                                                 \
  }                                                                                            \
  attributes int MicroWidth() { return kWidth<Vec>; }

#if FLAX_ATTENTION_CLONES
FLAX_ATTENTION_MICRO_COPY(__attribute__((target("arch=x86-64-v4"), flatten)), Vec16)
FLAX_ATTENTION_MICRO_COPY(__attribute__((target("arch=x86-64-v3"), flatten)), Vec8)
FLAX_ATTENTION_MICRO_COPY(__attribute__((target("default"), flatten)), Vec4)
// Each copy of the products by its width as well, for the tests (FlaxAttentionMicroGemmAt): the
// loader runs only the widest copy this CPU has, so an AVX-512 machine would otherwise never run
// the 8- and 4-float copies that AVX2 and older machines run.
FLAX_ATTENTION_GEMM_COPY(__attribute__((target("arch=x86-64-v4"), flatten)), Vec16, MicroGemm16)
FLAX_ATTENTION_GEMM_COPY(__attribute__((target("arch=x86-64-v3"), flatten)), Vec8, MicroGemm8)
FLAX_ATTENTION_GEMM_COPY(__attribute__((flatten)), Vec4, MicroGemm4)
#elif defined(__AVX512F__)
FLAX_ATTENTION_MICRO_COPY(__attribute__((flatten)), Vec16)
#elif defined(__AVX__)
FLAX_ATTENTION_MICRO_COPY(__attribute__((flatten)), Vec8)
#else
FLAX_ATTENTION_MICRO_COPY(__attribute__((flatten)), Vec4)
#endif
#undef FLAX_ATTENTION_MICRO_COPY
#undef FLAX_ATTENTION_GEMM_COPY
#else
int MicroWidth() { return 0; }
void MicroGemm(int64_t, int64_t, int64_t, const float*, int64_t, int64_t, const float*, int64_t,
               float*, int64_t, float, bool) {}
void Transpose(const float*, int64_t, int64_t, int64_t, float*, int64_t) {}
#endif

// ---- forward -------------------------------------------------------------------------------

WIDEST_VECTORS
void ForwardBlock(const Attention& a, int64_t b, int64_t hd, int64_t i0, float* out, float* M,
                  float* L) {
  const int64_t rows = std::min(a.bq, a.t - i0);
  const int64_t kend = a.Visible(i0 + rows - 1);  // the block's last row sees the latest keys
  const int64_t kbegin = a.Begin(i0);             // its first row the earliest
  const int64_t ldo = a.heads * a.dv, ldq = a.heads * a.dk;
  const int64_t ldk = a.kv_heads * a.dk, ldv = a.kv_heads * a.dv;
  float* O = out + ((b * a.t + i0) * a.heads + hd) * a.dv;
  float* m_out = M + (b * a.heads + hd) * a.t + i0;
  float* l_out = L + (b * a.heads + hd) * a.t + i0;
  if (kend <= kbegin) {  // every key hidden: softmax of an all -inf row, 0 / 0
    for (int64_t r = 0; r < rows; ++r) {
      std::fill(O + r * ldo, O + r * ldo + a.dv, std::nanf(""));
      m_out[r] = 0.0f, l_out[r] = 0.0f;
    }
    return;
  }
  // Keys in chunks of bk: one chunk (the whole row) while kend - kbegin <= bk, else an online
  // softmax over the chunks, the rows' output rescaled by exp(m_old - m_new) as the max grows.
  const int64_t bk = std::min(a.bk, kend - kbegin), ld = Padded(bk);
  const bool online = bk < kend - kbegin;
  float* S = Scratch(rows * ld + ld + (online ? rows * a.dv : 0));
  float* drop = S + rows * ld;
  float* acc = online ? drop + ld : O;  // the rows' running P V, (rows x dv)
  const int64_t ldacc = online ? a.dv : ldo;
  for (int64_t r = 0; r < rows; ++r) m_out[r] = kNegInf, l_out[r] = 0.0f;
  for (int64_t j0 = kbegin; j0 < kend; j0 += bk) {
    const int64_t n = std::min(bk, kend - j0), ldn = Padded(n);
    const bool first = j0 == kbegin;
    if (a.micro)
      MicroGemm(rows, ldn, a.dk, a.Q(b, i0, hd), ldq, 1, a.KT(b, hd) + j0, a.sp, S, ldn, a.scale,
                false);
    else
      scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, n, a.dk, a.scale,
                        a.Q(b, i0, hd), ldq, a.K(b, j0, hd), ldk, 0.0f, S, ldn);
    for (int64_t r = 0; r < rows; ++r) {
      float* row = S + r * ldn;
      const bool* keep = a.mask ? a.MaskRow(b, hd, i0 + r) + j0 * a.mask_stride[3] : nullptr;
      MaskRow(a, keep, row, std::clamp<int64_t>(a.Begin(i0 + r) - j0, 0, n),
              std::clamp<int64_t>(a.Visible(i0 + r) - j0, 0, n), ldn);
      const float m_old = m_out[r];
      const float m_new = std::max(m_old, RowMax(row, ldn));
      const float m = m_new == kNegInf ? 0.0f : m_new;  // nothing visible yet: every p is 0
      const float alpha = Exp(m_old - m);               // exp(-inf) = 0 on the first chunk
      l_out[r] = l_out[r] * alpha + ExpRow(row, ldn, m, 1.0f);
      m_out[r] = m_new;
      if (!first)
        for (int64_t c = 0; c < a.dv; ++c) acc[r * ldacc + c] *= alpha;
      if (a.Dropout()) {
        DropoutRow(a, a.RowHash(b, hd, i0 + r), j0, drop, ldn);
        for (int64_t j = 0; j < ldn; ++j) row[j] *= drop[j];
      }
    }
    if (a.micro)
      MicroGemm(rows, a.dv, n, S, ldn, 1, a.V(b, j0, hd), ldv, acc, ldacc, 1.0f, !first);
    else
      scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, a.dv, n, 1.0f, S, ldn,
                        a.V(b, j0, hd), ldv, first ? 0.0f : 1.0f, acc, ldacc);
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (m_out[r] == kNegInf) m_out[r] = 0.0f;  // the backward's exp(s - m) is 0 all the same
    const float l = l_out[r];
    for (int64_t c = 0; c < a.dv; ++c)
      O[r * ldo + c] = acc[r * ldacc + c] / l;  // 0 / 0 = NaN, as softmax
  }
}

// ---- backward ------------------------------------------------------------------------------

// One query head's gradients: its dQ rows written, its key head's dK and dV rows (zeroed by
// the caller, BackwardKeyHead) accumulated.
WIDEST_VECTORS
void BackwardHead(const Attention& a, int64_t b, int64_t hd, const float* out, const float* M,
                  const float* L, const float* d_out, float* dq, float* dk, float* dv) {
  const int64_t ldq = a.heads * a.dk, ldo = a.heads * a.dv;
  const int64_t ldk = a.kv_heads * a.dk, ldv = a.kv_heads * a.dv;
  float* dK = dk + (b * a.s * a.kv_heads + hd / a.group) * a.dk;
  float* dV = dv + (b * a.s * a.kv_heads + hd / a.group) * a.dv;
  for (int64_t i0 = 0; i0 < a.t; i0 += a.bq) {
    const int64_t rows = std::min(a.bq, a.t - i0);
    const int64_t kend = a.Visible(i0 + rows - 1), kbegin = a.Begin(i0);
    float* dQ = dq + ((b * a.t + i0) * a.heads + hd) * a.dk;
    const float* dO = d_out + ((b * a.t + i0) * a.heads + hd) * a.dv;
    const float* O = out + ((b * a.t + i0) * a.heads + hd) * a.dv;
    const float* m = M + (b * a.heads + hd) * a.t + i0;
    const float* l = L + (b * a.heads + hd) * a.t + i0;
    if (kend <= kbegin) {  // nothing visible: the forward's rows are NaN, so are their gradients
      for (int64_t r = 0; r < rows; ++r)
        std::fill(dQ + r * ldq, dQ + r * ldq + a.dk, std::nanf(""));
      continue;
    }
    float delta[kMaxRows];  // rowsum(dO * O) per row
    for (int64_t r = 0; r < rows; ++r) {
      float sum = 0.0f;
      for (int64_t c = 0; c < a.dv; ++c) sum += dO[r * ldo + c] * O[r * ldo + c];
      delta[r] = sum;
    }
    // Keys in chunks of bk: the forward's m and l make each chunk's weights final on their own.
    const int64_t bk = std::min(a.bk, kend - kbegin), ld = Padded(bk);
    float* P = Scratch((2 * rows + 1) * ld);
    float* dP = P + rows * ld;
    float* drop = dP + rows * ld;
    for (int64_t j0 = kbegin; j0 < kend; j0 += bk) {
      const int64_t n = std::min(bk, kend - j0), ldn = Padded(n);
      const bool first = j0 == kbegin;
      if (a.micro) {
        MicroGemm(rows, ldn, a.dk, a.Q(b, i0, hd), ldq, 1, a.KT(b, hd) + j0, a.sp, P, ldn,
                  a.scale, false);
        MicroGemm(rows, ldn, a.dv, dO, ldo, 1, a.VT(b, hd) + j0, a.sp, dP, ldn, 1.0f, false);
      } else {
        scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, n, a.dk, a.scale,
                          a.Q(b, i0, hd), ldq, a.K(b, j0, hd), ldk, 0.0f, P, ldn);
        scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, n, a.dv, 1.0f, dO, ldo,
                          a.V(b, j0, hd), ldv, 0.0f, dP, ldn);
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* p = P + r * ldn;
        float* dp = dP + r * ldn;
        const int64_t begin = std::clamp<int64_t>(a.Begin(i0 + r) - j0, 0, n);
        const int64_t visible = std::clamp<int64_t>(a.Visible(i0 + r) - j0, 0, n);
        const bool* keep = a.mask ? a.MaskRow(b, hd, i0 + r) + j0 * a.mask_stride[3] : nullptr;
        MaskRow(a, keep, p, begin, visible, ldn);
        ExpRow(p, ldn, m[r], 1.0f / l[r]);  // the forward's weights
        std::fill(dp + n, dp + ldn, 0.0f);
        if (a.Dropout()) {
          DropoutRow(a, a.RowHash(b, hd, i0 + r), j0, drop, ldn);
          for (int64_t j = 0; j < ldn; ++j) {
            dp[j] = p[j] * (dp[j] * drop[j] - delta[r]);  // dS
            p[j] *= drop[j];                              // P * D, for dV
          }
        } else {
          for (int64_t j = 0; j < ldn; ++j) dp[j] = p[j] * (dp[j] - delta[r]);  // dS
        }
        if (keep) {  // a filled score is a constant: no gradient flows through it
          const int64_t step = a.mask_stride[3];
          for (int64_t j = begin; j < visible; ++j)
            if (!keep[j * step]) dp[j] = 0.0f;
        }
      }
      // dV += (P * D)^T dO;  dQ (+)= dS K * scale;  dK += dS^T Q * scale
      if (a.micro) {
        MicroGemm(n, a.dv, rows, P, 1, ldn, dO, ldo, dV + j0 * ldv, ldv, 1.0f, true);
        MicroGemm(rows, a.dk, n, dP, ldn, 1, a.K(b, j0, hd), ldk, dQ, ldq, a.scale, !first);
        MicroGemm(n, a.dk, rows, dP, 1, ldn, a.Q(b, i0, hd), ldq, dK + j0 * ldk, ldk, a.scale,
                  true);
        continue;  // the BLAS's three products below are the same
      }
      scipy_cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, a.dv, rows, 1.0f, P, ldn,
                        dO, ldo, 1.0f, dV + j0 * ldv, ldv);
      scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, a.dk, n, a.scale, dP,
                        ldn, a.K(b, j0, hd), ldk, first ? 0.0f : 1.0f, dQ, ldq);
      scipy_cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, a.dk, rows, a.scale, dP,
                        ldn, a.Q(b, i0, hd), ldq, 1.0f, dK + j0 * ldk, ldk);
    }
  }
}

// One key head's task: its dK and dV rows zeroed, then each of its query heads in turn.
void BackwardKeyHead(const Attention& a, int64_t b, int64_t kvh, const float* out,
                     const float* M, const float* L, const float* d_out, float* dq, float* dk,
                     float* dv) {
  const int64_t ldk = a.kv_heads * a.dk, ldv = a.kv_heads * a.dv;
  float* dK = dk + (b * a.s * a.kv_heads + kvh) * a.dk;
  float* dV = dv + (b * a.s * a.kv_heads + kvh) * a.dv;
  for (int64_t j = 0; j < a.s; ++j) {
    std::fill(dK + j * ldk, dK + j * ldk + a.dk, 0.0f);
    std::fill(dV + j * ldv, dV + j * ldv + a.dv, 0.0f);
  }
  for (int64_t hd = kvh * a.group; hd < (kvh + 1) * a.group; ++hd)
    BackwardHead(a, b, hd, out, M, L, d_out, dq, dk, dv);
}

// Whether the products run on the micro-kernel, head dims aside. The call's `products` attribute
// chooses: 1 the BLAS, 2 the micro-kernel (wherever it is built: how the tests run it on every
// CPU). 0, the default: the micro-kernel where its copy for this CPU has 16-float vectors
// (AVX-512), the BLAS elsewhere: with 8-float vectors (AVX2) its 6 x 16 blocks run at about the
// BLAS's speed, a little slower on the forward (measured: docs/performance.md, "The micro-kernel
// on every CPU").
constexpr int32_t kProductsBlas = 1, kProductsMicro = 2;

bool MicroKernel(int32_t products) {
  if (!FLAX_ATTENTION_MICRO || products == kProductsBlas) return false;
  if (products == kProductsMicro) return true;
  return MicroWidth() == 16;
}

// ---- decoding the FFI call -----------------------------------------------------------------

ffi::Error Decode(Attention& a, F32x4 q, F32x4 k, F32x4 v, Mask mask, Offset offset, Seed seed,
                  Index batch_index, Index head_index, const Options& o) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), md = mask.dimensions();
  a.batch = qd[0], a.t = qd[1], a.heads = qd[2], a.dk = qd[3], a.s = kd[1], a.dv = vd[3];
  a.kv_heads = kd[2];
  if (kd[0] != a.batch || vd[0] != a.batch || vd[2] != a.kv_heads || a.kv_heads == 0 ||
      a.heads % a.kv_heads != 0 || kd[3] != a.dk || vd[1] != a.s)
    return ffi::Error::InvalidArgument("native attention: q, k, v shapes disagree");
  a.group = a.heads / a.kv_heads;
  a.window = o.window;
  if (batch_index.dimensions()[0] != a.batch || head_index.dimensions()[0] != a.heads)
    return ffi::Error::InvalidArgument("native attention: batch_index must hold b numbers, head_index h");
  const int64_t full[4] = {a.batch, a.heads, a.t, a.s};
  int64_t stride = 1;
  for (int axis = 3; axis >= 0; --axis) {
    if (md[axis] != 1 && md[axis] != full[axis])
      return ffi::Error::InvalidArgument("native attention: mask must be (b|1, h|1, t|1, s|1)");
    a.mask_stride[axis] = md[axis] == 1 ? 0 : stride;
    stride *= md[axis];
  }
  a.q = q.typed_data(), a.k = k.typed_data(), a.v = v.typed_data();
  a.mask = o.has_mask ? mask.typed_data() : nullptr;
  a.causal = o.is_causal, a.fill = o.fill_value, a.offset = *offset.typed_data();
  a.scale = 1.0f / std::sqrt(float(a.dk));
  a.seed = *seed.typed_data(), a.drop_threshold = o.drop_threshold, a.drop_scale = o.drop_scale;
  a.batch_index = batch_index.typed_data(), a.head_index = head_index.typed_data();
  // Tiles of 64 query rows (128 from 2048 queries) by 512 keys: fewer rows waste less of the
  // causal diagonal, more make sgemm faster (measured: docs/performance.md, "The native
  // kernel's tiles").
  a.bq = o.block_q > 0 ? o.block_q : (a.t >= 2048 ? 128 : 64);
  a.bk = o.block_k > 0 ? o.block_k : 512;
  if (a.bq > kMaxRows)
    return ffi::Error::InvalidArgument("native attention: block_q must be at most 1024");
  a.micro = MicroKernel(o.products) && a.dk % 16 == 0 && a.dv % 16 == 0;
  a.sp = Padded(a.s + kLanes);
  return ffi::Error::Success();
}

// The keys (and values, for the backward) transposed per head for the micro-kernel, one task
// per (batch, head). Their buffer is as large as the keys and values: a fresh one per call
// costs its page faults every call (measured in docs/performance.md), so one buffer of up
// to 256 MB is kept for the process and lent to whichever call finds it free; a call that
// needs more, or runs while another holds it, has a buffer of its own for the call.
struct Transposed {
  std::unique_lock<std::mutex> lock;  // holds the kept buffer while this call uses it
  std::unique_ptr<float[]> own;
};

std::mutex kept_mutex;
std::vector<float> kept;

float* Borrow(size_t n, Transposed& t) {
  constexpr size_t kKeepFloats = size_t{64} << 20;  // 256 MB
  if (n <= kKeepFloats) {
    std::unique_lock<std::mutex> lock(kept_mutex, std::try_to_lock);
    if (lock.owns_lock()) {
      if (kept.size() < n) kept.resize(n);
      t.lock = std::move(lock);
      return kept.data();
    }
  }
  t.own.reset(new float[n]);  // uninitialised: every element is written before it is read
  return t.own.get();
}

void TransposeHeads(ffi::ThreadPool& pool, Attention& a, bool values, Transposed& transposed) {
  const int64_t per_head = (a.dk + (values ? a.dv : 0)) * a.sp;
  float* kt = Borrow(a.batch * a.kv_heads * per_head, transposed);
  float* vt = kt + a.batch * a.kv_heads * a.dk * a.sp;
  ParallelFor(pool, a.batch * a.kv_heads, [&](int64_t bh) {  // per key head
    const int64_t b = bh / a.kv_heads, hd = bh % a.kv_heads * a.group;  // its first query head
    const int64_t ldk = a.kv_heads * a.dk, ldv = a.kv_heads * a.dv;
    Transpose(a.K(b, 0, hd), a.s, a.dk, ldk, kt + bh * a.dk * a.sp, a.sp);
    if (values) Transpose(a.V(b, 0, hd), a.s, a.dv, ldv, vt + bh * a.dv * a.sp, a.sp);
  });
  a.kt = kt;
  a.vt = values ? vt : nullptr;
}

ffi::Error Forward(ffi::ThreadPool pool, F32x4 q, F32x4 k, F32x4 v, Mask mask, Offset offset,
                   Seed seed, Index batch_index, Index head_index,
                   ffi::ResultBuffer<ffi::F32, 4> out, ffi::ResultBuffer<ffi::F32, 3> m,
                   ffi::ResultBuffer<ffi::F32, 3> l, Options options) {
  Attention a;
  if (auto e = Decode(a, q, k, v, mask, offset, seed, batch_index, head_index, options);
      e.failure())
    return e;
  Transposed transposed;  // released when the call returns
  if (a.micro) TransposeHeads(pool, a, false, transposed);
  const int64_t blocks = (a.t + a.bq - 1) / a.bq;
  float *o = out->typed_data(), *mm = m->typed_data(), *ll = l->typed_data();
  ParallelFor(pool, a.batch * a.heads * blocks, [&](int64_t item) {
    const int64_t bh = item / blocks, i0 = (item % blocks) * a.bq;
    ForwardBlock(a, bh / a.heads, bh % a.heads, i0, o, mm, ll);
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, F32x4 q, F32x4 k, F32x4 v, Mask mask, Offset offset,
                    Seed seed, Index batch_index, Index head_index, F32x4 out, F32x3 m, F32x3 l,
                    F32x4 d_out, ffi::ResultBuffer<ffi::F32, 4> dq,
                    ffi::ResultBuffer<ffi::F32, 4> dk, ffi::ResultBuffer<ffi::F32, 4> dv,
                    Options options) {
  Attention a;
  if (auto e = Decode(a, q, k, v, mask, offset, seed, batch_index, head_index, options);
      e.failure())
    return e;
  Transposed transposed;  // released when the call returns
  if (a.micro) TransposeHeads(pool, a, true, transposed);
  ParallelFor(pool, a.batch * a.kv_heads, [&](int64_t bh) {
    BackwardKeyHead(a, bh / a.kv_heads, bh % a.kv_heads, out.typed_data(), m.typed_data(),
                    l.typed_data(), d_out.typed_data(), dq->typed_data(), dk->typed_data(),
                    dv->typed_data());
  });
  return ffi::Error::Success();
}

}  // namespace

// The jaxlib whose FFI headers this library was built against (setup.py defines it): an XLA
// of another API version refuses the handlers and with them the whole CPU backend, so the
// package compares it with the running jaxlib before it registers anything.
#ifndef FLAX_ATTENTION_JAXLIB
#define FLAX_ATTENTION_JAXLIB "unknown"
#endif
extern "C" const char* FlaxAttentionJaxlibVersion() { return FLAX_ATTENTION_JAXLIB; }

// 1 where a call with the default `products` runs them on the micro-kernel (head dims multiples
// of 16).
extern "C" int FlaxAttentionMicroKernel() { return MicroKernel(0); }

// The floats per vector of the micro-kernel's copy for this CPU: 16 (AVX-512), 8 (AVX), 4; 0
// where it is not built.
extern "C" int FlaxAttentionMicroWidth() { return MicroWidth(); }

// C (m x n) = alpha A B (+ C where accumulate), as the kernel's products compute it (MicroGemm),
// by the copy with `width` floats per vector: 16, 8 or 4 in the portable build where this CPU
// runs that copy, the one copy's width otherwise. Returns 0 (and computes nothing) where that
// copy is not here. For the tests only.
extern "C" int FlaxAttentionMicroGemmAt(int width, int64_t m, int64_t n, int64_t k_len,
                                        const float* A, int64_t am, int64_t ak, const float* B,
                                        int64_t ldb, float* C, int64_t ldc, float alpha,
                                        int accumulate) {
#if FLAX_ATTENTION_MICRO && FLAX_ATTENTION_CLONES
  __builtin_cpu_init();
  if (width == 16 && __builtin_cpu_supports("x86-64-v4"))
    MicroGemm16(m, n, k_len, A, am, ak, B, ldb, C, ldc, alpha, accumulate != 0);
  else if (width == 8 && __builtin_cpu_supports("x86-64-v3"))
    MicroGemm8(m, n, k_len, A, am, ak, B, ldb, C, ldc, alpha, accumulate != 0);
  else if (width == 4)
    MicroGemm4(m, n, k_len, A, am, ak, B, ldb, C, ldc, alpha, accumulate != 0);
  else
    return 0;
  return 1;
#elif FLAX_ATTENTION_MICRO
  if (width != MicroWidth()) return 0;
  MicroGemm(m, n, k_len, A, am, ak, B, ldb, C, ldc, alpha, accumulate != 0);
  return 1;
#else
  return 0;
#endif
}

// 1 where the hot functions have one copy per x86-64 level, the widest this CPU runs picked at
// load (the portable build); 0 for one copy (FLAX_ATTENTION_MARCH, other compilers, machines).
extern "C" int FlaxAttentionClones() { return FLAX_ATTENTION_CLONES; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlaxAttentionForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32x4>()  // q
                                  .Arg<F32x4>()  // k
                                  .Arg<F32x4>()  // v
                                  .Arg<Mask>()  // mask
                                  .Arg<Offset>()  // query_offset
                                  .Arg<Seed>()  // dropout seed
                                  .Arg<Index>()  // batch_index
                                  .Arg<Index>()  // head_index
                                  .Ret<F32x4>()  // out
                                  .Ret<F32x3>()  // m
                                  .Ret<F32x3>()  // l
                                  .Attrs<Options>());  // the call's attributes

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlaxAttentionBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32x4>()  // q
                                  .Arg<F32x4>()  // k
                                  .Arg<F32x4>()  // v
                                  .Arg<Mask>()  // mask
                                  .Arg<Offset>()  // query_offset
                                  .Arg<Seed>()  // dropout seed
                                  .Arg<Index>()  // batch_index
                                  .Arg<Index>()  // head_index
                                  .Arg<F32x4>()  // out
                                  .Arg<F32x3>()  // m
                                  .Arg<F32x3>()  // l
                                  .Arg<F32x4>()  // d_out
                                  .Ret<F32x4>()  // dq
                                  .Ret<F32x4>()  // dk
                                  .Ret<F32x4>()  // dv
                                  .Attrs<Options>());  // the call's attributes
