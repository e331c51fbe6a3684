"""A fake Hugging Face hub on 127.0.0.1 serving real files, for the library's pull tests.

It answers what huggingface-hub's model_info / get_hf_file_metadata / http_get ask:

    GET  /api/models/ORG/REPO[/revision/REV]      {"id", "sha", "siblings": [{rfilename, size,
                                                   blobId, lfs: {size, sha256, pointerSize}}]}
    HEAD /ORG/REPO/resolve/REV/FILE               X-Repo-Commit, ETag, and for LFS files
                                                   X-Linked-Etag (sha256) / X-Linked-Size
    GET  /ORG/REPO/resolve/REV/FILE               the bytes; honours "Range: bytes=N-"

Unknown repos answer 404 with X-Error-Code: RepoNotFound, unknown files EntryNotFound.
Faults (set hub.mode): "drop" sends the first `drop_at` bytes of a file then cuts the
connection and answers 503 to requests that start at or past `drop_at`; "wrong" serves
bytes with one byte flipped (same size). `delay` sleeps per 64 KiB chunk (slow link).
Counters: hub.sent[file] (body bytes), hub.gets[file], hub.ranges[file] (Range starts).

Run standalone for a manual check: python tests/fakehub.py DIR ORG/REPO
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_MIN = 1024  # files this big (or .gguf / .safetensors) are "LFS" files with a sha256


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.mode = "normal"
        self.drop_at = 0
        self.delay = 0.0
        self.sent: dict[str, int] = defaultdict(int)
        self.gets: dict[str, int] = defaultdict(int)
        self.ranges: dict[str, list[int]] = defaultdict(list)
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None

    # -- content
    def add_file(self, repo: str, filename: str, data: bytes) -> None:
        self.repos.setdefault(repo, {})[filename] = data

    def add_path(self, repo: str, path: Path, filename: str | None = None) -> None:
        self.add_file(repo, filename or path.name, Path(path).read_bytes())

    def reset_counters(self) -> None:
        with self.lock:
            self.sent.clear()
            self.gets.clear()
            self.ranges.clear()

    @staticmethod
    def is_lfs(filename: str, data: bytes) -> bool:
        return len(data) >= LFS_MIN or filename.endswith((".gguf", ".safetensors"))

    def sibling(self, filename: str, data: bytes) -> dict:
        git = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
        s = {"rfilename": filename, "size": len(data), "blobId": git}
        if self.is_lfs(filename, data):
            s["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
        return s

    # -- server
    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> "FakeHub":
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                self.handle_req(head=True)

            def do_GET(self):
                self.handle_req(head=False)

            def send_json(self, code, obj, extra=None):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def handle_req(self, head: bool):
                path = unquote(urlsplit(self.path).path)
                parts = [p for p in path.split("/") if p]
                if parts[:2] == ["api", "models"] and len(parts) >= 4:
                    repo = "/".join(parts[2:4])
                    files = hub.repos.get(repo)
                    if files is None:
                        return self.send_json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                    return self.send_json(200, {"id": repo, "sha": COMMIT,
                                                "siblings": [hub.sibling(f, d) for f, d in sorted(files.items())]})
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo = "/".join(parts[:2])
                    filename = "/".join(parts[4:])
                    files = hub.repos.get(repo)
                    if files is None:
                        return self.send_json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                    if filename not in files:
                        return self.send_json(404, {"error": "Entry not found"},
                                              {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT})
                    return self.send_file(filename, files[filename], head)
                return self.send_json(404, {"error": "not found"})

            def send_file(self, filename: str, data: bytes, head: bool):
                lfs = hub.is_lfs(filename, data)
                git = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
                headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{git}"', "Accept-Ranges": "bytes"}
                if lfs:
                    sha = hashlib.sha256(data).hexdigest()
                    headers.update({"X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data)), "ETag": f'"{sha}"'})
                start = 0
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes="):
                    start = int(rng[len("bytes="):].split("-")[0] or 0)
                if head:
                    self.send_response(200)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    return
                with hub.lock:
                    hub.gets[filename] += 1
                    hub.ranges[filename].append(start)
                mode = hub.mode
                if mode == "drop" and start >= hub.drop_at:
                    return self.send_json(503, {"error": "try later"})
                body = data
                if mode == "wrong":
                    body = bytearray(data)
                    body[len(body) // 2] ^= 0xFF
                    body = bytes(body)
                chunk = body[start:]
                self.send_response(206 if start else 200)
                for k, v in headers.items():
                    self.send_header(k, v)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(chunk)))
                self.end_headers()
                limit = len(chunk) if mode != "drop" else max(0, hub.drop_at - start)
                pos = 0
                try:
                    while pos < limit:
                        piece = chunk[pos:min(limit, pos + 65536)]
                        self.wfile.write(piece)
                        pos += len(piece)
                        with hub.lock:
                            hub.sent[filename] += len(piece)
                        if hub.delay:
                            time.sleep(hub.delay)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    return
                if mode == "drop" and limit < len(chunk):
                    self.close_connection = True
                    try:
                        import socket

                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


if __name__ == "__main__":  # python tests/fakehub.py DIR ORG/REPO
    import sys

    hub = FakeHub()
    for p in Path(sys.argv[1]).iterdir():
        if p.is_file():
            hub.add_path(sys.argv[2], p)
    hub.start()
    print(f"HF_ENDPOINT={hub.url}", flush=True)
    threading.Event().wait()
