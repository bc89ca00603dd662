"""Child process for the io_uring fallback test: installs a seccomp filter that refuses
io_uring_setup (as Docker's default profile does), then opens a store and reports what it got.

Usage: python seccomp_child.py DIR
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import platform
import sys

NR_IO_URING_SETUP = 425  # same number on x86_64 and aarch64
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_RET_K = 0x20, 0x15, 0x06


class SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]


def refuse_io_uring() -> None:
    program = (SockFilter * 4)(
        SockFilter(BPF_LD_W_ABS, 0, 0, 0),  # A = seccomp_data.nr
        SockFilter(BPF_JEQ_K, 0, 1, NR_IO_URING_SETUP),
        SockFilter(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM),
        SockFilter(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    )
    prog = SockFprog(len(program), program)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(SECCOMP)")


def main() -> None:
    assert platform.machine() in ("x86_64", "aarch64")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    refuse_io_uring()
    from flexkv_py import BlockStore, IoEngineError
    from flexkv_py._native import io_uring_available

    report: dict[str, object] = {"io_uring_available": io_uring_available()}
    with BlockStore(sys.argv[1], 16 << 20) as store:
        report["auto_engine"] = store.io_engine
        data = bytes(range(256)) * 64
        report["put"] = store.put(b"k", data).status
        report["roundtrip"] = store.read(b"k") == data
    try:
        BlockStore(sys.argv[1], 16 << 20, io_engine="io_uring")
        report["forced"] = "opened"
    except IoEngineError as e:
        report["forced"] = f"IoEngineError: {e}"
    print(json.dumps(report))


if __name__ == "__main__":
    main()
