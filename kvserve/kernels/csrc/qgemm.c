/* kvserve's quantized CPU matmul: y[M, N] = x[M, K] . W[N, K]^T with W kept in 4 or 8 bits and integer dot products.
 *
 * The scheme is llama.cpp's (ggml-cpu quants: vec_dot_q4_1_q8_1, vec_dot_q8_0_q8_0): every activation row is
 * quantized per block of QK = 32 values to int8 with one float scale (d_x = max|x| / 127, q = round-to-nearest-even
 * (x / d_x), as llama.cpp's Q8_0/Q8_1 activations), so a block's dot product is an exact integer sum times float
 * scales. With ACT_PAIR, each activation block is a *pair* of int8 vectors instead (x ~= d_x (254 q1 + q2), q1 as
 * above and q2 its rounding residual: a 15-bit activation, "activations" below); every product stays an int8 dot
 * product, twice as many of them, and the weights are still loaded and unpacked once. Below, q_x = 254 q1 + q2 then:
 *
 *   4-bit weights, w = d_w * q_w + m_w (q_w in 0..15; GGUF Q4_1, and Q4_0 with m_w = -8 d_w):
 *       sum_k w_k x_k ~= d_w d_x * sum_k q_w q_x  +  m_w * (d_x * sum_k q_x)
 *   8-bit weights, w = d_w * q_w (q_w in -128..127; GGUF Q8_0, and kvserve's per-channel "int8" with d_w = 1 and a
 *   per-output float scale applied at the end):
 *       sum_k w_k x_k ~= d_w d_x * sum_k q_w q_x
 *
 * Packed weight layout (built in kvserve/quant/pack.py): output features in groups of G = 16, each group's
 * blocks contiguous, group-major: block (g, b) at byte (g * nb + b) * BLOCK_BYTES, nb = K / 32.
 *   Q4 block (320 bytes): fp16 d[16], fp16 m[16], then 256 bytes: byte j*64 + o*4 + i (j 0..3, o 0..15, i 0..3)
 *       holds w[16g + o][32b + 4j + i] in its low nibble and w[16g + o][32b + 16 + 4j + i] in its high nibble.
 *   Q4F block (384 bytes): as Q4 with float32 d[16] and m[16] (GGUF Q4_K: d = d_sb * sc, m = -dmin_sb * mn, which
 *       need more than float16's 11 bits, exact in float32).
 *   Q8 block (544 bytes): fp16 d[16], then 512 bytes: byte j*64 + o*4 + i (j 0..7) = int8 w[16g + o][32b + 4j + i].
 *   Q6 block (448 bytes; GGUF Q6_K, w = d * sc * (q - 32), q in 0..63, sc int8 per 16 inputs, d fp16 per 256):
 *       fp16 d[16] (each output's super-block d), int8 sc_lo[16] (inputs 0..15 of the block), int8 sc_hi[16]
 *       (inputs 16..31), 256 bytes of low nibbles as the Q4 block's, then 128 bytes of high 2-bit fields: byte
 *       (j >> 1) * 64 + o*4 + i holds q >> 4 of input 4j + i at bit 4 (j & 1) and of input 16 + 4j + i at bit
 *       4 (j & 1) + 2. 7 bits a weight (the file's 6.56).
 *   Q5F block (448 bytes; GGUF Q5_K, w = d q + m, q in 0..31): the Q4F block, then 64 bytes of high bits: byte
 *       o*4 + i holds bit 4 of input 4j + i at bit 2j and of input 16 + 4j + i at bit 2j + 1. 7 bits a weight (the
 *       file's 5.5). The tiles are the Q4 tiles (their `f32s` argument: 0 Q4, 1 Q4F, 2 Q5F, 3 Q4K) with that bit
 *       ORed in; on AVX2 each step's 16-bit sums go to 32 bits at once (a 5-bit block's would pass 2^15).
 *   Q4K (GGUF Q4_K as stored, 4.625 bits a weight against the file's 4.5): per group, super-blocks of 8 blocks (256
 *       inputs, 2368 bytes): fp16 d[16], fp16 dmin[16], then 8 blocks of 288 bytes: uint8 sc[16], uint8 mn[16]
 *       (6-bit), 256 bytes of nibbles as the Q4 block's. K is a multiple of 256, so a group is nb / 8 whole
 *       super-blocks (nb * 296 bytes: block_bytes) and block i of a run of groups is at q4k_block(w, i). The tiles
 *       form d_w = d * sc and m_w = -(dmin * mn) per block and 16 outputs: products of an 11-bit and a 6-bit value,
 *       exact in float32, so the same floats as Q4F's stored ones and the same outputs bit for bit.
 *   Q3K (GGUF Q3_K, w = d sc (q - 4), q in 0..7; 3.5625 bits a weight against the file's 3.4375): per group,
 *       super-blocks of 8 blocks: fp16 d[16], then 8 blocks of 224 bytes: int8 sc[2][16] (sc_lo, sc_hi), 128 bytes of
 *       the low 2 bits of q (as the Q6 block's high fields), 64 bytes of third bits (as Q5F's fifth bits). The Q6 tiles
 *       run it (their f32s argument 1: q6_block, q6_sc, q6_d, q3k_unpack_*), with the Q6 values' bits.
 *   Q2K (GGUF Q2_K as stored, 2.625 bits a weight as the file): super-blocks as Q4K's (fp16 d[16], dmin[16]) of 8
 *       blocks of 160 bytes; its tiles are in qgemm_q2k.h (layout and arithmetic there). MX4 (MXFP4): qgemm_mx4.h.
 * Four consecutive input features of 16 (AVX-512) or 8 (AVX2, half a group) outputs are one vector, and one
 * broadcast 4-byte group of the activation multiplies all of them (the interleaved layout of llama.cpp's
 * ggml-cpu repack "q4_0_8x8"): each output's sum lands in its own 32-bit lane, so no horizontal sums, and the
 * weight scales of 8/16 outputs are applied with one vector FMA per block.
 *
 * Two instruction-set paths, both compiled into the library with per-function target attributes (never
 * -march=native) and chosen at run time by the caller (kvserve/kernels/qgemm.py: CPUID, then a numerical
 * self-check, KVSERVE_CPU_ISA to force one):
 *   AVX2:         _mm256_maddubs_epi16 (u8 x s8 pairs -> s16) + _mm256_madd_epi16 (-> s32), 8 outputs x MR2 rows.
 *                 4-bit: eight u4 x s8 products of one lane pair sum at most 8 * 2 * 15 * 127 = 30480 < 2^15, so a
 *                 whole block accumulates in 16 bits. 8-bit: the sign trick (|w| x sign(x, w)), one madd per step.
 *   AVX-512 VNNI: _mm512_dpbusd_epi32 (u8 x s8 quads -> s32), 16 outputs x MR5 rows. 8-bit weights are the signed
 *                 operand, the activation is made unsigned (q_x + 128) and 128 * sum q_w is subtracted per block.
 *   Q6 (both paths): the weights unpacked to signed int8 (q - 32, in -32..31) and multiplied as 8-bit weights; the
 *   two 16-input halves of a block sum apart (AVX2: the integer sub-block scale is the second operand of
 *   _mm256_madd_epi16, so it is applied for free; AVX-512: vpmulld per half and block) into the exact integer
 *   sum_k sc q_w q_x (|.| <= 2 * 16 * 32 * 127 * 128 < 2^24, so exact in float32 too), which with ACT_PAIR meets
 *   254 a1 + a2 in float (254 a1 could exceed 2^31): q6_fold.
 *   With ACT_PAIR, q1 and q2 accumulate apart (AVX2 4-bit: two 16-bit sums, each within the bound above) and meet as
 *   254 a1 + a2 in int32 (at most 254 * 32 * 128 * 128 < 2^31) before the float scale.
 * Groups are split across OpenMP threads; within a group the rows are tiled, so each weight block is loaded and
 * unpacked once per MR rows and stays in L1/L2 while the row tiles pass over it.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qgemm_layouts.h" /* QK, G, FMT_*, each layout's block bytes and named offsets (kvserve/quant/layouts.py) */
#define MR6 4 /* rows per AVX-512 Q6 tile (four accumulators per row) */
#define MR2 4 /* rows per AVX2 tile */
#define MR5 6 /* rows per AVX-512 tile */
#define SERIAL_QUANT (64 * 1024) /* activations up to this many values are quantized by the calling thread */
#define SERIAL_MACS (64 * 1024)  /* products below this many multiply-adds run on the calling thread */
#define STACK_BYTES (16 * 1024)  /* quantized activations up to this many bytes go to a stack buffer */
#define RES 254                  /* ACT_PAIR: x ~= d (RES q1 + q2) */
#define Q4K_EXPAND_TILES 8       /* Q4K over more row tiles than this: each group expanded to Q4F blocks first */
#define CHUNK_BYTES (1024 * 1024) /* many rows pass over the weights in chunks of about this many activation bytes */

