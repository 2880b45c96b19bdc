"""GGUF's 5-bit, K-quant and IQ4 formats (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS) read from their file blocks
and repacked, exactly, into the x8 layout of verispec's CPU kernel (csrc/cpu.c's header describes it).

Each format's blocks are decoded to unsigned levels q per element and their scales: then
  Q5_0  w = d (q - 16)             per 32, q 0..31: d fp16, kept as stored (min -16 d in the kernel)
  Q5_1  w = d q + m                per 32: d, m fp16, kept
  Q4_K  w = (d sc_j) q - dmin m_j  per sub-block j (32 elements) of 256: d, dmin fp16 -> fp32, sc_j, m_j 6-bit
  Q5_K  the same with q 0..31
  Q6_K  w = (d sc_h) (q - 32)      per half-block h (16 elements) of 256: d fp16 -> fp32, sc_h int8, q 0..63
  IQ4_NL  w = d IQ4[q]             per 32: d fp16, q 0..15 indexing 16 fixed int8 values (llama.cpp's kvalues)
  IQ4_XS  w = (d (ls_j - 32)) IQ4[q]  per sub-block j (32) of 256: d fp16 -> fp32, ls_j 6-bit
and laid out per 8 output rows: the low 4 bits of q in the nibble groups Q4_0 / Q4_1 use, the bits above in planes
after them, every scale as the file stores it (fp16 d, dmin as -dmin, Q4_K / Q5_K's 12 bytes of packed 6-bit scales
and mins, which the kernel unpacks per sub-block). So a sub-block of Q4_K / Q5_K is a Q4_1-style block of scale
d sc_j and min -dmin m_j, both exact fp32 products (11 x 6 bits), and the kernel runs Q4_1's arithmetic on it;
Q6_K's two scales per 32 are applied to the halves' exact integer sums.

Bytes, repacked against the file: the same for every format but IQ4_XS (4.3125 bits per weight against 4.25: its
6-bit sub-block scales are kept one byte each).

Activations: rounded to int8 with one scale per 32 values for every format, as for Q4_0 / Q8_0 (llama.cpp rounds
them per 256 against the K-quants, its Q8_K). Per 32 is the finer rounding (an outlier spoils 32 values, not 256):
docs/results/formats.md has the measured error of both against the float64 product; and it keeps one quantised
activation row shared by every part of a mixed weight (a Q4_K_M's q, k and v may be Q4_K, Q4_K and Q6_K).
"""

from __future__ import annotations

import numpy as np

ROWS = 8
# format -> (elements per file block, bytes per file block)
FILE_BLOCKS: dict[str, tuple[int, int]] = {"Q5_0": (32, 22), "Q5_1": (32, 24), "Q4_K": (256, 144),
                                           "Q5_K": (256, 176), "Q6_K": (256, 210), "IQ4_NL": (32, 18),
                                           "IQ4_XS": (256, 136)}
