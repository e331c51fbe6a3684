"""`serve` and `version`: the daemon in the foreground, and which versions answer."""

from __future__ import annotations

import os

from localrun import __version__
from localrun.cli.common import CLIError
from localrun.client import APIError, DaemonClient
from localrun.config import ENV_VARS, settings


def cmd_version(args, client: DaemonClient) -> int:
    print(f"localrun version {__version__}")
    if client.is_up():
        try:
            v = client.version()
            print(f"daemon version {v.get('localrun_version') or v.get('version', '?')} at {client.base_url}")
        except APIError as exc:
            print(f"daemon at {client.base_url}: {exc.message}")
    else:
        print(f"no daemon is running at {client.base_url}")
    return 0


def cmd_serve(args) -> int:
    if args.host:
        os.environ["LOCALRUN_HOST"] = args.host  # settings() reads it; the server sees the flag
    from localrun.server import serve

    s = settings()
    with DaemonClient(s.base_url, api_key=s.api_key) as probe:
        if probe.is_up():
            raise CLIError(f"a localrun daemon is already running at {s.base_url} (stop it first, or pick another "
                           "address with --host or LOCALRUN_HOST)")
    return serve(s)


def serve_epilog() -> str:
    try:
        current = dict(settings().describe())
    except ValueError as exc:
        current = {}
        bad = str(exc)
    else:
        bad = ""
    lines = ["environment variables (default -> current value):"]
    for name, (default, help_text) in ENV_VARS.items():
        lines.append(f"  {name}")
        lines.append(f"      {help_text}")
        lines.append(f"      default: {default}    current: {current.get(name, '(invalid)')}")
    if bad:
        lines.append(f"\nError in the environment: {bad}")
    return "\n".join(lines)
