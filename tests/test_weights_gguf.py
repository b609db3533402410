"""GGUF loading: dequantization of every type, Q/K unpermute, config and tokenizer mapping, errors.

The files are written by tests/gguf_files.py with gguf.GGUFWriter (see there which quantized
types the gguf package can quantize and how the K-quant data is made).
"""
import math
from typing import Any, Optional

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, Keys
from gguf import GGMLQuantizationType as Q
from tokenizers import Tokenizer

from arfusion.engine.weights import (
    MissingMetadataError,
    UnsupportedTensorTypeError,
    load_gguf,
    load_gguf_tokenizer,
    load_model_weights,
    resolve_load_format,
    unpermute_qk,
)
from arfusion.engine.weights.errors import ModelFileError
from arfusion.engine.weights.gguf_names import llama3_freq_factors
from arfusion.engine.tokenizers.serving import load_serving_tokenizer
from tests.gguf_files import (
    CHAT_TEMPLATE, HEAD_DIM, HEADS, HIDDEN, INTER, KQUANTS, KV_HEADS, LAYERS, LLAMA3_SCALING, QUANT_TOLERANCE,
    ROPE_THETA, TYPES, LlamaFile, bpe_metadata, hf_name, llamacpp_permute, model_metadata, qwen2_chat_file, shapes,
    tiny_file, train_bpe, write_gguf, write_spm_file,
)


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory) -> LlamaFile:
    return LlamaFile(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture(scope="module")
def loaded(llama_file) -> tuple[Any, dict[str, torch.Tensor]]:
    config, weights = load_gguf(llama_file.path, torch.float32)
    return config, dict(weights)


def test_names_and_hf_layout(llama_file, loaded):
    _, tensors = loaded
    assert sorted(tensors) == sorted(hf_name(b) for b in llama_file.original)
    for base, values in llama_file.original.items():
        assert tuple(tensors[hf_name(base)].shape) == values.shape, base


def test_tensors_equal_library_dequantization(llama_file, loaded):
    """Exactly what gguf.quants.dequantize gives for the stored bytes, with Q/K in llama.cpp's layout once re-permuted."""
    _, tensors = loaded
    for base, stored in llama_file.stored.items():
        got = tensors[hf_name(base)].numpy()
        heads = HEADS if base.endswith("attn_q") else KV_HEADS if base.endswith("attn_k") else None
        if heads:
            got = llamacpp_permute(got, heads)
        np.testing.assert_array_equal(got, stored, err_msg=f"{base} ({TYPES[base].name})")


@pytest.mark.parametrize("base", [b for b, t in TYPES.items() if t not in KQUANTS])
def test_close_to_original_within_quantization_error(llama_file, loaded, base):
    _, tensors = loaded
    original = llama_file.original[base]
    err = np.abs(tensors[hf_name(base)].numpy() - original).max()
    assert err <= QUANT_TOLERANCE[TYPES[base]] * np.abs(original).max(), f"{base} {TYPES[base].name}: max error {err}"


def test_qk_unpermute_recovers_hf_layout(llama_file, loaded):
    _, tensors = loaded
    original = llama_file.original["blk.1.attn_q"]  # stored as F32: the round trip is exact
    assert not np.array_equal(llamacpp_permute(original, HEADS), original)
    np.testing.assert_array_equal(tensors["model.layers.1.self_attn.q_proj.weight"].numpy(), original)
    k = tensors["model.layers.1.self_attn.k_proj.weight"].numpy()  # F16: exact up to the fp16 cast
    np.testing.assert_array_equal(k, llama_file.original["blk.1.attn_k"].astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("n_head,shape", [(4, (256, 8)), (2, (128,)), (8, (64, 3))])
def test_unpermute_inverts_llamacpp_permute(n_head, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(n_head))
    permuted = torch.from_numpy(llamacpp_permute(x.numpy(), n_head))
    assert not torch.equal(permuted, x)
    assert torch.equal(unpermute_qk(permuted, n_head), x)


def test_config_mapping(llama_file, loaded):
    config, _ = loaded
    vocab = llama_file.bpe.get_vocab()
    assert config.architecture == "LlamaForCausalLM"
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (HIDDEN, LAYERS, INTER)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert config.vocab_size == len(vocab)
    assert config.rope_theta == ROPE_THETA and config.max_position_embeddings == 4096
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert not config.tie_word_embeddings and not config.attention_bias
    assert config.bos_token_id == vocab["<|endoftext|>"]
    assert config.eos_token_ids == (vocab["<|endoftext|>"], vocab["<|im_start|>"])
    scaling = config.rope_scaling
    assert set(scaling) == set(LLAMA3_SCALING) and scaling["rope_type"] == "llama3"
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        assert scaling[key] == pytest.approx(LLAMA3_SCALING[key], rel=1e-4), key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_to_requested_dtype(llama_file, loaded, dtype):
    _, reference = loaded
    _, weights = load_gguf(llama_file.path, dtype)
    for name, tensor in weights:
        assert tensor.dtype == dtype
        assert torch.equal(tensor, reference[name].to(dtype)), name


def test_tied_embeddings_without_output_tensor(tmp_path):
    config, weights = load_gguf(LlamaFile(tmp_path / "tied.gguf", drop_output=True).path)
    assert config.tie_word_embeddings
    assert "lm_head.weight" not in dict(weights)


def test_split_gguf_loads_all_shards(tmp_path, loaded):
    LlamaFile(tmp_path / "split.gguf", split_max_tensors=8)
    shards = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(shards) == 3
    config, weights = load_gguf(shards[0])
    assert config == loaded[0] and not config.tie_word_embeddings  # output.weight is in the last shard
    got = dict(weights)
    assert sorted(got) == sorted(loaded[1])
    assert all(torch.equal(got[n], loaded[1][n]) for n in got)
    with pytest.raises(ValueError, match="pass its first shard"):
        load_gguf(shards[1])
    shards[2].unlink()
    with pytest.raises(ModelFileError, match=f"^{shards[2]}: missing: shard of the 3-file split GGUF"):
        load_gguf(shards[0])


def test_qwen2_is_not_unpermuted_and_has_bias(tmp_path):
    rng = np.random.default_rng(1)
    vocab = 64
    tokens = [f"t{i}" for i in range(vocab)]
    meta = model_metadata("qwen2") | {Keys.Tokenizer.LIST: tokens}
    originals: dict[str, np.ndarray] = {}
    for base, shape in shapes(vocab).items():
        originals[base + ".weight"] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if base.split(".")[-1] in ("attn_q", "attn_k", "attn_v"):
            originals[base + ".bias"] = rng.standard_normal(shape[0]).astype(np.float32)
    tensors: dict[str, tuple[np.ndarray, Optional[Q]]] = {name: (values, None) for name, values in originals.items()}
    config, weights = load_gguf(write_gguf(tmp_path / "qwen2.gguf", "qwen2", meta, tensors))
    got = dict(weights)
    assert config.architecture == "Qwen2ForCausalLM" and config.attention_bias and config.rope_scaling is None
    np.testing.assert_array_equal(got["model.layers.0.self_attn.q_proj.weight"].numpy(), originals["blk.0.attn_q.weight"])
    np.testing.assert_array_equal(got["model.layers.1.self_attn.k_proj.bias"].numpy(), originals["blk.1.attn_k.bias"])
    assert len(got) == len(originals)


def test_gpt2_bpe_tokenizer_round_trip(llama_file):
    info = load_gguf_tokenizer(llama_file.path)
    vocab = llama_file.bpe.get_vocab()
    assert info.bos_token_id == vocab["<|endoftext|>"]
    assert info.eos_token_ids == (vocab["<|endoftext|>"], vocab["<|im_start|>"])
    assert info.chat_template == CHAT_TEMPLATE and not info.add_bos_token
    for text in ["hello world, hello GGUF!", "the lazy fox 12345 ünïcödé", "<|im_start|>the dog<|endoftext|>"]:
        ids = info.tokenizer.encode(text).ids
        assert ids == llama_file.bpe.encode(text).ids, text
        assert info.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert vocab["<|im_start|>"] in info.tokenizer.encode("<|im_start|>x").ids


@pytest.fixture(scope="module")
def qwen2_file(tmp_path_factory) -> tuple[Any, Tokenizer]:
    return qwen2_chat_file(tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf")


def test_qwen2_generation_ends_at_end_of_turn_and_end_of_text(qwen2_file):
    """The file's eos is <|im_end|>; <|endoftext|> ends generation too (HF's generation_config,
    llama.cpp's end-of-generation tokens), for the model config and the tokenizer alike."""
    path, bpe = qwen2_file
    vocab = bpe.get_vocab()
    expected = (vocab["<|im_end|>"], vocab["<|endoftext|>"])
    assert load_gguf(path)[0].eos_token_ids == expected
    assert load_gguf_tokenizer(path).eos_token_ids == expected
    assert load_serving_tokenizer(str(path)).eos_token_ids == expected


def test_qwen2_tokenizer_normalises_to_nfc(qwen2_file):
    tok = load_gguf_tokenizer(qwen2_file[0]).tokenizer
    assert tok.encode("caf\u0065\u0301 ok").ids == tok.encode("caf\u00e9 ok").ids


def test_qwen2_chat_template_and_special_tokens(qwen2_file):
    """Qwen2.5's template renders as HF's apply_chat_template does (default system prompt when
    none is given); its control tokens encode whole, no BOS is added, and decoding drops them."""
    path, bpe = qwen2_file
    vocab = bpe.get_vocab()
    tok = load_serving_tokenizer(str(path))
    default_system = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    assert tok.apply_chat_template([{"role": "user", "content": "hello world"}]) == (
        default_system + "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n")
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
             {"role": "assistant", "content": "the dog"}, {"role": "user", "content": "fox?"}]
    text = tok.apply_chat_template(turns, add_generation_prompt=False)
    assert text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
                    "<|im_start|>assistant\nthe dog<|im_end|>\n<|im_start|>user\nfox?<|im_end|>\n")
    ids = tok.encode(text, add_special_tokens=True)
    assert ids[0] == vocab["<|im_start|>"] and ids.count(vocab["<|im_end|>"]) == 4
    assert tok.decode(ids) == "system\nbe brief\nuser\nhello\nassistant\nthe dog\nuser\nfox?\n"
    assert tok.encode("<tool_call>x", add_special_tokens=False)[0] == vocab["<tool_call>"]
    assert tok.decode(tok.encode("<tool_call>x")) == "<tool_call>x"  # user-defined: kept in the text
    pad_id = tok.vocab_size - 1
    assert tok.tokenizer.id_to_token(pad_id).startswith("[PAD") and pad_id not in tok.encode("[PAD%d]" % pad_id)


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_bpe()


@pytest.mark.parametrize(
    "pre,pieces",
    [
        ("llama-bpe", ["ab", "\u0120", "123", "45"]),  # digits in groups of 3
        ("qwen2", ["ab", "\u0120", "1", "2", "3", "4", "5"]),  # single digits
        ("gpt-2", ["ab", "\u012012345"]),
    ],
)
def test_bpe_pre_tokenizer_follows_pre_label(tmp_path, bpe, pre, pieces):
    meta = bpe_metadata(bpe) | {Keys.Tokenizer.PRE: pre}
    tok = load_gguf_tokenizer(write_gguf(tmp_path / "t.gguf", "llama", meta, {})).tokenizer
    assert [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("ab 12345")] == pieces


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({Keys.Tokenizer.PRE: "smaug-bpe"}, ValueError, "unsupported tokenizer.ggml.pre 'smaug-bpe'"),
        ({Keys.Tokenizer.MODEL: "bert"}, ValueError, "unsupported tokenizer.ggml.model 'bert'"),
        ({Keys.Tokenizer.MERGES: None}, MissingMetadataError, "tokenizer.ggml.merges"),
        ({Keys.Tokenizer.LIST: None}, MissingMetadataError, "tokenizer.ggml.tokens"),
    ],
)
def test_tokenizer_errors(tmp_path, bpe, change, error, match):
    meta = {k: v for k, v in (bpe_metadata(bpe) | change).items() if v is not None}
    if Keys.Tokenizer.LIST not in meta:
        meta.pop(Keys.Tokenizer.TOKEN_TYPE)
    with pytest.raises(error, match=match.replace(".", r"\.")):
        load_gguf_tokenizer(write_gguf(tmp_path / "t.gguf", "llama", meta, {}))


