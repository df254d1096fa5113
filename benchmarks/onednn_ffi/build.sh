#!/usr/bin/env bash
# Builds _onednn_ffi.so beside this script against a private oneDNN prefix (lib/ and include/).
#   ONEDNN_ROOT  the prefix (required: PyPI onednn-cpu-gomp 2023.2.0 +
#                onednn-devel-cpu-gomp, unzipped; see README in __init__.py's docstring)
#   PYTHON       a Python with jax (for jax.ffi.include_dir()); default python3
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="${ONEDNN_ROOT:?set ONEDNN_ROOT to a oneDNN prefix with include/ and lib/}"
py="${PYTHON:-python3}"
ffi_inc="$("$py" -c 'import jax.ffi; print(jax.ffi.include_dir())')"
# DT_RPATH (not RUNPATH) so libdnnl's own dependencies are found in the prefix too.
exec g++ -O3 -shared -fPIC -std=c++17 -o "$here/_onednn_ffi.so" "$here/onednn_ffi.cc" \
  -I"$ffi_inc" -I"$root/include" -L"$root/lib" -ldnnl \
  -Wl,--disable-new-dtags,-rpath,"$root/lib"
