"""Type stubs for the Rust extension `flexkv_py._native`.

The native module owns the on-disk block store (io_uring / pread engines, O_DIRECT, content-hash
dedup, crash-safe journal) and an aligned host pool. Every call that does I/O, hashing or
compression releases the GIL.
"""

from collections.abc import Sequence
from typing import Literal, TypeAlias, final

from typing_extensions import Buffer

from flexkv_py.config.choices import Compression, ContentHash, Durability, IoEngine

# A block buffer: any buffer-protocol object (bytes, bytearray, memoryview, numpy array, a slice of
# a HostPool) or a raw ``(address, nbytes)`` pair, e.g. ``(tensor.data_ptr(), tensor.nbytes)``.
# For raw pairs the caller keeps the memory alive until the batch completes.
BlockBuffer: TypeAlias = Buffer | tuple[int, int]

BlockStatus = Literal[
    "ok",  # put: data written; get: data read and verified
    "deduped",  # put: identical content already stored, no data bytes written
    "not_found",  # get: key unknown (never stored, deleted or evicted)
    "corrupt",  # get: checksum/header mismatch; the buffer content is undefined
    "io_error",  # the device failed (EIO, short read/write, ENOSPC on write)
    "rejected",  # put: refused (an object-tier key out of range, a read-only shard)
    "no_space",  # put: larger than the whole budget, or everything else is pinned
    "bad_buffer",  # get: output buffer too small / read-only
]

class FlexKVError(Exception): ...
class ConfigError(FlexKVError, ValueError): ...
class StorageFullError(FlexKVError): ...
class CorruptBlockError(FlexKVError): ...
class IoEngineError(FlexKVError, OSError): ...
class StoreLockedError(FlexKVError): ...
class BlockNotFoundError(FlexKVError, KeyError): ...

class StoreClosedError(FlexKVError):
    """The store was closed (``close()``, or the tier shut down); nothing more can be submitted."""

@final
class BlockResult:
    @property
    def status(self) -> BlockStatus: ...
    @property
    def nbytes(self) -> int:
        """Uncompressed length of the block (get: bytes placed in the buffer)."""
    @property
    def error(self) -> str | None: ...
    @property
    def ok(self) -> bool:
        """True for "ok" and "deduped"."""

@final
class LookupHandle:
    """A lookup running on the object tier's runtime. Dropping the handle before its answer
    aborts the lookup; `ObjectTier.close` fails the ones not started (`StoreClosedError`) and
    waits for the running ones."""

    def done(self) -> bool:
        """The answer is in (never blocks)."""
    def result(self, timeout: float | None = None) -> int:
        """Block (GIL released) until answered: a chain lookup's count, or a presence probe's
        bits; raises TimeoutError after `timeout` seconds, a `FlexKVError` if it failed."""

