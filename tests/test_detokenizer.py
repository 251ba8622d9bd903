"""Incremental detokenization against the tokenizer's own full decode, with tokenizers trained here:
a byte-level BPE (GPT-2 style) and a SentencePiece-style BPE with byte fallback (Llama style)."""
from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tandem.detokenizer import IncrementalDetokenizer, raw_decoder

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! Streaming text token by token is harder than it looks.",
    "我们在本地训练一个小的分词器，用来测试增量解码。",
    "今天天气很好，我们去公园散步吧。",
    "Emoji too: 🙂🚀🎉 and mixed 中文 with English words.",
    "Stop strings may span token boundaries, like ###END### or <|stop|>.",
    "naïve café déjà vu — résumé über straße",
]
SPECIAL = ["<s>", "</s>"]


def wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )


def train_byte_level() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    return wrap(tokenizer)


def train_sentencepiece_style() -> PreTrainedTokenizerFast:
    """Metaspace ("▁") pieces; characters outside the small alphabet fall back to <0xNN> tokens."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL, limit_alphabet=40, show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    vocab = model["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer.model = models.BPE(vocab, merges, byte_fallback=True)
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    return wrap(tokenizer)


@pytest.fixture(scope="module")
def byte_level():
    return train_byte_level()


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def any_tokenizer(request):
    return train_byte_level() if request.param == "byte_level" else train_sentencepiece_style()


def output_text(tokenizer, prompt_ids, output_ids, skip_special_tokens=True) -> str:
    """The oracle: the output's part of the full decode of prompt + output."""
    kwargs = {"skip_special_tokens": skip_special_tokens, "clean_up_tokenization_spaces": False}
    prompt_text = tokenizer.decode(prompt_ids, **kwargs)
    full = tokenizer.decode(list(prompt_ids) + list(output_ids), **kwargs)
    assert full.startswith(prompt_text)
    return full[len(prompt_text):]


def random_text(rng: random.Random) -> str:
    words = " ".join(CORPUS).split(" ") + ["🙂🚀", "中文", "straße", "###", "END", "\n"]
    return " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))


