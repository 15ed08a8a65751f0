"""spaces_between_special_tokens and skip_special_tokens in the incremental detokenizer, on a WordPiece
tokenizer built here (its decoder puts a space before every token, special ones included, so the option
shows): on, the text is the tokenizer's own decode; off, an added token right after another one is its
bare content, as vLLM does for fast tokenizers."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.text.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def wordpiece():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5, "again": 6}
    tk = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.WordPiece()
    tk.add_special_tokens(["[CLS]", "[SEP]"])
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]")


@pytest.mark.parametrize("ids, bare", [
    ([3, 2, 2, 4, 5], "hello [SEP][SEP] worlds"),
    ([2, 1, 2, 6], "[SEP][CLS][SEP] again"),
    ([3, 4, 2, 6, 1], "hello world [SEP] again [CLS]"),
])
def test_spaces_between_special_tokens(wordpiece, ids, bare):
    def run(skip: bool, spaces: bool, one_by_one: bool) -> str:
        d = IncrementalDetokenizer(wordpiece, [3], skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        for chunk in ([[t] for t in ids] if one_by_one else [ids]):
            d.add(chunk)
        d.finish()
        return d.text.lstrip()

    for one_by_one in (True, False):
        assert run(False, True, one_by_one) == wordpiece.decode(ids, skip_special_tokens=False).lstrip()
        assert run(False, False, one_by_one) == bare
        assert run(True, False, one_by_one) == run(True, True, one_by_one) == wordpiece.decode(
            ids, skip_special_tokens=True).lstrip()
    consecutive = any(a in (1, 2) and b in (1, 2) for a, b in zip(ids, ids[1:]))
    assert (run(False, True, True) != bare) == consecutive  # the option changes only consecutive special tokens


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer
    from testbed.worker.smollm2 import default_model_dir
    return AutoTokenizer.from_pretrained(str(default_model_dir()))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_rust_decoder_streams_what_transformers_decode_streams(smollm2_tokenizer, data):
    """The detokenizer calls a fast tokenizer's Rust decoder directly; token by token or in chunks, special
    tokens skipped or kept, its stream and text equal those made through transformers' decode."""
    tok = smollm2_tokenizer
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), min_size=1, max_size=24))
    prompt = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), min_size=1, max_size=8))
    skip = data.draw(st.booleans())
    chunk = data.draw(st.integers(1, 5))

    def run(rust: bool) -> tuple[list[str], str]:
        d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        assert d.backend is not None
        if not rust:
            d.backend = None
        deltas = []
        for i in range(0, len(ids), chunk):
            d.add(ids[i:i + chunk])
            deltas.append(d.delta(False))
        d.finish()
        deltas.append(d.delta(True))
        assert "".join(deltas) == d.text
        return deltas, d.text

    assert run(True) == run(False)
