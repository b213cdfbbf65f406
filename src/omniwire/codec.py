"""The safe payload codec: a payload's non-tensor part as msgpack, tensors set aside.

``dumps(value)`` walks a payload and returns ``(header, tensors)``: the header is
msgpack bytes in which every tensor is replaced by its index in ``tensors``.
``loads(header, tensors)`` rebuilds the value. What the header may hold is fixed
by specs/wire-v1.md §6:

=========================  ==========================================
Python value               header encoding
=========================  ==========================================
None, bool, str, bytes     msgpack nil / bool / str / bin
int in [-2**63, 2**64-1]   msgpack int
float                      msgpack float 64 (NaN bits, ±inf, -0.0 kept)
list, dict                 msgpack array / map
tuple                      ext 1: msgpack array of the items
torch.Tensor               ext 2: uint index into the tensor table
numpy.ndarray              ext 3: uint index into the tensor table
registered dataclass or    ext 4: [registered name, {field: value}]
msgspec.Struct
anything, with opt-in      ext 5: pickle bytes (see ``allow_pickle``)
=========================  ==========================================

Dict keys may be None, bool, int, float, str, bytes or tuples of those; a tuple
key is a plain msgpack array, which a reader always rebuilds as a tuple. The same
tensor object appearing twice is stored once and comes back as one object.
Anything else — sets included (send a list or a tuple) — is a ``TypeError`` at
the sender naming its path, e.g. ``payload["a"][2]``. Pickle is refused unless *both* sides opt in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import threading
from collections.abc import Sequence
from typing import Any, Final

import msgspec
import numpy as np
import torch

from .errors import WireFormatError
from .wire import MAX_HEADER_DEPTH, MAX_TENSORS

__all__ = [
    "EXT_NDARRAY",
    "EXT_PICKLE",
    "EXT_STRUCT",
    "EXT_TENSOR",
    "EXT_TUPLE",
    "NDARRAY_DTYPES",
    "Encoded",
    "dumps",
    "loads",
    "register_type",
    "registered_types",
    "scalars_header",
    "unregister_type",
]

EXT_TUPLE: Final = 1
EXT_TENSOR: Final = 2
EXT_NDARRAY: Final = 3
#: The dtypes ext 3 (numpy array) may carry: those numpy has (wire-v1.md §6.1). A
#: tensor of another dtype (bfloat16, float8, complex32, ...) travels as ext 2 only.
NDARRAY_DTYPES: Final = frozenset(
    {"float16", "float32", "float64", "complex64", "complex128", "bool"}
    | {f"{s}int{b}" for s in ("", "u") for b in (8, 16, 32, 64)}
)
EXT_STRUCT: Final = 4
EXT_PICKLE: Final = 5

_I64_MIN: Final = -(2**63)
_U64_MAX: Final = 2**64 - 1
_SCALARS: Final = (type(None), bool, str, bytes, float)
_KEY_SCALARS: Final = (type(None), bool, int, float, str, bytes)

_encoder: Final = msgspec.msgpack.Encoder()
_plain_decoder: Final = msgspec.msgpack.Decoder()

_registry_lock = threading.Lock()
_by_name: dict[str, type] = {}
_by_type: dict[type, str] = {}


class Encoded(msgspec.Struct, frozen=True):
    """What :func:`dumps` returns: the header bytes and the tensors it set aside."""

    header: bytes
    tensors: list[torch.Tensor]
    #: For each tensor, where it sat in the payload (for diagnostics).
    paths: list[str]


def register_type(cls: type, name: str | None = None) -> type:
    """Allow instances of a dataclass or msgspec Struct in payloads.

    Both sides must register the type under the same ``name`` (default:
    ``"module.QualName"``). Its fields are encoded with this codec, recursively.
    Usable as a class decorator.

    Raises:
        TypeError: ``cls`` is neither a dataclass nor a msgspec Struct.
        ValueError: ``name`` is taken by another class.
    """
    if not (dataclasses.is_dataclass(cls) or issubclass(cls, msgspec.Struct)):
        raise TypeError(f"{cls!r} is neither a dataclass nor a msgspec.Struct")
    key = name or f"{cls.__module__}.{cls.__qualname__}"
    with _registry_lock:
        other = _by_name.get(key)
        if other is not None and other is not cls:
            raise ValueError(f"payload type name {key!r} is already registered to {other!r}")
        _by_name[key] = cls
        _by_type[cls] = key
    return cls


def unregister_type(cls: type) -> None:
    """Undo :func:`register_type` (mainly for tests)."""
    with _registry_lock:
        key = _by_type.pop(cls, None)
        if key is not None:
            _by_name.pop(key, None)


def registered_types() -> dict[str, type]:
    """A copy of the registered name → type table."""
    with _registry_lock:
        return dict(_by_name)


def _fields(value: Any) -> dict[str, Any]:
    if isinstance(value, msgspec.Struct):
        return {f: getattr(value, f) for f in value.__struct_fields__}
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}


# A path is a chain of (parent, step) pairs, formatted only when an error needs it.
_Path = tuple[Any, ...]


class _Attr(str):
    """A path step that is an attribute of a registered type, not a key or index."""


def _format_path(path: _Path, root: str = "payload") -> str:
    steps: list[str] = []
    while path:
        path, step = path
        steps.append(f".{step}" if isinstance(step, _Attr) else f"[{step!r}]")
    return root + "".join(reversed(steps))


class _Dumper:
    """One walk over one payload. Tensors are memoised by ``id`` so a shared one is sent once."""

    def __init__(self, allow_pickle: bool, root: str = "payload") -> None:
        self.allow_pickle = allow_pickle
        self.root = root
        self.tensors: list[torch.Tensor] = []
        self.paths: list[str] = []
        self.memo: dict[int, int] = {}

    def _tensor_index(self, key: int, tensor: torch.Tensor, path: _Path) -> int:
        index = self.memo.get(key)
        if index is None:
            if len(self.tensors) >= MAX_TENSORS:
                raise ValueError(
                    f"{_format_path(path, self.root)}: payload has more than {MAX_TENSORS} tensors"
                )
            index = len(self.tensors)
            self.memo[key] = index
            self.tensors.append(tensor)
            self.paths.append(_format_path(path, self.root))
        return index

    def _key(self, key: Any, path: _Path, depth: int) -> Any:
        """A dict key as msgpack-ready data; ``depth`` counts its enclosing containers."""
        kind = type(key)
        if kind in _KEY_SCALARS:
            if kind is int and not _I64_MIN <= key <= _U64_MAX:
                raise TypeError(
                    f"{_format_path(path, self.root)}: dict key {key} does not fit in 64 bits"
                )
            return key
        if kind is tuple:  # a msgpack array in key position always decodes as a tuple
            if depth + 1 > MAX_HEADER_DEPTH:  # a key nests like a value (spec §6.2)
                raise ValueError(
                    f"{_format_path(path)}: payload nests deeper than {MAX_HEADER_DEPTH} levels "
                    "(in a dict key)"
                )
            return tuple(self._key(k, path, depth + 1) for k in key)
        raise TypeError(
            f"{_format_path(path, self.root)}: dict key of type {kind.__name__} is not supported "
            "(use None, bool, int, float, str, bytes or a tuple of those)"
        )

    def walk(self, value: Any, path: _Path, depth: int) -> Any:
        """Return ``value`` as msgpack-ready data. ``depth`` counts enclosing containers."""
        kind = type(value)
        if kind in _SCALARS:
            return value
        if kind is int:
            if not _I64_MIN <= value <= _U64_MAX:
                raise TypeError(
                    f"{_format_path(path, self.root)}: int {value} does not fit in 64 bits"
                )
            return value
        if isinstance(value, torch.Tensor):
            return msgspec.msgpack.Ext(EXT_TENSOR, _encoder.encode(self._tensor(value, path)))
        if kind is np.ndarray:
            return msgspec.msgpack.Ext(EXT_NDARRAY, _encoder.encode(self._ndarray(value, path)))
        inner = depth + 1
        if inner > MAX_HEADER_DEPTH and kind in (list, dict, tuple):
            raise ValueError(
                f"{_format_path(path, self.root)}: value nests deeper than {MAX_HEADER_DEPTH} levels"
            )
        if kind is list:
            return [
                v if type(v) in _SCALARS else self.walk(v, (path, i), inner)
                for i, v in enumerate(value)
            ]
        if kind is dict:
            return {
                self._key(k, path, inner): v
                if type(v) in _SCALARS
                else self.walk(v, (path, k), inner)
                for k, v in value.items()
            }
        if kind is tuple:
            items = [self.walk(v, (path, i), inner) for i, v in enumerate(value)]
            return msgspec.msgpack.Ext(EXT_TUPLE, _encoder.encode(items))
        name = _by_type.get(kind)
        if name is not None:
            if inner > MAX_HEADER_DEPTH:
                raise ValueError(
                    f"{_format_path(path, self.root)}: value nests deeper than {MAX_HEADER_DEPTH} levels"
                )
            fields = {f: self.walk(v, (path, _Attr(f)), inner) for f, v in _fields(value).items()}
            return msgspec.msgpack.Ext(EXT_STRUCT, _encoder.encode([name, fields]))
        if self.allow_pickle:
            return msgspec.msgpack.Ext(EXT_PICKLE, pickle.dumps(value, protocol=5))
        hint = ""
        if dataclasses.is_dataclass(value) or isinstance(value, msgspec.Struct):
            hint = " (register it with omniwire.codec.register_type)"
        elif isinstance(value, np.generic):
            hint = " (convert numpy scalars with .item())"
        elif isinstance(value, set | frozenset):
            hint = " (send a list or a tuple: sets have no wire encoding)"
        raise TypeError(
            f"{_format_path(path, self.root)}: values of type {kind.__qualname__} cannot be sent{hint}"
        )

    def _tensor(self, tensor: torch.Tensor, path: _Path) -> int:
        if tensor.layout is not torch.strided:
            raise TypeError(
                f"{_format_path(path, self.root)}: {tensor.layout} tensors are not supported; send dense ones"
            )
        if tensor.is_quantized or tensor.is_meta or tensor.is_nested:
            raise TypeError(
                f"{_format_path(path, self.root)}: quantized, meta and nested tensors are not "
                "supported (send a nested tensor's components: .unbind())"
            )
        return self._tensor_index(id(tensor), tensor, path)

    def _ndarray(self, array: np.ndarray, path: _Path) -> int:
        key = id(array)
        index = self.memo.get(key)
        if index is not None:
            return index
        if not (array.flags.c_contiguous and array.flags.writeable):
            array = array.copy(order="C")  # torch.from_numpy needs both
        try:
            tensor = torch.from_numpy(array)
        except TypeError:
            tensor = None
        if tensor is None or str(tensor.dtype).removeprefix("torch.") not in NDARRAY_DTYPES:
            raise TypeError(
                f"{_format_path(path, self.root)}: numpy dtype {array.dtype} cannot be sent: "
                f"ext 3 carries numpy arrays of {', '.join(sorted(NDARRAY_DTYPES))}"
            )
        return self._tensor_index(key, tensor, path)


def dumps(value: Any, *, allow_pickle: bool = False, root: str = "payload") -> Encoded:
    """Encode ``value`` into a header and the list of tensors it contains.

    Args:
        value: the payload (see the module docstring for what it may contain).
        allow_pickle: encode otherwise unsupported objects with pickle. Only for
            trusted deployments; the receiver must opt in too.
        root: what error messages and ``Encoded.paths`` call the value
            (``"metadata"`` for a DataReady's metadata).

    Raises:
        TypeError: a value, dict key or int out of range, naming its path.
        ValueError: nesting deeper than ``MAX_HEADER_DEPTH`` or too many tensors.
    """
    if type(value) is dict and 0 < len(value) <= _FLAT_MAX:
        flat = _dumps_flat(value)
        if flat is not None:
            if root == "payload" or not flat.tensors:
                return flat
            paths = [root + p.removeprefix("payload") for p in flat.paths]
            return Encoded(flat.header, flat.tensors, paths)
    elif type(value) is torch.Tensor and _plain(value):
        return Encoded(_TENSOR_HEADER, [value], [root])
    dumper = _Dumper(allow_pickle, root)
    tree = dumper.walk(value, (), 0)
    return Encoded(_encoder.encode(tree), dumper.tensors, dumper.paths)


# The shape most payloads have — a flat dict of distinct tensors under str keys — has
# the same header every time for the same keys: it is encoded once, and recognised
# on the way in without the general decoder. Anything else takes the general path.
_FLAT_MAX = 16
_flat_headers: dict[tuple[str, ...], tuple[bytes, list[str]]] = {}
_flat_keys: dict[bytes, tuple[str, ...]] = {}


_FLAT_SCALARS: Final = (str, bool, float, type(None))


def _dumps_flat(value: dict[Any, Any]) -> Encoded | None:
    keys = tuple(value)
    tensors = list(value.values())
    if type(tensors[0]) is not torch.Tensor:
        header = scalars_header(value)
        return None if header is None else Encoded(header, [], [])
    for k, t in zip(keys, tensors, strict=True):
        if type(k) is not str or type(t) is not torch.Tensor:
            return None
        if not _plain(t):
            return None  # the general path says why
    if len(tensors) > 1 and len({id(t) for t in tensors}) != len(tensors):
        return None  # a tensor twice: one table entry (the general path)
    header, paths = _flat_header(keys)
    return Encoded(header, tensors, list(paths))


def scalars_header(value: dict[Any, Any]) -> bytes | None:
    """The header :func:`dumps` writes for a dict of str keys and plain scalars (the
    usual metadata), made without the walk; None for any other dict."""
    for k, v in value.items():
        kind = type(v)
        if type(k) is not str or not (
            kind in _FLAT_SCALARS or (kind is int and _I64_MIN <= v <= _U64_MAX)
        ):
            return None  # the general path takes it, or says what is wrong
    return _encoder.encode(value)


def _plain(t: torch.Tensor) -> bool:
    """A tensor the wire carries as it is (``t.device.type`` would cost 6× as much)."""
    return t.layout is torch.strided and not (t.is_quantized or t.is_meta or t.is_nested)


#: The header of a payload that is one tensor (the general path writes the same bytes).
_TENSOR_HEADER: Final = _encoder.encode(msgspec.msgpack.Ext(EXT_TENSOR, _encoder.encode(0)))


def _flat_header(keys: tuple[str, ...]) -> tuple[bytes, list[str]]:
    """The header of a flat dict of distinct tensors under ``keys``, and their paths."""
    cached = _flat_headers.get(keys)
    if cached is None:
        tree = {k: msgspec.msgpack.Ext(EXT_TENSOR, _encoder.encode(i)) for i, k in enumerate(keys)}
        header = _encoder.encode(tree)
        cached = (header, [_format_path(((), k)) for k in keys])
        if len(_flat_headers) >= 256:
            _flat_headers.clear()
            _flat_keys.clear()
        _flat_headers[keys] = cached
        _flat_keys[header] = keys
    return cached


def _learn_flat(header: bytes | memoryview, value: Any, tensors: Sequence[torch.Tensor]) -> None:
    """After a general decode: remember ``header`` if it is exactly the canonical header
    of a flat dict of the table's tensors, so the next one decodes without the parser."""
    if (
        type(value) is dict
        and 0 < len(value) == len(tensors) <= _FLAT_MAX
        and all(type(k) is str for k in value)
        and all(v is t for v, t in zip(value.values(), tensors, strict=True))
    ):
        _flat_header(tuple(value))  # cached, and recognised if the bytes are the same


class _Loader:
    """The state of one :func:`loads` call, which the shared decoder's ext hook reads."""

    def __init__(self, tensors: Sequence[torch.Tensor], allow_pickle: bool) -> None:
        self.tensors = tensors
        self.allow_pickle = allow_pickle

    def index(self, data: memoryview) -> int:
        index = _plain_decoder.decode(data)
        if type(index) is not int or not 0 <= index < len(self.tensors):
            raise WireFormatError(
                f"header refers to tensor {index!r}; the table has {len(self.tensors)}"
            )
        return index

    def ext(self, code: int, data: memoryview) -> Any:
        if code == EXT_TUPLE:
            items = _header_decoder.decode(data)
            if type(items) is not list:
                raise WireFormatError("tuple extension does not hold an array")
            return tuple(items)
        if code == EXT_TENSOR:
            return self.tensors[self.index(data)]
        if code == EXT_NDARRAY:
            tensor = self.tensors[self.index(data)]
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype not in NDARRAY_DTYPES:
                raise WireFormatError(
                    f"ext 3 (numpy array) cannot carry {dtype}: numpy has no such dtype "
                    "(the writer should have sent the tensor as ext 2)"
                )
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            return tensor.numpy()
        if code == EXT_STRUCT:
            return self.struct(_header_decoder.decode(data))
        if code == EXT_PICKLE:
            if not self.allow_pickle:
                raise WireFormatError(
                    "payload contains a pickled object and this receiver did not opt in "
                    "(allow_pickle=False); it was not unpickled"
                )
            return pickle.loads(data)  # allow_pickle: explicit opt-in, trusted peers only
        raise WireFormatError(f"unknown header extension type {code}")

    def struct(self, item: Any) -> Any:
        if type(item) is not list or len(item) != 2 or type(item[1]) is not dict:
            raise WireFormatError("registered-type extension is not [name, {fields}]")
        name, fields = item
        cls = _by_name.get(name) if type(name) is str else None
        if cls is None:
            raise WireFormatError(f"payload type {name!r} is not registered on this receiver")
        try:
            return cls(**fields)
        except Exception as exc:
            raise WireFormatError(f"cannot rebuild {name!r}: {exc}") from None


# One decoder for every header; its ext hook finds the call it serves here. Decoding
# never awaits, so a thread-local is enough, and it leaves no reference cycle behind.
_current = threading.local()


def _ext_hook(code: int, data: memoryview) -> Any:
    loader: _Loader = _current.loader
    return loader.ext(code, data)


_header_decoder: Final = msgspec.msgpack.Decoder(ext_hook=_ext_hook)
#: The usual metadata, a small map of str keys to scalars (what :func:`scalars_header`
#: writes), decoded and checked in one C call: a tenth of the general path's cost.
#: Anything else fails its type check and takes the general path.
_scalars_decoder: Final = msgspec.msgpack.Decoder(dict[str, str | int | float | bool | None])
_SCALARS_MAX = 512


_LEAVES: Final = frozenset({torch.Tensor, np.ndarray, str, bytes, int, float, bool, type(None)})


def _depth(value: Any) -> int:
    """Nesting depth of lists, dicts, tuples and registered types (scalars and tensors
    are depth 0); a dict's tuple keys nest too."""
    kind = type(value)
    if kind in _LEAVES:
        return 0
    if kind is dict:  # the common case, a flat dict (metadata), without the walk
        for k, v in value.items():
            if type(v) not in _LEAVES or type(k) is tuple:
                break
        else:
            return 1
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        kind = type(item)
        if kind is list or kind is tuple:
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in item if type(v) not in _LEAVES)
        elif kind is dict:
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in item.values() if type(v) not in _LEAVES)
            stack.extend((k, level + 1) for k in item if type(k) is tuple)  # keys nest too
        elif kind not in _LEAVES and (
            dataclasses.is_dataclass(item) or isinstance(item, msgspec.Struct)
        ):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in _fields(item).values())
    return deepest


