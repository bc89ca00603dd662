"""Copy-engine path: one ``cuMemcpyBatchAsync`` call for the whole list of copies (no SMs).

Each (block, copy run) becomes one pointer-to-pointer copy; the driver feeds them to the DMA
engines. The descriptor arrays are built with numpy and passed by pointer (ctypes on the driver
entry point), so a batch of ~10^5 copies costs about a millisecond of host time instead of the
per-element conversion the cuda-bindings wrapper would do.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import numpy as np
import torch

from flexkv_py.transfer.kv_layout import KVPageGeometry

logger = logging.getLogger(__name__)

_CUDA_ERROR_INVALID_VALUE = 1
_BATCH_FN_TYPE = ctypes.CFUNCTYPE(
    ctypes.c_int,  # CUresult
    ctypes.c_void_p,  # CUdeviceptr* dsts
    ctypes.c_void_p,  # CUdeviceptr* srcs
    ctypes.c_void_p,  # size_t* sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p,  # CUmemcpyAttributes* attrs
    ctypes.c_void_p,  # size_t* attrsIdxs
    ctypes.c_size_t,  # numAttrs
    ctypes.c_void_p,  # CUstream
)


def _load_batch_fn(prefer_overlap: bool) -> tuple[Any, Any]:
    """(ctypes function or None, attributes object). Raises ImportError if unavailable."""
    from cuda.bindings import driver

    try:
        (err,) = driver.cuInit(0)
    except Exception as e:  # no driver library at all
        raise ImportError(f"CUDA driver unavailable: {e}") from e
    if err != driver.CUresult.CUDA_SUCCESS:
        raise ImportError(f"cuInit failed: {err}")
    attrs = driver.CUmemcpyAttributes()
    attrs.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    if prefer_overlap:  # a hint: let the copies run beside the model's kernels
        attrs.flags = int(driver.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE)
    fn = None
    try:
        # CUDA 13 signature (no failIdx); the versioned lookup gives the matching entry point.
        err, pfn, _status = driver.cuGetProcAddress(
            b"cuMemcpyBatchAsync",
            13000,
            driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT,
        )
        if err == driver.CUresult.CUDA_SUCCESS and int(pfn):
            fn = _BATCH_FN_TYPE(int(pfn))
    except Exception as e:  # older bindings: fall back to the wrapper
        logger.debug("cuGetProcAddress(cuMemcpyBatchAsync) failed: %s", e)
    if fn is None and not hasattr(driver, "cuMemcpyBatchAsync"):
        raise ImportError("this CUDA driver / cuda-bindings has no cuMemcpyBatchAsync")
    return fn, attrs


def coalesce(
    dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same copies with each run of back-to-back ones (copy i+1 starts where copy i ends,
    at both ends) merged into one; the arrays unchanged when nothing merges."""
    ends_d = dsts[:-1] + sizes[:-1]
    ends_s = srcs[:-1] + sizes[:-1]
    joins = (dsts[1:] == ends_d) & (srcs[1:] == ends_s)
    if not joins.any():
        return dsts, srcs, sizes
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    merged = np.add.reduceat(sizes, starts).astype(np.uint64)
    return (
        np.ascontiguousarray(dsts[starts]),
        np.ascontiguousarray(srcs[starts]),
        merged,
    )


class BatchCopier:
    """``cuMemcpyBatchAsync`` on numpy descriptor arrays, on a given stream."""

    def __init__(self, *, prefer_overlap: bool = True) -> None:
        self._fn, self._attrs = _load_batch_fn(prefer_overlap)
        self._attrs_idx = np.zeros(1, dtype=np.uint64)
        self.ctypes_entry = self._fn is not None

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        count = len(sizes)
        if count == 0:
            return
        if self._fn is not None:
            err = self._fn(
                dsts.ctypes.data,
                srcs.ctypes.data,
                sizes.ctypes.data,
                count,
                int(self._attrs.getPtr()),
                self._attrs_idx.ctypes.data,
                1,
                stream,
            )
        else:
            from cuda.bindings import driver

            (err,) = driver.cuMemcpyBatchAsync(
                [driver.CUdeviceptr(int(x)) for x in dsts],
                [driver.CUdeviceptr(int(x)) for x in srcs],
                [int(x) for x in sizes],
                count,
                [self._attrs],
                [0],
                1,
                driver.CUstream(stream),
            )
            err = int(err)
        if err == _CUDA_ERROR_INVALID_VALUE and count > 4096:
            # Some drivers cap the batch length: split and retry (still few calls).
            half = count // 2
            self.copy(dsts[:half], srcs[:half], sizes[:half], stream)
            self.copy(dsts[half:], srcs[half:], sizes[half:], stream)
            return
        if err != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync failed with CUresult {err} ({count} copies)")


class CopyEnginePath:
    name = "copy_engine"
    sms_used = 0

    def __init__(
        self, geometry: KVPageGeometry, host: torch.Tensor, *, prefer_overlap: bool = True
    ) -> None:
        if geometry.device.type != "cuda":
            raise ValueError("the copy-engine path needs CUDA tensors")
        self._copier = BatchCopier(prefer_overlap=prefer_overlap)
        segs = geometry.segments
        self._seg_gpu = np.array(
            [geometry.storage_address(s.storage) + s.gpu_offset for s in segs], dtype=np.uint64
        )
        self._seg_stride = np.array([s.block_stride for s in segs], dtype=np.uint64)
        self._seg_host = np.array([s.host_offset for s in segs], dtype=np.uint64)
        self._seg_len = np.array([s.nbytes for s in segs], dtype=np.uint64)
        self._host_addr = np.uint64(host.data_ptr())
        self._slot_nbytes = np.uint64(host.shape[1])

    def descriptors(self, gpu_ids: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, ...]:
        ids = gpu_ids.astype(np.uint64)[:, None]
        sl = slots.astype(np.uint64)[:, None]
        gpu = (self._seg_gpu[None, :] + ids * self._seg_stride[None, :]).ravel()
        host = (self._host_addr + sl * self._slot_nbytes + self._seg_host[None, :]).ravel()
        sizes = np.broadcast_to(self._seg_len[None, :], (len(gpu_ids), len(self._seg_len)))
        return gpu, host, np.ascontiguousarray(sizes).ravel()

    def enqueue(self, direction: str, gpu_ids: np.ndarray, slots: np.ndarray) -> None:
        gpu, host, sizes = self.descriptors(gpu_ids, slots)
        dsts, srcs = (host, gpu) if direction == "d2h" else (gpu, host)
        self._copier.copy(dsts, srcs, sizes, torch.cuda.current_stream().cuda_stream)
