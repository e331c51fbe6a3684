"""Resolving a name to its stored model: the manifest found, its layers read and checked, the answer cached.

A model whose files are missing or damaged is a ModelDamaged that names it, says what is wrong and
how to repair it (pull it again, or remove and create it, or repair the model it was made from).
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from localrun.errors import InvalidRequest, LocalrunError, ModelDamaged, NotFound
from localrun.library import catalog as _catalog
from localrun.library.blobs import DamagedBlob, short_blob
from localrun.library.create import gguf_details, template_from_files
from localrun.library.gguf_info import GGUFInfo, cached_gguf_info
from localrun.library.layers import TEXT_LAYERS, read_config
from localrun.library.model import ResolvedModel
from localrun.library.names import ModelName, parse_name
from localrun.library.store import MT_ADAPTER, MT_FILE, MT_LICENSE, MT_MESSAGES, MT_MODEL, MT_PARAMS, MT_PROJECTOR, \
    MT_SYSTEM, MT_TEMPLATE, Store

# what a damaged layer is called in messages
PART_NAMES = {MT_MODEL: "weights file", MT_PROJECTOR: "vision projector", MT_ADAPTER: "LoRA adapter",
              MT_TEMPLATE: "template", MT_SYSTEM: "system prompt", MT_LICENSE: "license", MT_PARAMS: "parameters",
              MT_MESSAGES: "messages"}


def stat_sig(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def copy_resolved(r: ResolvedModel) -> ResolvedModel:
    """A copy whose containers the caller may change without changing the cached one."""
    return dataclasses.replace(r, parameters=dict(r.parameters), details=dict(r.details),
                               messages=[dict(x) if isinstance(x, dict) else x for x in r.messages])


class Resolver:
    """Names to stored models, for the library's other parts and every generation request."""

    def __init__(self, store: Store):
        self.store = store
        # name -> (its manifest's stat and path, the exact name's manifest path when the catalog's tag was taken
        # instead, the resolved model): every generation request resolves its model (see resolve)
        self._resolved: dict[str, tuple[tuple, Path, Path | None, ResolvedModel, list]] = {}

    def find(self, mn: ModelName) -> ModelName:
        """The stored name for mn: exact, else (no tag given) the catalog's default tag."""
        if self.store.manifest_path(mn).is_file():
            return mn
        if not mn.explicit_tag and not mn.is_hf:
            tag = _catalog.load_catalog()["latest"].get(mn.model)
            if tag and mn.namespace == "library":
                alt = mn.with_tag(tag)
                if self.store.manifest_path(alt).is_file():
                    return alt
        return mn

    def exists(self, name: str) -> bool:
        return self.store.manifest_path(self.find(parse_name(name))).is_file()

    def stored_name(self, name: str) -> str:
        """The stored model's full name for `name` (what delete unloads and removes): its manifest
        only, not its layers, so a model whose weights went missing can still be removed."""
        found = self.find(parse_name(name))
        if not self.store.manifest_path(found).is_file():
            raise NotFound(f"model '{name}' not found; `localrun list` shows the models in the library")
        return found.display

    def resolve(self, name: str) -> ResolvedModel:
        """The stored model `name` names. Every generation request asks, so the answer is kept while
        nothing it was read from changed: one stat of the manifest (a pull, create, copy or rm replaces
        or removes it; the layers it lists are content-addressed) and of its GGUF files (a truncated or
        replaced blob is seen) instead of about ten small reads. A model whose files are missing or
        invalid is a ModelDamaged (500) naming it and how to repair it; NotFound (404) is only for no
        such model."""
        hit = self._resolved.get(name)  # (a cached name was parsed, and found valid, when it was cached)
        if hit is not None:
            sig, path, exact, r, files = hit
            if (stat_sig(path) == sig and (exact is None or not exact.is_file())
                    and r.weights.exists() and all(stat_sig(p) == s for p, s in files)):
                return copy_resolved(r)
        given = parse_name(name)
        mn = self.find(given)
        path = self.store.manifest_path(mn)
        sig = stat_sig(path)  # before the read: a change after it misses next time
        files: list[tuple[Path, tuple | None]] = []  # (the same for its GGUF files)
        r = self.read_model(mn, sigs=files)
        if sig is not None:
            if len(self._resolved) >= 256:
                self._resolved.clear()
            self._resolved[name] = (sig, path, self.store.manifest_path(given) if mn != given else None, r, files)
        return copy_resolved(r)

    def read_model(self, mn: ModelName, damage: list[ModelDamaged] | None = None,
                   sigs: list[tuple[Path, tuple | None]] | None = None) -> ResolvedModel:
        """The model's manifest and layers read, and its files checked: each one's size, and the GGUF header
        of its weights, projector and adapter. A problem is a ModelDamaged; with `damage` (a list), the
        problems of those files are added to it instead (show's answer for a damaged model: what the manifest
        and the small layers say), and the answer has no GGUF header (info None). `sigs` (a list) gets each
        GGUF file's stat from before it was checked (what resolve's cache compares)."""
        m, digest, mtime = self.store.read_manifest(mn)
        cfg = read_config(self.store, m)

        def bad(l: dict, problem: str, part: str | None = None) -> None:
            err = self.damaged(mn, cfg, f"its {part or PART_NAMES.get(l['mediaType'], 'file')} (blob "
                                         f"{short_blob(l['digest'])}) {problem}", l["digest"])
            if damage is None:
                raise err
            damage.append(err)

        vals: dict[str, Any] = {"template": None, "system": None, "license": None}
        params: dict = {}
        messages: list = []
        adapter = None
        projector: Path | None = None
        weights: Path | None = None
        info: GGUFInfo | None = None
        files: list[tuple[str, str]] = []
        files_ok = True
        fmt = "gguf"
        for l in m["layers"]:
            mt = l["mediaType"]
            size = l.get("size") if isinstance(l.get("size"), int) and not isinstance(l.get("size"), bool) else None
            if mt in (MT_MODEL, MT_ADAPTER, MT_PROJECTOR):
                p = self.store.blob_path(l["digest"])
                if sigs is not None:
                    sigs.append((p, stat_sig(p)))
                header, problem = None, self.store.blob_problem(l["digest"], size)
                if problem is None:
                    try:
                        header = cached_gguf_info(p)
                    except InvalidRequest as e:  # "sha256-... is not a valid GGUF: ...", "sha256-...: <why>"
                        problem = e.message.removeprefix(p.name + " ") if e.message.startswith(p.name + " ") else \
                            f"cannot be read ({e.message.removeprefix(p.name + ': ')})"
                    except OSError as e:
                        problem = f"cannot be read ({e.strerror or e})"
                if problem is not None:
                    bad(l, problem)
                if mt == MT_MODEL:
                    weights, info = p, header
                elif mt == MT_ADAPTER:
                    adapter = str(p)
                else:
                    projector = p
            elif mt == MT_FILE:
                files.append((l["filename"], l["digest"]))
                problem = self.store.blob_problem(l["digest"], size)
                if problem is not None:
                    files_ok = False
                    bad(l, problem, f"file {l['filename']}")
            elif mt in TEXT_LAYERS or mt in (MT_PARAMS, MT_MESSAGES):
                try:
                    raw = self.store.read_small(l["digest"])
                    if mt in TEXT_LAYERS:
                        vals[TEXT_LAYERS[mt]] = raw.decode("utf-8", errors="replace")
                    elif mt == MT_PARAMS:
                        params = json.loads(raw)
                        if not isinstance(params, dict):
                            raise ValueError
                    else:
                        messages = json.loads(raw)
                        if not isinstance(messages, list):
                            raise ValueError
                except DamagedBlob as e:
                    raise self.damaged(mn, cfg, f"its {PART_NAMES[mt]} (blob {short_blob(l['digest'])}) {e.problem}",
                                        l["digest"]) from None
                except ValueError:
                    raise self.damaged(mn, cfg, f"its {PART_NAMES[mt]} (blob {short_blob(l['digest'])}) is not "
                                                 "what localrun writes there (not valid JSON)", l["digest"]) from None
        if weights is None:
            if not files:
                raise self.damaged(mn, cfg, "its manifest lists no weights")
            fmt = "safetensors"
            if files_ok:
                weights = self.store.view_dir(digest, files)
                if vals["template"] is None:
                    vals["template"] = template_from_files({fn: weights / fn for fn, _ in files})
            else:  # (damage holds why; nothing is linked to damaged files)
                weights = self.store.views / digest.removeprefix("sha256:")
        elif info is not None and vals["template"] is None:
            vals["template"] = info.chat_template
        details = dict(cfg.get("details") or (gguf_details(info) if info else {}))
        return ResolvedModel(
            name=mn.display, digest=digest, weights=weights, format=fmt, template=vals["template"],
            system=vals["system"], parameters=params, messages=messages, license=vals["license"], adapter=adapter,
            info=info, size=sum(int(l["size"]) for l in m["layers"]),
            modified_at=datetime.fromtimestamp(mtime, tz=timezone.utc), details=details, projector=projector,
        )

    # ------------------------------------------------------------------ damaged models
    def damaged(self, mn: ModelName, cfg: dict, what: str, digest: str | None = None) -> ModelDamaged:
        """The error for a stored model whose files are missing or invalid: it names the model, says what is
        wrong (`what`) and how to repair it. A file the model shares with the model it was made from (FROM it,
        or copied from it) is repaired there."""
        todo = self.repair_hint(mn, cfg)
        src = cfg.get("source") if isinstance(cfg.get("source"), dict) else {}
        origin = (cfg.get("details") or {}).get("parent_model") or ("" if "import" in src else src.get("catalog"))
        if digest and isinstance(origin, str) and origin:
            with_origin = self._origin_repair(mn, origin, digest)
            if with_origin:
                todo = with_origin
        return ModelDamaged(f"model '{mn.display}' is damaged: {what}; {todo}")

    @staticmethod
    def repair_hint(mn: ModelName, cfg: dict) -> str:
        """What repairs model `mn`: a pull for one that came from the catalog or a hub (it fetches what is
        missing or damaged again), else removing it and creating it again."""
        src = cfg.get("source") if isinstance(cfg.get("source"), dict) else {}
        created = bool((cfg.get("details") or {}).get("parent_model")) or "import" in src
        if not created and (mn.is_hf or _catalog.lookup(mn) is not None):
            return f"pull it again with `localrun pull {mn.display}` to repair it"
        return f"remove it with `localrun rm {mn.display}` and create it again"

    def _origin_repair(self, mn: ModelName, origin: str, digest: str) -> str | None:
        """How to repair the file `digest` of `mn` through `origin`, the model `mn` was made from, when that one
        has the file too (stored, or pinned by the catalog); None otherwise."""
        try:
            on = self.find(parse_name(origin))
        except LocalrunError:
            return None
        if on.display == mn.display:
            return None
        try:
            m, _, _ = self.store.read_manifest(on)
        except NotFound:
            src = _catalog.lookup(on)
            if src is not None and src.sha256 == digest:
                return f"it is the file of {on.display}: pull that again with `localrun pull {on.display}` to repair it"
            return None
        except LocalrunError:
            return None
        if digest not in {l.get("digest") for l in m["layers"]}:
            return None
        return f"it shares that file with {on.display}: {self.repair_hint(on, read_config(self.store, m))}"
