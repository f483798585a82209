"""Arguments checked before ctypes converts them. ctypes wraps an integer that does not fit its
C type (device 2**32 becomes device 0, a cap of 2**64 + 5 bytes a cap of 5) and a C string ends
at the first NUL, so the library would act on something the caller never asked for."""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Optional, Union

from ._lib import VramLedgerError, abi, load

INT_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type. Also a ValueError, which is what these arguments raised for
    a wrong type before they were checked this way, so that code catching it keeps working."""


class RefusedValueError(VramLedgerError, ValueError):
    """A value the library itself refused (with VramLedgerError) before this package checked it
    first: a negative or missing device, a tag name tag() does not know."""


def integer(value: Any, what: str, *, minimum: int = 0, maximum: int = INT64_MAX, c_type: str = "int64_t") -> int:
    """`value`, an int in [minimum, maximum], the range of the C argument it becomes."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{what} must be an int, not {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{what} must be at least {minimum}, not {value}")
    if value > maximum:
        raise OverflowError(f"{what} {value} is too large for its C type {c_type} (at most {maximum})")
    return int(value)


def flag(value: Any, what: str) -> int:
    """A bool as 0 or 1. Only a bool, as PyTorch's bindings take it: a truthy object passed by
    mistake (a string, a pool) would otherwise switch the option on silently."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{what} must be True or False, not {value!r}")
    return int(value)


def optional_integer(value: Any, what: str, **limits: Any) -> Optional[int]:
    """None, or an int as `integer` checks it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{what} must be an int or None, not {type(value).__name__}")
    return integer(value, what, **limits)


def device(value: Optional[int]) -> int:
    """A device ordinal: `value`, or with None the current CUDA device once PyTorch has
    initialised CUDA (else 0)."""
    if value is None:
        try:
            import torch

            if torch.cuda.is_initialized():
                return int(torch.cuda.current_device())
        except ImportError:
            pass
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        raise RefusedValueError(f"device {value} is not a device ordinal")
    d = integer(value, "device", maximum=INT_MAX, c_type="int")
    # With no device counted the library's own error says why (no driver, say): left to it.
    count = load().vram_ledger_device_count()
    if 0 < count <= d:
        raise RefusedValueError(f"no device with ordinal {d}: {count} device(s) available")
    return d


def devices(value: Optional[int]) -> int:
    """`value` as a device, or -1 (every device in use) for None."""
    return -1 if value is None else device(value)


def tag_name(name: Any) -> str:
    """A name tag() accepts."""
    if not isinstance(name, str):
        raise ArgumentTypeError(f"tag name must be a str, not {type(name).__name__}")
    a = abi()
    if name not in a.tag_bits:
        # The library's wording, from when it was the one to refuse the name.
        raise RefusedValueError(f"unknown tag {json.dumps(name, ensure_ascii=False)}: expected one of {a.expected_tags}")
    return name


def pool_tag(name: Any) -> Optional[str]:
    """mempool()'s tag: a tag name, or None for none."""
    if name is None:
        return None
    if not isinstance(name, str):
        raise ArgumentTypeError(f"tag must be a str or None, not {type(name).__name__}")
    tags = abi().tags
    if name not in tags:
        raise ValueError(f"tag must be one of {', '.join(tags)}, not {name!r}")
    return name


def tag_mask(tags: Union[str, Iterable[str], None], what: str) -> int:
    """The mask of sleep and wake for `tags` (one name, or several)."""
    if tags is None or isinstance(tags, str):
        names: Iterable[Any] = () if tags is None else [tags]
    else:
        try:
            names = list(tags)
        except TypeError:
            raise ArgumentTypeError(f"{what} must be a tag name or an iterable of them, not {type(tags).__name__}") from None
    a = abi()
    mask = 0
    for t in names:
        if not isinstance(t, str):
            raise ArgumentTypeError(f"{what}: a tag name must be a str, not {type(t).__name__}")
        if t not in a.tag_bits:
            raise ValueError(f"{what}: unknown tag {t!r}; expected one of {a.expected_tags}")
        mask |= a.tag_bits[t]
    return mask


def mode(value: Any) -> Optional[str]:
    """A segment mode name, or None (keep the configured one)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ArgumentTypeError(f"mode must be a str or None, not {type(value).__name__}")
    modes = abi().modes
    if value not in modes:
        raise ValueError(f"mode must be one of {', '.join(modes)}, not {value!r}")
    return value


def utilization(value: Any) -> float:
    """A fraction of the device's memory, in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"utilization must be a number in (0, 1], not {value!r}")
    if not (0.0 < value <= 1.0):
        raise ValueError(f"utilization must be a number in (0, 1], not {value!r}")
    return float(value)


def path(value: Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]) -> bytes:
    """A file system path as the C string the library opens."""
    encoded = os.fsencode(value)
    if b"\0" in encoded:
        raise ValueError(f"path {value!r} contains a NUL byte")
    return encoded


def text(value: Any, what: str) -> bytes:
    """A str as the NUL-terminated UTF-8 string the library reads."""
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{what} must be a str, not {type(value).__name__}")
    encoded = value.encode("utf-8")
    if b"\0" in encoded:
        raise ValueError(f"{what} {value!r} contains a NUL byte")
    return encoded
