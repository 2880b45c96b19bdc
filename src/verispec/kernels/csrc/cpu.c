/* verispec's own CPU matmul over a GGUF file's weight blocks, in llama.cpp's CPU arithmetic.
 *
 * The weights keep the file's blocks of 32 elements along K, their values untouched:
 *   Q4_0: fp16 d, 32 nibbles      w = (q - 8) d   (taken as q d + m with m = -8 d, exact in float)
 *   Q4_1: fp16 d, fp16 m, nibbles w = q d + m
 *   Q8_0: fp16 d, 32 int8         w = q d
 * but eight output rows are interleaved ("x8" layout, built by kernels/q8act.py) so that one vector's lanes
 * are eight outputs. A tile = 8 rows x 1 block:
 *   d[8] fp16 | m[8] fp16 (Q4_1 only) | quants: 8 groups g of [row 0..7][4 bytes]
 * where for 4-bit weights group g < 4 holds nibble bytes 4g..4g+3 (their low nibbles are elements 4g..4g+3, their
 * high nibbles elements 16+4g..16+4g+3, i.e. group g + 4), and for Q8_0 group g holds elements 4g..4g+3.
 *
 * Each activation row is quantised in blocks of 32 to int8: s = amax / 127, q = round-half-even(x * (1 / s)).
 * Then, per output element (n, r), blocks in order:
 *   acc  = fma(float(sum_j q_w[j] q_x[j]), d_w * s_x, acc)     (the integer sum is exact)
 *   mins = fma(m_w, s_x * sum_j q_x[j], mins)
 * and out = acc + mins. Each output element is computed by one thread in this order whatever the number of rows M,
 * the other rows or the thread count: a row's result never depends on its batch (batch invariance).
 *
 * Five more formats are repacked at load (kernels/kquant.py) into the same 4-bit x8 quant groups, the bits above
 * the fourth in planes beside them, every scale kept as the file stores it (so the K-quant tiles are no larger
 * than the file's blocks, but for IQ4_XS's 6-bit scales kept a byte each):
 *   Q5_0 (w = (q - 16) d), Q5_1 (w = q d + m), q 5-bit: per 32 a tile d[8] fp16 | m[8] (Q5_1) | 128 nibble bytes
 *     | 32 bytes of high bits (bit G of byte [row][e] = bit 4 of element 4G + e);
 *   Q4_K, Q5_K (w = d sc_j q - dmin m_j per 32-element sub-block j of 256): per 8 rows x 256 a superblock
 *     d[8] fp16 | -dmin[8] fp16 | the file's 12 scale bytes [12][8 rows] (sc_j, m_j 6-bit: scale_min_k4) | 8 x (128
 *     nibble bytes | 32 high bytes (Q5_K)); a sub-block is then a 32-block of scale d sc_j and min -dmin m_j, both
 *     products exact in fp32 (11 x 6 bits);
 *   Q6_K (w = d sc_h (q - 32) per 16-element half h): d[8] fp16 | sc[16 halves][8 rows] s8 | 8 x (128 nibble bytes
 *     | 64 bytes of 2 high bits: groups 0..3 then 4..7, bits 2(G % 4) .. + 1);
 *   IQ4_NL (w = d IQ4[q] per 32, a table of 16 int8 values): d[8] fp16 | 128 nibble bytes; IQ4_XS (w = d (ls_j - 32)
 *     IQ4[q] per sub-block j of 256): d[8] fp16 | ls_j - 32 [8][8] s8 | 8 x 128 nibble bytes.
 * For those, per block (G: groups of 4 elements, S: the exact integer sum of q_w q_x):
 *   Q5_0 / Q5_1 / Q4_K / Q5_K: as Q4_1 with their d and m (acc = fma(float(S), d * s_x, acc), mins = fma(m, ss))
 *   Q6_K: I = sc_a (S_a - 32 X_a) + sc_b (S_b - 32 X_b) over the block's halves (X: their sums of q_x), exact in
 *     int32; acc = fma(float(I), d * s_x, acc).
 *   IQ4_NL / IQ4_XS: as Q8_0 with the table's values as weights (d, or d (ls_j - 32), as its scale).
 * A weight may be several parts stacked along N, each in its own format (`layout`: kind, rows, byte offset per
 * part): a mixed file's fused q|k|v runs each tensor on its own blocks with the activations quantised once.
 *
 * Three bodies: the portable one (plain C, the reference), the AVX2 + FMA + F16C one and, where the CPU has
 * AVX-512 F / BW / VL / VNNI, one that takes two tiles per 512-bit vector (16 outputs) and sums with vpdpbusd; the
 * tests hold each to the portable one bit for bit, so choosing among them (vs_set_body) changes only the speed.
 * Built at first use by kernels/cpu_kernels.py with the flags this CPU has.
 *
 * Also here: `vs_attention`, fp32 attention of a few query rows over their keys, `vs_rope`, and `vs_decoder`,
 * every decoder layer of a forward in one call (see there).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VS_AVX2 1
#include <immintrin.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define VS_AVX512 1
#endif
#endif

#define QK 32
enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q5_0 = 3, Q5_1 = 4, Q4_K = 5, Q5_K = 6, Q6_K = 7, IQ4_NL = 8, IQ4_XS = 9,
       NKINDS = 10 };
static const int TILE_BYTES[NKINDS] = {144, 160, 272, 176, 192, 1152, 1408, 1680, 144, 1104};
/* IQ4_NL / IQ4_XS: a nibble indexes these int8 values (llama.cpp's kvalues_iq4nl) */
static const int8_t IQ4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* bytes of one x8 tile (8 rows x 32 elements), or of one 8-row superblock (8 rows x 256) of a K-quant */
int vs_tile_bytes(int kind) { return kind >= 0 && kind < NKINDS ? TILE_BYTES[kind] : -1; }

static inline int kquant(int kind) { return kind == Q4_K || kind == Q5_K || kind == Q6_K || kind == IQ4_XS; }
static inline int iq4(int kind) { return kind == IQ4_NL || kind == IQ4_XS; }

/* the tile (32-block kinds) or superblock (K-quants) holding group g's block b, of nb blocks per row */
static inline const uint8_t *tile_at(const uint8_t *w, int kind, int64_t nb, int64_t g, int64_t b) {
    return kquant(kind) ? w + (g * (nb / 8) + b / 8) * TILE_BYTES[kind] : w + (g * nb + b) * TILE_BYTES[kind];
}

/* from tile_at to block b's 128 nibble bytes (the new kinds; their high-bit planes follow them) */
static inline int64_t quant_off(int kind, int64_t b) {
    switch (kind) {
    case Q5_1: return 32;
    case Q4_K: return 128 + (b % 8) * 128;
    case Q5_K: return 128 + (b % 8) * 160;
    case Q6_K: return 144 + (b % 8) * 192;
    case IQ4_XS: return 80 + (b % 8) * 128;
    default: return 16;
    }
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static float f16_to_f32(uint16_t h) { /* IEEE half -> float, exact */
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t u;
    if (exp == 0x1f) u = sign | 0x7f800000 | (man << 13);
    else if (exp) u = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) u = sign;
    else { /* subnormal half: normalise */
        int e = -1;
        uint32_t m = man;
        do { e++; m <<= 1; } while (!(m & 0x400));
        u = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t f32_to_f16(float f) { /* IEEE float -> half, round to nearest even (as torch and vcvtps2ph) */
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t ax = x & 0x7fffffff;
    if (ax > 0x7f800000) return sign | 0x7e00 | (uint16_t)((ax >> 13) & 0x3ff); /* NaN stays NaN (quiet) */
    if (ax >= 0x477ff000) return sign | 0x7c00; /* at or past 65520 (and inf): inf */
    /* below 2^-14: a subnormal half, in units of 2^-24, rounded to even (1024: the least normal half) */
    if (ax < 0x38800000) return sign | (uint16_t)rintf(fabsf(f) * 16777216.0f);
    return sign | (uint16_t)((ax + 0xc8000fffu + ((ax >> 13) & 1)) >> 13); /* exponent rebased by -112, then RNE */
}

/* n halves -> floats (exact) and n floats -> halves (round to nearest even): a float16 KV cache's reads and writes */
static void f16_to_f32_row(const uint16_t *h, int64_t n, float *out) {
    int64_t i = 0;
#ifdef VS_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) out[i] = f16_to_f32(h[i]);
}

static void f32_to_f16_row(const float *x, int64_t n, uint16_t *out) {
    int64_t i = 0;
#ifdef VS_AVX2
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; i++) out[i] = f32_to_f16(x[i]);
}

/* x [n] -> out [n] halves as a float16 KV cache stores them (tests: portable != 0 takes the plain C conversion
 * for every element, which an AVX2 build otherwise uses only past a multiple of 8) */
int vs_to_f16(const float *x, int64_t n, uint16_t *out, int portable) {
    if (portable)
        for (int64_t i = 0; i < n; i++) out[i] = f32_to_f16(x[i]);
    else
        f32_to_f16_row(x, n, out);
    return 0;
}

/* one row x [K] (float32, or bfloat16 when x_bf16) -> q [K] int8, s [K/32] scales, ss [K/32] s * sum(q) and qsum
 * [K/32] sum(q): per block
 * of 32, d = amax / 127, q = round-half-even(x * (1 / d)). The AVX2 lines compute the same values: max is exact
 * (a NaN ignored, as fmaxf does), x * inv is one IEEE product, and its rounding is nearbyintf's */
static void quantize_row(const void *x, int x_bf16, int64_t K, int8_t *q, float *s, float *ss, int32_t *qsum,
                         int32_t *q16) {
#ifdef VS_AVX2
    /* whole vectors: a block's four in registers, its 32 int8 stored by two packs (the values are in -127..127,
     * so the packs' saturation never acts) and one permutation back into element order */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < K / QK; b++) {
        __m256 v[4];
        for (int i = 0; i < 4; i++) {
            const int64_t at = b * QK + 8 * i;
            v[i] = x_bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
                                _mm_loadu_si128((const __m128i *)((const uint16_t *)x + at))), 16))
                          : _mm256_loadu_ps((const float *)x + at);
        }
        __m256 mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) mx = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), mx);
        float l[8], amax = 0.0f;
        _mm256_storeu_ps(l, mx);
        for (int j = 0; j < 8; j++) amax = l[j] > amax ? l[j] : amax;
        const float d = amax / 127.0f;
        const __m256 inv = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        __m256i qi[4];
        for (int i = 0; i < 4; i++)
            qi[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv),
                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m256i a01 = _mm256_add_epi32(qi[0], qi[1]), a23 = _mm256_add_epi32(qi[2], qi[3]);
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
        _mm256_storeu_si256((__m256i *)(q + b * QK), _mm256_permutevar8x32_epi32(p, order));
        int32_t t[8], u[8], lo = 0, hi = 0;
        _mm256_storeu_si256((__m256i *)t, a01);
        _mm256_storeu_si256((__m256i *)u, a23);
        for (int k = 0; k < 8; k++) lo += t[k], hi += u[k];
        const int32_t sum = lo + hi;
        s[b] = d;
        ss[b] = d * (float)sum;
        qsum[b] = sum;
        q16[2 * b] = lo, q16[2 * b + 1] = hi;
    }
#else
    for (int64_t b = 0; b < K / QK; b++) {
        float v[QK];
        for (int j = 0; j < QK; j++)
            v[j] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[b * QK + j]) : ((const float *)x)[b * QK + j];
        float amax = 0.0f;
        int sum = 0, lo = 0;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(v[j]));
        const float d = amax / 127.0f;
        const float inv = d != 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < QK; j++) {
            const int qj = (int)nearbyintf(v[j] * inv);
            q[b * QK + j] = (int8_t)qj;
            sum += qj;
            if (j < 16) lo += qj;
        }
        s[b] = d;
        ss[b] = d * (float)sum;
        qsum[b] = sum;
        q16[2 * b] = lo, q16[2 * b + 1] = sum - lo;
    }
#endif
}

/* where a product goes: p, float32 or bfloat16 (bf16) [M, N]; res: NULL or a float32 [M, N] residual added to each
 * output as it is stored (float32 p only) */
typedef struct {
    void *p;
    int bf16;
    const float *res;
    int64_t ld; /* elements between rows of p and res (a part of a stacked weight writes its own columns) */
} dest;

static inline void store(const dest *o, int64_t i, float v) {
    if (o->res) v += o->res[i];
    if (o->bf16) ((uint16_t *)o->p)[i] = f32_to_bf16(v);
    else ((float *)o->p)[i] = v;
}

