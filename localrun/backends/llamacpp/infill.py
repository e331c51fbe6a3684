"""Fill in the middle on llama.cpp: the prompt llama-server's /infill lays out from a prefix and a suffix.

The model's vocabulary must have the fill-in-the-middle tokens (prefix, suffix, middle; repo and separator
tokens where it has them), as code models such as Qwen2.5-Coder and CodeLlama do.
"""

from __future__ import annotations

from typing import Callable

from localrun.backends.base import INFILL_BATCH, Infill
from localrun.errors import InvalidRequest


def fim_tokens(lib, v) -> dict[str, int] | None:
    """The vocabulary's FIM tokens (llama.cpp finds them by id in the GGUF or by their text); None
    when prefix, suffix or middle is missing. `v`: the model's llama_vocab."""
    ids = {k: int(getattr(lib, f"llama_vocab_fim_{k}")(v)) for k in ("pre", "suf", "mid", "rep", "sep")}
    return ids if min(ids["pre"], ids["suf"], ids["mid"]) >= 0 else None


def infill_tokens(lib, v, tokenize: Callable[..., list[int]], name: str, infill: Infill, prompt: str, n_ctx: int,
                  n_predict: int | None) -> list[int]:
    """The prompt llama-server's /infill builds (format_prompt_infill in tools/server): the repo-level
    pattern [FIM_REP]myproject [FIM_SEP]file chunk ... [FIM_SEP]filename [FIM_PRE]prefix prompt
    [FIM_SUF]suffix [FIM_MID], the prefix's tail and the suffix's head cut to fit a batch (3:1), the
    extra chunks to fit the context; prefix/suffix/extra texts are not parsed for special tokens.
    `tokenize(text, add_special, special=...)` is the backend's tokenizer; `name` the model's."""
    fim = fim_tokens(lib, v)
    if fim is None:
        raise InvalidRequest(f"{name} cannot fill in the middle: its vocabulary has no "
                             "fill-in-the-middle tokens (use a code model such as Qwen2.5-Coder or CodeLlama)")

    def tok(text: str) -> list[int]:
        return tokenize(text, False, special=False)

    extra: list[int] = []
    if fim["rep"] >= 0:
        extra += [fim["rep"], *tok("myproject\n")]
    for chunk in infill.extra:
        if fim["sep"] >= 0:
            extra += [fim["sep"], *tok(str(chunk.get("filename") or "tmp") + "\n")]
        else:
            extra += tok("\n\n--- snippet ---\n\n")
        extra += tok(str(chunk.get("text") or ""))
    if fim["sep"] >= 0:
        extra += [fim["sep"], *tok("filename\n")]
    prefix, suffix = tok(infill.prefix), tok(infill.suffix)
    head = tokenize(prompt, False) if prompt else []  # as llama-server tokenizes the prompt
    n_batch = INFILL_BATCH
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(head))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * (n_predict if n_predict is not None else -1)), len(extra))
    inp = [fim["pre"], *prefix[len(prefix) - n_prefix:], *head]
    end = [fim["suf"], *suffix[:n_suffix]]
    if lib.llama_vocab_get_add_bos(v):
        inp.insert(0, int(lib.llama_vocab_bos(v)))
    return [*extra[len(extra) - n_extra:], *inp, *end, fim["mid"]]
