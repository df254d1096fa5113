"""What the layers are built of, and run in every forward: the Linear factory and its row-parallel
product (with the narrow-weight kernel for a decode step's few rows), ``Embed`` and ``Dropout``;
and ``LayerOptions``, the Flax options a model hands down to every layer it builds, as one value.

Their initialisers are ``flax_attention._init``'s (torch's distributions); their mesh decisions
are ``flax_attention.mesh``'s, reached only where a mesh is set.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from flax_attention._init import partitioned, torch_linear_bias_init, torch_linear_kernel_init
from flax_attention.mesh import (
    LinearAxes,
    lookup_sharding,
    reduced_sharding,
    spec_of,
    unsplit,
)

__all__ = [
    "FLOAT32_FEW_ROWS",
    "FLOAT32_ROWS",
    "FLOAT32_WEIGHT",
    "NARROW_ROWS",
    "TILE_BFLOAT16_ROWS",
    "Dropout",
    "Embed",
    "LayerOptions",
    "linear_factory",
    "narrow_product_ok",
    "rows_dot_general",
]

#: The most rows a product sends to the narrow-weight kernel (``kernels.native.narrow``), per
#: weight dtype (``None``: any number). Where each crosses over (the ``products`` benchmark,
#: docs/performance.md, "Products per weight dtype"): bfloat16 from 2 rows on XLA's product (a
#: float32 result) runs at 0.5-0.76 of float32's time, the kernel's at 0.4-0.63 up to 4 rows,
#: 0.7-0.76 at 8 and 1.0-1.3 at 16 (at one row XLA's takes 6-9x: it widens the whole matrix
#: first). int8 is the kernel's at every size: XLA has no int8-weight product and converts the
#: whole matrix to float32 in memory first (2.4-3.9x float32's time at 32 rows, 1.2-1.3x at
#: 512), where the kernel takes 0.4-1.1x (from 16 rows it widens each block of weights once
#: into a float32 panel that every block of rows multiplies). On a CPU without bfloat16 pair
#: products (AVX2: ``narrow.slow_bfloat16_dot``) bfloat16 is the kernel's at every size too: XLA's
#: bfloat16 product there ran at 0.7 of float32's rate at 512 rows, the kernel's at 0.8-1.0
#: (docs/performance.md, "bfloat16 and int8 on an AVX2 CPU").
NARROW_ROWS = {jnp.dtype(jnp.bfloat16): 4, jnp.dtype(jnp.int8): None}

#: The most rows of a bfloat16 product that go to the kernel on a CPU with AMX's bfloat16 tile
#: products (``narrow.tile_bfloat16``): on an Intel Xeon XLA's bfloat16 product of 8 rows took
#: 0.33-0.97 of float32's time there, the kernel's 0.25-0.54 (0.32-0.79 of XLA's bfloat16 time
#: from 1 to 8 rows, 0.84-1.28 at 16; docs/performance.md, "An Intel Xeon with AMX").
TILE_BFLOAT16_ROWS = 8

#: The most rows of a float32 product with a ``(k, n)`` weight that go to the kernel where it
#: runs AVX-512, from 2 (one row stays XLA's: 0.84-1.18 of its time on the kernel). On an Intel
#: Xeon the kernel took 0.47-0.77 of XLA's time at 2 to 8 rows and 0.73-1.05 at 16; on a Zen 4
#: 0.78-0.87 at 8 (docs/performance.md, "An Intel Xeon with AMX"). With AVX2 XLA's is faster
#: (1.08-1.17 at 8 rows on the kernel), and with ``(n, k)`` weights (the tied head: 1.34).
FLOAT32_FEW_ROWS = 8

#: The fewest rows of a float32 product that go to the kernel, with a weight of at most
#: ``FLOAT32_WEIGHT`` floats, where its copy runs the CPU's widest vectors (AVX-512 or AVX2: a
#: narrower copy loses to XLA's own code). From 2048 rows the kernel widens the whole weight
#: into panels and each task takes a block of rows across all of them: GPT-2 small's six layer
#: products ran at 212 GFLOP/s on it at 8192 rows against XLA's dot (YNNPACK's) 167, at 2048
#: rows 197-211 against 168-201 (AVX-512); on an AVX2 CPU (Zen 3) the attention layer's
#: 768x768 product at 137-147 against 112-120, the MLP's as fast as XLA's or faster; below,
#: XLA's is as fast or faster (docs/performance.md, "`generate`'s Python, settled rounds, and
#: float32 products of many rows" and "bfloat16 and int8 on an AVX2 CPU").
FLOAT32_ROWS = 2048
FLOAT32_WEIGHT = 1 << 22  # 16 MB; a weight whose padded panels pass it takes a panel a task


def narrow_product_ok(rows: int, weight, *, nk: bool = False) -> bool:
    """Whether a product of ``rows`` rows with ``weight`` (``(k, n)``, or ``(n, k)`` with
    ``nk``) runs on the narrow-weight kernel: a bfloat16 weight at up to
    ``NARROW_ROWS[bfloat16]`` rows (``TILE_BFLOAT16_ROWS`` where the CPU has AMX's bfloat16
    tiles, any number where it has no bfloat16 pair products), an int8 weight at any number, a
    float32 one of at most ``FLOAT32_WEIGHT`` floats from ``FLOAT32_ROWS`` rows where the kernel
    runs the CPU's widest vectors (AVX-512 or AVX2), or of 2 to ``FLOAT32_FEW_ROWS`` rows with
    a ``(k, n)`` weight where those are AVX-512's; on the CPU with the kernel built, outside any
    mesh (a custom call would gather a sharded weight onto every device)."""
    dtype = jnp.dtype(weight.dtype)
    if weight.ndim != 2 or rows < 1:
        return False
    few = 2 <= rows <= FLOAT32_FEW_ROWS and not nk
    if dtype == jnp.float32:
        if not (few or rows >= FLOAT32_ROWS) or weight.size > FLOAT32_WEIGHT:
            return False
    elif dtype not in NARROW_ROWS:
        return False
    if jax.default_backend() != "cpu" or not jax.sharding.get_abstract_mesh().empty:
        return False
    from flax_attention.kernels.native import narrow

    if not narrow.available():
        return False
    if dtype == jnp.float32:  # AVX-512 or AVX2, the vectors XLA's own code runs here
        widest = narrow.width() >= 8 and narrow.width() == narrow.cpu_width()
        return widest and (rows >= FLOAT32_ROWS or narrow.width() == 16)
    limit = NARROW_ROWS[dtype]
    if dtype == jnp.bfloat16 and narrow.slow_bfloat16_dot():
        limit = None  # XLA's bfloat16 product is the slower one here at any rows
    elif dtype == jnp.bfloat16 and narrow.tile_bfloat16():
        limit = TILE_BFLOAT16_ROWS
    return limit is None or rows <= limit


@functools.cache
def _kernel_product(nk: bool):
    """``narrow.matmul(rows, weight, nk=nk)`` whose ``vmap`` over the rows is one call on every
    element's rows stacked (``jax.vmap`` of the custom call alone runs one call per element,
    each reading the whole weight: 64 elements of 6 rows against GPT-2's ``768x3072`` weight,
    48 ms that way, 18 ms stacked); a weight mapped too is XLA's product of float32 operands."""
    from flax_attention.kernels.native import narrow

    @jax.custom_batching.custom_vmap
    def product(rows, weight):
        return narrow.matmul(rows, weight, nk=nk)

    @product.def_vmap
    def _batched(axis_size, in_batched, rows, weight):
        rows_batched, weight_batched = in_batched
        if weight_batched:  # each element its own weight
            rows = rows if rows_batched else jnp.broadcast_to(rows, (axis_size, *rows.shape))
            spec = "bmk,bnk->bmn" if nk else "bmk,bkn->bmn"
            highest = jax.lax.Precision.HIGHEST
            out = jnp.einsum(spec, rows.astype(jnp.float32), weight.astype(jnp.float32),
                             precision=highest)  # fmt: skip
            return out, True
        m, k = rows.shape[1:]  # the rows are mapped (the rule runs only when one input is)
        out = product(rows.reshape(axis_size * m, k), weight)  # (axis_size * m, n)
        return out.reshape(axis_size, m, out.shape[-1]), True

    return product


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _narrow(rows, weight, nk: bool):
    """``rows (m, k) @ weight`` (``(k, n)``, or ``(n, k)`` with ``nk``) on the narrow kernel,
    float32. Its derivatives are XLA's products of the same operands: the tangent rule below,
    which reverse mode transposes (``d_out @ w.T``, ``x.T @ d_out``), so ``jvp``, ``grad`` and
    their compositions all work; under ``vmap`` the elements' rows are one call
    (``_kernel_product``)."""
    return _kernel_product(nk)(rows, weight)


