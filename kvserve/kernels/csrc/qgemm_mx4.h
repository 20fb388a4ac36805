/* MXFP4 weights (OCP Microscaling v1.0: 32 E2M1 values sharing one E8M0 exponent; GGUF type MXFP4, gpt-oss's expert
 * weights) on the int8 kernels (included by qgemm.c). Twice an E2M1 value is a small integer: kvalues below, as
 * llama.cpp's kvalues_mxfp4; so w = kvalues[code] * 2^(e - 128), an int8 weight times a power of two, and the Q8
 * kernels' integer dot products are exact for it.
 *
 * The MX4 layout (qgemm_layouts.h) keeps the file's 4.25 bits a weight: per block of 16 outputs x 32 inputs, the
 * outputs' exponents e[16] (uint8, E8M0), then 256 bytes of 4-bit codes ordered as the Q4 block's nibbles. The AVX2
 * and AVX-512 VNNI tiles read it directly (mx4_avx2_tile, mx4_avx512_tile: one table shuffle per 32 weights into the
 * Q8 tiles' steps); the AMX path expands its share of the groups into Q8 blocks once per call (mx4_group_to_q8,
 * amx_rows_mx4: d = 2^(e - 128) as a float16 power of two, which pack.pack_mx4 checks is representable) and runs
 * the Q8 tiles. Both give the Q8 path's bits for the same values.
 */

static const int8_t MX4_KVALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* float16 bits of 2^(e - 128) for e in [104, 143] (subnormal below 114); pack_mx4 keeps e in that range. */
static inline uint16_t mx4_d_fp16(uint8_t e) {
    return e >= 114 ? (uint16_t)((e - 113) << 10) : e >= 104 ? (uint16_t)(1u << (e - 104)) : 0;
}

/* One group's nb MX4 blocks at wg as nb Q8 blocks at out (32-byte aligned): d[o] = 2^(e[o] - 128) in float16, and
 * the codes of step j (inputs 4j + i, low nibbles) and 4 + j (inputs 16 + 4j + i, high) through the value table. */
T_AVX2 static void mx4_group_to_q8(const uint8_t *wg, int64_t nb, uint8_t *out) {
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MX4_KVALUES));
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * MX4_BLOCK;
        uint8_t *o = out + b * Q8_BLOCK;
        for (int i = 0; i < G; i++) ((uint16_t *)(o + Q8_D))[i] = mx4_d_fp16(blk[MX4_E + i]);
        for (int j = 0; j < 4; j++)
            for (int h = 0; h < 2; h++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + MX4_QS + j * 64 + h * 32));
                const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(raw, m4));
                const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4));
                _mm256_store_si256((__m256i *)(o + Q8_QS + j * 64 + h * 32), lo);
                _mm256_store_si256((__m256i *)(o + Q8_QS + (4 + j) * 64 + h * 32), hi);
            }
    }
}

/* The tiles read MX4 blocks directly (no expansion): each step's codes through the value table into the signed int8
 * weights the Q8 tiles load, with the Q8 tiles' step and epilogue macros, and d = 2^(e - 128) formed as a float
 * ((e - 1) << 23, e in [104, 143]): the same float as the expanded block's float16 d, the same exact integer sums,
 * so the same bits as the Q8 path on the expanded blocks (which the AMX path runs). Step jj's low nibbles are Q8 step
 * jj (inputs 4 jj + i), its high nibbles Q8 step 4 + jj (inputs 16 + 4 jj + i). */
T_AVX512 INLINE void mx4_avx512_tile(const uint8_t *wg, int64_t nb, const int8_t *xq, const float *xd,
                                     const float *xs, int64_t K, float *y, int64_t ldy, const float *oscale,
                                     const int mr, const int f32s, const int pair) {
    (void)xs, (void)f32s;
    const __m512i bias = _mm512_set1_epi8((char)0x80), m4 = _mm512_set1_epi8(0x0F);
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)MX4_KVALUES));
    const int64_t xrow = pair ? 2 * K : K, xblk = pair ? 2 * QK : QK;
    A5_ROWS(A5_ZERO_F)
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * MX4_BLOCK;
        PREFETCH(blk, MX4_BLOCK)
        __m512i corr = _mm512_setzero_si512(); /* 128 * sum_k q_w, per output */
        A5_ROWS(A5_ZERO_A)
        _Pragma("GCC unroll 1") for (int jj = 0; jj < 4; jj++) {
            const __m512i raw = _mm512_loadu_si512((const void *)(blk + MX4_QS + jj * 64));
            {
                const int j = jj;
                const __m512i w = _mm512_shuffle_epi8(lut, _mm512_and_si512(raw, m4));
                corr = _mm512_dpbusd_epi32(corr, bias, w);
                A5_ROWS(A5_Q8_STEP)
            }
            {
                const int j = jj + 4;
                const __m512i w = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4));
                corr = _mm512_dpbusd_epi32(corr, bias, w);
                A5_ROWS(A5_Q8_STEP)
            }
        }
        const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + MX4_E)));
        const __m512 dw = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23));
        A5_ROWS(A5_Q8_END)
    }
    A5_ROWS(A5_STORE)
}