static inline float hsum8(const float *l) { /* 8 lanes added in one fixed order */
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

typedef struct {
    const int8_t *q; /* [M, K] */
    const float *s;  /* [M, K/32] */
    const float *ss; /* [M, K/32] */
    const int32_t *qsum; /* [M, K/32]: each block's sum of q (exact) */
    const int32_t *q16; /* [M, K/16]: each half block's sum of q (exact) */
    const int8_t *qb; /* [M, K/4, 32], the AVX2 body only: each group of 4 of q repeated 8 times (32-byte aligned) */
} qrows;

/* element j of row i of an x8 tile's quants */
static inline int32_t tile_quant(const uint8_t *qs, int kind, int i, int j) {
    if (kind == Q8_0) return (int8_t)qs[(j / 4) * 32 + i * 4 + j % 4];
    const int jj = j & 15; /* nibble byte */
    const uint8_t byte = qs[(jj / 4) * 32 + i * 4 + jj % 4];
    return j < 16 ? (byte & 15) : (byte >> 4);
}

static inline float tile_half(const uint8_t *p, int i) { uint16_t h; memcpy(&h, p + 2 * i, 2); return f16_to_f32(h); }

/* element j of row i of a new kind's block (qs: its nibble bytes, the high-bit planes after them) */
static inline int32_t gen_quant(const uint8_t *qs, int kind, int i, int j) {
    const int jj = j & 15, G = j / 4, e = j % 4;
    int32_t v = (qs[(jj / 4) * 32 + i * 4 + e] >> (j < 16 ? 0 : 4)) & 15;
    if (iq4(kind)) return IQ4[v];
    if (kind == Q6_K) v |= ((qs[128 + (G / 4) * 32 + i * 4 + e] >> (2 * (G % 4))) & 3) << 4;
    else if (kind != Q4_K) v |= ((qs[128 + i * 4 + e] >> G) & 1) << 4;
    return v;
}

/* Q4_K / Q5_K: sub-block j's 6-bit scale and min of row i from the superblock's 12 scale bytes s[k][row] (the
 * file's bytes, 8 rows side by side): j < 4 in the low 6 bits of bytes j (scale) and 4 + j (min); j >= 4 in the
 * nibbles of byte 4 + j and the top 2 bits of bytes j - 4 (scale) and j (min) */
static inline void scale_min_k4(const uint8_t *s, int j, int i, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[8 * j + i] & 63;
        *mn = s[8 * (j + 4) + i] & 63;
    } else {
        const int c = s[8 * (j + 4) + i];
        *sc = (c & 15) | ((s[8 * (j - 4) + i] >> 6) << 4);
        *mn = (c >> 4) | ((s[8 * j + i] >> 6) << 4);
    }
}

/* row i's scale d and min m of block b of a new kind's tile t, or (Q6_K) d and its halves' scales sa, sb */
static inline void gen_params(const uint8_t *t, int kind, int64_t b, int i, float *d, float *m, int32_t *sa,
                              int32_t *sb) {
    const int j = (int)(b % 8);
    *sa = *sb = 0;
    *m = 0.0f;
    if (kind == Q5_0) { *d = tile_half(t, i); *m = -16.0f * *d; }
    else if (kind == IQ4_NL) *d = tile_half(t, i);
    else if (kind == IQ4_XS) *d = tile_half(t, i) * (float)(int8_t)t[16 + 8 * j + i]; /* d (ls_j - 32), exact */
    else if (kind == Q5_1) { *d = tile_half(t, i); *m = tile_half(t + 16, i); }
    else if (kind == Q6_K) {
        *d = tile_half(t, i);
        *sa = (int8_t)t[16 + 16 * j + i];
        *sb = (int8_t)t[24 + 16 * j + i];
    } else { /* Q4_K, Q5_K: d sc_j and -dmin m_j, products exact in fp32 */
        int sc, mn;
        scale_min_k4(t + 32, j, i, &sc, &mn);
        *d = tile_half(t, i) * (float)sc;
        *m = tile_half(t + 16, i) * (float)mn;
    }
}

/* --- the portable body: the reference arithmetic --- */
static void gemm_ref(const uint8_t *w, int kind, const qrows *x, int64_t M, int64_t N, int64_t K, const dest *o) {
    const int64_t nb = K / QK, tb = vs_tile_bytes(kind), qoff = kind == Q4_1 ? 32 : 16;
    #pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int i = (int)(n % 8);
        for (int64_t r = 0; r < M; r++) {
            float acc = 0.0f, mins = 0.0f;
            for (int64_t b = 0; kind >= Q5_0 && b < nb; b++) {
                const uint8_t *t = tile_at(w, kind, nb, n / 8, b), *qs = t + quant_off(kind, b);
                const int8_t *qx = x->q + r * K + b * QK;
                const int64_t rb = r * nb + b;
                float d, m;
                int32_t sa, sb, lo = 0, hi = 0;
                gen_params(t, kind, b, i, &d, &m, &sa, &sb);
                for (int j = 0; j < 16; j++) lo += gen_quant(qs, kind, i, j) * (int32_t)qx[j];
                for (int j = 16; j < QK; j++) hi += gen_quant(qs, kind, i, j) * (int32_t)qx[j];
                if (kind == Q6_K) {
                    const int32_t I = sa * (lo - 32 * x->q16[2 * rb]) + sb * (hi - 32 * x->q16[2 * rb + 1]);
                    acc = fmaf((float)I, d * x->s[rb], acc);
                } else if (iq4(kind)) {
                    acc = fmaf((float)(lo + hi), d * x->s[rb], acc);
                } else {
                    acc = fmaf((float)(lo + hi), d * x->s[rb], acc);
                    mins = fmaf(m, x->ss[rb], mins);
                }
            }
            for (int64_t b = 0; kind < Q5_0 && b < nb; b++) {
                const uint8_t *t = w + ((n / 8) * nb + b) * tb;
                const int8_t *qx = x->q + r * K + b * QK;
                int32_t sum = 0;
                for (int j = 0; j < QK; j++) sum += tile_quant(t + qoff, kind, i, j) * (int32_t)qx[j];
                const float d = tile_half(t, i), sx = x->s[r * nb + b];
                acc = fmaf((float)sum, d * sx, acc);
                if (kind != Q8_0) mins = fmaf(kind == Q4_1 ? tile_half(t + 16, i) : -8.0f * d, x->ss[r * nb + b], mins);
            }
            store(o, r * o->ld + n, acc + mins);
        }
    }
}

/* where the weight streams are fetched ahead to. The AVX-512 body's pair streams (4 rows and more; vs_set_prefetch):
 * 0 into L1 (T0), 1 into L2 (T1), 2 non-temporal (NTA). The single-tile streams of fewer rows, both vector bodies
 * (vs_set_row_prefetch): the same three. Non-temporal, a CPU may keep the ~100 MB of weights a forward
 * reads from displacing what its caches held: the KV cache, and the Python and torch code and data a step runs
 * after its forward (on a 2-core Zen 4 the first small torch op after a forward took 62 us with T0 against 34 with
 * NTA, 4 warm). Only the speed changes, never a bit */
static int prefetch_level = 0, row_prefetch_level = 0;

#ifdef VS_AVX2
/* the `bytes` at p fetched ahead: level 0 into L1 (T0), 1 into L2 (T1), 2 non-temporally (NTA); a line at a time */
static inline __attribute__((always_inline)) void fetch_ahead(const uint8_t *p, int64_t bytes, int level) {
    if (level == 1)
        for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch((const char *)(p + c), _MM_HINT_T1);
    else if (level == 2)
        for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch((const char *)(p + c), _MM_HINT_NTA);
    else
        for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch((const char *)(p + c), _MM_HINT_T0);
}

/* one activation row's block (32 int8) against a tile's 8 unpacked quant vectors: 8 int32 lanes = the 8 rows'
 * block sums. xb holds the block's 8 groups of 4 bytes, each already in every lane (vs_linear writes them once
 * per row; a load each here instead of a shuffle per tile and row: whole forwards x0.91-0.94 at 2-32 rows on a
 * Zen 1 AVX2 CPU, where the shuffles competed with the multiplies for the vector pipes). 4-bit: maddubs
 * (unsigned w x signed x, neighbours added into int16) of all 8 groups summed in int16 (at most 8 * 2 * 15 * 127 = 30480), then one madd with ones. 8-bit:
 * |w| against sign(w) x, each group madd'ed alone (2 * 128 * 127 leaves no int16 room) */
static inline __m256i tile_dot(const __m256i *wv, const __m256i *wabs, const int8_t *xb, int kind) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i x[8];
    for (int g = 0; g < 8; g++) x[g] = _mm256_load_si256((const __m256i *)(xb + 32 * g));
    if (kind != Q8_0) {
        __m256i s16 = _mm256_maddubs_epi16(wv[0], x[0]);
        for (int g = 1; g < 8; g++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(wv[g], x[g]));
        return _mm256_madd_epi16(s16, ones);
    }
    __m256i s32 = _mm256_setzero_si256();
    for (int g = 0; g < 8; g++) {
        const __m256i p = _mm256_maddubs_epi16(wabs[g], _mm256_sign_epi8(x[g], wv[g]));
        s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(p, ones));
    }
    return s32;
}

static inline void store8(const dest *o, int64_t i, int64_t N, int64_t n0, __m256 v) {
    float l[8];
    const int n = (int)(N - n0 < 8 ? N - n0 : 8);
    if (!o->bf16 && n == 8) {
        _mm256_storeu_ps((float *)o->p + i, o->res ? _mm256_add_ps(v, _mm256_loadu_ps(o->res + i)) : v);
        return;
    }
    _mm256_storeu_ps(l, v);
    for (int k = 0; k < n; k++) store(o, i + k, l[k]);
}

#ifdef VS_AVX512
/* tile_dot's 8 block sums with vpdpbusd (AVX-512 VNNI on 256 bits): wv as tile_dot's for 4-bit weights; for 8-bit
 * ones wv holds w ^ 0x80 (w + 128, unsigned) and 128 sum(x) (qsum) is taken off. The same exact integers */
static inline __m256i tile_dot_vnni(const __m256i *wv, const int8_t *xb, int32_t qsum, int kind) {
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int k = 0; k < 8; k += 2) {
        int32_t e0, e1;
        memcpy(&e0, xb + 4 * k, 4);
        memcpy(&e1, xb + 4 * k + 4, 4);
        s0 = _mm256_dpbusd_epi32(s0, wv[k], _mm256_set1_epi32(e0));
        s1 = _mm256_dpbusd_epi32(s1, wv[k + 1], _mm256_set1_epi32(e1));
    }
    const __m256i sum = _mm256_add_epi32(s0, s1);
    return kind == Q8_0 ? _mm256_sub_epi32(sum, _mm256_set1_epi32(128 * qsum)) : sum;
}
#endif

/* v's 16-bit lanes shifted left by s (right by -s): within a byte, the bits a plane mask keeps never cross */
static inline __m256i shift16(__m256i v, int s) {
    return s >= 0 ? _mm256_sll_epi16(v, _mm_cvtsi32_si128(s)) : _mm256_srl_epi16(v, _mm_cvtsi32_si128(-s));
}

/* a new kind's block: its 8 quant vectors wv[G] (the 8 rows' levels of elements 4G .. 4G + 3, unsigned) from the
 * nibble bytes at qs and the high-bit planes after them */
static inline __attribute__((always_inline)) void gen_unpack8(const uint8_t *qs, const int kind, __m256i *wv) {
    const __m256i lo = _mm256_set1_epi8(15);
    for (int k = 0; k < 4; k++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * k));
        wv[k] = _mm256_and_si256(v, lo);
        wv[k + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo);
    }
    if (iq4(kind)) { /* IQ4: the nibbles index IQ4's signed values (one table lookup per byte) */
        const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4));
        for (int G = 0; G < 8; G++) wv[G] = _mm256_shuffle_epi8(lut, wv[G]);
        return;
    }
    if (kind == Q6_K) {
        const __m256i h0 = _mm256_loadu_si256((const __m256i *)(qs + 128)),
                      h1 = _mm256_loadu_si256((const __m256i *)(qs + 160)), m = _mm256_set1_epi8(0x30);
        for (int G = 0; G < 4; G++) {
            wv[G] = _mm256_or_si256(wv[G], _mm256_and_si256(shift16(h0, 4 - 2 * G), m));
            wv[G + 4] = _mm256_or_si256(wv[G + 4], _mm256_and_si256(shift16(h1, 4 - 2 * G), m));
        }
    } else if (kind != Q4_K) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(qs + 128)), m = _mm256_set1_epi8(0x10);
        for (int G = 0; G < 8; G++) wv[G] = _mm256_or_si256(wv[G], _mm256_and_si256(shift16(h, 4 - G), m));
    }
}

