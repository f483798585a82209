#!/usr/bin/env python3
"""What one cuMemSetAccess or one cuMemUnmap over several adjacent mappings costs, against one
call per mapping: the question behind batching them in the virtual-memory modes.

For each piece size and range size: create the pieces, map them side by side, then either set
access (and later unmap) once over the whole range or once per piece, timing each way. After a
whole-range set-access, every byte of the range is written and one byte of each MiB read back
(so access was really granted on every piece); after a whole-range unmap, the first piece is mapped again (so the
range was really unmapped). Prints one JSON object per line. Needs only libcuda and python3.

    python3 scripts/vmm_range_bench.py [REPEATS]
"""
import ctypes as C
import json
import statistics
import sys
import time

MIB = 1 << 20
cu = C.CDLL("libcuda.so.1")


class Location(C.Structure):
    _fields_ = [("type", C.c_int), ("id", C.c_int)]


class AllocFlags(C.Structure):
    _fields_ = [
        ("compressionType", C.c_ubyte),
        ("gpuDirectRDMACapable", C.c_ubyte),
        ("usage", C.c_ushort),
        ("reserved", C.c_ubyte * 4),
    ]


class Prop(C.Structure):
    _fields_ = [
        ("type", C.c_int),
        ("requestedHandleTypes", C.c_int),
        ("location", Location),
        ("win32HandleMetaData", C.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class AccessDesc(C.Structure):
    _fields_ = [("location", Location), ("flags", C.c_int)]


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUresult {rc}")


def now():
    return time.perf_counter()


check(cu.cuInit(0), "cuInit")
dev = C.c_int()
check(cu.cuDeviceGet(C.byref(dev), 0), "cuDeviceGet")
ctx = C.c_void_p()
check(cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

prop = Prop()
prop.type = 1  # pinned
prop.location.type = 1  # device
prop.location.id = 0
access = AccessDesc()
access.location.type = 1
access.location.id = 0
access.flags = 3  # read and write

cu.cuMemAddressReserve.argtypes = [C.POINTER(C.c_uint64), C.c_size_t, C.c_size_t, C.c_uint64, C.c_uint64]
cu.cuMemCreate.argtypes = [C.POINTER(C.c_uint64), C.c_size_t, C.POINTER(Prop), C.c_uint64]
cu.cuMemMap.argtypes = [C.c_uint64, C.c_size_t, C.c_size_t, C.c_uint64, C.c_uint64]
cu.cuMemSetAccess.argtypes = [C.c_uint64, C.c_size_t, C.POINTER(AccessDesc), C.c_size_t]
cu.cuMemUnmap.argtypes = [C.c_uint64, C.c_size_t]
cu.cuMemRelease.argtypes = [C.c_uint64]
cu.cuMemsetD8_v2.argtypes = [C.c_uint64, C.c_ubyte, C.c_size_t]
cu.cuMemcpyDtoH_v2.argtypes = [C.c_void_p, C.c_uint64, C.c_size_t]
cu.cuCtxSynchronize.argtypes = []

RESERVE = 4096 * MIB
base = C.c_uint64()
check(cu.cuMemAddressReserve(C.byref(base), RESERVE, 0, 0, 0), "cuMemAddressReserve")
base = base.value


def create(n, piece):
    hs = []
    for _ in range(n):
        h = C.c_uint64()
        check(cu.cuMemCreate(C.byref(h), piece, C.byref(prop), 0), "cuMemCreate")
        hs.append(h.value)
    return hs


def map_all(hs, piece):
    for i, h in enumerate(hs):
        check(cu.cuMemMap(base + i * piece, piece, 0, h, 0), "cuMemMap")


def verify(total):
    """Write every byte of the range and read a byte of each MiB back."""
    check(cu.cuMemsetD8_v2(base, 0x5A, total), "cuMemsetD8")
    check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
    byte = C.c_ubyte()
    for off in range(0, total, MIB):
        check(cu.cuMemcpyDtoH_v2(C.byref(byte), base + off, 1), "cuMemcpyDtoH")
        if byte.value != 0x5A:
            return False
    return True


def one_round(piece, total, whole):
    n = total // piece
    hs = create(n, piece)
    map_all(hs, piece)
    t0 = now()
    if whole:
        check(cu.cuMemSetAccess(base, total, C.byref(access), 1), "cuMemSetAccess(range)")
    else:
        for i in range(n):
            check(cu.cuMemSetAccess(base + i * piece, piece, C.byref(access), 1), "cuMemSetAccess")
    t_access = now() - t0
    ok = verify(total)
    t0 = now()
    unmap_rc = 0
    if whole:
        unmap_rc = cu.cuMemUnmap(base, total)
        if unmap_rc != 0:
            for i in range(n):
                check(cu.cuMemUnmap(base + i * piece, piece), "cuMemUnmap")
    else:
        for i in range(n):
            check(cu.cuMemUnmap(base + i * piece, piece), "cuMemUnmap")
    t_unmap = now() - t0
    # The range is unmapped if its first piece can be mapped there again.
    remap_rc = cu.cuMemMap(base, piece, 0, hs[0], 0)
    if remap_rc == 0:
        check(cu.cuMemUnmap(base, piece), "cuMemUnmap")
    t0 = now()
    for h in hs:
        check(cu.cuMemRelease(h), "cuMemRelease")
    t_release = now() - t0
    return {
        "set_access_us": t_access * 1e6,
        "unmap_us": t_unmap * 1e6,
        "release_us": t_release * 1e6,
        "contents_ok": ok,
        "unmap_rc": unmap_rc,
        "remap_after_unmap_rc": remap_rc,
    }


def main():
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    for piece in (2 * MIB, 8 * MIB, 20 * MIB):
        for total in (piece, 40 * MIB, 160 * MIB, 1024 * MIB):
            if total < piece or total % piece:
                continue
            for whole in (True, False):
                if total == piece and not whole:
                    continue
                rounds = [one_round(piece, total, whole) for _ in range(repeats)]
                med = lambda k: round(statistics.median(r[k] for r in rounds), 1)
                print(json.dumps({
                    "piece_mib": piece // MIB,
                    "range_mib": total // MIB,
                    "pieces": total // piece,
                    "calls": "one per range" if whole else "one per piece",
                    "set_access_us": med("set_access_us"),
                    "unmap_us": med("unmap_us"),
                    "release_us": med("release_us"),
                    "contents_ok": all(r["contents_ok"] for r in rounds),
                    "unmap_rc": sorted({r["unmap_rc"] for r in rounds}),
                    "remap_after_unmap_rc": sorted({r["remap_after_unmap_rc"] for r in rounds}),
                }), flush=True)


main()