T_AVX2 INLINE void mx4_avx2_tile(const uint8_t *wg, int64_t nb, int half, const int8_t *xq, const float *xd,
                                 const float *xs, int64_t K, float *y, int64_t ldy, const float *oscale, const int mr,
                                 const int f32s, const int pair) {
    (void)xs, (void)f32s;
    const __m256i ones = _mm256_set1_epi16(1), res16 = _mm256_set1_epi16(RES), m4 = _mm256_set1_epi8(0x0F);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MX4_KVALUES));
    const int64_t xrow = pair ? 2 * K : K, xblk = pair ? 2 * QK : QK;
    A2_ROWS(A2_ZERO_F)
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * MX4_BLOCK;
        if (!half) PREFETCH(blk, MX4_BLOCK)
        A2_ROWS(A2_ZERO_A)
        _Pragma("GCC unroll 1") for (int jj = 0; jj < 4; jj++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + MX4_QS + jj * 64 + half * 32));
            {
                const int j = jj;
                const __m256i w = _mm256_shuffle_epi8(lut, _mm256_and_si256(raw, m4)), aw = _mm256_abs_epi8(w);
                A2_ROWS(A2_Q8_STEP)
            }
            {
                const int j = jj + 4;
                const __m256i w = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4));
                const __m256i aw = _mm256_abs_epi8(w);
                A2_ROWS(A2_Q8_STEP)
            }
        }
        const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + MX4_E + half * 8)));
        const __m256 dw = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23));
        A2_ROWS(A2_Q8_END)
    }
    A2_ROWS(A2_STORE)
}

/* One MX4 group over M rows on the VNNI (avx512) or AVX2 tiles, as group_avx512 / group_avx2 do for the others. */
DEFINE_GROUP_AVX2(mx4_group_avx2, mx4_avx2_tile)
DEFINE_GROUP_AVX512(mx4_group_avx512, mx4_avx512_tile, MR5, TILE_SWITCH6)

/* The AMX path for MX4 (inside kvserve_qgemm's parallel region, every thread): as amx_rows, with this thread's
 * contiguous share of the groups expanded to Q8 blocks once per call (mx4_group_to_q8), then the Q8 tiles over them:
 * the bits of the Q8 path on the same values, so the VNNI path's. Returns 0, or -1 when the expansion buffer could
 * not be allocated (nothing written by this thread). */
T_AMX static int amx_rows_mx4(int pair, const uint8_t *w, int64_t nb, int64_t groups, const int8_t *xq,
                              const float *xd, const float *xs, int64_t M, int64_t K, float *y, int64_t ldy) {
    const int64_t xrow = pair ? 2 * K : K;
    int64_t g0, g1;
    thread_groups(groups, &g0, &g1);
    if (g0 >= g1) return 0;
    const int64_t gb = nb * Q8_BLOCK; /* bytes of one expanded group (a multiple of 32) */
    uint8_t *q8 = aligned_alloc(64, (size_t)(((g1 - g0) * gb + 63) / 64 * 64));
    if (!q8) return -1;
    for (int64_t g = g0; g < g1; g++) mx4_group_to_q8(w + g * nb * MX4_BLOCK, nb, q8 + (g - g0) * gb);
    amx_configure(FMT_Q8);
    const int64_t chunk = rows_per_chunk(xrow);
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {
        const int64_t mc = M - c0 < chunk ? M - c0 : chunk;
        for (int64_t g = g0; g < g1; g++)
            group_amx(FMT_Q8, pair, q8 + (g - g0) * gb, nb, xq + c0 * xrow, xd + c0 * nb, xs + c0 * nb, mc, K,
                      y + c0 * ldy + g * G, ldy, NULL, NULL, 1);
    }
    amx_release();
    free(q8);
    return 0;
}