HIGH_BITS = {"Q5_0": 1, "Q5_1": 1, "Q4_K": 0, "Q5_K": 1, "Q6_K": 2, "IQ4_NL": 0, "IQ4_XS": 0}
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] float16."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 scale bytes [..., 12] -> the 8 sub-blocks' 6-bit scales and mins, uint8 [..., 8] each:
    sub-block j < 4 in the low 6 bits of bytes j and 4 + j; j >= 4 in byte 8 + (j - 4)'s nibbles and the top 2 bits
    of bytes j - 4 and j."""
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], -1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], -1)
    return sc, mn


def decode(raw: np.ndarray, kind: str) -> dict[str, np.ndarray]:
    """raw: uint8 [N, K / block * bytes per block], a tensor's rows of file blocks -> {"q": uint8 [N, K] levels,
    and per format its scales: "d" [N, blocks] float16 (+ "m" for Q5_1); K-quants "d" (+ "dmin") [N, K/256]
    float16, "sc" (+ "mn") [N, K/256, 8 or 16] uint8 (int8 for Q6_K), Q4_K / Q5_K's packed "scales" [N, K/256, 12]}."""
    elems, size = FILE_BLOCKS[kind]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    n = raw.shape[0]
    if raw.ndim != 2 or raw.shape[1] % size:
        raise ValueError(f"{kind}: rows of {raw.shape[1:]} bytes are not whole {size}-byte blocks")
    b = raw.reshape(n, -1, size)
    nb = b.shape[1]
    if kind == "IQ4_NL":  # d, then 16 bytes: element l in the low nibble of byte l, l + 16 in its high one
        return {"q": np.concatenate([b[:, :, 2:] & 15, b[:, :, 2:] >> 4], -1).reshape(n, -1), "d": _f16(b[:, :, 0:2])}
    if kind == "IQ4_XS":  # d, 2 bytes of high and 4 of low scale bits, then 16 nibble bytes per sub-block as IQ4_NL
        hi = b[:, :, 2:4].copy().view(np.uint16)  # [N, nb, 1]
        lo = b[:, :, 4:8]
        ls = ((lo[:, :, :, None] >> np.array([0, 4], np.uint8)) & 15).reshape(n, nb, 8)
        ls = ls | (((hi >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8) << 4)
        qs = b[:, :, 8:].reshape(n, nb, 8, 16)
        q = np.concatenate([qs & 15, qs >> 4], -1).reshape(n, -1)
        return {"q": q, "d": _f16(b[:, :, 0:2]), "ls": (ls.astype(np.int16) - 32).astype(np.int8)}
    if kind in ("Q5_0", "Q5_1"):
        at = 4 if kind == "Q5_1" else 2
        qh = np.unpackbits(b[:, :, at : at + 4], axis=-1, bitorder="little")  # [N, nb, 32]: bit j of element j
        qs = b[:, :, at + 4 :]
        q = np.concatenate([qs & 15, qs >> 4], -1) | (qh << 4)
        out = {"d": _f16(b[:, :, 0:2, None].reshape(n, nb, 2))}
        if kind == "Q5_1":
            out["m"] = _f16(b[:, :, 2:4])
        return {"q": q.reshape(n, -1), **out}
    if kind in ("Q4_K", "Q5_K"):
        sc, mn = _scale_min_k4(b[:, :, 4:16])
        qs = b[:, :, -128:].reshape(n, nb, 4, 32)  # 64 elements per 32 bytes: low nibbles, then high
        q = np.stack([qs & 15, qs >> 4], 3).reshape(n, nb, 256)
        if kind == "Q5_K":
            qh = b[:, :, 16:48]  # bit i of byte l: element 32 i + l
            q = q | (((qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4).reshape(n, nb, 256)
        return {"q": q.reshape(n, -1), "d": _f16(b[:, :, 0:2]), "dmin": _f16(b[:, :, 2:4]), "sc": sc, "mn": mn,
                "scales": b[:, :, 4:16]}
    # Q6_K: ql [128], qh [64], scales int8 [16], d; per 128-element half, ql's 64 bytes hold elements l (low
    # nibbles) and 64 + l (high), qh's 32 bytes the 2 high bits of elements 32 s + l in bits 2 s
    ql, qh = b[:, :, 0:128].reshape(n, nb, 2, 64), b[:, :, 128:192].reshape(n, nb, 2, 32)
    low = np.concatenate([ql & 15, ql >> 4], -1)  # [N, nb, 2, 128]
    high = ((qh[:, :, :, None, :] >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3).reshape(n, nb, 2, 128)
    q = (low | (high << 4)).reshape(n, -1)
    return {"q": q, "d": _f16(b[:, :, 208:210]), "sc": b[:, :, 192:208].view(np.int8)}


def dequantize(dec: dict[str, np.ndarray], kind: str) -> np.ndarray:
    """[N, K] float32 from `decode`'s levels and scales, in gguf's fp32 arithmetic (for the tests' oracle)."""
    q = dec["q"].astype(np.float32)
    n, k = q.shape
    if kind in ("IQ4_NL", "IQ4_XS"):
        v = IQ4_VALUES[dec["q"]].astype(np.float32)
        if kind == "IQ4_NL":
            return (dec["d"].astype(np.float32)[:, :, None] * v.reshape(n, -1, 32)).reshape(n, k)
        dl = (dec["d"].astype(np.float32)[:, :, None] * dec["ls"].astype(np.float32))[..., None]
        return (dl * v.reshape(n, -1, 8, 32)).reshape(n, k)
    if kind in ("Q5_0", "Q5_1"):
        d = dec["d"].astype(np.float32)[:, :, None]
        qb = q.reshape(n, -1, 32)
        w = d * (qb - 16) if kind == "Q5_0" else d * qb + dec["m"].astype(np.float32)[:, :, None]
        return w.reshape(n, k)
    if kind in ("Q4_K", "Q5_K"):
        d = (dec["d"].astype(np.float32)[:, :, None] * dec["sc"].astype(np.float32))[..., None]
        dm = (dec["dmin"].astype(np.float32)[:, :, None] * dec["mn"].astype(np.float32))[..., None]
        return (d * q.reshape(n, -1, 8, 32) - dm).reshape(n, k)
    d = (dec["d"].astype(np.float32)[:, :, None] * dec["sc"].astype(np.float32))[..., None]
    return (d * (q.reshape(n, -1, 16, 16) - 32)).reshape(n, k)


def _groups(q: np.ndarray, kind: str) -> np.ndarray:
    """levels uint8 [G * 8, K] -> per 32-block the kernel's quant bytes [G, K / 32, 128 (+ 32 or 64)]: nibble
    group k < 4 = [row][e] bytes of elements 4k + e (low) and 16 + 4k + e (high); then the high-bit planes."""
    g, nb = q.shape[0] // ROWS, q.shape[1] // 32
    x = q.reshape(g, ROWS, nb, 32).transpose(0, 2, 1, 3)  # [G, nb, row, 32]
    lo = (x & 15).reshape(g, nb, ROWS, 2, 4, 4)  # [.., row, half, k, e]
    nib = (lo[..., 0, :, :] | (lo[..., 1, :, :] << 4)).transpose(0, 1, 3, 2, 4).reshape(g, nb, 128)
    bits = HIGH_BITS[kind]
    if not bits:
        return nib
    h = (x >> 4).reshape(g, nb, ROWS, 8, 4)  # [.., row, group G, e]
    if bits == 1:
        plane = (h << np.arange(8, dtype=np.uint8)[:, None]).sum(3, dtype=np.uint8).reshape(g, nb, 32)
    else:
        h = h.reshape(g, nb, ROWS, 2, 4, 4)  # [.., row, G // 4, G % 4, e]
        plane = (h << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(4, dtype=np.uint8)  # [.., row, 2, e]
        plane = plane.transpose(0, 1, 3, 2, 4).reshape(g, nb, 64)
    return np.concatenate([nib, plane], -1)


def _by_rows(a: np.ndarray, g: int) -> np.ndarray:
    """[G * 8, B, ...] -> [G, B, ..., 8] (the 8 rows of a group innermost), as bytes [G, B, -1]."""
    a = a.reshape(g, ROWS, *a.shape[1:])
    return np.ascontiguousarray(np.moveaxis(a, 1, -1)).view(np.uint8).reshape(g, a.shape[2], -1)


def pack(raw: np.ndarray, kind: str) -> np.ndarray:
    """raw: uint8 [N, bytes per row] file blocks -> the kernel's tiles, uint8 [ceil(N / 8), K / 32, tile bytes]
    (Q5_0, Q5_1) or [ceil(N / 8), K / 256, superblock bytes] (K-quants). Rows past N are zero."""
    n = raw.shape[0]
    rows = -(-n // ROWS) * ROWS
    padded = np.zeros((rows, raw.shape[1]), np.uint8)
    padded[:n] = raw
    dec = decode(padded, kind)
    g = rows // ROWS
    quants = _groups(dec["q"], kind)  # [G, K/32, bytes]
    if kind in ("Q5_0", "Q5_1", "IQ4_NL"):
        lead = [_by_rows(dec["d"], g)] + ([_by_rows(dec["m"], g)] if kind == "Q5_1" else [])
        return np.ascontiguousarray(np.concatenate([*lead, quants], -1))
    ns = quants.shape[1] // 8
    head = [_by_rows(dec["d"], g)]  # fp16, as in the file
    if kind == "Q6_K":
        head.append(_by_rows(dec["sc"], g))  # [G, ns, 16 halves x 8 rows]
    elif kind == "IQ4_XS":
        head.append(_by_rows(dec["ls"], g))  # [G, ns, 8 sub-blocks x 8 rows]: ls_j - 32
    else:
        head += [_by_rows(-dec["dmin"], g), _by_rows(dec["scales"], g)]  # -dmin fp16; [G, ns, 12 bytes x 8 rows]
    return np.ascontiguousarray(np.concatenate([*head, quants.reshape(g, ns, -1)], -1))
