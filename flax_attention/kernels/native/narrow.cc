// Products of a few rows with weights of float32, bfloat16 or int8, for flax_attention's decode
// steps, called through jax.ffi (flax_attention/kernels/native/narrow.py).
//
//   y (m, n) = x (m, k) W     W (k, n), row-major: an nnx.Linear kernel                  ("kn")
//   y (m, n) = x (m, k) E^T   E (n, k), row-major: a tied head's embedding, an int8 layer's
//                             weight (models.quantized.Int8Linear, torch's layout)       ("nk")
//
// times scale (n,) per output feature for int8 weights (symmetric, w = q * scale). x and y are
// float32; each weight is widened to float32 in a register as it is read (bfloat16: its 16 bits
// shifted up; int8: sign-extended and converted) and every product accumulates in float32. A
// decode step multiplies a handful of rows by every weight once, so its time is the time to
// read the weights: narrower weights are read faster, and nothing wider than the weight is ever
// written to memory (XLA's CPU compiler widens a bfloat16 matrix to float32 in memory first).
//
// kn: the columns in tiles of V vectors of W floats; per tile a register block of R rows x V
// vectors accumulates over k, reading per k one short run of a weight row. Neighbouring tiles
// read the neighbouring bytes of the same cache lines, which stay in L2 from one tile to the
// next (a strip of k lines), so memory sees each weight once. Up to 8 rows per pass; more rows
// take more passes. One row reads the weight row by row, in memory order (KnRows).
// nk: per block of J rows of E (contiguous over k) and R rows of x, R x J vector accumulators
// over k, summed across lanes at the end; the next blocks prefetched.
// From kPackRows rows (a prompt's prefill), either layout: the weights are widened once per
// block into a float32 panel in L2 that every block of rows multiplies (Packed; nk's weights
// transposed into the same panels in registers, W x W floats at a time), as a GEMM packs its
// operand: the product runs at the FMAs' rate, as XLA's float32 one does. From kWholeRows
// rows the whole weight is widened into panels first and each task takes a block of rows
// across all of them (FillPanels, PanelRows): the same floats summed in the same order.
// Work is split over XLA's intra-op thread pool by column (kn) or row (nk) ranges.
//
// One source, written with GCC / Clang vector extensions over a vector type of W floats and
// compiled three times on x86-64 (W = 16 for x86-64-v4, AVX-512; 8 for x86-64-v3, AVX2 + FMA;
// 4 for baseline SSE2), each copy its own FFI handler: the package registers every copy this
// CPU runs and uses the widest (the tests run each). Elsewhere, or with one -march
// (FLAX_ATTENTION_ONE_ARCH), one copy.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using Rows = ffi::Buffer<ffi::F32, 2>;  // (no comma in a handler's binding: it is a macro argument)
using Scale = ffi::Buffer<ffi::F32, 1>;

