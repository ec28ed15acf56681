"""A byte-level tokenizer of any vocabulary size, for benchmarking structured outputs on
models built with random weights (no tokenizer ships with them, and none may be
downloaded): the 256 byte tokens, an end-of-text token, and seeded random strings of 2-8
printable characters, the lengths a real BPE vocabulary's tokens have. The grammar's
mask is computed over these tokens as over a real vocabulary of that size."""

from __future__ import annotations

import random
from pathlib import Path

EOS = "<|end_of_text|>"
PRINTABLE = [chr(c) for c in range(32, 127)]


def save_synthetic_tokenizer(path: Path, vocab_size: int, seed: int = 0):
    """A PreTrainedTokenizerFast of exactly vocab_size tokens saved to path; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    spell = _byte_level_map()  # printable ASCII in byte-level spelling (a space is 'Ġ')
    vocab = {spell[b]: b for b in range(256)}
    rng = random.Random(seed)
    while len(vocab) < vocab_size - 1:
        word = "".join(spell[ord(rng.choice(PRINTABLE))] for _ in range(rng.randint(2, 8)))
        vocab.setdefault(word, len(vocab))
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.save_pretrained(path)
    return fast


def _byte_level_map() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what ByteLevel spells bytes as)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}
