"""Writers of small GGUF files for the weight-loading tests (gguf.GGUFWriter, llama.cpp conventions).

Quantized test data: ``gguf.quants.quantize`` implements BF16, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0
(and the ternary/MXFP4 types), but not the K-quants (gguf 0.19 has only their dequantizers). For
Q4_K, Q5_K and Q6_K the files hold random blocks (small fp16 super-block scales, random quants);
their "original" is the library's dequantization of those blocks.
"""
import json
from pathlib import Path
from typing import Any, Optional

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter, Keys, TokenType
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from arfusion.engine.weights.gguf_names import llama3_freq_factors

HIDDEN, LAYERS, HEADS, KV_HEADS, INTER = 256, 2, 4, 2, 512
HEAD_DIM = HIDDEN // HEADS
ROPE_THETA = 500000.0
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
KQUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Per-tensor types: every float type and every quantized type the tests need, mixed like real files.
TYPES: dict[str, Q] = {
    "token_embd": Q.F16, "output_norm": Q.F32, "output": Q.Q6_K,
    "blk.0.attn_norm": Q.F32, "blk.0.ffn_norm": Q.F32,
    "blk.0.attn_q": Q.Q8_0, "blk.0.attn_k": Q.Q4_0, "blk.0.attn_v": Q.Q5_0, "blk.0.attn_output": Q.BF16,
    "blk.0.ffn_gate": Q.Q4_K, "blk.0.ffn_up": Q.Q5_K, "blk.0.ffn_down": Q.Q6_K,
    "blk.1.attn_norm": Q.F32, "blk.1.ffn_norm": Q.F32,
    "blk.1.attn_q": Q.F32, "blk.1.attn_k": Q.F16, "blk.1.attn_v": Q.Q4_1, "blk.1.attn_output": Q.Q5_1,
    "blk.1.ffn_gate": Q.Q8_0, "blk.1.ffn_up": Q.BF16, "blk.1.ffn_down": Q.Q4_K,
}
# Max |loaded - original| as a fraction of max |original| (one quantization step or less).
QUANT_TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1e-2, Q.Q5_0: 7e-2, Q.Q5_1: 7e-2, Q.Q4_0: 0.14, Q.Q4_1: 0.14}
HF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello GGUF!", "tokenizers are fun 123 456"] * 4
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
# Qwen2.5-Instruct's vocabulary metadata as llama.cpp writes it: control tokens (eos is the
# end-of-turn <|im_end|>, bos and padding <|endoftext|>), a user-defined one, [PAD<n>] "unused"
# ids padding the vocab to the next multiple of 8, the chat template of tokenizer_config.json.
QWEN2_SPECIALS = {"<|endoftext|>": TokenType.CONTROL, "<|im_start|>": TokenType.CONTROL,
                  "<|im_end|>": TokenType.CONTROL, "<tool_call>": TokenType.USER_DEFINED}
QWEN2_CHAT_TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen2_5_chat_template.jinja").read_text()