enum { ISA_AVX2 = 1, ISA_AVX512_VNNI = 2, ISA_AMX_INT8 = 3 };
/* activation precision: one int8 per value, a pair (15 bits), or bfloat16 on AMX-BF16 (qgemm_amx_bf16.h) */
enum { ACT_INT8 = 0, ACT_PAIR = 1, ACT_BF16 = 2 };

#define T_AVX2 __attribute__((target("avx2,fma,f16c")))
#ifdef KVSERVE_Q_EMULATE_AVX512 /* tests only: SIMDe's portable AVX-512 intrinsics (tests/model/qgemm_avx512_emu.c) */
#define T_AVX512 T_AVX2
#else
#define T_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#endif
#define INLINE static inline __attribute__((always_inline))
/* Software prefetch of the weight stream PF_DIST bytes ahead (past a group's end: the next group, which the same
 * thread takes next under the static schedule), one cache line per 64 bytes of the current block. */
#define PF_DIST 2048
#define PREFETCH(blk, bytes) \
    for (int _l = 0; _l < (bytes); _l += 64) _mm_prefetch((const char *)(blk) + PF_DIST + _l, _MM_HINT_T0);

/* Q4K: block i of a run of whole super-blocks at w, and its super-block's d[16], dmin[16]. */
static inline const uint8_t *q4k_block(const uint8_t *w, int64_t i) {
    return w + (i >> 3) * Q4K_SUPER + 64 + (i & 7) * Q4K_BLOCK;
}
static inline const uint8_t *q4k_super(const uint8_t *w, int64_t i) { return w + (i >> 3) * Q4K_SUPER; }

/* The Q6 tiles' blocks: Q6 (q3k 0) or Q3K (q3k 1: GGUF Q3_K as stored, w = d sc (q - 4), q in 0..7, int8 sc per 16
 * inputs, fp16 d per 256 in a super-block header of 8 blocks). Block i of a group at w, its sub-block scales sc_lo
 * (inputs 0..15; sc_hi 16 bytes on) and its outputs' fp16 d[16]. */
static inline const uint8_t *q6_block(const uint8_t *w, int64_t i, int q3k) {
    return q3k ? w + (i >> 3) * Q3K_SUPER + Q3K_SB_BLOCKS + (i & 7) * Q3K_BLOCK : w + i * Q6_BLOCK;
}
static inline const uint8_t *q6_sc(const uint8_t *blk, int q3k) { return blk + (q3k ? Q3K_SC : Q6_SC_LO); }
static inline const uint8_t *q6_d(const uint8_t *w, int64_t i, int q3k) {
    return q3k ? w + (i >> 3) * Q3K_SUPER + Q3K_SB_D : w + i * Q6_BLOCK + Q6_D;
}

/* A Q4K block's d_w = d * sc and m_w = -(dmin * mn) of outputs 8 h .. 8 h + 7 (blk: the block, sb: its super-block;
 * exact in float32: the floats a Q4F block stores). The AVX2 tile's and q4k_group_to_q4f's. */
T_AVX2 INLINE void q4k_scales_avx2(const uint8_t *blk, const uint8_t *sb, int h, __m256 *dw, __m256 *mw) {
    *dw = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + h * 16))),
                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + h * 8)))));
    const __m256 m = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 32 + h * 16))),
                                   _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 16 + h * 8)))));
    *mw = _mm256_xor_ps(_mm256_set1_ps(-0.0f), m);
}

/* ---- activations: per-32-block int8 (or int8 pairs), round half to even like np.rint; scalar and AVX2 ---- */

/* x[K] -> per block b of 32 values: d1 = max|x| / 127, q1 = rint(x / d1) clamped to +-127 (llama.cpp's Q8
 * activation). ACT_INT8: q[32 b ..] = q1, d[b] = d1. ACT_PAIR: also d2 = d1 / RES and q2 = rint((x - q1 d1) / d2),
 * the residual of q1 (|x - q1 d1| <= d1 / 2, so q2 fits in +-127 and the error is at most d2 / 2 = d1 / 508);
 * q[64 b ..] = q1[32] then q2[32], d[b] = d2 (x ~= d2 (RES q1 + q2)). s[b] = d[b] * sum of the block's integer values
 * (q1, or RES q1 + q2): the block's sum of the represented activations, for the m_w term of 4-bit weights. K must
 * be a multiple of 32. */
static void quantize_row(const float *x, int64_t K, int8_t *q, float *d, float *s, int pair) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        int8_t *q1 = q + b * QK * (pair ? 2 : 1), *q2 = q1 + QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) {
            float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
        float d1 = amax / 127.0f, d2 = d1 / (float)RES;
        float id1 = d1 != 0.0f ? 1.0f / d1 : 0.0f, id2 = d2 != 0.0f ? 1.0f / d2 : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            float v = nearbyintf(xb[i] * id1);
            v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
            q1[i] = (int8_t)v;
            if (pair) {
                float r = fmaf(-v, d1, xb[i]); /* the exact residual, one rounding (as the vector path's fnmadd) */
                float v2 = nearbyintf(r * id2);
                v2 = v2 > 127.0f ? 127.0f : (v2 < -127.0f ? -127.0f : v2);
                q2[i] = (int8_t)v2;
                sum += RES * (int)v + (int)v2;
            } else {
                sum += (int)v;
            }
        }
        d[b] = pair ? d2 : d1;
        s[b] = d[b] * (float)sum;
    }
}

/* The same as quantize_row, 32 values at a time (vroundps to nearest even = nearbyintf in the default mode). */
T_AVX2 static void quantize_row_avx2(const float *x, int64_t K, int8_t *q, float *d, float *s, int pair) {
    const __m256 sign = _mm256_set1_ps(-0.0f), lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), res = _mm256_set1_epi32(RES);
    const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        int8_t *qb = q + b * QK * (pair ? 2 : 1);
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        float d1 = _mm_cvtss_f32(m) / 127.0f, d2 = d1 / (float)RES;
        float id1s = d1 != 0.0f ? 1.0f / d1 : 0.0f, id2s = d2 != 0.0f ? 1.0f / d2 : 0.0f;
        __m256 id1 = _mm256_set1_ps(id1s), id2 = _mm256_set1_ps(id2s), vd1 = _mm256_set1_ps(d1);
        __m256i q1[4], q2[4], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            __m256 r1 = _mm256_max_ps(_mm256_min_ps(_mm256_round_ps(_mm256_mul_ps(v[i], id1), rnd), lim), nlim);
            q1[i] = _mm256_cvtps_epi32(r1);
            if (pair) {
                __m256 resid = _mm256_fnmadd_ps(r1, vd1, v[i]);
                __m256 r2 = _mm256_round_ps(_mm256_mul_ps(resid, id2), rnd);
                q2[i] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(r2, lim), nlim));
                sum = _mm256_add_epi32(sum, _mm256_add_epi32(_mm256_mullo_epi32(q1[i], res), q2[i]));
            } else {
                sum = _mm256_add_epi32(sum, q1[i]);
            }
        }
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q1[0], q1[1]), _mm256_packs_epi32(q1[2], q1[3]));
        _mm256_storeu_si256((__m256i *)qb, _mm256_permutevar8x32_epi32(p, perm));
        if (pair) {
            p = _mm256_packs_epi16(_mm256_packs_epi32(q2[0], q2[1]), _mm256_packs_epi32(q2[2], q2[3]));
            _mm256_storeu_si256((__m256i *)(qb + QK), _mm256_permutevar8x32_epi32(p, perm));
        }
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
        d[b] = pair ? d2 : d1;
        s[b] = d[b] * (float)_mm_cvtsi128_si32(t);
    }
}

/* Exposed for tests: the same quantization the matmul applies to x [M, K] (q: [M, K] int8, or [M, 2K] for
 * ACT_PAIR in the layout above; d, s: [M, K / 32]). isa 0: the scalar reference. */
void kvserve_q_quantize_rows(int isa, int act, const float *x, int64_t M, int64_t K, int8_t *q, float *d, float *s) {
    const int pair = act == ACT_PAIR;
    for (int64_t m = 0; m < M; m++) {
        int8_t *qm = q + m * K * (pair ? 2 : 1);
        if (isa == ISA_AVX2 || isa == ISA_AVX512_VNNI || isa == ISA_AMX_INT8)
            quantize_row_avx2(x + m * K, K, qm, d + m * (K / QK), s + m * (K / QK), pair);
        else
            quantize_row(x + m * K, K, qm, d + m * (K / QK), s + m * (K / QK), pair);
    }
}

/* ---- AVX2 ---- */

/* In the tiles: xq holds the rows' quantized activations, row i at xq + i * xrow, block b at + b * xblk (xrow = K,
 * xblk = 32, or 2K and 64 with pair: q1 then q2); `pair` is a compile-time constant at every call (the tile is
 * inlined into a switch), so the int8 path carries no extra work. Per-row named variables (an array of vectors makes
 * gcc spill them): integer accumulators a##i (q1) and c##i (q2) per block, float sums f##i. */
