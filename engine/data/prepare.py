"""`llm-pretrain prepare-data`: raw text files to a tokenized corpus (engine.data.corpus format).

Owns: finding inputs (files, directories, globs, and `@stdlib`: this Python's
own standard library sources, the embedded default corpus), reading them into
documents (.jsonl: one document per line's text field; any other file: one
document), tokenizing in parallel processes in a fixed order, and reporting
progress. The same inputs give byte-identical output. No MindSpore here.
"""
from __future__ import annotations

import glob
import hashlib
import json
import multiprocessing
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Iterable, Sequence, TextIO

import numpy as np

from contracts.errors import DataError
from engine.data.corpus import VERSION, CorpusWriter
from engine.data.corpus_blocks import DEFAULT_BLOCK_BYTES, check_block_bytes
from engine.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

STDLIB = "@stdlib"
TEXT_SUFFIXES = frozenset({
    ".txt", ".md", ".rst", ".jsonl", ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".java",
    ".js", ".ts", ".sh", ".toml", ".yaml", ".yml", ".json", ".html", ".css", ".tex", ".cfg", ".ini",
})
_SKIP_DIRS = frozenset({"__pycache__", ".git", ".hg", ".svn", "node_modules"})
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})


def stdlib_files() -> list[Path]:
    """This interpreter's standard-library .py files (no tests, no site-packages), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if not any(part in _STDLIB_SKIP for part in p.relative_to(root).parts[:-1]))


def _walk(directory: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        out += [Path(dirpath) / f for f in sorted(filenames)
                if not f.startswith(".") and Path(f).suffix.lower() in TEXT_SUFFIXES]
    return out


def find_inputs(specs: Sequence[str]) -> list[Path]:
    """Files named by the specs, each once, in the order given (directories and globs sorted)."""
    if not specs:
        raise DataError("no --input given; name files, directories, globs or @stdlib")
    found: list[Path] = []
    for spec in specs:
        if spec == STDLIB:
            found += stdlib_files()
        elif glob.has_magic(spec):
            matches = sorted(Path(m) for m in glob.glob(spec, recursive=True))
            files = [f for m in matches for f in (_walk(m) if m.is_dir() else [m])]
            if not files:
                raise DataError(f"input glob {spec!r} matches no files")
            found += files
        else:
            path = Path(spec)
            if path.is_dir():
                files = _walk(path)
                if not files:
                    raise DataError(f"input directory {spec!r} holds no text files "
                                    f"({', '.join(sorted(TEXT_SUFFIXES))})")
                found += files
            elif path.is_file():
                found.append(path)
            else:
                raise DataError(_not_an_input(spec, path))
    seen: set[Path] = set()
    unique = []
    for f in found:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


def _not_an_input(spec: str, path: Path) -> str:
    """Why a path that is neither a file nor a directory cannot be read as text."""
    allowed = "name text files, directories, globs or @stdlib"
    if path.is_symlink() and not path.exists():
        return f"input {spec!r} is a broken symbolic link (to {os.readlink(path)!r}); {allowed}"
    if not path.exists():
        return f"input {spec!r} does not exist; {allowed}"
    kind = ("a character device" if path.is_char_device() else "a block device" if path.is_block_device()
            else "a pipe" if path.is_fifo() else "a socket" if path.is_socket() else "not a regular file")
    return f"input {spec!r} is {kind}, not a text file or a directory; {allowed}"


# Work done in the tokenizer processes ----------------------------------------
_TOKENIZER: ByteTokenizer | HFTokenizer | None = None


def _init_worker(spec: str, eos_token: str | None) -> None:
    global _TOKENIZER
    _TOKENIZER = load_tokenizer(spec, eos_token)


def _documents(path: Path, text_field: str, stats: dict[str, Any]) -> Iterable[str]:
    raw = path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    # U+FFFD already present in valid input is not a replacement; only the excess is.
    stats["replaced"] += text.count("\ufffd") - raw.count("\ufffd".encode())
    if path.suffix.lower() != ".jsonl":
        yield text
        return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            value = record[text_field]
            if not isinstance(value, str):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            stats["bad_lines"] += 1
            stats.setdefault("first_bad_line", number)
            continue
        yield value


def _tokenize_file(job: tuple[str, str]) -> tuple[str, list[np.ndarray], dict[str, Any]]:
    path, text_field = job
    stats: dict[str, Any] = {"replaced": 0, "bad_lines": 0, "bytes": 0}
    docs = []
    try:
        stats["bytes"] = os.path.getsize(path)
        for text in _documents(Path(path), text_field, stats):
            if text:
                ids = _TOKENIZER.encode(text)
                docs.append(np.append(ids, np.uint32(_TOKENIZER.eos_id)))
    except OSError as e:
        stats["error"] = f"{e.strerror or e}"
    return path, docs, stats


class Progress:
    """A one-line bar and lines for people on a terminal; a JSON line every `interval_s` otherwise
    (logs, journald). `human` forces either (`--log-format`); None: by the stream."""

    def __init__(self, total_files: int, stream: TextIO = sys.stderr, interval_s: float = 5.0,
                 human: bool | None = None):
        self.total, self.stream, self.interval_s = total_files, stream, interval_s
        self.tty = stream.isatty() if human is None else human
        self.started = self.last = time.monotonic()
        self.files = self.tokens = self.bytes = 0
        self.bar = False                      # a bar is drawn on the current terminal line

    def update(self, tokens: int, size_bytes: int) -> None:
        self.files += 1
        self.tokens += tokens
        self.bytes += size_bytes
        now = time.monotonic()
        if self.tty and (now - self.last > 0.1 or self.files == self.total):
            width = 30
            done = int(width * self.files / max(1, self.total))
            rate = self.bytes / max(1e-9, now - self.started) / 1e6
            self.stream.write(f"\rprepare-data [{'#' * done}{'.' * (width - done)}] {self.files}/{self.total} "
                              f"files, {self.tokens:,} tokens, {rate:.1f} MB/s")
            self.stream.flush()
            self.last, self.bar = now, True
        elif not self.tty and now - self.last >= self.interval_s:
            self.emit("prepare_progress")
            self.last = now

    def emit(self, event: str, **extra: Any) -> None:
        record = {"event": event, "files_done": self.files, "files": self.total, "tokens": self.tokens,
                  "elapsed_s": round(time.monotonic() - self.started, 3), **extra}
        if self.tty:
            if self.bar:                      # the bar's line ends first
                self.stream.write("\n")
                self.bar = False
            fields = "  ".join(f"{k}={v:,}" if isinstance(v, int) else f"{k}={v}" for k, v in record.items()
                               if k not in ("event", "files_done"))
            self.stream.write(f"{event.replace('_', ' ')}  {fields}\n")
        else:
            self.stream.write(json.dumps(record) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.bar:
            self.stream.write("\n")
            self.bar = False


def prepare(inputs: Sequence[str], output: str | Path, *, tokenizer: str = "byte", eos_token: str | None = None,
            workers: int = 0, text_field: str = "text", shard_tokens: int = 1 << 27, overwrite: bool = False,
            block_bytes: int = DEFAULT_BLOCK_BYTES, log: TextIO = sys.stderr, human: bool | None = None,
            validation_fraction: float = 0.0) -> dict[str, Any]:
    """Prepares a corpus; returns its manifest. Raises DataError on bad input, leaving nothing behind.
    validation_fraction: about that fraction of the documents (by a hash of each) go to a validation
    split inside the corpus (`validation/`, a corpus of its own, named in the manifest), never to training."""
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens = {shard_tokens} must be >= 1")
    if not 0.0 <= validation_fraction < 1.0:
        raise DataError(f"--validation-fraction = {validation_fraction:g} is out of range; use 0 (none) up to "
                        "but not including 1 (e.g. 0.01)")
    check_block_bytes(block_bytes)
    files = find_inputs(inputs)
    tok = load_tokenizer(tokenizer, eos_token)   # fail fast, in this process, on a bad tokenizer
    writer = CorpusWriter(output, tokenizer=tok.describe(), shard_tokens=shard_tokens, overwrite=overwrite,
                          block_bytes=block_bytes)
    held_out = CorpusWriter(writer.tmp / VALIDATION_DIR, tokenizer=tok.describe(), shard_tokens=shard_tokens,
                            block_bytes=block_bytes) if validation_fraction > 0 else None
    workers = workers or min(len(files), os.cpu_count() or 1)
    progress = Progress(len(files), log, human=human)
    replaced: dict[str, int] = {}
    bad_lines: dict[str, int] = {}
    jobs = [(str(f), text_field) for f in files]
    try:
        with multiprocessing.get_context("spawn").Pool(workers, _init_worker, (tokenizer, eos_token)) as pool:
            for path, docs, stats in pool.imap(_tokenize_file, jobs, chunksize=4):
                if "error" in stats:
                    raise DataError(f"cannot read input {path!r}: {stats['error']}")
                for doc in docs:
                    (held_out if held_out is not None and _held_out(doc, validation_fraction) else writer).add_document(doc)
                if stats["replaced"]:
                    replaced[path] = stats["replaced"]
                if stats["bad_lines"]:
                    bad_lines[path] = stats["bad_lines"]
                    progress.emit("prepare_warning", file=path,
                                  warning=f"{stats['bad_lines']} lines are not JSON objects with a string field "
                                          f"{text_field!r} (first: line {stats['first_bad_line']}); skipped")
                progress.update(sum(d.size for d in docs), stats["bytes"])
        progress.close()
        for path, count in replaced.items():
            progress.emit("prepare_warning", file=path,
                          warning=f"{count} invalid UTF-8 byte sequences replaced with U+FFFD")
        inputs_summary = {"specs": list(inputs), "files": len(files),
                          "replaced_characters": sum(replaced.values()), "skipped_lines": sum(bad_lines.values())}
        out = _commit(writer, held_out, validation_fraction, inputs_summary)
    except BaseException:
        if held_out is not None:
            held_out.abort()
        writer.abort()
        raise
    manifest = json.loads((out / "manifest.json").read_text())
    progress.emit("prepare_done", documents=manifest["documents"], output=str(out),
                  shards=len(manifest["shards"]))
    return manifest


VALIDATION_DIR = "validation"     # the held-out split, inside the corpus's directory


def _commit(writer: CorpusWriter, held_out: CorpusWriter | None, fraction: float, inputs: dict[str, Any]) -> Path:
    """The validation split first (inside the corpus's temporary directory), then the corpus naming it."""
    validation = None
    if held_out is not None:
        if held_out.documents == 0:
            raise DataError(f"--validation-fraction = {fraction:g} held out none of the {writer.documents} documents; "
                            "raise it, or give the run a corpus of its own (data.validation_path)")
        held_out.commit(inputs)
        validation = {"path": VALIDATION_DIR, "fraction": fraction, "documents": held_out.documents,
                      "tokens": held_out.tokens}
    return writer.commit(inputs, validation=validation)


def _held_out(doc: np.ndarray, fraction: float) -> bool:
    """Whether a document belongs to the validation split: by a hash of its tokens, so the split does not
    depend on file order or worker count, and a document repeated in the inputs never lands on both sides."""
    digest = hashlib.blake2b(np.ascontiguousarray(doc).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64 < fraction


def cache_root(env=os.environ) -> Path:
    """This project's cache: under systemd's cache directory, XDG's, or ~/.cache."""
    base = env.get("CACHE_DIRECTORY") or env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base.split(":")[0]) / "llm-pretrain"


def default_corpus_dir(env=os.environ) -> Path:
    """Where the embedded stdlib corpus is prepared on first use (in cache_root)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    return cache_root(env) / f"corpus-stdlib-{version}-byte-v{VERSION}"


def ensure_default_corpus(log: TextIO = sys.stderr) -> Path:
    """The embedded corpus, prepared once (concurrent callers race safely: the rename is atomic)."""
    out = default_corpus_dir()
    if (out / "manifest.json").exists():
        return out
    try:
        prepare([STDLIB], out, log=log)
    except DataError:
        if not (out / "manifest.json").exists():   # someone else committed it first: use theirs
            raise
    return out
