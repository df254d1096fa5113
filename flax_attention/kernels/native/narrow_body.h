// The narrow products' code, included by narrow.cc once per x86-64 level inside a namespace and
// a `#pragma GCC target` region (so that every template here is compiled for that level and may
// use its intrinsics); `Vec`, the float vector of that level, is declared before the include and
// FLAX_NARROW_LEVEL defined (4: x86-64-v4, 3: x86-64-v3, 0: other; GCC's C++ front end does
// not define __AVX512F__ and the like inside a target pragma).
// Not a header to include elsewhere.


template <typename Vec>
constexpr int kW = sizeof(Vec) / sizeof(float);
// The vector registers of the level: 32 with AVX-512, else 16.
template <typename Vec>
constexpr int kVectorRegisters = kW<Vec> == 16 ? 32 : 16;

// W elements of T -> W floats. Loads are unaligned (memcpy); vectors go by reference.
template <typename Vec, typename T>
struct Widen;
template <typename Vec>
struct Widen<Vec, float> {
  static inline void Load(Vec& v, const float* p) { std::memcpy(&v, p, sizeof(Vec)); }
};
// The integer vectors of as many lanes as Vec: 16-bit and 8-bit halves, 32-bit words.
template <int W>
struct Lanes;
template <>
struct Lanes<16> {
  typedef uint16_t U16 __attribute__((vector_size(32)));
  typedef uint32_t U32 __attribute__((vector_size(64)));
  typedef int8_t I8 __attribute__((vector_size(16)));
  typedef int16_t I16 __attribute__((vector_size(32)));
  typedef int32_t I32 __attribute__((vector_size(64)));
};
template <>
struct Lanes<8> {
  typedef uint16_t U16 __attribute__((vector_size(16)));
  typedef uint32_t U32 __attribute__((vector_size(32)));
  typedef int8_t I8 __attribute__((vector_size(8)));
  typedef int16_t I16 __attribute__((vector_size(16)));
  typedef int32_t I32 __attribute__((vector_size(32)));
};
template <>
struct Lanes<4> {
  typedef uint16_t U16 __attribute__((vector_size(8)));
  typedef uint32_t U32 __attribute__((vector_size(16)));
  typedef int8_t I8 __attribute__((vector_size(4)));
  typedef int16_t I16 __attribute__((vector_size(8)));
  typedef int32_t I32 __attribute__((vector_size(16)));
};

template <typename Vec>
struct Widen<Vec, Bf16> {
  using L = Lanes<kW<Vec>>;
  static inline void Load(Vec& v, const Bf16* p) {
    // One zero extension and one shift where the target has them (GCC lowers the generic
    // conversion below to halves and shuffles, as it does int8's).
#if FLAX_NARROW_LEVEL == 4
    if constexpr (kW<Vec> == 16) {
      const __m512i f = _mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
      std::memcpy(&v, &f, sizeof(Vec));
      return;
    }
#endif
#if FLAX_NARROW_LEVEL >= 3
    if constexpr (kW<Vec> == 8) {
      const __m256i f = _mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
      std::memcpy(&v, &f, sizeof(Vec));
      return;
    }
#endif
    typename L::U16 h;
    std::memcpy(&h, p, sizeof h);
    typename L::U32 bits = __builtin_convertvector(h, typename L::U32) << 16;
    std::memcpy(&v, &bits, sizeof(Vec));
  }
};
template <typename Vec>
struct Widen<Vec, int8_t> {
  using L = Lanes<kW<Vec>>;
  static inline void Load(Vec& v, const int8_t* p) {
    // One sign extension and one conversion where the target has them: GCC 12 lowers the
    // generic conversion below to halves and shuffles (3x the int8 product's time).
#if FLAX_NARROW_LEVEL == 4
    if constexpr (kW<Vec> == 16) {
      const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
      std::memcpy(&v, &f, sizeof(Vec));
      return;
    }
#endif
#if FLAX_NARROW_LEVEL >= 3
    if constexpr (kW<Vec> == 8) {
      const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
      std::memcpy(&v, &f, sizeof(Vec));
      return;
    }
#endif
    typename L::I8 q;
    std::memcpy(&q, p, sizeof q);
    typename L::I16 h = __builtin_convertvector(q, typename L::I16);
    v = __builtin_convertvector(__builtin_convertvector(h, typename L::I32), Vec);
  }
};