#define A2_ZERO_F(i) __m256 f##i = _mm256_setzero_ps();
#define A2_ZERO_A(i) __m256i a##i = _mm256_setzero_si256(), c##i = _mm256_setzero_si256();
#define A2_BCAST(off) _mm256_set1_epi32(*(const int32_t *)(xr + (off)))
#define A2_Q4_STEP(i)                                                                                   \
    if (mr > i) {                                                                                       \
        const int8_t *xr = xq + (i) * xrow + b * xblk + 4 * j;                                          \
        a##i = _mm256_add_epi16(a##i, _mm256_maddubs_epi16(lo, A2_BCAST(0)));                           \
        a##i = _mm256_add_epi16(a##i, _mm256_maddubs_epi16(hi, A2_BCAST(16)));                          \
        if (pair) {                                                                                     \
            c##i = _mm256_add_epi16(c##i, _mm256_maddubs_epi16(lo, A2_BCAST(32)));                      \
            c##i = _mm256_add_epi16(c##i, _mm256_maddubs_epi16(hi, A2_BCAST(48)));                      \
        }                                                                                               \
    }
#define A2_Q4_END(i)                                                                                    \
    if (mr > i) {                                                                                       \
        __m256i t = pair ? _mm256_add_epi32(_mm256_madd_epi16(a##i, res16), _mm256_madd_epi16(c##i, ones)) \
                         : _mm256_madd_epi16(a##i, ones);                                               \
        f##i = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dw, _mm256_set1_ps(xd[(i) * nb + b])), f##i); \
        f##i = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[(i) * nb + b]), f##i);                             \
    }
#define A2_Q5_STEP(i)                                                                                   \
    if (mr > i) {                                                                                       \
        const int8_t *xr = xq + (i) * xrow + b * xblk + 4 * j;                                          \
        a##i = _mm256_add_epi32(a##i, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, A2_BCAST(0)), \
                                                                          _mm256_maddubs_epi16(hi, A2_BCAST(16))), ones)); \
        if (pair)                                                                                       \
            c##i = _mm256_add_epi32(c##i, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, A2_BCAST(32)), \
                                                                              _mm256_maddubs_epi16(hi, A2_BCAST(48))), ones)); \
    }
#define A2_Q5_END(i)                                                                                    \
    if (mr > i) {                                                                                       \
        __m256i t = pair ? _mm256_add_epi32(_mm256_mullo_epi32(a##i, _mm256_set1_epi32(RES)), c##i) : a##i; \
        f##i = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dw, _mm256_set1_ps(xd[(i) * nb + b])), f##i); \
        f##i = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[(i) * nb + b]), f##i);                             \
    }
#define A2_Q8_STEP(i)                                                                                   \
    if (mr > i) {                                                                                       \
        const int8_t *xr = xq + (i) * xrow + b * xblk + 4 * j;                                          \
        __m256i p1 = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(A2_BCAST(0), w));                        \
        a##i = _mm256_add_epi32(a##i, _mm256_madd_epi16(p1, pair ? res16 : ones));                      \
        if (pair)                                                                                       \
            c##i = _mm256_add_epi32(c##i, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(A2_BCAST(32), w)), \
                                                            ones));                                     \
    }
#define A2_Q8_END(i)                                                                                    \
    if (mr > i)                                                                                         \
        f##i = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair ? _mm256_add_epi32(a##i, c##i) : a##i),          \
                               _mm256_mul_ps(dw, _mm256_set1_ps(xd[(i) * nb + b])), f##i);
#define A2_STORE(i)                                                                                     \
    if (mr > i) _mm256_storeu_ps(y + (i) * ldy, oscale ? _mm256_mul_ps(f##i, _mm256_loadu_ps(oscale)) : f##i);
#define A2_ROWS(M) M(0) M(1) M(2) M(3)

/* mr rows (1..MR2) x 8 outputs (half `half` of group wg) -> y[i * ldy + 0..7]. */
T_AVX2 INLINE void q4_avx2_tile(const uint8_t *wg, int64_t nb, int half, const int8_t *xq, const float *xd,
                                const float *xs, int64_t K, float *y, int64_t ldy, const float *oscale, const int mr,
                                const int f32s, const int pair) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), res16 = _mm256_set1_epi16(RES);
    const int bb = f32s == 3 ? Q4K_SUPER / 8 : f32s == 2 ? Q5F_BLOCK : f32s ? Q4F_BLOCK : Q4_BLOCK;
    const int qo = f32s == 3 ? 32 : f32s ? 128 : 64; /* offset of the nibbles */
    const __m256i m1 = _mm256_set1_epi8(0x10);
    const int64_t xrow = pair ? 2 * K : K, xblk = pair ? 2 * QK : QK;
    A2_ROWS(A2_ZERO_F)
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = f32s == 3 ? q4k_block(wg, b) : wg + b * bb;
        if (!half) PREFETCH(wg + b * bb, bb) /* Q4K: the stream at its average stride, headers included */
        A2_ROWS(A2_ZERO_A)
        _Pragma("GCC unroll 1") for (int j = 0; j < 4; j++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + qo + j * 64 + half * 32));
            __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            if (f32s == 2) {
                const __m256i hb = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(blk + 384 + half * 32)), 2 * j);
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(hb, 4), m1));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(hb, 3), m1));
                A2_ROWS(A2_Q5_STEP)
            } else {
                A2_ROWS(A2_Q4_STEP)
            }
        }
        __m256 dw, mw;
        if (f32s == 3) {
            q4k_scales_avx2(blk, q4k_super(wg, b), half, &dw, &mw);
        } else {
            dw = f32s ? _mm256_loadu_ps((const float *)blk + half * 8)
                      : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + half * 16)));
            mw = f32s ? _mm256_loadu_ps((const float *)(blk + 64) + half * 8)
                      : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + half * 16)));
        }
        if (f32s == 2) {
            A2_ROWS(A2_Q5_END)
        } else {
            A2_ROWS(A2_Q4_END)
        }
    }
    A2_ROWS(A2_STORE)
}

T_AVX2 INLINE void q8_avx2_tile(const uint8_t *wg, int64_t nb, int half, const int8_t *xq, const float *xd,
                                const float *xs, int64_t K, float *y, int64_t ldy, const float *oscale, const int mr,
                                const int f32s, const int pair) {
    (void)xs, (void)f32s;
    const __m256i ones = _mm256_set1_epi16(1), res16 = _mm256_set1_epi16(RES);
    const int64_t xrow = pair ? 2 * K : K, xblk = pair ? 2 * QK : QK;
    A2_ROWS(A2_ZERO_F)
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * Q8_BLOCK;
        if (!half) PREFETCH(blk, Q8_BLOCK)
        A2_ROWS(A2_ZERO_A)
        _Pragma("GCC unroll 1") for (int j = 0; j < 8; j++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 32 + j * 64 + half * 32));
            __m256i aw = _mm256_abs_epi8(w);
            A2_ROWS(A2_Q8_STEP)
        }
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + half * 16)));
        A2_ROWS(A2_Q8_END)
    }
    A2_ROWS(A2_STORE)
}

/* Q6 sub-block scales of 8 outputs (int8 at p) as int16 pairs, one pair per 32-bit lane: the second operand of
 * _mm256_madd_epi16, so each lane's two 16-bit products are scaled and summed in one instruction. */
T_AVX2 INLINE __m256i q6_scales_avx2(const uint8_t *p) {
    __m256i s = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_or_si256(_mm256_and_si256(s, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(s, 16));
}

/* Step j of a Q6 block (8 outputs of half `half`): the signed weights of inputs 4j + i (lo) and 16 + 4j + i (hi). */
T_AVX2 INLINE void q6_unpack_avx2(const uint8_t *blk, int j, int half, __m256i *lo, __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + 64 + j * 64 + half * 32));
    const __m256i hb = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(blk + 320 + (j >> 1) * 64 + half * 32)),
                                         4 * (j & 1));
    *lo = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(raw, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30)), off);
    *hi = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), m4),
                                          _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30)), off);
}

/* Step j of a Q3K block (8 outputs of half `half`): the signed weights q - 4 of inputs 4j + i (lo) and 16 + 4j + i
 * (hi), from the 2-bit fields and the plane of third bits. */
T_AVX2 INLINE void q3k_unpack_avx2(const uint8_t *blk, int j, int half, __m256i *lo, __m256i *hi) {
    const __m256i m2 = _mm256_set1_epi8(3), b2 = _mm256_set1_epi8(4);
    const __m256i raw = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(blk + Q3K_QS + (j >> 1) * 64 + half * 32)),
                                          4 * (j & 1));
    const __m256i hb = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(blk + Q3K_QH + half * 32)), 2 * j);
    *lo = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(raw, m2), _mm256_and_si256(_mm256_slli_epi16(hb, 2), b2)), b2);
    *hi = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 2), m2),
                                          _mm256_and_si256(_mm256_slli_epi16(hb, 1), b2)), b2);
}

