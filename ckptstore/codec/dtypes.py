"""The dtypes ckptstore stores, by name and size, without importing torch.

Listing, inspecting and verifying a store read only JSON and bytes: they need the size of a
dtype and its safetensors code, never a ``torch.dtype``. Keeping those facts here lets
``ckptstore ls``, ``verify`` and ``prune --dry-run`` run without importing torch (1.5-2 s of
start-up; issue 12). The torch dtypes themselves are built from these names where a tensor
is made (``codec/tree.py``'s ``SUPPORTED_DTYPES``, ``codec/safetensors.py``).
"""

from __future__ import annotations

__all__ = ["ITEMSIZE", "SAFETENSORS_CODES"]

#: Every dtype the payload formats store: its name (``str(torch.float32)`` without
#: ``torch.``) and its size in bytes.
ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "complex64": 8,
}

#: safetensors' dtype code -> the dtype's name.
SAFETENSORS_CODES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "C64": "complex64",
}