namespace {

using flax_attention::ParallelFor;

#if defined(__GNUC__) && defined(__has_builtin)
#if __has_builtin(__builtin_convertvector) && __has_builtin(__builtin_shufflevector)
#define FLAX_NARROW_VECTORS 1
#endif
#endif
#ifndef FLAX_NARROW_VECTORS
#define FLAX_NARROW_VECTORS 0
#endif

#if defined(__x86_64__) && defined(__GLIBC__) && !defined(__clang__) && __GNUC__ >= 12 && \
    !defined(FLAX_ATTENTION_ONE_ARCH) && FLAX_NARROW_VECTORS
#define FLAX_NARROW_COPIES 1
#else
#define FLAX_NARROW_COPIES 0
#endif

// The weights' element types: float, bfloat16 (its bits), int8.
struct Bf16 {
  uint16_t bits;
};

template <typename T>
inline float Scalar(const T* p);
template <>
inline float Scalar<float>(const float* p) { return *p; }
template <>
inline float Scalar<Bf16>(const Bf16* p) {
  const uint32_t bits = uint32_t(p->bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
template <>
inline float Scalar<int8_t>(const int8_t* p) { return float(*p); }

// Products of this many rows or more widen each weight once into a float32 panel that every
// block of rows multiplies (Packed: narrow_body.h); fewer rows widen it in registers per pass
// of 8 rows. (The scalar build's work split reads it too.)
constexpr int64_t kPackRows = 16;

#if FLAX_NARROW_VECTORS

// One copy's entry: the product over columns [j0, j1) for a weight of element type `type`
// (0 float, 1 bfloat16, 2 int8).
#define FLAX_NARROW_PRODUCT                                                                    \
  __attribute__((flatten)) void Product(int type, bool nk, int64_t m, int64_t k, int64_t n,   \
                                        const float* x, const void* w, const float* scale,    \
                                        float* y, int64_t j0, int64_t j1) {                   \
    switch (type) {                                                                          \
      case 0: Range<Vec>(nk, m, k, x, (const float*)w, n, scale, y, j0, j1); break;          \
      case 1: Range<Vec>(nk, m, k, x, (const Bf16*)w, n, scale, y, j0, j1); break;           \
      case 2: Range<Vec>(nk, m, k, x, (const int8_t*)w, n, scale, y, j0, j1); break;         \
      default: break;                                                                        \
    }                                                                                        \
  }                                                                                          \
  __attribute__((flatten)) void Fill(int type, bool nk, int64_t k, int64_t n, const void* w,    \
                                     const float* scale, float* packed, int64_t q0, int64_t q1) { \
    switch (type * 2 + nk) {                                                                 \
      case 0: FillPanels<Vec, float, false>(k, (const float*)w, n, scale, packed, q0, q1); break; \
      case 1: FillPanels<Vec, float, true>(k, (const float*)w, n, scale, packed, q0, q1); break; \
      case 2: FillPanels<Vec, Bf16, false>(k, (const Bf16*)w, n, scale, packed, q0, q1); break; \
      case 3: FillPanels<Vec, Bf16, true>(k, (const Bf16*)w, n, scale, packed, q0, q1); break; \
      case 4: FillPanels<Vec, int8_t, false>(k, (const int8_t*)w, n, scale, packed, q0, q1); break; \
      case 5: FillPanels<Vec, int8_t, true>(k, (const int8_t*)w, n, scale, packed, q0, q1); break; \
      default: break;                                                                        \
    }                                                                                        \
  }                                                                                          \
  constexpr int64_t kPanelCols = PackV(kW<Vec>) * kW<Vec>;                                   \
  __attribute__((flatten)) void AcrossPanels(int64_t i0, int64_t i1, int64_t k, const float* x, \
                                     const float* packed, int64_t n, float* y) {              \
    PanelRows<Vec>(i0, i1, k, x, packed, n, y);                                              \
  }                                                                                          \
  __attribute__((flatten)) void Part(int type, int64_t m, int64_t k, int64_t n, const float* x, \
                                     const void* w, float* y, int64_t k0, int64_t k1) {      \
    switch (type) {                                                                          \
      case 0: KnPart<Vec>(m, k, x, (const float*)w, n, y, k0, k1); break;                    \
      case 1: KnPart<Vec>(m, k, x, (const Bf16*)w, n, y, k0, k1); break;                     \
      case 2: KnPart<Vec>(m, k, x, (const int8_t*)w, n, y, k0, k1); break;                   \
      default: break;                                                                        \
    }                                                                                        \
  }

#if FLAX_NARROW_COPIES
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
namespace v4 {
typedef float Vec __attribute__((vector_size(64)));
#define FLAX_NARROW_LEVEL 4
#include "narrow_body.h"
#undef FLAX_NARROW_LEVEL
FLAX_NARROW_PRODUCT
}  // namespace v4
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
namespace v3 {
typedef float Vec __attribute__((vector_size(32)));
#define FLAX_NARROW_LEVEL 3
#include "narrow_body.h"
#undef FLAX_NARROW_LEVEL
FLAX_NARROW_PRODUCT
}  // namespace v3
#pragma GCC pop_options
namespace base {
typedef float Vec __attribute__((vector_size(16)));
#define FLAX_NARROW_LEVEL 0
#include "narrow_body.h"
#undef FLAX_NARROW_LEVEL
FLAX_NARROW_PRODUCT
}  // namespace base
#else
namespace base {
#if defined(__AVX512F__)
typedef float Vec __attribute__((vector_size(64)));
#define FLAX_NARROW_LEVEL 4
#elif defined(__AVX2__)
typedef float Vec __attribute__((vector_size(32)));
#define FLAX_NARROW_LEVEL 3
#else
typedef float Vec __attribute__((vector_size(16)));
#define FLAX_NARROW_LEVEL 0
#endif
#include "narrow_body.h"
#undef FLAX_NARROW_LEVEL
FLAX_NARROW_PRODUCT
}  // namespace base
#endif
#undef FLAX_NARROW_PRODUCT

#else  // no vector extensions: scalar loops
namespace base {
void Product(int type, bool nk, int64_t m, int64_t k, int64_t n, const float* x,
                 const void* w, const float* scale, float* y, int64_t j0, int64_t j1) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = j0; j < j1; ++j) {
      float sum = 0.0f;
      for (int64_t kk = 0; kk < k; ++kk) {
        const int64_t at = nk ? j * k + kk : kk * n + j;
        const float v = type == 0   ? ((const float*)w)[at]
                        : type == 1 ? Scalar<Bf16>((const Bf16*)w + at)
                                    : float(((const int8_t*)w)[at]);
        sum += x[r * k + kk] * v;
      }
      y[r * n + j] = scale ? sum * scale[j] : sum;
    }
}
void Part(int type, int64_t m, int64_t k, int64_t n, const float* x, const void* w, float* y,
          int64_t k0, int64_t k1) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < n; ++j) {
      float sum = 0.0f;
      for (int64_t kk = k0; kk < k1; ++kk) {
        const int64_t at = kk * n + j;
        const float v = type == 0   ? ((const float*)w)[at]
                        : type == 1 ? Scalar<Bf16>((const Bf16*)w + at)
                                    : float(((const int8_t*)w)[at]);
        sum += x[r * k + kk] * v;
      }
      y[r * n + j] = sum;
    }
}
}  // namespace base
#endif