/* a##i (q1) and c##i (q2): sum_k sc q_w q_x in int32, the scale applied by madd (|pair sum| <= 2 * 32 * 127). */
#define A2_Q6_STEP(i)                                                                                   \
    if (mr > i) {                                                                                       \
        const int8_t *xr = xq + (i) * xrow + b * xblk + 4 * j;                                          \
        a##i = _mm256_add_epi32(a##i, _mm256_add_epi32(                                                 \
            _mm256_madd_epi16(_mm256_maddubs_epi16(alo, _mm256_sign_epi8(A2_BCAST(0), wlo)), slo),      \
            _mm256_madd_epi16(_mm256_maddubs_epi16(ahi, _mm256_sign_epi8(A2_BCAST(16), whi)), shi)));   \
        if (pair)                                                                                       \
            c##i = _mm256_add_epi32(c##i, _mm256_add_epi32(                                             \
                _mm256_madd_epi16(_mm256_maddubs_epi16(alo, _mm256_sign_epi8(A2_BCAST(32), wlo)), slo), \
                _mm256_madd_epi16(_mm256_maddubs_epi16(ahi, _mm256_sign_epi8(A2_BCAST(48), whi)), shi))); \
    }
#define A2_Q6_END(i)                                                                                    \
    if (mr > i) {                                                                                       \
        __m256 t = pair ? _mm256_fmadd_ps(_mm256_cvtepi32_ps(a##i), _mm256_set1_ps((float)RES), _mm256_cvtepi32_ps(c##i)) \
                        : _mm256_cvtepi32_ps(a##i);                                                     \
        f##i = _mm256_fmadd_ps(t, _mm256_mul_ps(dw, _mm256_set1_ps(xd[(i) * nb + b])), f##i);           \
    }

T_AVX2 INLINE void q6_avx2_tile(const uint8_t *wg, int64_t nb, int half, const int8_t *xq, const float *xd,
                                const float *xs, int64_t K, float *y, int64_t ldy, const float *oscale, const int mr,
                                const int f32s, const int pair) {
    (void)xs;
    const int q3k = f32s, bb = q3k ? Q3K_AVG_BLOCK : Q6_BLOCK; /* f32s 1: Q3K blocks */
    const int64_t xrow = pair ? 2 * K : K, xblk = pair ? 2 * QK : QK;
    A2_ROWS(A2_ZERO_F)
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = q6_block(wg, b, q3k), *sc = q6_sc(blk, q3k);
        if (!half) PREFETCH(wg + b * bb, bb)
        const __m256i slo = q6_scales_avx2(sc + half * 8), shi = q6_scales_avx2(sc + G + half * 8);
        A2_ROWS(A2_ZERO_A)
        _Pragma("GCC unroll 1") for (int j = 0; j < 4; j++) {
            __m256i wlo, whi;
            if (q3k) q3k_unpack_avx2(blk, j, half, &wlo, &whi);
            else q6_unpack_avx2(blk, j, half, &wlo, &whi);
            const __m256i alo = _mm256_abs_epi8(wlo), ahi = _mm256_abs_epi8(whi);
            A2_ROWS(A2_Q6_STEP)
        }
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(q6_d(wg, b, q3k) + half * 16)));
        A2_ROWS(A2_Q6_END)
    }
    A2_ROWS(A2_STORE)
}

/* One switch case per row count (1..6) with every flag a constant, so each tile is specialised. */
#define TILE_CASE(fn, n, f32s, pair, ...) case n: fn(__VA_ARGS__, n, f32s, pair); break;
#define TILE_SWITCH4(fn, f32s, pair, ...)                                                               \
    TILE_CASE(fn, 1, f32s, pair, __VA_ARGS__) TILE_CASE(fn, 2, f32s, pair, __VA_ARGS__)                 \
    TILE_CASE(fn, 3, f32s, pair, __VA_ARGS__) TILE_CASE(fn, 4, f32s, pair, __VA_ARGS__)
#define TILE_SWITCH6(fn, f32s, pair, ...)                                                               \
    TILE_SWITCH4(fn, f32s, pair, __VA_ARGS__)                                                           \
    TILE_CASE(fn, 5, f32s, pair, __VA_ARGS__) TILE_CASE(fn, 6, f32s, pair, __VA_ARGS__)
/* fmt x pair -> the tile, as a switch over the row count (SW: TILE_SWITCH4 or TILE_SWITCH6, the tile's rows). */
#define TILE_DISPATCH(SW, q4, q8, ...)                                                                  \
    if (fmt == FMT_Q8) {                                                                                \
        if (pair) { switch (mr) { SW(q8, 0, 1, __VA_ARGS__) } } else { switch (mr) { SW(q8, 0, 0, __VA_ARGS__) } } \
    } else if (fmt == FMT_Q4F) {                                                                        \
        if (pair) { switch (mr) { SW(q4, 1, 1, __VA_ARGS__) } } else { switch (mr) { SW(q4, 1, 0, __VA_ARGS__) } } \
    } else if (fmt == FMT_Q5F) {                                                                        \
        if (pair) { switch (mr) { SW(q4, 2, 1, __VA_ARGS__) } } else { switch (mr) { SW(q4, 2, 0, __VA_ARGS__) } } \
    } else if (fmt == FMT_Q4K) {                                                                        \
        if (pair) { switch (mr) { SW(q4, 3, 1, __VA_ARGS__) } } else { switch (mr) { SW(q4, 3, 0, __VA_ARGS__) } } \
    } else {                                                                                            \
        if (pair) { switch (mr) { SW(q4, 0, 1, __VA_ARGS__) } } else { switch (mr) { SW(q4, 0, 0, __VA_ARGS__) } } \
    }

T_AVX2 static void group_avx2(int fmt, int pair, const uint8_t *wg, int64_t nb, const int8_t *xq, const float *xd,
                              const float *xs, int64_t M, int64_t K, float *y, int64_t ldy, const float *oscale) {
    for (int64_t m0 = 0; m0 < M; m0 += MR2) {
        int mr = (M - m0) < MR2 ? (int)(M - m0) : MR2;
        for (int half = 0; half < 2; half++) {
            const int8_t *xq_ = xq + m0 * K * (pair ? 2 : 1);
            const float *xd_ = xd + m0 * nb, *xs_ = xs + m0 * nb, *os = oscale ? oscale + half * 8 : NULL;
            float *y_ = y + m0 * ldy + half * 8;
            if (fmt == FMT_Q6) {
                if (pair) { switch (mr) { TILE_SWITCH4(q6_avx2_tile, 0, 1, wg, nb, half, xq_, xd_, xs_, K, y_, ldy, os) } }
                else { switch (mr) { TILE_SWITCH4(q6_avx2_tile, 0, 0, wg, nb, half, xq_, xd_, xs_, K, y_, ldy, os) } }
            } else if (fmt == FMT_Q3K) {
                if (pair) { switch (mr) { TILE_SWITCH4(q6_avx2_tile, 1, 1, wg, nb, half, xq_, xd_, xs_, K, y_, ldy, os) } }
                else { switch (mr) { TILE_SWITCH4(q6_avx2_tile, 1, 0, wg, nb, half, xq_, xd_, xs_, K, y_, ldy, os) } }
            } else {
                TILE_DISPATCH(TILE_SWITCH4, q4_avx2_tile, q8_avx2_tile, wg, nb, half, xq_, xd_, xs_, K, y_, ldy, os)
            }
        }
    }
}

/* ---- AVX-512 VNNI ---- */

#define A5_ZERO_F(i) __m512 f##i = _mm512_setzero_ps();
#define A5_ZERO_A(i) __m512i a##i = _mm512_setzero_si512(), c##i = _mm512_setzero_si512();
#define A5_BCAST(off) _mm512_set1_epi32(*(const int32_t *)(xr + (off)))
#define A5_Q4_STEP(i)                                                                                   \
    if (mr > i) {                                                                                       \
        const int8_t *xr = xq + (i) * xrow + b * xblk + 4 * j;                                          \
        a##i = _mm512_dpbusd_epi32(a##i, lo, A5_BCAST(0));                                              \
        a##i = _mm512_dpbusd_epi32(a##i, hi, A5_BCAST(16));                                             \
        if (pair) {                                                                                     \
            c##i = _mm512_dpbusd_epi32(c##i, lo, A5_BCAST(32));                                         \
            c##i = _mm512_dpbusd_epi32(c##i, hi, A5_BCAST(48));                                         \
        }                                                                                               \
    }
