"""The Annotated Transformer's copy task (the post's ``example_simple_model``) in Flax.

    python examples/annotated_copy.py [--epochs 20] [--d-model 512] [--d-ff 2048] [--warmup 400]

A model of ``flax_attention.models.annotated.make_model(V, V, N=2)`` learns to copy random
sequences of 10 ids (V = 11, batches of 80, 20 batches an epoch), with the post's label
smoothing (0), Adam (0.9, 0.98, 1e-9) on ``rate``'s schedule (base lr 0.5, warmup 400), then
decodes ``0 1 2 ... 9`` greedily, as the post does. Prints each epoch's mean per-token loss and
its time, then the decoded ids.
"""

import argparse
import time

import numpy as np
from flax import nnx

from flax_attention.models import annotated


def main(argv=None) -> list[int]:
    parser = argparse.ArgumentParser(
        prog="python examples/annotated_copy.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batches", type=int, default=20, help="batches an epoch")
    parser.add_argument("--batch-size", type=int, default=80)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--d-ff", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dropout", type=float, default=0.1, help="every dropout (the post's 0.1)")
    args = parser.parse_args(argv)

    V = 11
    model = annotated.make_model(
        V,
        V,
        N=2,
        d_model=args.d_model,
        d_ff=args.d_ff,
        h=args.heads,
        dropout=args.dropout,
        attention_dropout=args.dropout,
        rngs=nnx.Rngs(args.seed),
    )
    tx = annotated.adam(args.d_model, factor=1.0, warmup=args.warmup, base_lr=0.5)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    criterion = annotated.LabelSmoothing(size=V, padding_idx=0, smoothing=0.0)
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        losses, tokens = 0.0, 0
        for batch in annotated.data_gen(V, args.batch_size, args.batches, rng=rng):
            loss = annotated.train_step(model, optimizer, criterion, batch)
            losses += float(loss) * batch.ntokens
            tokens += batch.ntokens
        print(
            f"epoch {epoch:2d}: loss per token {losses / tokens:.4f} "
            f"({time.perf_counter() - start:.1f} s)"
        )
    src = np.arange(10)[None]  # (1, 10): 0 1 2 ... 9, as the post decodes it
    src_mask = np.ones((1, 1, 10), bool)
    decoded = np.asarray(annotated.greedy_decode(model, src, src_mask, max_len=10, start_symbol=0))
    print("decoded:", " ".join(map(str, decoded[0].tolist())))
    return decoded[0].tolist()


if __name__ == "__main__":
    main()
