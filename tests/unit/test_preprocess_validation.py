"""The preprocessing model's input checks: invalid UTF-8 in word lists, word-list
caps, over-long prompts refused before they are tokenized, and the token-count bound that
makes that refusal sound."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from triton_disagg.engine.token_bound import max_token_bytes
from triton_disagg.engine.sampling import MAX_LIST_TOKENS, MAX_WORD_TOKENS, MAX_WORDS
from triton_disagg.front.tokenizer import Preprocessor
from triton_disagg.errors import RequestError


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from triton_disagg.builders.demo import write_demo_tokenizer

    path = tmp_path_factory.mktemp("tok")
    write_demo_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(demo_dir):
    from triton_disagg.front.tokenizer import Tokenizer

    return Tokenizer(demo_dir)


class CountingTokenizer:
    """The demo tokenizer, recording the length of every text it is asked to encode."""

    def __init__(self, inner):
        self.inner, self.encoded = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text, add_special_tokens=True):
        self.encoded.append(len(text))
        return self.inner.encode(text, add_special_tokens)

    def encode_word(self, text):
        self.encoded.append(len(text))
        return self.inner.encode_word(text)


def request(text=b"hello", max_tokens=5, **extra):
    return {"text_input": np.array([text], object), "max_tokens": np.array([max_tokens]),
            **{k: np.array(v, object) for k, v in extra.items()}}


def test_words_are_tokenized_alone_so_mid_sentence_words_need_their_space(tokenizer):
    """What clients/cli.py's --stop-words help and docs/architecture.md promise."""
    sentence = tokenizer.encode("I am so happy")
    assert tokenizer.encode_word("happy") != tokenizer.encode_word(" happy")
    assert sentence[-1:] == tokenizer.encode_word(" happy")
    assert sentence[-1:] != tokenizer.encode_word("happy")


@pytest.mark.parametrize("name", ["stop_words", "bad_words"])
def test_invalid_utf8_in_a_word_list_is_a_request_error_naming_the_tensor(tokenizer, name):
    pre = Preprocessor(tokenizer, max_seq_len=64, eos_id=1, pad_id=None, seal_key=b"k")
    with pytest.raises(RequestError, match=rf"{name}\[1\] is not valid UTF-8"):
        pre.process(request(**{name: [b"fine", b"\xff\xfe"]}))


@pytest.mark.parametrize("name", ["stop_words", "bad_words"])
def test_word_lists_over_the_caps_are_refused(tokenizer, name):
    pre = Preprocessor(tokenizer, max_seq_len=64, eos_id=1, pad_id=None, seal_key=b"k")
    one_token = b" happy"
    assert len(tokenizer.encode_word(one_token.decode())) == 1
    pre.process(request(**{name: [one_token] * MAX_WORDS}))             # at the cap: fine
    with pytest.raises(RequestError, match=rf"{name}: {MAX_WORDS + 1} words, at most"):
        pre.process(request(**{name: [one_token] * (MAX_WORDS + 1)}))
    with pytest.raises(RequestError, match=rf"{name}\[0\]: {MAX_WORD_TOKENS + 1} tokens"):
        pre.process(request(**{name: [one_token * (MAX_WORD_TOKENS + 1)]}))
    count = MAX_LIST_TOKENS // MAX_WORD_TOKENS + 1                     # each word fits, all don't
    with pytest.raises(RequestError, match=rf"{name}: {count * MAX_WORD_TOKENS} tokens in all"):
        pre.process(request(**{name: [one_token * MAX_WORD_TOKENS] * count}))


def test_a_huge_word_is_refused_without_being_tokenized(tokenizer):
    counting = CountingTokenizer(tokenizer)
    pre = Preprocessor(counting, max_seq_len=64, eos_id=1, pad_id=None, seal_key=b"k")
    with pytest.raises(RequestError, match=r"stop_words\[0\]: more than 64 tokens"):
        pre.process(request(stop_words=[b"x" * 1_000_000]))
    assert max(counting.encoded) < 1000


