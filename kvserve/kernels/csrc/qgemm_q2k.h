/* GGUF Q2_K weights in their own bits (included by qgemm.c): w = (d sc) q - dmin mn, q in 0..3, 4-bit sc and mn per
 * 16 inputs, float16 d and dmin per 256 (llama.cpp ggml-common.h block_q2_K; ggml-quants.c dequantize_row_q2_K).
 *
 * The Q2K layout (qgemm_layouts.h) keeps the file's 2.625 bits a weight: per group of 16 outputs, super-blocks of 8
 * blocks (256 inputs, Q2K_SUPER bytes): fp16 d[16], fp16 dmin[16], then 8 blocks of Q2K_BLOCK bytes: uint8
 * scmn[2][16] (sc | mn << 4 of each output's two 16-input halves), then 128 bytes of 2-bit values ordered as the Q6
 * block's high fields (byte (j >> 1) * 64 + o * 4 + i holds input 4j + i at bit 4 (j & 1) and input 16 + 4j + i at
 * bit 4 (j & 1) + 2).
 *
 * A block's dot product with one row of int8 activations q_x (scale d_x) is, exactly in integers,
 *     sum_k w_k x_k = d_x (d (sc_lo S_lo + sc_hi S_hi) - dmin T),   S_h = sum_{k in half h} q_k q_x,k,
 *                                                                   T = sum_k mn_k q_x,k
 * (mn_k: the min of input k's half). The tiles take the values (0..3) and the mins (0..15, each output's repeated
 * over its 4 bytes) as the unsigned operand of the integer dot products, as the 4-bit tiles take their nibbles:
 * |S_h| <= 16 * 3 * 127, |T| <= 32 * 15 * 127, so the AVX2 16-bit sums of one block cannot overflow (at most 4 * 2 *
 * 2 * 15 * 127 = 30480 for T). q2k_fold forms the float epilogue from those integers (with ACT_PAIR: 254 a1 + a2, as
 * the Q6 tiles), shared by the VNNI and AMX tiles, so the two paths give the same bits.
 */

/* Block i of a run of whole Q2K super-blocks at w, and its super-block's d[16], dmin[16]. */
static inline const uint8_t *q2k_block(const uint8_t *w, int64_t i) {
    return w + (i >> 3) * Q2K_SUPER + Q2K_SB_BLOCKS + (i & 7) * Q2K_BLOCK;
}
static inline const uint8_t *q2k_super(const uint8_t *w, int64_t i) { return w + (i >> 3) * Q2K_SUPER; }

/* ---- AVX2: 8 outputs (half `half` of the group) x MR2 rows ---- */

#define A2Q2_ZERO_A(i)                                                                                  \
    __m256i a##i = _mm256_setzero_si256(), e##i = a##i, m##i = a##i, c##i = a##i, g##i = a##i, n##i = a##i;
/* 16-bit sums: a (half 0: values x q1), e (half 1), m (mins x q1); c, g, n the same for q2 */
#define A2Q2_STEP(i)                                                                                    \
    if (mr > i) {                                                                                       \
        const int8_t *xr = xq + (i) * xrow + b * xblk + 4 * j;                                          \
        __m256i x0 = A2_BCAST(0), x1 = A2_BCAST(16);                                                    \
        a##i = _mm256_add_epi16(a##i, _mm256_maddubs_epi16(lo, x0));                                    \
        e##i = _mm256_add_epi16(e##i, _mm256_maddubs_epi16(hi, x1));                                    \
        m##i = _mm256_add_epi16(m##i, _mm256_add_epi16(_mm256_maddubs_epi16(mlo, x0), _mm256_maddubs_epi16(mhi, x1))); \
        if (pair) {                                                                                     \
            x0 = A2_BCAST(32), x1 = A2_BCAST(48);                                                       \
            c##i = _mm256_add_epi16(c##i, _mm256_maddubs_epi16(lo, x0));                                \
            g##i = _mm256_add_epi16(g##i, _mm256_maddubs_epi16(hi, x1));                                \
            n##i = _mm256_add_epi16(n##i, _mm256_add_epi16(_mm256_maddubs_epi16(mlo, x0), _mm256_maddubs_epi16(mhi, x1))); \
        }                                                                                               \
    }
/* sc_lo S_lo + sc_hi S_hi by madd with the scales as int16 pairs, T by madd with ones (exact int32) */
#define A2Q2_INT(a, e, m, t1, t2)                                                                       \
    const __m256 t1 = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(a, slo), _mm256_madd_epi16(e, shi))); \
    const __m256 t2 = _mm256_cvtepi32_ps(_mm256_madd_epi16(m, ones));
