"""A loaded model's own process: start it, speak to it, serve inside it.

- ``process``: the daemon's side: :func:`~localrun.backends.runner.process.start_runner` and the
  :class:`~localrun.backends.runner.process.RemoteBackend` it returns.
- ``worker``: the runner's side, ``python -m localrun.backends.runner.worker FD``: loads the model and serves it.
- ``wire``: the messages between them, over one end of a Unix socket pair.
"""
