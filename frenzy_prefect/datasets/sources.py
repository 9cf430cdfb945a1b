"""The raw files under a prefix, and the text each holds: a plain-text file is one document, a
JSONL line or a Parquet row one document each (its text field or column)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass

from frenzy_prefect.errors import DatasetError, NoRawFiles
from frenzy_prefect.spec.dataset import SourceFile
from frenzy_prefect.storage import filesystem, open_uri, reaching

FORMATS = (".txt", ".jsonl", ".parquet")
# Folders of our own output, never read as raw data (a prefix at a bucket's root holds them).
OWN_FOLDERS = {"frenzy-prepared", "frenzy-runs"}
PIECE_CHARS = 2**20  # a text file is tokenised in pieces of about this many characters, cut at line ends
PARQUET_BATCH = 1024

# A piece of a document's text, and whether the document ends with it.
Piece = tuple[str, bool]


def source_format(path: str) -> str:
    for suffix in FORMATS:
        if path.endswith(suffix):
            return suffix
    raise DatasetError(f"raw dataset file {path} has an unknown format; accepted: " + ", ".join(f"*{s}" for s in FORMATS))


def _version(fs, path: str, info: dict) -> str:
    """An S3 object's ETag; elsewhere (a local file) the content's sha256."""
    etag = info.get("ETag") or info.get("etag")
    if etag:
        return "etag:" + str(etag).strip('"')
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while block := f.read(2**22):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


@dataclass(frozen=True)
class Listing:
    """The raw files of a source, with paths relative to ``root`` (the prefix, or a single file's folder)."""

    root: str
    files: tuple[SourceFile, ...]

    def uri(self, file: SourceFile) -> str:
        return f"{self.root}/{file.path}"


def list_sources(source: str) -> Listing:
    """The raw files under ``source`` (a prefix, or one file), sorted by path, each checked for a
    known format before any is read."""
    fs, path = filesystem(source)
    path, root = path.rstrip("/"), source.rstrip("/")
    with reaching(source):
        # s3fs caches listings per filesystem instance, and a worker keeps its instance: a stale
        # one would hash (and open) yesterday's files. Forget them under the prefix first.
        fs.invalidate_cache(path)
        if fs.isfile(path):
            found, base, root = {path: fs.info(path)}, path.rsplit("/", 1)[0], root.rsplit("/", 1)[0]
        else:
            found, base = fs.find(path, detail=True), path
        for name in found:
            fs.invalidate_cache(name)  # and the folders the files are in
        files = []
        for name in sorted(found):
            rel = name[len(base) :].lstrip("/")
            if found[name].get("type") == "directory" or OWN_FOLDERS & set(rel.split("/")[:-1]):
                continue
            source_format(f"{root}/{rel}")
            files.append(SourceFile(path=rel, size=int(found[name]["size"]), version=_version(fs, name, found[name])))
    if not files:
        raise NoRawFiles(f"raw dataset {source} holds no files; accepted: " + ", ".join(f"*{s}" for s in FORMATS))
    return Listing(root=root, files=tuple(files))


def pieces(uri: str, text_field: str) -> Iterator[Piece]:
    """The documents of one raw file, as pieces of text."""
    fmt = source_format(uri)
    try:
        if fmt == ".txt":
            yield from _text_pieces(uri)
        elif fmt == ".jsonl":
            yield from _jsonl_pieces(uri, text_field)
        else:
            yield from _parquet_pieces(uri, text_field)
    except UnicodeDecodeError as exc:
        raise DatasetError(f"raw dataset file {uri} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _text_pieces(uri: str) -> Iterator[Piece]:
    with open_uri(uri, "r", encoding="utf-8") as f:
        piece = "".join(f.readlines(PIECE_CHARS))
        while piece:
            after = "".join(f.readlines(PIECE_CHARS))
            yield piece, not after
            piece = after


def _jsonl_pieces(uri: str, field: str) -> Iterator[Piece]:
    with open_uri(uri, "r", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"raw dataset file {uri} line {number} is not JSON ({exc.msg}); each line must be an object") from None
            if not isinstance(record, dict) or field not in record:
                keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                raise DatasetError(f"raw dataset file {uri} line {number} has no {field!r} field (it has: {keys}); set text_field")
            text = record[field]
            if text is None:  # a missing document, as a null Parquet cell
                continue
            if not isinstance(text, str):
                raise DatasetError(f"raw dataset file {uri} line {number}: {field!r} is a {type(text).__name__}, not a string")
            yield text, True


def _parquet_pieces(uri: str, column: str) -> Iterator[Piece]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open_uri(uri, "rb") as f:
        try:
            parquet = pq.ParquetFile(f)
        except pa.ArrowInvalid as exc:
            raise DatasetError(f"raw dataset file {uri} is not a Parquet file: {str(exc).splitlines()[0]}") from None
        schema = parquet.schema_arrow
        if column not in schema.names:
            raise DatasetError(f"raw dataset file {uri} has no column {column!r} (it has: {', '.join(schema.names)}); set text_field")
        kind = schema.field(column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
            raise DatasetError(f"raw dataset file {uri}: column {column!r} holds {kind}, not strings")
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH, columns=[column]):
            yield from ((text, True) for text in batch.column(0).to_pylist() if text is not None)