template <typename Vec>
inline void Store(float* p, const Vec& v) { std::memcpy(p, &v, sizeof(Vec)); }
template <typename Vec>
inline void LoadF(Vec& v, const float* p) { std::memcpy(&v, p, sizeof(Vec)); }

// ---- kn: y[r][j] = sum_k x[r][k] w[k][j] (* scale[j]) ----------------------------------------

// One register block: R rows of y, V vectors of columns, over k rows of w; added to y's values
// unless `first`; times scale where given (the last rows).
template <typename Vec, typename T, int R, int V, int Ahead = 0>
inline void KnBlock(int64_t k, const float* x, int64_t ldx, const T* w, int64_t ldw,
                    const float* scale, float* y, int64_t ldy, bool first) {
  constexpr int W = kW<Vec>;
  Vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      if (first) {
        acc[r][v] = Vec{};
      } else {
        LoadF(acc[r][v], y + r * ldy + W * v);
      }
    }
  // Per k, the order that keeps fewer values live beside the R x V accumulators (16 vector
  // registers below AVX-512): the V widened weights then a row at a time (V + 1 more), or a
  // weight vector at a time against the R rows (R + 1 more). The sums are the same.
  for (int64_t kk = 0; kk < k; ++kk) {
    const T* row = w + kk * ldw;
    if constexpr (Ahead > 0) {  // the same columns Ahead rows on, a cache line at a time
      constexpr int per = std::max<int>(1, 64 / int(W * sizeof(T)));
      for (int v = 0; v < V; v += per)  // (an address, maybe past the weights: no fault)
        __builtin_prefetch(reinterpret_cast<const void*>(
            reinterpret_cast<uintptr_t>(row) + (Ahead * ldw + W * v) * sizeof(T)));
    }
    if constexpr (V < R) {
      Vec wv[V];
      for (int v = 0; v < V; ++v) Widen<Vec, T>::Load(wv[v], row + W * v);
      for (int r = 0; r < R; ++r) {
        const float a = x[r * ldx + kk];
        for (int v = 0; v < V; ++v) acc[r][v] += a * wv[v];
      }
    } else {
      float a[R];
      for (int r = 0; r < R; ++r) a[r] = x[r * ldx + kk];
      for (int v = 0; v < V; ++v) {
        Vec wv;
        Widen<Vec, T>::Load(wv, row + W * v);
        for (int r = 0; r < R; ++r) acc[r][v] += a[r] * wv;
      }
    }
  }
  for (int v = 0; v < V; ++v) {
    Vec s;
    if (scale != nullptr) LoadF(s, scale + W * v);
    for (int r = 0; r < R; ++r) Store(y + r * ldy + W * v, scale ? acc[r][v] * s : acc[r][v]);
  }
}

// Columns [j0, j1) of R rows over k rows of w: tiles of V vectors, the rest in tiles of V / 2,
// V / 4, ... vectors, then single columns.
template <typename Vec, typename T, int R, int V, int Ahead = 0>
inline void KnTiles(int64_t k, const float* x, int64_t ldx, const T* w, int64_t ldw,
                    const float* scale, float* y, int64_t ldy, int64_t j0, int64_t j1,
                    bool first) {
  constexpr int W = kW<Vec>;
  int64_t j = j0;
  for (; j + V * W <= j1; j += V * W)
    KnBlock<Vec, T, R, V, Ahead>(k, x, ldx, w + j, ldw, scale ? scale + j : nullptr, y + j, ldy,
                                 first);
  if constexpr (V > 1) {
    KnTiles<Vec, T, R, V / 2, Ahead>(k, x, ldx, w, ldw, scale, y, ldy, j, j1, first);
  } else {
    for (; j < j1; ++j)
      for (int r = 0; r < R; ++r) {
        float sum = first ? 0.0f : y[r * ldy + j];
        for (int64_t kk = 0; kk < k; ++kk) sum += x[r * ldx + kk] * Scalar<T>(w + kk * ldw + j);
        y[r * ldy + j] = scale ? sum * scale[j] : sum;
      }
  }
}

