"""Weight loading: a model path -> (`ModelConfig`, iterator of full HF-named tensors).

`load_model_weights` dispatches on the format (safetensors directory, GGUF file, dummy);
`load_gguf_tokenizer` builds the tokenizer stored in a GGUF file. A file that cannot be served
raises `ModelFileError` (one line: the file and the problem).
"""
from arfusion.engine.weights.errors import ModelFileError
from arfusion.engine.weights.gguf_loader import UnsupportedTensorTypeError, load_gguf, unpermute_qk
from arfusion.engine.weights.gguf_names import MissingMetadataError
from arfusion.engine.weights.gguf_tokenizer import GGUFTokenizer, load_gguf_tokenizer
from arfusion.engine.weights.loader import load_model_weights, resolve_load_format
from arfusion.engine.weights.safetensors_loader import load_safetensors, read_hf_config

__all__ = [
    "GGUFTokenizer",
    "MissingMetadataError",
    "ModelFileError",
    "UnsupportedTensorTypeError",
    "load_gguf",
    "load_gguf_tokenizer",
    "load_model_weights",
    "load_safetensors",
    "read_hf_config",
    "resolve_load_format",
    "unpermute_qk",
]
