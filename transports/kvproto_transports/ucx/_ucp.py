"""ctypes binding of the few libucp calls ucxx's Python API does not expose: RMA.

ucxx (0.52) exposes tag, stream and active-message operations, but no memory
registration, remote keys or ``get``/``put``. It does expose the raw UCP
handles (``UCXContext.handle`` is a ``ucp_context_h``, ``UCXWorker.handle`` a
``ucp_worker_h``, ``UCXEndpoint.handle`` a ``ucp_ep_h``), and the ``libucx``
wheel it depends on ships ``libucp.so`` with its headers. So the RMA path
calls the UCP C API directly on those handles, from the one thread that also
progresses the worker (UCX objects here are not thread-safe).

ABI notes (UCX >= 1.19; structs from ``ucp/api/ucp.h``):

* ``ucs_status_t`` is a *packed* enum: one signed byte (``c_int8``). Reading it
  as ``int`` picks up garbage in the upper bytes.
* Parameter structs carry a ``field_mask``: UCX reads only the fields named
  there, which keeps these prefixes valid across UCX versions.
* ``ucs_status_ptr_t`` is a pointer that is either NULL (done at once), an
  error code cast to a pointer (>= ``UCS_ERR_LAST`` as unsigned) or a request.
"""

from __future__ import annotations

import ctypes
import importlib
import os
from dataclasses import dataclass
from typing import Any

_vp = ctypes.c_void_p
_status = ctypes.c_int8

UCS_OK = 0
UCS_INPROGRESS = 1
_UCS_ERR_LAST = -100
"""``UCS_ERR_LAST`` (ucs/type/status.h): status pointers at or above it are errors."""

UCS_MEMORY_TYPE_HOST = 0
UCS_MEMORY_TYPE_CUDA = 1

_MEM_MAP_ADDRESS = 1 << 0
_MEM_MAP_LENGTH = 1 << 1
_MEM_MAP_MEMORY_TYPE = 1 << 4


class _MemMapParams(ctypes.Structure):
    _fields_ = (
        ("field_mask", ctypes.c_uint64),
        ("address", _vp),
        ("length", ctypes.c_size_t),
        ("flags", ctypes.c_uint),
        ("prot", ctypes.c_uint),
        ("memory_type", ctypes.c_int),
        ("exported_memh_buffer", _vp),
    )


class _RequestParam(ctypes.Structure):
    # op_attr_mask = 0: UCX reads no other field (no callback, contiguous bytes).
    _fields_ = (
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", _vp),
        ("cb", _vp),
        ("datatype", ctypes.c_uint64),
        ("user_data", _vp),
        ("reply_buffer", _vp),
        ("memory_type", ctypes.c_int),
        ("recv_info", _vp),
        ("memh", _vp),
    )


class UcpError(Exception):
    """A UCP call returned an error status."""

    def __init__(self, call: str, status: int, text: str) -> None:
        super().__init__(f"{call}: {text} ({status})")
        self.status = status
        """The ``ucs_status_t`` value."""


@dataclass(frozen=True, slots=True)
class Started:
    """What a non-blocking UCP operation returned."""

    request: int
    """A request handle to check and free, or 0 if the operation is over."""
    status: int
    """``UCS_INPROGRESS`` with a request, else the final status."""


def _declare(lib: Any) -> None:
    sigs: dict[str, tuple[list[Any], Any]] = {
        "ucp_mem_map": ([_vp, ctypes.POINTER(_MemMapParams), ctypes.POINTER(_vp)], _status),
        "ucp_mem_unmap": ([_vp, _vp], _status),
        "ucp_rkey_pack": (
            [_vp, _vp, ctypes.POINTER(_vp), ctypes.POINTER(ctypes.c_size_t)],
            _status,
        ),
        "ucp_rkey_buffer_release": ([_vp], None),
        "ucp_ep_rkey_unpack": ([_vp, ctypes.c_char_p, ctypes.POINTER(_vp)], _status),
        "ucp_rkey_destroy": ([_vp], None),
        "ucp_get_nbx": (
            [_vp, _vp, ctypes.c_size_t, ctypes.c_uint64, _vp, ctypes.POINTER(_RequestParam)],
            ctypes.c_size_t,
        ),
        "ucp_put_nbx": (
            [_vp, _vp, ctypes.c_size_t, ctypes.c_uint64, _vp, ctypes.POINTER(_RequestParam)],
            ctypes.c_size_t,
        ),
        "ucp_ep_flush_nbx": ([_vp, ctypes.POINTER(_RequestParam)], ctypes.c_size_t),
        "ucp_request_check_status": ([_vp], _status),
        "ucp_request_cancel": ([_vp, _vp], None),
        "ucp_request_free": ([_vp], None),
        "ucp_worker_signal": ([_vp], _status),
        "ucs_status_string": ([_status], ctypes.c_char_p),
    }
    for name, (args, res) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res