// Rows of w in blocks of kKnRows, each block across all the columns before the next: the block's
// rows are read as that many sequential streams (a weight row is contiguous), where a tile
// over all of k would touch a new page of memory at every row. One row of x takes blocks of
// one weight row: the weight is then read in memory order, which the hardware prefetcher
// follows best (GPT-2 small's layer products from memory at one row, AVX-512, 2 threads:
// bfloat16 29 GB/s against 20-22 with blocks of 2 or 8 rows). More rows of x keep blocks of 8
// (their accumulators would otherwise be loaded and stored at every weight row) and prefetch
// each line of the block kKnAhead rows on (8 rows of int8 x GPT-2's products: 13.0 against
// 14.7 ms a pass).
constexpr int64_t kKnRows = 8;
constexpr int kKnAhead = 8;

// One row of x over a bfloat16 (k, n) weight with AVX2's 8-float vectors (the AVX-512 copy
// reads at the machine's bandwidth without it): each 32-bit pair of weights gives two floats
// without a shuffle, the even column's bits shifted up 16 and the odd column's low half
// cleared, where the widening load (a lane-crossing zero extension, then a shift) held the
// loop to 1.0-1.2 ns per 8 weights on a Zen 3 from L2 (0.6 this way). Per 2W columns the
// accumulators in y hold the W even columns then the W odd ones, interleaved back (and
// scaled) after the last weight row: per column the same FMAs in the same order as
// KnTiles'. Each step also prefetches the weight kKnOneRowAhead bytes on: the loop's
// other work leaves too few loads in flight for the hardware prefetcher alone (GPT-2 small's
// layer products from memory at one row, 2 threads, Zen 3: 14.7 GB/s before, 16.8 after,
// against 19.4 for a loop that only reads them; 768 and 1536 bytes on: 16.2-16.5).
constexpr int64_t kKnOneRowAhead = 1024;

template <typename Vec>
inline void KnOneRowBf16(int64_t k, const float* x, const Bf16* w, int64_t ldw,
                         const float* scale, float* y, int64_t j0, int64_t j1) {
  constexpr int W = kW<Vec>;
  static_assert(W == 8, "the interleave below is written for 8 floats");
  using U32 = typename Lanes<W>::U32;
  const U32 high = U32{} + 0xffff0000u;
  for (int64_t kk = 0; kk < k; ++kk) {
    const Bf16* row = w + kk * ldw;
    const float a = x[kk];
    for (int64_t j = j0; j < j1; j += 4 * W) {
      __builtin_prefetch(reinterpret_cast<const char*>(row + j) + kKnOneRowAhead);
      U32 b0, b1;
      std::memcpy(&b0, row + j, sizeof b0);
      std::memcpy(&b1, row + j + 2 * W, sizeof b1);
      Vec e0, o0, e1, o1;
      if (kk == 0) {
        e0 = o0 = e1 = o1 = Vec{};
      } else {
        LoadF(e0, y + j);
        LoadF(o0, y + j + W);
        LoadF(e1, y + j + 2 * W);
        LoadF(o1, y + j + 3 * W);
      }
      const U32 be0 = b0 << 16, bo0 = b0 & high, be1 = b1 << 16, bo1 = b1 & high;
      Vec we0, wo0, we1, wo1;
      std::memcpy(&we0, &be0, sizeof(Vec));
      std::memcpy(&wo0, &bo0, sizeof(Vec));
      std::memcpy(&we1, &be1, sizeof(Vec));
      std::memcpy(&wo1, &bo1, sizeof(Vec));
      e0 += a * we0;
      o0 += a * wo0;
      e1 += a * we1;
      o1 += a * wo1;
      Store(y + j, e0);
      Store(y + j + W, o0);
      Store(y + j + 2 * W, e1);
      Store(y + j + 3 * W, o1);
    }
  }
  for (int64_t j = j0; j < j1; j += 2 * W) {  // evens, odds -> columns in order
    Vec e, o;
    LoadF(e, y + j);
    LoadF(o, y + j + W);
    Vec lo = __builtin_shufflevector(e, o, 0, 8, 1, 9, 2, 10, 3, 11);
    Vec hi = __builtin_shufflevector(e, o, 4, 12, 5, 13, 6, 14, 7, 15);
    if (scale != nullptr) {
      Vec s;
      LoadF(s, scale + j);
      lo *= s;
      LoadF(s, scale + j + W);
      hi *= s;
    }
    Store(y + j, lo);
    Store(y + j + W, hi);
  }
}

