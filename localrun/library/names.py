"""Model names and blob digests: the only strings that ever become paths in the store.

Every path the library builds comes from a :class:`ModelName` (validated here) or a
digest that passed :func:`validate_digest` (``sha256:`` + 64 lowercase hex), so a
name like ``../../etc/passwd`` or a digest like ``sha256:../x`` never reaches the
filesystem (Ollama CVE-2024-37032).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from localrun.errors import InvalidRequest

DEFAULT_HOST = "local"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
HF_HOST = "hf.co"
_HF_ALIASES = {"hf.co", "huggingface.co", "www.huggingface.co"}

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
# A path component: starts with a letter or digit, then letters, digits, '.', '_', '-'.
MAX_PART = 96  # characters in a namespace or model part of a name (Ollama's limits too)
MAX_TAG = 128
_PART_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,%d}$" % (MAX_PART - 1))
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,%d}$" % (MAX_TAG - 1))
# Original file names of files inside a model (safetensors repos): one plain component.
_FILENAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$")


def validate_digest(digest: object) -> str:
    """Return the digest in canonical ``sha256:<hex>`` form or raise InvalidRequest.

    ``sha256-<hex>`` (the blob file-name form) is accepted and normalized; anything
    else (wrong length, upper case, other algorithms, path characters) is refused.
    """
    if not isinstance(digest, str):
        raise InvalidRequest("invalid digest: expected a string like 'sha256:<64 hex digits>'")
    d = digest.strip()
    if d.startswith("sha256-"):
        d = "sha256:" + d[len("sha256-"):]
    if not _DIGEST_RE.match(d):
        raise InvalidRequest(f"invalid digest {_quoted(d, 80)}: expected 'sha256:' followed by 64 lowercase hex digits")
    return d


def validate_filename(name: str) -> str:
    if not isinstance(name, str) or not _FILENAME_RE.match(name) or ".." in name:
        raise InvalidRequest(f"invalid file name {_quoted(str(name), 80)} inside a model: expected a plain file name")
    return name


@dataclass(frozen=True)
class ModelName:
    host: str  # "local" for library names, "hf.co" for Hugging Face repos
    namespace: str  # "library" by default; the ORG for hf.co names
    model: str  # the model (or REPO for hf.co names)
    tag: str  # "latest" by default; the quant (Q4_K_M) for hf.co GGUF names
    explicit_tag: bool = True  # False when the user gave no tag

    @property
    def is_hf(self) -> bool:
        return self.host == HF_HOST

    @property
    def repo_id(self) -> str | None:
        return f"{self.namespace}/{self.model}" if self.is_hf else None

    @property
    def base(self) -> str:
        """The name without its tag: 'smollm2', 'ns/name', 'hf.co/ORG/REPO'."""
        if self.is_hf:
            return f"{HF_HOST}/{self.namespace}/{self.model}"
        if self.namespace == DEFAULT_NAMESPACE:
            return self.model
        return f"{self.namespace}/{self.model}"

    @property
    def display(self) -> str:
        """The canonical 'name:tag' string (what list/show/resolve report)."""
        return f"{self.base}:{self.tag}"

    @property
    def parts(self) -> tuple[str, str, str, str]:
        """Path components of the manifest: manifests/<host>/<namespace>/<model>/<tag>."""
        return (self.host, self.namespace, self.model, self.tag)

    def with_tag(self, tag: str) -> "ModelName":
        return ModelName(self.host, self.namespace, self.model, tag, True)

    def __str__(self) -> str:
        return self.display


def _shown(text: str, limit: int = 120) -> str:
    """text for an error message: escaped, and cut (ending in '...') when long."""
    cut = text[:limit].encode("unicode_escape").decode("ascii")
    return cut + "..." if len(text) > limit else cut


def _quoted(text: str, limit: int = 120) -> str:
    """_shown(text) in single quotes: escaped once ('h\\xe9llo'), never again by a repr()."""
    return f"'{_shown(text, limit)}'"


def _bad(text: str, why: str) -> InvalidRequest:
    return InvalidRequest(
        f"invalid model name {_quoted(text)}: {why}. Use 'name', 'name:tag', 'namespace/name:tag' or 'hf.co/ORG/REPO[:QUANT]'"
    )


def parse_name(text: object) -> ModelName:
    """Parse and validate a model name. Raises InvalidRequest with the reason."""
    if not isinstance(text, str):
        raise InvalidRequest("invalid model name: expected a string")
    raw = text
    t = text.strip()
    if not t:
        raise _bad(raw, "it is empty")
    if "\x00" in t:
        raise _bad(raw, "it contains a NUL byte")
    if "\\" in t:
        raise _bad(raw, "it contains a backslash")
    if t.startswith("/") or t.startswith("~"):
        raise _bad(raw, "it looks like a file path; use FROM in a Modelfile (localrun create) to import files")
    for prefix in ("https://", "http://"):
        if t.lower().startswith(prefix):
            t = t[len(prefix):]
    if ".." in t:
        raise _bad(raw, "it contains '..'")
    if any(c.isspace() for c in t):
        raise _bad(raw, "it contains whitespace")
    # The tag follows the last ':' after the last '/'.
    slash = t.rfind("/")
    colon = t.rfind(":")
    if colon > slash:
        path, tag = t[:colon], t[colon + 1:]
        if not tag:
            raise _bad(raw, "the tag after ':' is empty")
        explicit = True
    else:
        path, tag, explicit = t, DEFAULT_TAG, False
    if len(tag) > MAX_TAG:
        raise _bad(raw, f"the tag {_quoted(tag, 40)} is {len(tag)} characters long: at most {MAX_TAG}")
    if not _TAG_RE.match(tag):
        raise _bad(raw, f"the tag {_quoted(tag, 40)} may only hold letters, digits, '.', '_' and '-'")
    comps = path.split("/")
    if any(c == "" for c in comps):
        raise _bad(raw, "it has an empty path component")
    if comps[0].lower() in _HF_ALIASES:
        if len(comps) != 3:
            raise _bad(raw, "Hugging Face names look like hf.co/ORG/REPO")
        host, namespace, model = HF_HOST, comps[1], comps[2]
    elif len(comps) == 1:
        host, namespace, model = DEFAULT_HOST, DEFAULT_NAMESPACE, comps[0].lower()
        tag = tag.lower()
    elif len(comps) == 2:
        host, namespace, model = DEFAULT_HOST, comps[0].lower(), comps[1].lower()
        tag = tag.lower()
    else:
        if "." in comps[0]:
            raise _bad(raw, f"the registry {_quoted(comps[0], 40)} is not supported (only hf.co)")
        raise _bad(raw, "too many '/' components")
    for c in (namespace, model):
        if len(c) > MAX_PART:
            raise _bad(raw, f"{_quoted(c, 40)} is {len(c)} characters long: each part of a name may have at most "
                            f"{MAX_PART}")
        if not _PART_RE.match(c):
            raise _bad(raw, f"{_quoted(c, 40)} may only hold letters, digits, '.', '_' and '-' and must start with a letter or digit")
    if host == DEFAULT_HOST and namespace in (HF_HOST,):
        raise _bad(raw, "Hugging Face names look like hf.co/ORG/REPO")
    return ModelName(host, namespace, model, tag, explicit)


__all__ = ["ModelName", "parse_name", "validate_digest", "validate_filename", "DEFAULT_TAG", "HF_HOST"]
