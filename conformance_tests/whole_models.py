"""The whole-model cases of the report (``spec.MODEL_CASES``): ``flax_attention.models``
against its torch twins, the same checks and tolerances as the layers'.

| model | Flax (``flax_attention.models``) | torch twin | data |
|---|---|---|---|
| ``GPTModel`` | ``GPTModel`` | ``book_gpt.GPTModel`` | 4 batches of (2, 16) ids |
| ``annotated`` | ``annotated.make_model`` | ``annotated_model`` | a padded batch; the copy task |
| ``Qwen3Model`` | ``Qwen3Model`` | ``llms_from_scratch.qwen3.Qwen3Model`` | as the GPT's |
| ``Llama3Model`` | ``Llama3Model`` | ``llms_from_scratch.llama3.Llama3Model`` | as the GPT's |

torch draws the weights (``case.seed``), but for Qwen3 and Llama 3, whose twin is the book's
package as it ships (its mixture of experts builds the experts on the meta device, with nothing
drawn): NumPy draws theirs as torch's initialisers would, the norms' scales away from 1, and the
book's model loads them with ``assign=True``. The Flax model is built without drawing its own and
loaded with ``flax_attention.load_state_dict`` (the tests' way: ``test_models.py``,
``test_annotated_model.py``, ``test_qwen3_llama3.py``). Every dropout is off on both sides (the
post's attentions' fixed 0.1 included). Rows, each ``compare``'s rule against the
``tolerances.py`` entry of its check:

- ``forward``: eval-mode outputs (GPT, Qwen3, Llama 3: logits and chapter 5's loss; annotated:
  the encoder's memory, the decoder's output, the generator's log-probs and the label-smoothed
  loss).
- ``forward/int8`` (GPT): ``models.quantize(model, "int8")``'s logits against the book's model
  holding the int8 model's dequantized weights (``fa.state_dict`` of it), under the float32
  ``forward`` tolerance, on a prefill-sized batch (2 x 16 ids: XLA's products) and a
  decode-sized one (2 x 7: the narrow-weight kernel's, where it is built).
- ``dtype`` (bfloat16; not the annotated model): the model in bfloat16 against float32 torch,
  one row per batch size (``forward``: 2 x 16 ids, ``forward/decode``: 2 x 7). Its bound is
  torch's own: ``tol`` is 1.5 times the error of the book's model in bfloat16 on the same input
  (capped at the layers' bfloat16 ``forward`` entry). GPT: both models cast whole (``dtype``
  and ``param_dtype``); Qwen3 and Llama 3: both built as the book's configs build them,
  ``cfg["dtype"]`` bfloat16 (Qwen3's norm scales stay float32 on both sides).
- ``grad``: every parameter's gradient of that loss, by torch name (the worst one named).
- ``train/adamw`` (GPT, Qwen3, Llama 3: chapter 5's ``AdamW(lr=4e-4, weight_decay=0.1)``, the
  library's ``train_step`` with ``optax.adamw`` as a user writes it) and ``train/adam``
  (annotated: the post's Adam on its ``rate`` schedule, warmup 400, base lr 0.5, on the copy
  task): each step's loss, every parameter after steps 10 and 20, and the trained model's
  output.
- ``train/key_bias`` (GPT, annotated; Qwen3 and Llama 3 have no biases): the key projections'
  biases (``W_key.bias``, ``linears.1.bias``) have no
  true gradient: softmax ignores a shift shared by all keys. Adam normalises the rounding noise
  of their gradients into steps of nearly the learning rate, so they drift apart with no effect
  on anything; the ``train`` rows leave them out of the parameters (the trained output holds
  them) and this row holds them as the layers' does: their gradient is zero on both sides and
  new random values leave the output unchanged on both sides.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx

import flax_attention as fa
from conformance_tests import annotated_model as post
from conformance_tests import book_gpt
from conformance_tests.checks.train import COMPARE_EVERY
from conformance_tests.compare import Row, compare, make_row, to_numpy
from conformance_tests.pairs import rng
from conformance_tests.spec import ModelCase, is_shift_invariant
from conformance_tests.tolerances import tolerance
from flax_attention import models
from flax_attention.models import annotated

__all__ = ["MESH_SKIP_REASON", "run_model_case"]

#: Why a whole-model case is not run on ``--mesh`` (it is printed as the case's SKIP line).
MESH_SKIP_REASON = (
    "whole models run on one device here (the models on a mesh: "
    "conformance_tests/tests/sharded_tests.py)"
)


def _numpy_state(module: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in module.state_dict().items()}


def _snapshot_steps(steps: int) -> list[int]:
    """The steps the parameters are compared after: every ``COMPARE_EVERY`` (the layers'
    ``train`` check's), and the last."""
    return sorted({*range(COMPARE_EVERY, steps + 1, COMPARE_EVERY), steps})


def _segments(items: list, steps: list[int]) -> list[list]:
    """``items`` cut after each of ``steps`` (1-based counts)."""
    bounds = [0, *steps]
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]