def test_a_huge_prompt_is_refused_before_it_is_tokenized(tokenizer):
    counting = CountingTokenizer(tokenizer)
    pre = Preprocessor(counting, max_seq_len=64, eos_id=1, pad_id=None, seal_key=b"k")
    with pytest.raises(RequestError, match="max_seq_len 64"):
        pre.process(request(b"word " * 1_000_000))
    assert counting.encoded == []
    with pytest.raises(RequestError, match="max_tokens"):           # no room left for a prompt
        pre.process(request(max_tokens=64))
    assert counting.encoded == []
    pre.process(request(b"word " * 20, max_tokens=5))                  # fits: encoded once
    assert counting.encoded == [100]


def test_the_length_bound_never_refuses_a_text_that_fits(tokenizer):
    """``surely_more_tokens(text, n)`` implies ``len(encode(text)) > n``, on the texts that
    pack the most bytes per token: the longest vocabulary entries and special tokens."""
    vocab = tokenizer._tok.get_vocab(with_added_tokens=True)
    longest = sorted(vocab, key=lambda t: len(t.encode()))[-40:]
    pieces = [tokenizer.decode([vocab[t]], skip_special_tokens=False) for t in longest]
    pieces += ["<|begin_of_text|>", " happy", "日本語", "🎉", " ", "\n"]
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 60)))
        count = len(tokenizer.encode(text))
        for n in (0, 1, count // 2, count - 1, count, count + 1):
            if tokenizer.surely_more_tokens(text, n):
                assert count > n, (text, n)
    assert tokenizer.surely_more_tokens("a" * (64 * tokenizer.max_token_bytes + 1), 64)


def test_the_bound_holds_only_for_tokenizers_that_keep_every_byte(demo_dir):
    config = json.loads((demo_dir / "tokenizer.json").read_text())
    assert max_token_bytes(config) >= len("<|begin_of_text|>")
    metaspace = {"normalizer": {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"}, {"type": "Replace"}]},
        "pre_tokenizer": None, "model": {**config["model"], "unk_token": "<unk>",
                                         "byte_fallback": True}}
    assert max_token_bytes({**config, **metaspace}) is not None
    unbounded = [
        {"model": {**config["model"], "unk_token": "<unk>"}},          # unk for any run
        {"model": {**config["model"], "type": "WordPiece"}},
        {"pre_tokenizer": {"type": "Whitespace"}},                       # drops spaces
        {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "behavior": "Removed"}, {"type": "ByteLevel"}]}},
        {"normalizer": {"type": "Strip"}},
        {"added_tokens": [{"content": "<mask>", "lstrip": True}]},       # swallows spaces
    ]
    for change in unbounded:
        assert max_token_bytes({**config, **change}) is None, change


class UnboundedTokenizer(CountingTokenizer):
    """A tokenizer whose token count no text length bounds (``surely_more_tokens`` never
    decides): a huge text must be refused by its length alone."""

    def surely_more_tokens(self, text, n):
        return False


def test_a_text_over_the_byte_limit_is_refused_whatever_the_tokenizer(tokenizer):
    from triton_disagg.front.tokenizer import MAX_TEXT_BYTES

    unbounded = UnboundedTokenizer(tokenizer)
    pre = Preprocessor(unbounded, max_seq_len=64, eos_id=1, pad_id=None, seal_key=b"k")
    with pytest.raises(RequestError, match=f"text_input is {MAX_TEXT_BYTES + 1} bytes"):
        pre.process(request(b"x" * (MAX_TEXT_BYTES + 1)))
    with pytest.raises(RequestError, match=rf"stop_words\[0\] is {MAX_TEXT_BYTES + 1} bytes"):
        pre.process(request(stop_words=[b"x" * (MAX_TEXT_BYTES + 1)]))
    assert max(unbounded.encoded, default=0) < 1000          # only the prompt "hello"
