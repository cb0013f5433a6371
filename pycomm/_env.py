"""pycomm's environment variables, and the arguments that set the same things
(timeouts, ranks, sizes), read and checked in one place.

A reader returns the variable's value, or ``default`` when it is unset or
empty, and raises :class:`CommError` naming the variable and what it takes
when the value is malformed, as a bad argument would: a typo must not turn a
setting off or into something else (``PYCOMM_HEARTBEAT_S=5s`` silently
meant "no heartbeat"; ``PYCOMM_TIMEOUT=-1`` made every wait time out at once).
The variables: docs/environment.md.

Example::

    timeout = _env.seconds("PYCOMM_TIMEOUT", 300.0)
"""
from __future__ import annotations

import math
import operator
import os
from typing import Optional

from ._loader import CommError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def check_seconds(value: object, what: str, *, zero_ok: bool = False) -> float:
    """``value`` as a number of seconds: finite and > 0 (>= 0 with ``zero_ok``,
    where 0 turns the bound off). ``what`` names it in the error.

    Example::

        check_seconds(30, "timeout") == 30.0
    """
    try:
        s = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise CommError(f"pycomm: {what}={value!r} is not a number of seconds") from None
    if not math.isfinite(s) or s < 0 or (s == 0 and not zero_ok):
        bound = ">= 0 (0: off)" if zero_ok else "> 0"
        raise CommError(f"pycomm: {what}={value!r}: a timeout must be a finite number of seconds {bound}")
    return s


def check_whole(value: object, what: str, *, minimum: int) -> int:
    """``value`` as a whole number >= ``minimum``: an int (or anything with
    ``__index__``, as numpy's), not a bool, a float or a string.

    Example::

        check_whole(4, "world_size", minimum=1) == 4
    """
    if isinstance(value, bool):
        raise CommError(f"pycomm: {what}={value!r} is not a whole number")
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise CommError(f"pycomm: {what}={value!r} is not a whole number") from None
    return _at_least(n, minimum, what, value)


def _at_least(n: int, minimum: int, what: str, given: object) -> int:
    if n < minimum:
        raise CommError(f"pycomm: {what}={given!r} must be at least {minimum}")
    return n


def _raw(name: str) -> Optional[str]:
    value = os.environ.get(name, "").strip()
    return value or None


def seconds(name: str, default: float, *, zero_ok: bool = False) -> float:
    """A number of seconds from ``name`` (see :func:`check_seconds`)."""
    value = _raw(name)
    return default if value is None else check_seconds(value, name, zero_ok=zero_ok)


def whole(name: str, default: Optional[int], *, minimum: int) -> Optional[int]:
    """A whole number >= ``minimum`` from ``name``."""
    value = _raw(name)
    if value is None:
        return default
    try:
        n = int(value)
    except ValueError:
        raise CommError(f"pycomm: {name}={value!r} is not a whole number") from None
    return _at_least(n, minimum, name, value)


def parse_size(text: str) -> int:
    """Bytes from "65536", "64K", "4M", "1G" (or "4MB"); ValueError if malformed.

    Example::

        parse_size("4M") == 4 << 20
    """
    t = text.strip().upper().rstrip("B")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    n = float(t) * mult
    if not math.isfinite(n):
        raise ValueError(f"not a size: {text!r}")
    return int(n)


def format_size(n: int) -> str:
    """The inverse of :func:`parse_size` for whole units: 65536 -> '64K', 1000 -> '1000'.

    Example::

        format_size(4 << 20) == "4M"
    """
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def size(name: str, default: int) -> int:
    """A byte size > 0 from ``name`` ("65536", "64K", "4M", "1G")."""
    value = _raw(name)
    if value is None:
        return default
    try:
        n = parse_size(value)
    except ValueError:
        raise CommError(f"pycomm: {name}={value!r} is not a size in bytes (e.g. 65536, 64K, 4M)") from None
    if n <= 0:
        raise CommError(f"pycomm: {name}={value!r} must be a size above 0")
    return n


def flag(name: str, default: bool = False) -> bool:
    """On or off from ``name``: 1/true/yes/on or 0/false/no/off (any case)."""
    value = _raw(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise CommError(f"pycomm: {name}={value!r} is neither on (1, true, yes, on) nor off (0, false, no, off)")
