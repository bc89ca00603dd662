"""Staged path: a few SMs gather pages in device memory, the copy engines move whole pages.

Copy engines are fastest on large copies and SMs are poor at PCIe (UVA stores top out ~6% under
the DMA ceiling). So D2H runs, per chunk of blocks: a Triton gather (8 programs) of each block's
runs into one contiguous page in a device staging buffer, then one ``cuMemcpyBatchAsync`` of the
whole pages (~MiBs each) to their host slots. H2D is the mirror: batched page copies into
staging, then a Triton scatter. Two staging buffers alternate, so chunk c+1's gather overlaps
chunk c's DMA (a side stream carries the DMA; events keep the buffers' reuse ordered).

The alternation carries on across batches and nothing joins the two streams: a store or load cut
into several jobs (coordinator/pipeline.py) then keeps the copy engine busy from one batch into the
next. Joining at each batch's end (as this path once did) left the DMA idle for a whole gather (or
scatter) at every boundary: ~2 % of a 2000-block store in 8 parts on an H200. Ordering without it:
a DMA waits for its own chunk's gather (``ready``), a buffer's next use waits for its last one
(``_free``), the first gather of a batch follows the caller's stream (the engine makes the current
stream wait for it), and a D2H completes on the DMA stream (returned to the engine, which records
the batch's event there: every gather of the batch precedes its DMA); an H2D ends on the current
stream with its last scatter.

Two cuts of the time around the copies themselves:

* Host slots that follow each other (as a batch's slots mostly do) move in one DMA, since the
  staging rows always do: fewer, larger copies for the driver to feed. A merged copy stops at
  the pool's registration boundaries (``merge_span_slots``): one copy never spans two
  ``cudaHostRegister`` ranges.
* The chunk whose SM work nothing hides is made small: a D2H's first gather runs before any
  DMA and an H2D's last scatter after every DMA, so chunks grow 1, 2, 4, ... pages at a D2H's
  head and shrink the same way at an H2D's tail (each one's SM work still fits under its
  neighbour's DMA).

Device memory cost: 2 x ``chunk_pages`` pages (e.g. 2 x 32 x 2.25 MiB = 144 MiB).
"""

from __future__ import annotations

import numpy as np
import torch

from flexkv_py.transfer.copy_engine_path import BatchCopier
from flexkv_py.transfer.kv_layout import KVPageGeometry
from flexkv_py.transfer.triton_path import TritonCopyPath


def chunk_bounds(
    n: int, chunk: int, direction: str, *, taper: bool = True
) -> list[tuple[int, int]]:
    """[start, end) of each chunk of an n-page batch: at most `chunk` pages each, the unhidden
    end (a D2H's head, an H2D's tail) in chunks of 1, 2, 4, ... pages when `taper`."""
    sizes: list[int] = []
    rest = n
    if taper:
        step = 1
        while step < chunk and rest > 0:
            sizes.append(min(step, rest))
            rest -= sizes[-1]
            step *= 2
    sizes += [chunk] * (rest // chunk) + ([rest % chunk] if rest % chunk else [])
    if taper and direction != "d2h":
        sizes.reverse()
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def merged_runs(slots: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray]:
    """(first index, length) of each run of consecutive slots that stays within one
    `span`-slot registration: chunk row i+1 follows row i, so such a run is one copy."""
    k = len(slots)
    if k == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    s = slots.astype(np.int64)
    joins = (s[1:] == s[:-1] + 1) & (s[1:] // span == s[:-1] // span)
    starts = np.concatenate(([0], np.flatnonzero(~joins) + 1))
    lengths = np.diff(np.concatenate((starts, [k])))
    return starts, lengths


class StagedCopyPath:
    name = "staged"

    def __init__(
        self,
        geometry: KVPageGeometry,
        host: torch.Tensor,
        *,
        chunk_pages: int = 32,
        programs: int = 8,
        tile_bytes: int = 32768,
        num_warps: int = 16,
        prefer_overlap: bool = True,
        merge_span_slots: int = 1,
        taper: bool = True,
    ) -> None:
        """`merge_span_slots`: slots per pinned registration of `host` (1: no merged copies)."""
        if geometry.device.type != "cuda":
            raise ValueError("the staged path needs CUDA tensors")
        dev = geometry.device
        self._copier = BatchCopier(prefer_overlap=prefer_overlap)
        self._chunk = chunk_pages
        self._row = host.shape[1]
        self._page = geometry.page_nbytes
        self._host_addr = host.data_ptr()
        # A merged copy also moves the bytes between pages, so only where a slot is one page.
        self._span = merge_span_slots if self._row == self._page else 1
        self._taper = taper
        self.copies_issued = 0  # DMA descriptors sent (tests see the merging)
        self._stages = [
            torch.empty((chunk_pages, self._row), dtype=torch.uint8, device=dev) for _ in range(2)
        ]
        self._kernels = [
            TritonCopyPath(
                geometry, st, programs=programs, tile_bytes=tile_bytes, num_warps=num_warps
            )
            for st in self._stages
        ]
        self._dma_stream = torch.cuda.Stream(dev)
        self._free = [torch.cuda.Event() for _ in range(2)]
        self._used = [False, False]
        self._next_buffer = 0  # carries on across batches (see the module docstring)
        self.sms_used = self._kernels[0].sms_used

    def enqueue(
        self, direction: str, gpu_ids: np.ndarray, slots: np.ndarray
    ) -> torch.cuda.Stream | None:
        """On the current stream; a D2H completes on the DMA stream, returned (no join)."""
        main = torch.cuda.current_stream()
        dma = self._dma_stream
        for start, end in chunk_bounds(len(gpu_ids), self._chunk, direction, taper=self._taper):
            b = self._next_buffer
            self._next_buffer = 1 - b
            ids = gpu_ids[start:end]
            rows = np.arange(len(ids), dtype=np.int64)
            stage, host, sizes = self._page_copies(b, slots[start:end])
            ready = torch.cuda.Event()
            if direction == "d2h":
                if self._used[b]:
                    main.wait_event(self._free[b])  # previous DMA out of this buffer is done
                self._kernels[b].enqueue("d2h", ids, rows)  # gather into staging (main)
                ready.record(main)
                dma.wait_event(ready)
                self._copier.copy(host, stage, sizes, dma.cuda_stream)
                self._free[b].record(dma)
            else:
                if self._used[b]:
                    dma.wait_event(self._free[b])  # previous scatter from this buffer is done
                self._copier.copy(stage, host, sizes, dma.cuda_stream)
                ready.record(dma)
                main.wait_event(ready)
                self._kernels[b].enqueue("h2d", ids, rows)  # scatter from staging (main)
                self._free[b].record(main)
            self._used[b] = True
            self.copies_issued += len(sizes)
        return dma if direction == "d2h" else None

    def _page_copies(
        self, buffer: int, slots: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(staging addresses, host addresses, sizes) of a chunk's page copies, merged."""
        firsts, lengths = merged_runs(slots, self._span)
        row = np.uint64(self._row)
        stage = np.uint64(self._stages[buffer].data_ptr()) + firsts.astype(np.uint64) * row
        host = np.uint64(self._host_addr) + slots[firsts].astype(np.uint64) * row
        sizes = (lengths.astype(np.uint64) - np.uint64(1)) * row + np.uint64(self._page)
        return stage, host, sizes