#define A5_Q4_END(i)                                                                                    \
    if (mr > i) {                                                                                       \
        const __m512 t = pair ? pair_fold(a##i, c##i) : _mm512_cvtepi32_ps(a##i);                       \
        f##i = _mm512_fmadd_ps(t, _mm512_mul_ps(dw, _mm512_set1_ps(xd[(i) * nb + b])), f##i);           \
        f##i = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[(i) * nb + b]), f##i);                             \
    }
#define A5_Q8_STEP(i)                                                                                   \
    if (mr > i) {                                                                                       \
        const int8_t *xr = xq + (i) * xrow + b * xblk + 4 * j;                                          \
        a##i = _mm512_dpbusd_epi32(a##i, _mm512_xor_si512(A5_BCAST(0), bias), w);                       \
        if (pair) c##i = _mm512_dpbusd_epi32(c##i, _mm512_xor_si512(A5_BCAST(32), bias), w);            \
    }
#define A5_Q8_END(i)                                                                                    \
    if (mr > i) {                                                                                       \
        const __m512i t = _mm512_sub_epi32(a##i, corr);                                                 \
        const __m512 tf = pair ? pair_fold(t, _mm512_sub_epi32(c##i, corr)) : _mm512_cvtepi32_ps(t);    \
        f##i = _mm512_fmadd_ps(tf, _mm512_mul_ps(dw, _mm512_set1_ps(xd[(i) * nb + b])), f##i);          \
    }
#define A5_STORE(i)                                                                                     \
    if (mr > i) _mm512_storeu_ps(y + (i) * ldy, oscale ? _mm512_mul_ps(f##i, _mm512_loadu_ps(oscale)) : f##i);
#define A5_ROWS(M) M(0) M(1) M(2) M(3) M(4) M(5)

/* Step j of a 4-bit block (nib: its 64 bytes of nibbles): the unsigned weights of inputs 4j + i (lo) and 16 + 4j + i
 * (hi); with hbits (Q5F: the block's 64 bytes of high bits) the fifth bit ORed in. Also the AMX path's B tiles. */
T_AVX512 INLINE void q4_unpack_avx512(const uint8_t *nib, const uint8_t *hbits, int j, __m512i *lo, __m512i *hi) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m1 = _mm512_set1_epi8(0x10);
    const __m512i raw = _mm512_loadu_si512((const void *)nib);
    *lo = _mm512_and_si512(raw, m4), *hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
    if (hbits) {
        const __m512i hb = _mm512_srli_epi16(_mm512_loadu_si512((const void *)hbits), 2 * j);
        *lo = _mm512_or_si512(*lo, _mm512_and_si512(_mm512_slli_epi16(hb, 4), m1));
        *hi = _mm512_or_si512(*hi, _mm512_and_si512(_mm512_slli_epi16(hb, 3), m1));
    }
}

/* A 4-bit block's d_w and m_w of 16 outputs: f32s 0 (Q4: fp16 at blk, blk + 32), 1 and 2 (Q4F, Q5F: float32 at blk,
 * blk + 64) or 3 (Q4K: d * sc and -(dmin * mn) from the block's 6-bit sc, mn and the super-block's fp16 d, dmin at
 * sb; exact, Q4F's floats). Shared by the VNNI and AMX tiles. */
T_AVX512 INLINE void q4_scales_avx512(const int f32s, const uint8_t *blk, const uint8_t *sb, __m512 *dw, __m512 *mw) {
    if (f32s == 3) {
        *dw = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sb)),
                            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)blk))));
        const __m512 m = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + 32))),
                                       _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16)))));
        *mw = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(m), _mm512_set1_epi32((int)0x80000000u)));
    } else if (f32s) {
        *dw = _mm512_loadu_ps((const void *)blk), *mw = _mm512_loadu_ps((const void *)(blk + 64));
    } else {
        *dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        *mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
    }
}

/* RES a1 + a2 in float for the epilogues: a1, a2 below 2^24 convert exactly and the FMA rounds the exact
 * RES a1 + a2 once, as converting that integer would (the same bits as the int32 sum, without vpmulld). */
T_AVX512 INLINE __m512 pair_fold(__m512i a1, __m512i a2) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), _mm512_set1_ps((float)RES), _mm512_cvtepi32_ps(a2));
}

T_AVX512 INLINE void q4_avx512_tile(const uint8_t *wg, int64_t nb, const int8_t *xq, const float *xd,
                                    const float *xs, int64_t K, float *y, int64_t ldy, const float *oscale,
                                    const int mr, const int f32s, const int pair) {
    const int bb = f32s == 3 ? Q4K_SUPER / 8 : f32s == 2 ? Q5F_BLOCK : f32s ? Q4F_BLOCK : Q4_BLOCK;
    const int qo = f32s == 3 ? 32 : f32s ? 128 : 64;
    const int64_t xrow = pair ? 2 * K : K, xblk = pair ? 2 * QK : QK;
    A5_ROWS(A5_ZERO_F)
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = f32s == 3 ? q4k_block(wg, b) : wg + b * bb;
        PREFETCH(wg + b * bb, bb) /* Q4K: the stream at its average stride, headers included */
        A5_ROWS(A5_ZERO_A)
        _Pragma("GCC unroll 1") for (int j = 0; j < 4; j++) {
            __m512i lo, hi;
            q4_unpack_avx512(blk + qo + j * 64, f32s == 2 ? blk + 384 : NULL, j, &lo, &hi);
            A5_ROWS(A5_Q4_STEP)
        }
        __m512 dw, mw;
        q4_scales_avx512(f32s, blk, f32s == 3 ? q4k_super(wg, b) : NULL, &dw, &mw);
        A5_ROWS(A5_Q4_END)
    }
    A5_ROWS(A5_STORE)
}

T_AVX512 INLINE void q8_avx512_tile(const uint8_t *wg, int64_t nb, const int8_t *xq, const float *xd,
                                    const float *xs, int64_t K, float *y, int64_t ldy, const float *oscale,
                                    const int mr, const int f32s, const int pair) {
    (void)xs, (void)f32s;
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    const int64_t xrow = pair ? 2 * K : K, xblk = pair ? 2 * QK : QK;
    A5_ROWS(A5_ZERO_F)
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * Q8_BLOCK;
        PREFETCH(blk, Q8_BLOCK)
        __m512i corr = _mm512_setzero_si512(); /* 128 * sum_k q_w, per output */
        A5_ROWS(A5_ZERO_A)
        _Pragma("GCC unroll 1") for (int j = 0; j < 8; j++) {
            __m512i w = _mm512_loadu_si512((const void *)(blk + 32 + j * 64));
            corr = _mm512_dpbusd_epi32(corr, bias, w);
            A5_ROWS(A5_Q8_STEP)
        }
        __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        A5_ROWS(A5_Q8_END)
    }
    A5_ROWS(A5_STORE)
}

/* Step j of a Q6 block (16 outputs): the signed weights of inputs 4j + i (lo) and 16 + 4j + i (hi); also the AMX
 * path's B tiles. */
T_AVX512 INLINE void q6_unpack_avx512(const uint8_t *blk, int j, __m512i *lo, __m512i *hi) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30), off = _mm512_set1_epi8(32);
    const __m512i raw = _mm512_loadu_si512((const void *)(blk + 64 + j * 64));
    const __m512i hb = _mm512_srli_epi16(_mm512_loadu_si512((const void *)(blk + 320 + (j >> 1) * 64)), 4 * (j & 1));
    *lo = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(raw, m4), _mm512_and_si512(_mm512_slli_epi16(hb, 4), m30)), off);
    *hi = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), m4),
                                          _mm512_and_si512(_mm512_slli_epi16(hb, 2), m30)), off);
}

/* Step j of a Q3K block (16 outputs): as q3k_unpack_avx2; also the AMX path's B tiles. */
T_AVX512 INLINE void q3k_unpack_avx512(const uint8_t *blk, int j, __m512i *lo, __m512i *hi) {
    const __m512i m2 = _mm512_set1_epi8(3), b2 = _mm512_set1_epi8(4);
    const __m512i raw = _mm512_srli_epi16(_mm512_loadu_si512((const void *)(blk + Q3K_QS + (j >> 1) * 64)), 4 * (j & 1));
    const __m512i hb = _mm512_srli_epi16(_mm512_loadu_si512((const void *)(blk + Q3K_QH)), 2 * j);
    *lo = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(raw, m2), _mm512_and_si512(_mm512_slli_epi16(hb, 2), b2)), b2);
    *hi = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 2), m2),
                                          _mm512_and_si512(_mm512_slli_epi16(hb, 1), b2)), b2);
}

/* The float value of a Q6 block's dot products, before d_w d_x: the halves' exact integer sums (lo, hi; q2's in lo2,
 * hi2 with pair) times their sub-block scales, then 254 t1 + t2 in float. Shared by the VNNI and AMX tiles, so the
 * two give the same bits. */
T_AVX512 INLINE __m512 q6_fold(__m512i lo, __m512i hi, __m512i lo2, __m512i hi2, __m512 slo, __m512 shi,
                               const int pair) {
    /* sc_lo lo + sc_hi hi in float: each product and the sum are integers below 2^24, so exact -- the integer sum's
     * bits, without vpmulld (two uops on one port, the epilogue's bottleneck) */
    const __m512 t1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), slo, _mm512_mul_ps(_mm512_cvtepi32_ps(hi), shi));
    if (!pair) return t1;
    const __m512 t2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo2), slo, _mm512_mul_ps(_mm512_cvtepi32_ps(hi2), shi));
    return _mm512_fmadd_ps(t1, _mm512_set1_ps((float)RES), t2);
}

