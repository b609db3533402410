"""The tokenizer a server uses for a model path: an explicit tokenizer path wins; built-in
models use the tiny tokenizer; a HF directory its tokenizer.json; a GGUF file the tokenizer
stored in its metadata."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

from tokenizers import AddedToken

from arfusion.engine.models.builtin import BUILTIN_MODELS, builtin_config
from arfusion.engine.tokenizers.tokenizer import Tokenizer, build_tiny_tokenizer, load_tokenizer

if TYPE_CHECKING:
    from arfusion.engine.weights.gguf_loader import ParsedGGUF


def dummy_model_tokenizer(vocab_size: int) -> Tokenizer:
    """The tiny byte-level tokenizer, with ids past its vocabulary up to ``vocab_size`` added as
    plain tokens ``<|tN|>``: a built-in model with dummy weights (e.g. llama3-8b shapes) then
    decodes every id it samples to visible text, so streaming shows one piece per token."""
    tokenizer = build_tiny_tokenizer()
    extra = range(tokenizer.vocab_size, vocab_size)
    tokenizer.tokenizer.add_tokens([AddedToken(f"<|t{i}|>", special=False, normalized=False) for i in extra])
    return tokenizer


def check_paths_exist(model_path: str, tokenizer_path: Optional[str] = None) -> None:
    """ValueError naming the option when ``model_path`` (unless a built-in model) or
    ``tokenizer_path`` does not exist."""
    for flag, given in (("--model-path", model_path), ("--tokenizer-path", tokenizer_path)):
        if given and given not in BUILTIN_MODELS and not Path(given).exists():
            raise ValueError(f"{flag} {given!r}: no such file or directory"
                             + (f" (nor a built-in model: {', '.join(BUILTIN_MODELS)})" if flag == "--model-path" else ""))


def load_serving_tokenizer(model_path: str, tokenizer_path: Optional[str] = None,
                           parsed: Optional[ParsedGGUF] = None) -> Tokenizer:
    """ValueError naming the path when ``model_path`` (or ``tokenizer_path``) does not exist or
    holds no tokenizer. ``parsed``: the model's GGUF file, parsed already (not parsed again)."""
    check_paths_exist(model_path, tokenizer_path)
    if tokenizer_path:
        return load_tokenizer(tokenizer_path)
    if model_path in BUILTIN_MODELS:
        return dummy_model_tokenizer(builtin_config(model_path).vocab_size)
    path = Path(model_path)
    if parsed is not None or (path.is_file() and path.suffix == ".gguf"):
        from arfusion.engine.weights.gguf_tokenizer import load_gguf_tokenizer

        gguf = load_gguf_tokenizer(parsed or path)
        tok = gguf.tokenizer
        name = lambda i: tok.id_to_token(i) if i is not None else None  # noqa: E731
        return Tokenizer(tok, name(gguf.bos_token_id), [name(i) for i in gguf.eos_token_ids], gguf.chat_template)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return load_tokenizer(path)
    raise ValueError(f"no tokenizer found for {model_path!r}: pass --tokenizer-path (a tokenizer.json or its directory)")
