"""The Annotated Transformer's whole encoder-decoder model, its training pieces and greedy decoding
in torch: the reference that ``flax_attention.models.annotated`` is held to.

"The Annotated Transformer" (Harvard NLP: Sasha Rush, 2018; revised by Austin Huang, Suraj
Subramanian, Jonathan Sum, Khalid Almubarak and Stella Biderman, 2022;
https://nlp.seas.harvard.edu/annotated-transformer/) builds "Attention Is All You Need" in
PyTorch. This module follows the post's published code
(https://github.com/harvardnlp/annotated-transformer, ``the_annotated_transformer.py``) name for
name and loop for loop, so its
``state_dict()`` has the post's keys (``make_model(11, 11, N=2)``)::

    encoder.layers.{i}.self_attn.linears.{0..3}.{weight,bias}     W^Q, W^K, W^V, W^O
    encoder.layers.{i}.feed_forward.w_{1,2}.{weight,bias}
    encoder.layers.{i}.sublayer.{0,1}.norm.{a_2,b_2}
    encoder.norm.{a_2,b_2}
    decoder.layers.{i}.{self_attn,src_attn}.linears.{0..3}.{weight,bias}
    decoder.layers.{i}.feed_forward.w_{1,2}.{weight,bias}
    decoder.layers.{i}.sublayer.{0,1,2}.norm.{a_2,b_2}
    decoder.norm.{a_2,b_2}
    src_embed.0.lut.weight, src_embed.1.pe                        (1, 5000, d_model) buffer
    tgt_embed.0.lut.weight, tgt_embed.1.pe
    generator.proj.{weight,bias}

The post's own ``MultiHeadedAttention`` and ``attention`` are here, not
``torch_reference.annotated``'s: that one is a document that renames ``linears`` to
``proj_weights`` and fills with ``-1e10``; the post fills with ``-1e9``.

Shape legend: ``b`` batch, ``s`` source tokens, ``t`` target tokens, ``h`` heads,
``d_k = d_model // h``, ``V`` vocabulary.

What a port must reproduce, as the post's code does it:

- ``make_model`` builds every attention as ``MultiHeadedAttention(h, d_model)``: its dropout is
  0.1 whatever ``dropout`` says (``make_model(..., dropout=0.0)`` still drops attention weights
  in train mode); the other dropouts take ``dropout``. Every parameter with ``dim > 1`` (the
  linear weights and the two embedding tables) is ``xavier_uniform_``; biases keep torch's
  ``nn.Linear`` init, ``a_2``/``b_2`` ones and zeros.
- ``LayerNorm``: ``a_2 * (x - mean) / (std + eps) + b_2`` with ``eps = 1e-6`` added to the
  *unbiased* standard deviation (``x.std(-1)``), not inside a square root.
- ``SublayerConnection`` is pre-norm, ``x + dropout(sublayer(norm(x)))``; each stack ends with
  its own ``norm``.
- ``Embeddings`` multiplies by ``sqrt(d_model)``; ``PositionalEncoding`` adds ``pe[:, :t]`` (a
  buffer of 5000 positions, saved in the state dict) and then applies dropout.
- ``subsequent_mask(size)`` is a bool ``(1, size, size)``, True on and below the diagonal.
  ``Batch`` makes ``src_mask`` bool ``(b, 1, s)`` and ``tgt_mask`` bool ``(b, t - 1, t - 1)``
  (padding and future), ``ntokens`` a 0-d int64 tensor; ``greedy_decode`` turns its masks into
  ``src``'s dtype (int64 for token ids) with ``type_as``: attention only ever tests
  ``mask == 0``.
- ``rate`` treats step 0 as step 1 (``LambdaLR`` calls it with 0 when it is built, so the first
  update already uses ``rate(1)``).
- ``LabelSmoothing`` spreads ``smoothing / (size - 2)`` over the vocabulary, puts
  ``1 - smoothing`` on the target, zeros the padding column and every row whose target is the
  padding index, and sums ``KLDivLoss``; ``SimpleLossCompute`` divides by ``norm`` (the batch's
  non-padding target tokens) for the gradient and returns ``sloss.data * norm`` as the loss.
- ``greedy_decode`` decodes one row (``next_word.data[0]``), ``max_len - 1`` steps after
  ``start_symbol``, re-running the decoder on the whole prefix each step.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
from torch.nn.functional import log_softmax
from torch.optim.lr_scheduler import LambdaLR

__all__ = [
    "Batch",
    "Decoder",
    "DecoderLayer",
    "Embeddings",
    "Encoder",
    "EncoderDecoder",
    "EncoderLayer",
    "Generator",
    "LabelSmoothing",
    "LayerNorm",
    "MultiHeadedAttention",
    "PositionalEncoding",
    "PositionwiseFeedForward",
    "SimpleLossCompute",
    "SublayerConnection",
    "attention",
    "clones",
    "data_gen",
    "greedy_decode",
    "make_model",
    "make_optimizer",
    "rate",
    "subsequent_mask",
    "train_steps",
]


class EncoderDecoder(nn.Module):
    """
    A standard Encoder-Decoder architecture. Base for this and many
    other models.
    """

    def __init__(self, encoder, decoder, src_embed, tgt_embed, generator):
        super(EncoderDecoder, self).__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.src_embed = src_embed
        self.tgt_embed = tgt_embed
        self.generator = generator

    def forward(self, src, tgt, src_mask, tgt_mask):
        "Take in and process masked src and target sequences."
        # src (b, s), tgt (b, t) token ids -> decoder output (b, t, d_model), not yet projected
        return self.decode(self.encode(src, src_mask), src_mask, tgt, tgt_mask)

    def encode(self, src, src_mask):
        return self.encoder(self.src_embed(src), src_mask)  # (b, s, d_model)

    def decode(self, memory, src_mask, tgt, tgt_mask):
        return self.decoder(self.tgt_embed(tgt), memory, src_mask, tgt_mask)  # (b, t, d_model)


class Generator(nn.Module):
    "Define standard linear + softmax generation step."

    def __init__(self, d_model, vocab):
        super(Generator, self).__init__()
        self.proj = nn.Linear(d_model, vocab)

    def forward(self, x):
        return log_softmax(self.proj(x), dim=-1)  # (..., V) log-probabilities


def clones(module, N):
    "Produce N identical layers."
    return nn.ModuleList([copy.deepcopy(module) for _ in range(N)])


class Encoder(nn.Module):
    "Core encoder is a stack of N layers"

    def __init__(self, layer, N):
        super(Encoder, self).__init__()
        self.layers = clones(layer, N)
        self.norm = LayerNorm(layer.size)

    def forward(self, x, mask):
        "Pass the input (and mask) through each layer in turn."
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)


class LayerNorm(nn.Module):
    "Construct a layernorm module (See citation for details)."

    def __init__(self, features, eps=1e-6):
        super(LayerNorm, self).__init__()
        self.a_2 = nn.Parameter(torch.ones(features))
        self.b_2 = nn.Parameter(torch.zeros(features))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)  # (..., 1)
        std = x.std(-1, keepdim=True)  # (..., 1), unbiased (divides by features - 1)
        return self.a_2 * (x - mean) / (std + self.eps) + self.b_2


class SublayerConnection(nn.Module):
    """
    A residual connection followed by a layer norm.
    Note for code simplicity the norm is first as opposed to last.
    """

    def __init__(self, size, dropout):
        super(SublayerConnection, self).__init__()
        self.norm = LayerNorm(size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, sublayer):
        "Apply residual connection to any sublayer with the same size."
        return x + self.dropout(sublayer(self.norm(x)))


class EncoderLayer(nn.Module):
    "Encoder is made up of self-attn and feed forward (defined below)"

    def __init__(self, size, self_attn, feed_forward, dropout):
        super(EncoderLayer, self).__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.sublayer = clones(SublayerConnection(size, dropout), 2)
        self.size = size

    def forward(self, x, mask):
        "Follow Figure 1 (left) for connections."
        x = self.sublayer[0](x, lambda x: self.self_attn(x, x, x, mask))
        return self.sublayer[1](x, self.feed_forward)


class Decoder(nn.Module):
    "Generic N layer decoder with masking."

    def __init__(self, layer, N):
        super(Decoder, self).__init__()
        self.layers = clones(layer, N)
        self.norm = LayerNorm(layer.size)

    def forward(self, x, memory, src_mask, tgt_mask):
        for layer in self.layers:
            x = layer(x, memory, src_mask, tgt_mask)
        return self.norm(x)


class DecoderLayer(nn.Module):
    "Decoder is made of self-attn, src-attn, and feed forward (defined below)"

    def __init__(self, size, self_attn, src_attn, feed_forward, dropout):
        super(DecoderLayer, self).__init__()
        self.size = size
        self.self_attn = self_attn
        self.src_attn = src_attn
        self.feed_forward = feed_forward
        self.sublayer = clones(SublayerConnection(size, dropout), 3)

    def forward(self, x, memory, src_mask, tgt_mask):
        "Follow Figure 1 (right) for connections."
        m = memory
        x = self.sublayer[0](x, lambda x: self.self_attn(x, x, x, tgt_mask))
        x = self.sublayer[1](x, lambda x: self.src_attn(x, m, m, src_mask))
        return self.sublayer[2](x, self.feed_forward)


def subsequent_mask(size):
    "Mask out subsequent positions."
    attn_shape = (1, size, size)
    subsequent_mask = torch.triu(torch.ones(attn_shape), diagonal=1).type(torch.uint8)
    return subsequent_mask == 0  # (1, size, size) bool, True on and below the diagonal


def attention(query, key, value, mask=None, dropout=None):
    "Compute 'Scaled Dot Product Attention'"
    # query (b, h, t, d_k), key and value (b, h, s, d_k), mask broadcastable to (b, h, t, s)
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)  # (b, h, t, s)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = scores.softmax(dim=-1)  # (b, h, t, s)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return torch.matmul(p_attn, value), p_attn  # (b, h, t, d_k), (b, h, t, s)


class MultiHeadedAttention(nn.Module):
    def __init__(self, h, d_model, dropout=0.1):
        "Take in model size and number of heads."
        super(MultiHeadedAttention, self).__init__()
        assert d_model % h == 0
        # We assume d_v always equals d_k
        self.d_k = d_model // h
        self.h = h
        self.linears = clones(nn.Linear(d_model, d_model), 4)
        self.attn = None
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):
        "Implements Figure 2"
        if mask is not None:
            # Same mask applied to all h heads.
            mask = mask.unsqueeze(1)  # (b or 1, 1, t or 1, s)
        nbatches = query.size(0)

        # 1) Do all the linear projections in batch from d_model => h x d_k
        query, key, value = [
            lin(x).view(nbatches, -1, self.h, self.d_k).transpose(1, 2)  # (b, h, t or s, d_k)
            for lin, x in zip(self.linears, (query, key, value))
        ]

        # 2) Apply attention on all the projected vectors in batch.
        x, self.attn = attention(query, key, value, mask=mask, dropout=self.dropout)

        # 3) "Concat" using a view and apply a final linear.
        x = x.transpose(1, 2).contiguous().view(nbatches, -1, self.h * self.d_k)  # (b, t, d_model)
        del query
        del key
        del value
        return self.linears[-1](x)  # (b, t, d_model)


class PositionwiseFeedForward(nn.Module):
    "Implements FFN equation."

    def __init__(self, d_model, d_ff, dropout=0.1):
        super(PositionwiseFeedForward, self).__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.w_2(self.dropout(self.w_1(x).relu()))


class Embeddings(nn.Module):
    def __init__(self, d_model, vocab):
        super(Embeddings, self).__init__()
        self.lut = nn.Embedding(vocab, d_model)
        self.d_model = d_model

    def forward(self, x):
        return self.lut(x) * math.sqrt(self.d_model)  # (b, t) -> (b, t, d_model)


class PositionalEncoding(nn.Module):
    "Implement the PE function."

    def __init__(self, d_model, dropout, max_len=5000):
        super(PositionalEncoding, self).__init__()
        self.dropout = nn.Dropout(p=dropout)

        # Compute the positional encodings once in log space.
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len).unsqueeze(1)  # (max_len, 1) int64
        div_term = torch.exp(torch.arange(0, d_model, 2) * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        pe = pe.unsqueeze(0)  # (1, max_len, d_model)
        self.register_buffer("pe", pe)

    def forward(self, x):
        x = x + self.pe[:, : x.size(1)].requires_grad_(False)  # (b, t, d_model)
        return self.dropout(x)


def make_model(src_vocab, tgt_vocab, N=6, d_model=512, d_ff=2048, h=8, dropout=0.1):
    "Helper: Construct a model from hyperparameters."
    c = copy.deepcopy
    attn = MultiHeadedAttention(h, d_model)  # dropout 0.1, whatever ``dropout`` is
    ff = PositionwiseFeedForward(d_model, d_ff, dropout)
    position = PositionalEncoding(d_model, dropout)
    model = EncoderDecoder(
        Encoder(EncoderLayer(d_model, c(attn), c(ff), dropout), N),
        Decoder(DecoderLayer(d_model, c(attn), c(attn), c(ff), dropout), N),
        nn.Sequential(Embeddings(d_model, src_vocab), c(position)),
        nn.Sequential(Embeddings(d_model, tgt_vocab), c(position)),
        Generator(d_model, tgt_vocab),
    )

    # This was important from their code.
    # Initialize parameters with Glorot / fan_avg.
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    return model


class Batch:
    """Object for holding a batch of data with mask during training."""

    def __init__(self, src, tgt=None, pad=2):  # 2 = <blank>
        self.src = src  # (b, s)
        self.src_mask = (src != pad).unsqueeze(-2)  # (b, 1, s) bool
        if tgt is not None:
            self.tgt = tgt[:, :-1]  # (b, t - 1): the decoder's input
            self.tgt_y = tgt[:, 1:]  # (b, t - 1): what it must predict
            self.tgt_mask = self.make_std_mask(self.tgt, pad)  # (b, t - 1, t - 1) bool
            self.ntokens = (self.tgt_y != pad).data.sum()  # 0-d int64 tensor

    @staticmethod
    def make_std_mask(tgt, pad):
        "Create a mask to hide padding and future words."
        tgt_mask = (tgt != pad).unsqueeze(-2)  # (b, 1, t)
        tgt_mask = tgt_mask & subsequent_mask(tgt.size(-1)).type_as(tgt_mask.data)
        return tgt_mask  # (b, t, t)


def train_steps(model, optimizer, scheduler, batches, criterion):
    """``run_epoch(..., mode="train")``'s loop with ``accum_iter=1``, after
    ``example_simple_model``'s ``model.train()``: for each ``Batch``, the forward pass,
    ``SimpleLossCompute(model.generator, criterion)``, ``loss_node.backward()``,
    ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``, ``scheduler.step()``.

    Returns each step's ``loss`` as the post's ``run_epoch`` adds it up, ``sloss.data * norm``
    (the criterion's sum over the batch's tokens, before that step's update), as Python floats;
    divide by the batch's ``ntokens`` for the per-token loss the post prints. The post's logging
    and ``TrainState`` counters are left out: they change nothing that is computed."""
    loss_compute = SimpleLossCompute(model.generator, criterion)
    losses = []
    model.train()
    for batch in batches:
        out = model.forward(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
        loss, loss_node = loss_compute(out, batch.tgt_y, batch.ntokens)
        loss_node.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())
    return losses


def rate(step, model_size, factor, warmup):
    """
    we have to default the step to 1 for LambdaLR function
    to avoid zero raising to negative power.
    """
    if step == 0:
        step = 1
    return factor * (model_size ** (-0.5) * min(step ** (-0.5), step * warmup ** (-1.5)))


class LabelSmoothing(nn.Module):
    "Implement label smoothing."

    def __init__(self, size, padding_idx, smoothing=0.0):
        super(LabelSmoothing, self).__init__()
        self.criterion = nn.KLDivLoss(reduction="sum")
        self.padding_idx = padding_idx
        self.confidence = 1.0 - smoothing
        self.smoothing = smoothing
        self.size = size
        self.true_dist = None

    def forward(self, x, target):
        # x (n, V) log-probabilities, target (n,) token ids -> a 0-d sum
        assert x.size(1) == self.size
        true_dist = x.data.clone()
        true_dist.fill_(self.smoothing / (self.size - 2))
        true_dist.scatter_(1, target.data.unsqueeze(1), self.confidence)
        true_dist[:, self.padding_idx] = 0
        mask = torch.nonzero(target.data == self.padding_idx)  # (n_pad, 1)
        if mask.dim() > 0:
            true_dist.index_fill_(0, mask.squeeze(), 0.0)
        self.true_dist = true_dist
        return self.criterion(x, true_dist.clone().detach())


def data_gen(V, batch_size, nbatches, generator=None):
    """Generate random data for a src-tgt copy task.

    ``generator`` (a ``torch.Generator``, not in the post) draws the tokens; ``None`` draws
    from torch's global generator, as the post does."""
    for _ in range(nbatches):
        data = torch.randint(1, V, size=(batch_size, 10), generator=generator)  # (b, 10)
        data[:, 0] = 1
        src = data.requires_grad_(False).clone().detach()
        tgt = data.requires_grad_(False).clone().detach()
        yield Batch(src, tgt, 0)


class SimpleLossCompute:
    "A simple loss compute and train function."

    def __init__(self, generator, criterion):
        self.generator = generator
        self.criterion = criterion

    def __call__(self, x, y, norm):
        x = self.generator(x)  # (b, t, V)
        sloss = self.criterion(x.contiguous().view(-1, x.size(-1)), y.contiguous().view(-1)) / norm
        return sloss.data * norm, sloss


def greedy_decode(model, src, src_mask, max_len, start_symbol):
    # src (1, s), src_mask (1, 1, s) -> ys (1, max_len) in src's dtype, starting with start_symbol
    memory = model.encode(src, src_mask)
    ys = torch.zeros(1, 1).fill_(start_symbol).type_as(src.data)
    for _ in range(max_len - 1):
        out = model.decode(memory, src_mask, ys, subsequent_mask(ys.size(1)).type_as(src.data))
        prob = model.generator(out[:, -1])  # (1, V)
        _, next_word = torch.max(prob, dim=1)
        next_word = next_word.data[0]
        ys = torch.cat([ys, torch.zeros(1, 1).type_as(src.data).fill_(next_word)], dim=1)
    return ys


def make_optimizer(model, d_model, factor=1.0, warmup=400, base_lr=0.5):
    """``example_simple_model``'s optimizer and schedule: ``Adam(lr=base_lr, betas=(0.9, 0.98),
    eps=1e-9)`` and ``LambdaLR`` with ``rate(step, model_size=d_model, factor, warmup)`` (the post
    reads ``d_model`` from ``model.src_embed[0].d_model``). Returns ``(optimizer,
    lr_scheduler)``; the learning rate of step ``n`` (from 0) is ``base_lr * rate(n, ...)``."""
    optimizer = torch.optim.Adam(model.parameters(), lr=base_lr, betas=(0.9, 0.98), eps=1e-9)
    lr_scheduler = LambdaLR(
        optimizer=optimizer,
        lr_lambda=lambda step: rate(step, model_size=d_model, factor=factor, warmup=warmup),
    )
    return optimizer, lr_scheduler