def _grads_by_name(model, grads, names) -> dict[str, np.ndarray]:
    """Flax gradients in the parameters' places, by torch name (``names``: the twin's)."""
    holder = nnx.clone(model)
    nnx.update(holder, grads)
    exported = fa.state_dict(holder)
    return {n: exported[n] for n in names}


def _trajectory(names, t_losses, f_losses, t_snaps, f_snaps, steps):
    """Each step's loss and every parameter but the key biases at each snapshot step."""
    reference = {f"loss@{i + 1}": v for i, v in enumerate(t_losses)}
    actual = {f"loss@{i + 1}": np.float64(v) for i, v in enumerate(f_losses)}
    for t_snap, f_snap, at in zip(t_snaps, f_snaps, steps, strict=True):
        for name in names:
            if not is_shift_invariant(name):
                reference[f"{name}@{at}"], actual[f"{name}@{at}"] = t_snap[name], f_snap[name]
    return reference, actual


class _Runner:
    """What the checks of one model case call: ``pair``, ``forward``, ``grads``, ``output``,
    ``train`` (one runner per case and process: ``_runner``)."""

    #: Whether the model has key biases (the ``train/key_bias`` row) and an int8 form
    #: (``models.quantize``: the ``forward/int8`` row).
    key_biases, quantizable = True, False

    def __init__(self):
        self._templates = {}

    def make_flax(self, dtype=None) -> nnx.Module:
        """A Flax model of the case's sizes (its parameters are replaced by torch's), in
        ``dtype`` (``None``: float32; a narrower one for the ``dtype`` rows)."""
        raise NotImplementedError

    def flax_model(self, backend, weights: dict[str, np.ndarray], dtype=None) -> nnx.Module:
        """A Flax model (``make_flax(dtype)``) holding ``weights``, strictly loaded. Built as
        ``new_model`` builds one: no parameter drawn, the rest (RNG streams) concrete; that
        skeleton is made once per backend and dtype and copied (a train step may donate what it
        is given)."""
        key = (backend.label, dtype)
        if key not in self._templates:
            make = functools.partial(self.make_flax, dtype)
            model = nnx.eval_shape(make)
            nnx.update(model, jax.jit(lambda: nnx.state(make(), nnx.Not(nnx.Param)))())
            self._templates[key] = nnx.split(model)
        graphdef, state = self._templates[key]
        state = jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, state)
        model = nnx.merge(graphdef, state)
        fa.load_state_dict(model, weights)
        return model


