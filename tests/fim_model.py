"""The tiny fill-in-the-middle test model (no package ships a small code model with FIM tokens): a random
Llama whose vocabulary has <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>, written by tests/tools/tiny_fim.py
(a copy of the project's shared tool) and converted by the converter in the llama-cpp-python sdist, cached
under the pytest cache directory; and the reference: llama-server's /infill layout (format_prompt_infill in
tools/server/server-common.cpp, written out again here from that source, independently of localrun's
backend) decoded greedily by llama.cpp itself through llama-cpp-python, one sequence, one token at a time."""

from __future__ import annotations

from pathlib import Path

from vlm_model import build_models

N_BATCH = 2048  # llama-server's default --batch-size


def build_tiny_fim(cache: Path) -> Path:
    """The tiny FIM model's GGUF, built once into ``cache``."""
    return build_models(cache, "tiny_fim.py", {"tiny-fim.gguf": ("",)})[0]


class Reference:
    """llama.cpp (llama-cpp-python) on the tiny model: llama-server's infill layout and greedy decoding."""

    def __init__(self, gguf: Path, n_ctx: int):
        import llama_cpp

        self.n_ctx = n_ctx
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=2, verbose=False)
        self.lib = llama_cpp
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)

    def close(self) -> None:
        self.llm.close()

    def tok(self, text: str, special: bool = False) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=special) if text else []

    def fim(self, name: str) -> int:
        return int(getattr(self.lib, f"llama_vocab_fim_{name}")(self.vocab))

    def layout(self, prefix: str, suffix: str, extra: list[dict] | None = None, prompt: str = "",
               n_predict: int = -1) -> list[int]:
        """format_prompt_infill, as llama-server calls it (its n_predict is the server's, -1 by default)."""
        null = -1
        extra_tokens: list[int] = []
        if self.fim("rep") != null:
            extra_tokens += [self.fim("rep"), *self.tok("myproject\n")]
        for chunk in extra or []:
            if self.fim("sep") != null:
                extra_tokens += [self.fim("sep"), *self.tok(chunk.get("filename", "tmp") + "\n")]
            else:
                extra_tokens += self.tok("\n\n--- snippet ---\n\n")
            extra_tokens += self.tok(chunk["text"])
        if self.fim("sep") != null:
            extra_tokens += [self.fim("sep"), *self.tok("filename\n")]
        tp, ts = self.tok(prefix), self.tok(suffix)
        head = self.tok(prompt, special=True)
        n_prefix_take = min(len(tp), 3 * (N_BATCH // 4))
        n_suffix_take = min(len(ts), max(0, N_BATCH // 4 - (2 + len(head))))
        n_extra_take = min(max(0, self.n_ctx - N_BATCH - 2 * n_predict), len(extra_tokens))
        tp = [self.fim("pre"), *tp[len(tp) - n_prefix_take:], *head]
        ts = [self.fim("suf"), *ts[:n_suffix_take]]
        inp = tp
        if self.lib.llama_vocab_get_add_bos(self.vocab):
            inp = [int(self.lib.llama_vocab_bos(self.vocab)), *inp]
        inp = [*extra_tokens[len(extra_tokens) - n_extra_take:], *inp]
        return [*inp, *ts, self.fim("mid")]

    def greedy(self, tokens: list[int], n: int, stop_at_eog: bool = True) -> list[int]:
        """Greedy ids after `tokens` (a fresh sequence), stopping before an end-of-generation token."""
        lib = self.lib
        mem = lib.llama_get_memory(self.llm.ctx)
        lib.llama_memory_clear(mem, True)
        for i in range(0, len(tokens), 512):
            part = (lib.llama_token * len(tokens[i:i + 512]))(*tokens[i:i + 512])  # alive while decoded
            batch = lib.llama_batch_get_one(part, len(part))
            assert lib.llama_decode(self.llm.ctx, batch) == 0
        greedy = lib.llama_sampler_init_greedy()
        out: list[int] = []
        try:
            for _ in range(n):
                tok = lib.llama_sampler_sample(greedy, self.llm.ctx, -1)
                if stop_at_eog and lib.llama_vocab_is_eog(self.vocab, tok):
                    break
                out.append(tok)
                one = (lib.llama_token * 1)(tok)
                batch = lib.llama_batch_get_one(one, 1)
                assert lib.llama_decode(self.llm.ctx, batch) == 0
        finally:
            lib.llama_sampler_free(greedy)
        return out

    def text(self, ids: list[int]) -> str:
        return self.llm.detokenize(ids).decode("utf-8", "replace")
