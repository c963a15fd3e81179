"""Errors raised by kv_transfer.

Expected outcomes (a miss, no room) are return values, not exceptions; these
errors mark data that must not be used.
"""

from __future__ import annotations


class KVTransferError(Exception):
    """Base class of kv_transfer errors."""


class CorruptObjectError(KVTransferError):
    """An encoded object failed verification: bad magic or version, truncated,
    checksum mismatch, or a header that does not fit the expected layout.

    The caller counts it, drops the object from its tier and recomputes.
    """


class LayoutMismatchError(CorruptObjectError):
    """A well-formed object written for another model geometry or dtype."""