class _GPT(_Runner):
    """The book's ``GPTModel``: chapter 5's loss on ``BATCHES`` batches of ``(2, 16)`` ids."""

    optimiser = "adamw"
    quantizable = True
    BATCHES, BATCH = 4, 2
    #: Tokens per row (``None``: the context length).
    TOKENS: int | None = None
    #: One object for every run: part of the optimiser's static structure (jit's cache key).
    ADAMW = optax.adamw(4e-4, weight_decay=0.1)

    def __init__(self, case: ModelCase):
        super().__init__()
        self.case, self.cfg = case, dict(case.config)
        tokens = self.TOKENS or self.cfg["context_length"]
        data = rng(case, "batches").integers(
            0, self.cfg["vocab_size"], (self.BATCHES, self.BATCH, tokens + 1)
        )
        self.batches = [(row[:, :-1], row[:, 1:]) for row in data]

    def pair(self, backend):
        torch.manual_seed(self.case.seed)
        twin = book_gpt.GPTModel(self.cfg).to(backend.torch_device)
        return twin, self.flax_model(backend, _numpy_state(twin))

    def make_flax(self, dtype=None):
        if dtype is None:
            return models.GPTModel(self.cfg, rngs=nnx.Rngs(0))
        return models.GPTModel(self.cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)

    def _torch_batch(self, backend, batch):
        return tuple(torch.from_numpy(a).to(backend.torch_device) for a in batch)

    def forward(self, backend):
        twin, model = self.pair(backend)
        twin.eval()
        model.eval()
        x, y = self._torch_batch(backend, self.batches[0])
        with torch.no_grad():
            reference = {"logits": twin(x), "loss": book_gpt.calc_loss_batch(x, y, twin)}
        logits, loss = _gpt_forward(model, *self.batches[0])
        return reference, {"logits": logits, "loss": loss}

    def grads(self, backend, twin=None, model=None):
        if twin is None:
            twin, model = self.pair(backend)
        twin.train()
        model.train()
        x, y = self._torch_batch(backend, self.batches[0])
        twin.zero_grad()
        book_gpt.calc_loss_batch(x, y, twin).backward()
        reference = {n: p.grad for n, p in twin.named_parameters()}
        _, grads = _gpt_loss_and_grads(model, *self.batches[0])
        return reference, _grads_by_name(model, grads, reference)

    def output(self, backend, twin, model):
        """Eval-mode logits of the first batch on both sides."""
        twin.eval()
        model.eval()
        with torch.no_grad():
            expected = twin(self._torch_batch(backend, self.batches[0])[0])
        return expected, _gpt_forward(model, *self.batches[0])[0]

    def train(self, backend):
        twin, model = self.pair(backend)
        steps = self.case.steps
        batches = [self.batches[i % self.BATCHES] for i in range(steps)]
        snapshots = _snapshot_steps(steps)
        optimizer = torch.optim.AdamW(twin.parameters(), lr=4e-4, weight_decay=0.1)
        t_losses, t_snaps = [], []
        for segment in _segments(batches, snapshots):
            torch_segment = [self._torch_batch(backend, b) for b in segment]
            t_losses += book_gpt.train_steps(twin, optimizer, torch_segment, backend.torch_device)
            t_snaps.append({n: p.detach().clone() for n, p in twin.named_parameters()})
        model.train()
        flax_optimizer = nnx.Optimizer(model, self.ADAMW, wrt=nnx.Param)
        f_losses, f_snaps = [], []
        for segment in _segments(batches, snapshots):
            f_losses += [float(models.train_step(model, flax_optimizer, x, y)) for x, y in segment]
            f_snaps.append(fa.state_dict(model))
        names = [n for n, _ in twin.named_parameters()]
        reference, actual = _trajectory(names, t_losses, f_losses, t_snaps, f_snaps, snapshots)
        trained = self.output(backend, twin, model)
        reference["logits (trained)"], actual["logits (trained)"] = trained
        return reference, actual

    def _inputs(self) -> dict[str, np.ndarray]:
        """The inference rows' inputs: the first batch (prefill-sized: 32 rows, the
        narrow-weight kernel's float32 panels with int8, and with bfloat16 where the CPU has no
        bfloat16 pair products, else XLA's bfloat16 products) and its first 2 ids
        (decode-sized: 4 rows, the kernel's register path in both; ``_layers.NARROW_ROWS``)."""
        x = self.batches[0][0]
        return {"logits (2x16)": x, "logits (2x2)": x[:, :2]}

    def int8(self, backend):
        """``models.quantize(model, "int8")`` against the book's model holding its dequantized
        weights."""
        _, model = self.pair(backend)
        model.eval()
        quantized = models.quantize(model, "int8")
        book = book_gpt.GPTModel(self.cfg).to(backend.torch_device).eval()
        dequantized = fa.state_dict(quantized)
        book.load_state_dict({k: torch.from_numpy(v) for k, v in dequantized.items()})
        reference, actual = {}, {}
        for name, ids in self._inputs().items():
            with torch.no_grad():
                reference[name] = book(torch.from_numpy(ids).to(backend.torch_device))
            actual[name] = _gpt_logits(quantized, ids)
        return reference, actual

    def bfloat16_models(self, backend):
        """``(float32 torch, torch in bfloat16, Flax in bfloat16)``, the same weights: torch's
        model cast to bfloat16, the Flax model built with ``dtype`` and ``param_dtype``."""
        twin, _ = self.pair(backend)
        model = self.flax_model(backend, _numpy_state(twin), jnp.bfloat16)
        return twin, copy.deepcopy(twin).to(torch.bfloat16), model

    def bfloat16(self, backend):
        """Per input: float32 torch, torch's bfloat16 model and the Flax bfloat16 model's
        logits (``bfloat16_models``)."""
        twin, twin_bf16, model = self.bfloat16_models(backend)
        twin.eval()
        twin_bf16.eval()
        model.eval()
        results = {}
        for name, ids in self._inputs().items():
            x = torch.from_numpy(ids).to(backend.torch_device)
            with torch.no_grad():
                reference, theirs = twin(x), twin_bf16(x).float()
            results[name] = reference, theirs, _gpt_logits(model, ids).astype(jnp.float32)
        return results


