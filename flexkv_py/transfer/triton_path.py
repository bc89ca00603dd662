"""One Triton kernel moves a whole list of (GPU block, host slot) pairs through UVA.

The host pool is registered with CUDA, so a kernel can load from / store to it directly over
PCIe. Work is cut into fixed tiles (a tile is part of one copy run of one block); a persistent
grid of a few programs (default 8, i.e. ~6% of an H200's SMs) walks all tiles, so transfers
leave the rest of the GPU to the model. ``programs=0`` launches one program per tile instead.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from flexkv_py.transfer.kv_layout import KVPageGeometry


@triton.jit
def _page_copy_kernel(
    gpu_ptr,  # int64 words; every GPU address is an offset from here
    host_ptr,  # int64 words; the host pool
    pairs_ptr,  # int64 [2, n_pairs]: GPU block ids, then host slots
    n_pairs,
    t_gpu_off,  # per tile of one page: word offset of block 0's tile from gpu_ptr
    t_gpu_stride,  # words between consecutive blocks
    t_host_off,  # word offset inside the host page
    t_len,  # words in the tile (== TILE when EVEN)
    tiles_per_page,
    slot_words,
    nprog,
    TILE: tl.constexpr,
    D2H: tl.constexpr,
    EVEN: tl.constexpr,
    VEC: tl.constexpr,
):
    pid = tl.program_id(0)
    total = n_pairs * tiles_per_page
    offs = tl.arange(0, TILE)
    for w in range(pid, total, nprog):
        p = w // tiles_per_page
        t = w - p * tiles_per_page
        g = tl.load(pairs_ptr + p)
        s = tl.load(pairs_ptr + n_pairs + p)
        goff = tl.load(t_gpu_off + t) + g * tl.load(t_gpu_stride + t)
        hoff = tl.load(t_host_off + t) + s * slot_words
        goff = tl.multiple_of(goff, VEC)
        hoff = tl.multiple_of(hoff, VEC)
        if D2H:
            src = gpu_ptr + goff
            dst = host_ptr + hoff
        else:
            src = host_ptr + hoff
            dst = gpu_ptr + goff
        if EVEN:
            tl.store(dst + offs, tl.load(src + offs))
        else:
            m = offs < tl.load(t_len + t)
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


class TritonCopyPath:
    name = "triton"

    def __init__(
        self,
        geometry: KVPageGeometry,
        host: torch.Tensor,
        *,
        programs: int = 8,
        tile_bytes: int = 16384,
        num_warps: int = 8,
    ) -> None:
        if geometry.device.type != "cuda":
            raise ValueError("the Triton path needs CUDA tensors")
        dev = geometry.device
        self._dev = dev
        self._host_words = triton.reinterpret(host, tl.int64)
        addrs = [geometry.storage_address(i) for i in range(len(geometry.storages))]
        base_index = int(np.argmin(addrs))
        base = addrs[base_index]
        self._gpu_words = triton.reinterpret(geometry.storages[base_index], tl.int64)
        slot_nbytes = host.shape[1]
        nums = [slot_nbytes, host.data_ptr()] + [a - base for a in addrs]
        for s in geometry.segments:
            nums += [s.gpu_offset, s.block_stride, s.host_offset, s.nbytes]
        if any(n % 8 for n in nums):
            raise ValueError("the Triton path needs 8-byte aligned copy runs")
        self._vec = 2 if all(n % 16 == 0 for n in nums) else 1
        tile_words = tile_bytes // 8
        rows = []
        for s in geometry.segments:
            gpu_rel = addrs[s.storage] - base + s.gpu_offset
            for off in range(0, s.nbytes, tile_bytes):
                n = min(tile_bytes, s.nbytes - off)
                rows.append(
                    ((gpu_rel + off) // 8, s.block_stride // 8, (s.host_offset + off) // 8, n // 8)
                )
        table = torch.tensor(rows, dtype=torch.int64).t().contiguous().to(dev)
        self._t_gpu_off, self._t_gpu_stride, self._t_host_off, self._t_len = table.unbind(0)
        self._tiles_per_page = len(rows)
        self._even = all(r[3] == tile_words for r in rows)
        self._tile_words = tile_words
        self._slot_words = slot_nbytes // 8
        self._programs = programs
        self._num_warps = num_warps
        sm_count = torch.cuda.get_device_properties(dev).multi_processor_count
        self.sms_used = sm_count if programs <= 0 else min(programs, sm_count)

    def enqueue(self, direction: str, gpu_ids: np.ndarray, slots: np.ndarray) -> None:
        pairs_host = torch.from_numpy(np.stack([gpu_ids, slots])).pin_memory()
        self.enqueue_pairs(direction, pairs_host.to(self._dev, non_blocking=True), len(gpu_ids))

    def enqueue_pairs(self, direction: str, pairs: torch.Tensor, n: int) -> None:
        """`enqueue` of pairs already on the device: int64, GPU block ids then host slots (n
        each, contiguous), e.g. one slice of an upload that serves several launches."""
        total = n * self._tiles_per_page
        nprog = total if self._programs <= 0 else min(self._programs, total)
        _page_copy_kernel[(nprog,)](
            self._gpu_words,
            self._host_words,
            pairs,
            n,
            self._t_gpu_off,
            self._t_gpu_stride,
            self._t_host_off,
            self._t_len,
            self._tiles_per_page,
            self._slot_words,
            nprog,
            TILE=self._tile_words,
            D2H=direction == "d2h",
            EVEN=self._even,
            VEC=self._vec,
            num_warps=self._num_warps,
        )
