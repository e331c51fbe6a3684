"""`localrun bench mixed` (every API at once, unloads, library churn) at smoke length against its own
real daemon, and its stream check on its own."""

import asyncio
import os
import re
import subprocess
import sys

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)


def test_the_mixed_workload_runs_clean(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALRUN_")}
    r = subprocess.run([sys.executable, "-m", "localrun.bench", "mixed", "--seconds", "20", "--clients", "6"],
                       env={**env, "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "problems: 0" in r.stdout, r.stdout
    answered = int(re.search(r"(\d+) requests answered", r.stdout).group(1))
    assert answered > 20, r.stdout
    for kind in ("create", "delete", "upload"):  # the library churned while the clients ran
        assert int(re.search(rf"^\s+{kind}\s+(\d+)$", r.stdout, re.M).group(1)) > 0, r.stdout


def test_an_error_inside_a_stream_is_a_problem():
    """The check the bench relies on: an SSE error event or an NDJSON error line fails the request."""
    from localrun.bench.mixed import _stream

    bodies = {"/sse": b'data: {"id":"x","choices":[]}\n\nevent: error\ndata: {"type":"error"}\n\n',
              "/ndjson": b'{"model":"m","message":{"content":"hi"}}\n{"error":"the runner died"}\n',
              "/fine": b'{"model":"m","message":{"content":"an error message, as text"}}\n'}

    async def main():
        transport = httpx.MockTransport(lambda req: httpx.Response(200, content=bodies[req.url.path]))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            for path in ("/sse", "/ndjson"):
                with pytest.raises(RuntimeError, match="inside the stream"):
                    await _stream(c, path, {})
            assert (await _stream(c, "/fine", {})).status_code == 200

    asyncio.run(main())
