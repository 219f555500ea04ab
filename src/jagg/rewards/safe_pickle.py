"""Reading a pickle that an untrusted peer wrote, admitting plain data only.

``pickle.loads`` runs whatever callable the pickle names (``os.system``, ``builtins.exec``, ...): reading an answer with
it hands the peer the reading process. :func:`loads_plain` reads with an unpickler whose only globals are wrappers
that rebuild numeric numpy arrays and scalars as numpy pickles them (``numpy.dtype`` of a bool, integer or float
kind; ``ndarray`` as a name only, not a constructor; ``_reconstruct`` of numpy's empty start and ``_frombuffer``;
numpy's ``scalar``; under numpy 1's ``numpy.core`` and numpy 2's ``numpy._core`` names), and the set, frozenset and
latin-1 bytes of pickle protocols 0-2. Plain containers (dict, list, tuple), numbers, strings, bytes, bools and None
need no global. Any other global is refused by name before it is looked up, so nothing it names runs; an array or
scalar of another dtype (object, string, structured) is refused too. An array's data comes from the pickle's own
bytes, so an answer costs about the memory of its size.
"""

from __future__ import annotations

import io
import pickle

import numpy as np

NUMERIC_KINDS = "biuf"                    # bool, signed and unsigned integers, floats


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle asked for something other than plain data; the message names it."""


def _numeric(dtype: np.dtype) -> np.dtype:
    if not isinstance(dtype, np.dtype) or dtype.kind not in NUMERIC_KINDS or dtype.fields is not None:
        raise UnsafePickleError(f"the pickle holds a numpy dtype {dtype!r}; only bool, integer and float arrays are "
                                "read")
    return dtype


def _dtype(*args) -> np.dtype:
    return _numeric(np.dtype(*args))


class _NdarrayName:
    """What the pickle gets for ``numpy.ndarray``: a name for :func:`_reconstruct`, not a constructor it could call
    with a huge shape."""


def _reconstruct(subtype, shape, dtype_code):
    """numpy's ``_reconstruct(ndarray, (0,), b'b')``: an empty array that the pickle's state then fills (its data
    comes from the pickle's own bytes)."""
    if subtype is not _NdarrayName or shape != (0,):
        raise UnsafePickleError(f"the pickle rebuilds an array as {subtype!r} of shape {shape!r}; only numpy's own "
                                "ndarray pickles are read")
    return np.ndarray.__new__(np.ndarray, shape, _dtype(dtype_code))


def _frombuffer(buffer, dtype, shape, order):
    data = np.frombuffer(bytes(buffer), dtype=_numeric(dtype))
    return data.reshape(shape, order=order).copy()


def _scalar(dtype, data: bytes = b""):
    if not isinstance(data, bytes):
        raise UnsafePickleError(f"the pickle builds a numpy scalar from a {type(data).__name__}, not bytes")
    return np.frombuffer(data, dtype=_numeric(dtype), count=1)[0]


def _latin1(text, encoding: str = "latin1") -> bytes:
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise UnsafePickleError(f"the pickle calls _codecs.encode on {type(text).__name__} {encoding!r}; only the "
                                "latin-1 bytes of pickle protocols 0-2 are read")
    return text.encode("latin1")



def _empty_bytes(*args) -> bytes:
    if args:
        raise UnsafePickleError("the pickle calls bytes with arguments; only the empty bytes of protocols 0-2 are read")
    return b""


ALLOWED_GLOBALS = {("numpy", "dtype"): _dtype, ("numpy", "ndarray"): _NdarrayName, ("_codecs", "encode"): _latin1,
                   ("builtins", "set"): set, ("builtins", "frozenset"): frozenset,
                   ("builtins", "bytes"): _empty_bytes}
for _core in ("numpy.core", "numpy._core"):                    # numpy 1 and numpy 2 pickles
    ALLOWED_GLOBALS.update({(f"{_core}.multiarray", "_reconstruct"): _reconstruct,
                            (f"{_core}.multiarray", "scalar"): _scalar,
                            (f"{_core}.numeric", "_frombuffer"): _frombuffer})

class PlainUnpickler(pickle.Unpickler):
    """An unpickler that admits :data:`ALLOWED_GLOBALS` only (module docstring)."""

    def find_class(self, module: str, name: str):
        try:                                                    # protocols 0-2 name builtins __builtin__
            return ALLOWED_GLOBALS[("builtins" if module == "__builtin__" else module, name)]
        except KeyError:
            raise UnsafePickleError(f"the pickle asks for {module}.{name}, which is refused: only plain data (dict, "
                                    "list, tuple, numbers, strings, bools, None, numeric numpy arrays) is read, "
                                    "never an object whose loading could run code") from None


def _check(value, depth: int = 0):
    """Raise unless ``value`` is plain data with numeric arrays (after loading: a dtype changed by its state)."""
    if depth > 100:
        raise UnsafePickleError("the pickle nests containers more than 100 deep")
    if isinstance(value, (np.ndarray, np.generic)):
        _numeric(value.dtype)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check(k, depth + 1)
            _check(v, depth + 1)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for v in value:
            _check(v, depth + 1)
    elif not (value is None or isinstance(value, (bool, int, float, str, bytes))):
        raise UnsafePickleError(f"the pickle holds a {type(value).__name__}; only plain data is read")


def loads_plain(data: bytes):
    """The plain data the pickle ``data`` holds (module docstring); an :class:`UnsafePickleError` names what is
    refused, another :class:`pickle.UnpicklingError` (or EOFError, ValueError) says why it is not a pickle."""
    value = PlainUnpickler(io.BytesIO(data)).load()
    _check(value)
    return value
