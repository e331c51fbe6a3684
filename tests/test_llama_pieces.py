"""llamacpp.pieces.PieceTokenizer against llama.cpp's own llama_tokenize: the same tokens for every text, on every
tokenizer test vocabulary llama.cpp ships (vendor/llama.cpp/models/ggml-vocab-*.gguf, with their test
inputs) and on SmolLM2, first from llama.cpp and then from the cache; the vocabularies it cannot copy
exactly are left to llama.cpp whole; the cache stays inside its byte budget."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from localrun.backends.llamacpp.pieces import PieceTokenizer  # noqa: E402
from localrun.bench.tokenize import VocabOnly  # noqa: E402

# the vocabularies whose tokenizing the cache copies (llama.cpp's SentencePiece and byte-level BPE sessions,
# no whitespace-stripping special tokens): if one of these turned the cache off, it would be off for the
# models most users run (Llama 3, Qwen, StarCoder, DeepSeek-Coder, ...)
COPIED = {"llama-spm", "llama-bpe", "qwen2", "qwen35", "gpt-2", "starcoder", "deepseek-coder", "falcon", "mpt",
          "gpt-neox", "refact", "command-r", "baichuan", "aquila"}
NOT_COPIED = {"bert-bge", "nomic-bert-moe"}  # WordPiece: not cut-then-tokenize-each-piece


class Vocab(VocabOnly):
    def pieces(self, **kw) -> PieceTokenizer | None:
        pt = super().pieces()
        if pt is not None and kw:
            pt.max_bytes = kw["max_bytes"]
        return pt


def texts_for(pt: PieceTokenizer, inputs: list[str]) -> list[str]:
    """llama.cpp's test inputs, and texts around the vocabulary's special tokens: adjacent, repeated, cut
    short, inside words, between whitespace; a chat of several turns."""
    specials = [t.decode("utf-8", "replace") for t, _ in pt._cut[True]][:8]
    out = list(inputs) + ["", " ", "  ", "\n", "hello", "naïve café 日本語 🤖 1234567 \t\r\n x"]
    for s in specials:
        out += [s, s + s, " " + s + " ", "a" + s + "b", s + "\nhello", "x " + s[:-1], s[1:] + s, "\n\n" + s + "  \n",
                s + " world" + s, s[: len(s) // 2] + s + s[len(s) // 2:]]
    if len(specials) >= 2:
        a, b = specials[0], specials[1]
        out += [a + b, b + a + b, f"{a}system\nYou are terse.{b}\n{a}user\nHi!{b}\n{a}assistant\n",
                "".join(f"{a}user\nturn {i}: {'word ' * i}{b}\n" for i in range(12))]
    return out


def check(vocab: Vocab, pt: PieceTokenizer, texts: list[str]) -> int:
    n = 0
    for rep in range(2):  # llama.cpp's pieces, then the cached ones
        for text in texts:
            for add_special in (False, True):
                for special in (False, True):
                    got = pt.tokenize(text, add_special, special)
                    want = vocab.raw(text.encode("utf-8"), add_special, special)
                    assert got == want, (text[:120], add_special, special, rep)
                    n += 1
    return n


@pytest.fixture(scope="module")
def vocab_dir(request, tmp_path_factory) -> Path:
    from vlm_model import _sdist

    try:
        cache = request.config.cache.mkdir("llama-sdist")
    except AttributeError:  # the cache plugin is off
        cache = tmp_path_factory.mktemp("llama-sdist")
    return _sdist(cache) / "vendor" / "llama.cpp" / "models"


def test_pieces_tokenize_as_llama_cpp_on_its_test_vocabularies(vocab_dir):
    files = sorted(vocab_dir.glob("ggml-vocab-*.gguf"))
    assert len(files) >= 15, f"expected llama.cpp's tokenizer test vocabularies in {vocab_dir}"
    on, off, checks = set(), set(), 0
    for f in files:
        name = f.name[len("ggml-vocab-"):-len(".gguf")]
        inp = f.with_name(f.name + ".inp")
        inputs = inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n") if inp.exists() else []
        vocab = Vocab(f)
        try:
            pt = vocab.pieces()
            if pt is None:
                off.add(name)
                continue
            on.add(name)
            checks += check(vocab, pt, texts_for(pt, inputs))
        finally:
            vocab.close()
    assert COPIED <= on, f"the piece cache is off for {sorted(COPIED - on)}"
    assert not (NOT_COPIED & on), f"the piece cache is on for a WordPiece vocabulary: {sorted(NOT_COPIED & on)}"
    assert checks > 5000


def test_longest_piece_counts_every_token_with_one_buffer(vocab_dir, smollm2_gguf):
    """BackendInfo.max_token_bytes (the bound that refuses a prompt too long for the window before it is
    tokenized): one reused 256-byte buffer, a longer piece counted by the size llama.cpp asks for; equal
    to the longest piece written out whole, on vocabularies whose longest is shorter and longer than that."""
    from localrun.backends.llamacpp.pieces import longest_piece, token_piece

    seen = {}
    for f in [smollm2_gguf, vocab_dir / "ggml-vocab-aquila.gguf", vocab_dir / "ggml-vocab-llama-bpe.gguf"]:
        vocab = Vocab(f)
        try:
            n = llama_cpp.llama_vocab_n_tokens(vocab.vocab)
            want = max(len(token_piece(llama_cpp, vocab.vocab, t, special=True)) for t in range(n))
            seen[f.name] = longest_piece(llama_cpp, vocab.vocab, n)
            assert seen[f.name] == want, (f.name, seen[f.name], want)
        finally:
            vocab.close()
    assert seen["ggml-vocab-aquila.gguf"] > 256 > seen[Path(smollm2_gguf).name]  # both sides of the buffer


def test_pieces_on_smollm2_a_growing_chat_and_a_small_budget(smollm2_gguf):
    vocab = Vocab(smollm2_gguf)
    try:
        pt = vocab.pieces()
        assert pt is not None
        assert {t for t, _ in pt._cut[True]} >= {b"<|im_start|>", b"<|im_end|>"}
        # a chat resent turn after turn: each turn's text is the last one's and a new message
        history = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM.<|im_end|>\n"
        for i in range(20):
            history += f"<|im_start|>user\nQuestion {i}: {'why is the sky blue? ' * (i % 5)}<|im_end|>\n"
            prompt = history + "<|im_start|>assistant\n"
            assert pt.tokenize(prompt, True, True) == vocab.raw(prompt.encode(), True, True)
            history += f"<|im_start|>assistant\nAnswer {i}: Rayleigh scattering, {i} times over.<|im_end|>\n"
        pieces = pt.pieces(history.encode(), True)
        assert len(pieces) == 4 * 41  # (special, text, special, newline): the system message and 40 turns
        # each piece kept once, its text and its ids (4 bytes each) counted
        kept = {p for p in pt.pieces(prompt.encode(), True) if type(p) is bytes}  # every earlier prompt is in the last
        assert set(k[1] for k in pt._cache) == kept
        assert pt.cached_bytes == sum(len(k[1]) + 4 * len(ids) for k, ids in pt._cache.items())
        # a budget smaller than the texts: pieces are dropped, the tokens stay exact, the bytes under it
        small = vocab.pieces(max_bytes=256)
        for i in range(50):
            text = f"<|im_start|>user\nmessage {i} {'x' * (i * 7)}<|im_end|>\n<|im_start|>assistant\n"
            assert small.tokenize(text, False, True) == vocab.raw(text.encode(), False, True)
            assert small.cached_bytes <= 256
        big = "y " * 200  # over a quarter of the budget: tokenized, never kept
        assert small.tokenize(big, False, True) == vocab.raw(big.encode(), False, True)
        assert all(len(k[1]) <= 64 for k in small._cache)
    finally:
        vocab.close()


def test_the_backend_tokenizes_through_the_pieces(smollm2_gguf):
    """LlamaCppBackend._tokenize goes through its PieceTokenizer and gives llama.cpp's tokens."""
    from llama_backend import smollm2_backend

    backend = smollm2_backend(smollm2_gguf, num_ctx=256, parallel=1)
    try:
        assert backend._pieces is not None
        text = "<|im_start|>user\nHello, naïve world!<|im_end|>\n<|im_start|>assistant\n"
        for add_special in (False, True):
            want = backend._tokenize_raw(text.encode(), add_special, True)
            assert backend._tokenize(text, add_special) == want
            assert backend._tokenize(text, add_special) == want  # from the cache
        assert backend._pieces.cached_bytes > 0
    finally:
        asyncio.run(backend.close())


def test_overlapping_special_texts_turn_the_cache_off():
    from localrun.backends.llamacpp.pieces import _overlapping

    assert _overlapping([b"<ab>", b"b><c"]) is True  # "b>" ends one and starts the other
    assert _overlapping([b"<aa>", b"<bb>"]) is False
    assert _overlapping([b"aaaa", b"bbbb"]) is False  # a text overlapping itself is no order question
    assert _overlapping([b"abab", b"baba"]) is True


def test_bench_tokenize_prints_both_ways_and_checks_them_equal(capsys):
    """`localrun bench tokenize` on the bundled model, a short chat: both timings each turn, the ratio."""
    from localrun.bench.cli import main

    assert main(["tokenize", "--turns", "6", "--words", "20"]) == 0
    out = capsys.readouterr().out
    assert "llama_tokenize ms" in out and "pieces ms" in out
    assert "last half of the turns, median a turn: llama_tokenize" in out and "bytes of pieces kept" in out
