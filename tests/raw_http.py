"""HTTP/1.1 over a raw asyncio connection, for tests that send what ordinary clients will not: a
head or body of any size, a body sent chunked, a body that goes on after the server answered.

`exchange` writes a request (head, then body parts) and reads one answer; `chunked` frames a body
for ``transfer-encoding: chunked``.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Iterable, Iterator, Optional

HOST = "127.0.0.1"


def head(method: str, path: str, headers: Optional[dict[str, str]] = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"host: {HOST}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunked(body: bytes, chunk_bytes: int) -> Iterator[bytes]:
    """``body`` as chunks of ``chunk_bytes`` bytes, then the last (empty) chunk."""
    for start in range(0, len(body), chunk_bytes):
        part = body[start:start + chunk_bytes]
        yield f"{len(part):x}\r\n".encode() + part + b"\r\n"
    yield b"0\r\n\r\n"


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], Any]:
    """Status, headers (lower-case names) and the JSON body (None if empty) of one answer with a
    Content-Length."""
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("the server closed the connection without an answer")
    status = int(status_line.split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, json.loads(body) if body else None


async def exchange(port: int, request_head: bytes, body_parts: Iterable[bytes] = (),
                   then: Optional[bytes] = None,
                   bytes_per_s: Optional[float] = None) -> tuple[tuple[int, dict[str, str], Any], ...]:
    """Send ``request_head`` and ``body_parts`` on a new connection (at most ``bytes_per_s``, as
    over a network, else as fast as the connection takes them) and read the answer; with
    ``then``, send that request on the same connection and read its answer too."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(request_head)
        start, sent = time.monotonic(), 0
        for part in body_parts:
            writer.write(part)
            await writer.drain()
            sent += len(part)
            if bytes_per_s is not None:
                await asyncio.sleep(max(0.0, start + sent / bytes_per_s - time.monotonic()))
        answers = [await read_answer(reader)]
        if then is not None:
            writer.write(then)
            await writer.drain()
            answers.append(await read_answer(reader))
        return tuple(answers)
    finally:
        writer.close()