def _bfloat16_rows(case, backend, runner) -> list[Row]:
    """The ``dtype`` rows: each input's Flax bfloat16 logits against float32 torch, ``tol`` 1.5
    times the error of torch's own bfloat16 model there (at most the bfloat16 ``forward``
    entry)."""
    rows = []
    results = runner.bfloat16(backend)
    for check, (reference, theirs, ours) in zip(("forward", "forward/decode"), results.values()):
        reference, theirs, ours = ({"logits": x} for x in (reference, theirs, ours))
        torch_error = compare(reference, theirs, 1.0).err_over_bound
        tol = min(1.5 * torch_error, tolerance("bfloat16", "forward"))
        rows.append(make_row(case.name, backend, "bfloat16", check, reference, ours, tol=tol))
    return rows


_gpt_logits = nnx.jit(lambda model, ids: model(ids))


@nnx.jit
def _gpt_forward(model, x, y):
    logits = model(x)
    return logits, models.calc_loss_batch(x, y, model)


_gpt_loss_and_grads = nnx.jit(nnx.value_and_grad(lambda m, x, y: models.calc_loss_batch(x, y, m)))


class _BookLLM(_GPT):
    """The book's package's ``Qwen3Model`` or ``Llama3Model`` (``llms_from_scratch``, the twin
    as the book ships it) against ``models.Qwen3Model`` or ``models.Llama3Model``: the GPT's
    batches (``(2, 16)`` ids), chapter 5's loss and AdamW steps, and bfloat16 rows. No biases
    (no ``train/key_bias`` row), no int8 form.

    NumPy draws the weights (``weights``): the book's mixture of experts builds its experts on
    the meta device (nothing drawn), so the model loads them with ``assign=True``."""

    key_biases, quantizable = False, False
    TOKENS = 16
    #: The Flax class, by the case's model.
    MODELS = {"Qwen3Model": models.Qwen3Model, "Llama3Model": models.Llama3Model}

    def __init__(self, case: ModelCase):
        super().__init__(case)
        if "rope_freq" in self.cfg:  # a dict, held as pairs in the case
            self.cfg["rope_freq"] = dict(self.cfg["rope_freq"])
        self.weights = self._draw_weights()

    def _book(self, dtype) -> torch.nn.Module:
        """The book's model built from the case's config in ``dtype`` (its own weights). The
        book's package is imported here, when a case needs it (the report names it when it is
        missing: ``cli.missing_requirements``)."""
        if self.case.model == "Qwen3Model":
            from llms_from_scratch.qwen3 import Qwen3Model as book_model
        else:
            from llms_from_scratch.llama3 import Llama3Model as book_model
        return book_model({**self.cfg, "dtype": dtype})

    def _draw_weights(self) -> dict[str, np.ndarray]:
        """Float32 weights by the book's names, drawn as torch's initialisers draw them
        (``nn.Embedding`` N(0, 1), ``nn.Linear`` U(-1/sqrt(fan_in), 1/sqrt(fan_in))), and
        every norm's scale 1 + 0.3 N(0, 1): away from 1, so a norm read wrongly shows."""
        generator = rng(self.case, "weights")
        weights = {}
        for name, tensor in self._book(torch.float32).state_dict().items():  # meta: shapes
            shape = tuple(tensor.shape)
            if "norm" in name:
                value = 1 + 0.3 * generator.standard_normal(shape)
            elif name == "tok_emb.weight":
                value = generator.standard_normal(shape)
            else:
                bound = 1 / np.sqrt(shape[-1])
                value = generator.uniform(-bound, bound, shape)
            weights[name] = value.astype(np.float32)
        return weights

    def _book_holding_weights(self, backend, dtype) -> torch.nn.Module:
        """The book's model in ``dtype`` holding ``weights``, each cast to its parameter's
        dtype there (in bfloat16, Qwen3's norm scales stay float32, as the book builds them)."""
        book = self._book(dtype)
        own = book.state_dict()
        state = {n: torch.tensor(v, dtype=own[n].dtype) for n, v in self.weights.items()}
        book.load_state_dict(state, assign=True)  # assign: the experts are on "meta"
        return book.to(backend.torch_device)

    def pair(self, backend):
        return (
            self._book_holding_weights(backend, torch.float32),
            self.flax_model(backend, self.weights),
        )

    def make_flax(self, dtype=None):
        flax_class = self.MODELS[self.case.model]
        return flax_class({**self.cfg, "dtype": dtype or jnp.float32}, rngs=nnx.Rngs(0))

    def bfloat16_models(self, backend):
        """Both models built as the book's configs build them in bfloat16 (``cfg["dtype"]``:
        the parameters, and the computation with them), holding the same weights."""
        return (
            self._book_holding_weights(backend, torch.float32),
            self._book_holding_weights(backend, torch.bfloat16),
            self.flax_model(backend, self.weights, jnp.bfloat16),
        )