static inline __m256 u8_to_ps(__m128i v) { /* the low 8 bytes -> 8 floats */
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}

static inline __m128i load8(const uint8_t *p) { return _mm_loadl_epi64((const __m128i *)p); }

/* scale_min_k4 for the 8 rows at once: sc and mn as 8 bytes each (the byte shifts as 16-bit ones on bits masked so
 * that nothing crosses into the neighbouring byte) */
static inline __attribute__((always_inline)) void scale_min_k4_8(const uint8_t *s, int j, __m128i *sc, __m128i *mn) {
    if (j < 4) {
        *sc = _mm_and_si128(load8(s + 8 * j), _mm_set1_epi8(63));
        *mn = _mm_and_si128(load8(s + 8 * (j + 4)), _mm_set1_epi8(63));
        return;
    }
    const __m128i c = load8(s + 8 * (j + 4)), top = _mm_set1_epi8((char)0xC0);
    *sc = _mm_or_si128(_mm_and_si128(c, _mm_set1_epi8(15)),
                       _mm_srli_epi16(_mm_and_si128(load8(s + 8 * (j - 4)), top), 2));
    *mn = _mm_or_si128(_mm_srli_epi16(_mm_and_si128(c, _mm_set1_epi8((char)0xF0)), 4),
                       _mm_srli_epi16(_mm_and_si128(load8(s + 8 * j), top), 2));
}

/* gen_params for the 8 rows of tile t at once (the same values) */
static inline __attribute__((always_inline)) void gen_params8(const uint8_t *t, const int kind, int64_t b,
        __m256 *d, __m256 *m, __m256i *sa, __m256i *sb) {
    const int j = (int)(b % 8);
    if (kind == IQ4_NL) {
        *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
    } else if (kind == IQ4_XS) {
        const __m128i ls = load8(t + 16 + 8 * j); /* ls_j - 32, int8 */
        *d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t)),
                           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ls)));
    } else if (kind == Q5_0 || kind == Q5_1) {
        *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
        *m = kind == Q5_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 16)))
                          : _mm256_mul_ps(*d, _mm256_set1_ps(-16.0f));
    } else if (kind == Q6_K) {
        *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
        *sa = _mm256_cvtepi8_epi32(load8(t + 16 + 16 * j));
        *sb = _mm256_cvtepi8_epi32(load8(t + 24 + 16 * j));
    } else {
        __m128i sc, mn;
        scale_min_k4_8(t + 32, j, &sc, &mn);
        *d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t)), u8_to_ps(sc));
        *m = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 16))), u8_to_ps(mn));
    }
}

/* a new kind's block sums from broadcast activation groups xb (as tile_dot's): into *sa (all 32 elements), or, for
 * Q6_K, *sa and *sb (elements 0..15 and 16..31). maddubs pairs are added in int16 only as far as they cannot
 * saturate: 8 of 4-bit (8 * 2 * 15 * 127), 4 of 5-bit, 2 of 6-bit */
static inline __attribute__((always_inline)) void gen_dot(const __m256i *wv, const int8_t *xb, const int kind,
                                                           __m256i *sa, __m256i *sb) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i p[8];
    if (iq4(kind)) { /* signed weights: |w| against sign(w) x, each group madd'ed alone (as Q8_0's) */
        __m256i s32 = _mm256_setzero_si256();
        for (int G = 0; G < 8; G++) {
            const __m256i x = _mm256_load_si256((const __m256i *)(xb + 32 * G));
            s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wv[G], wv[G]),
                                                                               _mm256_sign_epi8(x, wv[G])), ones));
        }
        *sa = s32;
        return;
    }
    for (int G = 0; G < 8; G++) p[G] = _mm256_maddubs_epi16(wv[G], _mm256_load_si256((const __m256i *)(xb + 32 * G)));
    if (kind == Q4_K) {
        __m256i s16 = p[0];
        for (int G = 1; G < 8; G++) s16 = _mm256_add_epi16(s16, p[G]);
        *sa = _mm256_madd_epi16(s16, ones);
    } else if (kind == Q6_K) {
        *sa = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[0], p[1]), ones),
                               _mm256_madd_epi16(_mm256_add_epi16(p[2], p[3]), ones));
        *sb = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[4], p[5]), ones),
                               _mm256_madd_epi16(_mm256_add_epi16(p[6], p[7]), ones));
    } else {
        const __m256i a = _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3]));
        const __m256i c = _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7]));
        *sa = _mm256_add_epi32(_mm256_madd_epi16(a, ones), _mm256_madd_epi16(c, ones));
    }
}

#ifdef VS_AVX512
/* gen_dot's sums with vpdpbusd from the block's 32 int8 activations xq (no int16 limit) */
static inline __attribute__((always_inline)) void gen_dot_vnni(const __m256i *wv, const int8_t *xq, int32_t qsum,
                                                                const int kind, __m256i *sa, __m256i *sb) {
    __m256i a = _mm256_setzero_si256(), c = _mm256_setzero_si256();
    const __m256i flip = _mm256_set1_epi8(iq4(kind) ? (char)0x80 : 0); /* IQ4: w + 128 (unsigned), 128 sum(x) off */
    for (int G = 0; G < 4; G++) {
        int32_t e0, e1;
        memcpy(&e0, xq + 4 * G, 4);
        memcpy(&e1, xq + 16 + 4 * G, 4);
        a = _mm256_dpbusd_epi32(a, _mm256_xor_si256(wv[G], flip), _mm256_set1_epi32(e0));
        c = _mm256_dpbusd_epi32(c, _mm256_xor_si256(wv[G + 4], flip), _mm256_set1_epi32(e1));
    }
    if (kind == Q6_K) *sa = a, *sb = c;
    else if (iq4(kind)) *sa = _mm256_sub_epi32(_mm256_add_epi32(a, c), _mm256_set1_epi32(128 * qsum));
    else *sa = _mm256_add_epi32(a, c);
}
#endif

#ifndef PF_ROW_TILES
#define PF_ROW_TILES 32 /* tiles fetched ahead of the one stream (past the end: harmless): measured, whole forwards
                           * x0.90-0.93 of none at 1-8 rows (AVX2 body) and 1-3 (AVX-512); 8 or 16 ahead gained less */
#endif
/* RT activation rows (RT a constant: the accumulators stay in registers) against one row of 8-row tiles; vnni
 * (a constant too, only where the build has AVX-512 VNNI): the block sums by tile_dot_vnni */
static inline __attribute__((always_inline)) void tile_rows(const uint8_t *w, const int kind, const qrows *x,
        int64_t N, int64_t K, int64_t g, int64_t r0, const int RT, const dest *o, const int vnni) {
    const int64_t nb = K / QK, tb = kind == Q4_0 ? 144 : kind == Q4_1 ? 160 : 272, qoff = kind == Q4_1 ? 32 : 16;
    __m256 acc[8], mins[8];
    for (int t = 0; t < RT; t++) { acc[t] = _mm256_setzero_ps(); mins[t] = _mm256_setzero_ps(); }
    for (int64_t b = 0; b < nb; b++) {
        if (kind >= Q5_0) { /* the new kinds: their own unpacking and, for Q6_K, the halves' integer scales */
            const uint8_t *t = tile_at(w, kind, nb, g, b), *qs = t + quant_off(kind, b);
            const int64_t bb = kquant(kind) ? TILE_BYTES[kind] / 8 : TILE_BYTES[kind]; /* bytes per block */
#if PF_ROW_TILES
            fetch_ahead(qs + PF_ROW_TILES * bb, bb, row_prefetch_level);
#endif
            __m256i wv[8], sa = _mm256_setzero_si256(), sb = sa, ca = sa, cb = sa;
            __m256 d, m = _mm256_setzero_ps();
            gen_unpack8(qs, kind, wv);
            gen_params8(t, kind, b, &d, &m, &ca, &cb);
            for (int t_ = 0; t_ < RT; t_++) {
                const int64_t rb = (r0 + t_) * nb + b;
#ifdef VS_AVX512
                if (vnni) gen_dot_vnni(wv, x->q + (r0 + t_) * K + b * QK, x->qsum[rb], kind, &sa, &sb);
                else
#endif
                    gen_dot(wv, x->qb + rb * 256, kind, &sa, &sb);
                const __m256 dx = _mm256_mul_ps(d, _mm256_set1_ps(x->s[rb]));
                if (kind == Q6_K) {
                    const __m256i I = _mm256_add_epi32(
                        _mm256_mullo_epi32(ca, _mm256_sub_epi32(sa, _mm256_set1_epi32(32 * x->q16[2 * rb]))),
                        _mm256_mullo_epi32(cb, _mm256_sub_epi32(sb, _mm256_set1_epi32(32 * x->q16[2 * rb + 1]))));
                    acc[t_] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), dx, acc[t_]);
                } else if (iq4(kind)) {
                    acc[t_] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sa), dx, acc[t_]);
                } else {
                    acc[t_] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sa), dx, acc[t_]);
                    mins[t_] = _mm256_fmadd_ps(m, _mm256_set1_ps(x->ss[rb]), mins[t_]);
                }
            }
            continue;
        }
        const uint8_t *tp = w + (g * nb + b) * tb;
#if PF_ROW_TILES
        fetch_ahead(tp + PF_ROW_TILES * tb, tb, row_prefetch_level);
#endif
        __m256i wv[8], wabs[8];
        if (kind == Q8_0) {
            for (int k = 0; k < 8; k++) {
                wv[k] = _mm256_loadu_si256((const __m256i *)(tp + qoff + 32 * k));
                if (vnni) wv[k] = _mm256_xor_si256(wv[k], _mm256_set1_epi8((char)0x80));
                else wabs[k] = _mm256_sign_epi8(wv[k], wv[k]);
            }
        } else {
            const __m256i lo = _mm256_set1_epi8(15);
            for (int k = 0; k < 4; k++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(tp + qoff + 32 * k));
                wv[k] = _mm256_and_si256(v, lo);
                wv[k + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo);
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tp));
        const __m256 m = kind == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tp + 16)))
                                      : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
        for (int t = 0; t < RT; t++) {
            const int64_t rb = (r0 + t) * nb + b;
#ifdef VS_AVX512
            const __m256i sum = vnni ? tile_dot_vnni(wv, x->q + (r0 + t) * K + b * QK, x->qsum[rb], kind)
                                     : tile_dot(wv, wabs, x->qb + rb * 256, kind);
#else
            const __m256i sum = tile_dot(wv, wabs, x->qb + rb * 256, kind);
#endif
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(x->s[rb])), acc[t]);
            if (kind != Q8_0) mins[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(x->ss[rb]), mins[t]);
        }
    }
    for (int t = 0; t < RT; t++)
        store8(o, (r0 + t) * o->ld + 8 * g, N, 8 * g, _mm256_add_ps(acc[t], mins[t]));
}

static inline __attribute__((always_inline)) void group(const uint8_t *w, const int kind, const qrows *x,
        int64_t M, int64_t N, int64_t K, int64_t g, const dest *o, const int vnni) {
    int64_t r0 = 0;
    if (vnni) { /* the AVX-512 build: its 32 vector registers hold 8 rows' accumulators beside the tile */
        for (; r0 + 8 <= M; r0 += 8) tile_rows(w, kind, x, N, K, g, r0, 8, o, vnni);
        switch (M - r0) { /* the rest in one pass over the tiles, as below */
        case 7: tile_rows(w, kind, x, N, K, g, r0, 7, o, vnni); break;
        case 6: tile_rows(w, kind, x, N, K, g, r0, 6, o, vnni); break;
        case 5: tile_rows(w, kind, x, N, K, g, r0, 5, o, vnni); break;
        case 4: tile_rows(w, kind, x, N, K, g, r0, 4, o, vnni); break;
        case 3: tile_rows(w, kind, x, N, K, g, r0, 3, o, vnni); break;
        case 2: tile_rows(w, kind, x, N, K, g, r0, 2, o, vnni); break;
        case 1: tile_rows(w, kind, x, N, K, g, r0, 1, o, vnni); break;
        }
        return;
    }
    for (; r0 + 4 <= M; r0 += 4) tile_rows(w, kind, x, N, K, g, r0, 4, o, vnni);
    switch (M - r0) { /* the rest in one pass over the tiles (2 + 1 would unpack them twice): measured */
    case 3: tile_rows(w, kind, x, N, K, g, r0, 3, o, vnni); break;
    case 2: tile_rows(w, kind, x, N, K, g, r0, 2, o, vnni); break;
    case 1: tile_rows(w, kind, x, N, K, g, r0, 1, o, vnni); break;
    }
}

