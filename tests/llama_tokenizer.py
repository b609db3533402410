"""A Llama-style SentencePiece tokenizer built offline with the ``tokenizers`` library: BPE
trained on a small corpus, the Metaspace ("▁") pre-tokenizer and decoder (a word's space is
its token's "▁"; the decoder drops the space of a text's first token), byte fallback
(``<0xNN>`` pieces for characters outside the vocabulary), ``<s>`` put first by the
post-processor, ``</s>`` the end."""
from __future__ import annotations

import json

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from arfusion.engine.tokenizers.tokenizer import Tokenizer

SPECIALS = ["<unk>", "<s>", "</s>"]
CORPUS = ["The capital of France is Paris.", "Paris is a city in France, the capital.",
          "The quick brown fox jumps over the lazy dog.", "hello world, hello again"] * 4


def llama_style_tokenizer() -> Tokenizer:
    """Ids: the three specials, the 256 byte pieces, then the trained vocabulary."""
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIALS)
    trained = HFTokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trained.train_from_iterator(CORPUS, trainer)
    spec = json.loads(trained.to_str())
    learned = [t for t, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]) if t not in SPECIALS]
    pieces = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + learned
    spec["model"]["vocab"] = {piece: i for i, piece in enumerate(pieces)}
    spec["model"]["byte_fallback"] = True
    tk = HFTokenizer.from_str(json.dumps(spec))
    tk.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="\u2581", prepend_scheme="first")])
    tk.add_special_tokens(SPECIALS)
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return Tokenizer(tk, "<s>", ["</s>"], None)
