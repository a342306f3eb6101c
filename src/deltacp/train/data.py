"""Real training text with no network: documents concatenated into fixed-length sequences.

Default source: the .py files of this interpreter's standard library (sysconfig's stdlib path), read as
bytes (vocab 256). Documents are visited in an order shuffled from the seed (a fresh order each epoch),
joined with a separator and cut into [batch_size, seq_len] global batches, a new one every step; or, with
`packing`, laid back to back into rows of seq_len tokens with their offsets (cu_seqlens), a document that does
not fit continuing as a new document in the next row. Every rank reads the same stream, the whole global
batch, and keeps its dp group's rows (`next_step`), whose CP slice it takes later: the data order is the global
batch's, not a rank's, so every (dp, cp) layout trains on the same batches. `state_dict()` is the stream
position (epoch, document, offset), the same on every rank, so a resumed run reads exactly the tokens an
uninterrupted one would have read, at any (dp, cp).
"""

from __future__ import annotations

import functools
import json
import random
import sysconfig
from pathlib import Path

import torch

from deltacp.train.config import ConfigError, DataConfig, first_line

TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl")
SEPARATOR = b"\n\n"


class ByteTokenizer:
    """One token per UTF-8 byte."""

    vocab_size = 256

    def encode(self, text: bytes | str) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)


