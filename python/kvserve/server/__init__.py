"""kvserve's OpenAI-compatible HTTP server (`python -m kvserve serve`). Its web packages
(fastapi, uvicorn) load with the app, not with this package: the command line reads
kvserve.server.limits without them."""

__all__ = ["ServerState", "build_app"]


def __getattr__(name: str):
    if name in __all__:
        from kvserve.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'kvserve.server' has no attribute {name!r}")