/* The 16 int8 sub-block scales at p as floats. */
T_AVX512 INLINE __m512 q6_scales(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

#define A6_ROWS(M) M(0) M(1) M(2) M(3)
#define A6_ZERO_A(i) __m512i a##i = _mm512_setzero_si512(), e##i = a##i, c##i = a##i, g##i = a##i;
#define A6_STEP(i)                                                                                      \
    if (mr > i) {                                                                                       \
        const int8_t *xr = xq + (i) * xrow + b * xblk + 4 * j;                                          \
        a##i = _mm512_dpbusd_epi32(a##i, _mm512_xor_si512(A5_BCAST(0), bias), wlo);                    \
        e##i = _mm512_dpbusd_epi32(e##i, _mm512_xor_si512(A5_BCAST(16), bias), whi);                   \
        if (pair) {                                                                                     \
            c##i = _mm512_dpbusd_epi32(c##i, _mm512_xor_si512(A5_BCAST(32), bias), wlo);                \
            g##i = _mm512_dpbusd_epi32(g##i, _mm512_xor_si512(A5_BCAST(48), bias), whi);                \
        }                                                                                               \
    }
#define A6_END(i)                                                                                       \
    if (mr > i) {                                                                                       \
        __m512 t = q6_fold(_mm512_sub_epi32(a##i, clo), _mm512_sub_epi32(e##i, chi), _mm512_sub_epi32(c##i, clo), \
                           _mm512_sub_epi32(g##i, chi), slo, shi, pair);                                \
        f##i = _mm512_fmadd_ps(t, _mm512_mul_ps(dw, _mm512_set1_ps(xd[(i) * nb + b])), f##i);           \
    }

T_AVX512 INLINE void q6_avx512_tile(const uint8_t *wg, int64_t nb, const int8_t *xq, const float *xd,
                                    const float *xs, int64_t K, float *y, int64_t ldy, const float *oscale,
                                    const int mr, const int f32s, const int pair) {
    (void)xs;
    const int q3k = f32s, bb = q3k ? Q3K_AVG_BLOCK : Q6_BLOCK; /* f32s 1: Q3K blocks */
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    const int64_t xrow = pair ? 2 * K : K, xblk = pair ? 2 * QK : QK;
    A6_ROWS(A5_ZERO_F)
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = q6_block(wg, b, q3k);
        PREFETCH(wg + b * bb, bb)
        __m512i clo = _mm512_setzero_si512(), chi = clo; /* 128 * sum of each half's weights, per output */
        A6_ROWS(A6_ZERO_A)
        _Pragma("GCC unroll 1") for (int j = 0; j < 4; j++) {
            __m512i wlo, whi;
            if (q3k) q3k_unpack_avx512(blk, j, &wlo, &whi);
            else q6_unpack_avx512(blk, j, &wlo, &whi);
            clo = _mm512_dpbusd_epi32(clo, bias, wlo);
            chi = _mm512_dpbusd_epi32(chi, bias, whi);
            A6_ROWS(A6_STEP)
        }
        const __m512 slo = q6_scales(q6_sc(blk, q3k)), shi = q6_scales(q6_sc(blk, q3k) + G);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)q6_d(wg, b, q3k)));
        A6_ROWS(A6_END)
    }
    A6_ROWS(A5_STORE)
}

/* A format's own group functions over M rows (as group_avx2 / group_avx512 do for the others): fn_avx2 over 8-output
 * halves on MR2-row tiles, fn_avx512 over MR-row tiles (SW: TILE_SWITCH4 / TILE_SWITCH6); no per-output scale. */
#define DEFINE_GROUP_AVX2(fn, tile)                                                                     \
    T_AVX2 static void fn(int pair, const uint8_t *wg, int64_t nb, const int8_t *xq, const float *xd,    \
                          const float *xs, int64_t M, int64_t K, float *y, int64_t ldy) {               \
        const float *oscale = NULL;                                                                     \
        for (int64_t m0 = 0; m0 < M; m0 += MR2) {                                                       \
            int mr = (M - m0) < MR2 ? (int)(M - m0) : MR2;                                              \
            for (int half = 0; half < 2; half++) {                                                      \
                const int8_t *xq_ = xq + m0 * K * (pair ? 2 : 1);                                       \
                const float *xd_ = xd + m0 * nb, *xs_ = xs + m0 * nb;                                   \
                float *y_ = y + m0 * ldy + half * 8;                                                    \
                if (pair) { switch (mr) { TILE_SWITCH4(tile, 0, 1, wg, nb, half, xq_, xd_, xs_, K, y_, ldy, oscale) } } \
                else { switch (mr) { TILE_SWITCH4(tile, 0, 0, wg, nb, half, xq_, xd_, xs_, K, y_, ldy, oscale) } } \
            }                                                                                           \
        }                                                                                               \
    }
#define DEFINE_GROUP_AVX512(fn, tile, MR, SW)                                                           \
    T_AVX512 static void fn(int pair, const uint8_t *wg, int64_t nb, const int8_t *xq, const float *xd,  \
                            const float *xs, int64_t M, int64_t K, float *y, int64_t ldy) {             \
        const float *oscale = NULL;                                                                     \
        for (int64_t m0 = 0; m0 < M; m0 += MR) {                                                        \
            int mr = (M - m0) < MR ? (int)(M - m0) : MR;                                                \
            const int8_t *xq_ = xq + m0 * K * (pair ? 2 : 1);                                           \
            const float *xd_ = xd + m0 * nb, *xs_ = xs + m0 * nb;                                       \
            float *y_ = y + m0 * ldy;                                                                   \
            if (pair) { switch (mr) { SW(tile, 0, 1, wg, nb, xq_, xd_, xs_, K, y_, ldy, oscale) } }      \
            else { switch (mr) { SW(tile, 0, 0, wg, nb, xq_, xd_, xs_, K, y_, ldy, oscale) } }           \
        }                                                                                               \
    }

#include "qgemm_q2k.h"

T_AVX512 static void group_avx512(int fmt, int pair, const uint8_t *wg, int64_t nb, const int8_t *xq,
                                  const float *xd, const float *xs, int64_t M, int64_t K, float *y, int64_t ldy,
                                  const float *oscale) {
    if (fmt == FMT_Q2K) { /* its own tiles (qgemm_q2k.h) */
        q2k_group_avx512(pair, wg, nb, xq, xd, xs, M, K, y, ldy);
        return;
    }
    const int64_t mr_max = fmt == FMT_Q6 || fmt == FMT_Q3K ? MR6 : MR5;
    for (int64_t m0 = 0; m0 < M; m0 += mr_max) {
        int mr = (M - m0) < mr_max ? (int)(M - m0) : (int)mr_max;
        const int8_t *xq_ = xq + m0 * K * (pair ? 2 : 1);
        const float *xd_ = xd + m0 * nb, *xs_ = xs + m0 * nb;
        float *y_ = y + m0 * ldy;
        if (fmt == FMT_Q6) {
            if (pair) { switch (mr) { TILE_SWITCH4(q6_avx512_tile, 0, 1, wg, nb, xq_, xd_, xs_, K, y_, ldy, oscale) } }
            else { switch (mr) { TILE_SWITCH4(q6_avx512_tile, 0, 0, wg, nb, xq_, xd_, xs_, K, y_, ldy, oscale) } }
        } else if (fmt == FMT_Q3K) {
            if (pair) { switch (mr) { TILE_SWITCH4(q6_avx512_tile, 1, 1, wg, nb, xq_, xd_, xs_, K, y_, ldy, oscale) } }
            else { switch (mr) { TILE_SWITCH4(q6_avx512_tile, 1, 0, wg, nb, xq_, xd_, xs_, K, y_, ldy, oscale) } }
        } else {
            TILE_DISPATCH(TILE_SWITCH6, q4_avx512_tile, q8_avx512_tile, wg, nb, xq_, xd_, xs_, K, y_, ldy, oscale)
        }
    }
}

/* Inside a parallel region: this thread's contiguous share [g0, g1) of `groups` output groups (a static schedule,
 * so the same groups go to the same thread on every row chunk and no barrier is needed); empty for spare threads. */
static void thread_groups(int64_t groups, int64_t *g0, int64_t *g1) {
    const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num(), per = (groups + nth - 1) / nth;
    *g0 = tid * per < groups ? tid * per : groups;
    *g1 = *g0 + per < groups ? *g0 + per : groups;
}

/* Rows per pass over the weights for rows of xrow activation bytes: a multiple of 16 (the AMX tile) holding about
 * CHUNK_BYTES of activations, so they stay in L2 while every group of the thread's share passes over them (the
 * weights are read once per chunk, the activations once per group, from L2). A row's bits do not depend on its
 * chunk or tile. */
static int64_t rows_per_chunk(int64_t xrow) {
    const int64_t r = CHUNK_BYTES / xrow / 16 * 16;
    return r < 16 ? 16 : r;
}