@final
class BatchHandle:
    """An in-flight batch. The store keeps every buffer alive until the batch completes,
    even if this handle is dropped."""

    def done(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> list[BlockResult]:
        """Block (GIL released) until done; raises TimeoutError after `timeout` seconds."""
    def __len__(self) -> int: ...

@final
class HostPool:
    """Internal: the raw region under `flexkv_py.HostPool` (the slotted pool; use that).

    Page-aligned anonymous mmap, first-touched in parallel. One region serves CUDA DMA (after
    cudaHostRegister) and O_DIRECT I/O. Unmapped at close() / garbage collection, but never
    under a live view: each memoryview() leases the mapping until it (and every array or tensor
    made from it) is gone."""

    def __new__(
        cls, nbytes: int, *, huge_pages: bool = False, touch_threads: int = 0
    ) -> HostPool: ...
    @property
    def address(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def huge_pages(self) -> bool: ...
    @property
    def live_views(self) -> int:
        """Views from memoryview() still alive; after close() they alone keep the mapping."""
    @property
    def closed(self) -> bool: ...
    def memoryview(self) -> memoryview:
        """Writable view of the whole pool (e.g. for torch.frombuffer) that keeps the memory
        mapped while it, or anything made from it, is alive."""
    def close(self) -> None:
        """Drop the pool's reference: unmapped now, or when the last view goes. Later calls of
        address / nbytes / huge_pages / memoryview raise ClosedError."""

@final
class BlockStore:
    """A crash-safe, content-deduplicated block store over one or more cache directories."""

    def __new__(
        cls,
        dirs: str | Sequence[str],
        capacity_bytes: int,
        *,
        io_engine: IoEngine = "auto",
        queue_depth: int = 64,
        compression: Compression = "none",
        zstd_level: int = 1,
        content_hash: ContentHash = "xxh3-128",
        durability: Durability = "process",
        preallocate: bool = True,
        read_only: bool = False,
        batch_threads: int = 4,
        fault_injection: str | None = None,
    ) -> BlockStore:
        """`dirs`: a list, or FlexKV's ';'-separated string. `capacity_bytes` is the physical
        byte budget, split evenly across directories. `read_only=True` opens an existing store
        (capacity ignored) without taking the lock, e.g. to inspect a directory in use.
        The store keeps no eviction order: its owner (the scheduler's index) deletes what it
        evicts; a put that still finds the device full evicts by a clock sweep (reported by
        `drain_evicted`), and `keys()`/`inventory()` list oldest write first.
        `fault_injection` (testing only; also the FLEXKV_FAULT_INJECTION environment variable):
        "<read|write|any>:<EIO|ENOSPC>:<N>" fails every Nth matching device I/O,
        "<read|write|any>:DELAY<ms>:<N>" delays it, "journal:<EIO|ENOSPC>:<N>" fails every Nth
        journal write and "journal:DELAY<ms>:<N>" slows every Nth background compaction."""
    @property
    def io_engine(self) -> str:
        """The engine actually in use ("io_uring" or "psync")."""
    @property
    def dirs(self) -> list[str]: ...
    @property
    def capacity_bytes(self) -> int: ...
    def submit_put(
        self,
        items: Sequence[tuple[bytes, BlockBuffer]],
        parents: Sequence[bytes | None] | None = None,
        metas: Sequence[bytes | None] | None = None,
    ) -> BatchHandle:
        """``parents``: each block's chain parent key; ``metas``: opaque bytes kept in the block's
        header page (at most ~4 KiB minus the key); parallel to ``items``, None = absent."""
    def submit_get(self, items: Sequence[tuple[bytes, BlockBuffer]]) -> BatchHandle:
        """Each buffer must be writable and at least the block's length."""
    def inventory(self) -> list[tuple[bytes, bytes | None]]:
        """Every stored key with its chain parent (None: none, or not stored), oldest first."""
    def read_metas(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The metadata stored with each key (one batched header-page read each, GIL released);
        None: not stored, stored without metadata, or a duplicate of another key's content."""
    def put(self, key: bytes, data: BlockBuffer) -> BlockResult: ...
    def get(self, key: bytes, out: BlockBuffer) -> BlockResult: ...
    def read(self, key: bytes) -> bytes:
        """Convenience: raises BlockNotFoundError / CorruptBlockError / IoEngineError."""
    def contains(self, key: bytes) -> bool: ...
    def match_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are stored (stops at the first miss)."""
    def block_len(self, key: bytes) -> int | None:
        """Uncompressed length of a stored block, None if absent."""
    def delete(self, key: bytes) -> bool: ...
    def delete_fingerprints(self, tag: bytes, fingerprints: bytes) -> list[bytes]:
        """Delete the keys starting with `tag` whose fingerprint (`BlockSet.digest` of the key
        past its 4-byte rank tag) is in `fingerprints` (8 bytes each, joined); returns them."""
        ...
    def delete_prefixed(self, prefixes: Sequence[bytes]) -> list[bytes]:
        """Delete every key that starts with one of `prefixes`; returns them, oldest write first."""
        ...
    def clear(self) -> int:
        """Delete every key; returns how many were removed."""
    def keys(self) -> list[bytes]: ...
    def keys_joined(
        self, heads: Sequence[bytes], cut: int, min_len: int
    ) -> tuple[bytes, int] | None:
        """`keys()` of the keys that start with one of `heads` and are at least `min_len` bytes
        long, `cut` bytes cut from each, joined: (bytes, their common width, 0 when none);
        None when their widths differ. No object per key (a restart lists millions)."""
    def inventory_joined(
        self, heads: Sequence[bytes], cut: int, min_len: int
    ) -> tuple[bytes, bytes, bytes, int] | None:
        """`keys_joined` with the chain links among the keys listed: (keys, children, parents,
        width), `children[i]` extending `parents[i]`, all joined; None when widths differ."""
    def follow(self) -> tuple[list[bytes], list[bytes]] | None:
        """A read-only view: (keys that appeared, keys that vanished) in the writer's journal
        since the last call or the open; None when it cannot be followed (replaced by a
        compaction or rewrite): open a new view then. ConfigError on a writable store."""
    def drain_evicted(self) -> list[bytes]:
        """Keys the store evicted (capacity pressure) since the last call."""
    def verify(self) -> list[bytes]:
        """Read and check every block; returns the keys whose data is corrupt or unreadable."""
    def stats(self) -> dict[str, int | float | str]: ...
    def checkpoint(self) -> None:
        """Compact the journal now (also done on close and when it grows)."""
    def close(self) -> None:
        """Wait for in-flight batches, compact the journal, mark a clean shutdown, unlock."""
    def __enter__(self) -> BlockStore: ...
    def __exit__(self, *exc: object) -> None: ...
    def __len__(self) -> int: ...
    def index_nbytes(self) -> int:
        """Bytes the in-memory index holds (keys, contents), estimated from
        its allocations; ``index_nbytes() / len(store)`` is the index cost per block."""

# The names the native parsers accept for each string option (aliases aside), in their order.
IO_ENGINES: tuple[str, ...]
COMPRESSIONS: tuple[str, ...]
CONTENT_HASHES: tuple[str, ...]
DURABILITIES: tuple[str, ...]
FAULT_TARGETS: tuple[str, ...]
FAULT_ERRNOS: tuple[str, ...]
STATUSES: tuple[BlockStatus, ...]
# The journal format this build writes. Opening (not read-only) a store written by another
# version moves its files to ``<dir>/set-aside/v<old>-<unix secs>/`` (one WARNING) and starts empty.
JOURNAL_FORMAT_VERSION: int
# The store's allocation unit (bytes) and the pages each data file starts with (its superblock).
STORE_PAGE: int
SUPERBLOCK_PAGES: int

@final
class BlockSet:
    """Block keys (namespace head + block hash) kept as 8-byte fingerprints (the first 8 bytes
    of xxh3-128 of head || hash, little-endian) in least-recently-used order, 21-29 bytes per
    key: presence of blocks that live only in a lower tier. A fingerprint clash answers a false
    "present"; the worker's store looks the full key up and answers not_found, and the block is
    recomputed. Thread-safe; calls over many keys release the GIL."""

    def __new__(cls, chains: bool = False) -> BlockSet: ...
    def add(self, head: bytes, hash: bytes) -> bool:
        """True if newly added; adding a present key keeps its place in the LRU order."""
    def add_key(self, key: bytes) -> bool:
        """`add` of a full key (head + hash): the same digest."""
    def add_keys(self, keys: Sequence[bytes]) -> int:
        """How many were newly added."""
    def add_joined(self, joined: bytes, width: int) -> int:
        """`add_keys` of keys joined into one buffer, each `width` bytes (ValueError when
        `joined` is not whole keys); how many were newly added."""
    def add_digests(self, digests: Sequence[bytes]) -> int:
        """`add_keys` for digests already made (`digest`, `pop_lru`); each is 8 bytes."""
    def discard(self, head: bytes, hash: bytes) -> bool: ...
    def discard_key(self, key: bytes) -> bool: ...
    def discard_keys(self, keys: Sequence[bytes]) -> int: ...
    def discard_digests(self, digests: Sequence[bytes]) -> int: ...
    def contains(self, head: bytes, hash: bytes) -> bool: ...
    def __contains__(self, key: object, /) -> bool:
        """Full-key membership; a key that is not bytes raises TypeError."""
    def __len__(self) -> int: ...
    def prefix_run(self, head: bytes, hashes: Sequence[bytes], start: int, stop: int) -> int:
        """How many consecutive hashes[start:stop] are present (stops at the first absent one).
        ValueError unless 0 <= start <= stop <= len(hashes)."""
    def present_mask(self, head: bytes, hashes: Sequence[bytes], start: int, stop: int) -> bytes:
        """One byte per hashes[start:stop]: 1 present, 0 absent."""
    def touch(self, head: bytes, hashes: Sequence[bytes]) -> None:
        """Move each present key to the most recent end, in the order given."""
    def pop_lru(self, n: int) -> list[bytes]:
        """Remove and return up to n digests, least recently used first."""
    def digests(self) -> list[bytes]:
        """Every digest, least recently used first."""
    @staticmethod
    def digest(head: bytes, hash: bytes) -> bytes:
        """The 8-byte digest (fingerprint) that (head, hash) is kept as."""
    def intersect_update(self, other: BlockSet) -> None:
        """Keep only the digests also in `other` (what every TP rank holds); order kept."""
    # Chain links (prefix-aware eviction order): a parent is named by `parent_name`, 8 bytes
    # of which the first 5 (its digest's) count.
    @staticmethod
    def parent_name(key: bytes) -> bytes:
        """The 8-byte name of the block of `key` in chain links: its digest's first 5 bytes,
        then three zero bytes (not a fingerprint for drops: that is `digest`)."""
    def add_chained(self, key: bytes, parent: bytes | None, kids: int) -> bool:
        """Add `key` extending the block named `parent`, `kids` children counted."""
    def has_digest(self, digest: bytes) -> bool:
        """Is a block named this here (an 8-byte parent name; a digest names its block too)?"""
    def add_kid(self, parent: bytes) -> bool: ...
    def drop_kid(self, parent: bytes) -> bool:
        """Take a child off a block named `parent` that has one; False if none here does."""
    def take_chained(self, key: bytes) -> tuple[bytes | None, int] | None:
        """Remove `key`: (parent name or None, children counted), None if absent."""
    def pop_tails(self, n: int) -> list[tuple[bytes, bytes | None]]:
        """Evict up to `n` chain tails (no counted child), least recently used first: (digest,
        parent name when the child was not counted off a parent in this set: the caller's to
        drop; one here loses the child itself)."""
    def kids_of(self, key: bytes) -> int | None: ...
    def link_keys(self, children: Sequence[bytes], parents: Sequence[bytes]) -> int: ...
    def link_joined(self, children: bytes, parents: bytes, width: int) -> int:
        """`link_keys` of `width`-byte keys joined into buffers (ValueError when they are not
        the same whole keys); how many links were made."""
    @staticmethod
    def find_records(
        head: bytes, hashes: bytes, hash_len: int, digests: Sequence[bytes]
    ) -> list[int]:
        """Positions of the `hash_len`-byte records of `hashes` whose digest is in `digests`."""
    def reserve(self, additional: int) -> None:
        """Room for `additional` more keys without regrowing (ValueError past the set's limit of
        2**32 - 2 keys, MemoryError when it cannot be allocated)."""
    def clear(self) -> None:
        """Forget every key and release the memory."""
    def nbytes(self) -> int:
        """Heap bytes held (table and arena capacities)."""

def content_hash(data: Buffer, algorithm: ContentHash = "xxh3-128") -> bytes: ...
def io_uring_available() -> bool: ...
def set_fault_delays(enabled: bool) -> None:
    """Testing: turn slow-mode fault injection (``DELAY<ms>``) on or off in this process."""

def store_capacity_blocks(capacity_bytes: int, dirs: int, stored_bytes: int) -> int:
    """Blocks of `stored_bytes` a store of `capacity_bytes` over `dirs` directories holds (no
    dedup, no compression): the store's own layout arithmetic. ConfigError unless `dirs` and
    `stored_bytes` are >= 1."""

def block_pages(stored_bytes: int) -> int:
    """Pages one block of `stored_bytes` takes on disk (its header page plus its data)."""

# --- The object-store tier (rust/object): blocks as objects in S3, GCS, Azure, files or memory.

@final
class ObjectTier:
    """KV blocks as objects, chosen by URL: ``s3://bucket/prefix``, ``gs://``, ``az://``,
    ``file:///path``, ``memory://``. The first writer of a key wins (conditional create);
    every read is verified (the SSD tier's block header + content hash). Requests run on the
    tier's own per-process runtime (rebuilt in a forked child), at most `concurrency` at once;
    each block gets ``(retries + 1) * timeout_s`` plus backoff. S3 credentials come from the
    arguments or the ``AWS_*`` environment; the cloud metadata address is asked only with
    `allow_instance_metadata`. Opening a remote store makes one listing request: a wrong
    secret or a missing bucket is a `ConfigError` naming the endpoint (never the secret)."""

    def __new__(
        cls,
        url: str,
        *,
        endpoint: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        allow_http: bool = False,
        allow_instance_metadata: bool = False,
        concurrency: int = 32,
        timeout_s: float = 10.0,
        retries: int = 3,
        compression: Literal["none", "zstd"] = "none",
        zstd_level: int = 3,
        touch_interval_s: float = 300.0,
        claim_lease_s: float | None = None,
    ) -> ObjectTier:
        """`claim_lease_s`: how long a chain put's upload claim on a segment holds racing
        writers off (they wait for its manifest, then upload themselves); default: `timeout_s`
        times the segment's upload rounds plus one."""
    @property
    def url(self) -> str: ...
    @property
    def backend(self) -> Literal["s3", "gs", "az", "file", "memory"]: ...
    @property
    def prefix(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    def submit_put(
        self, items: Sequence[tuple[bytes, BlockBuffer]], chain: Sequence[bytes] | None = None
    ) -> BatchHandle:
        """With `chain` (every key from the root to the last block): the chain's manifests are
        read first (known blocks send nothing) and written once their blocks are stored; each
        segment's new blocks go up under an upload claim (``c/<key>``), so a racing writer of the
        same chain sends no body for them ("deduped" once the claim holder's manifest lists them;
        uploaded after all if the holder's lease ends without one)."""
    def check(self) -> None:
        """One listing request, as at open: raises `ConfigError` naming the problem (credentials
        refused, no such bucket, no answer within the budget), never the secret; GIL released."""
    def submit_get(self, items: Sequence[tuple[bytes, BlockBuffer]]) -> BatchHandle: ...
    def lookup_chain(self, keys: Sequence[bytes]) -> int:
        """Leading blocks of the chain (root first) stored, from its segment manifests: at most
        ``1 + log2(n/64 + 1) + 6`` requests in sequence (plus, for a hit that ends inside a
        segment, the manifest that could vouch for it and one round of up to 63 HEADs confirming
        it), 1 for a chain stored before; GIL released."""
    def submit_lookup_chain(self, keys: Sequence[bytes]) -> LookupHandle:
        """`lookup_chain(keys)` on the tier's runtime (at most 4 of a tier at once, probes
        included): returns at once; the handle's `result` is the count. Raises
        `StoreClosedError` once closed."""
    def submit_present(self, keys: Sequence[bytes]) -> LookupHandle:
        """Whether each key is stored as a one-block chain (8 asked at once), on the tier's
        runtime: returns at once; the handle's `result` has bit i set when
        `lookup_chain([keys[i]]) == 1`. Raises `StoreClosedError` once closed."""
    def gc(
        self,
        *,
        ttl_s: float,
        grace_s: float = 600.0,
        budget_bytes: int | None = None,
        dry_run: bool = False,
    ) -> dict[str, int]:
        """One collection pass: manifests unused for `ttl_s` (and not an ancestor of a used one)
        go, then blocks no live manifest lists and older than `grace_s`; over `budget_bytes`,
        the least recently used chain tails go first; manifests older than `grace_s` that name
        a block or parent gone (and their descendants) go too (`manifests_dangling`). Returns the
        counts."""
    def inspect(self) -> dict[str, int]:
        """Objects and bytes of the prefix by kind: blocks, manifests, touches, claims, lease,
        other."""
    def start_gc(
        self,
        holder: str,
        *,
        ttl_s: float,
        grace_s: float = 600.0,
        budget_bytes: int | None = None,
        interval_s: float = 300.0,
        lease_s: float = 900.0,
    ) -> None:
        """Collection passes in the background on the tier's runtime: every `interval_s`, one
        `gc` pass by whichever process holds the lease (`holder` names this one; `lease_s` >=
        `interval_s`). Counted in stats (`gc_passes`, `gc_pass_failures`); `close` stops it."""
    def try_gc_lease(self, holder: str, lease_s: float) -> bool:
        """Take or renew the prefix's GC lease; True when `holder` holds it now."""
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Known keys answer locally, the rest with one HEAD each; unanswered lookups are False."""
    def delete(self, keys: Sequence[bytes]) -> int:
        """Delete the keys' objects (absent ones count as deleted); raises on the first failure."""
    def drain_evicted(self) -> list[bytes]:
        """Always empty: the tier evicts nothing by itself."""
    def stats(self) -> dict[str, int | float | str]: ...
    def close(self) -> None:
        """No more batches (`StoreClosedError`); returns once this process's batches in flight
        have finished (GIL released; every request is bounded by the tier's budget)."""
    def __enter__(self) -> ObjectTier: ...
    def __exit__(self, *exc: object) -> None: ...
