"""An operator's dataset for ``gpufleet bench --dataset``: JSON Lines, one request a line, each an object with
``prompt`` (a non-empty string) and optionally ``output_tokens`` (the tokens to ask for, 1 or more). Checked
whole before any request is sent, and written again in guidellm's own columns (``output_tokens_count``)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from gpufleet.input_files import json_depth_problem, kind

FIELDS = {"prompt", "output_tokens"}
MAX_ROWS = 1_000_000
MAX_BYTES = 1 << 30
ROW_DEPTH = 2
"""The deepest a row nests: an object of strings and numbers (a deeper one is refused before it is parsed)."""


class DatasetError(ValueError):
    """A dataset that is not JSONL of the expected fields (the message names the file, the line and the field)."""


def load_dataset(path: Path, max_model_len: int) -> list[dict[str, object]]:
    """The rows of ``path`` in guidellm's columns; DatasetError at the first line that is not one (or for a file
    that is not a regular one of at most :data:`MAX_BYTES`: a pipe or a device would be read without end)."""
    try:
        found = path.stat()
        if not stat.S_ISREG(found.st_mode):
            raise DatasetError(f"{path}: expected a regular JSONL file, found {kind(found.st_mode)}")
        if found.st_size > MAX_BYTES:
            raise DatasetError(f"{path}: expected at most {MAX_BYTES:,} bytes, found {found.st_size:,}")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: expected a readable UTF-8 JSONL file, found {type(exc).__name__}") from None
    rows: list[dict[str, object]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}: line {number}"
        if problem := json_depth_problem(line, ROW_DEPTH):
            raise DatasetError(f"{where}: {problem}")
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: expected one JSON object, found invalid JSON ({exc.msg})") from None
        except ValueError:  # an integer of more digits than Python converts
            raise DatasetError(f"{where}: expected one JSON object, found a number too long to read") from None
        if not isinstance(doc, dict):
            raise DatasetError(f"{where}: expected a JSON object, found {type(doc).__name__}")
        if unknown := sorted(set(doc) - FIELDS):
            raise DatasetError(f"{where}: {unknown[0]}: expected only prompt and output_tokens, found an unknown key")
        prompt = doc.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise DatasetError(f"{where}: prompt: expected a non-empty string, found {json.dumps(prompt)[:40]}")
        row: dict[str, object] = {"prompt": prompt}
        if "output_tokens" in doc:
            out = doc["output_tokens"]
            if not isinstance(out, int) or isinstance(out, bool) or not 1 <= out < max_model_len:
                raise DatasetError(f"{where}: output_tokens: expected a whole number from 1 to"
                                   f" {max_model_len - 1} (below max_model_len), found {json.dumps(out)[:40]}")
            row["output_tokens_count"] = out
        rows.append(row)
        if len(rows) > MAX_ROWS:
            raise DatasetError(f"{path}: expected at most {MAX_ROWS:,} requests, found more")
    if not rows:
        raise DatasetError(f"{path}: expected at least one request, found none")
    return rows


def write_for_client(rows: list[dict[str, object]], path: Path) -> Path:
    """``rows`` as the JSONL guidellm reads (``path``, a ``.jsonl`` name)."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path
