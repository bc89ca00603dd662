"""The scheduler's lookup of a request's block hashes, and its keys, memoized per request.

vLLM asks the connector for a waiting request's external hit on every scheduling attempt (every
step it waits), always with the same block hashes, only ever appended to. Building all keys
(`prefix + variant + hash`, one bytes object each) every time cost about as much as the index
lookup itself, so the lookup builds none: the index files its entries under (head, block hash)
too (`TierIndex.readable_hashes`). The keys a load needs (the hit's) are built once per request
and extended as its hashes grow.

The memo trusts vLLM's hashes to be chained (a block's hash covers every token before it): if
the last memoized block's hash still matches, so do all before it. Hashes that were cut
(streaming sessions) or recomputed (hash lookahead) are noticed by that check and the memo is
trimmed or rebuilt. Entries are forgotten when the request finishes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from flexkv_py.index.namespace import PREFIX_LEN, VARIANT_LEN, Namespace


class Request(Protocol):
    """What is read of vLLM's `Request` (read-only, so vLLM's list[BlockHash] fits)."""

    @property
    def request_id(self) -> str: ...

    @property
    def block_hashes(self) -> Sequence[bytes]: ...


# readable_hashes(head, hashes, start, stop): index of the first unreadable key
# head + hashes[i] in [start, stop) (TierIndex.readable_hashes).
HashPrefixFn = Callable[[bytes, Sequence[bytes], int, int], int]
# Safety net for requests whose end the connector never hears of: the oldest memo is dropped.
MAX_REQUESTS = 4096
_HASH_AT = PREFIX_LEN + VARIANT_LEN


@dataclass(slots=True)
class _Memo:
    request: object  # identity: a new Request under an old id starts a new memo
    variant: bytes
    head: bytes
    keys: list[bytes]  # keys of block_hashes[: len(keys)]


class RequestKeys:
    def __init__(self, ns: Namespace) -> None:
        self._prefix = ns.prefix
        self._memo: dict[str, _Memo] = {}
        self._heads: dict[bytes, bytes] = {}  # variant -> prefix + variant

    def __len__(self) -> int:
        return len(self._memo)

    def forget(self, req_id: str) -> None:
        self._memo.pop(req_id, None)

    def keys(self, request: Request, variant: bytes, stop: int | None = None) -> list[bytes]:
        """The request's memoized keys, covering at least block_hashes[:stop] (all when None).
        The memo's own list: slice it at once, later calls may extend or trim it."""
        memo = self._get(request, variant)
        hashes = request.block_hashes
        n = len(hashes)
        self._extend(memo, hashes, n if stop is None else min(stop, n))
        return memo.keys

    def longest_hit(
        self, request: Request, first: int, variant: bytes, readable_hashes: HashPrefixFn
    ) -> int:
        """Readable blocks of the request from block `first` on (the longest prefix)."""
        hashes = request.block_hashes
        total = len(hashes)
        if first >= total:
            return 0
        return readable_hashes(self.head(variant), hashes, first, total) - first

    def head(self, variant: bytes) -> bytes:
        """prefix + variant: what the index files this namespace's keys under."""
        head = self._heads.get(variant)
        if head is None:
            if len(variant) != VARIANT_LEN:
                raise ValueError(f"key variant must be {VARIANT_LEN} bytes, got {len(variant)}")
            head = self._heads[variant] = self._prefix + variant
        return head

    # ------------------------------------------------------------------ internals
    def _get(self, request: Request, variant: bytes) -> _Memo:
        req_id = request.request_id
        memo = self._memo.get(req_id)
        if memo is None or memo.request is not request or memo.variant != variant:
            if len(variant) != VARIANT_LEN:
                raise ValueError(f"key variant must be {VARIANT_LEN} bytes, got {len(variant)}")
            memo = _Memo(request, variant, self._prefix + variant, [])
            self._memo.pop(req_id, None)
            self._memo[req_id] = memo
            while len(self._memo) > MAX_REQUESTS:
                del self._memo[next(iter(self._memo))]
            return memo
        keys = memo.keys
        if keys:
            hashes = request.block_hashes
            if len(keys) > len(hashes):
                del keys[len(hashes) :]  # cut hashes (a streaming session's tail)
            # Chained hashes: the last one matching vouches for every one before it.
            if keys and keys[-1][_HASH_AT:] != hashes[len(keys) - 1]:
                keys.clear()
        return memo

    @staticmethod
    def _extend(memo: _Memo, hashes: Sequence[bytes], stop: int) -> None:
        keys = memo.keys
        if stop > len(keys):
            head = memo.head
            # `head + h`, not `head + bytes(h)`: vLLM's hashes are bytes already, and the extra
            # call per block was most of the cost of building keys.
            keys.extend([head + h for h in hashes[len(keys) : stop]])
