"""What the plan records' fields hold, checked: ints and shapes (:func:`_check_int`,
:func:`_check_shape`, shared by every record's ``__post_init__``) and dtype strings
(:func:`check_dtype_str`, :func:`dtype_str`, :func:`itemsize_nbytes`).

Dtypes are carried as strings, exactly as ``str(torch.dtype)`` prints them
(``"torch.float32"``, ``"torch.bfloat16"``), so plans serialise to JSON without torch objects.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "WIRE_DTYPES",
    "dtype_str",
    "wire_dtype_str",
    "itemsize_nbytes",
    "check_dtype_str",
]

#: the floating-point dtypes dmuon's buffers carry (a mixed-precision policy's ``param_dtype`` /
#: ``reduce_dtype``, and the parameters' own): the one list the planner, the CLI and the runtime use
WIRE_DTYPES = ("torch.float32", "torch.float64", "torch.float16", "torch.bfloat16")


def _check_int(owner: str, name: str, value: Any, minimum: int) -> None:
    if type(value) is not int:  # bool and numpy ints rejected on purpose: JSON must round-trip
        raise TypeError(f"{owner}.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value}")


def _check_shape(owner: str, name: str, value: Any) -> None:
    if type(value) is not tuple:
        raise TypeError(f"{owner}.{name} must be a tuple of ints, got {type(value).__name__}")
    for d in value:
        _check_int(owner, name + "[i]", d, 0)


def check_dtype_str(owner: str, name: str, value: Any, *, optional: bool = False) -> None:
    """Raise unless ``value`` is ``"torch.<name>"`` naming a ``torch.dtype`` (or None if optional)."""
    if value is None and optional:
        return
    if not isinstance(value, str) or not value.startswith("torch."):
        raise ValueError(f"{owner}.{name} must be a dtype string like 'torch.float32', got {value!r}")
    if not isinstance(getattr(torch, value[len("torch.") :], None), torch.dtype):
        raise ValueError(f"{owner}.{name}: {value!r} is not a torch dtype")


def dtype_str(dtype: Any) -> str | None:
    """Normalise a ``torch.dtype``, a dtype string (``"torch.bfloat16"`` or ``"bfloat16"``) or
    None to the canonical string form (``str(torch.dtype)``) or None.

    Raises:
        ValueError: the value does not name a torch dtype.
    """
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        return str(dtype)
    if isinstance(dtype, str):
        name = dtype[len("torch.") :] if dtype.startswith("torch.") else dtype
        resolved = getattr(torch, name, None)
        if isinstance(resolved, torch.dtype):
            return str(resolved)
    raise ValueError(f"not a torch dtype: {dtype!r}")


def wire_dtype_str(dtype: Any, what: str) -> str | None:
    """:func:`dtype_str` of ``dtype`` (None stays None) if it is one of :data:`WIRE_DTYPES`.

    Raises:
        ValueError: naming ``what`` (e.g. ``"mp_policy.param_dtype"``) and the dtypes allowed.
    """
    name = dtype_str(dtype)
    if name is not None and name not in WIRE_DTYPES:
        raise ValueError(
            f"{what} = {name}: dmuon's buffers carry floating-point dtypes only "
            f"({', '.join(d[len('torch.') :] for d in WIRE_DTYPES)})"
        )
    return name


def itemsize_nbytes(dtype: str) -> int:
    """Bytes per element of the dtype named by ``dtype`` (e.g. ``"torch.bfloat16"`` -> 2)."""
    resolved = getattr(torch, dtype[len("torch.") :] if dtype.startswith("torch.") else dtype, None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"not a torch dtype: {dtype!r}")
    return resolved.itemsize
