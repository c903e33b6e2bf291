"""Zero-copy export of backend memory: ``__cuda_array_interface__`` and DLPack.

:class:`MemoryView` describes ``nbytes`` of ``uint8`` at an address and hands them to any
consumer (CuPy, PyTorch, JAX, NumPy for host memory) without copying. The DLPack capsule is
built with :mod:`ctypes` (the unversioned ``DLManagedTensor`` of DLPack 0.8, which every
consumer accepts), so the ``cuda`` backend needs no array library of its own.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

__all__ = ["DLDEVICE_CPU", "DLDEVICE_CUDA", "DLDEVICE_CUDA_HOST", "MemoryView"]

#: DLPack device types.
DLDEVICE_CPU = 1
DLDEVICE_CUDA = 2
DLDEVICE_CUDA_HOST = 3


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _Deleter),
]

_CAPSULE_NAME = b"dltensor"

#: Element types a view can carry: typestr -> (DLPack type code, bits).
_TYPES = {"|u1": (1, 8), "<i4": (0, 32), "<i8": (0, 64)}
# Our own function objects, so that argtypes set here never clash with other ctypes users.
_api = ctypes.PyDLL(None, handle=ctypes.pythonapi._handle)
_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CapsuleDestructor]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

# Exported tensors by address of their DLManagedTensor: the struct, its shape, and the
# owner that keeps the memory alive, until the consumer (or the unused capsule) lets go.
_exports: dict[int, tuple[Any, ...]] = {}


@_Deleter
def _delete_managed(address: int | None) -> None:
    if address:
        _exports.pop(address, None)


@_CapsuleDestructor
def _destroy_capsule(capsule: int | None) -> None:
    # A consumer renames the capsule ("used_dltensor") and calls the deleter itself; a
    # capsule still named "dltensor" was never consumed, so release it here.
    if capsule and _api.PyCapsule_IsValid(capsule, _CAPSULE_NAME):
        address = _api.PyCapsule_GetPointer(capsule, _CAPSULE_NAME)
        if address:
            _exports.pop(address, None)


class MemoryView:
    """``nbytes`` of ``uint8`` at ``address``, exported without copying.

    Args:
        address: first byte, as the consumer's device sees it.
        nbytes: length.
        device_type: :data:`DLDEVICE_CUDA` (device memory), :data:`DLDEVICE_CUDA_HOST`
            (pinned host memory) or :data:`DLDEVICE_CPU`.
        device_id: the CUDA device ordinal (0 for host memory).
        owner: kept alive as long as any export of the view is.
        stream: the producer's stream handle (work on it may still write the memory), or
            ``None``.
        synchronize: called before an export, so that queued work is visible to a consumer
            on another stream.
    """

    def __init__(
        self,
        address: int,
        nbytes: int,
        device_type: int,
        device_id: int = 0,
        owner: Any = None,
        stream: int | None = None,
        synchronize: Callable[[], None] | None = None,
        shape: tuple[int, ...] | None = None,
        typestr: str = "|u1",
    ) -> None:
        if typestr not in _TYPES:
            raise ValueError(f"typestr={typestr!r}: must be one of {sorted(_TYPES)}")
        size = _TYPES[typestr][1] // 8
        shape = (nbytes // size,) if shape is None else tuple(int(d) for d in shape)
        count = 1
        for d in shape:
            count *= d
        if count * size > nbytes:
            raise ValueError(f"shape {shape} of {typestr} needs {count * size} bytes; the "
                             f"memory has {nbytes}")
        self.shape = shape
        self.typestr = typestr
        self.address = address
        self.nbytes = nbytes
        self.device_type = device_type
        self.device_id = device_id
        self.owner = owner
        self._stream = stream
        self._synchronize = synchronize

    def typed(self, shape: tuple[int, ...], typestr: str) -> MemoryView:
        """The same memory as an array of ``shape`` and ``typestr`` (``"<i4"``: int32,
        ``"<i8"``: int64, ``"|u1"``: bytes), row-major, without copying."""
        return MemoryView(self.address, self.nbytes, self.device_type, self.device_id,
                          owner=self.owner, stream=self._stream,
                          synchronize=self._synchronize, shape=shape, typestr=typestr)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if self.device_type == DLDEVICE_CPU:
            raise AttributeError("host memory has no CUDA array interface")
        return {
            "shape": self.shape,
            "typestr": self.typestr,
            "data": (self.address, False),
            "strides": None,
            "version": 3,
            "stream": self._stream or None,
        }

    @property
    def __array_interface__(self) -> dict[str, Any]:
        if self.device_type == DLDEVICE_CUDA:
            raise AttributeError("device memory has no host array interface")
        return {
            "shape": self.shape,
            "typestr": self.typestr,
            "data": (self.address, False),
            "strides": None,
            "version": 3,
        }

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.device_type, self.device_id)

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """A ``"dltensor"`` capsule of the memory (never a copy).

        Raises:
            BufferError: a copy or another device was asked for.
        """
        if copy:
            raise BufferError("MemoryView exports without copying only (copy=True asked)")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"memory is on DLPack device {self.__dlpack_device__()}")
        if stream != -1 and self._synchronize is not None:
            self._synchronize()
        managed = _DLManagedTensor()
        shape = (ctypes.c_int64 * len(self.shape))(*self.shape)
        managed.dl_tensor.data = self.address or None
        managed.dl_tensor.device = _DLDevice(self.device_type, self.device_id)
        managed.dl_tensor.ndim = len(self.shape)
        code, bits = _TYPES[self.typestr]
        managed.dl_tensor.dtype = _DLDataType(code, bits, 1)
        managed.dl_tensor.shape = shape
        managed.dl_tensor.strides = None
        managed.dl_tensor.byte_offset = 0
        managed.manager_ctx = None
        managed.deleter = _delete_managed
        address = ctypes.addressof(managed)
        _exports[address] = (managed, shape, self.owner)
        return _api.PyCapsule_New(address, _CAPSULE_NAME, _destroy_capsule)
