"""kv_transfer.checksum: CRC32C through the wheel's C library (GIL released), its fallbacks, CRC-32."""

from __future__ import annotations

import sys
import threading
import time
import zlib

import numpy as np
import pytest

from kv_transfer import checksum

CHECK = b"123456789"  # the standard check input: CRC32C 0xE3069283, CRC-32 0xCBF43926


def test_known_check_values_for_every_implementation() -> None:
    assert checksum.crc32c_pure(CHECK) == 0xE3069283
    assert checksum.crc32c(CHECK) == 0xE3069283
    assert checksum.crc32(CHECK) == 0xCBF43926 == zlib.crc32(CHECK)
    assert checksum.compute(checksum.CRC32C, CHECK) == 0xE3069283
    assert checksum.compute(checksum.CRC32, CHECK) == 0xCBF43926
    with pytest.raises(ValueError, match="unknown checksum algorithm 7"):
        checksum.compute(7, CHECK)


@pytest.mark.parametrize("algo", [checksum.CRC32, checksum.CRC32C])
def test_buffer_kinds_and_continuation_agree(algo: int) -> None:
    data = np.random.default_rng(0).integers(0, 256, 10_001, dtype=np.uint8)
    whole = checksum.compute(algo, data.tobytes())
    assert checksum.compute(algo, data) == whole  # ndarray
    assert checksum.compute(algo, memoryview(bytearray(data.tobytes())).toreadonly()) == whole  # read-only view
    assert checksum.compute(algo, data[4000:], checksum.compute(algo, data[:4000])) == whole  # continued
    assert checksum.compute(algo, data[:10_000].view(np.int16)) == checksum.compute(algo, data[:10_000])  # any dtype


def test_native_crc32c_matches_the_pure_one_on_odd_lengths() -> None:
    rng = np.random.default_rng(1)
    for n in (0, 1, 7, 63, 64, 65, 4097):
        buf = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert checksum.crc32c(buf) == checksum.crc32c_pure(buf), n


@pytest.mark.skipif(checksum.IMPLEMENTATION != "ctypes", reason="needs google-crc32c's bundled C library")
def test_ctypes_crc32c_releases_the_gil() -> None:
    """Another thread runs Python while a large buffer is checksummed.

    With forced GIL hand-offs switched off (a switch interval of 60 s), another thread
    can run only where the running one lets the GIL go. A ticker thread wakes every
    millisecond; if it ticked between the two reads around a checksum call, the call
    let go of the GIL. A call that kept it would show no tick however long it ran, so
    this needs no timing bound: a busy machine only makes it take more calls.
    """
    big = np.ones(32 << 20, dtype=np.uint8)
    stop, ticks = threading.Event(), [0]

    def tick() -> None:
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)  # lets the GIL go

    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    ticker = threading.Thread(target=tick)
    try:
        ticker.start()
        seen, calls, deadline = 0, 0, time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            before = ticks[0]
            checksum.crc32c(big)
            seen, calls = ticks[0] - before, calls + 1
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        ticker.join()
    assert seen > 0, f"no tick during {calls} checksum calls: the GIL was held"