using ProductFn = void (*)(int, bool, int64_t, int64_t, int64_t, const float*, const void*,
                           const float*, float*, int64_t, int64_t);
using PartFn = void (*)(int, int64_t, int64_t, int64_t, const float*, const void*, float*, int64_t,
                        int64_t);
using FillFn = void (*)(int, bool, int64_t, int64_t, const void*, const float*, float*, int64_t,
                        int64_t);
using RowsFn = void (*)(int64_t, int64_t, int64_t, const float*, const float*, int64_t, float*);

// From kWholeRows rows, a weight whose panels take up to kWholeFloats floats is widened whole
// into panels first (FillPanels), then each task takes kRowBlock rows of x across every panel
// (PanelRows): the rows stay in L2 while the panels come from L3, where one task per panel
// streams all of x (and y) from memory once per panel. GPT-2 small's six layer products
// (AVX-512, 2 threads, two runs), float32: 8192 rows 212 GFLOP/s against 178 one panel a task,
// 4096 rows 206 against 189, 2048 rows 211 / 197 against 203 / 178; int8 (a prompt's products,
// the only ones below 2048 rows here): 4096 rows 213 against 192, but 1024 rows 203 against
// 214 and 512 rows 186 against 201 (docs/performance.md, "`generate`'s Python, settled rounds,
// and float32 products of many rows").
constexpr int64_t kWholeRows = 2048;
constexpr int64_t kWholeFloats = int64_t(1) << 22;  // 16 MB of panels
constexpr int64_t kRowBlock = 96;

// Products of up to this many rows with a (k, n) weight are split over the weight's rows (one
// contiguous block a task, partial sums added at the end) instead of over its columns.
constexpr int64_t kSplitRows = 8;