/* group() with `kind` a constant in each call, so each kind's loop is compiled for it alone */
static inline __attribute__((always_inline)) void group_of(const uint8_t *w, int kind, const qrows *x, int64_t M,
        int64_t N, int64_t K, int64_t g, const dest *o, const int vnni) {
    switch (kind) {
    case Q4_0: group(w, Q4_0, x, M, N, K, g, o, vnni); break;
    case Q4_1: group(w, Q4_1, x, M, N, K, g, o, vnni); break;
    case Q8_0: group(w, Q8_0, x, M, N, K, g, o, vnni); break;
    case Q5_0: group(w, Q5_0, x, M, N, K, g, o, vnni); break;
    case Q5_1: group(w, Q5_1, x, M, N, K, g, o, vnni); break;
    case Q4_K: group(w, Q4_K, x, M, N, K, g, o, vnni); break;
    case Q5_K: group(w, Q5_K, x, M, N, K, g, o, vnni); break;
    case Q6_K: group(w, Q6_K, x, M, N, K, g, o, vnni); break;
    case IQ4_NL: group(w, IQ4_NL, x, M, N, K, g, o, vnni); break;
    default: group(w, IQ4_XS, x, M, N, K, g, o, vnni); break;
    }
}

static void gemm_avx2(const uint8_t *w, int kind, const qrows *x, int64_t M, int64_t N, int64_t K, const dest *o) {
    const int64_t groups = (N + 7) / 8;
    #pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) group_of(w, kind, x, M, N, K, g, o, 0);
}
#endif

#ifdef VS_AVX512
/* --- the AVX-512 VNNI body: two x8 tiles side by side, 16 outputs per vector ---
 * Lanes 0..7 are tile (g, b)'s rows, lanes 8..15 tile (g + 1, b)'s. Each lane's block sum is the same exact integer
 * as tile_dot's: vpdpbusd adds four u8 x s8 products into an int32 lane without saturation. 4-bit weights are
 * unsigned nibbles already; an 8-bit weight w is taken as the unsigned w + 128 (w ^ 0x80) and 128 times the
 * block's sum of x (the same for every lane) taken off again. Each lane's float arithmetic is then the AVX2
 * body's, in the same order: acc = fma(float(sum), d * s_x, acc), mins = fma(m, s_x * sum(q_x), mins), out =
 * acc + mins. So this body equals the portable one bit for bit (the tests hold it to that). */
#ifndef PF_TILES
#define PF_TILES 64 /* tiles ahead per stream: measured, whole forwards at 4-32 rows x0.86-0.90 of 8 ahead (once
                        * attention got cheaper), 128 no better; 0 (none) slower from 4 rows on */
#endif
#ifndef PAIR_ROWS
#define PAIR_ROWS 5 /* from this many rows on, two tiles per vector (vs_set_pair_rows changes it, for benchmarks):
                     * measured on a 2-core Zen 4, forwards after 128 tokens, 8 lanes against pairs: 4 rows 6.1-6.2
                     * against 6.6 ms (default model, Q4_1), 21.2-21.5 against 22.5 (a 0.5B Q4_K_M), 51.6 against
                     * 58.1 (a 1.5B Q4_K_M); 5 rows 7.2-7.5 against 6.4 on the default model, alike or slightly
                     * faster with 8 lanes at the larger shapes; 8 rows slower with 8 lanes everywhere */
#endif
static int pair_from = PAIR_ROWS;
/* where the pair streams' tiles are fetched ahead to: 0 into L1 (T0), 1 into L2 (T1). Which is faster depends on the
 * CPU: on a 2-core Zen 4, whole forwards of the default model at 4 rows took 5.9 ms with L2 against 7.3 with L1
 * (two streams 64 tiles ahead into a 32 KB L1); 8 rows and more, bound by the arithmetic, alike. The loader times
 * both (vs_set_prefetch, and the non-temporal level). Pairs from 3 rows on (or 2) instead of 4 measured no faster
 * with either level */

static inline __m512i pair256(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

static inline __m512 pair_half(const uint8_t *a, const uint8_t *b) { /* 8 + 8 fp16 -> 16 floats */
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                   _mm_loadu_si128((const __m128i *)b), 1));
}

static inline void store16(const dest *o, int64_t i, int64_t N, int64_t n0, __m512 v) {
    const int n = (int)(N - n0 < 16 ? N - n0 : 16);
    if (!o->bf16 && n == 16) {
        _mm512_storeu_ps((float *)o->p + i, o->res ? _mm512_add_ps(v, _mm512_loadu_ps(o->res + i)) : v);
        return;
    }
    float l[16];
    _mm512_storeu_ps(l, v);
    for (int k = 0; k < n; k++) store(o, i + k, l[k]);
}

static inline __m512 cat_ps(__m256 a, __m256 b) { /* a in lanes 0..7, b in 8..15 */
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
}

static inline __m512i cat_si(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }

/* pair_rows' block b for the new kinds: each tile unpacked as the 8-lane bodies do, side by side in 16 lanes */
static inline __attribute__((always_inline)) void gen_pair(const uint8_t *w, const int kind, const qrows *x,
        int64_t K, int64_t g, int64_t b, int64_t r0, const int RT, __m512 *acc, __m512 *mins) {
    const int64_t nb = K / QK, bb = kquant(kind) ? TILE_BYTES[kind] / 8 : TILE_BYTES[kind];
    const uint8_t *ta = tile_at(w, kind, nb, g, b), *tc = tile_at(w, kind, nb, g + 1, b);
    const uint8_t *qa = ta + quant_off(kind, b), *qc = tc + quant_off(kind, b);
#if PF_TILES
    fetch_ahead(qa + PF_TILES * bb, bb, prefetch_level);
    fetch_ahead(qc + PF_TILES * bb, bb, prefetch_level);
#endif
    __m256i a[8], c[8], sa0 = _mm256_setzero_si256(), sb0 = sa0, sa1 = sa0, sb1 = sa0;
    __m256 d0, d1, m0 = _mm256_setzero_ps(), m1 = m0;
    gen_unpack8(qa, kind, a);
    gen_unpack8(qc, kind, c);
    gen_params8(ta, kind, b, &d0, &m0, &sa0, &sb0);
    gen_params8(tc, kind, b, &d1, &m1, &sa1, &sb1);
    __m512i wv[8];
    const __m512i flip = _mm512_set1_epi8(iq4(kind) ? (char)0x80 : 0); /* IQ4: w + 128, as gen_dot_vnni */
    for (int G = 0; G < 8; G++) wv[G] = _mm512_xor_si512(cat_si(a[G], c[G]), flip);
    const __m512 d = cat_ps(d0, d1), m = cat_ps(m0, m1);
    const __m512i ca = cat_si(sa0, sa1), cb = cat_si(sb0, sb1);
    for (int t = 0; t < RT; t++) {
        const int64_t rb = (r0 + t) * nb + b;
        const int8_t *xq = x->q + (r0 + t) * K + b * QK;
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        for (int G = 0; G < 4; G++) {
            int32_t e0, e1;
            memcpy(&e0, xq + 4 * G, 4);
            memcpy(&e1, xq + 16 + 4 * G, 4);
            s0 = _mm512_dpbusd_epi32(s0, wv[G], _mm512_set1_epi32(e0));
            s1 = _mm512_dpbusd_epi32(s1, wv[G + 4], _mm512_set1_epi32(e1));
        }
        const __m512 dx = _mm512_mul_ps(d, _mm512_set1_ps(x->s[rb]));
        if (kind == Q6_K) {
            const __m512i I = _mm512_add_epi32(
                _mm512_mullo_epi32(ca, _mm512_sub_epi32(s0, _mm512_set1_epi32(32 * x->q16[2 * rb]))),
                _mm512_mullo_epi32(cb, _mm512_sub_epi32(s1, _mm512_set1_epi32(32 * x->q16[2 * rb + 1]))));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), dx, acc[t]);
        } else if (iq4(kind)) {
            const __m512i sum = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_set1_epi32(128 * x->qsum[rb]));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), dx, acc[t]);
        } else {
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), dx, acc[t]);
            mins[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(x->ss[rb]), mins[t]);
        }
    }
}

/* RT activation rows against groups g and g + 1 (both full tiles in memory; rows past N are padding) */
static inline __attribute__((always_inline)) void pair_rows(const uint8_t *w, const int kind, const qrows *x,
        int64_t N, int64_t K, int64_t g, int64_t r0, const int RT, const dest *o) {
    const int64_t nb = K / QK, tb = kind == Q4_0 ? 144 : kind == Q4_1 ? 160 : 272, qoff = kind == Q4_1 ? 32 : 16;
    __m512 acc[8], mins[8];
    for (int t = 0; t < RT; t++) { acc[t] = _mm512_setzero_ps(); mins[t] = _mm512_setzero_ps(); }
    for (int64_t b = 0; b < nb; b++) {
        if (kind >= Q5_0) {
            gen_pair(w, kind, x, K, g, b, r0, RT, acc, mins);
            continue;
        }
        const uint8_t *ta = w + (g * nb + b) * tb, *tc = ta + nb * tb;
#if PF_TILES
        fetch_ahead(ta + PF_TILES * tb, tb, prefetch_level); /* the two tile streams (measured: L2, NTA or L1) */
        fetch_ahead(tc + PF_TILES * tb, tb, prefetch_level);
#endif
        __m512i wv[8];
        if (kind == Q8_0) {
            const __m512i flip = _mm512_set1_epi8((char)0x80);
            for (int k = 0; k < 8; k++) wv[k] = _mm512_xor_si512(pair256(ta + qoff + 32 * k, tc + qoff + 32 * k), flip);
        } else {
            const __m512i lo = _mm512_set1_epi8(15);
            for (int k = 0; k < 4; k++) {
                const __m512i v = pair256(ta + qoff + 32 * k, tc + qoff + 32 * k);
                wv[k] = _mm512_and_si512(v, lo);
                wv[k + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo);
            }
        }
        const __m512 d = pair_half(ta, tc);
        const __m512 m = kind == Q4_1 ? pair_half(ta + 16, tc + 16) : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
        for (int t = 0; t < RT; t++) {
            const int64_t rb = (r0 + t) * nb + b;
            const int32_t *xb = (const int32_t *)(x->q + (r0 + t) * K + b * QK); /* group k: elements 4k .. 4k+3 */
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int k = 0; k < 8; k += 2) {
                int32_t e0, e1;
                memcpy(&e0, xb + k, 4);
                memcpy(&e1, xb + k + 1, 4);
                s0 = _mm512_dpbusd_epi32(s0, wv[k], _mm512_set1_epi32(e0));
                s1 = _mm512_dpbusd_epi32(s1, wv[k + 1], _mm512_set1_epi32(e1));
            }
            __m512i sum = _mm512_add_epi32(s0, s1);
            if (kind == Q8_0) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * x->qsum[rb]));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(x->s[rb])), acc[t]);
            if (kind != Q8_0) mins[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(x->ss[rb]), mins[t]);
        }
    }
    for (int t = 0; t < RT; t++)
        store16(o, (r0 + t) * o->ld + 8 * g, N, 8 * g, _mm512_add_ps(acc[t], mins[t]));
}

static inline __attribute__((always_inline)) void pair(const uint8_t *w, const int kind, const qrows *x,
        int64_t M, int64_t N, int64_t K, int64_t g, const dest *o) {
    int64_t r0 = 0;
    for (; r0 + 8 <= M; r0 += 8) pair_rows(w, kind, x, N, K, g, r0, 8, o);
    switch (M - r0) { /* the rest in one pass over the tiles, as in group */
    case 7: pair_rows(w, kind, x, N, K, g, r0, 7, o); break;
    case 6: pair_rows(w, kind, x, N, K, g, r0, 6, o); break;
    case 5: pair_rows(w, kind, x, N, K, g, r0, 5, o); break;
    case 4: pair_rows(w, kind, x, N, K, g, r0, 4, o); break;
    case 3: pair_rows(w, kind, x, N, K, g, r0, 3, o); break;
    case 2: pair_rows(w, kind, x, N, K, g, r0, 2, o); break;
    case 1: pair_rows(w, kind, x, N, K, g, r0, 1, o); break;
    }
}

