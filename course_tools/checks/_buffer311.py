"""NumPy's direct read of a CPU ``jax.Array``'s buffer, made visible to a Python-level recorder on
Python 3.11 (lesson 00's transfer tracker, :mod:`course_tools.checks._lesson00_moves`).

``np.asarray(x)`` and ``np.array(x)`` of an array on XLA:CPU read its memory through the C buffer
protocol (jaxlib's ``ArrayImpl`` fills the type's ``bf_getbuffer`` slot), not through ``x.__array__``
and ``ArrayImpl._value``. On Python >= 3.12 that slot is the Python method ``ArrayImpl.__buffer__``
(PEP 688): the tracker wraps it. Python 3.11 has no ``__buffer__``, so nothing at the Python level sees
such a read: the tracker would miss every copy to the host made with NumPy (all of x copied to the
host, a total made there). :class:`NoBufferProtocol` empties the slot while the answer runs; NumPy then
finds no buffer and falls back to ``x.__array__``, which reads ``ArrayImpl._value`` (recorded). The
values are the same; the read becomes a copy instead of a view. ``memoryview(x)`` raises ``TypeError``
meanwhile.
"""

from __future__ import annotations

import ctypes
import sys

_PY_BF_GETBUFFER = 1  # the slot number of bf_getbuffer (CPython's Include/typeslots.h)


class _BufferProcs(ctypes.Structure):
    _fields_ = [("bf_getbuffer", ctypes.c_void_p), ("bf_releasebuffer", ctypes.c_void_p)]


class _TypeHead(ctypes.Structure):
    """The start of CPython 3.11's ``PyTypeObject``, up to ``tp_as_buffer`` (Include/cpython/object.h)."""

    _fields_ = [
        *[(n, ctypes.c_void_p) for n in ("ob_refcnt", "ob_type", "ob_size", "tp_name")],
        *[(n, ctypes.c_void_p) for n in ("tp_basicsize", "tp_itemsize", "tp_dealloc")],
        *[(n, ctypes.c_void_p) for n in ("tp_vectorcall_offset", "tp_getattr", "tp_setattr")],
        *[(n, ctypes.c_void_p) for n in ("tp_as_async", "tp_repr", "tp_as_number")],
        *[(n, ctypes.c_void_p) for n in ("tp_as_sequence", "tp_as_mapping", "tp_hash")],
        *[(n, ctypes.c_void_p) for n in ("tp_call", "tp_str", "tp_getattro", "tp_setattro")],
        ("tp_as_buffer", ctypes.POINTER(_BufferProcs)),
    ]


def _slot(cls: type) -> int | None:
    get = ctypes.pythonapi.PyType_GetSlot
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_int]
    return get(cls, _PY_BF_GETBUFFER)


class NoBufferProtocol:
    """Within ``with NoBufferProtocol(cls):`` instances of ``cls`` export no buffer (Python < 3.12 only;
    on 3.12 and later wrap ``cls.__buffer__`` instead). Nothing is changed where ``cls`` has no buffer.

    Raises:
      RuntimeError: on Python >= 3.12, or where the type's layout is not CPython 3.11's (the slot read
        back through ``tp_as_buffer`` is not the one ``PyType_GetSlot`` returns).
    """

    def __init__(self, cls: type):
        if sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
            raise RuntimeError(
                f"NoBufferProtocol is for CPython 3.11, not {sys.implementation.name} "
                f"{sys.version.split()[0]}: wrap {cls.__name__}.__buffer__ there"
            )
        self.cls, self._procs, self._saved = cls, None, None

    def __enter__(self):
        slot = _slot(self.cls)
        if not slot:
            return self
        procs = _TypeHead.from_address(id(self.cls)).tp_as_buffer
        if not procs or procs.contents.bf_getbuffer != slot:
            raise RuntimeError(
                f"the buffer slot of {self.cls.__name__} is not where CPython 3.11 keeps it "
                f"(Python {sys.version.split()[0]}): NumPy's reads of its buffer cannot be recorded"
            )
        self._procs, self._saved = procs.contents, slot
        self._procs.bf_getbuffer = None
        return self

    def __exit__(self, *exc):
        if self._procs is not None:
            self._procs.bf_getbuffer = self._saved
            self._procs = None
