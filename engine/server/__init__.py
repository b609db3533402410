"""The OpenAI-compatible HTTP server in front of an `EngineClient` (see app.py)."""
from engine.server.app import build_app

__all__ = ["build_app"]
