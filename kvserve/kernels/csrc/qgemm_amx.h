/* The AMX-INT8 path of kvserve_qgemm (included by qgemm.c): Intel Advanced Matrix Extensions (Sapphire Rapids and
 * later; Intel 64 and IA-32 Architectures Software Developer's Manual, vol. 1, ch. 18 "Intel AMX") multiply 16 rows
 * of activations by 16 outputs of one 32-value weight block in one instruction, where the AVX-512 VNNI tile needs
 * 8-16 `vpdpbusd` per row.
 *
 * Per 16 outputs (one weight group) x 16 rows x one block b of 32 input features:
 *   A tile (16 rows x 32 bytes, row stride xrow): the rows' int8 activations of block b, read in place (q1; with
 *       ACT_PAIR a second A tile holds q2, 32 bytes further on);
 *   B tile (8 rows x 64 bytes): row r holds the 4 weights k = 4r..4r+3 of each of the 16 outputs -- exactly a Q8
 *       block's 512 bytes, read in place; a Q4 group's nibbles are unpacked once per row chunk into that form (the low
 *       nibbles of a block's j-th 64 bytes are row j, the high nibbles row 4 + j: the layout at the top of qgemm.c);
 *       a Q6 group's 6-bit values likewise, as signed int8, each 16-input half (4 rows) its own B tile, since the
 *       halves have their own integer scales (amx_tile_q6);
 *   C tiles (16 x 16 int32): TDPBSUD (signed activations x unsigned 4-bit weights) or TDPBSSD (signed x signed 8-bit)
 *       of A and B: the block's exact integer dot products, one C tile per activation half.
 * The C tiles are stored and the block's epilogue runs in AVX-512 exactly as the VNNI tile's (254 c1 + c2 in int32,
 * then the same float multiply-adds in the same order), so this path's outputs equal the AVX-512 VNNI path's bit
 * for bit: the integer sums are the same, only where they are computed differs. The weight scales are per block, so
 * the float epilogue (three to five vector instructions per row and block, after a 1 KiB tile store) is what bounds
 * the path, not the tile unit; two sets of C tiles alternate between blocks, and each block's epilogue runs two
 * blocks behind its products: block b's products start, block b - 1's C tiles are stored, and block b - 2 (stored a
 * step earlier, so its loads never wait on the tile store) is scaled (4-11% less time a call than scaling right after
 * the store, Q4 and Q8 at 64-512 rows, benchmarks/qgemm_bench.c). Rows pass in chunks of about 1 MiB of activations (rows_per_chunk), each group's B tiles
 * unpacked once per chunk into a buffer that stays in cache; rows past the last full 16 of a call go through the
 * VNNI tiles. Measured in docs/quantization.md ("The kernel").
 *
 * Linux hands a process the tile registers only on request (amx_probe.h); amx_usable() asks. Each thread loads the
 * tile configuration before its first tile instruction of a call and releases the tiles at the end.
 */
#include "amx_probe.h"

#define AMX_ROWS 16  /* rows per AMX tile */

#ifdef KVSERVE_Q_EMULATE_AMX /* tests only: tests/model/qgemm_amx_emu.c supplies the tile operations in C */
#define T_AMX T_AVX512
#else
#define T_AMX __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))
/* gcc 12's _tile_loadconfig declares only 8 bytes of its operand read, so the compiler drops the stores that fill the
 * rest of the configuration; this names the whole struct. */
#define AMX_LOAD_CONFIG(cfg) __asm__ volatile("ldtilecfg %0" ::"m"(cfg))
#endif

/* 1 if the CPU has AMX-TILE and AMX-INT8 and the kernel grants this process the tile data state, else 0; probed
 * once (cached_probe: every kvserve_qgemm call checks its isa). */
#ifndef KVSERVE_Q_EMULATE_AMX
static int amx_probe(void) { return amx_granted(CPUID7_EDX_AMX_TILE | CPUID7_EDX_AMX_INT8); }
#endif

static int amx_usable(void) {
#ifdef KVSERVE_Q_EMULATE_AMX
    return 1;
#else
    static int cached = -1;
    return cached_probe(&cached, amx_probe);
#endif
}