def feed(detokenizer, ids, rng, flush=True):
    """Feeds ``ids`` in random chunks of 1–3 tokens; returns the deltas (and the stop, if any)."""
    deltas, stop, position = [], None, 0
    while position < len(ids):
        size = rng.randint(1, 3)
        delta = detokenizer.add_tokens(ids[position : position + size])
        position += size
        deltas.append(delta.new_text)
        if delta.stop_matched is not None:
            return deltas, delta.stop_matched, position
    if flush:
        deltas.append(detokenizer.flush().new_text)
    return deltas, stop, position


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_of_random_tokens_join_into_the_full_decode(byte_level, skip_special_tokens):
    rng = random.Random(0)
    vocab_size = len(byte_level)
    for _ in range(200):
        prompt = byte_level.encode(random_text(rng), add_special_tokens=False)
        output = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 30))]
        detokenizer = IncrementalDetokenizer(
            byte_level, prompt, skip_special_tokens=skip_special_tokens
        )
        deltas, _, _ = feed(detokenizer, output, rng)
        expected = byte_level.decode(output, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == expected
        assert detokenizer.text == expected
        if "\ufffd" not in expected:
            assert not any("\ufffd" in delta for delta in deltas)


def test_deltas_of_encoded_text_join_into_the_full_decode(any_tokenizer):
    rng = random.Random(1)
    for _ in range(150):
        prompt = any_tokenizer.encode(random_text(rng), add_special_tokens=rng.random() < 0.5)
        output = any_tokenizer.encode(random_text(rng), add_special_tokens=False)
        deltas, _, _ = feed(IncrementalDetokenizer(any_tokenizer, prompt), output, rng)
        assert "".join(deltas) == output_text(any_tokenizer, prompt, output)


def test_no_delta_holds_a_broken_character(any_tokenizer):
    rng = random.Random(2)
    split_characters = 0
    for _ in range(150):
        output = any_tokenizer.encode(random_text(rng) + " 我们🙂中文", add_special_tokens=False)
        assert "\ufffd" not in any_tokenizer.decode(output)
        split_characters += sum("\ufffd" in any_tokenizer.decode([t]) for t in output)
        detokenizer = IncrementalDetokenizer(any_tokenizer, [])
        for token in output:
            assert "\ufffd" not in detokenizer.add_tokens([token]).new_text
        assert detokenizer.flush().new_text == ""
    assert split_characters > 100, "the corpus should split characters across tokens"


def expected_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(start, stop string) of the first occurrence of any stop string; list order breaks ties."""
    found = [(text.find(s), k, s) for k, s in enumerate(stops) if text.find(s) != -1]
    return min(found)[0::2] if found else None


@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_strings_are_cut_exactly(any_tokenizer, include_stop):
    rng = random.Random(3)
    matched = 0
    for _ in range(300):
        prompt = any_tokenizer.encode(random_text(rng), add_special_tokens=False)
        output = any_tokenizer.encode(random_text(rng), add_special_tokens=False)
        full = output_text(any_tokenizer, prompt, output)
        # Stop strings drawn from the text itself (spanning token boundaries), plus decoys.
        stops = []
        for _ in range(rng.randint(1, 3)):
            start = rng.randrange(len(full))
            stops.append(full[start : start + rng.randint(1, 6)])
        stops.append(rng.choice(["zzz", "END###", "🙂🙂", "。。"]))
        detokenizer = IncrementalDetokenizer(
            any_tokenizer, prompt, stop=stops, include_stop_str_in_output=include_stop
        )
        deltas, stop, consumed = feed(detokenizer, output, rng)
        if stop is None:
            assert expected_stop(full, stops) is None
            assert "".join(deltas) == full
            continue
        matched += 1
        # The oracle: the full decode of the tokens fed until the match.
        seen = output_text(any_tokenizer, prompt, output[:consumed])
        start, expected = expected_stop(seen, stops)
        assert stop == expected
        end = start + len(stop) if include_stop else start
        assert "".join(deltas) == detokenizer.text == seen[:end]
    assert matched > 150


def test_text_is_held_back_only_while_it_may_begin_a_stop_string(byte_level):
    stops = ["###END###", "<|stop|>"]
    text = "Hello, world! Stop strings may span token boundaries, like ###END or <|stop"
    output = byte_level.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(byte_level, [], stop=stops)
    for n, token in enumerate(output, start=1):
        detokenizer.add_tokens([token])
        decoded = byte_level.decode(output[:n])
        held = max(
            (k for s in stops for k in range(1, len(s)) if decoded.endswith(s[:k])), default=0
        )
        assert detokenizer.text == decoded[: len(decoded) - held]
    assert detokenizer.flush().new_text == "<|stop"
    assert detokenizer.text == text


def test_a_stop_string_split_over_tokens_stops_at_the_token_that_completes_it(byte_level):
    prompt = byte_level.encode("The quick brown fox", add_special_tokens=False)
    output = byte_level.encode(" jumps over <|sto<|stop|> the lazy dog.", add_special_tokens=False)
    completes = next(n for n in range(len(output) + 1) if "<|stop|>" in byte_level.decode(output[:n]))
    assert "<|stop|>" not in byte_level.decode(output[completes - 3 : completes]), "spans > 3 tokens"
    detokenizer = IncrementalDetokenizer(byte_level, prompt, stop=["<|stop|>"])
    deltas = [detokenizer.add_tokens([token]) for token in output[:completes]]
    assert [d.stop_matched for d in deltas] == [None] * (completes - 1) + ["<|stop|>"]
    # The decoy "<|sto" is held back, then released once the next "<" rules it out.
    assert "".join(d.new_text for d in deltas) == detokenizer.text == " jumps over <|sto"


def test_output_completing_byte_runs_after_a_prompt_ending_in_byte_tokens():
    """The prompt's last tokens are byte-fallback pieces of an emoji begun earlier, and the output
    starts with more byte tokens: the first window must not start inside the emoji."""
    tokenizer = train_sentencepiece_style()
    # Characters absent from the training corpus can only be byte-fallback pieces, whichever
    # characters the trainer's limited alphabet kept.
    assert not any(c in "".join(CORPUS) for c in "🛸ꙮ🦉")
    ids = tokenizer.encode("Hello 🛸ꙮ🦉 ok", add_special_tokens=False)
    pieces = tokenizer.convert_ids_to_tokens(ids)
    split = pieces.index("<0xB8>") + 1  # after 🛸 (F0 9F 9B B8)
    assert pieces[split] == "<0xEA>" and len(pieces[:split]) > 5  # ꙮ (EA 99 AE) starts the output
    prompt, output = ids[:split], ids[split:]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detokenizer.add_tokens([token]).new_text for token in output]
    deltas.append(detokenizer.flush().new_text)
    assert "".join(deltas) == output_text(tokenizer, prompt, output) == "ꙮ🦉 ok"


def test_a_fast_tokenizer_decodes_through_tokenizers_itself_unless_its_class_decodes_otherwise(byte_level):
    # the tests above then hold for the raw path, against transformers' own decode as the oracle
    assert raw_decoder(byte_level) is not None

    class Shouting(type(byte_level)):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    shouting = Shouting(tokenizer_object=byte_level.backend_tokenizer)
    assert raw_decoder(shouting) is None
    ids = byte_level.encode("hello there", add_special_tokens=False)
    deltas, _, _ = feed(IncrementalDetokenizer(shouting, []), ids, random.Random(0))
    assert "".join(deltas) == shouting.decode(ids) == "HELLO THERE"