#define A2Q2_END(i)                                                                                     \
    if (mr > i) {                                                                                       \
        A2Q2_INT(a##i, e##i, m##i, s1, u1)                                                              \
        __m256 s = s1, u = u1;                                                                          \
        if (pair) {                                                                                     \
            A2Q2_INT(c##i, g##i, n##i, s2, u2)                                                          \
            s = _mm256_fmadd_ps(s1, _mm256_set1_ps((float)RES), s2);                                    \
            u = _mm256_fmadd_ps(u1, _mm256_set1_ps((float)RES), u2);                                    \
        }                                                                                               \
        f##i = _mm256_fmadd_ps(_mm256_fmadd_ps(s, dw, _mm256_mul_ps(u, mw)), _mm256_set1_ps(xd[(i) * nb + b]), f##i); \
    }

T_AVX2 INLINE void q2k_avx2_tile(const uint8_t *wg, int64_t nb, int half, const int8_t *xq, const float *xd,
                                 const float *xs, int64_t K, float *y, int64_t ldy, const float *oscale, const int mr,
                                 const int f32s, const int pair) {
    (void)xs, (void)f32s;
    const __m256i mask2 = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1), mask4 = _mm256_set1_epi32(0x0F);
    const __m256i rep = _mm256_set1_epi32(0x01010101), lo16 = _mm256_set1_epi32(0xFFFF);
    const int64_t xrow = pair ? 2 * K : K, xblk = pair ? 2 * QK : QK;
    A2_ROWS(A2_ZERO_F)
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = q2k_block(wg, b), *sb = q2k_super(wg, b);
        if (!half) PREFETCH(wg + b * Q2K_AVG_BLOCK, Q2K_AVG_BLOCK) /* the stream at its average stride */
        const __m256i r0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + Q2K_SCMN + half * 8)));
        const __m256i r1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + Q2K_SCMN + 16 + half * 8)));
        const __m256i k0 = _mm256_and_si256(r0, mask4), k1 = _mm256_and_si256(r1, mask4);
        const __m256i slo = _mm256_or_si256(_mm256_and_si256(k0, lo16), _mm256_slli_epi32(k0, 16));
        const __m256i shi = _mm256_or_si256(_mm256_and_si256(k1, lo16), _mm256_slli_epi32(k1, 16));
        const __m256i mlo = _mm256_mullo_epi32(_mm256_srli_epi32(r0, 4), rep);
        const __m256i mhi = _mm256_mullo_epi32(_mm256_srli_epi32(r1, 4), rep);
        A2_ROWS(A2Q2_ZERO_A)
        _Pragma("GCC unroll 1") for (int j = 0; j < 4; j++) {
            const __m256i raw = _mm256_srli_epi16(
                _mm256_loadu_si256((const __m256i *)(blk + Q2K_QS + (j >> 1) * 64 + half * 32)), 4 * (j & 1));
            const __m256i lo = _mm256_and_si256(raw, mask2), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 2), mask2);
            A2_ROWS(A2Q2_STEP)
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + Q2K_SB_D + half * 16)));
        const __m256 mw = _mm256_xor_ps(_mm256_set1_ps(-0.0f),
                                        _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + Q2K_SB_DMIN + half * 16))));
        A2_ROWS(A2Q2_END)
    }
    A2_ROWS(A2_STORE)
}

DEFINE_GROUP_AVX2(q2k_group_avx2, q2k_avx2_tile)

/* ---- AVX-512 VNNI: 16 outputs x MR6 rows (six accumulators a row) ---- */

/* Step j of a Q2K block (16 outputs): the values of inputs 4j + i (lo) and 16 + 4j + i (hi), unsigned bytes; also the
 * AMX path's B tiles. */
T_AVX512 INLINE void q2k_unpack_avx512(const uint8_t *blk, int j, __m512i *lo, __m512i *hi) {
    const __m512i m2 = _mm512_set1_epi8(3);
    const __m512i raw = _mm512_srli_epi16(_mm512_loadu_si512((const void *)(blk + Q2K_QS + (j >> 1) * 64)), 4 * (j & 1));
    *lo = _mm512_and_si512(raw, m2), *hi = _mm512_and_si512(_mm512_srli_epi16(raw, 2), m2);
}

/* A Q2K block's 16 sub-block scales (h = 0: inputs 0..15, 1: 16..31) as floats, and its mins as the unsigned
 * operand of a step (each output's mn in its 4 bytes; also the AMX path's B rows). */
