// oneDNN matmul behind one XLA FFI handler: a measurement candidate against XLA's own dot.
//
// out (m, n) float32 = x (m, k) @ w, where w is (k, n) row-major, or (n, k) row-major when the
// attribute nk is true (then out = x @ w.T; read in place as a (k, n) matrix with the `ba` tag).
//   x: float32 or bfloat16.  w: float32, bfloat16 or int8.  scale: float32 (n,) or empty (0,).
//   f32 x f32, bf16 x bf16: oneDNN matmul with an f32 destination; a non-empty scale multiplies
//     the output columns afterwards (a short loop here).
//   float x int8 ("weights decompression"): matmul with fpmath_mode + apply_to_int and the scale
//     as a per-N weights scale (mask 1 << 1). Needs oneDNN >= 3.4 (apply_to_int); with an older
//     library the handler returns an Unimplemented error saying so.
// Weights are not reordered by default: plain `ab`/`ba` memory descriptors, so a call reads the
// caller's buffer as it is. Attribute packed=true (measurement only) instead reorders the weights
// once per weights address into the layout oneDNN prefers (format_tag::any) and reuses that copy:
// stale if other weights later arrive at the same address. Primitives are cached per (m, k, n, dtypes, nk, scaled) behind a mutex.
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#define ONEDNN_FFI_VERSION (DNNL_VERSION_MAJOR * 100 + DNNL_VERSION_MINOR)

