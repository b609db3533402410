"""A request's output text continues its prompt's: it is ``decode(prompt + output)`` minus
``decode(prompt)``, token by token (streamed), a few tokens at a time, or all at once, with stop
strings, for a Llama-style SentencePiece tokenizer (Metaspace, built offline), a SentencePiece
GGUF vocab (the Replace/ByteFallback/Fuse/Strip decoder), a trained byte-level BPE and the tiny
byte-level tokenizer. Decoded alone, a SentencePiece output would lose its first space."""
import random

import pytest

from arfusion.engine.common.sampling_params import SamplingParams
from arfusion.engine.scheduling.detokenizer import CONTEXT_TOKENS, output_starts_text, prompt_context
from arfusion.engine.scheduling.request import Request
from arfusion.engine.tokenizers.serving import load_serving_tokenizer
from arfusion.engine.tokenizers.tokenizer import Tokenizer, build_tiny_tokenizer
from tests.gguf_files import train_bpe, write_spm_file
from tests.llama_tokenizer import llama_style_tokenizer

PROMPTS = ["The capital of France is", "hello", "héllo wörld €", "a\nb  c", ""]
WORDS = ["Paris", "the", "hello", "wörld", "€", "é", "fox", "123", "\n", ",", "  "]


@pytest.fixture(scope="module", params=["llama", "spm-gguf", "byte-level-bpe", "tiny"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    if request.param == "llama":
        return llama_style_tokenizer()
    if request.param == "spm-gguf":
        path = write_spm_file(tmp_path_factory.mktemp("spm") / "spm.gguf", xy_first=True)[0]
        return load_serving_tokenizer(str(path))
    if request.param == "byte-level-bpe":
        return Tokenizer(train_bpe(), None, ["<|endoftext|>"], None)
    return build_tiny_tokenizer()


def random_output(tokenizer: Tokenizer, seed: int) -> list[int]:
    """Ids of a random text of words, spaces and multi-byte characters (some split over byte
    tokens), with a special token that is no end token in the middle."""
    rng = random.Random(seed)
    text = "".join(rng.choice(["", " "]) + rng.choice(WORDS) for _ in range(12))
    ids = tokenizer.encode(text, add_special_tokens=False)
    specials = [i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == "" and i not in tokenizer.eos_token_ids
                and tokenizer.decode([i], skip_special_tokens=False)]
    if specials:
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
    return ids


def released(tokenizer: Tokenizer, prompt_ids: list[int], output_ids: list[int], every: int,
             stop: tuple[str, ...] = ()) -> tuple[str, str]:
    """The text a request releases when its output arrives ``every`` tokens at a time (as the
    scheduler hands it over), and its finish reason."""
    req = Request(prompt_ids, SamplingParams(max_tokens=len(output_ids), stop=stop), emit=lambda chunk: None)
    text = ""
    for start in range(0, len(output_ids), every):
        for token in output_ids[start:start + every]:
            req.output_ids.append(token)
            req.check_finished(tokenizer.eos_token_ids, 10_000)
        text += req.release(tokenizer).text
        if req.finish_reason is not None:
            break
    return text, req.finish_reason


def continuation(tokenizer: Tokenizer, prompt_ids: list[int], output_ids: list[int]) -> str:
    whole, prompt = tokenizer.decode(prompt_ids + output_ids), tokenizer.decode(prompt_ids)
    assert whole.startswith(prompt)
    return whole[len(prompt):]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("every", [1, 3, 1000], ids=["streamed", "by-3", "whole"])
def test_output_text_is_the_continuation_of_the_prompts(tokenizer: Tokenizer, prompt: str, seed: int, every: int):
    prompt_ids = tokenizer.encode(prompt)
    output_ids = random_output(tokenizer, seed)
    assert released(tokenizer, prompt_ids, output_ids, every) == (continuation(tokenizer, prompt_ids, output_ids), "length")


@pytest.mark.parametrize("every", [1, 1000], ids=["streamed", "whole"])
def test_the_first_output_word_keeps_its_space_with_sentencepiece(every: int):
    tokenizer = llama_style_tokenizer()
    prompt_ids = tokenizer.encode("The capital of France is")
    output_ids = tokenizer.encode(" Paris Paris Paris", add_special_tokens=False)
    assert tokenizer.decode(output_ids) == "Paris Paris Paris", "decoded alone, the space is lost"
    assert released(tokenizer, prompt_ids, output_ids, every) == (" Paris Paris Paris", "length")


@pytest.mark.parametrize("stop, expected", [((" Paris",), ("", "stop")), (("s P",), (" Pari", "stop")),
                                            (("Paris.",), (" Paris Paris Paris", "length"))])
@pytest.mark.parametrize("every", [1, 1000], ids=["streamed", "whole"])
def test_stop_strings_see_the_first_space(stop: tuple[str, ...], expected: tuple[str, str], every: int):
    tokenizer = llama_style_tokenizer()
    prompt_ids = tokenizer.encode("The capital of France is")
    output_ids = tokenizer.encode(" Paris Paris Paris", add_special_tokens=False)
    assert released(tokenizer, prompt_ids, output_ids, every, stop) == expected


def test_the_context_begins_on_a_character_after_text():
    """After only special tokens (or none) the output begins a text; the context grows past
    special tokens and pieces of a character to text that begins on a character."""
    tokenizer = llama_style_tokenizer()
    bos = tokenizer.bos_token_id
    assert output_starts_text(tokenizer, [bos]) and output_starts_text(tokenizer, [])
    word = tokenizer.encode("Paris", add_special_tokens=False)
    prompt_ids = [bos, *word, *[bos] * (3 * CONTEXT_TOKENS)]
    assert not output_starts_text(tokenizer, prompt_ids)
    assert tokenizer.decode(prompt_context(tokenizer, prompt_ids)) == "Paris"
    euro = tokenizer.encode("x€€€", add_special_tokens=False)  # "▁", "x" and the 9 bytes of three €
    assert len(euro) == 11 and "\ufffd" in tokenizer.decode(euro[-CONTEXT_TOKENS:])
    assert prompt_context(tokenizer, euro) == euro[-2 * CONTEXT_TOKENS:]
