"""The daemon's HTTP client, shared by the CLI and the TUI.

Every request the client can make is described once, in :class:`Requests`
(``calls.py``), as a :class:`Call` (method, path, JSON body, whether the answer is an
NDJSON stream and how to pick the result out of the body).  :class:`DaemonClient`
(``sync_client.py``) sends those calls with a blocking ``httpx.Client``;
:class:`AsyncDaemonClient` (``async_client.py``) sends the very same calls with
``httpx.AsyncClient`` (same method names; streams become async iterators); what they
share, starting the daemon included, is in ``base.py``.  Neither imports anything from
the server: the daemon is reached over HTTP only, like any other client (curl, the
OpenAI SDK).

    c = DaemonClient()
    c.ensure_running()                 # starts `localrun serve` in the background if needed
    for chunk in c.chat("smollm2:135m", [{"role": "user", "content": "hi"}]):
        print(chunk["message"]["content"], end="")
"""

from __future__ import annotations

from localrun.client.async_client import AsyncDaemonClient
from localrun.client.base import base_url_for
from localrun.client.calls import THINK_LEVELS, parse_think
from localrun.client.errors import APIError, DaemonUnavailable
from localrun.client.sync_client import DaemonClient

__all__ = ["DaemonClient", "AsyncDaemonClient", "APIError", "DaemonUnavailable", "base_url_for", "parse_think",
           "THINK_LEVELS"]
