"""`localrun`: the command line, a thin HTTP client of the daemon (see localrun.client).

Every verb except `serve` and `bench` talks to the daemon and starts it in the
background when none answers.  Errors end as one line on stderr and a non-zero exit
code, never a traceback; Ctrl+C stops a stream cleanly (exit 130).

One module per group of verbs (`run.py`: run and chat, `models.py`: pull, list, show,
rm, cp, `create.py`, `loaded.py`: ps and stop, `daemon.py`: serve and version,
`launch.py`, `passthrough.py`: bench and ray-serve); `parser.py` builds the parser and
`dispatch.py` holds `main`.
"""

from __future__ import annotations

from localrun.cli.dispatch import main

__all__ = ["main"]
