"""Gather/scatter with plain torch ops: the CPU path (CI, CPU-only hosts) and a CUDA fallback.

CPU: one ``index_select`` + ``index_copy_`` per copy run (per layer, or per layer-and-head),
each over the whole list of blocks.

CUDA (fallback when neither Triton nor the copy-engine path is usable): gather the runs of up to
``chunk_pages`` blocks into a GPU staging buffer (one kernel per run), then one copy per whole
page (~MiBs, so the copy engines run near full speed). Uses all SMs for the gathers.
"""

from __future__ import annotations

import numpy as np
import torch

from flexkv_py.transfer.kv_layout import KVPageGeometry


class TorchCopyPath:
    name = "torch"

    def __init__(self, geometry: KVPageGeometry, host: torch.Tensor, *, chunk_pages: int = 64):
        self._geom = geometry
        self._host = host  # uint8 [num_slots, slot_nbytes]
        self._chunk_pages = chunk_pages
        # Word-sized elements: torch's index kernels are ~8x faster on int64 than on uint8.
        word = _word_size(geometry, host)
        dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
        self._word = word
        self._host_words = host.view(dtype)
        self._views = [
            geometry.storages[s.storage]
            .view(dtype)
            .as_strided(
                (geometry.num_blocks, s.nbytes // word),
                (s.block_stride // word, 1),
                s.gpu_offset // word,
            )
            for s in geometry.segments
        ]
        self.is_cuda = geometry.device.type == "cuda"
        self.sms_used = (
            torch.cuda.get_device_properties(geometry.device).multi_processor_count
            if self.is_cuda
            else 0
        )

    def enqueue(self, direction: str, gpu_ids: np.ndarray, slots: np.ndarray) -> None:
        """CPU: copies now. CUDA: enqueues on the current stream."""
        if self.is_cuda:
            self._enqueue_cuda(direction, gpu_ids, slots)
            return
        ids = torch.from_numpy(gpu_ids)
        sl = torch.from_numpy(slots)
        w = self._word
        for seg, view in zip(self._geom.segments, self._views, strict=True):
            host = self._host_words[:, seg.host_offset // w : (seg.host_offset + seg.nbytes) // w]
            if direction == "d2h":
                host.index_put_((sl,), view.index_select(0, ids))
            else:
                view.index_put_((ids,), host.index_select(0, sl))

    def _enqueue_cuda(self, direction: str, gpu_ids: np.ndarray, slots: np.ndarray) -> None:
        dev = self._geom.device
        page = self._geom.page_nbytes
        for start in range(0, len(gpu_ids), self._chunk_pages):
            ids_np = gpu_ids[start : start + self._chunk_pages]
            slots_np = slots[start : start + self._chunk_pages]
            ids = torch.from_numpy(ids_np).to(dev, non_blocking=False)
            stage = torch.empty((len(ids_np), page), dtype=torch.uint8, device=dev)
            if direction == "d2h":
                for seg, view in zip(self._geom.segments, self._views, strict=True):
                    stage[:, seg.host_offset : seg.host_offset + seg.nbytes].copy_(
                        view.index_select(0, ids).view(torch.uint8)
                    )
                for row, slot in enumerate(slots_np.tolist()):
                    self._host[slot, :page].copy_(stage[row], non_blocking=True)
            else:
                for row, slot in enumerate(slots_np.tolist()):
                    stage[row].copy_(self._host[slot, :page], non_blocking=True)
                for seg, view in zip(self._geom.segments, self._views, strict=True):
                    rows = stage[:, seg.host_offset : seg.host_offset + seg.nbytes]
                    view.index_copy_(0, ids, rows.view(view.dtype))


def _word_size(geometry: KVPageGeometry, host: torch.Tensor) -> int:
    nums = [host.shape[1]] + [st.numel() for st in geometry.storages]
    for s in geometry.segments:
        nums += [s.gpu_offset, s.block_stride, s.host_offset, s.nbytes]
    for word in (8, 4, 2):
        if all(n % word == 0 for n in nums):
            return word
    return 1