static void gemm_avx512(const uint8_t *w, int kind, const qrows *x, int64_t M, int64_t N, int64_t K, const dest *o) {
    const int64_t groups = (N + 7) / 8, pairs = M >= pair_from ? groups / 2 : 0, singles = groups - 2 * pairs;
    #pragma omp for schedule(static) nowait /* disjoint outputs from the pairs' */
    for (int64_t p = pairs; p < pairs + singles; p++) { /* few rows, or an odd last group: 8 lanes, one tile */
        group_of(w, kind, x, M, N, K, pairs ? 2 * p : p, o, 1);
    }
    if (!pairs) return;
    #pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; p++) {
        switch (kind) {
        case Q4_0: pair(w, Q4_0, x, M, N, K, 2 * p, o); break;
        case Q4_1: pair(w, Q4_1, x, M, N, K, 2 * p, o); break;
        case Q8_0: pair(w, Q8_0, x, M, N, K, 2 * p, o); break;
        case Q5_0: pair(w, Q5_0, x, M, N, K, 2 * p, o); break;
        case Q5_1: pair(w, Q5_1, x, M, N, K, 2 * p, o); break;
        case Q4_K: pair(w, Q4_K, x, M, N, K, 2 * p, o); break;
        case Q5_K: pair(w, Q5_K, x, M, N, K, 2 * p, o); break;
        case Q6_K: pair(w, Q6_K, x, M, N, K, 2 * p, o); break;
        case IQ4_NL: pair(w, IQ4_NL, x, M, N, K, 2 * p, o); break;
        default: pair(w, IQ4_XS, x, M, N, K, 2 * p, o); break;
        }
    }
}
#endif

#define MAXQ 64 /* queries in one attention task: rows x query heads */
static int attention_rows = MAXQ; /* the most rows of a sequence in one task (vs_set_attention_rows) */

/* --- attention of a few query rows over their keys, fp32 (the CPU cache's dtype) ---
 * per (batch b, row m): s_l = dot(q, k_l) * scale + bias_l; p_l = exp(s_l - max s); out = sum_l (p_l / sum p) v_l,
 * keys with p_l = 0 (masked: -inf) skipped. dot: element i in lane i % 8, fma in order, the lanes added as hsum8;
 * exp: `vexp` below; sum p: the visible keys' in eight lanes (`psum`); sum p v: over l in order. A row's result
 * depends on its own q, visible keys, values and bias only: not on the other rows, nor on how many masked keys pad
 * or interleave its key range. */

/* exp(x) (Cephes' expf polynomial on r = x - n ln 2, n = round(x / ln 2)); 0 below -87, x taken as 88 above 88 */
#define EXP_C0 1.9875691500e-4f
#define EXP_C1 1.3981999507e-3f
#define EXP_C2 8.3334519073e-3f
#define EXP_C3 4.1665795894e-2f
#define EXP_C4 1.6666665459e-1f
#define EXP_C5 5.0000001201e-1f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
#define LOG2E 1.44269504088896341f

static inline float vexp(float x) {
    if (!(x >= -87.0f)) return 0.0f;
    x = fminf(x, 88.0f);
    const float n = nearbyintf(x * LOG2E);
    float r = fmaf(n, -LN2_HI, x);
    r = fmaf(n, -LN2_LO, r);
    float p = EXP_C0;
    p = fmaf(p, r, EXP_C1); p = fmaf(p, r, EXP_C2); p = fmaf(p, r, EXP_C3);
    p = fmaf(p, r, EXP_C4); p = fmaf(p, r, EXP_C5);
    const float y = fmaf(p, r * r, r) + 1.0f;
    const uint32_t e = (uint32_t)((int32_t)n + 127) << 23;
    float two;
    memcpy(&two, &e, 4);
    return y * two;
}

#ifdef VS_AVX2
static inline __m256 vexp8(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f)); /* below: zeroed at the end */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_C0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C1)); p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C3)); p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C5));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep);
}

static inline float hsum8v(__m256 v) { /* hsum8's order: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) */
    const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* l0+l4 .. l3+l7 */
    const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a)); /* (l0+l4)+(l2+l6), (l1+l5)+(l3+l7) */
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}
#endif

static inline float dot8(const float *a, const float *b, int64_t n) {
    float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < n; i++) l[i & 7] = fmaf(a[i], b[i], l[i & 7]);
    return hsum8(l);
}

/* scores of M rows against one batch's L keys into s [M, ls] (row stride ls >= L): the portable body */
static void scores_ref(const float *q, int64_t qm, const float *k, int64_t kl, const float *br, int64_t bm,
                       int64_t M, int64_t L, int64_t hd, float scale, float *s, int64_t ls) {
    for (int64_t l = 0; l < L; l++)
        for (int64_t m = 0; m < M; m++) {
            float v = dot8(q + m * qm, k + l * kl, hd) * scale;
            s[m * ls + l] = br ? v + br[m * bm + l] : v;
        }
}

#ifdef VS_AVX2
/* hsum8v of eight vectors at once: lane j of the result is hsum8v(a[j]), with the same additions in the same
 * order ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), by a transposing network instead of eight reductions */
static inline __m256 hsum8x8(const __m256 *a) {
    __m256 x[4], y[2];
    for (int j = 0; j < 4; j++) /* [a0+a4 .. a3+a7 | b0+b4 .. b3+b7] of keys 2j, 2j + 1 */
        x[j] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * j], a[2 * j + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * j], a[2 * j + 1], 0x31));
    for (int j = 0; j < 2; j++) /* [(x0+x2), (x1+x3) of keys 4j, 4j + 2 | of keys 4j + 1, 4j + 3] */
        y[j] = _mm256_add_ps(_mm256_shuffle_ps(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1))); /* keys 0 2 4 6 | 1 3 5 7 */
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static void scores_avx2(const float *q, int64_t qm, const float *k, int64_t kl, const float *br, int64_t bm,
                        int64_t M, int64_t L, int64_t hd, float scale, float *s, int64_t ls) {
    int64_t l = 0;
    for (; l + 8 <= L; l += 8) { /* eight keys at once: eight fma chains in dot8's order, reduced together */
        const float *kr = k + l * kl;
        for (int64_t m = 0; m < M; m++) {
            const float *qr = q + m * qm;
            __m256 a[8];
            for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
            for (int64_t i = 0; i < hd; i += 8) {
                const __m256 qv = _mm256_loadu_ps(qr + i);
                for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + j * kl + i), a[j]);
            }
            __m256 v = _mm256_mul_ps(hsum8x8(a), _mm256_set1_ps(scale));
            if (br) v = _mm256_add_ps(v, _mm256_loadu_ps(br + m * bm + l));
            _mm256_storeu_ps(s + m * ls + l, v);
        }
    }
    for (; l + 4 <= L; l += 4) { /* four keys at once: four independent fma chains, each in dot8's order */
        const float *k0 = k + l * kl, *k1 = k0 + kl, *k2 = k1 + kl, *k3 = k2 + kl;
        for (int64_t m = 0; m < M; m++) {
            const float *qr = q + m * qm;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t i = 0; i < hd; i += 8) {
                const __m256 qv = _mm256_loadu_ps(qr + i);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + i), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + i), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + i), a3);
            }
            const float *bias_m = br ? br + m * bm + l : NULL;
            const float v[4] = {hsum8v(a0) * scale, hsum8v(a1) * scale, hsum8v(a2) * scale, hsum8v(a3) * scale};
            for (int j = 0; j < 4; j++) s[m * ls + l + j] = bias_m ? v[j] + bias_m[j] : v[j];
        }
    }
    for (; l < L; l++) {
        const float *kr = k + l * kl;
        for (int64_t m = 0; m < M; m++) {
            const float *qr = q + m * qm;
            __m256 acc = _mm256_setzero_ps();
            for (int64_t i = 0; i < hd; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr + i), _mm256_loadu_ps(kr + i), acc);
            const float v = hsum8v(acc) * scale;
            s[m * ls + l] = br ? v + br[m * bm + l] : v;
        }
    }
}
#endif

/* sum of p [L] >= 0 in eight lanes: the c-th nonzero p (c = 0, 1, ...) is added to lane c % 8, in order, and the
 * lanes are added as hsum8. Zeros (masked keys) are skipped, so a key range padded or interleaved with masked keys
 * sums to the same bits as the visible keys alone, as pv_rows' sum does; eight chains instead of one sequential sum.
 * vec: whole runs of eight nonzero p added as one vector, rotated to their lanes (the same additions) */
static float psum(const float *p, int64_t L, int vec) {
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t c = 0, l = 0;
#ifdef VS_AVX2
    if (vec && L >= 16) {
        __m256 acc = _mm256_setzero_ps();
        for (; l + 8 <= L; l += 8) {
            const __m256 x = _mm256_loadu_ps(p + l);
            if (_mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_EQ_OQ)) == 0) {
                /* element i to lane (c + i) % 8: lane j takes element (j - c) % 8 */
                const __m256i idx = _mm256_and_si256(
                    _mm256_sub_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)(c & 7))),
                    _mm256_set1_epi32(7));
                acc = _mm256_add_ps(acc, _mm256_permutevar8x32_ps(x, idx));
                c += 8;
                continue;
            }
            _mm256_storeu_ps(lane, acc);
            for (int i = 0; i < 8; i++)
                if (p[l + i] != 0.0f) lane[c++ & 7] += p[l + i];
            acc = _mm256_loadu_ps(lane);
        }
        _mm256_storeu_ps(lane, acc);
    }
#else
    (void)vec;
#endif
    for (; l < L; l++)
        if (p[l] != 0.0f) lane[c++ & 7] += p[l];
    return hsum8(lane);
}

/* a row of scores s [L] -> p = exp(s - max s) in place; returns 1 / sum p (0 and all p zero when no key is
 * visible: every score -inf). exp: vexp8 on whole vectors from the start, vexp on the tail (the same values) */
static float softmax_row(float *sr, int64_t L, int vec) {
    float mx = -INFINITY;
    int64_t l = 0;
#ifdef VS_AVX2
    if (vec && L >= 8) { /* the same maximum (exact; a NaN ignored, as fmaxf does) */
        __m256 m8 = _mm256_set1_ps(-INFINITY);
        for (; l + 8 <= L; l += 8) m8 = _mm256_max_ps(_mm256_loadu_ps(sr + l), m8);
        float t[8];
        _mm256_storeu_ps(t, m8);
        for (int j = 0; j < 8; j++) mx = t[j] > mx ? t[j] : mx;
    }
#endif
    for (; l < L; l++) mx = fmaxf(mx, sr[l]);
    l = 0;
    if (mx == -INFINITY) {
        for (; l < L; l++) sr[l] = 0.0f;
        return 0.0f;
    }
#ifdef VS_AVX2
    for (; vec && l + 8 <= L; l += 8)
        _mm256_storeu_ps(sr + l, vexp8(_mm256_sub_ps(_mm256_loadu_ps(sr + l), _mm256_set1_ps(mx))));
#else
    (void)vec;
#endif
    for (; l < L; l++) sr[l] = vexp(sr[l] - mx);
    return 1.0f / psum(sr, L, vec);
}

#ifdef VS_AVX2
/* out [8 NV] += sum over t < n of (p[t] inv) v[t * vl ..] in t order, p[t] = 0 skipped: pv_rows' fma per element,
 * the output kept in NV registers across the keys instead of loaded and stored per key (the same bits) */
static inline __attribute__((always_inline)) void pv_chunk(float *out, const float *v, int64_t vl, const float *p,
                                                           int64_t n, float inv, const int NV) {
    __m256 acc[8];
    for (int u = 0; u < NV; u++) acc[u] = _mm256_loadu_ps(out + 8 * u);
    for (int64_t t = 0; t < n; t++) {
        if (p[t] == 0.0f) continue;
        const __m256 w = _mm256_set1_ps(p[t] * inv);
        for (int u = 0; u < NV; u++) acc[u] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + t * vl + 8 * u), acc[u]);
    }
    for (int u = 0; u < NV; u++) _mm256_storeu_ps(out + 8 * u, acc[u]);
}
#endif

/* out [hd] += sum over t < n of (p[t] inv) v_t, v_t = v + t vl: per element one fma per key, t in order, keys with
 * p[t] = 0 skipped. vec (hd a multiple of 8): the same fmas, the output in registers in chunks of 64 floats */
