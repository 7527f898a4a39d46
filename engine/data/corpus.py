"""A prepared corpus on disk: token shards plus a manifest, written atomically, verified on open.

Owns: the format —

    DIR/manifest.json          format, version, tokenizer, dtype, documents, tokens, block_bytes,
                               shards [{file, tokens, sha256, crc32c: [per block]}], inputs summary
    DIR/tokens-00000.bin       raw little-endian uint16 (vocabulary <= 65536) or uint32

documents concatenated, each followed by the tokenizer's end-of-document id —
and reading it as one memory-mapped token stream. A corpus directory is
complete once it exists under its final name: it is written as
`DIR.tmp-<pid>/`, fsynced, then renamed. Version 2 adds a CRC32C per block
(engine.data.corpus_blocks), checked as training first reads each block in an
epoch; version 1 corpora (sha256 per shard, checked whole at open) still read.
No MindSpore here.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from checkpointing import checksums
from contracts.errors import CantCreateError, DataError
from durable import fsync_path
from engine.data.corpus_blocks import DEFAULT_BLOCK_BYTES, BlockVerifier, RunningBlocks, check_block_bytes

FORMAT = "llm-pretrain-corpus"
VERSION = 2
READS = (1, 2)
MANIFEST = "manifest.json"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(out: Path) -> None:
    """Deletes `out.tmp-<pid>` directories whose writer is gone (a crash mid-write)."""
    for tmp in out.parent.glob(f"{out.name}.tmp-*"):
        suffix = tmp.name.rsplit("-", 1)[-1]
        if not suffix.isdigit() or not _pid_alive(int(suffix)):
            shutil.rmtree(tmp, ignore_errors=True)


class CorpusWriter:
    """Streams documents' tokens into shards under a temporary name; `commit` makes the corpus visible."""

    def __init__(self, out: str | Path, *, tokenizer: dict[str, Any], shard_tokens: int, overwrite: bool = False,
                 block_bytes: int = DEFAULT_BLOCK_BYTES):
        self.block_bytes = check_block_bytes(block_bytes)
        self.out = Path(out)
        if self.out.exists() and not overwrite and any(self.out.iterdir() if self.out.is_dir() else [True]):
            raise DataError(f"output {str(self.out)!r} already exists; choose another directory or pass --overwrite")
        self.tmp = self.out.parent / f"{self.out.name}.tmp-{os.getpid()}"
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(self.out)
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp.mkdir()
        except OSError as e:
            raise CantCreateError(f"cannot create the corpus at {str(self.out)!r}: {e.strerror or e} "
                                  f"({e.filename or self.tmp}); choose a writable --output") from None
        self.tokenizer, self.shard_tokens, self.overwrite = tokenizer, shard_tokens, overwrite
        self.dtype = token_dtype(tokenizer["vocab_size"])
        self.shards: list[dict[str, Any]] = []
        self.documents = 0
        self.tokens = 0
        self._file = None
        self._digest = None
        self._blocks: RunningBlocks | None = None
        self._in_shard = 0

    def _open_shard(self) -> None:
        name = f"tokens-{len(self.shards):05d}.bin"
        self._file = open(self.tmp / name, "wb")
        self._digest = hashlib.sha256()
        self._blocks = RunningBlocks(self.block_bytes)
        self._in_shard = 0
        self.shards.append({"file": name, "tokens": 0, "sha256": "", "crc32c": []})

    def _close_shard(self) -> None:
        if self._file is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.shards[-1].update(tokens=self._in_shard, sha256=self._digest.hexdigest(), crc32c=self._blocks.finish())
        self._file = None

    def add_document(self, tokens: np.ndarray) -> None:
        """tokens: one document's ids, its end-of-document id already appended."""
        data = np.asarray(tokens).astype(self.dtype, copy=False)
        self.documents += 1
        while data.size:
            if self._file is None or self._in_shard == self.shard_tokens:
                self._close_shard()
                self._open_shard()
            part = data[: self.shard_tokens - self._in_shard]
            blob = part.tobytes()
            self._file.write(blob)
            self._digest.update(blob)
            self._blocks.update(blob)
            self._in_shard += part.size
            self.tokens += part.size
            data = data[part.size:]

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def commit(self, inputs: dict[str, Any], *, validation: dict[str, Any] | None = None) -> Path:
        """Writes and fsyncs the manifest, then renames the directory into place. `validation`: the held-out
        split already committed inside this corpus's directory (its path relative to it, and counts)."""
        self._close_shard()
        if self.tokens == 0:
            self.abort()
            raise DataError("the inputs hold no text: nothing to write")
        manifest = {"format": FORMAT, "version": VERSION, "tokenizer": self.tokenizer, "dtype": self.dtype.name,
                    "documents": self.documents, "tokens": self.tokens, "block_bytes": self.block_bytes,
                    "shards": self.shards, "inputs": inputs, **({"validation": validation} if validation else {})}
        path = self.tmp / MANIFEST
        path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        fsync_path(path)
        fsync_path(self.tmp)
        old = None
        if self.overwrite and self.out.exists():
            old = self.out.parent / f"{self.out.name}.old-{os.getpid()}"
            os.rename(self.out, old)
        try:
            os.rename(self.tmp, self.out)   # refuses a non-empty target: never replaces another's corpus
        except OSError:
            self.abort()
            raise DataError(f"output {str(self.out)!r} appeared while preparing; left it as it is") from None
        fsync_path(self.out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.out


class Corpus:
    """A committed corpus as one read-only token stream (memory-mapped shards)."""

    def __init__(self, path: str | Path, *, verify_checksums: bool = True):
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            raise DataError(f"{str(self.path)!r} is not a prepared corpus: {MANIFEST} is missing "
                            "(run `llm-pretrain prepare-data`)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{str(manifest_path)!r} is not valid JSON: {e}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise DataError(f"{str(manifest_path)!r} is not an llm-pretrain corpus manifest")
        if manifest.get("version") not in READS:
            raise DataError(f"{str(manifest_path)!r} has format version {manifest.get('version')!r}; "
                            f"this build reads versions {', '.join(map(str, READS))}")
        self.manifest = manifest
        self.dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
        self.tokenizer = manifest["tokenizer"]
        self._maps: list[np.ndarray] = []
        offsets = [0]
        for shard in manifest["shards"]:
            file = self.path / shard["file"]
            expected = shard["tokens"] * self.dtype.itemsize
            try:
                size = file.stat().st_size
            except FileNotFoundError:
                raise DataError(f"shard {str(file)!r} is missing") from None
            if size != expected:
                raise DataError(f"shard {str(file)!r} is {size} bytes but the manifest says {expected} "
                                "(truncated or altered); prepare the corpus again")
            blocks = "crc32c" in shard
            if verify_checksums and not blocks and checksums.file_digest(file, checksums.SHA256) != shard["sha256"]:
                raise DataError(f"shard {str(file)!r} fails its sha256 check (altered or corrupt); "
                                "prepare the corpus again")
            self._maps.append(np.memmap(file, dtype=self.dtype, mode="r", shape=(shard["tokens"],)))
            offsets.append(offsets[-1] + shard["tokens"])
        self._offsets = np.asarray(offsets, dtype=np.int64)
        self.num_tokens = int(offsets[-1])
        # version 2: blocks are checked as they are first read each epoch (CorpusSource calls verify)
        self.verifier: BlockVerifier | None = None
        if manifest.get("block_bytes"):
            self.verifier = BlockVerifier(str(self.path), [s["file"] for s in manifest["shards"]], self._maps,
                                          self._offsets, [s["crc32c"] for s in manifest["shards"]],
                                          int(manifest["block_bytes"]), self.dtype.itemsize)
        self.verify_blocks = verify_checksums and self.verifier is not None

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer["vocab_size"])

    @property
    def validation_path(self) -> Path | None:
        """The held-out split prepare-data set aside in this corpus (--validation-fraction), if any."""
        split = self.manifest.get("validation")
        return self.path / split["path"] if isinstance(split, dict) and split.get("path") else None

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the whole stream, across shard boundaries."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens})")
        first = int(np.searchsorted(self._offsets, start, side="right")) - 1
        parts = []
        while start < stop:
            base = int(self._offsets[first])
            end = min(stop, int(self._offsets[first + 1]))
            parts.append(self._maps[first][start - base:end - base])
            start, first = end, first + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def iter_documents(corpus: Corpus) -> Iterator[np.ndarray]:
    """The corpus's documents in order, split at the end-of-document id (for tests and inspection)."""
    eos = corpus.tokenizer["eos_id"]
    stream = corpus.tokens(0, corpus.num_tokens)
    ends = np.flatnonzero(stream == eos)
    start = 0
    for end in ends:
        yield stream[start:end]
        start = end + 1