T_AVX512 INLINE __m512 q2k_scales_avx512(const uint8_t *blk, int h) {
    const __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + Q2K_SCMN + h * 16)));
    return _mm512_cvtepi32_ps(_mm512_and_si512(s, _mm512_set1_epi32(0x0F)));
}
T_AVX512 INLINE __m512i q2k_mins_avx512(const uint8_t *blk, int h) {
    const __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + Q2K_SCMN + h * 16)));
    return _mm512_mullo_epi32(_mm512_srli_epi32(s, 4), _mm512_set1_epi32(0x01010101));
}

/* d (sc_lo S_lo + sc_hi S_hi) - dmin T of 16 outputs from the block's integer sums (q1's: slo_, shi_, t; q2's with
 * pair: slo2, shi2, t2), before d_x: q6_fold for the scaled halves, 254 t + t2 for the mins. Shared by the VNNI and
 * AMX tiles (the same bits). */
T_AVX512 INLINE __m512 q2k_fold(__m512i slo_, __m512i shi_, __m512i t, __m512i slo2, __m512i shi2, __m512i t2,
                                __m512 sclo, __m512 schi, __m512 dw, __m512 mw, const int pair) {
    const __m512 s = q6_fold(slo_, shi_, slo2, shi2, sclo, schi, pair);
    const __m512 u = pair ? pair_fold(t, t2) : _mm512_cvtepi32_ps(t);
    return _mm512_fmadd_ps(s, dw, _mm512_mul_ps(u, mw));
}

/* A Q2K block's super-block d and -dmin of 16 outputs. */
T_AVX512 INLINE void q2k_dmin_avx512(const uint8_t *sb, __m512 *dw, __m512 *mw) {
    *dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + Q2K_SB_D)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + Q2K_SB_DMIN)));
    *mw = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(m), _mm512_set1_epi32((int)0x80000000u)));
}

#define A5Q2_ZERO_A(i)                                                                                  \
    __m512i a##i = _mm512_setzero_si512(), e##i = a##i, m##i = a##i, c##i = a##i, g##i = a##i, n##i = a##i;
#define A5Q2_STEP(i)                                                                                    \
    if (mr > i) {                                                                                       \
        const int8_t *xr = xq + (i) * xrow + b * xblk + 4 * j;                                          \
        __m512i x0 = A5_BCAST(0), x1 = A5_BCAST(16);                                                    \
        a##i = _mm512_dpbusd_epi32(a##i, lo, x0);                                                       \
        e##i = _mm512_dpbusd_epi32(e##i, hi, x1);                                                       \
        m##i = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(m##i, mlo, x0), mhi, x1);                        \
        if (pair) {                                                                                     \
            x0 = A5_BCAST(32), x1 = A5_BCAST(48);                                                       \
            c##i = _mm512_dpbusd_epi32(c##i, lo, x0);                                                   \
            g##i = _mm512_dpbusd_epi32(g##i, hi, x1);                                                   \
            n##i = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(n##i, mlo, x0), mhi, x1);                    \
        }                                                                                               \
    }
#define A5Q2_END(i)                                                                                     \
    if (mr > i)                                                                                         \
        f##i = _mm512_fmadd_ps(q2k_fold(a##i, e##i, m##i, c##i, g##i, n##i, sclo, schi, dw, mw, pair),  \
                               _mm512_set1_ps(xd[(i) * nb + b]), f##i);

T_AVX512 INLINE void q2k_avx512_tile(const uint8_t *wg, int64_t nb, const int8_t *xq, const float *xd,
                                     const float *xs, int64_t K, float *y, int64_t ldy, const float *oscale,
                                     const int mr, const int f32s, const int pair) {
    (void)xs, (void)f32s;
    const int64_t xrow = pair ? 2 * K : K, xblk = pair ? 2 * QK : QK;
    A6_ROWS(A5_ZERO_F)
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = q2k_block(wg, b);
        PREFETCH(wg + b * Q2K_AVG_BLOCK, Q2K_AVG_BLOCK)
        const __m512i mlo = q2k_mins_avx512(blk, 0), mhi = q2k_mins_avx512(blk, 1);
        A6_ROWS(A5Q2_ZERO_A)
        _Pragma("GCC unroll 1") for (int j = 0; j < 4; j++) {
            __m512i lo, hi;
            q2k_unpack_avx512(blk, j, &lo, &hi);
            A6_ROWS(A5Q2_STEP)
        }
        const __m512 sclo = q2k_scales_avx512(blk, 0), schi = q2k_scales_avx512(blk, 1);
        __m512 dw, mw;
        q2k_dmin_avx512(q2k_super(wg, b), &dw, &mw);
        A6_ROWS(A5Q2_END)
    }
    A6_ROWS(A5_STORE)
}

DEFINE_GROUP_AVX512(q2k_group_avx512, q2k_avx512_tile, MR6, TILE_SWITCH4)