class _Annotated(_Runner):
    """The Annotated Transformer's model: a padded batch (forward, grad), the copy task (train)."""

    optimiser = "adam"
    PAD = 0

    def __init__(self, case: ModelCase):
        super().__init__()
        self.case, self.cfg = case, dict(case.config)
        V = self.cfg["V"]
        generator = rng(case, "batch")
        src = generator.integers(1, V, (2, 9))  # the second row padded at its end
        src[1, 6:] = self.PAD
        tgt = generator.integers(1, V, (2, 8))
        tgt[:, 0] = 1
        tgt[1, 5:] = self.PAD
        self.src, self.tgt = src, tgt
        self.smoothing = annotated.LabelSmoothing(V, self.PAD, 0.1)

    def _sizes(self):
        c = self.cfg
        return dict(N=c["N"], d_model=c["d_model"], d_ff=c["d_ff"], h=c["h"])

    def pair(self, backend):
        V = self.cfg["V"]
        torch.manual_seed(self.case.seed)
        twin = post.make_model(V, V, **self._sizes(), dropout=0.0)
        for module in twin.modules():  # the attentions' dropout is a fixed 0.1 in the post
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        twin = twin.to(backend.torch_device)
        return twin, self.flax_model(backend, _numpy_state(twin))

    def make_flax(self, dtype=None):  # float32 only: no dtype rows
        V = self.cfg["V"]
        return annotated.make_model(
            V, V, **self._sizes(), dropout=0.0, attention_dropout=0.0, rngs=nnx.Rngs(0)
        )

    def _batches(self, backend, src, tgt):
        """``(post.Batch on the torch device, annotated.Batch)`` of ``src`` and ``tgt``."""
        device = backend.torch_device
        theirs = post.Batch(torch.from_numpy(src).to(device), torch.from_numpy(tgt).to(device), 0)
        return theirs, annotated.Batch(src, tgt, self.PAD)

    @staticmethod
    def _arrays(ours):
        return (ours.src, ours.tgt, ours.src_mask, ours.tgt_mask, ours.tgt_y, float(ours.ntokens))

    def _torch_loss(self, twin, theirs):
        """The post's ``SimpleLossCompute`` with label smoothing 0.1: ``(loss, sloss)``."""
        criterion = post.LabelSmoothing(size=self.cfg["V"], padding_idx=self.PAD, smoothing=0.1)
        out = twin(theirs.src, theirs.tgt, theirs.src_mask, theirs.tgt_mask)
        return post.SimpleLossCompute(twin.generator, criterion)(out, theirs.tgt_y, theirs.ntokens)

    def forward(self, backend):
        twin, model = self.pair(backend)
        twin.eval()
        model.eval()
        theirs, ours = self._batches(backend, self.src, self.tgt)
        with torch.no_grad():
            memory = twin.encode(theirs.src, theirs.src_mask)
            out = twin.decode(memory, theirs.src_mask, theirs.tgt, theirs.tgt_mask)
            reference = {
                "memory": memory,
                "out": out,
                "log_probs": twin.generator(out),
                "loss": self._torch_loss(twin, theirs)[1],
            }
        got = _annotated_forward_and_loss(model, self.smoothing, self._arrays(ours))
        return reference, dict(zip(("memory", "out", "log_probs", "loss"), got))

    def grads(self, backend, twin=None, model=None):
        if twin is None:
            twin, model = self.pair(backend)
        twin.train()
        model.train()
        theirs, ours = self._batches(backend, self.src, self.tgt)
        twin.zero_grad()
        self._torch_loss(twin, theirs)[1].backward()
        reference = {n: p.grad for n, p in twin.named_parameters()}
        _, grads = _annotated_loss_and_grads(model, self.smoothing, self._arrays(ours))
        return reference, _grads_by_name(model, grads, reference)

    def output(self, backend, twin, model):
        """Eval-mode log-probs of the padded batch on both sides."""
        twin.eval()
        model.eval()
        theirs, ours = self._batches(backend, self.src, self.tgt)
        with torch.no_grad():
            out = twin(theirs.src, theirs.tgt, theirs.src_mask, theirs.tgt_mask)
            expected = twin.generator(out)
        got = _annotated_forward_and_loss(model, self.smoothing, self._arrays(ours))[2]
        return expected, got

    def train(self, backend):
        """The post's ``example_simple_model`` loop: Adam (0.9, 0.98, 1e-9) on ``rate``'s
        schedule (warmup 400, base lr 0.5), label smoothing 0, batches of 4 rows of 10 ids."""
        twin, model = self.pair(backend)
        steps, d_model, V = self.case.steps, self.cfg["d_model"], self.cfg["V"]
        data = list(annotated.data_gen(V, 4, steps, rng=rng(self.case, "copy task")))
        snapshots = _snapshot_steps(steps)
        optimizer, scheduler = post.make_optimizer(twin, d_model, 1.0, warmup=400, base_lr=0.5)
        criterion = post.LabelSmoothing(size=V, padding_idx=self.PAD, smoothing=0.0)
        t_losses, t_snaps = [], []
        for segment in _segments(data, snapshots):
            torch_segment = [
                self._batches(backend, b.src, np.concatenate([b.tgt, b.tgt_y[:, -1:]], 1))[0]
                for b in segment
            ]
            t_losses += post.train_steps(twin, optimizer, scheduler, torch_segment, criterion)
            t_snaps.append({n: p.detach().clone() for n, p in twin.named_parameters()})
        model.train()
        tx = annotated.adam(d_model, factor=1.0, warmup=400, base_lr=0.5)
        flax_optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        smoothing = annotated.LabelSmoothing(V, self.PAD, 0.0)
        f_losses, f_snaps = [], []
        for segment in _segments(data, snapshots):
            # the post's loss of a step is the criterion's sum: sloss * ntokens
            f_losses += [
                float(annotated.train_step(model, flax_optimizer, smoothing, b)) * b.ntokens
                for b in segment
            ]
            f_snaps.append(fa.state_dict(model))
        names = [n for n, _ in twin.named_parameters()]
        reference, actual = _trajectory(names, t_losses, f_losses, t_snaps, f_snaps, snapshots)
        trained = self.output(backend, twin, model)
        reference["log_probs (trained)"], actual["log_probs (trained)"] = trained
        return reference, actual