static void pv_rows(float *out, const float *v, int64_t vl, const float *p, int64_t n, float inv, int64_t hd,
                    int vec) {
#ifdef VS_AVX2
    for (int64_t c = 0; vec && c < hd; c += 64) {
        switch ((hd - c) / 8 < 8 ? (hd - c) / 8 : 8) {
        case 8: pv_chunk(out + c, v + c, vl, p, n, inv, 8); break;
        case 7: pv_chunk(out + c, v + c, vl, p, n, inv, 7); break;
        case 6: pv_chunk(out + c, v + c, vl, p, n, inv, 6); break;
        case 5: pv_chunk(out + c, v + c, vl, p, n, inv, 5); break;
        case 4: pv_chunk(out + c, v + c, vl, p, n, inv, 4); break;
        case 3: pv_chunk(out + c, v + c, vl, p, n, inv, 3); break;
        case 2: pv_chunk(out + c, v + c, vl, p, n, inv, 2); break;
        default: pv_chunk(out + c, v + c, vl, p, n, inv, 1); break;
        }
    }
    if (vec) return;
#else
    (void)vec;
#endif
    for (int64_t t = 0; t < n; t++) {
        if (p[t] == 0.0f) continue;
        const float a = p[t] * inv;
        for (int64_t i = 0; i < hd; i++) out[i] = fmaf(a, v[t * vl + i], out[i]);
    }
}

#ifdef VS_AVX2
/* scores of nq queries (qp[i], hd floats each) against L keys k (stride kl) into sp[i][0 .. L - 1]: each score in
 * scores_avx2's arithmetic (one fma chain per key in dot8's order, reduced as hsum8v, times scale), so the same bits
 * whichever queries are computed together. Eight keys at a time are read once for all the queries (from L1 after
 * the first); with AVX-512's 32 vector registers three queries share each key vector's load */
static void scores_multi(const float *const *qp, int64_t nq, const float *k, int64_t kl, int64_t L, int64_t hd,
                         float scale, float *const *sp, int64_t off) {
    const __m256 sc = _mm256_set1_ps(scale);
    int64_t l = 0;
    for (; l + 8 <= L; l += 8) {
        const float *kr = k + l * kl;
        int64_t i = 0;
#ifdef VS_AVX512
        for (; i + 3 <= nq; i += 3) {
            const float *q0 = qp[i], *q1 = qp[i + 1], *q2 = qp[i + 2];
            __m256 a[8], b[8], c[8];
            for (int j = 0; j < 8; j++) a[j] = b[j] = c[j] = _mm256_setzero_ps();
            for (int64_t e = 0; e < hd; e += 8) {
                const __m256 x0 = _mm256_loadu_ps(q0 + e), x1 = _mm256_loadu_ps(q1 + e), x2 = _mm256_loadu_ps(q2 + e);
                for (int j = 0; j < 8; j++) {
                    const __m256 kv = _mm256_loadu_ps(kr + j * kl + e);
                    a[j] = _mm256_fmadd_ps(x0, kv, a[j]);
                    b[j] = _mm256_fmadd_ps(x1, kv, b[j]);
                    c[j] = _mm256_fmadd_ps(x2, kv, c[j]);
                }
            }
            _mm256_storeu_ps(sp[i] + off + l, _mm256_mul_ps(hsum8x8(a), sc));
            _mm256_storeu_ps(sp[i + 1] + off + l, _mm256_mul_ps(hsum8x8(b), sc));
            _mm256_storeu_ps(sp[i + 2] + off + l, _mm256_mul_ps(hsum8x8(c), sc));
        }
#endif
        for (; i < nq; i++) {
            const float *qr = qp[i];
            __m256 a[8];
            for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
            for (int64_t e = 0; e < hd; e += 8) {
                const __m256 x = _mm256_loadu_ps(qr + e);
                for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(x, _mm256_loadu_ps(kr + j * kl + e), a[j]);
            }
            _mm256_storeu_ps(sp[i] + off + l, _mm256_mul_ps(hsum8x8(a), sc));
        }
    }
    if (l < L) /* the last keys: scores_avx2's own four-key and one-key steps, per query */
        for (int64_t i = 0; i < nq; i++) scores_avx2(qp[i], hd, k + l * kl, kl, NULL, 0, 1, L - l, hd, scale, sp[i] + off + l, L);
}

/* pv_chunk for nq outputs at once (the same fmas per output, keys in order, p = 0 skipped): each value vector is
 * loaded once for up to three outputs (AVX-512: 3 x NV accumulators in registers), else one output at a time */
static inline __attribute__((always_inline)) void pv_chunk_multi(float *const *op, int64_t nq, int64_t c,
                                                                 const float *v, int64_t vl, const float *const *pp,
                                                                 int64_t off, int64_t n, const float *inv,
                                                                 const int NV) {
    int64_t i = 0;
#ifdef VS_AVX512
    for (; i + 3 <= nq; i += 3) {
        __m256 a[8], b[8], d[8];
        float *o0 = op[i] + c, *o1 = op[i + 1] + c, *o2 = op[i + 2] + c;
        const float *p0 = pp[i] + off, *p1 = pp[i + 1] + off, *p2 = pp[i + 2] + off;
        for (int u = 0; u < NV; u++) {
            a[u] = _mm256_loadu_ps(o0 + 8 * u);
            b[u] = _mm256_loadu_ps(o1 + 8 * u);
            d[u] = _mm256_loadu_ps(o2 + 8 * u);
        }
        for (int64_t t = 0; t < n; t++) {
            const float *vt = v + t * vl + c;
            if (p0[t] != 0.0f && p1[t] != 0.0f && p2[t] != 0.0f) {
                const __m256 w0 = _mm256_set1_ps(p0[t] * inv[i]), w1 = _mm256_set1_ps(p1[t] * inv[i + 1]),
                             w2 = _mm256_set1_ps(p2[t] * inv[i + 2]);
                for (int u = 0; u < NV; u++) {
                    const __m256 x = _mm256_loadu_ps(vt + 8 * u);
                    a[u] = _mm256_fmadd_ps(w0, x, a[u]);
                    b[u] = _mm256_fmadd_ps(w1, x, b[u]);
                    d[u] = _mm256_fmadd_ps(w2, x, d[u]);
                }
                continue;
            }
            if (p0[t] != 0.0f) {
                const __m256 w = _mm256_set1_ps(p0[t] * inv[i]);
                for (int u = 0; u < NV; u++) a[u] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 8 * u), a[u]);
            }
            if (p1[t] != 0.0f) {
                const __m256 w = _mm256_set1_ps(p1[t] * inv[i + 1]);
                for (int u = 0; u < NV; u++) b[u] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 8 * u), b[u]);
            }
            if (p2[t] != 0.0f) {
                const __m256 w = _mm256_set1_ps(p2[t] * inv[i + 2]);
                for (int u = 0; u < NV; u++) d[u] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 8 * u), d[u]);
            }
        }
        for (int u = 0; u < NV; u++) {
            _mm256_storeu_ps(o0 + 8 * u, a[u]);
            _mm256_storeu_ps(o1 + 8 * u, b[u]);
            _mm256_storeu_ps(o2 + 8 * u, d[u]);
        }
    }
#endif
    for (; i < nq; i++) pv_chunk(op[i] + c, v + c, vl, pp[i] + off, n, inv[i], NV);
}

/* pv_rows for nq outputs over the same n values: op[i] [hd] += sum over t of (pp[i][off + t] inv[i]) v_t */
static void pv_multi(float *const *op, int64_t nq, const float *v, int64_t vl, const float *const *pp, int64_t off,
                     int64_t n, const float *inv, int64_t hd) {
    for (int64_t c = 0; c < hd; c += 64) {
        switch ((hd - c) / 8 < 8 ? (hd - c) / 8 : 8) {
        case 8: pv_chunk_multi(op, nq, c, v, vl, pp, off, n, inv, 8); break;
        case 7: pv_chunk_multi(op, nq, c, v, vl, pp, off, n, inv, 7); break;
        case 6: pv_chunk_multi(op, nq, c, v, vl, pp, off, n, inv, 6); break;
        case 5: pv_chunk_multi(op, nq, c, v, vl, pp, off, n, inv, 5); break;
        case 4: pv_chunk_multi(op, nq, c, v, vl, pp, off, n, inv, 4); break;
        case 3: pv_chunk_multi(op, nq, c, v, vl, pp, off, n, inv, 3); break;
        case 2: pv_chunk_multi(op, nq, c, v, vl, pp, off, n, inv, 2); break;
        default: pv_chunk_multi(op, nq, c, v, vl, pp, off, n, inv, 1); break;
        }
    }
}
#endif

/* q [B, M, hd] (strides qb, qm), k and v [B, L, hd] (strides kb, kl and vb, vl), bias [B?, M?, L] or NULL
 * (strides bb, bm; 0 where broadcast), out [B, M, hd] contiguous; the last dimension of each is contiguous.
 * ref: the portable body. Returns 0, or -2 without memory. */
int vs_attention(const float *q, int64_t qb, int64_t qm, const float *k, int64_t kb, int64_t kl, const float *v,
                 int64_t vb, int64_t vl, const float *bias, int64_t bb, int64_t bm, int64_t B, int64_t M, int64_t L,
                 int64_t hd, float scale, float *out, int nthreads, int ref) {
    int failed = 0;
#ifdef VS_AVX2
    const int vec = !ref && hd % 8 == 0;
#else
    const int vec = 0;
    (void)ref;
    (void)vec;
#endif
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (B * M * L * hd > (1 << 20))
    for (int64_t b = 0; b < B; b++) {
        float *s = malloc((size_t)(M * L + M) * sizeof(float));
        if (!s) { failed = 1; continue; }
        float *inv = s + M * L;
        const float *qb_ = q + b * qb, *kb_ = k + b * kb, *vb_ = v + b * vb, *br = bias ? bias + b * bb : NULL;
#ifdef VS_AVX2
        if (vec) scores_avx2(qb_, qm, kb_, kl, br, bm, M, L, hd, scale, s, L);
        else
#endif
            scores_ref(qb_, qm, kb_, kl, br, bm, M, L, hd, scale, s, L);
        for (int64_t m = 0; m < M; m++) inv[m] = softmax_row(s + m * L, L, vec);
        float *o = out + b * M * hd;
        for (int64_t i = 0; i < M * hd; i++) o[i] = 0.0f;
        for (int64_t m = 0; m < M; m++) pv_rows(o + m * hd, vb_, vl, s + m * L, L, inv[m], hd, vec); /* (p / sum p) v */
        free(s);
    }
    return failed ? -2 : 0;
}

/* RoPE in place on the first `heads` heads of each row of x (row stride `stride` floats, heads of hd floats):
 * x'[i] = x[i] c[i] + x[i + h] s[i] for i < h = hd / 2, x[i] c[i] + x[i - h] s[i] after (HF's rotate_half, with
 * s the signed sine [-sin, sin]), each as fma(rolled, s, x c); cos, sin: [N, hd] rows. Element-wise: no body
 * choice to make. Returns 0, or -1 for an odd hd or one over 512. */
int vs_rope(float *x, int64_t N, int64_t stride, int64_t heads, int64_t hd, const float *cos, const float *sin) {
    const int64_t h = hd / 2;
    float tmp[512];
    if (hd > 512 || hd % 2) return -1;
    for (int64_t n = 0; n < N; n++) {
        const float *c = cos + n * hd, *s = sin + n * hd;
        for (int64_t a = 0; a < heads; a++) {
            float *v = x + n * stride + a * hd;
            memcpy(tmp, v, (size_t)hd * sizeof(float));
            for (int64_t i = 0; i < hd; i++) v[i] = fmaf(tmp[i < h ? i + h : i - h], s[i], tmp[i] * c[i]);
        }
    }
    return 0;
}

/* the matmul bodies: VS_BODY_ACTIVE (0) in a call means the one vs_set_body chose (at first the fastest built) */
enum { VS_BODY_ACTIVE = 0, VS_BODY_PORTABLE = 1, VS_BODY_AVX2 = 2, VS_BODY_AVX512 = 3 };

/* bit b set: body b is in this build */
int vs_bodies(void) {
    int m = 1 << VS_BODY_PORTABLE;
#ifdef VS_AVX2
    m |= 1 << VS_BODY_AVX2;
#endif
#ifdef VS_AVX512
    m |= 1 << VS_BODY_AVX512;
#endif
    return m;
}

#if defined(VS_AVX512)
static int active_body = VS_BODY_AVX512;
#elif defined(VS_AVX2)
static int active_body = VS_BODY_AVX2;
#else
static int active_body = VS_BODY_PORTABLE;
#endif

static int body_built(int body) { return body > 0 && body <= VS_BODY_AVX512 && (vs_bodies() & (1 << body)); }

/* the body that calls with VS_BODY_ACTIVE (and vs_decoder) run; returns 0, or -1 for one not in this build. All
 * bodies give the same bits, so the choice changes only the speed */
int vs_set_body(int body) {
    if (!body_built(body)) return -1;
    active_body = body;
    return 0;
}

/* at most `rows` rows of one sequence per attention task (1: each row reads its keys alone, as before rows were
 * attended together); returns the previous setting. Only the speed changes, never a bit: for benchmarks */
