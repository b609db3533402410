"""The served API: `build_app(engine, served_model_name)`, OpenAI's completions and chat
completions, the native (SGLang-style) routes, health, and the tokenizer routes, over any
`EngineClient` (see app.py)."""
from arfusion.engine.server.api.app import build_app

__all__ = ["build_app"]
