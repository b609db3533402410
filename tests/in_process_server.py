"""`InProcessServer`: the HTTP server as `engine.launch_server` runs it (`DrainingServer` with
`http_config`'s limits and protocol, on a bound socket; with ``parsing``, its large bodies
screened by a parser pool), on a thread, with an `EngineClient` such as the `FakeEngine` behind it."""
from __future__ import annotations

import threading
from typing import Optional

from arfusion.engine.server.api import build_app
from arfusion.engine.server.api.engine_client import EngineClient
from arfusion.engine.server.http.lifecycle import Lifecycle
from arfusion.engine.server.http.server import BodyParsing, DrainingServer, HttpLimits, bind_http_socket, http_config
from tests.server_process import free_port

LIMIT = 64 * 1024
LIMITS = HttpLimits(LIMIT, head_timeout_s=60, body_timeout_s=60, max_connections=1000)


class InProcessServer:
    """`DrainingServer` with the server's `http_config` on a thread, on a bound socket."""

    def __init__(self, engine: EngineClient, limits: HttpLimits = LIMITS, grace_s: float = 1.0,
                 parsing: Optional[BodyParsing] = None) -> None:
        self.port = free_port()
        sock = bind_http_socket("127.0.0.1", self.port)
        serving, lifecycle = threading.Event(), Lifecycle()
        config = http_config(build_app(engine, "m", lifecycle), limits, "warning", parsing)
        self.server = DrainingServer(config, lifecycle, grace_s, lambda: 0, serving.set,
                                     parsing.pool if parsing is not None else None)
        self.thread = threading.Thread(target=self.server.run, args=([sock],), daemon=True)
        self.thread.start()
        assert serving.wait(60), "the server did not start"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
