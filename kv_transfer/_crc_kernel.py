"""The Triton kernel of ``device_crc`` (imported only when a device checks objects: importing
Triton costs every process that imports the store, CPU-only ones too). The math is in
``device_crc``'s docstring."""

import triton
import triton.language as tl


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def crc_kernel(src, pitch_words, tables, cols, out, n_chunks, WORDS: tl.constexpr, LANES: tl.constexpr):
    obj = tl.program_id(0)
    row = src + obj.to(tl.int64) * pitch_words
    acc = tl.zeros([LANES], dtype=tl.uint32)
    for g in range(0, n_chunks, LANES):
        chunk = g + tl.arange(0, LANES)
        live = chunk < n_chunks
        crc = tl.zeros([LANES], dtype=tl.uint32)
        for w in tl.static_range(WORDS):  # the chunk's words, slice-by-4
            word = tl.load(row + chunk * WORDS + w, mask=live, other=0).to(tl.uint32, bitcast=True)
            crc = crc ^ word
            b0 = (crc & 0xFF).to(tl.int32)
            b1 = ((crc >> 8) & 0xFF).to(tl.int32)
            b2 = ((crc >> 16) & 0xFF).to(tl.int32)
            b3 = (crc >> 24).to(tl.int32)
            crc = (tl.load(tables + 768 + b0).to(tl.uint32, bitcast=True)
                   ^ tl.load(tables + 512 + b1).to(tl.uint32, bitcast=True)
                   ^ tl.load(tables + 256 + b2).to(tl.uint32, bitcast=True)
                   ^ tl.load(tables + b3).to(tl.uint32, bitcast=True))
        for b in tl.static_range(32):  # move the chunk's register to the object's end
            col = tl.load(cols + chunk * 32 + b, mask=live, other=0).to(tl.uint32, bitcast=True)
            acc = acc ^ tl.where(((crc >> b) & 1) != 0, col, 0)
    tl.store(out + obj, tl.reduce(acc, 0, _xor).to(tl.int32, bitcast=True))

