"""Rank 0's server, in three parts: `engine.server.http` (the HTTP server: connection and body
limits, the draining shutdown, server-sent events), `engine.server.api` (the OpenAI-compatible and
native routes on an `EngineClient`), and `engine.server.engine` (the `Engine`, the client that
bridges the routes to the scheduler thread). `engine.server.rank0` composes them on top of rank
0's `engine.runtime.rank_stack.RankStack`."""
