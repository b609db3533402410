"""The HTTP server under the API: request limits enforced before the app (`limits`, `protocol`),
the error object it answers them with (`errors`), the server's life (`lifecycle`), its draining
shutdown (`server`) and server-sent events (`streaming`). It knows nothing of the routes."""
