// A decode cache's write, in place: the new tokens' rows go into the cache at `index`, called
// through jax.ffi with the cache aliased to the result (flax_attention/kernels/native/cache_write.py);
// and the rows of a bfloat16 embedding table at token ids (table_rows.py), below.
//
//   cache (..., S, F) any dtype, rows (..., n, F) of the same dtype and leading shape, index ()
//   int32 -> the cache with rows [index, index + n) of every leading slice replaced, or the
//   cache as it was where they do not fit (index + n > S).
//
// XLA's own dynamic-update-slice does this in place only where nothing else in the program
// keeps the old cache or reads the new one through a fusion: in a decode step it does not. The
// step's attention reads the updated cache through dots whose operand fusions take the update
// in again, out of place, so every step copied each layer's whole cache up to five times, and
// XLA's CPU compiler widens a bfloat16 update to float32 over the whole cache. A custom call is
// never fused: the cache is written once, in place, and read where it lies.

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using Index = ffi::Buffer<ffi::S32, 0>;  // (no comma in a handler's binding: it is a macro argument)
using Ids = ffi::Buffer<ffi::S32, 1>;

namespace {

ffi::Error CacheWrite(ffi::AnyBuffer cache, ffi::AnyBuffer rows, Index index,
                      ffi::Result<ffi::AnyBuffer> out) {
  const auto cd = cache.dimensions();
  const auto rd = rows.dimensions();
  if (cd.size() < 2 || rd.size() != cd.size())
    return ffi::Error::InvalidArgument("cache write: cache and rows must have the same rank >= 2");
  if (cache.element_type() != rows.element_type())
    return ffi::Error::InvalidArgument("cache write: cache and rows must have one dtype");
  const size_t rank = cd.size();
  int64_t slices = 1;
  for (size_t i = 0; i + 2 < rank; ++i) {
    if (cd[i] != rd[i])
      return ffi::Error::InvalidArgument("cache write: cache and rows' leading shapes differ");
    slices *= cd[i];
  }
  if (cd[rank - 1] != rd[rank - 1])
    return ffi::Error::InvalidArgument("cache write: cache and rows' feature sizes differ");
  const int64_t length = cd[rank - 2], n = rd[rank - 2];
  const size_t row_bytes = cd[rank - 1] * ffi::ByteWidth(cache.element_type());
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != cache.untyped_data())  // not aliased: start from the cache as it is
    std::memcpy(dst, cache.untyped_data(), cache.size_bytes());
  const int64_t at = *index.typed_data();
  if (at < 0 || at + n > length) return ffi::Error::Success();  // does not fit: unchanged
  const char* src = static_cast<const char*>(rows.untyped_data());
  for (int64_t s = 0; s < slices; ++s)
    std::memcpy(dst + (s * length + at) * row_bytes, src + s * n * row_bytes, n * row_bytes);
  return ffi::Error::Success();
}

// out (n, F) = table (V, F) [ids (n,)], any dtype: a negative id counts from the end, as
// NumPy's; an id out of range gives a row of all-ones bytes (NaN in a float table), as
// jnp.take's fill. XLA's CPU compiler widens a bfloat16 gather's whole table to float32 and,
// where the lookup is inside a loop (generate's), hoists that widening out of it: the whole
// table copied at every call. A custom call reads only the rows it returns.
ffi::Error TableRows(ffi::AnyBuffer table, Ids ids, ffi::Result<ffi::AnyBuffer> out) {
  const auto td = table.dimensions();
  const auto od = out->dimensions();
  const int64_t n = ids.dimensions()[0];
  if (td.size() != 2 || od.size() != 2 || od[0] != n || od[1] != td[1] ||
      out->element_type() != table.element_type())
    return ffi::Error::InvalidArgument("table rows: table (V, F), ids (n,) and out (n, F)");
  const int64_t rows = td[0];
  const size_t row_bytes = td[1] * ffi::ByteWidth(table.element_type());
  const char* src = static_cast<const char*>(table.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  const int32_t* id = ids.typed_data();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t at = id[i] < 0 ? id[i] + rows : id[i];
    if (at >= 0 && at < rows) {
      std::memcpy(dst + i * row_bytes, src + at * row_bytes, row_bytes);
    } else {
      std::memset(dst + i * row_bytes, 0xff, row_bytes);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlaxTableRows, TableRows,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<Ids>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlaxCacheWrite, CacheWrite,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Index>()
                                  .Ret<ffi::AnyBuffer>());