// x (m, k) float32; w (k, n) or, nk, (n, k); scale (n,) for int8 and (0,) otherwise; y (m, n).
template <ProductFn product, PartFn part, FillFn fill, RowsFn across, int64_t panel_cols>
ffi::Error Product(ffi::ThreadPool pool, ffi::Buffer<ffi::F32, 2> x, ffi::AnyBuffer w,
                   ffi::Buffer<ffi::F32, 1> scale, ffi::ResultBuffer<ffi::F32, 2> y, bool nk) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (wd.size() != 2) return ffi::Error::InvalidArgument("narrow product: w must be 2-D");
  const int64_t m = xd[0], k = xd[1], n = nk ? wd[0] : wd[1];
  if ((nk ? wd[1] : wd[0]) != k)
    return ffi::Error::InvalidArgument("narrow product: x's and w's contracted sizes differ");
  int type;
  switch (w.element_type()) {
    case ffi::DataType::F32: type = 0; break;
    case ffi::DataType::BF16: type = 1; break;
    case ffi::DataType::S8: type = 2; break;
    default: return ffi::Error::InvalidArgument("narrow product: w must be f32, bf16 or s8");
  }
  const int64_t scales = scale.dimensions()[0];
  if (scales != 0 && scales != n)
    return ffi::Error::InvalidArgument("narrow product: scale must be (n,) or (0,)");
  const float* s = scales ? scale.typed_data() : nullptr;
  const float* xp = x.typed_data();
  const void* wp = w.untyped_data();
  float* yp = y->typed_data();
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {  // an empty sum: zeros, as XLA's product gives
    std::fill(yp, yp + m * n, 0.0f);
    return ffi::Error::Success();
  }
  // Ranges of columns (kn) or embedding rows (nk), whole multiples of 64 so that no two threads
  // share a cache line of y or (kn) of the weights, taken in turn, so that a thread that starts
  // late or is preempted (a busy machine) does not hold the call up: a few per thread for a few
  // rows (longer ranges stream the weights better), 64 columns each from kPackRows rows (one
  // AVX-512 panel, 4 or 8 narrower ones: a panel costs the same whatever the range, and finer
  // items keep both threads busy to the end).
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t align = 64;
  const int64_t panels = (n + align - 1) / align;
  const int64_t chunks =
      std::max<int64_t>(1, m >= kPackRows ? panels : std::min<int64_t>(4 * threads, panels));
  const int64_t step = ((n + chunks - 1) / chunks + align - 1) / align * align;
  const int64_t items = (n + step - 1) / step;
  auto body = [&](int64_t item) {
    const int64_t j0 = item * step, j1 = std::min(n, j0 + step);
    product(type, nk, m, k, n, xp, wp, s, yp, j0, j1);
  };
  if (!nk && m <= kSplitRows && k >= 64 * threads && m * k * n >= (1 << 16)) {
    // Each task one contiguous block of whole weight rows (multiples of 8), its partial
    // product in its own buffer, the buffers summed (and scaled) after.
    const int64_t parts = std::min<int64_t>(2 * threads, k / 32);
    const int64_t rows = ((k + parts - 1) / parts + 7) / 8 * 8;
    const int64_t tasks = (k + rows - 1) / rows;
    std::vector<float> partial(static_cast<size_t>(tasks * m * n));
    ParallelFor(pool, tasks, [&](int64_t t) {
      part(type, m, k, n, xp, wp, partial.data() + t * m * n, t * rows,
           std::min(k, (t + 1) * rows));
    });
    for (int64_t i = 0; i < m * n; ++i) {
      float sum = partial[i];
      for (int64_t t = 1; t < tasks; ++t) sum += partial[t * m * n + i];
      yp[i] = s ? sum * s[i % n] : sum;
    }
    return ffi::Error::Success();
  }
  if constexpr (fill != nullptr) {
    const int64_t panel_count = (n + panel_cols - 1) / panel_cols;
    if (m >= kWholeRows && k * panel_count * panel_cols <= kWholeFloats) {
      // The calling thread's buffer, kept for its next call (up to 16 MB per XLA thread that
      // ever runs such a product) and not zero-filled: XLA may run two products at once from
      // two threads, never two on one, and ParallelFor's caller runs nothing else meanwhile.
      thread_local std::unique_ptr<float[]> buffer;
      thread_local int64_t capacity = 0;
      if (capacity < k * panel_count * panel_cols) {
        capacity = k * panel_count * panel_cols;
        buffer.reset(new float[static_cast<size_t>(capacity)]);
      }
      float* packed = buffer.get();
      ParallelFor(pool, panel_count,
                  [&](int64_t q) { fill(type, nk, k, n, wp, s, packed, q, q + 1); });
      ParallelFor(pool, (m + kRowBlock - 1) / kRowBlock, [&](int64_t b) {
        across(b * kRowBlock, std::min(m, (b + 1) * kRowBlock), k, xp, packed, n, yp);
      });
      return ffi::Error::Success();
    }
  }
  if (items == 1 || m * k * n < (1 << 16)) {
    for (int64_t item = 0; item < items; ++item) body(item);
  } else {
    ParallelFor(pool, items, body);
  }
  return ffi::Error::Success();
}

}  // namespace

// Bit 0: the baseline copy; bit 1: the x86-64-v3 copy; bit 2: the x86-64-v4 copy; each set
// where the library has that copy and this CPU runs it.
extern "C" int FlaxNarrowLevels() {
#if FLAX_NARROW_COPIES
  __builtin_cpu_init();
  const bool v3 = __builtin_cpu_supports("x86-64-v3");
  const bool v4 = __builtin_cpu_supports("x86-64-v4");
  return 1 | (v3 ? 2 : 0) | (v3 && v4 ? 4 : 0);
#else
  return 1;
#endif
}

