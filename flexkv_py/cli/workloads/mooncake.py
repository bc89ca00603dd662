"""Mooncake FAST'25 trace reader (JSONL, one request per line).

Fields: ``timestamp`` (ms from the start), ``input_length`` and ``output_length`` (tokens),
``hash_ids`` (one id per block of `block_tokens` tokens, 512 in the published traces; equal ids
mean equal prefix blocks). Keys are chained over the ids like vLLM's prefix hashes, and only the
prompt's full blocks are cacheable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flexkv_py.cli.workloads.base import Request, Workload, chain_hashes
from flexkv_py.errors import TraceFormatError

MOONCAKE_BLOCK_TOKENS = 512
_INT_FIELDS = ("input_length", "output_length")


def _field(obj: dict[str, Any], name: str, where: str) -> Any:
    if name not in obj:
        raise TraceFormatError(f"{where}: missing field {name!r}")
    return obj[name]


def _parse_line(text: str, where: str) -> tuple[float, int, int, list[int]]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{where}: not valid JSON ({e.msg})") from e
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object")
    ts = _field(obj, "timestamp", where)
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise TraceFormatError(f"{where}: field 'timestamp' must be a number, got {ts!r}")
    lengths = []
    for name in _INT_FIELDS:
        value = _field(obj, name, where)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TraceFormatError(f"{where}: field {name!r} must be an integer >= 0")
        lengths.append(value)
    ids = _field(obj, "hash_ids", where)
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise TraceFormatError(f"{where}: field 'hash_ids' must be a list of integers")
    return float(ts), lengths[0], lengths[1], ids


def read_mooncake_trace(
    path: str | Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS, limit: int | None = None
) -> Workload:
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise TraceFormatError(f"{path}: cannot read trace: {e.strerror or e}") from e
    requests: list[Request] = []
    start: float | None = None
    for lineno, text in enumerate(lines, 1):
        if not text.strip():
            continue
        if limit is not None and len(requests) >= limit:
            break
        ts, input_len, output_len, ids = _parse_line(text, f"{path}:{lineno}")
        start = ts if start is None else start
        full = min(len(ids), input_len // block_tokens)
        keys = chain_hashes(str(i).encode() for i in ids[:full])
        requests.append(
            Request(
                arrival=(ts - start) / 1000.0,
                keys=tuple(keys),
                contents=tuple(keys),
                prompt_tokens=input_len,
                output_tokens=output_len,
            )
        )
    if not requests:
        raise TraceFormatError(f"{path}: no requests in trace")
    return Workload(
        f"mooncake:{path.name}",
        block_tokens,
        requests,
        params={"trace": str(path), "block_tokens": block_tokens, "requests": len(requests)},
    )
