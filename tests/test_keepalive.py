"""Kept-alive HTTP connections: the daemon keeps an idle one open for LOCALRUN_HTTP_KEEPALIVE (2 minutes by
default; uvicorn's own 5 s made a client that paused longer, as agents and editors do between requests,
write on a connection the daemon was closing: a broken pipe). Real daemons on 127.0.0.1, raw sockets and
http.client, which does not notice a connection the server closed."""

from __future__ import annotations

import http.client
import socket
import time

import pytest
from daemon import Daemon

pytestmark = pytest.mark.timeout(120)


def _get_version(sock: socket.socket) -> bytes:
    sock.sendall(b"GET /api/version HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    return data


def test_an_idle_connection_stays_open_past_uvicorns_five_seconds(tmp_path):
    d = Daemon(tmp_path / "home")
    try:
        sock = socket.create_connection(("127.0.0.1", d.port))
        assert b" 200 " in _get_version(sock).split(b"\r\n")[0]
        sock.settimeout(6.5)
        with pytest.raises(socket.timeout):  # nothing comes, and the daemon does not close it (b"")
            sock.recv(1)
        assert b" 200 " in _get_version(sock).split(b"\r\n")[0]  # the same connection, reused
        sock.close()
        # http.client (the plainest client) after the same pause: no broken pipe, no reconnect
        conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
        conn.request("GET", "/api/version")
        conn.getresponse().read()
        first = conn.sock
        time.sleep(6)
        conn.request("GET", "/api/version")
        assert conn.getresponse().status == 200 and conn.sock is first
        conn.close()
    finally:
        d.stop()


def test_the_setting_is_honoured(tmp_path):
    d = Daemon(tmp_path / "home", LOCALRUN_HTTP_KEEPALIVE="1s")
    try:
        sock = socket.create_connection(("127.0.0.1", d.port))
        _get_version(sock)
        sock.settimeout(10)
        t = time.monotonic()
        assert sock.recv(1) == b""  # closed by the daemon once idle for the setting
        assert time.monotonic() - t < 5
        sock.close()
    finally:
        d.stop()
    with pytest.raises(RuntimeError, match="LOCALRUN_HTTP_KEEPALIVE"):
        Daemon(tmp_path / "home2", LOCALRUN_HTTP_KEEPALIVE="0")