/* Bytes of one packed block (16 outputs x 32 inputs) of fmt; 0 for an unknown fmt. */
static int64_t block_bytes(int fmt) {
    switch (fmt) {
    case FMT_Q4: return Q4_BLOCK;
    case FMT_Q8: return Q8_BLOCK;
    case FMT_Q4F: return Q4F_BLOCK;
    case FMT_Q6: return Q6_BLOCK;
    case FMT_Q5F: return Q5F_BLOCK;
    case FMT_Q4K: return Q4K_AVG_BLOCK; /* per block on average: the group stride is nb * this */
    case FMT_MX4: return MX4_BLOCK;
    case FMT_Q2K: return Q2K_AVG_BLOCK; /* as FMT_Q4K */
    case FMT_Q3K: return Q3K_AVG_BLOCK;
    default: return 0;
    }
}

/* K must be a multiple of this for fmt: a super-block layout's 256 inputs, else one block. */
static int64_t k_multiple(int fmt) { return fmt == FMT_Q4K || fmt == FMT_Q2K || fmt == FMT_Q3K ? 8 * QK : QK; }

#include "qgemm_amx.h"
#include "qgemm_amx_bf16.h"
#include "qgemm_mx4.h"

/* One group's Q4K blocks (nb of them) rewritten as Q4F blocks at out (nb * Q4F_BLOCK bytes): d * sc and -(dmin * mn)
 * as float32 (the floats the Q4K tiles form), the nibbles copied. For many rows the tiles then read ready scales
 * instead of forming them once per row tile: the same bits, the scale work done once per group and call. */
T_AVX2 static void q4k_group_to_q4f(const uint8_t *wg, int64_t nb, uint8_t *out) {
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = q4k_block(wg, b);
        uint8_t *o = out + b * Q4F_BLOCK;
        for (int h = 0; h < 2; h++) {
            __m256 d, m;
            q4k_scales_avx2(blk, q4k_super(wg, b), h, &d, &m);
            _mm256_store_ps((float *)o + 8 * h, d);
            _mm256_store_ps((float *)(o + 64) + 8 * h, m);
        }
        for (int c = 0; c < 256; c += 32)
            _mm256_store_si256((__m256i *)(o + 128 + c), _mm256_loadu_si256((const __m256i *)(blk + 32 + c)));
    }
}

/* Inside a parallel region, called by every thread (no barrier: each thread's share of the groups is a static
 * schedule, `nowait`): y[M, N] = the quantized rows xq / xd / xs (quantize_row_avx2) times W^T, as kvserve_qgemm
 * describes -- AMX for M >= AMX_ROWS on that path, else the VNNI or AVX2 tiles; a row's bits do not depend on M.
 * Returns 0, or 1 when this thread could not get its MX4 expansion buffer. */
static int qgemm_share(int fmt, int isa, int pair, const uint8_t *w, int64_t nb, int64_t groups, const int8_t *xq,
                       const float *xd, const float *xs, int64_t M, int64_t K, float *y, int64_t ldy,
                       const float *oscale) {
    const int64_t bb = block_bytes(fmt), xrow = pair ? 2 * K : K;
    if (isa == ISA_AMX_INT8 && M >= AMX_ROWS) { /* fewer rows: all of them on the VNNI tiles */
        if (fmt == FMT_MX4) /* its groups expanded to Q8 blocks first (qgemm_mx4.h) */
            return amx_rows_mx4(pair, w, nb, groups, xq, xd, xs, M, K, y, ldy) ? 1 : 0;
        amx_rows(fmt, pair, w, nb, groups, xq, xd, xs, M, K, y, ldy, oscale);
        return 0;
    }
    /* Q4K over more than Q4K_EXPAND_TILES row tiles: each group first as Q4F blocks (q4k_group_to_q4f) */
    const int avx512 = isa == ISA_AVX512_VNNI || isa == ISA_AMX_INT8;
    uint8_t *q4f = fmt == FMT_Q4K && M > Q4K_EXPAND_TILES * (avx512 ? MR5 : MR2)
                       ? aligned_alloc(64, (size_t)(nb * Q4F_BLOCK)) : NULL;
    const int64_t mc = rows_per_chunk(xrow);
    for (int64_t c0 = 0; c0 < M; c0 += mc) { /* the same groups to each thread every chunk: no barrier */
        const int64_t rows = M - c0 < mc ? M - c0 : mc;
        const int8_t *xq_ = xq + c0 * xrow;
        const float *xd_ = xd + c0 * nb, *xs_ = xs + c0 * nb;
#pragma omp for schedule(static) nowait
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *wg = w + g * nb * bb;
            const float *os = oscale ? oscale + g * G : NULL;
            float *yg = y + c0 * ldy + g * G;
            int f = fmt;
            if (q4f) q4k_group_to_q4f(wg, nb, q4f), wg = q4f, f = FMT_Q4F;
            if (fmt == FMT_MX4) /* its own tiles (qgemm_mx4.h) */
                avx512 ? mx4_group_avx512(pair, wg, nb, xq_, xd_, xs_, rows, K, yg, ldy)
                       : mx4_group_avx2(pair, wg, nb, xq_, xd_, xs_, rows, K, yg, ldy);
            else if (avx512)
                group_avx512(f, pair, wg, nb, xq_, xd_, xs_, rows, K, yg, ldy, os);
            else if (fmt == FMT_Q2K)
                q2k_group_avx2(pair, wg, nb, xq_, xd_, xs_, rows, K, yg, ldy);
            else
                group_avx2(f, pair, wg, nb, xq_, xd_, xs_, rows, K, yg, ldy, os);
        }
    }
    free(q4f);
    return 0;
}

/* ---- entry points ---- */

/* 1 if this CPU can run `isa`, else 0 (CPUID through the compiler's runtime). */
int kvserve_q_isa_supported(int isa) {
    __builtin_cpu_init();
    if (isa == ISA_AVX2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
#ifdef KVSERVE_Q_EMULATE_AVX512
    if (isa == ISA_AVX512_VNNI) return 1;
#endif
#ifdef KVSERVE_Q_EMULATE_AMX
    if (isa == ISA_AMX_INT8) return 1;
#endif
    const int vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                     __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    if (isa == ISA_AVX512_VNNI) return vnni ? 1 : 0;
    if (isa == ISA_AMX_INT8) return vnni && amx_usable() ? 1 : 0; /* its row tails run on the VNNI tiles */
    return 0;
}

/* 1 if activations `act` can run on path `isa` here: ACT_BF16 needs the AMX path and AMX-BF16; the others run on
 * every supported path. */
int kvserve_q_act_supported(int isa, int act) {
    if (!kvserve_q_isa_supported(isa)) return 0;
    if (act == ACT_BF16) return isa == ISA_AMX_INT8 && amx_bf16_usable();
    return act == ACT_INT8 || act == ACT_PAIR;
}

/* y[M, N] (row stride ldy >= N) = x[M, K] . W^T, W packed as described at the top (fmt FMT_Q4, FMT_Q4F, FMT_Q5F, FMT_Q8, FMT_Q6,
 * FMT_Q4K, FMT_MX4, FMT_Q2K or FMT_Q3K, N a multiple of 16, K of 32 (FMT_Q4K, FMT_Q2K, FMT_Q3K: of 256)), activations quantized as `act` (ACT_INT8 or ACT_PAIR; ACT_BF16: rounded to bfloat16, qgemm_amx_bf16.h, on the AMX path only). oscale: NULL, or N floats
 * multiplied into the outputs (per-channel int8). Returns 0, or -1 for bad arguments / an unsupported isa, -2 when
 * scratch memory could not be allocated (nothing written). */
int kvserve_qgemm(int fmt, int isa, int act, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                  const float *oscale, float *y, int64_t ldy) {
    if (!block_bytes(fmt) || !kvserve_q_act_supported(isa, act) || K % k_multiple(fmt) || N % G || M < 0 || ldy < N)
        return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t nb = K / QK, groups = N / G;
    if (act == ACT_BF16) { /* a format without a bf16 decoder: its int8 tiles, for every M */
        if (bf16_format(fmt)) return qgemm_bf16(fmt, x, M, K, w, nb, groups, oscale, y, ldy);
        act = ACT_INT8;
    }
    const int pair = act == ACT_PAIR;
    const int64_t xrow = pair ? 2 * K : K; /* bytes of one row's quantized activations */
    /* Scratch for the quantized activations: on the stack for small inputs (decode steps), else the heap. */
    _Alignas(64) int8_t sq[STACK_BYTES];
    float sd[STACK_BYTES / QK], ss[STACK_BYTES / QK];
    const int on_stack = M * xrow <= STACK_BYTES;
    int8_t *xq = on_stack ? sq : malloc((size_t)(M * xrow));
    float *xd = on_stack ? sd : malloc(sizeof(float) * (size_t)(M * nb));
    float *xs = on_stack ? ss : malloc(sizeof(float) * (size_t)(M * nb));
    if (!xq || !xd || !xs) {
        if (!on_stack) { free(xq); free(xd); free(xs); }
        return -2;
    }
    /* Each OpenMP barrier costs a thread wake-up, so small inputs are quantized before the parallel region by
     * this thread alone, and tiny products run without one. */
    const int serial_quant = M * K <= SERIAL_QUANT;
    if (serial_quant)
        for (int64_t m = 0; m < M; m++) quantize_row_avx2(x + m * K, K, xq + m * xrow, xd + m * nb, xs + m * nb, pair);
    int failed = 0; /* a thread could not get its MX4 expansion buffer */
#pragma omp parallel if (M * N * K >= SERIAL_MACS)
    {
        if (!serial_quant) {
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++)
                quantize_row_avx2(x + m * K, K, xq + m * xrow, xd + m * nb, xs + m * nb, pair);
        }
        if (qgemm_share(fmt, isa, pair, w, nb, groups, xq, xd, xs, M, K, y, ldy, oscale))
            __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
    }
    if (!on_stack) { free(xq); free(xd); free(xs); }
    return failed ? -2 : 0;
}

