"""Tokenizers for corpus preparation: byte-level (the default, nothing to download) and Hugging Face.

Owns: turning document text into token ids with an end-of-document id
appended, and a description of the tokenizer that the corpus manifest
records (kind, vocabulary size, end-of-document id, the file's path and
sha256), and the files an `export --format hf` ships so that transformers'
AutoTokenizer loads the same tokenizer (the byte-level one as a tokenizer.json).
No MindSpore here.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from contracts.errors import DataError

# Names under which tokenizer.json files commonly define their end-of-text token.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")
BYTE_EOS_TOKEN = "<|endoftext|>"


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

    def to_tokenizers(self):
        """This tokenizer as a `tokenizers.Tokenizer` (what `.to_str()` writes is a tokenizer.json): the
        byte-level pre-tokenizer maps each UTF-8 byte to one character of GPT-2's byte alphabet, a
        BPE model without merges gives that character the byte's value as its id, and <|endoftext|>
        is the special token 256. encode(text) == list(text.encode("utf-8")); decoding inverts it."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        chars = _byte_chars()
        tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(BYTE_EOS_TOKEN, special=True, normalized=False)])
        assert tok.token_to_id(BYTE_EOS_TOKEN) == self.eos_id
        return tok


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-character table (the one `tokenizers`' ByteLevel pre-tokenizer uses): printable
    Latin-1 bytes stand for themselves, the others for U+0100 onwards, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def hf_tokenizer_files(tokenizer_json: str, eos_token: str, *, model_max_length: int) -> dict[str, str]:
    """The files transformers' `AutoTokenizer.from_pretrained(DIR)` loads as a PreTrainedTokenizerFast,
    by name: the tokenizer.json as given, its tokenizer_config.json and special_tokens_map.json."""
    import json

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token,
              "model_max_length": model_max_length, "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": tokenizer_json,
            "tokenizer_config.json": json.dumps(config, indent=2, sort_keys=True) + "\n",
            "special_tokens_map.json": json.dumps({"eos_token": eos_token}, indent=2) + "\n"}


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
        except FileNotFoundError:
            raise TokenizerError(f"tokenizer file {str(self.path)!r} does not exist; give `byte` or a Hugging Face "
                                 "tokenizer.json (or a directory holding one)") from None
        except OSError as e:
            raise TokenizerError(f"tokenizer file {str(self.path)!r} cannot be read: {e.strerror or e}") from None
        _check_tokenizer_json(self.path, raw)
        try:
            self._tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
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
        # path: where `llm-pretrain export` finds the file again (it checks the sha256)
        return {"kind": self.kind, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "eos_token": self.eos_token, "file": self.path.name, "path": str(self.path.resolve()),
                "sha256": self.sha256}


def _check_tokenizer_json(path: Path, raw: bytes) -> None:
    """What is wrong with a file that is not a tokenizer.json, said before the tokenizers library says
    it in its own words (for JSON of another shape: "expected `,` or `}`")."""
    where = f"tokenizer file {str(path)!r}"
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise TokenizerError(f"{where} is not UTF-8 text; expected a Hugging Face tokenizer.json") from None
    except ValueError as e:
        raise TokenizerError(f"{where} is not JSON ({e}); expected a Hugging Face tokenizer.json") from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        found = (f"an object with keys {', '.join(sorted(data)[:8])}" if isinstance(data, dict) and data
                 else "an empty object" if isinstance(data, dict) else f"a JSON {type(data).__name__}")
        raise TokenizerError(f"{where} is JSON but not a Hugging Face tokenizer.json (it is {found}; a "
                             "tokenizer.json is an object with a \"model\" section, as tokenizer.save() writes it)")


def load_tokenizer(spec: str, eos_token: str | None = None) -> ByteTokenizer | HFTokenizer:
    """`byte`, or a path to a tokenizer.json (or a directory holding one)."""
    if spec == "byte":
        if eos_token:
            raise TokenizerError("--eos-token applies to a tokenizer.json; the byte tokenizer's is <|endoftext|>")
        return ByteTokenizer()
    return HFTokenizer(spec, eos_token)
