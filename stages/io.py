"""Writing outputs whole: every file goes to a temporary name first and is renamed into place, so a
stage killed midway never leaves a half-written file that a later stage could take for a whole one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def _tmp(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    tmp = _tmp(path)
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: str | Path, data) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    write_text(path, "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows))


def write_parquet(path: str | Path, table: pa.Table) -> None:
    path = Path(path)
    tmp = _tmp(path)
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def replace_dir(tmp: Path, path: Path) -> None:
    """Move a finished folder into place (the old one, if any, goes first)."""
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
