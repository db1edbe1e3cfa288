"""kvserve's OpenAI-compatible HTTP server (`python -m kvserve serve`)."""

from kvserve.server.app import ServerState, build_app

__all__ = ["ServerState", "build_app"]