dnnl::engine& Engine() {
  static dnnl::engine* engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

dnnl::stream& Stream() {
  // CPU streams execute synchronously; one per calling thread keeps concurrent XLA callers apart.
  thread_local dnnl::stream stream(Engine());
  return stream;
}

using Key = std::tuple<int64_t, int64_t, int64_t, int, int, bool, bool>;

struct Entry {
  dnnl::matmul prim;
  dnnl::memory::desc x_md, w_md, dst_md, scale_md;
  // The `packed` variant: weights in the layout oneDNN picks (format_tag::any), reordered once
  // per weights pointer (see PackedWeights). packed_prim is prim when that layout is the plain one.
  dnnl::matmul packed_prim;
  dnnl::memory::desc packed_w_md;
  bool packed_is_plain = true;
  bool scale_in_attr = false;  // scale applied by oneDNN (int8 weights); else by the loop below
};

std::mutex cache_mutex;
std::map<Key, std::shared_ptr<Entry>>& Cache() {
  static auto* cache = new std::map<Key, std::shared_ptr<Entry>>();
  return *cache;
}

bool ToDnnl(ffi::DataType t, dnnl::memory::data_type* out) {
  switch (t) {
    case ffi::DataType::F32: *out = dnnl::memory::data_type::f32; return true;
    case ffi::DataType::BF16: *out = dnnl::memory::data_type::bf16; return true;
    case ffi::DataType::S8: *out = dnnl::memory::data_type::s8; return true;
    default: return false;
  }
}

// Builds (or finds) the primitive; returns an error message on failure.
std::shared_ptr<Entry> GetEntry(int64_t m, int64_t k, int64_t n, dnnl::memory::data_type xt,
                                dnnl::memory::data_type wt, bool nk, bool scaled,
                                std::string* why) {
  Key key{m, k, n, static_cast<int>(xt), static_cast<int>(wt), nk, scaled};
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto it = Cache().find(key);
  if (it != Cache().end()) return it->second;
  using md = dnnl::memory::desc;
  using tag = dnnl::memory::format_tag;
  auto e = std::make_shared<Entry>();
  e->x_md = md({m, k}, xt, tag::ab);
  e->w_md = md({k, n}, wt, nk ? tag::ba : tag::ab);
  e->dst_md = md({m, n}, dnnl::memory::data_type::f32, tag::ab);
  dnnl::primitive_attr attr;
  const bool int_w = wt == dnnl::memory::data_type::s8;
  if (int_w) {
#if ONEDNN_FFI_VERSION >= 304
    attr.set_fpmath_mode(xt == dnnl::memory::data_type::bf16 ? dnnl::fpmath_mode::bf16
                                                              : dnnl::fpmath_mode::strict,
                         /*apply_to_int=*/true);
    if (scaled) {
      attr.set_scales_mask(DNNL_ARG_WEIGHTS, 1 << 1);  // one scale per N column of (k, n)
      e->scale_md = md({n}, dnnl::memory::data_type::f32, tag::a);
      e->scale_in_attr = true;
    }
#else
    *why = "int8 weights with float activations need oneDNN >= 3.4 (fpmath_mode apply_to_int, "
           "'weights decompression'); this library is " +
           std::to_string(DNNL_VERSION_MAJOR) + "." + std::to_string(DNNL_VERSION_MINOR);
    return nullptr;
#endif
  }
  try {
    dnnl::matmul::primitive_desc pd(Engine(), e->x_md, e->w_md, e->dst_md, attr);
    e->prim = dnnl::matmul(pd);
    dnnl::matmul::primitive_desc ppd(Engine(), e->x_md, md({k, n}, wt, tag::any), e->dst_md,
                                     attr);
    e->packed_w_md = ppd.weights_desc();
    e->packed_is_plain = e->packed_w_md == e->w_md;
    e->packed_prim = e->packed_is_plain ? e->prim : dnnl::matmul(ppd);
  } catch (const dnnl::error& err) {
    *why = std::string("oneDNN matmul primitive_desc failed: ") + err.what();
    return nullptr;
  }
  Cache().emplace(key, e);
  return e;
}

// Weights reordered to the primitive's preferred layout, once per (weights pointer, primitive).
// MEASUREMENT ONLY: keyed by address, so new contents at an address already seen are NOT seen
// (stale results) and packed copies are never freed.
std::mutex packed_mutex;
dnnl::memory PackedWeights(const Entry& e, void* w) {
  static auto* packed = new std::map<std::pair<const void*, const Entry*>, dnnl::memory>();
  std::lock_guard<std::mutex> lock(packed_mutex);
  auto key = std::make_pair(static_cast<const void*>(w), &e);
  auto it = packed->find(key);
  if (it != packed->end()) return it->second;
  dnnl::memory plain(e.w_md, Engine(), w);
  dnnl::memory mem(e.packed_w_md, Engine());
  dnnl::reorder(plain, mem).execute(Stream(), plain, mem);
  Stream().wait();
  packed->emplace(key, mem);
  return mem;
}

ffi::Error MatmulImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale, bool nk,
                      bool packed, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2)
    return ffi::Error::InvalidArgument("onednn_matmul: x and w must be 2-D");
  const int64_t m = xd[0], k = xd[1];
  const int64_t n = nk ? wd[0] : wd[1];
  if ((nk ? wd[1] : wd[0]) != k)
    return ffi::Error::InvalidArgument("onednn_matmul: contracting dimensions differ");
  const int64_t ns = scale.element_count();
  if (ns != 0 && ns != n)
    return ffi::Error::InvalidArgument("onednn_matmul: scale must be (n,) or (0,)");
  dnnl::memory::data_type xt, wt;
  if (!ToDnnl(x.element_type(), &xt) || xt == dnnl::memory::data_type::s8)
    return ffi::Error::InvalidArgument("onednn_matmul: x must be float32 or bfloat16");
  if (!ToDnnl(w.element_type(), &wt))
    return ffi::Error::InvalidArgument("onednn_matmul: w must be float32, bfloat16 or int8");
  if (m == 0 || n == 0) return ffi::Error::Success();
  std::string why;
  auto e = GetEntry(m, k, n, xt, wt, nk, ns != 0, &why);
  if (!e) return ffi::Error(ffi::ErrorCode::kUnimplemented, why);
  float* dst = out->typed_data();
  try {
    dnnl::memory xm(e->x_md, Engine(), x.untyped_data());
    const bool use_packed = packed && !e->packed_is_plain;
    dnnl::memory wm = use_packed ? PackedWeights(*e, w.untyped_data())
                                 : dnnl::memory(e->w_md, Engine(), w.untyped_data());
    const dnnl::matmul& prim = use_packed ? e->packed_prim : e->prim;
    dnnl::memory dm(e->dst_md, Engine(), dst);
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, dm}};
    if (e->scale_in_attr)
      args.emplace(DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS,
                   dnnl::memory(e->scale_md, Engine(), scale.typed_data()));
    prim.execute(Stream(), args);
    Stream().wait();
  } catch (const dnnl::error& err) {
    return ffi::Error::Internal(std::string("oneDNN matmul execute failed: ") + err.what());
  }
  if (ns != 0 && !e->scale_in_attr) {
    const float* s = scale.typed_data();
    for (int64_t i = 0; i < m; ++i) {
      float* row = dst + i * n;
      for (int64_t j = 0; j < n; ++j) row[j] *= s[j];
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // x
                                  .Arg<ffi::AnyBuffer>()         // w
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale
                                  .Attr<bool>("nk")
                                  .Attr<bool>("packed")
                                  .Ret<ffi::Buffer<ffi::F32>>());

// For the Python side: which oneDNN this was built and runs with, and its threading runtime.
extern "C" const char* OnednnFfiInfo() {
  static std::string info;
  if (info.empty()) {
    const dnnl_version_t* v = dnnl_version();
    const char* thr = v->cpu_runtime == DNNL_RUNTIME_OMP   ? "OpenMP"
                      : v->cpu_runtime == DNNL_RUNTIME_TBB ? "TBB"
                      : v->cpu_runtime == DNNL_RUNTIME_SEQ ? "sequential"
                      : v->cpu_runtime == DNNL_RUNTIME_THREADPOOL ? "threadpool"
                      : v->cpu_runtime == DNNL_RUNTIME_SYCL ? "SYCL"
                                                            : "other";
    char buf[160];
    std::snprintf(buf, sizeof buf, "oneDNN %d.%d.%d (%s), cpu runtime %s, built against %d.%d",
                  v->major, v->minor, v->patch, v->hash, thr, DNNL_VERSION_MAJOR,
                  DNNL_VERSION_MINOR);
    info = buf;
  }
  return info.c_str();
}
