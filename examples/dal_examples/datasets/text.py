"""An English text corpus every Python ships (``pydoc_data.topics``), a byte-level tokenizer and
[B, L] token blocks for language-model tests and benchmarks, with no download."""
from __future__ import annotations

#: the held-out share: the last topics (in sorted order) that together hold at least this share of characters
HELD_OUT_SHARE = 0.10


def topic_names() -> list[str]:
    """The names of ``pydoc_data.topics.topics``, sorted: the corpus order (79 topics in Python 3.11+)."""
    from pydoc_data.topics import topics

    return sorted(topics)


def _join(names) -> str:
    from pydoc_data.topics import topics

    return "".join(topics[n] for n in names)


def corpus() -> str:
    """All topics' texts concatenated in :func:`topic_names` order (about 465k characters)."""
    return _join(topic_names())


def held_out_topics() -> list[str]:
    """The fewest last topics of :func:`topic_names` whose texts hold at least ``HELD_OUT_SHARE``
    of the corpus' characters (``typesseq-mutable`` .. ``yield`` and a few before them)."""
    from pydoc_data.topics import topics

    names = topic_names()
    total, held, k = sum(len(topics[n]) for n in names), 0, len(names)
    while held < HELD_OUT_SHARE * total:
        k -= 1
        held += len(topics[names[k]])
    return names[k:]


def split() -> tuple[str, str]:
    """(train, held_out) texts: held_out is the :func:`held_out_topics` joined, train every other
    topic joined, both in :func:`topic_names` order; no topic is in both and
    ``train + held_out == corpus()``. The same on every run of the same Python."""
    held = held_out_topics()
    names = topic_names()
    return _join(names[: len(names) - len(held)]), _join(held)


class ByteTokenizer:
    """Byte-level tokenizer: ids are the UTF-8 bytes of the text (vocab 256, no special tokens).

    ``decode(encode(s)) == s`` for every ``str`` ``s`` (UTF-8 is lossless); ``decode`` of a byte
    sequence that is not valid UTF-8 (a block cut inside a character) substitutes U+FFFD.

    >>> ByteTokenizer().encode("é")
    [195, 169]
    """

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` as ints in [0, 256)."""
        if not isinstance(text, str):
            raise TypeError(f"ByteTokenizer.encode takes a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """The text whose UTF-8 bytes are ``ids`` (ints in [0, 256); a tensor or list)."""
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        bad = [i for i in ids if not 0 <= i < 256]
        if bad:
            raise ValueError(f"ByteTokenizer.decode: ids must lie in [0, 256), got {bad[:5]}")
        return bytes(ids).decode("utf-8", errors="replace")


def token_tensor(text: str, tokenizer=None):
    """``tokenizer.encode(text)`` (default :class:`ByteTokenizer`) as a 1-D int64 tensor."""
    import torch

    return torch.tensor((tokenizer or ByteTokenizer()).encode(text), dtype=torch.int64)


def blocks(ids, length: int):
    """Consecutive non-overlapping blocks of ``length`` tokens: ``[len(ids) // length, length]``
    (the last partial block is dropped); row ``r`` is ``ids[r * length:(r + 1) * length]``."""
    if length < 1 or len(ids) < length:
        raise ValueError(f"blocks: length must be in [1, {len(ids)}] (the number of tokens), got {length}")
    n = len(ids) // length
    return ids[: n * length].reshape(n, length)


def random_batches(ids, batch: int, length: int, steps: int, seed: int = 0):
    """Yield ``steps`` batches ``[batch, length]`` of windows of ``ids`` starting at offsets drawn
    uniformly from ``[0, len(ids) - length]`` by ``torch.Generator().manual_seed(seed)``: the same
    seed gives the same batches."""
    import torch

    if len(ids) < length:
        raise ValueError(f"random_batches: {len(ids)} tokens are fewer than one block of {length}")
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - length + 1, (batch,), generator=g)
        yield torch.stack([ids[s: s + length] for s in starts.tolist()])
