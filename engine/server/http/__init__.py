"""The HTTP server under the API: request limits enforced before the app (`limits`, `protocol`),
the error object it answers them with (`errors`), large bodies parsed and screened in parser
processes before the app sees them (`large_bodies`, `parser_pool`, `parser_process`), the
server's life (`lifecycle`), its draining shutdown (`server`) and server-sent events
(`streaming`). It knows nothing of the routes: what a parser process runs is given to it."""
