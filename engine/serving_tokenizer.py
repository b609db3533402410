"""The tokenizer a server uses for a model path: an explicit tokenizer path wins; built-in
models use the tiny tokenizer; a HF directory its tokenizer.json; a GGUF file the tokenizer
stored in its metadata."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from engine.models.builtin import BUILTIN_MODELS
from engine.tokenizer import Tokenizer, build_tiny_tokenizer, load_tokenizer


def load_serving_tokenizer(model_path: str, tokenizer_path: Optional[str] = None) -> Tokenizer:
    if tokenizer_path:
        return load_tokenizer(tokenizer_path)
    if model_path in BUILTIN_MODELS:
        return build_tiny_tokenizer()
    path = Path(model_path)
    if path.is_file() and path.suffix == ".gguf":
        from engine.weights.gguf_tokenizer import load_gguf_tokenizer

        gguf = load_gguf_tokenizer(path)
        tok = gguf.tokenizer
        name = lambda i: tok.id_to_token(i) if i is not None else None  # noqa: E731
        return Tokenizer(tok, name(gguf.bos_token_id), [name(i) for i in gguf.eos_token_ids], gguf.chat_template)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return load_tokenizer(path)
    raise ValueError(f"no tokenizer found for {model_path!r}: pass --tokenizer-path (a tokenizer.json or its directory)")