@functools.partial(nnx.jit, static_argnums=1)
def _annotated_forward_and_loss(model, smoothing, arrays):
    src, tgt, src_mask, tgt_mask = arrays[:4]
    memory = model.encode(src, src_mask)
    out = model.decode(memory, src_mask, tgt, tgt_mask)
    return memory, out, model.generator(out), annotated.loss_compute(model, smoothing, arrays)


_annotated_loss_and_grads = nnx.jit(nnx.value_and_grad(annotated.loss_compute), static_argnums=1)

_MODELS = {
    "GPTModel": _GPT,
    "annotated": _Annotated,
    "Qwen3Model": _BookLLM,
    "Llama3Model": _BookLLM,
}


@functools.cache
def _runner(case: ModelCase) -> _Runner:
    """One runner per case and process: its Flax skeletons are built once."""
    return _MODELS[case.model](case)


def _key_bias(runner, backend):
    """The key biases: a zero gradient on both sides, and no effect on the output when set to
    new random values on both sides."""
    twin, model = runner.pair(backend)
    t_grads, f_grads = runner.grads(backend, twin, model)
    names = [n for n in t_grads if is_shift_invariant(n)]
    reference, actual = {}, {}
    for n in names:
        zero = np.zeros(tuple(t_grads[n].shape), np.float32)
        reference[f"grad {n} (torch)"], actual[f"grad {n} (torch)"] = zero, t_grads[n]
        reference[f"grad {n} (flax)"], actual[f"grad {n} (flax)"] = zero, f_grads[n]
    before_t, before_f = runner.output(backend, twin, model)
    shifted = {
        n: rng(runner.case, f"shift/{n}").standard_normal(tuple(t_grads[n].shape)) for n in names
    }
    with torch.no_grad():
        params = dict(twin.named_parameters())
        for n, v in shifted.items():
            params[n].copy_(torch.from_numpy(v.astype(np.float32)))
    fa.load_state_dict(model, {n: v.astype(np.float32) for n, v in shifted.items()}, strict=False)
    after_t, after_f = runner.output(backend, twin, model)
    reference["output after new key biases (torch)"] = before_t
    actual["output after new key biases (torch)"] = after_t
    reference["output after new key biases (flax)"] = before_f
    actual["output after new key biases (flax)"] = after_f
    return reference, actual