@_narrow.defjvp
def _narrow_jvp(nk, primals, tangents):
    rows, weight = primals
    d_rows, d_weight = tangents
    w = weight.astype(jnp.float32)
    d_out = d_rows.astype(jnp.float32) @ (w.T if nk else w)  # (m, n)
    if jnp.issubdtype(weight.dtype, jnp.floating):  # an int8 weight has no tangent
        d_w = d_weight.astype(jnp.float32)
        d_out = d_out + rows.astype(jnp.float32) @ (d_w.T if nk else d_w)
    return _narrow(rows, weight, nk), d_out


class Embed(nnx.Embed):
    """``nnx.Embed`` whose lookup, on an ``Explicit`` mesh, is laid out like its ids, features
    whole (``jnp.take`` cannot tell on its own when the ids are split over ``data``), unless
    ``out_sharding`` is given: the models' embeddings name no layout, as the Linears name none
    (``rows_dot_general``). A bfloat16 table's rows come from the native lookup where it runs
    (``kernels.native.table_rows``: XLA's gather would widen the whole table)."""

    def __call__(self, inputs, out_sharding=None):
        if out_sharding is None and not jax.sharding.get_abstract_mesh().empty:
            out_sharding = lookup_sharding(inputs)
        table = self.embedding[...]
        unchanged = self.dtype in (None, table.dtype)
        if out_sharding is None and table.dtype == jnp.bfloat16 and unchanged:
            from flax_attention.kernels.native import table_rows

            if table_rows.usable(table, inputs):  # XLA would widen the whole table first
                return table_rows.take(table, inputs)
        return super().__call__(inputs, out_sharding=out_sharding)