int vs_set_attention_rows(int rows) {
    const int was = attention_rows;
    attention_rows = rows < 1 ? 1 : rows;
    return was;
}

/* where the AVX-512 body's pair streams are fetched ahead to (0 L1, 1 L2, 2 non-temporal); returns the level
 * before, or -1 for another level (nothing set). Only the speed changes, never a bit */
int vs_set_prefetch(int level) {
    if (level < 0 || level > 2) return -1;
    const int was = prefetch_level;
    prefetch_level = level;
    return was;
}

/* from how many rows on the AVX-512 body runs two tiles per vector (below: one tile, 8 lanes, up to 8 rows per pass);
 * returns the setting before (rows < 1 reads it without a change). Only the speed changes, never a bit */
int vs_set_pair_rows(int rows) {
#ifdef VS_AVX512
    const int was = pair_from;
    if (rows >= 1) pair_from = rows;
    return was;
#else
    (void)rows;
    return -1;
#endif
}

/* where the single-tile streams (fewer rows than a pair takes) are fetched ahead to (0 L1, 1 L2, 2 non-temporal);
 * returns the level before, or -1 for another level (nothing set). Only the speed changes, never a bit */
int vs_row_prefetch(void) { return row_prefetch_level; } /* the levels in force */
int vs_pair_prefetch(void) { return prefetch_level; }

int vs_set_row_prefetch(int level) {
    if (level < 0 || level > 2) return -1;
    const int was = row_prefetch_level;
    row_prefetch_level = level;
    return was;
}

/* one row x [K] (float32, or bfloat16 when x_bf16) RMS-normalised and scaled: out = (x * r) * w with
 * r = 1 / sqrt(sum(x^2) / K + eps), the sum in 8 lanes (element j in lane j % 8, fma in order, hsum8) */
static void rms_norm_row(const void *x, int x_bf16, int64_t K, const float *w, float eps, float *out) {
    float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#ifdef VS_AVX2
    if (!x_bf16 && K % 8 == 0) { /* lane j % 8 in a vector: the same fmas in the same order */
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < K; j += 8) {
            const __m256 v = _mm256_loadu_ps((const float *)x + j);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        _mm256_storeu_ps(l, acc);
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum8(l) / (float)K + eps));
        for (int64_t j = 0; j < K; j += 8)
            _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps((const float *)x + j), inv),
                                                    _mm256_loadu_ps(w + j)));
        return;
    }
#endif
    for (int64_t j = 0; j < K; j++) {
        out[j] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[j]) : ((const float *)x)[j];
        l[j & 7] = fmaf(out[j], out[j], l[j & 7]);
    }
    const float inv = 1.0f / sqrtf(hsum8(l) / (float)K + eps);
    for (int64_t j = 0; j < K; j++) out[j] = (out[j] * inv) * w[j];
}

/* SwiGLU of one row x [2K] (gate | up, float32) -> out [K]: silu(g) * u with silu(g) = g / (1 + exp(-g)) */
static void swiglu_row(const float *x, int64_t K, float *out, int ref) {
    const float *g = x, *u = x + K;
    int64_t j = 0;
#ifdef VS_AVX2
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; !ref && j + 8 <= K; j += 8) {
        const __m256 gv = _mm256_loadu_ps(g + j);
        const __m256 e = vexp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + j)));
    }
#else
    (void)ref;
#endif
    for (; j < K; j++) out[j] = (g[j] / (1.0f + vexp(-g[j]))) * u[j];
}

/* out [M, N] = x' [M, K] times the weight's transpose (+ residual). w: an [N, K] weight in `nparts` parts stacked
 * along N, part p at layout[3p .. 3p + 2] = (kind, rows, byte offset into w): the x8 tiles of its rows
 * ([ceil(rows / 8), K / 32] tiles, or [ceil(rows / 8), K / 256] superblocks of a K-quant; rows past its count are
 * padding); x float32 or bfloat16 (x_bf16); x' = x, or x RMS-
 * normalised with weights norm_w [K] and eps when norm_w is not NULL, or (act = 1) SwiGLU of a float32 x
 * [M, 2K] (gate | up); out float32 or bfloat16 (out_bf16);
 * residual: NULL or float32 [M, N] added to out (float32 out only). body: VS_BODY_* (ACTIVE: vs_set_body's).
 * Returns 0, -1 for a bad kind, K, residual or body, -2 without memory. */
int vs_linear(const uint8_t *w, const int64_t *layout, int nparts, int64_t N, int64_t K, const void *x, int x_bf16,
              int64_t M, void *out, int out_bf16, int nthreads, int body, const float *norm_w, float eps,
              const float *residual, int act) {
    if (nparts < 1 || K % QK || (residual && out_bf16) || (act && (x_bf16 || norm_w))) return -1;
    int64_t rows_in_parts = 0;
    for (int p = 0; p < nparts; p++) {
        const int64_t kind = layout[3 * p];
        if (vs_tile_bytes((int)kind) < 0 || layout[3 * p + 1] <= 0 || (kquant((int)kind) && K % 256)) return -1;
        rows_in_parts += layout[3 * p + 1];
    }
    if (rows_in_parts != N) return -1;
    if (body == VS_BODY_ACTIVE) body = active_body;
    if (!body_built(body)) return -1;
    const int use_ref = body == VS_BODY_PORTABLE;
    if (M <= 0 || N <= 0) return 0;
    const int64_t nb = K / QK;
    const int64_t normed = norm_w || act ? M * K : 0;
    const int64_t bcast = body == VS_BODY_AVX2 ? 8 * M * K : 0; /* the AVX2 body's broadcast groups */
    const size_t bytes = (size_t)(bcast + (normed + 5 * M * nb) * (int64_t)sizeof(float) + M * K);
    void *scratch = aligned_alloc(32, (bytes + 31) / 32 * 32);
    if (!scratch) return -2;
    int8_t *qb = (int8_t *)scratch; /* first, so 32-byte aligned */
    float *s = (float *)(qb + bcast), *ss = s + M * nb, *xn = ss + M * nb;
    int32_t *qsum = (int32_t *)(xn + normed);
    int32_t *q16 = qsum + M * nb;
    int8_t *q = (int8_t *)(q16 + 2 * M * nb);
    const qrows rows = {q, s, ss, qsum, q16, qb};
    /* one parallel region per call: the rows prepared, then the product's worksharing loops (a fork and join
     * fewer per stage) */
    #pragma omp parallel num_threads(nthreads)
    {
        /* each row alone (normed or SwiGLU'd, then quantised), so the rows may go to threads: the same values */
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) {
            const void *xr = (const char *)x + r * K * (x_bf16 ? 2 : 4) * (act ? 2 : 1); /* act: rows of 2K */
            if (norm_w) rms_norm_row(xr, x_bf16, K, norm_w, eps, xn + r * K);
            else if (act) swiglu_row((const float *)xr, K, xn + r * K, use_ref);
            if (normed)
                quantize_row(xn + r * K, 0, K, q + r * K, s + r * nb, ss + r * nb, qsum + r * nb, q16 + 2 * r * nb);
            else quantize_row(xr, x_bf16, K, q + r * K, s + r * nb, ss + r * nb, qsum + r * nb, q16 + 2 * r * nb);
#ifdef VS_AVX2
            if (bcast)
                for (int64_t g = 0; g < K / 4; g++) { /* group g's 4 bytes in every 32-bit lane */
                    int32_t e;
                    memcpy(&e, q + r * K + 4 * g, 4);
                    _mm256_store_si256((__m256i *)(qb + (r * K / 4 + g) * 32), _mm256_set1_epi32(e));
                }
#endif
        }
        int64_t col = 0;
        for (int p = 0; p < nparts; col += layout[3 * p + 1], p++) { /* each part into its own columns */
            const int kind = (int)layout[3 * p];
            const int64_t n = layout[3 * p + 1];
            const uint8_t *wp = w + layout[3 * p + 2];
            const dest o = {(char *)out + col * (out_bf16 ? 2 : 4), out_bf16, residual ? residual + col : NULL, N};
#ifdef VS_AVX512
            if (body == VS_BODY_AVX512) gemm_avx512(wp, kind, &rows, M, n, K, &o);
            else
#endif
#ifdef VS_AVX2
            if (body == VS_BODY_AVX2) gemm_avx2(wp, kind, &rows, M, n, K, &o);
            else
#endif
                gemm_ref(wp, kind, &rows, M, n, K, &o);
        }
    }
    free(scratch);
    return 0;
}

/* --- every decoder layer of one forward in one call (the gguf-q8act path's `DecoderKernel`) ---
 * Row r's K/V go to position pos[r] of its sequence; its RoPE position is rpos[r]. It sees the keys lo .. hi[r] - 1
 * (lo = rpos[r] - window + 1 in a sliding-window layer, else 0), then hi[r] + j for each bit j of anc[r], in that
 * (ascending) order: a chain's row has hi = pos + 1 and no bits; a draft tree's node has hi = the tree's first
 * position and the bits of its ancestors and itself. The cache's layer tensors hold
 * kv head h, position j of row r's sequence at element base[r] + h * hstride + phys(j) * hd, where
 * phys(j) = table[j / bs] * bs + j % bs with the row's block table at tables + toff[r] (a slot cache: one entry
 * 0 and bs = its length). Each layer runs what models/llama.py's `Layer.forward` runs on this path, with the same
 * functions in the same order (so the same bits): x' = x + o(attention(rope(qkv(norm(x))))), then
 * x'' = x' + down(swiglu(gate_up(norm(x')))), K/V written for every row before any row attends. */
typedef struct {
    const uint8_t *qkv, *o, *gate_up, *down; /* x8 tiles */
    const int64_t *qkv_layout, *o_layout, *gate_up_layout, *down_layout; /* their parts, as vs_linear's */
    int32_t qkv_parts, o_parts, gate_up_parts, down_parts;
    const float *attn_norm, *mlp_norm; /* [d] */
    int64_t window; /* 0: full attention */
} vs_layer;

typedef struct {
    float *k, *v; /* the layer's cache: float32, or float16 (uint16_t elements) when half */
    const int64_t *pos, *rpos, *hi, *base, *toff;
    const uint64_t *anc;
    const int32_t *tables;
    int64_t bs, hstride;
    int half;
} vs_rows;

/* n positions (hd values each) of a layer's K or V cache c from element `at`: the cache's own floats, or, in a
 * float16 cache, their exact float values converted into tmp [n hd]. Attention then runs on float32 as it does over a
 * float32 cache holding the same (rounded) values: the same bits, with half the bytes read from memory. */
static inline const float *kv_read(const vs_rows *R, const float *c, int64_t at, int64_t n, int64_t hd, float *tmp) {
    if (!R->half) return c + at;
    f16_to_f32_row((const uint16_t *)(const void *)c + at, n * hd, tmp);
    return tmp;
}

static inline int64_t row_lo(const vs_rows *R, int64_t r, int64_t window) { /* never past hi: a count >= 0 */
    const int64_t lo = window && R->rpos[r] - window + 1 > 0 ? R->rpos[r] - window + 1 : 0;
    return lo < R->hi[r] ? lo : R->hi[r];
}

static inline int64_t phys(const vs_rows *R, int64_t r, int64_t j) {
    return (int64_t)R->tables[R->toff[r] + j / R->bs] * R->bs + j % R->bs;
}

#define KV_HALF_RUN 32 /* a float16 cache's runs are converted at most this many positions at a time (L1-sized) */

/* the end of the run of consecutive cache positions from j (the rest of j's block), at most hi; in a float16 cache
 * at most KV_HALF_RUN positions, so that the converted run stays in L1 (each key's score and each value's share of
 * the sum come out the same however the keys are split into runs: a paged cache splits them at its blocks) */
static inline int64_t run_end(const vs_rows *R, int64_t j, int64_t hi) {
    int64_t end = (j / R->bs + 1) * R->bs;
    if (R->half && end - j > KV_HALF_RUN) end = j + KV_HALF_RUN;
    return end < hi ? end : hi;
}


/* row r's scores against the keys it alone sees: hmin .. hi[r] - 1 (the rest of lo .. hi[r] - 1, in runs) and then
 * hi[r] + each bit of anc[r]; g query heads q [g, hd] of kv head h (a head's scores at s + a ls, from column hmin - lo) */
