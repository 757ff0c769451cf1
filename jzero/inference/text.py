"""Text in and out of the engine: a byte-level model (vocab 256, the bundled corpus's) reads and
writes UTF-8; any other speaks token ids. `jzero generate` and `jzero serve` share it."""
from __future__ import annotations

import codecs

BYTE_VOCAB = 256


def encode(text: str, vocab_size: int) -> list[int]:
    """``text`` as token ids; ValueError unless the model is byte-level."""
    if vocab_size != BYTE_VOCAB:
        raise ValueError(f"text needs a byte-level model (vocab {BYTE_VOCAB}); this one has vocab {vocab_size}: "
                         "send token ids")
    return list(text.encode("utf-8"))


class Detokenizer:
    """Tokens as text, one at a time: UTF-8 bytes for a byte-level model (a character split over
    tokens comes out whole, with its last byte), space-separated ids otherwise."""

    def __init__(self, vocab_size: int):
        self.bytes = vocab_size == BYTE_VOCAB
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def piece(self, token: int) -> str:
        return self.decoder.decode(bytes([token])) if self.bytes else f"{token} "

    def flush(self) -> str:
        """What an unfinished character left behind (a replacement character), at the end."""
        return self.decoder.decode(b"", final=True) if self.bytes else ""

    def of(self, tokens: list[int]) -> str:
        """All of ``tokens`` at once (the detokenizer is spent)."""
        return "".join(map(self.piece, tokens)) + self.flush()
