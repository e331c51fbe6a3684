"""`localrun bench`: throughput, serve, prefix, startup and sample, as the field measures them.

Entry point: :func:`localrun.bench.cli.main`. Importing this package imports nothing
heavy (no engine, no server stack)."""