def run_model_case(case: ModelCase, check: str, backend, dtype: str = "float32") -> list[Row]:
    """Rows of one check of a whole-model case on ``backend``: float32 for every check but
    ``dtype``, which has bfloat16 rows (the GPT's)."""
    if check not in case.checks or (dtype == "float32") == (check == "dtype"):
        return []
    if check == "dtype" and dtype != "bfloat16":
        return []
    with _torch_threads(1):
        return _run(_runner(case), check, backend, dtype)


@contextlib.contextmanager
def _torch_threads(n: int):
    """torch on ``n`` threads, put back on exit. The models are tiny (2 x 16 tokens of width
    32): one thread runs a step of the twin in milliseconds, where torch's OpenMP pool, its
    threads waiting on each other on a busy 2-core machine, took up to 0.5 s for one backward
    pass. Measured on 2 loaded cores (load average 4): the GPT case's train check, compiled,
    0.25 s on one thread and 2.5 s to 17 s on two."""
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _run(runner: _Runner, check: str, backend, dtype: str) -> list[Row]:
    case = runner.case
    row = functools.partial(make_row, case.name, backend, dtype)
    if check == "forward":
        rows = [row("forward", *runner.forward(backend))]
        if runner.quantizable:
            rows.append(row("forward/int8", *runner.int8(backend), "forward"))
        return rows
    if check == "dtype":
        return _bfloat16_rows(case, backend, runner)
    if check == "grad":
        reference, actual = runner.grads(backend)
        finite = all(bool(np.isfinite(to_numpy(g)).all()) for g in actual.values())
        return [row("grad", reference, actual, ok=finite)]
    if check == "train":
        rows = [row(f"train/{runner.optimiser}", *runner.train(backend), "train")]
        if runner.key_biases:
            rows.append(row("train/key_bias", *_key_bias(runner, backend), "train"))
        return rows
    raise ValueError(f"check ({check!r}) must be one of {case.checks} for {case.name}")