class Ucp:
    """The loaded ``libucp`` (the copy ucxx itself uses)."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        _declare(lib)
        self._no_params = _RequestParam(op_attr_mask=0)

    def status_text(self, status: int) -> str:
        """``ucs_status_string``."""
        text: bytes = self._lib.ucs_status_string(status)
        return text.decode(errors="replace")

    def _check(self, call: str, status: int) -> None:
        if status != UCS_OK:
            raise UcpError(call, status, self.status_text(status))

    def _started(self, ptr: int) -> Started:
        if ptr == 0:
            return Started(request=0, status=UCS_OK)
        if ptr >= (1 << 64) + _UCS_ERR_LAST:
            return Started(request=0, status=ptr - (1 << 64))
        return Started(request=ptr, status=UCS_INPROGRESS)

    # --- memory ---------------------------------------------------------

    def mem_map(self, context: int, address: int, length: int, *, cuda: bool) -> int:
        """Register ``length`` bytes at ``address``; returns the ``ucp_mem_h``."""
        params = _MemMapParams(
            field_mask=_MEM_MAP_ADDRESS | _MEM_MAP_LENGTH | _MEM_MAP_MEMORY_TYPE,
            address=address,
            length=length,
            memory_type=UCS_MEMORY_TYPE_CUDA if cuda else UCS_MEMORY_TYPE_HOST,
        )
        memh = _vp()
        self._check(
            "ucp_mem_map", self._lib.ucp_mem_map(context, ctypes.byref(params), ctypes.byref(memh))
        )
        return int(memh.value or 0)

    def mem_unmap(self, context: int, memh: int) -> None:
        """Deregister a ``ucp_mem_h``."""
        self._check("ucp_mem_unmap", self._lib.ucp_mem_unmap(context, memh))

    def rkey_pack(self, context: int, memh: int) -> bytes:
        """The packed remote key a peer unpacks to read this memory."""
        buf = _vp()
        size = ctypes.c_size_t()
        self._check(
            "ucp_rkey_pack",
            self._lib.ucp_rkey_pack(context, memh, ctypes.byref(buf), ctypes.byref(size)),
        )
        try:
            return ctypes.string_at(buf.value or 0, size.value)
        finally:
            self._lib.ucp_rkey_buffer_release(buf)

    def rkey_unpack(self, ep: int, packed: bytes) -> int:
        """Unpack a peer's remote key on endpoint ``ep`` (only after the endpoint is wired up)."""
        rkey = _vp()
        self._check(
            "ucp_ep_rkey_unpack", self._lib.ucp_ep_rkey_unpack(ep, packed, ctypes.byref(rkey))
        )
        return int(rkey.value or 0)

    def rkey_destroy(self, rkey: int) -> None:
        """Release an unpacked remote key (before its endpoint goes)."""
        self._lib.ucp_rkey_destroy(rkey)

    # --- operations -----------------------------------------------------

    def get(self, ep: int, local: int, length: int, remote: int, rkey: int) -> Started:
        """Start reading ``length`` bytes at remote ``remote`` into local ``local``."""
        return self._started(
            self._lib.ucp_get_nbx(ep, local, length, remote, rkey, ctypes.byref(self._no_params))
        )

    def put(self, ep: int, local: int, length: int, remote: int, rkey: int) -> Started:
        """Start writing ``length`` bytes at local ``local`` to remote ``remote`` (completion is
        local: flush the endpoint for remote completion)."""
        return self._started(
            self._lib.ucp_put_nbx(ep, local, length, remote, rkey, ctypes.byref(self._no_params))
        )

    def flush(self, ep: int) -> Started:
        """Start flushing ``ep``: completes once it is connected and prior operations ended."""
        return self._started(self._lib.ucp_ep_flush_nbx(ep, ctypes.byref(self._no_params)))

    def check(self, request: int) -> int:
        """``ucp_request_check_status``: ``UCS_INPROGRESS`` or the final status."""
        status: int = self._lib.ucp_request_check_status(request)
        return status

    def cancel(self, worker: int, request: int) -> None:
        """Ask UCX to cancel a request (it completes with ``UCS_ERR_CANCELED``)."""
        self._lib.ucp_request_cancel(worker, request)

    def free(self, request: int) -> None:
        """Release a request handle (UCX keeps it until it completes)."""
        self._lib.ucp_request_free(request)

    def signal(self, worker: int) -> None:
        """Wake a worker blocked in its event wait; safe from any thread."""
        self._lib.ucp_worker_signal(worker)


_loaded: Ucp | None = None


def load_ucp() -> Ucp:
    """The ``libucp`` ucxx already loaded: the same handle, never a second copy.

    The ``libucx`` wheel ships ``libucp.so`` and ``libucp.so.0`` as two separate
    files (not symlinks); ``dlopen`` of the other path would map a second UCP
    into the process, operating on the first one's handles. Looking the
    library up by soname with ``RTLD_NOLOAD`` returns the loaded one.
    """
    global _loaded  # noqa: PLW0603 - one process-wide library handle
    if _loaded is None:
        importlib.import_module("ucxx")  # loads libucp (ucxx.__init__ -> libucxx.load_library)
        try:
            lib = ctypes.CDLL("libucp.so.0", mode=os.RTLD_NOLOAD)
        except OSError:
            # The order of libucx.load.UCX_LIBRARIES: libucs, libucs_signal, libuct, libucp.
            lib = importlib.import_module("libucx").load_library()[3]
        _loaded = Ucp(lib)
    return _loaded