template <typename Vec, typename T, int R, int V>
inline void KnRows(int64_t k, const float* x, int64_t ldx, const T* w, int64_t ldw,
                   const float* scale, float* y, int64_t ldy, int64_t j0, int64_t j1) {
  if constexpr (R == 1 && kW<Vec> == 8 && std::is_same_v<T, Bf16>) {
    const int64_t whole = j0 + (j1 - j0) / (4 * kW<Vec>) * (4 * kW<Vec>);
    if (k > 0 && whole > j0) KnOneRowBf16<Vec>(k, x, w, ldw, scale, y, j0, whole);
    j0 = whole;
    if (j0 == j1) return;
  }
  constexpr int64_t rows = R == 1 ? 1 : kKnRows;
  constexpr int ahead = R == 1 ? 0 : kKnAhead;
  for (int64_t kb = 0; kb < k; kb += rows) {
    const int64_t kl = std::min(rows, k - kb);
    KnTiles<Vec, T, R, V, ahead>(kl, x + kb, ldx, w + kb * ldw, ldw,
                                 kb + kl == k ? scale : nullptr, y, ldy, j0, j1, kb == 0);
  }
}

// Vectors of columns per tile for R rows: as wide as the register file holds the accumulators
// (32 vector registers with AVX-512, 16 otherwise), so that each weight row is read in runs of
// up to 1 KB.
constexpr int KnV(int W, int R) {
  return W == 16 ? (R == 1 ? 16 : R == 2 ? 8 : R <= 4 ? 4 : 2)
                 : (R == 1 ? 8 : R == 2 ? 4 : R <= 4 ? 2 : 1);
}

template <typename Vec, typename T>
void KnRange(int64_t m, int64_t k, const float* x, const T* w, int64_t n, const float* scale,
             float* y, int64_t j0, int64_t j1) {
  constexpr int W = kW<Vec>;
  for (int64_t i = 0; i < m; i += 8) {
    const float* xi = x + i * k;
    float* yi = y + i * n;
    switch (std::min<int64_t>(8, m - i)) {
#define FLAX_NARROW_KN(R) \
  case R: KnRows<Vec, T, R, KnV(W, R)>(k, xi, k, w, n, scale, yi, n, j0, j1); break;
      FLAX_NARROW_KN(1)
      FLAX_NARROW_KN(2)
      FLAX_NARROW_KN(3)
      FLAX_NARROW_KN(4)
      FLAX_NARROW_KN(5)
      FLAX_NARROW_KN(6)
      FLAX_NARROW_KN(7)
      FLAX_NARROW_KN(8)
#undef FLAX_NARROW_KN
      default: break;
    }
  }
}

