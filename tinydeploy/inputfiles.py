"""Reading what the user hands in (the model, --inputs, calibration data) defensively: only
regular files (a FIFO, a device or a folder is refused without waiting on it: the file is opened
non-blocking and checked with fstat), never more bytes than the caller's limit, arrays of .npz
and .npy files read one by one with their header checked first (so a small compressed archive
cannot expand into gigabytes), and every failure is one TinydeployError naming the file."""
from __future__ import annotations

import os
import stat
import sys
import zipfile

import numpy as np

from tinydeploy.codegen.cfmt import printable
from tinydeploy.errors import TinydeployError

NPZ_MAX_MEMBERS = 100_000     # arrays in one .npz (its directory is read whole)
NPY_HEADER_MAX = 1 << 16      # bytes of an .npy header (numpy writes a few hundred)

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
          (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))


def open_regular(path, what: str):
    """(binary file object, size) of the regular file `path`; `what` names it in errors."""
    shown = printable(str(path))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise TinydeployError(f"{what} {shown!r} does not exist") from None
    except OSError as e:
        raise TinydeployError(f"cannot read {what} {shown!r}: {printable(e.strerror or str(e), 80)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((k for test, k in _KINDS if test(st.st_mode)), "a special file")
            raise TinydeployError(f"{what} {shown!r} is not a file ({kind})")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def regular_size(path, what: str) -> int:
    """The size of the regular file `path` (errors as open_regular)."""
    f, size = open_regular(path, what)
    f.close()
    return size


def read_regular(path, what: str, limit: int) -> bytes:
    """The bytes of the regular file `path`, refused when it holds more than `limit`."""
    f, size = open_regular(path, what)
    with f:
        if size > limit:
            raise TinydeployError(f"{what} {printable(str(path))!r} is {size} bytes; at most {limit} are read")
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise TinydeployError(f"cannot read {what} {printable(str(path))!r}: "
                                  f"{printable(e.strerror or str(e), 80)}") from None
    if len(data) > limit:
        raise TinydeployError(f"{what} {printable(str(path))!r} grew past {limit} bytes while it was read")
    return data


def _dtype_text(dt: np.dtype) -> str:
    """float32, or 'big-endian float32 (>f4)' when the byte order is not this machine's."""
    if dt.byteorder not in ("=", "|") and dt.newbyteorder("=") != dt:
        order = "big" if dt.byteorder == ">" else "little"
        return f"{order}-endian {dt.name} ({dt.str}; this machine is {sys.byteorder}-endian)"
    return dt.name


def _read_npy(f, where: str, want: tuple[tuple[int, ...], np.dtype] | None, limit: int) -> np.ndarray:
    """One .npy stream: the header first (shape and type checked against `want`), then exactly
    the bytes it announces."""
    try:
        version = np.lib.format.read_magic(f)
        header = (np.lib.format.read_array_header_1_0 if version == (1, 0) else
                  np.lib.format.read_array_header_2_0)
        shape, fortran, dtype = header(f, max_header_size=NPY_HEADER_MAX)
    except Exception as e:
        raise TinydeployError(f"{where} is not a numpy array ({printable(str(e).splitlines()[0] if str(e) else type(e).__name__, 120)})") from None
    if dtype.hasobject:
        raise TinydeployError(f"{where} holds Python objects; only numeric arrays are read")
    if want is not None:
        shape_w, dtype_w = want
        if tuple(shape) != tuple(shape_w) or dtype != dtype_w:
            raise TinydeployError(f"{where}: expected {_dtype_text(np.dtype(dtype_w))} {'x'.join(map(str, shape_w))}, "
                                  f"got {_dtype_text(dtype)} {'x'.join(map(str, shape)) or '(scalar)'}")
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if n > limit:
        raise TinydeployError(f"{where} is {n} bytes; at most {limit} are read")
    data = f.read(n)
    if len(data) != n:
        raise TinydeployError(f"{where} is truncated: {len(data)} of its {n} bytes")
    a = np.frombuffer(data, dtype=dtype)
    return (a.reshape(shape[::-1]).T if fortran else a.reshape(shape)).copy()


def load_arrays(path, wanted: list[tuple[str, tuple, np.dtype]], what: str = "inputs file") -> dict[str, np.ndarray]:
    """The arrays named in `wanted` [(name, shape, dtype)] from an .npz (by name) or an .npy (the
    first of them), each checked against its shape and type before its data is read; arrays of
    an .npz that nobody asked for are never read."""
    shown = printable(str(path))
    f, size = open_regular(path, what)
    limit = max((int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize for _, s, d in wanted), default=0)
    with f:
        magic = f.read(6)
        f.seek(0)
        if magic == b"\x93NUMPY":
            name, shape_w, dtype_w = wanted[0]
            return {name: _read_npy(f, f"input {printable(name)!r} ({shown})", (tuple(shape_w), np.dtype(dtype_w)), limit)}
        if not magic.startswith(b"PK"):
            raise TinydeployError(f"cannot read {what} from {shown!r}: neither an .npz nor an .npy file")
        try:
            z = zipfile.ZipFile(f)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
            raise TinydeployError(f"cannot read {what} from {shown!r}: {printable(str(e), 120)}") from None
        with z:
            infos = z.infolist()
            if len(infos) > NPZ_MAX_MEMBERS:
                raise TinydeployError(f"{shown!r} holds {len(infos)} arrays; at most {NPZ_MAX_MEMBERS} are looked at")
            members = {i.filename[:-4] if i.filename.endswith(".npy") else i.filename: i for i in infos}
            out = {}
            for name, shape_w, dtype_w in wanted:
                info = members.get(name)
                if info is None:
                    have = ", ".join(printable(m, 40) for m in list(members)[:10]) or "none"
                    raise TinydeployError(f"{shown} has no array named {printable(name)!r} (expected "
                                          f"{np.dtype(dtype_w).name} {'x'.join(map(str, shape_w))}; it has {have})")
                try:
                    with z.open(info) as m:
                        out[name] = _read_npy(m, f"input {printable(name)!r} ({shown})",
                                              (tuple(shape_w), np.dtype(dtype_w)), limit)
                except TinydeployError:
                    raise
                except Exception as e:   # a damaged archive: zlib, CRC or zip errors
                    raise TinydeployError(f"cannot read array {printable(name)!r} from {shown!r}: "
                                          f"{printable(str(e) or type(e).__name__, 120)}") from None
            return out


def is_file(path) -> bool:
    """Path.is_file() that says False instead of raising (names too long, loops, no permission)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False

