"""The tokenizer and the incremental detokenizer streaming uses.

Tokenizer wraps a transformers fast tokenizer, built from tokenizer files or from the
GGUF metadata; Detokenizer turns tokens into text as they arrive."""

from __future__ import annotations

import contextlib
import threading
import functools
import json
from pathlib import Path


class Tokenizer:
    def __init__(self, hf_tokenizer, eos_token_ids: list[int], chat_template: str | None) -> None:
        self._tok = hf_tokenizer
        eos = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids = sorted(eos)
        self.chat_template = chat_template or getattr(hf_tokenizer, "chat_template", None)
        if isinstance(self.chat_template, dict):  # some repos ship several named templates
            self.chat_template = self.chat_template.get("default") or next(iter(self.chat_template.values()))
        self.bos_token = hf_tokenizer.bos_token or ""
        self.eos_token = hf_tokenizer.eos_token or ""
        self.vocab_size = len(hf_tokenizer)

    @classmethod
    def from_gguf(cls, path: str | Path, eos_token_ids: list[int], chat_template: str | None) -> "Tokenizer":
        from transformers import AutoTokenizer

        p = Path(path)
        try:
            tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        except TypeError:  # transformers 5.23 cannot read a gpt-oss GGUF's rope.scaling keys (it reads each
            with _without_rope_scaling():  # field's first part, its name's length): read the tokenizer without them
                tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        return cls(tok, eos_token_ids, chat_template)

    @classmethod
    def from_dir(cls, directory: str | Path, eos_token_ids: list[int]) -> "Tokenizer | None":
        d = Path(directory)
        if not (d / "tokenizer.json").is_file() and not (d / "tokenizer.model").is_file():
            return None
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(d))
        eos = list(eos_token_ids)
        gen = d / "generation_config.json"
        if gen.is_file():
            e = json.loads(gen.read_text()).get("eos_token_id")
            eos += e if isinstance(e, list) else [] if e is None else [e]
        return cls(tok, eos, None)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The tokens decode(skip_special_tokens=True) leaves out: the special added tokens."""
        added = getattr(self._tok, "added_tokens_decoder", {}) or {}
        return frozenset({i for i, t in added.items() if getattr(t, "special", False)}
                         | set(self._tok.all_special_ids or ()))

    def kept_specials(self, texts: list[str] | None) -> frozenset[int]:
        """The special tokens among `texts` (each one token's text): those whose text an output keeps."""
        return self._kept(tuple((texts or [])[:64])) if texts else frozenset()

    @functools.lru_cache(maxsize=64)  # noqa: B019 - a few sets per model (its templates' markers)
    def _kept(self, texts: tuple[str, ...]) -> frozenset[int]:
        out = set()
        for t in texts:
            ids = self.encode(t) if len(t) <= 64 else []
            if len(ids) == 1 and ids[0] in self.special_ids:
                out.add(ids[0])
        return frozenset(out)

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        return list(self._tok(text, add_special_tokens=add_special)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_str(self, token_id: int) -> str:
        return self._tok.decode([token_id])

    def max_token_bytes(self) -> int:
        """An upper bound on the bytes of text one token stands for (its vocabulary form in
        UTF-8 is never shorter), so a prompt of more bytes than this x N has more than N tokens."""
        return max((len(t.encode("utf-8")) for t in self._tok.get_vocab()), default=0)


class Detokenizer:
    """Turns a growing token list into text deltas without splitting multi-byte characters or
    losing the leading spaces that depend on the previous token (vLLM's offsets method).
    Special tokens give no text, except those in `keep` (a harmony chat's channel markers, a
    template's tool-call markers): their text stays in the output, for the parser to read."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], keep: frozenset[int] = frozenset()) -> None:
        self.tok = tokenizer
        self.drop = tokenizer.special_ids - keep if keep else None  # None: decode as skip_special_tokens does
        tail = prompt_ids[-5:] if self.drop is None else [i for i in prompt_ids if i not in self.drop][-5:]
        self.ids = list(tail)
        self.prefix = 0
        self.read = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids) if self.drop is None else self.tok.decode(ids, skip_special_tokens=False)

    def add(self, token_id: int) -> str:
        if self.drop is not None and token_id in self.drop:
            return ""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self.ids = self.ids[self.read:]
        self.prefix, self.read = 0, len(self.ids)
        return text[len(before):]


_READER_SWAP = threading.Lock()  # one swap at a time (a runner loads its one model's tokenizer before its weights)


@contextlib.contextmanager
def _without_rope_scaling():
    """gguf.GGUFReader, while transformers reads a GGUF's tokenizer, with the rope.scaling.* keys left out (the
    tokenizer needs none of them). The swap is process-wide for the call's length, so it is serialised."""
    import gguf

    real = gguf.GGUFReader

    class _Reader(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for k in [k for k in self.fields if ".rope.scaling." in k]:
                del self.fields[k]

    with _READER_SWAP:
        gguf.GGUFReader = _Reader
        try:
            yield
        finally:
            gguf.GGUFReader = real
