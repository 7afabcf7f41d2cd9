"""Packing of token and float arrays: for the wire, and for the trusted side's stored buffer.

Arrays are little-endian bytes of a fixed dtype (`le_bytes` / `from_le_bytes`): 4 bytes per value instead
of up to 20 characters of JSON, and decoding is one `np.frombuffer`. On the wire they travel as base64 of
those bytes (`pack` / `unpack`, `PackedArray`); in Python, fields hold `numpy.ndarray`.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
from pydantic_core import PydanticCustomError, core_schema


@lru_cache(maxsize=None)
def _wire_dtype(dtype: str) -> tuple[np.dtype, np.dtype]:
    return np.dtype(dtype).newbyteorder("<"), np.dtype(dtype)


def le_bytes(values: Any, dtype: str) -> bytes:
    """A 1-D array as little-endian `dtype` bytes (no copy beyond the one `tobytes` makes when the values
    already have that layout)."""
    return np.ascontiguousarray(values, dtype=_wire_dtype(dtype)[0]).tobytes()


def from_le_bytes(raw: bytes, dtype: str) -> np.ndarray:
    """Little-endian `dtype` bytes as a native 1-D array: a read-only view (a copy only on big-endian hosts)."""
    le, native = _wire_dtype(dtype)
    return np.frombuffer(raw, dtype=native) if le == native else np.frombuffer(raw, dtype=le).astype(native)


def pack(values: Any, dtype: str) -> str:
    """Encode a 1-D array as base64 of little-endian `dtype` bytes."""
    return base64.b64encode(le_bytes(values, dtype)).decode()


def unpack(text: str | bytes, dtype: str, max_len: int | None = None) -> np.ndarray:
    """Decode base64 of little-endian `dtype` bytes into a native-endian 1-D array (a writable copy).

    For base64 strings given in Python (JSON input is decoded by pydantic-core): one length check
    before decoding, one strict C decode (`strict_mode` refuses characters outside the alphabet and bad
    padding), one copy.
    """
    le, native = _wire_dtype(dtype)
    if max_len is not None and len(text) > 4 * ((max_len * le.itemsize + 2) // 3):  # checked before decoding
        raise ValueError(f"array longer than {max_len} values")
    try:
        raw = binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not valid base64: {exc}") from None
    if len(raw) % le.itemsize:
        raise ValueError(f"{len(raw)} bytes is not a whole number of {le.itemsize}-byte values")
    return np.frombuffer(raw, dtype=le).astype(native)


@dataclass(frozen=True)
class PackedArray:
    """Pydantic annotation: `Annotated[np.ndarray, PackedArray("int32", max_len=...)]`.

    Accepts a base64 string (from JSON: decoded by pydantic-core, which also takes unpadded and URL-safe
    base64), or a list / ndarray / strict base64 string (from Python). Always yields a 1-D ndarray of
    exactly `dtype`: from JSON a read-only view of the decoded bytes, from Python a writable copy.
    Serializes to base64 in JSON mode.

    `deferred`: from JSON, the field keeps the decoded bytes and the enclosing model turns them into
    arrays (`count` + `from_wire`), many at once: Completion's, for a whole submission in one numpy call.
    """

    dtype: str
    max_len: int
    deferred: bool = False

    @property
    def itemsize(self) -> int:
        return _wire_dtype(self.dtype)[0].itemsize

    def count(self, raw: bytes) -> int:
        """How many values decoded wire bytes hold; ValueError if not whole values or over the cap."""
        n, rest = divmod(len(raw), self.itemsize)
        if rest:
            raise ValueError(f"{len(raw)} bytes is not a whole number of {self.itemsize}-byte values")
        if n > self.max_len:
            raise ValueError(f"array has {n} values, limit is {self.max_len}")
        return n

    def counts(self, raws: list[bytes]) -> list[int]:
        """`count` of many arrays in one pass; ValueError(index, reason) for the first bad one."""
        size = self.itemsize
        lengths = [len(r) for r in raws]
        if max(lengths, default=0) > self.max_len * size or any(n % size for n in lengths):
            for i, r in enumerate(raws):
                try:
                    self.count(r)
                except ValueError as exc:
                    raise ValueError(i, str(exc)) from None
        return [n // size for n in lengths]

    def from_wire(self, raw: bytes) -> np.ndarray:
        """Decoded wire bytes (checked by `count`) as a read-only view: no copy (a copy costs as much as
        the rest of the per-array work); a byte swap only on big-endian hosts. Nothing writes into
        arrays that came over the wire."""
        return from_le_bytes(raw, self.dtype)

    def _validate(self, value: Any) -> np.ndarray:
        if type(value) is np.ndarray and value.ndim == 1 and value.dtype == _wire_dtype(
            self.dtype)[1] and value.size <= self.max_len:
            return value.copy()  # already exactly what the checks below would produce (e.g. a lease's prompt)
        if isinstance(value, (str, bytes)):
            try:
                arr = unpack(value, self.dtype, self.max_len)
            except ValueError as exc:
                raise PydanticCustomError("packed_array", "{msg}", {"msg": str(exc)}) from None
        elif isinstance(value, (list, tuple, np.ndarray)):
            arr = np.asarray(value)
            if arr.ndim != 1:
                raise PydanticCustomError("packed_array", "expected a 1-D array, got {ndim} dimensions",
                    {"ndim": arr.ndim})
            if arr.size and np.issubdtype(np.dtype(self.dtype), np.integer):
                if not np.issubdtype(arr.dtype, np.integer):
                    raise PydanticCustomError("packed_array", "expected integers, got {dtype}",
                        {"dtype": str(arr.dtype)})
                info = np.iinfo(self.dtype)
                if arr.min() < info.min or arr.max() > info.max:
                    raise PydanticCustomError("packed_array", "value out of {dtype} range", {"dtype": self.dtype})
            try:
                arr = arr.astype(self.dtype)
            except (TypeError, ValueError) as exc:
                raise PydanticCustomError("packed_array", "cannot convert to {dtype}: {msg}", {"dtype": self.dtype,
                    "msg": str(exc)}) from None
        else:
            raise PydanticCustomError("packed_array", "expected base64 string or array, got {t}",
                {"t": type(value).__name__})
        if arr.size > self.max_len:
            raise PydanticCustomError("packed_array", "array has {n} values, limit is {limit}", {"n": int(arr.size),
                "limit": self.max_len})
        return arr

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        # From JSON, pydantic-core decodes the base64 (WireModel sets `val_json_bytes`): no Python call
        # per array for that, and none at all for a deferred one.
        json_schema = core_schema.bytes_schema()
        if not self.deferred:
            def from_json(raw: bytes) -> np.ndarray:
                try:
                    self.count(raw)
                except ValueError as exc:
                    raise PydanticCustomError("packed_array", "{msg}", {"msg": str(exc)}) from None
                return self.from_wire(raw)

            json_schema = core_schema.no_info_after_validator_function(from_json, json_schema)
        return core_schema.json_or_python_schema(
            json_schema=json_schema,
            python_schema=core_schema.no_info_plain_validator_function(self._validate),
            serialization=core_schema.plain_serializer_function_ser_schema(lambda arr: pack(arr, self.dtype),
            when_used="json"),
        )

    def __get_pydantic_json_schema__(self, schema: Any, handler: Any) -> dict[str, Any]:
        return {
            "type": "string",
            "contentEncoding": "base64",
            "description": f"base64 of little-endian {self.dtype} values (at most {self.max_len})",
        }
