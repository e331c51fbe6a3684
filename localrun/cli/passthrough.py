"""`bench` and `ray-serve`: verbs whose arguments go untouched to their own command lines."""

from __future__ import annotations

from localrun.cli.common import CLIError


def passthrough_args(argv: list[str], verb: str = "bench") -> list[str] | None:
    """`localrun [globals] bench ARGS...` -> ARGS, passed untouched to the bench CLI (or another `verb`'s)."""
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--host":
            i += 2
        elif tok.startswith("-"):
            i += 1
        else:
            return argv[i + 1:] if tok == verb else None
    return None


def run_bench(rest: list[str]) -> int:
    try:
        from localrun.bench.cli import main as bench_main
    except ImportError as exc:
        raise CLIError(f"`localrun bench` is not available in this install ({exc})") from None
    result = bench_main(rest)
    return result if isinstance(result, int) else 0


def run_ray_serve(rest: list[str]) -> int:
    """`localrun [globals] ray-serve ARGS...`: the Ray Serve launcher's own command line, without the daemon."""
    from localrun.cluster.ray_serve import main as ray_serve_main

    return ray_serve_main(rest)
