"""Manifests: one JSON file per stored name:tag (Ollama's shape), listing the blobs a model is made of.

Manifest paths are built only from validated ModelNames; a manifest is written to a temp file and
lands with os.replace, and only once every blob it names is in the store.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterator

from localrun.errors import LocalrunError, ModelDamaged, NotFound
from localrun.library.blobs import Blobs
from localrun.library.disk_errors import storage_errors
from localrun.library.names import ModelName, parse_name, validate_digest, validate_filename
from localrun.library.scratch import Scratch, fsync_dir


class Manifests:
    """manifests/ of a store: what `blobs` holds is checked before a manifest names it; `scratch` holds the
    temp files manifests are written through."""

    def __init__(self, manifests: Path, blobs: Blobs, scratch: Scratch):
        self.manifests, self.blobs, self.scratch = manifests, blobs, scratch

    def manifest_path(self, name: ModelName) -> Path:
        return self.manifests.joinpath(*name.parts)

    def read_manifest(self, name: ModelName) -> tuple[dict, str, float]:
        p = self.manifest_path(name)
        try:
            raw = p.read_bytes()
            mtime = p.stat().st_mtime
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise NotFound(f"model '{name.display}' not found; pull it with `localrun pull {name.display}`") from None
        try:
            m = json.loads(raw)
            layers = m["layers"]
            for layer in layers + ([m["config"]] if m.get("config") else []):
                validate_digest(layer["digest"])
                if "filename" in layer:
                    validate_filename(layer["filename"])
        except (ValueError, KeyError, TypeError, LocalrunError):
            raise ModelDamaged(f"model '{name.display}' is damaged: its manifest is corrupt; remove it with "
                               f"`localrun rm {name.display}`, then pull or create it again") from None
        return m, "sha256:" + hashlib.sha256(raw).hexdigest(), mtime

    def write_manifest(self, name: ModelName, manifest: dict) -> str:
        data = json.dumps(manifest, indent=2, sort_keys=False).encode()
        for layer in manifest["layers"]:
            if not self.blobs.has_blob(layer["digest"]):
                raise LocalrunError(f"cannot write manifest of {name.display}: blob {layer['digest'][:19]} is missing",
                                    status=500, code="storage_error")
        path = self.manifest_path(name)
        with self.scratch.temp_file() as (tmp, f), storage_errors(f"write the manifest of {name.display}"):
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, path)
            fsync_dir(path.parent)
        return "sha256:" + hashlib.sha256(data).hexdigest()

    def delete_manifest(self, name: ModelName) -> None:
        p = self.manifest_path(name)
        try:
            p.unlink()
        except FileNotFoundError:
            raise NotFound(f"model '{name.display}' not found") from None
        # prune empty parent directories up to manifests/
        parent = p.parent
        while parent != self.manifests and parent.is_dir():
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def iter_manifests(self) -> Iterator[tuple[ModelName, Path]]:
        if not self.manifests.is_dir():
            return
        for host in sorted(self.manifests.iterdir()):
            for ns in sorted(_dirs(host)):
                for model in sorted(_dirs(ns)):
                    for tag in sorted(model.iterdir()):
                        if tag.name.startswith(".") or not tag.is_file():
                            continue
                        text = (f"hf.co/{ns.name}/{model.name}:{tag.name}" if host.name == "hf.co"
                                else f"{ns.name}/{model.name}:{tag.name}")
                        try:
                            name = parse_name(text)
                        except LocalrunError:
                            continue
                        if name.parts != (host.name, ns.name, model.name, tag.name):
                            continue
                        yield name, tag



def _dirs(p: Path) -> list[Path]:
    try:
        return [c for c in p.iterdir() if c.is_dir() and not c.name.startswith(".")]
    except OSError:
        return []