// Rows [k0, k1) of w, every column, for up to 8 rows of x at a time: y = x[:, k0:k1] @ w[k0:k1]
// (no scale), into y (m, n). One task's share when a product of a few rows is split over the
// weight's rows: each task then reads one contiguous block of the weight.
template <typename Vec, typename T>
void KnPart(int64_t m, int64_t k, const float* x, const T* w, int64_t n, float* y, int64_t k0,
            int64_t k1) {
  constexpr int W = kW<Vec>;
  for (int64_t i = 0; i < m; i += 8) {
    const float* xi = x + i * k + k0;
    float* yi = y + i * n;
    switch (std::min<int64_t>(8, m - i)) {
#define FLAX_NARROW_PART(R) \
  case R: KnRows<Vec, T, R, KnV(W, R)>(k1 - k0, xi, k, w + k0 * n, n, nullptr, yi, n, 0, n); break;
      FLAX_NARROW_PART(1)
      FLAX_NARROW_PART(2)
      FLAX_NARROW_PART(3)
      FLAX_NARROW_PART(4)
      FLAX_NARROW_PART(5)
      FLAX_NARROW_PART(6)
      FLAX_NARROW_PART(7)
      FLAX_NARROW_PART(8)
#undef FLAX_NARROW_PART
      default: break;
    }
  }
}

// ---- packed: many rows ------------------------------------------------------------------------

// A prefill's products: many rows share every weight, so the time is the FMAs'. kn: per panel of
// PackV vectors of columns and block of kPackK weight rows, the weights are widened (and
// scaled) once into a float32 panel (kPackK x panel, 64 KB with AVX-512) that stays in L2, and
// every block of kPackR rows of x multiplies it in registers (KnBlock on the panel). nk: the
// same panels, filled from the transposed weight (FillTransposed). Nothing wider than the
// weight is written to memory but the panel; XLA's product would first write the whole widened
// matrix. The int8 weights are dequantized (q * scale) as XLA's product has them, so the sums
// are those of the dequantized matrix, in another order.
constexpr int64_t kPackK = 256;
constexpr int kPackR = 6;
// Vectors of columns per panel: 6 x 4 accumulators with 32 vector registers, 6 x 2 with 16.
// (8 x 3, 12 x 2 and panels of 128 or 512 weight rows measured the same with AVX-512.)
constexpr int PackV(int W) { return W == 16 ? 4 : 2; }

// `count` weights from p as float32, times scale (one per weight) where given, into out.
template <typename Vec, typename T>
inline void WidenRun(const T* p, int64_t count, const float* scale, float* out) {
  constexpr int W = kW<Vec>;
  int64_t c = 0;
  for (; c + W <= count; c += W) {
    Vec v;
    Widen<Vec, T>::Load(v, p + c);
    if (scale) {
      Vec sv;
      LoadF(sv, scale + c);
      v *= sv;
    }
    Store(out + c, v);
  }
  for (; c < count; ++c) out[c] = scale ? Scalar<T>(p + c) * scale[c] : Scalar<T>(p + c);
}

// t[i][c] <- t[c][i]: W x W floats transposed in registers, in log2(W) rounds that interleave
// the first half's vectors with the second half's (a perfect shuffle; two-source permutes).
template <typename Vec, std::size_t... I>
inline void TransposeSquare(Vec* t, std::index_sequence<I...>) {
  constexpr int W = kW<Vec>;
  for (int round = 1; round < W; round *= 2) {
    Vec u[W];
    for (int i = 0; i < W / 2; ++i) {  // indices below W from the first operand, else the second
      u[2 * i] = __builtin_shufflevector(t[i], t[i + W / 2], int(I % 2 ? I / 2 + W : I / 2)...);
      u[2 * i + 1] = __builtin_shufflevector(t[i], t[i + W / 2],
                                             int(I % 2 ? I / 2 + W + W / 2 : I / 2 + W / 2)...);
    }
    for (int i = 0; i < W; ++i) t[i] = u[i];
  }
}

