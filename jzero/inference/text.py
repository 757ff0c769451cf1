"""Text in and out of a model: its tokenizer. A byte-level model (vocab 256, the bundled
corpus's) reads and writes UTF-8 (`Bytes`); a Hugging Face directory's ``tokenizer.json`` goes
through the ``tokenizers`` library (`HF`: ids exactly as ``Tokenizer.encode(text).ids`` gives
them, the tokenizer's post-processor deciding BOS/EOS; its chat template rendered as
transformers renders it); any other model speaks token ids (`Ids`). `jzero generate`, `serve`,
`eval` and the training data share them (`for_model`).
"""
from __future__ import annotations

import codecs
import hashlib
import json
from pathlib import Path
from typing import Any

from jzero.config import ConfigError

BYTE_VOCAB = 256


class Ids:
    """A model without a tokenizer: prompts are token ids, outputs space-separated ids."""

    text = False
    eos: tuple[int, ...] = ()

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, special: bool = True) -> list[int]:
        """``text`` as ids; ``special``: with the special tokens the tokenizer adds (BOS)."""
        raise ValueError(f"text needs a tokenizer: this model has vocab {self.vocab_size} and no tokenizer.json "
                         f"(byte-level models have vocab {BYTE_VOCAB}): send token ids")

    def decode(self, tokens: list[int]) -> str:
        return self.detokenizer().of(tokens)

    def detokenizer(self) -> Any:
        return _Pieces(lambda token: f"{token} ")

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        raise ValueError("chat needs a tokenizer with a chat template (a Hugging Face model directory)")

    def fingerprint(self) -> str:
        """What decides the tokens this tokenizer gives (a token cache is keyed by it)."""
        return f"{type(self).__name__}:{self.vocab_size}"


class Bytes(Ids):
    """UTF-8 bytes, one a token (a character split over tokens comes out whole, with its last byte)."""

    text = True

    def __init__(self):
        super().__init__(BYTE_VOCAB)

    def encode(self, text: str, special: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenizer(self) -> Any:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return _Pieces(lambda token: decoder.decode(bytes([token])), lambda: decoder.decode(b"", final=True))


class _Pieces:
    """Tokens as text, one at a time: ``piece(token)``, then ``flush()`` at the end."""

    def __init__(self, piece: Any, flush: Any = lambda: ""):
        self.piece, self.flush = piece, flush

    def of(self, tokens: list[int]) -> str:
        """All of ``tokens`` at once (the detokenizer is spent)."""
        return "".join(map(self.piece, tokens)) + self.flush()


class HF(Ids):
    """A Hugging Face directory's tokenizer (``tokenizer.json``), its special tokens
    (``tokenizer_config.json``), EOS ids (``generation_config.json`` and ``config.json``) and
    chat template (``chat_template.jinja`` or ``tokenizer_config.json``)."""

    text = True

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer

        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"jzero.model.hf: {path} not found (text in and out needs the model's tokenizer)")
        self.tokenizer = Tokenizer.from_file(str(path))
        super().__init__(self.tokenizer.get_vocab_size(with_added_tokens=True))
        settings = _json(directory / "tokenizer_config.json")
        self.special = {k: _token_text(settings.get(k)) for k in ("bos_token", "eos_token")}
        template = directory / "chat_template.jinja"
        self.template = template.read_text() if template.is_file() else settings.get("chat_template")
        ids = set()
        for source in (_json(directory / "generation_config.json"), _json(directory / "config.json")):
            found = source.get("eos_token_id")
            ids.update(found if isinstance(found, list) else [] if found is None else [found])
        if self.special["eos_token"] is not None and self.tokenizer.token_to_id(self.special["eos_token"]) is not None:
            ids.add(self.tokenizer.token_to_id(self.special["eos_token"]))
        self.eos = tuple(sorted(ids))

    def encode(self, text: str, special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def fingerprint(self) -> str:
        return hashlib.sha256("\0".join([self.tokenizer.to_str(), self.template or "", repr(self.eos),
                                          repr(self.special)]).encode()).hexdigest()

    def encode_offsets(self, text: str, special: bool = True) -> tuple[list[int], list[tuple[int, int]]]:
        """``text`` as ids with each token's (start, end) characters in it."""
        encoding = self.tokenizer.encode(text, add_special_tokens=special)
        return encoding.ids, encoding.offsets

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def detokenizer(self) -> Any:
        """Incremental: the text of all tokens so far, less what was already given out; held
        back while it ends in an unfinished character."""
        seen: list[int] = []
        given = [""]

        def piece(token: int) -> str:
            seen.append(token)
            full = self.decode(seen)
            if full.endswith("\ufffd"):
                return ""
            new, given[0] = full[len(given[0]):], full
            return new

        return _Pieces(piece, lambda: self.decode(seen)[len(given[0]):])

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """``messages`` rendered with the chat template, in a sandboxed Jinja environment set up
        as transformers sets it up (``trim_blocks``, ``lstrip_blocks``, ``raise_exception``)."""
        if not self.template:
            raise ValueError("this tokenizer has no chat template (chat_template.jinja or tokenizer_config.json)")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                     **{k: v or "" for k, v in self.special.items()})


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


def for_model(vocab_size: int, hf: str | None = None) -> Ids:
    """The tokenizer of a model: its HF directory's, bytes at vocab 256, else ids."""
    if hf is not None:
        return HF(hf)
    return Bytes() if vocab_size == BYTE_VOCAB else Ids(vocab_size)