class HFTokenizer:
    """A local Hugging Face tokenizer directory (AutoTokenizer, local files only)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self.tok)

    def encode(self, text: bytes | str) -> list[int]:
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        ids = self.tok.encode(text, add_special_tokens=False)
        eos = self.tok.eos_token_id
        return ids + ([eos] if eos is not None else [])


def make_tokenizer(cfg: DataConfig):
    if cfg.tokenizer == "bytes":
        return ByteTokenizer()
    if not Path(cfg.tokenizer).is_dir():
        raise ConfigError(f"train.data.tokenizer={cfg.tokenizer!r} is neither 'bytes' nor a local directory")
    try:
        return HFTokenizer(cfg.tokenizer)
    except Exception as exc:  # noqa: BLE001  (transformers raises OSError, ValueError, ... for a directory without one)
        raise ConfigError(f"train.data.tokenizer={cfg.tokenizer!r}: no Hugging Face tokenizer could be loaded from "
                          f"this directory ({type(exc).__name__}: {first_line(exc)})") from None



def stdlib_files() -> list[Path]:
    """The standard library's .py files, sorted; listed once per process (walking it costs ~0.5 s of CPU, and it
    does not change while a process runs)."""
    return list(_stdlib_files(Path(sysconfig.get_paths()["stdlib"])))


@functools.lru_cache(maxsize=None)
def _stdlib_files(root: Path) -> tuple[Path, ...]:
    files = sorted(p for p in root.rglob("*.py")
                   if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts) and p.is_file())
    if not files:
        raise RuntimeError(f"no Python standard library sources found under {root}")
    return tuple(files)


def listed_files(paths) -> list[Path]:
    files = []
    for entry in paths:
        p = Path(entry)
        if p.is_dir():
            files += sorted(q for q in p.rglob("*") if q.is_file() and q.suffix in TEXT_SUFFIXES)
        elif p.is_file():
            files.append(p)
        else:
            raise ConfigError(f"train.data.paths: {entry!r} does not exist")
    if not files:
        raise ConfigError(f"train.data.paths {list(paths)} hold no text files ({', '.join(TEXT_SUFFIXES)})")
    return files


def _record(path: Path, number: int, line: str, jsonl_field: str) -> bytes:
    """The document text of line `number` of a .jsonl file."""
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise ConfigError(f"train.data.paths: {path}:{number} is not JSON ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get(jsonl_field), str):
        raise ConfigError(f"train.data.jsonl_field={jsonl_field!r}: {path}:{number} has no string field "
                          f"{jsonl_field!r}")
    return record[jsonl_field].encode("utf-8")


def _read(path: Path, text: bool, part: str = "all") -> str | bytes:
    """The file's contents (part: all | line, the first line | byte, the first byte), decoded as UTF-8 with
    `text`; or ConfigError naming train.data.paths and the file."""
    try:
        with open(path, "rb") as fh:
            data = {"all": fh.read, "line": fh.readline, "byte": lambda: fh.read(1)}[part]()
    except OSError as exc:
        raise ConfigError(f"train.data.paths: {path} cannot be read ({type(exc).__name__}: "
                          f"{exc.strerror or first_line(exc)})") from None
    if not text:
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"train.data.paths: {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _documents(path: Path, jsonl_field: str) -> list[bytes]:
    if path.suffix != ".jsonl":
        return [_read(path, text=False)]
    return [_record(path, number, line, jsonl_field)
            for number, line in enumerate(_read(path, text=True).splitlines(), 1) if line.strip()]


def check_files(files: list[Path], cfg: DataConfig) -> None:
    """Every file can be read, and the first record of every .jsonl file has the text field (the rest of a file is
    checked as the stream reaches it): cheap, one line of each file."""
    for path in files:
        if path.suffix != ".jsonl":
            _read(path, text=False, part="byte")
            continue
        first = _read(path, text=True, part="line")
        if first.strip():
            _record(path, 1, first, cfg.jsonl_field)


def check_trainable_text(files: list[Path], cfg: DataConfig, tokenizer) -> None:
    """Raise ConfigError naming train.data.paths unless some document gives the model a target: text that is not
    just whitespace and, with packing (no target crosses a document boundary), at least 2 tokens.

    Reads documents in order until one does (normally the first), so it is cheap for real data; with packing it
    tokenizes their first 4 KiB (2 tokens there are 2 in the document)."""
    for path in files:
        for doc in _documents(path, cfg.jsonl_field):
            if doc.strip() and (not cfg.packing or len(tokenizer.encode(doc[:4096])) >= 2):
                return
    shown = ", ".join(str(p) for p in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    if cfg.packing and any(doc.strip() for path in files for doc in _documents(path, cfg.jsonl_field)):
        raise ConfigError(f"train.data.paths {list(cfg.paths)} hold no trainable target: every document has fewer "
                          f"than 2 tokens, and with train.data.packing true no target crosses a document boundary "
                          f"({len(files)} file(s): {shown}); use longer documents or train.data.packing false")
    raise ConfigError(f"train.data.paths {list(cfg.paths)} hold no usable text: every document is empty or "
                      f"whitespace ({len(files)} file(s): {shown})")


class TokenStream:
    """Deterministic, resumable stream of [batch_size, seq_len] token batches."""

    def __init__(self, cfg: DataConfig, seed: int):
        self.cfg, self.seed = cfg, seed
        self.tokenizer = make_tokenizer(cfg)
        self.files = stdlib_files() if cfg.source == "stdlib" else listed_files(cfg.paths)
        if cfg.source == "files":
            check_trainable_text(self.files, cfg, self.tokenizer)
        self.epoch, self.file_index, self.offset = 0, 0, 0
        self._order = self._order_for(0)
        self._cache: tuple[tuple[int, int], list[int], int] | None = None

    def _order_for(self, epoch: int) -> list[int]:
        order = list(range(len(self.files)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def _tokens_of(self, file_index: int) -> list[int]:
        if self._cache is None or self._cache[0] != (self.epoch, file_index):
            path = self.files[self._order[file_index]]
            tokens, text_tokens, starts = [], 0, []
            for doc in _documents(path, self.cfg.jsonl_field):
                encoded = self.tokenizer.encode(doc)
                if self.cfg.packing and not encoded:
                    continue
                starts.append(len(tokens))
                tokens += encoded
                text_tokens += len(encoded) if doc.strip() else 0
                if isinstance(self.tokenizer, ByteTokenizer) and not self.cfg.packing:
                    tokens += list(SEPARATOR)
            self._cache = ((self.epoch, file_index), tokens, text_tokens, starts + [len(tokens)])
        return self._cache[1]

    def _has_text(self, file_index: int) -> bool:
        self._tokens_of(file_index)
        return self._cache[2] > 0

    def _take(self, n: int, boundaries: list[int] | None = None) -> list[int]:
        """The next n tokens; with `boundaries`, append the offset (within the result) of every document end."""
        out: list[int] = []
        empty_files = 0
        while len(out) < n:
            tokens = self._tokens_of(self.file_index)
            end = self.offset + n - len(out)
            if boundaries is not None:  # stop at the end of the current document
                doc_ends = self._cache[3]
                end = min(end, next(e for e in doc_ends if e > self.offset)) if self.offset < len(tokens) else end
            piece = tokens[self.offset: end]
            out += piece
            self.offset += len(piece)
            if boundaries is not None and piece:
                boundaries.append(len(out))
            # Separators alone are no text: a source whose every document is empty must not stream them forever.
            empty_files = 0 if self._has_text(self.file_index) else empty_files + 1
            if empty_files > len(self.files):
                raise ConfigError(f"train.data: the {len(self.files)} data file(s) hold no usable text (every "
                                  f"document is empty or whitespace)")
            if self.offset >= len(tokens):
                self.file_index, self.offset = self.file_index + 1, 0
                if self.file_index == len(self.files):
                    self.epoch, self.file_index = self.epoch + 1, 0
                    self._order = self._order_for(self.epoch)
        return out

    def next_batch(self) -> torch.Tensor:
        """The next global batch [batch_size, seq_len] (int64)."""
        B, S = self.cfg.batch_size, self.cfg.seq_len
        return torch.tensor(self._take(B * S), dtype=torch.long).view(B, S)

    def next_packed_row(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next packed row [1, seq_len] (int64) and its document offsets cu_seqlens [0, ..., seq_len]."""
        ends: list[int] = []
        ids = self._take(self.cfg.seq_len, boundaries=ends)
        return torch.tensor(ids, dtype=torch.long)[None], torch.tensor([0] + ends, dtype=torch.long)

    def next_step(self, part: int = 0, parts: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Dp group `part` of `parts`: its rows of the next global batch (batch_size rows, all read here).

        Unpacked: ([batch_size / parts, seq_len], None). Packed: its rows joined into one row
        [1, batch_size / parts * seq_len] with their cu_seqlens joined (each row's documents stay documents)."""
        B = self.cfg.batch_size
        if B % parts:
            raise ConfigError(f"train.data.batch_size ({B}) must be divisible by train.accelerator.dp ({parts})")
        mine = slice(part * (B // parts), (part + 1) * (B // parts))
        if not self.cfg.packing:
            return self.next_batch()[mine], None
        return join_packed_rows([self.next_packed_row() for _ in range(B)][mine])

    def state_dict(self) -> dict:
        return dict(epoch=self.epoch, file_index=self.file_index, offset=self.offset, seed=self.seed,
                    num_files=len(self.files))

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed or state["num_files"] != len(self.files):
            raise RuntimeError(f"the checkpoint's data stream (seed {state['seed']}, {state['num_files']} files) does "
                               f"not match this run's (seed {self.seed}, {len(self.files)} files)")
        self.epoch, self.file_index, self.offset = state["epoch"], state["file_index"], state["offset"]
        self._order = self._order_for(self.epoch)
        self._cache = None


def join_packed_rows(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows ([1, S], cu_seqlens) -> one row [1, n*S] with the joined cu_seqlens (documents unchanged)."""
    if len(rows) == 1:
        return rows[0]
    ids, cus, offset = [], [rows[0][1][:1]], 0
    for row, cu in rows:
        ids.append(row)
        cus.append(cu[1:] + offset)
        offset += row.shape[1]
    return torch.cat(ids, dim=1), torch.cat(cus)