static void own_scores(const vs_rows *R, int64_t r, int64_t head, const float *q, int64_t g, int64_t lo,
                       int64_t hmin, int64_t hd, float scale, float *s, int64_t ls, int vec, float *tmp) {
#ifndef VS_AVX2
    (void)vec;
#endif
    int64_t L = R->hi[r] - lo;
    for (int64_t j = hmin; j < R->hi[r];) {
        const int64_t end = run_end(R, j, R->hi[r]);
        const float *kp = kv_read(R, R->k, head + phys(R, r, j) * hd, end - j, hd, tmp);
#ifdef VS_AVX2
        if (vec) scores_avx2(q, hd, kp, hd, NULL, 0, g, end - j, hd, scale, s + (j - lo), ls);
        else
#endif
            scores_ref(q, hd, kp, hd, NULL, 0, g, end - j, hd, scale, s + (j - lo), ls);
        j = end;
    }
    for (uint64_t m = R->anc[r]; m; m &= m - 1, L++) { /* a tree node's ancestors and itself */
        const float *kp = kv_read(R, R->k, head + phys(R, r, R->hi[r] + __builtin_ctzll(m)) * hd, 1, hd, tmp);
#ifdef VS_AVX2
        if (vec) scores_avx2(q, hd, kp, hd, NULL, 0, g, 1, hd, scale, s + L, ls);
        else
#endif
            scores_ref(q, hd, kp, hd, NULL, 0, g, 1, hd, scale, s + L, ls);
    }
}

/* one task: rows r0 .. r0 + n - 1 of one sequence, whose keys start at the same lo, and their g query heads a0 ..
 * a0 + g - 1 of kv head h; out: att [N, H hd]; s: scratch [n g, ls]. The keys lo .. hmin - 1 (hmin: the rows'
 * smallest hi) are read once for all n g queries; each query's scores, softmax and sum are computed as for that
 * row and head alone (the same bits): a row's result does not depend on the rows it is computed with */
static void attend_task(const vs_rows *R, const float *qkv, int64_t W, int64_t H, int64_t r0, int64_t n, int64_t h,
                        int64_t a0, int64_t g, int64_t lo, int64_t hd, float scale, float *s, int64_t ls, float *att,
                        int vec, float *tmp) {
    const int64_t head = R->base[r0] + h * R->hstride, nq = n * g;
    const float *qp[MAXQ];
    float *sp[MAXQ], *op[MAXQ], inv[MAXQ];
    int64_t hmin = R->hi[r0];
    for (int64_t i = 0; i < n; i++) hmin = R->hi[r0 + i] < hmin ? R->hi[r0 + i] : hmin;
    for (int64_t i = 0; i < nq; i++) {
        const int64_t r = r0 + i / g, a = a0 + i % g;
        qp[i] = qkv + r * W + a * hd;
        sp[i] = s + i * ls;
        op[i] = att + (r * H + a) * hd;
    }
    for (int64_t j = lo; j < hmin;) { /* the shared keys, in runs of consecutive positions */
        const int64_t end = run_end(R, j, hmin);
        const float *kp = kv_read(R, R->k, head + phys(R, r0, j) * hd, end - j, hd, tmp);
#ifdef VS_AVX2
        if (vec) scores_multi(qp, nq, kp, hd, end - j, hd, scale, sp, j - lo);
        else
#endif
            for (int64_t i = 0; i < nq; i++) scores_ref(qp[i], hd, kp, hd, NULL, 0, 1, end - j, hd, scale, sp[i] + (j - lo), ls);
        j = end;
    }
    for (int64_t i = 0; i < n; i++)
        own_scores(R, r0 + i, head, qp[i * g], g, lo, hmin, hd, scale, sp[i * g], ls, vec, tmp);
    for (int64_t i = 0; i < nq; i++) {
        const int64_t r = r0 + i / g;
        inv[i] = softmax_row(sp[i], R->hi[r] - lo + __builtin_popcountll(R->anc[r]), vec);
        for (int64_t e = 0; e < hd; e++) op[i][e] = 0.0f;
    }
    for (int64_t j = lo; j < hmin;) {
        const int64_t end = run_end(R, j, hmin);
        const float *vp = kv_read(R, R->v, head + phys(R, r0, j) * hd, end - j, hd, tmp);
#ifdef VS_AVX2
        if (vec) pv_multi(op, nq, vp, hd, (const float *const *)sp, j - lo, end - j, inv, hd);
        else
#endif
            for (int64_t i = 0; i < nq; i++) pv_rows(op[i], vp, hd, sp[i] + (j - lo), end - j, inv[i], hd, vec);
        j = end;
    }
    for (int64_t i = 0; i < nq; i++) { /* each row's own keys: the rest of its range, then its tree bits */
        const int64_t r = r0 + i / g;
        for (int64_t j = hmin; j < R->hi[r];) {
            const int64_t end = run_end(R, j, R->hi[r]);
            pv_rows(op[i], kv_read(R, R->v, head + phys(R, r, j) * hd, end - j, hd, tmp), hd, sp[i] + (j - lo),
                    end - j, inv[i], hd, vec);
            j = end;
        }
        int64_t t = R->hi[r] - lo;
        for (uint64_t m = R->anc[r]; m; m &= m - 1, t++)
            pv_rows(op[i], kv_read(R, R->v, head + phys(R, r, R->hi[r] + __builtin_ctzll(m)) * hd, 1, hd, tmp), hd,
                    sp[i] + t, 1, inv[i], hd, vec);
    }
}

/* the attention of N rows' H heads (G = H / KH per kv head) from qkv [N, (H + 2 KH) hd] into att [N, H hd].
 * A task: up to `rb` consecutive rows of one sequence (same cache addressing, keys from the same lo) and g query
 * heads sharing a kv head. rb and g are chosen from the shapes and the thread count alone (each query's bits are
 * the same whatever its task): whole sequences and whole head groups where that gives each thread two tasks, else
 * sequences split into shorter runs of rows, then one head per task */
static int attend_rows(const vs_rows *R, const float *qkv, int64_t N, int64_t H, int64_t KH, int64_t hd,
                       int64_t window, float scale, float *att, int nthreads) {
    const int64_t W = (H + 2 * KH) * hd, G = H / KH;
    int64_t most = 1, work = 0, longest = 1, run = 0;
    for (int64_t r = 0; r < N; r++) {
        const int64_t count = R->hi[r] - row_lo(R, r, window) + __builtin_popcountll(R->anc[r]);
        most = count > most ? count : most;
        work += count;
        run = r && R->base[r] == R->base[r - 1] && R->toff[r] == R->toff[r - 1] ? run + 1 : 1;
        longest = run > longest ? run : longest;
    }
#ifdef VS_AVX2
    const int vec = hd % 8 == 0;
#else
    const int vec = 0;
#endif
    const int64_t g = G <= MAXQ ? G : 1;
    int64_t rb = longest < MAXQ / g ? longest : MAXQ / g, T = 0;
    rb = rb < attention_rows ? rb : attention_rows;
    int64_t *task = malloc((size_t)(2 * N + 1) * sizeof(int64_t)); /* each task's first row and row count */
    if (!task) return -2;
    for (;;) { /* the sequences' runs of rows, split into near-equal parts of at most rb rows */
        T = 0;
        for (int64_t r = 0; r < N;) {
            const int64_t lo = row_lo(R, r, window);
            int64_t e = r + 1;
            while (e < N && R->base[e] == R->base[r] && R->toff[e] == R->toff[r] && row_lo(R, e, window) == lo) e++;
            const int64_t parts = (e - r + rb - 1) / rb;
            for (int64_t p = 0; p < parts; p++) {
                const int64_t a = r + (e - r) * p / parts, b = r + (e - r) * (p + 1) / parts;
                task[2 * T] = a, task[2 * T + 1] = b - a, T++;
            }
            r = e;
        }
        if (rb == 1 || T * KH >= 2 * nthreads) break;
        rb = (rb + 1) / 2;
    }
    /* query heads per task (a float16 cache: always the whole group, whose keys are then converted once, not once
     * per query head) and tasks per row run */
    const int64_t gt = T * KH >= 2 * nthreads || R->half ? g : 1, per = H / gt;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) if (work * H * hd > (1 << 17))
    {
        float *s = malloc((size_t)(most * rb * gt + (R->half ? KV_HALF_RUN * hd : 0)) * sizeof(float));
        if (!s) failed = 1;
        float *tmp = s && R->half ? s + most * rb * gt : NULL; /* a float16 cache's run, converted */
        #pragma omp for schedule(static) /* head groups outermost: a thread's tasks share kv heads */
        for (int64_t i = 0; i < T * per; i++) {
            if (!s) continue;
            const int64_t t = i % T, a = i / T * gt, r0 = task[2 * t], n = task[2 * t + 1];
            attend_task(R, qkv, W, H, r0, n, a / G, a, gt, row_lo(R, r0, window), hd, scale, s, most, att, vec, tmp);
        }
        free(s);
    }
    free(task);
    return failed ? -2 : 0;
}

/* K and V of the N rows (qkv's heads H .. H + KH - 1 and the KH after them) into the cache */
static void write_kv(const vs_rows *R, const float *qkv, int64_t N, int64_t H, int64_t KH, int64_t hd) {
    const int64_t W = (H + 2 * KH) * hd;
    for (int64_t r = 0; r < N; r++)
        for (int64_t h = 0; h < KH; h++) {
            const int64_t at = R->base[r] + h * R->hstride + phys(R, r, R->pos[r]) * hd;
            if (R->half) {
                f32_to_f16_row(qkv + r * W + (H + h) * hd, hd, (uint16_t *)(void *)R->k + at);
                f32_to_f16_row(qkv + r * W + (H + KH + h) * hd, hd, (uint16_t *)(void *)R->v + at);
                continue;
            }
            memcpy(R->k + at, qkv + r * W + (H + h) * hd, (size_t)hd * sizeof(float));
            memcpy(R->v + at, qkv + r * W + (H + KH + h) * hd, (size_t)hd * sizeof(float));
        }
}

/* x [N, d] (float32, in place) through layers 0 .. nl - 1; kc, vc: each layer's cache tensors (float16 when kv_half:
 * K/V rounded to nearest even when written, read back exactly); cos, sin [N, hd]
 * the rows' RoPE (at rpos); capture: per layer NULL or the first of N rows, cap_ld floats apart (cap_ld >= d: several
 * layers' states side by side in one buffer), that get x as it enters the layer. Returns 0, -1 for bad shapes, -2
 * without memory. */
int vs_decoder(const vs_layer *layers, int64_t nl, float *const *kc, float *const *vc, int64_t d, int64_t H,
               int64_t KH, int64_t hd, int64_t I, float eps, float scale, float *x, int64_t N, const float *cos,
               const float *sin, const int64_t *pos, const int64_t *rpos, const int64_t *hi, const uint64_t *anc,
               const int64_t *base, const int32_t *tables, const int64_t *toff, int64_t bs, int64_t hstride,
               float *const *capture, int64_t cap_ld, int kv_half, int nthreads) {
    if (N <= 0) return 0;
    if (KH <= 0 || H % KH || hd > 512 || hd % 2 || (capture && cap_ld < d)) return -1;
    const int64_t W = (H + 2 * KH) * hd;
    float *buf = malloc((size_t)(N * (W + H * hd + d + 2 * I)) * sizeof(float));
    if (!buf) return -2;
    float *qkv = buf, *att = qkv + N * W, *y = att + N * H * hd, *h = y + N * d;
    int rc = 0;
    for (int64_t l = 0; l < nl && !rc; l++) {
        const vs_layer *L = layers + l;
        const vs_rows R = {kc[l], vc[l], pos, rpos, hi, base, toff, anc, tables, bs, hstride, kv_half};
        if (capture && capture[l])
            for (int64_t r = 0; r < N; r++) memcpy(capture[l] + r * cap_ld, x + r * d, (size_t)d * sizeof(float));
        rc = vs_linear(L->qkv, L->qkv_layout, L->qkv_parts, W, d, x, 0, N, qkv, 0, nthreads, 0, L->attn_norm, eps,
                       NULL, 0);
        if (rc) break;
        vs_rope(qkv, N, W, H + KH, hd, cos, sin);
        write_kv(&R, qkv, N, H, KH, hd);
        rc = attend_rows(&R, qkv, N, H, KH, hd, L->window, scale, att, nthreads);
        if (!rc) rc = vs_linear(L->o, L->o_layout, L->o_parts, d, H * hd, att, 0, N, y, 0, nthreads, 0, NULL, 0.0f,
                                x, 0);
        if (!rc) rc = vs_linear(L->gate_up, L->gate_up_layout, L->gate_up_parts, 2 * I, d, y, 0, N, h, 0, nthreads, 0,
                                L->mlp_norm, eps, NULL, 0);
        if (!rc) rc = vs_linear(L->down, L->down_layout, L->down_parts, d, I, h, 0, N, x, 0, nthreads, 0, NULL, 0.0f,
                                y, 1);
    }
    free(buf);
    return rc;
}