@pytest.mark.parametrize("xy_first", [True, False])
def test_sentencepiece_tokenizer(tmp_path, xy_first):
    path, tokens = write_spm_file(tmp_path / "spm.gguf", xy_first)
    info = load_gguf_tokenizer(path)
    assert (info.bos_token_id, info.eos_token_ids, info.add_bos_token) == (1, (2,), True)
    enc = info.tokenizer.encode("hello world hé")
    pieces = [tokens[i] for i in enc.ids]
    assert pieces == ["<s>", "\u2581hello", "\u2581world", "\u2581h", "<0xC3>", "<0xA9>"]
    assert info.tokenizer.decode(enc.ids) == "hello world hé"
    expected = ["\u2581", "xy", "z"] if xy_first else ["\u2581", "x", "yz"]  # highest-scored merge first
    assert [tokens[i] for i in info.tokenizer.encode("xyz", add_special_tokens=False).ids] == expected


def test_dispatch_auto_picks_gguf(llama_file, loaded):
    assert resolve_load_format(llama_file.path) == "gguf"
    config, weights = load_model_weights(llama_file.path)
    assert config == loaded[0]
    name, tensor = next(weights)
    assert torch.equal(tensor, loaded[1][name])


def test_llama_qk_bias_is_unpermuted_too(tmp_path):
    """llama.cpp permutes q/k biases like their weights (1-D rows). A llama model with attention
    bias has q/k/v and o_proj biases in every layer."""
    rng = np.random.default_rng(4)
    bias_q = rng.standard_normal(HIDDEN).astype(np.float32)
    bias_k = rng.standard_normal(KV_HEADS * HEAD_DIM).astype(np.float32)
    extra = {
        "blk.0.attn_q.bias": (llamacpp_permute(bias_q, HEADS), None),
        "blk.0.attn_k.bias": (llamacpp_permute(bias_k, KV_HEADS), None),
        "blk.1.attn_q.bias": (bias_q, None), "blk.1.attn_k.bias": (bias_k, None),
    } | {f"blk.{i}.{part}.bias": (rng.standard_normal(size).astype(np.float32), None)
         for i in range(LAYERS) for part, size in (("attn_v", KV_HEADS * HEAD_DIM), ("attn_output", HIDDEN))}
    config, weights = load_gguf(tiny_file(tmp_path / "b.gguf", extra=extra))
    got = dict(weights)
    assert config.attention_bias
    np.testing.assert_array_equal(got["model.layers.0.self_attn.q_proj.bias"].numpy(), bias_q)
    np.testing.assert_array_equal(got["model.layers.0.self_attn.k_proj.bias"].numpy(), bias_k)


