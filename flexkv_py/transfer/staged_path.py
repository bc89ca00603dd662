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

An H2D batch ends with a scatter no DMA hides (8 SMs move a 32-page chunk, 72 MiB, in ~0.23 ms on
an H200: 2 % of a 4K-token restore). Its last chunk is therefore cut in halves down to
``tail_pages`` (32 -> 16, 8, 8): each DMA still hides the scatter before it, and the exposed one
is a quarter as long. The scatters' (GPU block, staging row) pairs of the whole batch go up in one
pinned copy right after its first DMA is issued, not one small copy per chunk (less host time
per chunk: the tail's small chunks must be issued faster than their DMAs run).

Pages of consecutive host slots go as one copy (`coalesce`): a chunk's staging rows are
consecutive, and so are the slots of blocks stored together, and the driver issues one large copy
faster than 32 page copies (a restore's first DMA waits for that issue).

Device memory cost: 2 x ``chunk_pages`` pages (e.g. 2 x 32 x 2.25 MiB = 144 MiB).
"""

from __future__ import annotations

import numpy as np
import torch

from flexkv_py.transfer.copy_engine_path import BatchCopier, coalesce
from flexkv_py.transfer.kv_layout import KVPageGeometry
from flexkv_py.transfer.triton_path import TritonCopyPath

COALESCE = True  # benches/restore_breakdown.py measures it off


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
        tail_pages: int = 8,
    ) -> None:
        if geometry.device.type != "cuda":
            raise ValueError("the staged path needs CUDA tensors")
        dev = geometry.device
        self._copier = BatchCopier(prefer_overlap=prefer_overlap)
        self._chunk = chunk_pages
        self._tail = max(1, min(tail_pages, chunk_pages))
        self._row = host.shape[1]
        self._page = geometry.page_nbytes
        self._host_addr = host.data_ptr()
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
        if direction == "h2d":
            self._enqueue_h2d(gpu_ids, slots)
            return None
        main = torch.cuda.current_stream()
        dma = self._dma_stream
        sizes = np.full(self._chunk, self._page, dtype=np.uint64)
        for start in range(0, len(gpu_ids), self._chunk):
            b = self._next_buffer
            self._next_buffer = 1 - b
            ids = gpu_ids[start : start + self._chunk]
            sl = slots[start : start + self._chunk].astype(np.uint64)
            k = len(ids)
            rows = np.arange(k, dtype=np.int64)
            stage = np.uint64(self._stages[b].data_ptr()) + rows.astype(np.uint64) * np.uint64(
                self._row
            )
            host = np.uint64(self._host_addr) + sl * np.uint64(self._row)
            ready = torch.cuda.Event()
            if direction == "d2h":
                if self._used[b]:
                    main.wait_event(self._free[b])  # previous DMA out of this buffer is done
                self._kernels[b].enqueue("d2h", ids, rows)  # gather into staging (main)
                ready.record(main)
                dma.wait_event(ready)
                self._copy(host, stage, sizes[:k], dma.cuda_stream)
                self._free[b].record(dma)
            else:
                if self._used[b]:
                    dma.wait_event(self._free[b])  # previous scatter from this buffer is done
                self._copy(stage, host, sizes[:k], dma.cuda_stream)
                ready.record(dma)
                main.wait_event(ready)
                self._kernels[b].enqueue("h2d", ids, rows)  # scatter from staging (main)
                self._free[b].record(main)
            self._used[b] = True
        return dma if direction == "d2h" else None

    def _copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        if COALESCE and len(sizes) > 1:
            dsts, srcs, sizes = coalesce(dsts, srcs, sizes)
        self._copier.copy(dsts, srcs, sizes, stream)

    def _enqueue_h2d(self, gpu_ids: np.ndarray, slots: np.ndarray) -> None:
        """Per chunk (`h2d_chunks`): batched page copies into a staging buffer on the DMA
        stream, then the scatter out of it on the current stream."""
        main = torch.cuda.current_stream()
        dma = self._dma_stream
        chunks = h2d_chunks(len(gpu_ids), self._chunk, self._tail)
        sizes = np.full(self._chunk, self._page, dtype=np.uint64)
        row = np.uint64(self._row)
        host_rows = np.uint64(self._host_addr) + slots.astype(np.uint64) * row
        pairs: torch.Tensor | None = None
        for start, end in chunks:
            b = self._next_buffer
            self._next_buffer = 1 - b
            k = end - start
            stage = np.uint64(self._stages[b].data_ptr()) + np.arange(k, dtype=np.uint64) * row
            ready = torch.cuda.Event()
            if self._used[b]:
                dma.wait_event(self._free[b])  # previous scatter from this buffer is done
            self._copy(stage, host_rows[start:end], sizes[:k], dma.cuda_stream)
            ready.record(dma)
            if pairs is None:  # after the first DMA is issued: it need not wait for this
                pairs = self._upload_pairs(gpu_ids, chunks, main.device)
            main.wait_event(ready)
            self._kernels[b].enqueue_pairs("h2d", pairs[2 * start : 2 * end], k)
            self._free[b].record(main)
            self._used[b] = True

    @staticmethod
    def _upload_pairs(
        gpu_ids: np.ndarray, chunks: list[tuple[int, int]], device: torch.device
    ) -> torch.Tensor:
        """Every chunk's scatter pairs ([GPU block ids, staging rows] of its k pages, at
        2 * start), in one pinned upload on the current stream."""
        flat = np.empty(2 * len(gpu_ids), dtype=np.int64)
        for start, end in chunks:
            flat[2 * start : start + end] = gpu_ids[start:end]
            flat[start + end : 2 * end] = np.arange(end - start, dtype=np.int64)
        return torch.from_numpy(flat).pin_memory().to(device, non_blocking=True)


def h2d_chunks(n: int, chunk: int, tail: int) -> list[tuple[int, int]]:
    """(start, end) of an H2D batch's chunks: `chunk` pages each, the last `chunk` (or fewer)
    cut in halves down to `tail` pages (32, tail 8: ..., 32, 16, 8, 8), so the scatter that ends
    the batch is short and each DMA is still at least about half the one before (it hides the
    scatter before it)."""
    out: list[tuple[int, int]] = []
    start = 0
    while n - start > chunk:
        out.append((start, start + chunk))
        start += chunk
    while n - start > tail:
        take = max(tail, (n - start + 1) // 2)
        out.append((start, start + take))
        start += take
    if start < n:
        out.append((start, n))
    return out
