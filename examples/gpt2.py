"""Generate with GPT-2 on ``flax_attention.models`` (the book's ``GPTModel``).

    python examples/gpt2.py (--checkpoint DIR | --state-dict PATH --config JSON) \\
        (--prompt TEXT | --prompt-ids 1,2,3) --max-new-tokens N [--batch B] [--json PATH] ...

``--checkpoint``: a Hugging Face GPT-2 directory; ``--state-dict``: the book's ``.pth`` or a
``.safetensors`` of its names, with ``--config`` its cfg dict (a JSON file or JSON). ``--prompt``
reads ``tokenizer.json`` (or ``vocab.json`` + ``merges.txt``) in ``--tokenizer`` or the
checkpoint; nothing is downloaded. ``--json`` writes ``{"tokens": [[new ids of row 0], ...],
"prefill_ms", "tokens_per_s", "compile_s"}``, wall clock: ``compile_s`` is the first generate
call minus the second, identical one (tracing and compiling, and whatever else runs once);
``tokens_per_s`` is B * N new tokens over the second call (prefill included); ``prefill_ms`` is
a call for one new token, after a warm-up call of the same shapes.
"""

import argparse
import json
import pathlib
import sys
import time


def parse_args(argv=None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python examples/gpt2.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add = parser.add_argument
    weights = parser.add_mutually_exclusive_group(required=True)
    weights.add_argument("--checkpoint", metavar="DIR", help="Hugging Face GPT-2 directory")
    weights.add_argument("--state-dict", metavar="PATH", help="the book's .pth or .safetensors")
    add("--config", metavar="JSON", help="with --state-dict: the book's cfg dict (file or JSON)")
    add("--tokenizer", metavar="DIR", help="tokenizer files for --prompt (default: checkpoint)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", metavar="TEXT", help="text, through the tokenizer")
    source.add_argument("--prompt-ids", metavar="IDS", help="token ids, e.g. 464,3290,318")
    add("--max-new-tokens", type=int, required=True, metavar="N")
    add("--batch", type=int, default=1, metavar="B", help="rows (the same prompt)")
    add("--json", metavar="PATH", help="write tokens and timings as JSON")
    add("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    add("--top-k", type=int, default=None, metavar="K", help="sample among the K most likely")
    add("--seed", type=int, default=0, help="jax.random.key seed for sampling")
    return parser, parser.parse_args(argv)


def read_tokenizer(directory: str):  # tokenizer.json, or vocab.json + merges.txt; else None
    import tokenizers

    d = pathlib.Path(directory)
    if (d / "tokenizer.json").is_file():
        return tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    if (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        return tokenizers.ByteLevelBPETokenizer(str(d / "vocab.json"), str(d / "merges.txt"))
    return None


def load_model(args):
    """``--checkpoint``, or ``--state-dict`` with ``--config``: an eval-mode ``GPTModel``."""
    import flax_attention as fa
    from flax_attention.models import GPTModel, read_pth
    from flax_attention.models.checkpoints import new_model

    if (args.checkpoint is None) == (args.config is None):
        raise ValueError(f"--config ({args.config!r}) must come with --state-dict, and only then")
    if args.checkpoint is not None:
        return GPTModel.from_pretrained(args.checkpoint)
    text = args.config.strip()
    try:
        cfg = json.loads(text if text.startswith("{") else pathlib.Path(text).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"--config ({text!r}) must be JSON or a JSON file ({error})") from None
    path = pathlib.Path(args.state_dict)
    model = new_model(GPTModel, cfg)  # abstract parameters, filled by one strict load
    if path.suffix == ".safetensors":
        fa.load_file(model, path)
    elif path.suffix in (".pth", ".pt"):
        fa.load_state_dict(model, read_pth(path))
    else:
        raise ValueError(f"--state-dict ({str(path)!r}) must be a .pth or .safetensors file")
    model.eval()
    return model


def prompt_ids(args, tokenizer) -> list[int]:
    if args.prompt is None:
        ids = [part.strip() for part in args.prompt_ids.split(",") if part.strip()]
        if not all(part.lstrip("-").isdigit() for part in ids):
            raise ValueError(f"--prompt-ids ({args.prompt_ids!r}) must be comma-separated ints")
        return [int(part) for part in ids]
    if tokenizer is None:
        where = args.tokenizer or args.checkpoint
        found = f"none in {where!r}" if where else "no --tokenizer given"
        raise ValueError(
            f"--prompt ({args.prompt!r}) needs tokenizer.json (or vocab.json and merges.txt) in "
            f"--tokenizer or --checkpoint ({found}): pass --tokenizer DIR or --prompt-ids"
        )
    return tokenizer.encode(args.prompt).ids


def warn_unknown_ids(tokenizer_size: int, vocab_size: int, new_ids) -> None:
    """Say on stderr when the tokenizer knows fewer ids than the model emits: its decode drops
    the others, so a row may print as little or no text."""
    if tokenizer_size >= vocab_size:
        return
    unknown = int((new_ids >= tokenizer_size).sum())
    print(
        f"warning: the tokenizer's vocabulary ({tokenizer_size} ids) is smaller than the "
        f"model's vocab_size ({vocab_size}): ids >= {tokenizer_size} cannot be decoded and are "
        f"left out of the text ({unknown} of the {new_ids.size} new ids here). Pass the "
        "model's own tokenizer (--tokenizer DIR), or --json PATH for the ids.",
        file=sys.stderr,
    )


def run(args) -> dict:
    if args.batch < 1:
        raise ValueError(f"--batch ({args.batch}) must be a positive int")
    directory = args.tokenizer or args.checkpoint
    tokenizer = read_tokenizer(directory) if directory else None
    prompt = prompt_ids(args, tokenizer)
    import jax  # after the arguments are checked: a mistake is reported at once
    import numpy as np

    from flax_attention.models import generate

    model = load_model(args)
    ids = np.asarray([prompt] * args.batch, np.int32)
    key, context = jax.random.key(args.seed), model.cfg["context_length"]

    def timed(new_tokens):  # the tokens and the wall time of one whole generate call
        start = time.perf_counter()
        out = generate(model, ids, new_tokens, context, args.temperature, args.top_k, key=key)
        return np.asarray(out.block_until_ready()), time.perf_counter() - start

    _, first_s = timed(args.max_new_tokens)  # compiles
    out, generate_s = timed(args.max_new_tokens)
    timed(1)  # compiles the prefill's shapes
    new_ids, prefill_s = out[:, len(prompt) :], timed(1)[1]
    if tokenizer is not None:
        warn_unknown_ids(tokenizer.get_vocab_size(), model.cfg["vocab_size"], new_ids)
    for row in new_ids.tolist():
        print(tokenizer.decode(prompt + row) if tokenizer is not None else row)
    result = {
        "tokens": new_ids.tolist(), "prefill_ms": 1e3 * prefill_s,
        "tokens_per_s": new_ids.size / generate_s, "compile_s": first_s - generate_s,
    }  # fmt: skip
    print(", ".join(f"{k} {v:.4g}" for k, v in list(result.items())[1:]), file=sys.stderr)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    try:
        run(args)
    except (ValueError, TypeError) as error:
        parser.error(str(error))  # exits 2, the message on stderr
    return 0


if __name__ == "__main__":
    sys.exit(main())