def hf_name(gguf_base: str) -> str:
    if gguf_base.startswith("blk."):
        _, layer, part = gguf_base.split(".")
        return f"model.layers.{layer}.{HF_NAMES[part]}.weight"
    return HF_NAMES[gguf_base] + ".weight"


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of HF Q/K rows (written independently of the loader)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_kquant_blocks(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of a K-quant with small positive fp16 super-block scale(s), as (rows, bytes)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    scale = (1e-4 + 1e-3 * rng.random((raw.shape[0], 1))).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        raw[:, -2:] = scale  # ql, qh, int8 scales, then d
    else:
        raw[:, 0:2] = scale  # d, dmin, scales, (qh,) qs
        raw[:, 2:4] = (1e-4 * rng.random((raw.shape[0], 1))).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, cols // block * size)


def encode(values: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """What GGUFWriter.add_tensor gets for ``values`` stored as ``qtype``."""
    if qtype == Q.F32:
        return values.astype(np.float32)
    if qtype == Q.F16:
        return values.astype(np.float16)
    if qtype in KQUANTS:
        return random_kquant_blocks(values.shape[0], values.shape[1], qtype, rng)
    return quantize(values, qtype)


def train_bpe(specials: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>")) -> Tokenizer:
    """A byte-level BPE (GPT-2 pre-tokenizer) trained on CORPUS; ``specials`` take the first ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def bpe_metadata(tok: Tokenizer) -> dict[str, Any]:
    """``tokenizer.*`` metadata of a "gpt2" GGUF vocab for ``tok`` (ids in vocab order, merges as "a b")."""
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tok.to_str())["model"]["merges"]
    specials = {"<|endoftext|>", "<|im_start|>"}
    return {
        Keys.Tokenizer.MODEL: "gpt2",
        Keys.Tokenizer.PRE: "gpt-2",
        Keys.Tokenizer.LIST: tokens,
        Keys.Tokenizer.TOKEN_TYPE: [int(TokenType.CONTROL if t in specials else TokenType.NORMAL) for t in tokens],
        Keys.Tokenizer.MERGES: [" ".join(m) if isinstance(m, list) else m for m in merges],
        Keys.Tokenizer.BOS_ID: vocab["<|endoftext|>"],
        Keys.Tokenizer.EOS_ID: vocab["<|endoftext|>"],
        Keys.Tokenizer.EOT_ID: vocab["<|im_start|>"],
        Keys.Tokenizer.ADD_BOS: False,
        Keys.Tokenizer.CHAT_TEMPLATE: CHAT_TEMPLATE,
    }


def qwen2_vocab_metadata(tok: Tokenizer) -> dict[str, Any]:
    """``tokenizer.*`` metadata of a Qwen2.5-Instruct-style GGUF for ``tok`` (from ``train_bpe(QWEN2_SPECIALS)``)."""
    meta = bpe_metadata(tok)
    vocab = tok.get_vocab()
    tokens = meta[Keys.Tokenizer.LIST]
    pads = [f"[PAD{i}]" for i in range(len(tokens), (len(tokens) // 8 + 1) * 8)]
    types = [int(QWEN2_SPECIALS.get(t, TokenType.NORMAL)) for t in tokens] + [int(TokenType.UNUSED)] * len(pads)
    meta.pop(Keys.Tokenizer.EOT_ID)
    return meta | {
        Keys.Tokenizer.PRE: "qwen2", Keys.Tokenizer.LIST: tokens + pads, Keys.Tokenizer.TOKEN_TYPE: types,
        Keys.Tokenizer.EOS_ID: vocab["<|im_end|>"], Keys.Tokenizer.PAD_ID: vocab["<|endoftext|>"],
        Keys.Tokenizer.CHAT_TEMPLATE: QWEN2_CHAT_TEMPLATE,
    }


def model_metadata(arch: str) -> dict[str, Any]:
    """The ``{arch}.*`` hyper-parameters of the test model, as llama.cpp's converter writes them."""
    return {
        f"{arch}.block_count": LAYERS,
        f"{arch}.context_length": 4096,
        f"{arch}.embedding_length": HIDDEN,
        f"{arch}.feed_forward_length": INTER,
        f"{arch}.attention.head_count": HEADS,
        f"{arch}.attention.head_count_kv": KV_HEADS,
        f"{arch}.rope.freq_base": ROPE_THETA,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
    }


def write_gguf(path: Path, arch: str, metadata: dict[str, Any], tensors: dict[str, tuple[np.ndarray, Optional[Q]]],
               split_max_tensors: int = 0) -> Path:
    """Write a GGUF; tensors are (float array, None) or (uint8 blocks, their type); split when asked."""
    writer = GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def shapes(vocab: int) -> dict[str, tuple[int, ...]]:
    """GGUF base name -> HF-layout shape of every weight of the test model."""
    out: dict[str, tuple[int, ...]] = {"token_embd": (vocab, HIDDEN)}
    for i in range(LAYERS):
        out |= {
            f"blk.{i}.attn_norm": (HIDDEN,), f"blk.{i}.ffn_norm": (HIDDEN,),
            f"blk.{i}.attn_q": (HIDDEN, HIDDEN), f"blk.{i}.attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), f"blk.{i}.attn_output": (HIDDEN, HIDDEN),
            f"blk.{i}.ffn_gate": (INTER, HIDDEN), f"blk.{i}.ffn_up": (INTER, HIDDEN), f"blk.{i}.ffn_down": (HIDDEN, INTER),
        }
    return out | {"output_norm": (HIDDEN,), "output": (vocab, HIDDEN)}  # last, as in converted files


class LlamaFile:
    """A llama-arch GGUF: ``original`` HF-layout floats, ``stored`` the library's dequantization of
    what was written (GGUF layout: Q/K permuted), plus the tokenizer it was built from."""

    def __init__(self, path: Path, drop_output: bool = False, split_max_tensors: int = 0) -> None:
        rng = np.random.default_rng(0)
        self.bpe = train_bpe()
        meta = model_metadata("llama") | bpe_metadata(self.bpe)
        self.original: dict[str, np.ndarray] = {}
        self.stored: dict[str, np.ndarray] = {}
        tensors: dict[str, tuple[np.ndarray, Optional[Q]]] = {}
        for base, shape in shapes(self.bpe.get_vocab_size()).items():
            if drop_output and base == "output":
                continue
            qtype = TYPES[base]
            values = (rng.standard_normal(shape) * 0.1 + (1.0 if base.endswith("norm") else 0.0)).astype(np.float32)
            heads = HEADS if base.endswith("attn_q") else KV_HEADS if base.endswith("attn_k") else None
            to_file = llamacpp_permute(values, heads) if heads else values
            data = encode(to_file, qtype, rng)
            self.stored[base] = dequantize(data, qtype)
            if qtype in KQUANTS:
                assert heads is None, "K-quant test data is random, so it must not be a permuted tensor"
                values = self.stored[base]
            self.original[base] = values
            tensors[base + ".weight"] = (data, qtype)
        factors = llama3_freq_factors(LLAMA3_SCALING, ROPE_THETA, HEAD_DIM).astype(np.float32)
        tensors["rope_freqs.weight"] = (factors, None)
        self.path = write_gguf(path, "llama", meta, tensors, split_max_tensors)


def write_spm_file(path: Path, xy_first: bool) -> tuple[Path, list[str]]:
    """A llama-arch GGUF holding only a SentencePiece vocab: control, byte and scored normal pieces."""
    pieces = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "x", "y", "z", "\u2581h", "he", "ll", "\u2581he", "llo",
              "\u2581hello", "\u2581w", "or", "\u2581wor", "ld", "\u2581world", "xy", "yz"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256 + [TokenType.NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    if not xy_first:  # make "yz" outrank "xy"
        scores[tokens.index("xy")], scores[tokens.index("yz")] = scores[tokens.index("yz")], scores[tokens.index("xy")]
    meta = {
        Keys.Tokenizer.MODEL: "llama", Keys.Tokenizer.LIST: tokens, Keys.Tokenizer.SCORES: scores,
        Keys.Tokenizer.TOKEN_TYPE: [int(t) for t in types], Keys.Tokenizer.BOS_ID: 1, Keys.Tokenizer.EOS_ID: 2,
        Keys.Tokenizer.UNK_ID: 0, Keys.Tokenizer.ADD_BOS: True,
    }
    return write_gguf(path, "llama", meta, {}), tokens


def qwen2_chat_file(path: Path) -> tuple[Path, Tokenizer]:
    """An all-F32 ``qwen2`` model (q/k/v biases) with `qwen2_vocab_metadata`; returns the file and
    the BPE it was built from."""
    rng = np.random.default_rng(5)
    bpe = train_bpe(tuple(QWEN2_SPECIALS))
    meta = model_metadata("qwen2") | qwen2_vocab_metadata(bpe)
    tensors = {}
    for base, shape in shapes(len(meta[Keys.Tokenizer.LIST])).items():
        tensors[base + ".weight"] = ((rng.standard_normal(shape) * 0.1 + base.endswith("norm")).astype(np.float32), None)
        if base.split(".")[-1] in ("attn_q", "attn_k", "attn_v"):
            tensors[base + ".bias"] = ((rng.standard_normal(shape[0]) * 0.1).astype(np.float32), None)
    return write_gguf(path, "qwen2", meta, tensors), bpe


def tiny_file(path: Path, arch: str = "llama", drop: str = "",
              extra: Optional[dict[str, tuple[np.ndarray, Optional[Q]]]] = None) -> Path:
    """An all-F32 model of ``arch`` without metadata key ``drop``; ``extra`` tensors added or replaced."""
    rng = np.random.default_rng(2)
    vocab = 32
    meta = model_metadata(arch) | {Keys.Tokenizer.LIST: [f"t{i}" for i in range(vocab)]}
    meta.pop(drop.format(arch=arch), None)
    tensors = {b + ".weight": ((rng.standard_normal(s) + 0.5).astype(np.float32), None) for b, s in shapes(vocab).items()}
    return write_gguf(path, arch, meta, tensors | (extra or {}))