def loads(
    header: bytes | memoryview, tensors: Sequence[torch.Tensor], *, allow_pickle: bool = False
) -> Any:
    """Rebuild a payload from its header and tensor table.

    Raises:
        WireFormatError: malformed header, a tensor index outside the table, an
            unregistered type, nesting deeper than ``MAX_HEADER_DEPTH``, or a
            pickled object while ``allow_pickle`` is False (never unpickled).
    """
    header = bytes(header)
    if header == _TENSOR_HEADER and len(tensors) == 1:
        return tensors[0]  # one tensor, as dumps() writes it
    keys = _flat_keys.get(header)
    if keys is not None and len(keys) == len(tensors):
        return dict(zip(keys, tensors, strict=True))  # a header dumps() wrote: a flat dict
    if not tensors and header and len(header) <= _SCALARS_MAX and 0x80 <= header[0] <= 0x8F:
        with contextlib.suppress(msgspec.DecodeError):
            return _scalars_decoder.decode(header)
    previous = getattr(_current, "loader", None)
    _current.loader = _Loader(tensors, allow_pickle)
    try:
        value = _header_decoder.decode(header)
    except WireFormatError:
        raise
    except RecursionError:
        raise WireFormatError("payload header is nested too deeply") from None
    except Exception as exc:
        raise WireFormatError(f"malformed payload header: {exc}") from None
    finally:
        _current.loader = previous  # holds no tensor once the call returns
    if _depth(value) > MAX_HEADER_DEPTH:
        raise WireFormatError(f"payload header nests deeper than {MAX_HEADER_DEPTH} levels")
    _learn_flat(header, value, tensors)
    return value
