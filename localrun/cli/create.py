"""`create`: a model from a Modelfile, its files uploaded first to a daemon that does not see them."""

from __future__ import annotations

from pathlib import Path

from localrun.cli.common import CLIError
from localrun.cli.progress import show_progress
from localrun.client import DaemonClient


def cmd_create(args, client: DaemonClient) -> int:
    path = Path(args.file).expanduser()
    if not path.is_file():
        raise CLIError(f"no Modelfile at {path}: pass one with -f PATH")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CLIError(f"cannot read {path}: {exc}") from None
    base = path.resolve().parent
    if client.sees_my_files():  # the daemon reads the files FROM names itself (one copy, no upload)
        last = show_progress(client.create(args.name, text, base_dir=str(base), quantize=args.quantize))
    else:
        last = _create_remote(args.name, text, base, client, args.quantize)
    return 0 if last and last.get("status") == "success" else 1


def _create_remote(name: str, text: str, base: Path, client: DaemonClient, quantize: str | None = None) -> dict | None:
    """A daemon on another machine (or in a container) cannot read this one's files: as `ollama create` does, the files
    FROM names are uploaded (POST /api/blobs/<sha256>, skipped when the daemon has them) and the
    create names them in `files`; a FROM that names a model goes as it is."""
    from localrun.errors import InvalidRequest
    from localrun.library.modelfile import local_source, parse_modelfile, render_modelfile

    try:
        mf = parse_modelfile(text)
        sources = [local_source(mf.from_ or "", base)] + ([local_source(mf.projector, base)] if mf.projector else [])
    except InvalidRequest as exc:
        raise CLIError(str(exc)) from None
    if sources[0] is None:
        if any(sources[1:]):
            raise CLIError(f"the daemon at {client.base_url} does not see this machine's files: a projector file can only go "
                           "with the model as a file too (FROM ./model.gguf, then FROM ./mmproj.gguf)")
        return show_progress(client.create(name, text, quantize=quantize))
    files: dict[str, Path] = {}
    for src in sources:
        files.update(_files_to_upload(src))
    digests = {fn: _upload(client, fn, p) for fn, p in files.items()}
    rest = render_modelfile(None, mf.parameters, mf.template, mf.system, mf.messages, mf.license, mf.adapter)
    return show_progress(client.create(name, rest, files=digests, quantize=quantize))


def _files_to_upload(src: Path) -> dict[str, Path]:
    """{name: path}: a GGUF file, or the files localrun keeps of a safetensors model directory."""
    from localrun.errors import InvalidRequest
    from localrun.library.create import safetensors_dir_files

    shown = str(src)
    try:
        if src.is_dir():
            return safetensors_dir_files(src, shown)
    except InvalidRequest as exc:
        raise CLIError(str(exc)) from None
    except OSError as exc:
        raise CLIError(f"cannot read {shown}: {exc.strerror or exc}") from None
    if not src.is_file():
        raise CLIError(f"FROM {shown}: no such file")
    return {src.name: src}


def _upload(client: DaemonClient, fn: str, path: Path) -> str:
    """sha256 of the file (a progress bar), then the upload unless the daemon has it (another bar)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from localrun.library.blobs import sha256_file

    try:
        size = path.stat().st_size
        bars = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                        TimeRemainingColumn(), console=Console(stderr=True, highlight=False))
        with bars:
            task = bars.add_task(f"hashing {fn}", total=size)
            digest, _ = sha256_file(path, progress=lambda n: bars.update(task, completed=n))
            if client.has_blob(digest):
                return digest
            task = bars.add_task(f"uploading {fn}", total=size)
            client.upload_blob(digest, path, on_bytes=lambda n: bars.advance(task, n))
    except OSError as exc:
        raise CLIError(f"cannot read {path}: {exc.strerror or exc}") from None
    return digest
