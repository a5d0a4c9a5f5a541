"""Columnar inputs of `meshrun action=prepare`: Parquet files, Arrow files, and Hugging Face `datasets`
directories written by save_to_disk, read with pyarrow (the `datasets` package is not needed).

- Parquet (*.parquet): read a row group's text column at a time (`pyarrow.parquet.ParquetFile.iter_batches`),
  so memory stays bounded by the batch, not the file.
- Arrow (*.arrow): the IPC file format (random access, what pyarrow.ipc.new_file / feather v2 write) or the
  IPC stream format (what `datasets` writes), read record batch by record batch.
- A save_to_disk directory: `state.json` lists its Arrow files in order (`_data_files`), beside
  `dataset_info.json`; a DatasetDict's `dataset_dict.json` lists its splits, each such a directory.

Every row's text (column prepare.text_key) is one document, exactly as a JSON Lines line's field would be,
so the same text gives the same tokens and the same held-out split whichever container it came in.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from training.data.sources import DataError

PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow",)
COLUMNAR_SUFFIXES = PARQUET_SUFFIXES + ARROW_SUFFIXES
BATCH_ROWS = 1024


def is_columnar(path: str) -> bool:
    return path.endswith(COLUMNAR_SUFFIXES)


def _pyarrow():
    try:
        import pyarrow  # noqa: F401
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError(
            "prepare.inputs holds Parquet or Arrow data, which needs pyarrow: pip install pyarrow "
            "(a dependency of meshrun; reinstall it)"
        ) from None
    return pyarrow


def is_saved_dataset(path: str) -> bool:
    """A directory written by `datasets`' save_to_disk (a Dataset or a DatasetDict)."""
    return os.path.isdir(path) and (
        os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(os.path.join(path, "dataset_dict.json"))
    )


def saved_dataset_files(path: str) -> list[str]:
    """The Arrow files of a save_to_disk directory in the dataset's row order (a DatasetDict: its splits in
    dataset_dict.json's order, each split's files in order)."""
    return _saved_files(path, splits_allowed=True)


def _plain_name(name: object, what: str, path: str, suffix: str = "") -> str:
    """A name inside the directory `path` (no separator, not "." or ".."; ending in `suffix`), else DataError:
    a crafted state.json or dataset_dict.json must not make prepare read files outside its directory."""
    if (
        not isinstance(name, str)
        or not name
        or "/" in name
        or "\0" in name
        or name in (".", "..")
        or not name.endswith(suffix)
    ):
        raise DataError(
            f"prepare.inputs: the save_to_disk directory {path!r} names {what} {name!r}, which is not a "
            f"{suffix or 'plain'} name inside it; save it again with save_to_disk or point prepare.inputs at its "
            f"*.arrow files"
        )
    return name


def _saved_files(path: str, splits_allowed: bool) -> list[str]:
    dict_json = os.path.join(path, "dataset_dict.json")
    try:
        if os.path.isfile(dict_json) and splits_allowed:
            with open(dict_json) as f:
                splits = json.load(f).get("splits") or []
            return [
                p
                for split in splits
                for p in _saved_files(os.path.join(path, _plain_name(split, "the split", path)), False)
            ]
        with open(os.path.join(path, "state.json")) as f:
            state = json.load(f)
        files = [
            os.path.join(path, _plain_name(entry["filename"], "the data file", path, ".arrow"))
            for entry in state.get("_data_files") or []
        ]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DataError(
            f"prepare.inputs: {path!r} looks like a Hugging Face save_to_disk directory but its "
            f"state.json / dataset_dict.json cannot be read ({exc}); save it again with "
            f"Dataset.save_to_disk or point prepare.inputs at its *.arrow files"
        ) from None
    missing = [p for p in files if os.path.islink(p) or not os.path.isfile(p)]
    if missing or not files:
        raise DataError(
            f"prepare.inputs: the save_to_disk directory {path!r} "
            + (f"lacks {missing[0]!r}" if missing else "lists no data files")
            + "; save it again or point prepare.inputs at its *.arrow files"
        )
    return files


def _batches(path: str):
    """Record batches of `path` (Parquet or Arrow, file or stream format) and the file's row count."""
    pa = _pyarrow()
    if path.endswith(PARQUET_SUFFIXES):
        pf = pa.parquet.ParquetFile(path)
        return pf.schema_arrow, (lambda columns: pf.iter_batches(batch_size=BATCH_ROWS, columns=columns))
    source = pa.memory_map(path)
    try:
        reader = pa.ipc.open_file(source)
        return reader.schema, (
            lambda columns: (reader.get_batch(i).select(columns) for i in range(reader.num_record_batches))
        )
    except pa.ArrowInvalid:
        source.seek(0)
        stream = pa.ipc.open_stream(source)
        return stream.schema, (lambda columns: (b.select(columns) for b in stream))


def row_count(path: str) -> int:
    """Rows of the file (Parquet: its footer; Arrow: its record batches, memory-mapped, not decoded)."""
    pa = _pyarrow()
    try:
        if path.endswith(PARQUET_SUFFIXES):
            return int(pa.parquet.ParquetFile(path).metadata.num_rows)
        source = pa.memory_map(path)
        try:
            reader = pa.ipc.open_file(source)
            return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            source.seek(0)
            return sum(b.num_rows for b in pa.ipc.open_stream(source))
    except (pa.ArrowException, OSError) as exc:
        raise DataError(
            f"{path}: not a readable {'Parquet' if path.endswith(PARQUET_SUFFIXES) else 'Arrow'} "
            f"file ({exc}); remove it from prepare.inputs or write it again"
        ) from None


def texts(path: str, key: str) -> Iterator[list[str]]:
    """Lists of documents (the `key` column's strings), batch by batch, in row order."""
    pa = _pyarrow()
    try:
        schema, batches = _batches(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(
            f"{path}: not a readable {'Parquet' if path.endswith(PARQUET_SUFFIXES) else 'Arrow'} "
            f"file ({exc}); remove it from prepare.inputs or write it again"
        ) from None
    if key not in schema.names:
        raise DataError(
            f"{path}: no column {key!r}; set prepare.text_key to the column that holds the text "
            f"(columns here: {', '.join(schema.names[:8])})"
        )
    kind = schema.field(key).type
    if not (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or getattr(pa.types, "is_string_view", lambda _: False)(kind)
    ):
        raise DataError(
            f"{path}: column {key!r} is {kind}, not text; set prepare.text_key to the column that holds the text"
        )
    row = 0
    try:
        for batch in batches([key]):
            column = batch.column(0)
            if column.null_count:
                first = row + next(i for i, v in enumerate(column.is_null().to_pylist()) if v)
                raise DataError(
                    f"{path}: row {first} of column {key!r} is null; drop the empty rows or choose "
                    f"another prepare.text_key"
                )
            # Full validation first: offsets past the data made to_pylist read outside the mapped file (SIGBUS)
            # or decode garbage, and text that is not UTF-8 raised UnicodeDecodeError.
            column.validate(full=True)
            values = column.to_pylist()
            row += len(values)
            yield values
    except (pa.ArrowException, UnicodeDecodeError, SystemError) as exc:
        raise DataError(
            f"{path}: reading failed at row {row} ({exc}); the file is damaged: write it again or "
            f"remove it from prepare.inputs"
        ) from None