/* Palette 1: tiles 0, 1 the A tiles (q1, q2); 2 the B tile; 4, 5 and 6, 7 the two sets of C tiles (q1, q2). */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Q6 (amx_tile_q6) and Q2K (amx_tile_q2k): tiles 0, 1 the A tiles of a block's two 16-input halves (16 rows x 16 bytes), 2, 3 their B tiles
 * (4 rows x 64 bytes), 4, 5 the halves' C tiles for q1 and 6, 7 for q2. */
T_AMX static void amx_configure(int fmt) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    const int half = fmt == FMT_Q6 || fmt == FMT_Q2K || fmt == FMT_Q3K;
    cfg.rows[0] = cfg.rows[1] = AMX_ROWS, cfg.colsb[0] = cfg.colsb[1] = half ? QK / 2 : QK;
    cfg.rows[2] = half ? QK / 8 : QK / 4, cfg.colsb[2] = 4 * G;
    if (half) cfg.rows[3] = QK / 8, cfg.colsb[3] = 4 * G;
    for (int t = 4; t < 8; t++) cfg.rows[t] = AMX_ROWS, cfg.colsb[t] = 4 * G;
    AMX_LOAD_CONFIG(cfg);
}

T_AMX static void amx_release(void) { _tile_release(); }

/* The B tiles of n consecutive 4-bit blocks (Q4: 320 bytes each, Q4F: 384, Q5F: 448 with the fifth bit, Q4K: in
 * whole super-blocks) unpacked to bq (512 bytes each), by the VNNI tile's q4_unpack_avx512. */
T_AMX static void amx_unpack_q4(const uint8_t *w, int64_t n, int fmt, uint8_t *bq) {
    const int64_t bb = block_bytes(fmt);
    const int qo = fmt == FMT_Q4K ? 32 : fmt == FMT_Q4 ? 64 : 128;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *blk = fmt == FMT_Q4K ? q4k_block(w, i) : w + i * bb;
        for (int j = 0; j < 4; j++) {
            __m512i lo, hi;
            q4_unpack_avx512(blk + qo + j * 64, fmt == FMT_Q5F ? blk + 384 : NULL, j, &lo, &hi);
            _mm512_store_si512((void *)(bq + i * 512 + j * 64), lo);
            _mm512_store_si512((void *)(bq + i * 512 + (4 + j) * 64), hi);
        }
    }
}

/* The B tiles of n consecutive Q6 blocks (448 bytes each; q3k: Q3K blocks, in whole super-blocks) as signed int8
 * (q - 32; Q3K: q - 4) to bq (512 bytes each): the 16-input halves' 4 rows of 64 bytes, lo then hi (q6_unpack_avx512,
 * q3k_unpack_avx512: the VNNI tile's vectors). */
T_AMX static void amx_unpack_q6(const uint8_t *w, int64_t n, int q3k, uint8_t *bq) {
    for (int64_t i = 0; i < n; i++)
        for (int j = 0; j < 4; j++) {
            __m512i lo, hi;
            if (q3k) q3k_unpack_avx512(q6_block(w, i, 1), j, &lo, &hi);
            else q6_unpack_avx512(w + i * Q6_BLOCK, j, &lo, &hi);
            _mm512_store_si512((void *)(bq + i * 512 + j * 64), lo);
            _mm512_store_si512((void *)(bq + i * 512 + 256 + j * 64), hi);
        }
}

/* The B tiles of n consecutive Q2K blocks (whole super-blocks at w) to bq, 1024 bytes each: the values (unsigned,
 * 0..3) of the 16-input halves, 4 rows of 64 bytes each, lo then hi (q2k_unpack_avx512), then each half's mins as 4
 * equal rows (q2k_mins_avx512): the operands of the VNNI tile's steps. */
T_AMX static void amx_unpack_q2k(const uint8_t *w, int64_t n, uint8_t *bq) {
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *blk = q2k_block(w, i);
        const __m512i mlo = q2k_mins_avx512(blk, 0), mhi = q2k_mins_avx512(blk, 1);
        for (int j = 0; j < 4; j++) {
            __m512i lo, hi;
            q2k_unpack_avx512(blk, j, &lo, &hi);
            _mm512_store_si512((void *)(bq + i * 1024 + j * 64), lo);
            _mm512_store_si512((void *)(bq + i * 1024 + 256 + j * 64), hi);
            _mm512_store_si512((void *)(bq + i * 1024 + 512 + j * 64), mlo);
            _mm512_store_si512((void *)(bq + i * 1024 + 768 + j * 64), mhi);
        }
    }
}