// p[kk][c] = w[c][kk] (* scale[c]) for c < cols, kk < kl, w's rows ldw apart, p's ldp: W x W
// squares widened, scaled and transposed in registers, the edges one weight at a time (GPT-2's
// int8 products at 512 rows spent 6 % of their time in this fill a float at a time).
template <typename Vec, typename T>
inline void FillTransposed(const T* w, int64_t ldw, const float* scale, int64_t cols, int64_t kl,
                           float* p, int64_t ldp) {
  constexpr int W = kW<Vec>;
  const int64_t cw = cols / W * W, kw = kl / W * W;
  for (int64_t c0 = 0; c0 < cw; c0 += W)
    for (int64_t k0 = 0; k0 < kw; k0 += W) {
      Vec t[W];
      for (int c = 0; c < W; ++c) {
        Widen<Vec, T>::Load(t[c], w + (c0 + c) * ldw + k0);
        if (scale) t[c] *= scale[c0 + c];
      }
      TransposeSquare<Vec>(t, std::make_index_sequence<W>());
      for (int i = 0; i < W; ++i) Store(p + (k0 + i) * ldp + c0, t[i]);
    }
  for (int64_t c = 0; c < cols; ++c)  // the edges: columns from cw, rows of w from kw
    for (int64_t kk = c < cw ? kw : 0; kk < kl; ++kk) {
      const float v = Scalar<T>(w + c * ldw + kk);
      p[kk * ldp + c] = scale ? v * scale[c] : v;
    }
}

// Rows [i0, i1) of y (columns [0, cols) from y, n apart) over one panel block p (kl x NB
// floats: kl weight rows from x's column 0, x's rows k apart), added to y's values unless
// `first`: blocks of kPackR rows, then the rest in one narrower block. KnTiles: a full panel
// is one KnBlock; a narrower one takes narrower tiles.
template <typename Vec>
inline void PanelBlock(int64_t i0, int64_t i1, int64_t k, int64_t kl, const float* x,
                       const float* p, int64_t cols, float* y, int64_t n, bool first) {
  constexpr int W = kW<Vec>, V = PackV(W), NB = V * W;
  int64_t i = i0;
  for (; i + kPackR <= i1; i += kPackR)
    KnTiles<Vec, float, kPackR, V>(kl, x + i * k, k, p, NB, nullptr, y + i * n, n, 0, cols, first);
  switch (i1 - i) {
#define FLAX_NARROW_PACKED(R)                                                                \
  case R:                                                                                    \
    KnTiles<Vec, float, R, V>(kl, x + i * k, k, p, NB, nullptr, y + i * n, n, 0, cols, first); \
    break;
    FLAX_NARROW_PACKED(1)
    FLAX_NARROW_PACKED(2)
    FLAX_NARROW_PACKED(3)
    FLAX_NARROW_PACKED(4)
    FLAX_NARROW_PACKED(5)
#undef FLAX_NARROW_PACKED
    default: break;
  }
}

// Nk: w is (n, k), its panels filled transposed; else (k, n).
template <typename Vec, typename T, bool Nk>
void Packed(int64_t m, int64_t k, const float* x, const T* w, int64_t n, const float* scale,
            float* y, int64_t j0, int64_t j1) {
  constexpr int W = kW<Vec>, NB = PackV(W) * W;
  std::vector<float> panel(static_cast<size_t>(kPackK * NB));
  float* p = panel.data();
  for (int64_t j = j0; j < j1; j += NB) {
    const int64_t cols = std::min<int64_t>(NB, j1 - j);
    for (int64_t kb = 0; kb < k; kb += kPackK) {
      const int64_t kl = std::min(kPackK, k - kb);
      if constexpr (Nk) {  // w (n, k): w[j:j+cols, kb:kb+kl] transposed -> p (kl x NB)
        FillTransposed<Vec, T>(w + j * k + kb, k, scale ? scale + j : nullptr, cols, kl, p, NB);
      } else {
        for (int64_t kk = 0; kk < kl; ++kk)  // w[kb:kb+kl, j:j+cols] -> p (kl x NB, cols used)
          WidenRun<Vec, T>(w + (kb + kk) * n + j, cols, scale ? scale + j : nullptr, p + kk * NB);
      }
      PanelBlock<Vec>(0, m, k, kl, x + kb, p, cols, y + j, n, kb == 0);
    }
  }
}