// 1 on an x86-64 CPU without an instruction that multiplies bfloat16 pairs into float32 sums
// (AVX512_BF16's vdpbf16ps, AMX-BF16), where XLA's CPU product of bfloat16 operands runs at a
// fraction of float32's rate and the kernel's widened panels beat it at any number of rows
// (docs/performance.md, "bfloat16 and int8 on an AVX2 CPU"); 0 where the CPU has one, or
// where this build cannot tell (not x86-64, not GCC 12+).
extern "C" int FlaxNarrowSlowBf16Dot() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
  __builtin_cpu_init();
  return !(__builtin_cpu_supports("avx512bf16") || __builtin_cpu_supports("amx-bf16"));
#else
  return 0;
#endif
}

// 1 where this CPU has AMX's bfloat16 tile products (AMX-BF16): there XLA's bfloat16 product
// of a few rows ran slower than the kernel's up to 8 rows (an Intel Xeon: 8 rows at 0.33-0.97
// of float32's time against the kernel's 0.25-0.54), where on a CPU with AVX512_BF16 alone it
// is as fast from 5 rows (docs/performance.md, "An Intel Xeon with AMX"); 0 where it has none,
// or where this build cannot tell (not x86-64, not GCC 12+).
extern "C" int FlaxNarrowTileBf16() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
  __builtin_cpu_init();
  return __builtin_cpu_supports("amx-bf16") ? 1 : 0;
#else
  return 0;
#endif
}

// The floats per vector of the widest vectors this CPU runs (16: AVX-512, 8: AVX2 with FMA, 4:
// SSE2), whatever copies the library holds: a one-arch AVX2 build on an AVX-512 CPU runs
// narrower vectors than XLA's own code there. 0 where this build cannot tell (not x86-64, not
// GCC 12+).
extern "C" int FlaxNarrowCpuWidth() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return 16;
  return __builtin_cpu_supports("x86-64-v3") ? 8 : 4;
#else
  return 0;
#endif
}

// The floats per vector of the copy with bit `level` (0, 1, 2) of FlaxNarrowLevels.
extern "C" int FlaxNarrowWidth(int level) {
#if FLAX_NARROW_COPIES
  return level == 2 ? 16 : level == 1 ? 8 : 4;
#elif FLAX_NARROW_VECTORS && defined(__AVX512F__)
  return level == 0 ? 16 : 0;
#elif FLAX_NARROW_VECTORS && defined(__AVX__)
  return level == 0 ? 8 : 0;
#elif FLAX_NARROW_VECTORS
  return level == 0 ? 4 : 0;
#else
  return level == 0 ? 1 : 0;
#endif
}

#if FLAX_NARROW_VECTORS
#define FLAX_NARROW_FILL(fn) fn::Fill
#define FLAX_NARROW_ROWS(fn) fn::AcrossPanels
#define FLAX_NARROW_PANEL(fn) fn::kPanelCols
#else
#define FLAX_NARROW_FILL(fn) nullptr
#define FLAX_NARROW_ROWS(fn) nullptr
#define FLAX_NARROW_PANEL(fn) 1
#endif
#define FLAX_NARROW_HANDLER(symbol, fn)                                  \
  static ffi::Error symbol##Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32, 2> x, ffi::AnyBuffer w, \
                          ffi::Buffer<ffi::F32, 1> scale, ffi::ResultBuffer<ffi::F32, 2> y, \
                          bool nk) {                                     \
    return Product<fn::Product, fn::Part, FLAX_NARROW_FILL(fn), FLAX_NARROW_ROWS(fn),        \
                   FLAX_NARROW_PANEL(fn)>(pool, x, w, scale, y, nk);                          \
  }                                                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, symbol##Impl,                    \
                                ffi::Ffi::Bind()                         \
                                    .Ctx<ffi::ThreadPool>()              \
                                    .Arg<Rows>()                         \
                                    .Arg<ffi::AnyBuffer>()               \
                                    .Arg<Scale>()                        \
                                    .Ret<Rows>()                         \
                                    .Attr<bool>("nk"));

FLAX_NARROW_HANDLER(FlaxNarrowProductBase, base)
#if FLAX_NARROW_COPIES
FLAX_NARROW_HANDLER(FlaxNarrowProductV3, v3)
FLAX_NARROW_HANDLER(FlaxNarrowProductV4, v4)
#endif