def test_error_unknown_architecture(tmp_path):
    with pytest.raises(ValueError, match="unknown GGUF architecture 'falcon'"):
        load_gguf(tiny_file(tmp_path / "f.gguf", arch="falcon"))


@pytest.mark.parametrize("key", [Keys.Attention.LAYERNORM_RMS_EPS, Keys.LLM.BLOCK_COUNT, Keys.Attention.HEAD_COUNT])
def test_error_missing_metadata_names_key(tmp_path, key):
    with pytest.raises(MissingMetadataError, match=key.format(arch="llama").replace(".", r"\.")):
        load_gguf(tiny_file(tmp_path / "m.gguf", drop=key))


def test_error_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    block, size = GGML_QUANT_SIZES[Q.Q8_K]  # gguf 0.19 has no Q8_K dequantizer
    raw = np.random.default_rng(3).integers(0, 256, size=(INTER, HIDDEN // block * size), dtype=np.uint8)
    path = tiny_file(tmp_path / "q8k.gguf", extra={"blk.1.ffn_up.weight": (raw, Q.Q8_K)})
    with pytest.raises(UnsupportedTensorTypeError, match=r"'blk\.1\.ffn_up\.weight'.*Q8_K"):
        load_gguf(path)


def test_error_unknown_tensor_name(tmp_path):
    extra = {"blk.0.ffn_gate_exps.weight": (np.ones((2, HIDDEN), dtype=np.float32), None)}
    with pytest.raises(ValueError, match="unknown GGUF tensor 'blk.0.ffn_gate_exps.weight'"):
        load_gguf(tiny_file(tmp_path / "e.gguf", extra=extra))


def test_error_unsupported_rope_freqs(tmp_path):
    factors = np.linspace(1.0, 3.0, HEAD_DIM // 2).astype(np.float32) ** 2  # not of the llama3 form
    with pytest.raises(ValueError, match="llama3 rope scaling rule"):
        load_gguf(tiny_file(tmp_path / "r.gguf", extra={"rope_freqs.weight": (factors, None)}))


def test_error_missing_file(tmp_path):
    with pytest.raises(ModelFileError, match="nope.gguf: no such GGUF file"):
        load_gguf(tmp_path / "nope.gguf")


def test_llama3_factors_match_rule_at_boundaries():
    factors = llama3_freq_factors(LLAMA3_SCALING, ROPE_THETA, HEAD_DIM)
    wavelen = 2 * math.pi * ROPE_THETA ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    assert np.all(factors[wavelen < 8192 / 4] == 1.0) and np.all(factors[wavelen > 8192] == 8.0)
    middle = factors[(wavelen >= 8192 / 4) & (wavelen <= 8192)]
    assert len(middle) >= 2 and np.all((middle > 1) & (middle < 8))
