"""Tokenizers for corpus preparation: byte-level (the default, nothing to download) and Hugging Face.

Owns: turning document text into token ids with an end-of-document id
appended, and a description of the tokenizer that the corpus manifest
records (kind, vocabulary size, end-of-document id, sha256 of the file).
No MindSpore here.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from engine.config import DataError

# Names under which tokenizer.json files commonly define their end-of-text token.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")


class TokenizerError(DataError):
    """A tokenizer that cannot be used; the message names the file and what is wrong."""


class ByteTokenizer:
    """UTF-8 bytes 0..255, plus <|endoftext|> = 256 between documents."""

    kind = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "eos_id": self.eos_id}


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, through the `tokenizers` library."""

    kind = "hf"

    def __init__(self, path: str | Path, eos_token: str | None = None):
        import tokenizers

        self.path = Path(path)
        if self.path.is_dir():
            self.path = self.path / "tokenizer.json"
        try:
            raw = self.path.read_bytes()
            self._tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except FileNotFoundError:
            raise TokenizerError(f"tokenizer file {str(self.path)!r} does not exist") from None
        except Exception as e:  # the tokenizers library raises its own untyped exceptions
            raise TokenizerError(f"tokenizer file {str(self.path)!r} is not a valid tokenizer.json: {e}") from None
        self.sha256 = hashlib.sha256(raw).hexdigest()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        names = (eos_token,) if eos_token else EOS_CANDIDATES
        ids = [self._tok.token_to_id(n) for n in names]
        found = [(n, i) for n, i in zip(names, ids) if i is not None]
        if not found:
            raise TokenizerError(f"tokenizer {str(self.path)!r} defines none of {', '.join(names)} as an "
                                 "end-of-document token; name one with --eos-token")
        self.eos_token, self.eos_id = found[0]

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "eos_token": self.eos_token, "file": self.path.name, "sha256": self.sha256}


def load_tokenizer(spec: str, eos_token: str | None = None) -> ByteTokenizer | HFTokenizer:
    """`byte`, or a path to a tokenizer.json (or a directory holding one)."""
    if spec == "byte":
        if eos_token:
            raise TokenizerError("--eos-token applies to a tokenizer.json; the byte tokenizer's is <|endoftext|>")
        return ByteTokenizer()
    return HFTokenizer(spec, eos_token)
