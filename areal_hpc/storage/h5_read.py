"""Opening a rollout log (storage/rollout_log.py) for reading without a hang, and what h5py
raises on a damaged file as one RolloutLogError naming the file: the superblock read for the
writer's status flags and the end-of-file address, SWMR reads with bounded retries."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
from pathlib import Path

import h5py

log = logging.getLogger(__name__)

_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


class RolloutLogError(ValueError):
    """The file is not a readable rollout log: not HDF5, damaged or truncated, another program's
    HDF5, or a schema this code does not know. The message names the file."""


def text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _superblock(path: Path) -> tuple[int | None, int]:
    """(end-of-file address, status flags) of an HDF5 file's superblock (at offset 0).

    The address is None when unknown or not binding: a writer still has the file open, or
    crashed, in SWMR mode (the flags say so), where it may run ahead of the bytes on disk. The
    flags (superblock v2 on; 0 in older ones) are non-zero while a writer has the file open, and
    stay so after a writer crashed."""
    with open(path, "rb") as fh:
        head = fh.read(64)
    if not head.startswith(_HDF5_SIGNATURE) or len(head) < 64:
        return None, 0
    version = head[8]
    if version >= 2:                # signature, version, offset/length sizes, flags, addresses
        size, flags, start = head[9], head[11], 12
    else:                           # v0/v1: versions of sub-structures, K values, then addresses
        size, flags, start = head[13], int.from_bytes(head[20:24], "little"), 24 + 4 * version
    if flags or size not in (2, 4, 8):
        return None, flags
    addr = lambda k: int.from_bytes(head[start + k * size: start + (k + 1) * size], "little")
    return addr(0) + addr(2), 0     # base address + end-of-file address


# A reader in SWMR mode retries a metadata read that fails its checksum (the writer may be
# halfway through a flush), waiting twice as long each time, from 1 ns. HDF5's default of 100
# attempts makes a damaged file hang its reader for hours; measured with HDF5 2.0: 24 attempts
# give up after 0.02 s, 28 after 0.27 s, 32 after 4.3 s. A live writer's flush is over in far
# less than the 0.27 s that 28 attempts wait in all.
SWMR_READ_ATTEMPTS = 28


@functools.lru_cache(maxsize=4)
def hdf5_function(name: str):
    """A function of the HDF5 library h5py has loaded (found in this process's memory map; h5py
    does not wrap every one), or None where that cannot be done."""
    try:
        with open("/proc/self/maps") as fh:
            libs = {line.split()[-1] for line in fh if "/libhdf5" in line}
        names = {p: os.path.basename(p) for p in libs}
        lib = next(p for p in sorted(libs)
                   if names[p].startswith("libhdf5") and "_hl" not in names[p])
        return getattr(ctypes.CDLL(lib), name)
    except (OSError, StopIteration, AttributeError):
        return None


def _set_read_attempts():
    """HDF5's H5Pset_metadata_read_attempts, or None."""
    fn = hdf5_function("H5Pset_metadata_read_attempts")
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_int64, ctypes.c_uint], ctypes.c_int
    return fn


def open_swmr(path: Path) -> h5py.File:
    """Open for SWMR reading with at most SWMR_READ_ATTEMPTS attempts per metadata read."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_LATEST, h5py.h5f.LIBVER_LATEST)
    setter = _set_read_attempts()
    if setter is None or setter(fapl.id, SWMR_READ_ATTEMPTS) < 0:
        log.warning("%s: cannot bound HDF5's SWMR read retries (H5Pset_metadata_read_attempts "
                    "not found); a damaged file may make this read hang", path)
    fid = h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDONLY | h5py.h5f.ACC_SWMR_READ,
                        fapl=fapl)
    return h5py.File(fid)


def first_line(exc: BaseException) -> str:
    message = text(exc.args[0]) if exc.args else ""
    return (message.splitlines() or [type(exc).__name__])[0]


def open_for_reading(path: Path) -> h5py.File:
    """Open a rollout log for reading; a file that is not HDF5, is cut short or damaged is a
    RolloutLogError (at once: never a hang).

    A closed file (no writer has it open: the superblock's status flags are clear) is opened
    normally, where HDF5 reports a failed checksum at once. Only a file that a writer has open
    (a live job), or had when it crashed, is opened in SWMR mode, with bounded retries
    (SWMR_READ_ATTEMPTS). HDF5 itself does not notice a truncated file opened for SWMR
    reading, so a closed file's size is checked against the end-of-file address its superblock
    records."""
    if not h5py.is_hdf5(path):
        raise RolloutLogError(f"{path}: not an HDF5 file")
    (eof, flags), size = _superblock(path), path.stat().st_size
    if eof is not None and size < eof:
        raise RolloutLogError(f"{path}: truncated HDF5 file ({size} bytes, the file says {eof})")
    if not flags:
        try:
            return h5py.File(path, "r")
        except OSError as e:
            first = first_line(e)
            # a writer opened it since the flags were read: read it as a live file
            if "already open for write" not in first and "consistency flags" not in first:
                raise RolloutLogError(f"{path}: damaged HDF5 file ({first})") from None
    try:
        return open_swmr(path)
    except (OSError, RuntimeError, KeyError, ValueError) as e:
        raise RolloutLogError(f"{path}: damaged HDF5 file ({first_line(e)})") from None


@contextlib.contextmanager
def damage_is_an_error(path: Path, what: str = ""):
    """Turn what h5py raises on a damaged file (checksum failures, unreadable objects: OSError,
    KeyError, RuntimeError, TypeError, ...) into a RolloutLogError naming the file."""
    try:
        yield
    except (RolloutLogError, IndexError):
        raise
    except (OSError, KeyError, RuntimeError, TypeError, ValueError, AttributeError) as e:
        where = f" ({what})" if what else ""
        raise RolloutLogError(f"{path}: damaged rollout log{where}: {first_line(e)}") from None


def rewrite_committed(path: Path, keep) -> None:
    """Copy the committed rows of a log whose writer died into a fresh file that replaces it;
    `keep(src, group, name)`: how many entries of /group/name the committed rows hold.

    HDF5 refuses to open such a file for writing until its status flags are cleared (h5clear);
    reading it in SWMR mode works, and every row up to the last flush is intact."""
    tmp = path.with_name(path.name + ".recover")
    with open_swmr(path) as src, h5py.File(tmp, "w", libver="latest") as dst:
        for key, value in src.attrs.items():
            dst.attrs[key] = value
        for grp in src:
            g = dst.create_group(grp)
            for name, ds in src[grp].items():
                g.create_dataset(name, data=ds[:keep(src, grp, name)], maxshape=(None,),
                                 chunks=ds.chunks, fletcher32=True)
    os.replace(tmp, path)