#define AX_ZERO_F(i) __m512 f##i = _mm512_setzero_ps();
/* Row i of block pb: as A5_Q4_END / A5_Q8_END (the m_w term only for 4-bit weights). */
#define AX_END(i)                                                                                       \
    {                                                                                                   \
        const __m512i t = _mm512_load_si512((const void *)(cb + (i) * G));                              \
        const __m512 tf = pair ? pair_fold(t, _mm512_load_si512((const void *)(cb + (AMX_ROWS + (i)) * G))) \
                               : _mm512_cvtepi32_ps(t);                                                 \
        f##i = _mm512_fmadd_ps(tf, _mm512_mul_ps(dw, _mm512_set1_ps(xd[(i) * nb + pb])), f##i);         \
        if (fmt != FMT_Q8) f##i = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[(i) * nb + pb]), f##i);         \
    }
#define AX_STORE(i) _mm512_storeu_ps(y + (i) * ldy, oscale ? _mm512_mul_ps(f##i, _mm512_loadu_ps(oscale)) : f##i);
#define AX_ROWS(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15)
/* Load block b's A and B tiles and start its products into C tiles c1 (q1) and c2 (q2). */
#define AX_ISSUE(c1, c2)                                                                                \
    _tile_loadd(0, xq + b * xblk, xrow);                                                                \
    if (pair) _tile_loadd(1, xq + b * xblk + QK, xrow);                                                 \
    if (fmt == FMT_Q8) _tile_loadd(2, wg + b * bb + 32, 4 * G); else _tile_loadd(2, bq + b * 512, 4 * G); \
    _tile_zero(c1);                                                                                     \
    if (pair) _tile_zero(c2);                                                                           \
    if (fmt == FMT_Q8) { _tile_dpbssd(c1, 0, 2); if (pair) _tile_dpbssd(c2, 1, 2); }                    \
    else { _tile_dpbsud(c1, 0, 2); if (pair) _tile_dpbsud(c2, 1, 2); }
#define AX_STORE_C(c1, c2, buf)                                                                         \
    _tile_stored(c1, buf, 4 * G);                                                                       \
    if (pair) _tile_stored(c2, buf + AMX_ROWS * G, 4 * G);

/* 16 rows x one group: y[16, 16] (row stride ldy) from the group's packed blocks wg (4-bit: their B tiles in bq) and
 * the rows' activations (as in the VNNI tiles: row i at xq + i * xrow, d and s at xd, xs + i * nb). fmt and pair
 * are constants at each call; float sums in registers. */
T_AMX INLINE void amx_tile(const int fmt, const int pair, const uint8_t *wg, const uint8_t *bq, int64_t nb,
                           const int8_t *xq, const float *xd, const float *xs, int64_t K, float *y, int64_t ldy,
                           const float *oscale) {
    _Alignas(64) int32_t cbuf[2][2 * AMX_ROWS * G];
    const int f32s = fmt == FMT_Q4K ? 3 : fmt == FMT_Q4F || fmt == FMT_Q5F, bb = (int)block_bytes(fmt);
    const int64_t xrow = pair ? 2 * K : K, xblk = pair ? 2 * QK : QK;
    AX_ROWS(AX_ZERO_F)
    for (int64_t b = 0; b <= nb + 1; b++) {
        if (b < nb) { /* block b on one set of C tiles ... */
            if (b & 1) { AX_ISSUE(6, 7) } else { AX_ISSUE(4, 5) }
        }
        if (b > 0 && b <= nb) { /* ... block b - 1 stored from the other set ... */
            if ((b - 1) & 1) { AX_STORE_C(6, 7, cbuf[1]) } else { AX_STORE_C(4, 5, cbuf[0]) }
        }
        if (b > 1) { /* ... and block b - 2, stored one step earlier, scaled (its store has completed) */
            const int64_t pb = b - 2;
            const int32_t *cb = cbuf[pb & 1];
            __m512 dw, mw;
            if (fmt == FMT_Q8) {
                dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wg + pb * bb))), mw = _mm512_setzero_ps();
            } else {
                q4_scales_avx512(f32s, f32s == 3 ? q4k_block(wg, pb) : wg + pb * bb,
                                 f32s == 3 ? q4k_super(wg, pb) : NULL, &dw, &mw);
            }
            AX_ROWS(AX_END)
        }
    }
    AX_ROWS(AX_STORE)
}