class Dropout(nnx.Dropout):
    """``nnx.Dropout`` with the same keep-mask, drawn flat: ``bernoulli(key, 1 - rate,
    (x.size,))`` reshaped to ``x.shape``. Threefry draws a shape's bits as the flat draw of its
    size, reshaped (either way ``jax_threefry_partitionable`` is set), so these are the bits
    ``nnx.Dropout`` draws for ``x.shape``, bit for bit; XLA's CPU backend compiles the flat draw
    several times faster (its multi-dimensional index arithmetic is what takes long; the
    measurements: docs/performance.md).

    ``nnx.Dropout``'s own call runs where the flat draw could lay the mask out differently
    (a mesh set, or inputs split over mesh axes), with ``broadcast_dims``, for a key of another
    generator than Threefry, and where it draws nothing (deterministic, rate 0 or 1)."""

    def __call__(self, inputs, *, deterministic=None, rngs=None):
        deterministic = self.deterministic if deterministic is None else deterministic
        if (
            deterministic is not False
            or not 0.0 < self.rate < 1.0
            or self.broadcast_dims
            or not unsplit(inputs)
        ):
            return super().__call__(inputs, deterministic=deterministic, rngs=rngs)
        stream = self.rngs if rngs is None else rngs
        if isinstance(stream, nnx.Rngs):
            stream = stream[self.rng_collection]
        if isinstance(stream, nnx.RngStream):
            key = stream()
        elif isinstance(stream, jax.Array):
            key = stream
        else:  # nnx.Dropout's own error
            return super().__call__(inputs, deterministic=deterministic, rngs=rngs)
        if str(jax.random.key_impl(key)) != "threefry2x32":
            return super().__call__(inputs, deterministic=deterministic, rngs=key)
        keep_prob = 1.0 - self.rate
        keep = jax.random.bernoulli(key, keep_prob, (math.prod(inputs.shape),))
        keep = keep.reshape(inputs.shape)
        return jax.lax.select(keep, inputs / keep_prob, jnp.zeros_like(inputs))