// The whole weight widened (and scaled) once into float32 panels of NB columns, panel q at
// packed + q * k * NB, (k x NB) row-major: the panels [q0, q1). Nk: w is (n, k), else (k, n).
template <typename Vec, typename T, bool Nk>
void FillPanels(int64_t k, const T* w, int64_t n, const float* scale, float* packed, int64_t q0,
                int64_t q1) {
  constexpr int W = kW<Vec>, NB = PackV(W) * W;
  for (int64_t q = q0; q < q1; ++q) {
    const int64_t j = q * NB, cols = std::min<int64_t>(NB, n - j);
    float* p = packed + q * k * NB;
    if constexpr (Nk) {
      FillTransposed<Vec, T>(w + j * k, k, scale ? scale + j : nullptr, cols, k, p, NB);
    } else {
      for (int64_t kk = 0; kk < k; ++kk)
        WidenRun<Vec, T>(w + kk * n + j, cols, scale ? scale + j : nullptr, p + kk * NB);
    }
  }
}

// Rows [i0, i1) of y over every panel FillPanels made: the rows' x (in L2) meets each panel in
// turn, in blocks of kPackK weight rows, as Packed sums them (the same floats, the same order).
template <typename Vec>
void PanelRows(int64_t i0, int64_t i1, int64_t k, const float* x, const float* packed, int64_t n,
               float* y) {
  constexpr int W = kW<Vec>, NB = PackV(W) * W;
  for (int64_t j = 0; j < n; j += NB) {
    const int64_t cols = std::min<int64_t>(NB, n - j);
    const float* panel = packed + j * k;  // (j / NB) * k * NB
    for (int64_t kb = 0; kb < k; kb += kPackK) {
      const int64_t kl = std::min(kPackK, k - kb);
      PanelBlock<Vec>(i0, i1, k, kl, x + kb, panel + kb * NB, cols, y + j, n, kb == 0);
    }
  }
}

// ---- nk: y[r][j] = sum_k x[r][k] e[j][k] (* scale[j]) ----------------------------------------

template <typename Vec>
inline float Sum(const Vec& v) {
#if FLAX_NARROW_LEVEL == 4
  if constexpr (kW<Vec> == 16) {
    __m512 f;
    std::memcpy(&f, &v, sizeof f);
    return _mm512_reduce_add_ps(f);
  }
#endif
#if FLAX_NARROW_LEVEL >= 3
  if constexpr (kW<Vec> == 8) {
    __m256 f;
    std::memcpy(&f, &v, sizeof f);
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
  }
#endif
  float s = 0.0f;
  for (int i = 0; i < kW<Vec>; ++i) s += v[i];
  return s;
}

// A block of J embedding rows (J x k contiguous weights) is read as J streams, a vector of each
// per step, which leaves too few cache misses in flight to keep memory busy: the streaming
// copies prefetch, per step, as many lines of the block kNkAhead blocks on as the step reads
// (GPT-2 small's tied head at one row, AVX-512, 2 threads: bfloat16 22 -> 33 GB/s, int8 16 -> 51
// GB/s, float32 unchanged at 31).
constexpr int kNkAhead = 2;