#define AX_Q6_END(i)                                                                                    \
    {                                                                                                   \
        const int32_t *c = cbuf + (i) * G;                                                              \
        __m512 t = q6_fold(_mm512_load_si512((const void *)c), _mm512_load_si512((const void *)(c + 256)), \
                           pair ? _mm512_load_si512((const void *)(c + 512)) : _mm512_setzero_si512(),  \
                           pair ? _mm512_load_si512((const void *)(c + 768)) : _mm512_setzero_si512(),  \
                           slo, shi, pair);                                                             \
        f##i = _mm512_fmadd_ps(t, _mm512_mul_ps(dw, _mm512_set1_ps(xd[(i) * nb + b])), f##i);           \
    }

/* 16 rows x one Q6 group (bq: its B tiles, amx_unpack_q6): per block, the halves' products into C tiles 4, 5 (q1) and
 * 6, 7 (q2), stored, then q6_fold and the float epilogue of the VNNI tile (A6_END): the same bits. */
T_AMX INLINE void amx_tile_q6(const int q3k, const int pair, const uint8_t *wg, const uint8_t *bq, int64_t nb, const int8_t *xq,
                              const float *xd, int64_t K, float *y, int64_t ldy, const float *oscale) {
    _Alignas(64) int32_t cbuf[4 * AMX_ROWS * G];
    const int64_t xrow = pair ? 2 * K : K, xblk = pair ? 2 * QK : QK;
    AX_ROWS(AX_ZERO_F)
    for (int64_t b = 0; b < nb; b++) {
        _tile_loadd(0, xq + b * xblk, xrow);
        _tile_loadd(1, xq + b * xblk + QK / 2, xrow);
        _tile_loadd(2, bq + b * 512, 4 * G);
        _tile_loadd(3, bq + b * 512 + 256, 4 * G);
        _tile_zero(4);
        _tile_zero(5);
        _tile_dpbssd(4, 0, 2);
        _tile_dpbssd(5, 1, 3);
        if (pair) {
            _tile_loadd(0, xq + b * xblk + QK, xrow);
            _tile_loadd(1, xq + b * xblk + QK + QK / 2, xrow);
            _tile_zero(6);
            _tile_zero(7);
            _tile_dpbssd(6, 0, 2);
            _tile_dpbssd(7, 1, 3);
        }
        _tile_stored(4, cbuf, 4 * G);
        _tile_stored(5, cbuf + 256, 4 * G);
        if (pair) {
            _tile_stored(6, cbuf + 512, 4 * G);
            _tile_stored(7, cbuf + 768, 4 * G);
        }
        const uint8_t *sc = q6_sc(q6_block(wg, b, q3k), q3k);
        const __m512 slo = q6_scales(sc), shi = q6_scales(sc + G);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)q6_d(wg, b, q3k)));
        AX_ROWS(AX_Q6_END)
    }
    AX_ROWS(AX_STORE)
}

#define AX_Q2K_END(i)                                                                                   \
    {                                                                                                   \
        const int32_t *c = cbuf + (i) * G;                                                              \
        const __m512i z = _mm512_setzero_si512();                                                       \
        const __m512 t = q2k_fold(_mm512_load_si512((const void *)c), _mm512_load_si512((const void *)(c + 256)), \
                                  _mm512_load_si512((const void *)(c + 512)),                            \
                                  pair ? _mm512_load_si512((const void *)(c + 768)) : z,                \
                                  pair ? _mm512_load_si512((const void *)(c + 1024)) : z,               \
                                  pair ? _mm512_load_si512((const void *)(c + 1280)) : z, sclo, schi, dw, mw, pair); \
        f##i = _mm512_fmadd_ps(t, _mm512_set1_ps(xd[(i) * nb + b]), f##i);                              \
    }