def rows_dot_general(lhs, rhs, dimension_numbers, precision=None, **options):
    """``jax.lax.dot_general`` for ``nnx.Linear`` and the tied head: ``x (..., d_in) @ kernel
    (d_in, d_out)`` (or ``@ table.T`` for a ``(d_out, d_in)`` table) as one ``(rows, d_in)``
    product on ``x`` flattened to rows, then reshaped back; the same numbers, and the same call
    as ``dot_general`` where the leading axes carry sharding in their type (an ``Explicit``
    mesh), ``out_sharding`` is given, or the contraction is another one. On an ``Explicit``
    mesh a product over features split across a mesh axis gets its ``out_sharding`` here
    (``flax_attention.mesh.reduced_sharding``), so the layers name none.

    Why: the kernel's gradient of the ``(b, t, d_in)`` product is a contraction over two axes,
    and XLA's CPU compiler transposes the incoming gradient for it; in a deep model that
    transpose fuses the residual stream's whole chain of gradient additions, recomputed per
    layer (quadratic in depth), and for the tied head it copies the ``(b * t, V)`` gradient of
    the logits. On rows the same gradient is one plain product, no transpose (the measurements:
    docs/performance.md, "Where a training step's time goes").

    A decode step's few rows (``narrow_product_ok``) go to the narrow-weight kernel, which reads
    a bfloat16 or int8 matrix at its own width (XLA widens it to float32 in memory first), and
    so do float32 products of many rows (``FLOAT32_ROWS``), which it runs faster than XLA's dot;
    the result is float32 rounded to the product's dtype."""
    (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = dimension_numbers
    rows_by_matrix = (  # x (..., d_in) @ a 2-D weight, over x's last axis
        lhs.ndim >= 2
        and rhs.ndim == 2
        and not lhs_batch
        and not rhs_batch
        and tuple(lhs_contracting) == (lhs.ndim - 1,)
    )
    no_mesh = jax.sharding.get_abstract_mesh().empty
    if rows_by_matrix and not no_mesh and options.get("out_sharding") is None:
        options["out_sharding"] = reduced_sharding(lhs, rhs, rhs_contracting)
    plain = (
        rows_by_matrix
        and options.get("out_sharding") is None
        and (no_mesh or not any(spec_of(lhs)))
    )
    count = math.prod(lhs.shape[:-1])
    nk = tuple(rhs_contracting) == (1,)
    # (a float32 product of other row counts is XLA's without asking: a forward's every Linear)
    few = 2 <= count <= FLOAT32_FEW_ROWS
    small = not few and count < FLOAT32_ROWS and jnp.dtype(rhs.dtype) == jnp.float32
    if plain and not small and narrow_product_ok(count, rhs, nk=nk):
        rows = lhs.reshape(-1, lhs.shape[-1])  # (rows, d_in)
        dtype = options.get("preferred_element_type") or jnp.result_type(lhs, rhs)
        out = _narrow(rows, rhs, nk).astype(dtype)  # (rows, d_out)
        return out.reshape(*lhs.shape[:-1], out.shape[-1])  # (..., d_out)
    operand, numbers = lhs, dimension_numbers
    if plain and lhs.ndim > 2:  # (rows, d_in)
        operand, numbers = lhs.reshape(-1, lhs.shape[-1]), (((1,), rhs_contracting), ((), ()))
    # XLA's product. Two bfloat16 operands ask for a float32 result, rounded to bfloat16 after:
    # XLA's CPU compiler otherwise widens both operands to float32 copies in memory and runs a
    # float32 product, where with a float32 result it runs a bfloat16 product accumulating in
    # float32 (AVX512_BF16), about twice as fast on a prefill's products (docs/performance.md,
    # "Qwen3-0.6B on CPU"). Either way the sums are float32 and rounded once.
    widened = (
        jnp.dtype(lhs.dtype) == jnp.bfloat16
        and jnp.dtype(rhs.dtype) == jnp.bfloat16
        and options.get("preferred_element_type") is None
    )
    if widened:
        options = {**options, "preferred_element_type": jnp.float32}
    out = jax.lax.dot_general(operand, rhs, numbers, precision=precision, **options)
    out = out.astype(jnp.bfloat16) if widened else out
    return out if operand is lhs else out.reshape(*lhs.shape[:-1], out.shape[-1])


def linear_factory(*, dtype, param_dtype, precision, rngs: nnx.Rngs):
    """``linear(d_in, d_out, use_bias=..., axes=...)``: an ``nnx.Linear`` with torch's
    initialisers and the layer's Flax options, so every sublayer gets ``dtype``, ``param_dtype``
    and ``precision``. ``axes`` (a ``mesh.LinearAxes``, e.g. ``TO_HEADS`` or ``FROM_HEADS``)
    becomes the kernel's and bias's partition metadata. Its product is ``rows_dot_general``."""

    def linear(
        in_features: int, out_features: int, *, use_bias: bool = True, axes: LinearAxes
    ) -> nnx.Linear:
        return nnx.Linear(
            in_features,
            out_features,
            use_bias=use_bias,
            kernel_init=partitioned(torch_linear_kernel_init, axes.kernel),
            bias_init=partitioned(torch_linear_bias_init(in_features), axes.bias),
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
            dot_general=rows_dot_general,
            rngs=rngs,
        )

    return linear


@dataclasses.dataclass(frozen=True)
class LayerOptions:
    """The Flax options of a model's layers, passed down as one value: the model checks them at
    its door and builds every sublayer from this (``linear``, ``norm``, ``dense``, ``attention``
    say which of them each kind of layer takes), instead of threading each keyword by hand
    through every constructor.

    ``dtype``: the computation dtype (``None``: the inputs'); ``param_dtype``: the parameters';
    ``precision``: every matmul's; ``implementation``: the attention core's (``None``: the
    fastest for each call)."""

    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    implementation: str | None = None

    def linear(self, rngs: nnx.Rngs):
        """``linear_factory`` with these options."""
        return linear_factory(
            dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision, rngs=rngs
        )

    def norm(self) -> dict:
        """The keywords of a norm or an embedding: ``dtype``, ``param_dtype``."""
        return {"dtype": self.dtype, "param_dtype": self.param_dtype}

    def dense(self) -> dict:
        """The keywords of a layer of Linears (a feed-forward): ``norm()`` and ``precision``."""
        return {**self.norm(), "precision": self.precision}

    def attention(self) -> dict:
        """The keywords of an attention layer (or a block holding one): all four."""
        return {**self.dense(), "implementation": self.implementation}
