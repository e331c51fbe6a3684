"""The localrun daemon: FastAPI app (``create_app``), the model manager, and ``serve``.

``localrun serve`` calls :func:`serve`; ``python -m localrun.server`` runs :func:`main`.
Imported lazily so ``import localrun.server`` stays cheap.
"""

from __future__ import annotations


def create_app(*args, **kwargs):
    from localrun.server.app import create_app as _create_app

    return _create_app(*args, **kwargs)


def serve(settings=None) -> int:
    from localrun.server.app import serve as _serve

    return _serve(settings)


def main(argv=None) -> int:
    from localrun.server.app import main as _main

    return _main(argv)


__all__ = ["create_app", "serve", "main"]