/* 16 rows x one Q2K group (bq: its B tiles, amx_unpack_q2k). Per block and activation part (q1, then q2 with pair):
 * the halves' A tiles (0, 1) times the values' B tiles into C tiles 4, 5 (S_lo, S_hi) and times the mins' B tiles
 * into C tile 6 (T), stored; then q2k_fold and the VNNI tile's epilogue (A5Q2_END): the same bits. */
T_AMX INLINE void amx_tile_q2k(const int pair, const uint8_t *wg, const uint8_t *bq, int64_t nb, const int8_t *xq,
                               const float *xd, int64_t K, float *y, int64_t ldy, const float *oscale) {
    _Alignas(64) int32_t cbuf[6 * AMX_ROWS * G];
    const int64_t xrow = pair ? 2 * K : K, xblk = pair ? 2 * QK : QK;
    AX_ROWS(AX_ZERO_F)
    for (int64_t b = 0; b < nb; b++) {
        for (int p = 0; p <= pair; p++) {
            _tile_loadd(0, xq + b * xblk + p * QK, xrow);
            _tile_loadd(1, xq + b * xblk + p * QK + QK / 2, xrow);
            _tile_loadd(2, bq + b * 1024, 4 * G);
            _tile_loadd(3, bq + b * 1024 + 256, 4 * G);
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_dpbsud(4, 0, 2);
            _tile_dpbsud(5, 1, 3);
            _tile_loadd(2, bq + b * 1024 + 512, 4 * G);
            _tile_loadd(3, bq + b * 1024 + 768, 4 * G);
            _tile_dpbsud(6, 0, 2);
            _tile_dpbsud(6, 1, 3);
            _tile_stored(4, cbuf + p * 768, 4 * G);
            _tile_stored(5, cbuf + p * 768 + 256, 4 * G);
            _tile_stored(6, cbuf + p * 768 + 512, 4 * G);
        }
        const uint8_t *blk = q2k_block(wg, b);
        const __m512 sclo = q2k_scales_avx512(blk, 0), schi = q2k_scales_avx512(blk, 1);
        __m512 dw, mw;
        q2k_dmin_avx512(q2k_super(wg, b), &dw, &mw);
        AX_ROWS(AX_Q2K_END)
    }
    AX_ROWS(AX_STORE)
}

/* One group, rows [0, M): the full 16-row tiles on AMX (bq: a 4-bit group's B tiles, unpacked; NULL: every row on
 * the VNNI tiles), the rest on the VNNI tiles. */
