"""A `tokenizers.Tokenizer` built from a GGUF file's ``tokenizer.*`` metadata.

Two vocab kinds (``tokenizer.ggml.model``):
- ``gpt2``: byte-level BPE from ``tokens`` + ``merges``; the pre-tokenizer regex is chosen by
  ``tokenizer.ggml.pre`` (llama.cpp stores a label, not the regex): Llama 3, Qwen2 or GPT-2 style;
  Qwen2 text is NFC-normalised first, as its HF tokenizer does.
- ``llama``: SentencePiece BPE from ``tokens`` + ``scores`` with byte fallback (``<0xNN>`` tokens).
  SentencePiece merges the adjacent pair whose merged piece has the highest score; the same order
  is expressed as a BPE merge list: every split (a, b) of a vocab piece into two vocab pieces,
  ranked by the merged piece's score (descending), ties by id.
Control tokens become special added tokens, user-defined ones plain added tokens, so both are
matched whole in text. BOS/EOS are added by a post-processor when ``add_bos_token`` /
``add_eos_token`` say so (as HF's tokenizer.json does). A HF tokenizer, when the user gives one,
takes precedence; that choice is made by the caller.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from gguf import GGUFReader, Keys, TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from arfusion.engine.weights.errors import ModelFileError
from arfusion.engine.weights.gguf_file import open_gguf
from arfusion.engine.weights.gguf_loader import ParsedGGUF
from arfusion.engine.weights.gguf_names import eos_token_ids, field_value

_LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# tokenizer.ggml.pre label -> split regex (None: GPT-2's regex, built into ByteLevel).
_BPE_PRE: dict[str, Optional[str]] = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "gpt-2": None,
}
_IGNORE_MERGES_PRE = frozenset({"llama3", "llama-v3", "llama-bpe"})
# Vocabularies whose HF tokenizer.json normalises text to NFC before splitting (Qwen2's does; the
# GGUF keeps only the pre label): "e" + U+0301 must give the tokens of "é".
_NFC_PRE = frozenset({"qwen2"})
SPIECE_SPACE = "\u2581"


@dataclass(frozen=True)
class GGUFTokenizer:
    """The tokenizer of a GGUF file and the special ids and chat template stored with it."""

    tokenizer: Tokenizer
    bos_token_id: Optional[int]
    eos_token_ids: tuple[int, ...]
    chat_template: Optional[str]
    add_bos_token: bool


def _byte_level_bpe(reader: GGUFReader, tokens: list[str], path: str) -> Tokenizer:
    pre = field_value(reader, Keys.Tokenizer.PRE, "default")
    if pre not in _BPE_PRE:
        raise ModelFileError(
            path, f"unsupported tokenizer.ggml.pre {pre!r} (supported: {sorted(_BPE_PRE)}); pass a HF tokenizer directory instead"
        )
    merges = [tuple(m.split(" ", 1)) for m in field_value(reader, Keys.Tokenizer.MERGES, path=path)]
    vocab = {tok: i for i, tok in reversed(list(enumerate(tokens)))}  # first id wins for duplicates
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES_PRE))
    if pre in _NFC_PRE:
        tok.normalizer = normalizers.NFC()
    split = _BPE_PRE[pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece-BPE merge order: splits of each normal piece into two normal pieces,
    ranked by the merged piece's score, highest first (ties: lower id, then shorter left part)."""
    normal: dict[str, int] = {}
    for i, piece in enumerate(tokens):
        if types[i] == TokenType.NORMAL and piece not in normal:
            normal[piece] = i
    ranked = []
    for piece, pid in normal.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in normal and right in normal:
                ranked.append((-scores[pid], pid, k, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_bpe(reader: GGUFReader, tokens: list[str], types: list[int], path: str) -> Tokenizer:
    scores = field_value(reader, Keys.Tokenizer.SCORES, path=path)
    vocab = {tok: i for i, tok in reversed(list(enumerate(tokens)))}
    unk_id = field_value(reader, Keys.Tokenizer.UNK_ID, None)
    unk = tokens[unk_id] if unk_id is not None else None
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, types), unk_token=unk, byte_fallback=True, fuse_unk=True)
    )
    add_prefix = bool(field_value(reader, Keys.Tokenizer.ADD_PREFIX, True))
    replace = normalizers.Replace(" ", SPIECE_SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPIECE_SPACE), replace]) if add_prefix else replace
    steps: list[Any] = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _post_processor(tokens: list[str], bos: Optional[int], eos: Optional[int], add_bos: bool, add_eos: bool):
    """HF-style TemplateProcessing: ``[BOS] $A [EOS]`` (pairs: ``... [BOS] $B [EOS]``); None when nothing is added."""
    head = [bos] if add_bos and bos is not None else []
    tail = [eos] if add_eos and eos is not None else []
    if not head and not tail:
        return None
    single = [tokens[i] for i in head] + ["$A"] + [tokens[i] for i in tail]
    pair = single + [f"{tokens[i]}:1" for i in head] + ["$B:1"] + [f"{tokens[i]}:1" for i in tail]
    specials = [(tokens[i], i) for i in dict.fromkeys(head + tail)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def load_gguf_tokenizer(file: Union[str, Path, ParsedGGUF]) -> GGUFTokenizer:
    """Build the tokenizer stored in a GGUF file (parsed here unless ``file`` is parsed already).

    Raises `ModelFileError` naming the file: not a complete GGUF file (`open_gguf`), an unsupported
    ``tokenizer.ggml.model`` or ``tokenizer.ggml.pre``, or (`MissingMetadataError`) an absent
    required key (tokens, merges or scores).
    """
    reader = file.metadata if isinstance(file, ParsedGGUF) else open_gguf(file)
    path = str(file.path if isinstance(file, ParsedGGUF) else file)
    kind = field_value(reader, Keys.Tokenizer.MODEL, path=path)
    tokens: list[str] = field_value(reader, Keys.Tokenizer.LIST, path=path)
    types: list[int] = field_value(reader, Keys.Tokenizer.TOKEN_TYPE, [TokenType.NORMAL] * len(tokens))
    if kind == "gpt2":
        tok = _byte_level_bpe(reader, tokens, path)
    elif kind == "llama":
        tok = _sentencepiece_bpe(reader, tokens, types, path)
    else:
        raise ModelFileError(path, f"unsupported tokenizer.ggml.model {kind!r} (supported: gpt2, llama)")
    special = [TokenType.CONTROL, TokenType.UNKNOWN]
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in special]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == TokenType.USER_DEFINED]
    )
    bos = field_value(reader, Keys.Tokenizer.BOS_ID, None)
    eos = field_value(reader, Keys.Tokenizer.EOS_ID, None)
    add_bos = bool(field_value(reader, Keys.Tokenizer.ADD_BOS, kind == "llama"))
    add_eos = bool(field_value(reader, Keys.Tokenizer.ADD_EOS, False))
    post = _post_processor(tokens, bos, eos, add_bos, add_eos)
    if post is not None:
        tok.post_processor = post
    return GGUFTokenizer(
        tokenizer=tok,
        bos_token_id=bos,
        eos_token_ids=eos_token_ids(reader),
        chat_template=field_value(reader, Keys.Tokenizer.CHAT_TEMPLATE, None),
        add_bos_token=add_bos,
    )
