"""The OpenAI-compatible HTTP layer: `build_app(engine, served_model_name)`, one FastAPI app of
route groups, each in its own module:

    engine.server.api.openai_routes     POST /v1/completions, POST /v1/chat/completions, GET /v1/models
    engine.server.api.native_routes     POST /generate (SGLang style), POST /flush_cache
    engine.server.api.health_routes     GET /health, GET /get_server_info
    engine.server.api.tokenizer_routes  POST /tokenize, POST /detokenize, GET /tokenizer_info

Prompts are tokenized and chat templates rendered in a worker thread (`asyncio.to_thread`), never
on the event loop: a huge prompt delays only its own request. Every error is answered as
``{"error": {"message", "type", "code"}}`` (`engine.server.api.error_responses`), an `EngineError`
with its status (400, 500, 503); inside a stream that already started, an error event and then
``[DONE]``. While the server drains (`Lifecycle.draining`) new generation requests get 503. A
client disconnect aborts its request in both modes: a non-streaming request, and a stream
before its first chunk (while it waits or is prefilled), is cancelled as soon as its client
leaves; a stream that has started closes the engine's generator when it ends.
"""
from __future__ import annotations

from typing import Optional

from fastapi import FastAPI

from arfusion.engine.server.api.engine_client import EngineClient
from arfusion.engine.server.api.error_responses import add_error_handlers
from arfusion.engine.server.api.health_routes import add_health_routes
from arfusion.engine.server.api.native_routes import add_native_routes
from arfusion.engine.server.api.openai_routes import add_openai_routes
from arfusion.engine.server.api.request_handling import RequestHandler
from arfusion.engine.server.api.tokenizer_routes import add_tokenizer_routes
from arfusion.engine.server.http.lifecycle import InFlightMiddleware, Lifecycle


def build_app(engine: EngineClient, served_model_name: str, lifecycle: Optional[Lifecycle] = None,
              allow_special_tokens_in_messages: bool = False) -> FastAPI:
    """The FastAPI app serving ``engine`` under the model name ``served_model_name``;
    ``lifecycle`` (default: a new one) counts its requests and says when it drains. Special
    tokens' text in chat messages is tokenized as text unless ``allow_special_tokens_in_messages``."""
    app = FastAPI(title="arfusion")
    lifecycle = lifecycle or Lifecycle()
    app.add_middleware(InFlightMiddleware, lifecycle=lifecycle)
    server = RequestHandler(engine, served_model_name, lifecycle, allow_special_tokens_in_messages)
    add_error_handlers(app)
    add_openai_routes(app, server)
    add_native_routes(app, server)
    add_health_routes(app, server)
    add_tokenizer_routes(app, engine, served_model_name, allow_special_tokens_in_messages)
    return app
