"""kv_transfer.checksum: CRC32C through the wheel's C library (GIL released), its fallbacks, CRC-32."""

from __future__ import annotations

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
    """Another thread keeps running Python while a large buffer is checksummed: its loop count
    over the checksum calls is a real fraction of its count while the main thread sleeps."""
    big = np.ones(32 << 20, dtype=np.uint8)

    def count_during(work) -> int:
        stop, n = threading.Event(), [0]

        def spin() -> None:
            while not stop.is_set():
                n[0] += 1

        th = threading.Thread(target=spin)
        th.start()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.3:
            work()
        stop.set()
        th.join()
        return n[0]

    idle = count_during(lambda: time.sleep(0.005))
    busy = count_during(lambda: checksum.crc32c(big))
    assert busy > 0.2 * idle, (busy, idle)