T_AMX static void group_amx(int fmt, int pair, const uint8_t *wg, int64_t nb, const int8_t *xq, const float *xd,
                            const float *xs, int64_t M, int64_t K, float *y, int64_t ldy, const float *oscale,
                            const uint8_t *bq, int tiles) {
    const int64_t xrow = pair ? 2 * K : K, full = tiles ? M / AMX_ROWS * AMX_ROWS : 0;
    for (int64_t m0 = 0; m0 < full; m0 += AMX_ROWS) {
        const int8_t *xq_ = xq + m0 * xrow;
        const float *xd_ = xd + m0 * nb, *xs_ = xs + m0 * nb;
        float *y_ = y + m0 * ldy;
        if (fmt == FMT_Q6) {
            if (pair) amx_tile_q6(0, 1, wg, bq, nb, xq_, xd_, K, y_, ldy, oscale);
            else amx_tile_q6(0, 0, wg, bq, nb, xq_, xd_, K, y_, ldy, oscale);
        } else if (fmt == FMT_Q3K) {
            if (pair) amx_tile_q6(1, 1, wg, bq, nb, xq_, xd_, K, y_, ldy, oscale);
            else amx_tile_q6(1, 0, wg, bq, nb, xq_, xd_, K, y_, ldy, oscale);
        } else if (fmt == FMT_Q2K) {
            if (pair) amx_tile_q2k(1, wg, bq, nb, xq_, xd_, K, y_, ldy, oscale);
            else amx_tile_q2k(0, wg, bq, nb, xq_, xd_, K, y_, ldy, oscale);
        } else if (fmt == FMT_Q8) {
            if (pair) amx_tile(FMT_Q8, 1, wg, bq, nb, xq_, xd_, xs_, K, y_, ldy, oscale);
            else amx_tile(FMT_Q8, 0, wg, bq, nb, xq_, xd_, xs_, K, y_, ldy, oscale);
        } else if (fmt == FMT_Q4F) {
            if (pair) amx_tile(FMT_Q4F, 1, wg, bq, nb, xq_, xd_, xs_, K, y_, ldy, oscale);
            else amx_tile(FMT_Q4F, 0, wg, bq, nb, xq_, xd_, xs_, K, y_, ldy, oscale);
        } else if (fmt == FMT_Q5F) {
            if (pair) amx_tile(FMT_Q5F, 1, wg, bq, nb, xq_, xd_, xs_, K, y_, ldy, oscale);
            else amx_tile(FMT_Q5F, 0, wg, bq, nb, xq_, xd_, xs_, K, y_, ldy, oscale);
        } else if (fmt == FMT_Q4K) {
            if (pair) amx_tile(FMT_Q4K, 1, wg, bq, nb, xq_, xd_, xs_, K, y_, ldy, oscale);
            else amx_tile(FMT_Q4K, 0, wg, bq, nb, xq_, xd_, xs_, K, y_, ldy, oscale);
        } else {
            if (pair) amx_tile(FMT_Q4, 1, wg, bq, nb, xq_, xd_, xs_, K, y_, ldy, oscale);
            else amx_tile(FMT_Q4, 0, wg, bq, nb, xq_, xd_, xs_, K, y_, ldy, oscale);
        }
    }
    if (full < M)
        group_avx512(fmt, pair, wg, nb, xq + full * xrow, xd + full * nb, xs + full * nb, M - full, K, y + full * ldy,
                     ldy, oscale);
}

/* Inside kvserve_qgemm's parallel region, called by every thread: this thread's contiguous share of the groups (as a
 * static schedule), over the rows in chunks of rows_per_chunk(xrow) (a chunk's activations stay in L2 while the share
 * of groups passes over them). Per chunk and group, a 4-bit or Q6 group's B tiles are unpacked into a per-thread
 * buffer of nb * 512 bytes (L1/L2) and used by all the chunk's row tiles, so neither the weights nor their unpacked
 * form are read from memory more than once per chunk; a thread that cannot get that buffer runs its share on the
 * VNNI tiles (the same bits). */
T_AMX static void amx_rows(int fmt, int pair, const uint8_t *w, int64_t nb, int64_t groups, const int8_t *xq,
                           const float *xd, const float *xs, int64_t M, int64_t K, float *y, int64_t ldy,
                           const float *oscale) {
    const int64_t xrow = pair ? 2 * K : K, bb = block_bytes(fmt), mc = rows_per_chunk(xrow);
    int64_t g0, g1;
    thread_groups(groups, &g0, &g1);
    if (g0 >= g1) return;
    uint8_t *bq = fmt == FMT_Q8 ? NULL : aligned_alloc(64, (size_t)(nb * (fmt == FMT_Q2K ? 1024 : 512)));
    const int tiles = fmt == FMT_Q8 || bq;
    if (tiles) amx_configure(fmt);
    for (int64_t c0 = 0; c0 < M; c0 += mc) {
        const int64_t rows = M - c0 < mc ? M - c0 : mc;
        for (int64_t g = g0; g < g1; g++) {
            const uint8_t *wg = w + g * nb * bb;
            if (bq && (fmt == FMT_Q6 || fmt == FMT_Q3K)) amx_unpack_q6(wg, nb, fmt == FMT_Q3K, bq);
            else if (bq && fmt == FMT_Q2K) amx_unpack_q2k(wg, nb, bq);
            else if (bq) amx_unpack_q4(wg, nb, fmt, bq);
            group_amx(fmt, pair, wg, nb, xq + c0 * xrow, xd + c0 * nb, xs + c0 * nb, rows, K, y + c0 * ldy + g * G,
                      ldy, oscale ? oscale + g * G : NULL, bq, tiles);
        }
    }
    if (tiles) amx_release();
    free(bq);
}