template <typename Vec, typename T, int R, int J>
inline void NkBlock(int64_t k, const float* x, int64_t ldx, const T* e, int64_t lde,
                    const float* scale, float* y, int64_t ldy) {
  constexpr int W = kW<Vec>;
  Vec acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = Vec{};
  int64_t kk = 0;
  // (an address, maybe past the weights: a prefetch does not fault)
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(e) + kNkAhead * J * lde * sizeof(T);
  constexpr int lines = std::max<int>(1, int(J * W * sizeof(T)) / 64);
  for (; kk + W <= k; kk += W) {
    for (int l = 0; l < lines; ++l)
      __builtin_prefetch(reinterpret_cast<const void*>(ahead + kk * J * sizeof(T) + 64 * l));
    // Per step, the order that fits the vector registers beside the R x J accumulators: the J
    // widened weights then a row at a time (J + 1 more), or, where those do not fit (one row
    // of 8 embedding rows with 16 registers: AVX2), the R rows then a weight at a time (R + 1
    // more): GCC otherwise spills the widened weights to the stack at every step. The sums are
    // the same.
    if constexpr (R * J + J + 1 <= kVectorRegisters<Vec>) {
      Vec ev[J];
      for (int j = 0; j < J; ++j) Widen<Vec, T>::Load(ev[j], e + j * lde + kk);
      for (int r = 0; r < R; ++r) {
        Vec xv;
        LoadF(xv, x + r * ldx + kk);
        for (int j = 0; j < J; ++j) acc[r][j] += xv * ev[j];
      }
    } else {
      Vec xv[R];
      for (int r = 0; r < R; ++r) LoadF(xv[r], x + r * ldx + kk);
      for (int j = 0; j < J; ++j) {
        Vec ev;
        Widen<Vec, T>::Load(ev, e + j * lde + kk);
        for (int r = 0; r < R; ++r) acc[r][j] += xv[r] * ev;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) {
      float sum = Sum(acc[r][j]);
      for (int64_t t = kk; t < k; ++t) sum += x[r * ldx + t] * Scalar<T>(e + j * lde + t);
      y[r * ldy + j] = scale ? sum * scale[j] : sum;
    }
}

constexpr int NkJ(int W, int R) {
  return W == 16 ? (R <= 2 ? 8 : R <= 4 ? 4 : 2) : (R <= 1 ? 8 : R <= 2 ? 4 : R <= 4 ? 2 : 1);
}

template <typename Vec, typename T, int R>
inline void NkRows(int64_t k, const float* x, int64_t ldx, const T* e, const float* scale,
                   float* y, int64_t ldy, int64_t j0, int64_t j1) {
  constexpr int J = NkJ(kW<Vec>, R);
  int64_t j = j0;
  for (; j + J <= j1; j += J)
    NkBlock<Vec, T, R, J>(k, x, ldx, e + j * k, k, scale ? scale + j : nullptr, y + j, ldy);
  for (; j < j1; ++j)
    NkBlock<Vec, T, R, 1>(k, x, ldx, e + j * k, k, scale ? scale + j : nullptr, y + j, ldy);
}

template <typename Vec, typename T>
void NkRange(int64_t m, int64_t k, const float* x, const T* e, int64_t n, const float* scale,
             float* y, int64_t j0, int64_t j1) {
  for (int64_t i = 0; i < m; i += 8) {
    const float* xi = x + i * k;
    float* yi = y + i * n;
    switch (std::min<int64_t>(8, m - i)) {
#define FLAX_NARROW_NK(R) \
  case R: NkRows<Vec, T, R>(k, xi, k, e, scale, yi, n, j0, j1); break;
      FLAX_NARROW_NK(1)
      FLAX_NARROW_NK(2)
      FLAX_NARROW_NK(3)
      FLAX_NARROW_NK(4)
      FLAX_NARROW_NK(5)
      FLAX_NARROW_NK(6)
      FLAX_NARROW_NK(7)
      FLAX_NARROW_NK(8)
#undef FLAX_NARROW_NK
      default: break;
    }
  }
}

// Columns (kn) or embedding rows (nk) [j0, j1) of the product of m rows: the panels from
// kPackRows rows, else each weight widened in registers per pass of 8 rows.
template <typename Vec, typename T>
inline void Range(bool nk, int64_t m, int64_t k, const float* x, const T* w, int64_t n,
                  const float* scale, float* y, int64_t j0, int64_t j1) {
  if (m >= kPackRows) {
    if (nk) {
      Packed<Vec, T, true>(m, k, x, w, n, scale, y, j0, j1);
    } else {
      Packed<Vec, T, false>(m, k, x, w, n, scale, y, j0, j1);
    }
  } else if (nk) {
    NkRange<Vec>(m, k, x, w, n, scale, y, j0, j1);
  } else {
    KnRange<Vec>(m, k, x, w, n, scale, y, j0, j1);
  }
}