/* out[t, K] = row rows[t] of a packed weight (fmt, K as for kvserve_qgemm), decoded to float32 as
 * kvserve/quant/pack.py's unpackers do: d q + m (FMT_Q4, FMT_Q4F, FMT_Q5F, FMT_Q4K), d q times oscale[row] when
 * given (FMT_Q8), (d sc) (q - 32) (FMT_Q6), kvalues[code] 2^(e - 128) (FMT_MX4), (d sc) q - dmin mn (FMT_Q2K), (d sc) (q - 4) (FMT_Q3K), each product and sum rounded on
 * its own (no fused multiply-add), so the bits equal numpy's. An embedding lookup from a tied LM head. Returns 0;
 * -1 for a bad fmt or K, -2 for a row outside [0, N) (nothing written). */
T_AVX2 __attribute__((optimize("fp-contract=off"))) int kvserve_q_unpack_rows(int fmt, const uint8_t *w, int64_t N,
                                                                              int64_t K, const float *oscale,
                                                                              const int64_t *rows, int64_t T,
                                                                              float *out) {
    if (!block_bytes(fmt) || K <= 0 || K % k_multiple(fmt)) return -1;
    for (int64_t t = 0; t < T; t++)
        if (rows[t] < 0 || rows[t] >= N) return -2;
    const int64_t nb = K / QK, bb = block_bytes(fmt);
    for (int64_t t = 0; t < T; t++) {
        const int64_t r = rows[t], g = r / G, o = r % G;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = fmt == FMT_Q4K   ? q4k_block(w, g * nb + b)
                                 : fmt == FMT_Q2K ? q2k_block(w, g * nb + b)
                                 : fmt == FMT_Q3K ? q6_block(w, g * nb + b, 1)
                                                  : w + (g * nb + b) * bb;
            float *y = out + t * K + b * QK;
            if (fmt == FMT_Q8) {
                const float d = _cvtsh_ss(((const uint16_t *)(blk + Q8_D))[o]);
                const int8_t *q = (const int8_t *)(blk + Q8_QS);
                for (int j = 0; j < 8; j++)
                    for (int i = 0; i < 4; i++) {
                        float v = (float)q[j * 64 + o * 4 + i] * d;
                        y[j * 4 + i] = oscale ? v * oscale[r] : v;
                    }
            } else if (fmt == FMT_MX4) { /* kvalues[code] * 2^(e - 128), as gguf's MXFP4 dequantize */
                const float d = ldexpf(1.0f, (int)blk[MX4_E + o] - 128);
                for (int j = 0; j < 4; j++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t byte = blk[MX4_QS + j * 64 + o * 4 + i];
                        y[j * 4 + i] = d * (float)MX4_KVALUES[byte & 0x0F];
                        y[16 + j * 4 + i] = d * (float)MX4_KVALUES[byte >> 4];
                    }
            } else if (fmt == FMT_Q2K) { /* (d sc) q - dmin mn per 16 inputs, as formats.q2_k_values */
                const uint8_t *sb = q2k_super(w, g * nb + b);
                const float d = _cvtsh_ss(((const uint16_t *)(sb + Q2K_SB_D))[o]);
                const float dmin = _cvtsh_ss(((const uint16_t *)(sb + Q2K_SB_DMIN))[o]);
                const uint8_t s0 = blk[Q2K_SCMN + o], s1 = blk[Q2K_SCMN + G + o];
                const float dl0 = d * (float)(s0 & 0x0F), ml0 = dmin * (float)(s0 >> 4);
                const float dl1 = d * (float)(s1 & 0x0F), ml1 = dmin * (float)(s1 >> 4);
                for (int j = 0; j < 4; j++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t h = blk[Q2K_QS + (j >> 1) * 64 + o * 4 + i] >> (4 * (j & 1));
                        y[j * 4 + i] = dl0 * (float)(h & 3) - ml0;
                        y[16 + j * 4 + i] = dl1 * (float)((h >> 2) & 3) - ml1;
                    }
            } else if (fmt == FMT_Q3K) { /* (d sc) (q - 4), as formats.dequantize */
                const float d = _cvtsh_ss(((const uint16_t *)q6_d(w, g * nb + b, 1))[o]);
                const float dlo = d * (float)((const int8_t *)blk)[Q3K_SC + o];
                const float dhi = d * (float)((const int8_t *)blk)[Q3K_SC + G + o];
                for (int j = 0; j < 4; j++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t q = blk[Q3K_QS + (j >> 1) * 64 + o * 4 + i] >> (4 * (j & 1));
                        const uint8_t h = blk[Q3K_QH + o * 4 + i] >> (2 * j);
                        y[j * 4 + i] = dlo * (float)(((q & 3) | ((h & 1) << 2)) - 4);
                        y[16 + j * 4 + i] = dhi * (float)((((q >> 2) & 3) | ((h & 2) << 1)) - 4);
                    }
            } else if (fmt == FMT_Q6) { /* (d sc) (q - 32), as formats.dequantize */
                const float d = _cvtsh_ss(((const uint16_t *)(blk + Q6_D))[o]);
                const float dlo = d * (float)((const int8_t *)blk)[Q6_SC_LO + o];
                const float dhi = d * (float)((const int8_t *)blk)[Q6_SC_HI + o];
                for (int j = 0; j < 4; j++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t byte = blk[Q6_QL + j * 64 + o * 4 + i];
                        const uint8_t h = blk[Q6_QH + (j >> 1) * 64 + o * 4 + i] >> (4 * (j & 1));
                        y[j * 4 + i] = dlo * (float)(((byte & 0x0F) | ((h & 3) << 4)) - 32);
                        y[16 + j * 4 + i] = dhi * (float)(((byte >> 4) | (((h >> 2) & 3) << 4)) - 32);
                    }
            } else {
                const int f32 = fmt == FMT_Q4F || fmt == FMT_Q5F; /* Q5F's d, m, nibbles where Q4F's are */
                float d = f32 ? ((const float *)(blk + Q4F_D))[o] : _cvtsh_ss(((const uint16_t *)(blk + Q4_D))[o]);
                float m = f32 ? ((const float *)(blk + Q4F_M))[o] : _cvtsh_ss(((const uint16_t *)(blk + Q4_M))[o]);
                const uint8_t *nib = blk + (f32 ? Q4F_QS : Q4_QS);
                if (fmt == FMT_Q4K) { /* d * sc, -(dmin * mn), as formats.decode_q4_k */
                    const uint8_t *sb = q4k_super(w, g * nb + b);
                    d = _cvtsh_ss(((const uint16_t *)(sb + Q4K_SB_D))[o]) * (float)blk[Q4K_SC + o];
                    m = -(_cvtsh_ss(((const uint16_t *)(sb + Q4K_SB_DMIN))[o]) * (float)blk[Q4K_MN + o]);
                    nib = blk + Q4K_QS;
                }
                for (int j = 0; j < 4; j++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t byte = nib[j * 64 + o * 4 + i];
                        const uint8_t h = fmt == FMT_Q5F ? (uint8_t)(blk[Q5F_QH + o * 4 + i] >> (2 * j)) : 0;
                        y[j * 4 + i] = d * (float)((byte & 0x0F) | ((h & 1) << 4)) + m;
                        y[16 + j * 4 + i] = d * (float)((byte >> 4) | ((h & 2) << 3)) + m;
                    }
            }
        }
    }
    return 0;
}

/* Layout constants as compiled, so Python and C cannot disagree: KVSERVE_Q_LAYOUT_N values (qgemm_layouts.h, in
 * kvserve.quant.layouts.c_constants' order) to out, which must hold kvserve_q_layout_n() of them. */
int64_t kvserve_q_layout_n(void) { return KVSERVE_Q_LAYOUT_N; }
void kvserve_q_layout(int64_t *out) {
    static const int64_t v[KVSERVE_Q_LAYOUT_N] = KVSERVE_Q_LAYOUT;
    memcpy(out, v, sizeof v);
}

#include "qgemm_moe.h"
