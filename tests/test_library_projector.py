"""A vision projector is its own layer: a Modelfile's second FROM (a GGUF whose architecture is clip)
is copied into the store as a projector blob, resolve() names it, a model built FROM that one inherits
it, and a second FROM that is not a projector is a clear 400 that stores nothing."""

from __future__ import annotations

import json

import pytest

from localrun.errors import InvalidRequest
from localrun.library.api import Library
from localrun.library.store import MT_PROJECTOR


def _layers(lib: Library, name: str) -> list[dict]:
    manifest_path = next(p for mn, p in lib.store.iter_manifests() if mn.display in (name, f"{name}:latest"))
    return json.loads(manifest_path.read_text())["layers"]


def test_second_from_is_the_projector_layer(tmp_path, vlm):
    gguf, mmproj = vlm
    lib = Library(tmp_path / "models")
    r = lib.create("vlm", f"FROM {gguf}\nFROM {mmproj}\n")
    assert r.projector is not None and r.projector.read_bytes() == mmproj.read_bytes()
    assert r.weights.read_bytes() == gguf.read_bytes()
    assert [l["mediaType"] for l in _layers(lib, "vlm")].count(MT_PROJECTOR) == 1
    # a model made from it keeps the projector: the same blob, not a copy
    r2 = lib.create("vlm-child", "FROM vlm\nSYSTEM be brief\n")
    assert r2.projector == r.projector
    # a text-only model has none
    assert lib.create("text", f"FROM {gguf}\n").projector is None


def test_a_second_from_that_is_not_a_projector_is_refused(tmp_path, vlm, smollm2_gguf):
    gguf, _ = vlm
    lib = Library(tmp_path / "models")
    with pytest.raises(InvalidRequest, match="vision projector"):
        lib.create("bad", f"FROM {gguf}\nFROM {smollm2_gguf}\n")
    with pytest.raises(InvalidRequest, match="three"):
        lib.create("bad", f"FROM {gguf}\nFROM {gguf}\nFROM {gguf}\n")
    assert not lib.exists("bad")
