"""The CUDA runtime calls that torch does not expose.

* ``copy_2d_async``: a pitched copy (``cudaMemcpy2DAsync``) on a stream:
  ``height`` runs of ``width`` bytes, each at its own pitch on either side.
  A layer's pages of a batch of blocks go with one of these from a
  contiguous device buffer into their columns of the host rows; torch's
  ``copy_`` into a strided host view goes through a pageable temporary
  and a synchronising copy.
* ``clear_last_error``: reset the runtime's last error after a failed call
  made outside torch, which would otherwise surface at torch's next launch
  check.

The library is the runtime torch itself loaded (matched by its soname, the
major version torch was built with first), so streams and pointers are
shared.  Where it cannot be found, or ``pitched_copies_work`` finds its
copies wrong on the device, callers keep to torch's own copies.  This
module knows nothing of caches or rows.
"""

from __future__ import annotations

import ctypes
import functools

#: ``cudaMemcpyKind`` values.
HOST_TO_DEVICE = 1
DEVICE_TO_HOST = 2


def _names() -> list[str]:
    names = []
    try:
        import torch

        major = (torch.version.cuda or "").split(".")[0]
        if major:
            names.append(f"libcudart.so.{major}")
    except Exception:
        pass
    return names + [n for n in ("libcudart.so.13", "libcudart.so.12", "libcudart.so") if n not in names]


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    for name in _names():
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        copy = lib.cudaMemcpy2DAsync
        copy.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                         ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        copy.restype = ctypes.c_int
        lib.cudaGetLastError.restype = ctypes.c_int
        return lib
    return None


def available() -> bool:
    """Whether the CUDA runtime library could be loaded."""
    return _library() is not None


@functools.lru_cache(maxsize=None)
def pitched_copies_work(device) -> bool:
    """Whether ``copy_2d_async`` moves the right bytes both ways between
    pinned host memory and ``device``: tried once, on a few bytes, so that a
    runtime library that does not match torch's is never used for KV."""
    if not available():
        return False
    try:
        import torch

        host = torch.arange(64, dtype=torch.uint8).pin_memory()
        back = torch.zeros(64, dtype=torch.uint8).pin_memory()
        dev = torch.zeros(32, dtype=torch.uint8, device=device)
        stream = torch.cuda.current_stream(device)
        # Four runs of 8 bytes, 16 apart on the host, packed on the device.
        copy_2d_async(dev.data_ptr(), 8, host.data_ptr(), 16, 8, 4, HOST_TO_DEVICE, stream.cuda_stream)
        copy_2d_async(back.data_ptr() + 4, 16, dev.data_ptr(), 8, 8, 4, DEVICE_TO_HOST, stream.cuda_stream)
        stream.synchronize()
        want = torch.zeros(64, dtype=torch.uint8)
        for run in range(4):
            want[run * 16 + 4:run * 16 + 12] = host[run * 16:run * 16 + 8]
        return bool(torch.equal(back, want))
    except Exception:
        clear_last_error()
        return False


def clear_last_error() -> None:
    lib = _library()
    if lib is not None:
        lib.cudaGetLastError()


def copy_2d_async(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                  kind: int, stream: int) -> None:
    """Queue a pitched copy on ``stream`` (a ``cudaStream_t`` handle, as
    ``torch.cuda.Stream.cuda_stream`` gives); it returns once queued."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the CUDA runtime library (libcudart) cannot be loaded")
    rc = lib.cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, kind, stream)
    if rc != 0:
        lib.cudaGetLastError()
        raise RuntimeError(f"cudaMemcpy2DAsync of {height} x {width} bytes failed with CUDA error {rc}")
