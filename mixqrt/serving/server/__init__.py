"""`mixqrt serve`: an OpenAI-compatible HTTP server (Starlette on uvicorn) over one Engine, or N
engine replicas behind one endpoint on Ray Serve (mixqrt.serving.server.ray). Needs the `serve` extra
(`ray` for Ray). docs/server.md has the routes, limits and safety rules.

    from mixqrt.serving.server import create_app, run
    run(create_app(pipe), host="127.0.0.1", port=8000)
"""
from __future__ import annotations

from mixqrt.serving.server.cli import add_serve_parser


def __getattr__(name):
    if name in ("create_app", "Server"):
        from mixqrt.serving.server import app
        return getattr(app, name)
    if name in ("Limits", "HTTPError"):
        from mixqrt.serving.server import guard
        return getattr(guard, name)
    if name in ("run", "uvicorn_config"):
        from mixqrt.serving.server import cli
        return getattr(cli, name)
    raise AttributeError(name)


__all__ = ["add_serve_parser", "create_app", "run", "Limits"]
