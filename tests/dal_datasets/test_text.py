"""dal_examples.datasets.text: the pydoc_data.topics corpus, its fixed split, the byte tokenizer, token blocks."""
import pytest
import torch
from pydoc_data.topics import topics

from dal_examples.datasets import text


def test_corpus_is_every_topic_once_in_sorted_order():
    names = sorted(topics)
    assert text.topic_names() == names
    assert text.corpus() == "".join(topics[n] for n in names)
    assert len(text.corpus()) > 400_000  # ~465k characters of English in Python 3.11+


def test_split_is_disjoint_by_topic_and_covers_the_corpus():
    train, held = text.split()
    names = sorted(topics)
    held_names = text.held_out_topics()
    k = len(names) - len(held_names)
    assert held_names == names[k:] and held == "".join(topics[n] for n in held_names)
    total = len(text.corpus())
    assert len(held) >= 0.1 * total > len(held) - len(topics[names[k]])  # the fewest last topics
    assert train == "".join(topics[n] for n in names if n not in held_names)
    assert len(train) + len(held) == len(text.corpus())
    assert train + held == text.corpus()


def test_byte_tokenizer_round_trips_and_matches_utf8():
    tok = text.ByteTokenizer()
    s = text.corpus()[:20_000] + "é … ∑ 😀"
    ids = tok.encode(s)
    assert ids == list(s.encode("utf-8")) and max(ids) < tok.vocab_size == 256
    assert tok.decode(ids) == s
    assert tok.decode(torch.tensor(ids)) == s
    with pytest.raises(ValueError, match="256"):
        tok.decode([1, 300])
    with pytest.raises(TypeError, match="str"):
        tok.encode(b"bytes")


def test_blocks_and_random_batches():
    ids = text.token_tensor("abcdefghij")
    b = text.blocks(ids, 3)
    assert b.shape == (3, 3) and b[1].tolist() == list(b"def")
    with pytest.raises(ValueError, match="length"):
        text.blocks(ids, 11)
    train, _ = text.split()
    ids = text.token_tensor(train[:5000])
    one = list(text.random_batches(ids, 4, 16, steps=3, seed=1))
    two = list(text.random_batches(ids, 4, 16, steps=3, seed=1))
    assert len(one) == 3 and all(x.shape == (4, 16) for x in one)
    assert all(torch.equal(x, y) for x, y in zip(one, two))
    row = one[0][0]  # a window of the token stream
    starts = [i for i in range(len(ids) - 15) if torch.equal(ids[i:i + 16], row)]
    assert starts
