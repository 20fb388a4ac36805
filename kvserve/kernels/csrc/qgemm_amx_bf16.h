/* The bf16 activations of kvserve_qgemm (ACT_BF16, included by qgemm.c): on AMX-BF16 CPUs (Sapphire Rapids and
 * later; Intel SDM vol. 2, TDPBF16PS) the weights are decoded to bfloat16 and multiplied by the activations rounded to
 * bfloat16, the sums kept in float32 inside the tile unit across the whole row: no per-block float epilogue, which is
 * what bounds the int8 tiles (qgemm_amx.h). The weights stay packed in memory; each thread decodes four groups (16
 * outputs each, all K) at a time into a buffer of 4 nb KiB that up to BF16_CHUNK_ROWS rows then reuse.
 *
 * Every row runs on the tiles, a lone decode row included (a 16-row tile whose other rows are zero padding), so a
 * row's bits never depend on M: TDPBF16PS's rounding inside a tile operation is the hardware's own (it matches no
 * sequential float32 order, so no AVX-512 path could reproduce it), but each output row is computed from its own
 * input row only, in the order of the K blocks, which the loop fixes (checked on Sapphire Rapids against 1-row tiles
 * and other rows; tests/model/test_bf16_kernels.py checks every row count, tile shape and split). Formats: the 4-bit family (Q4, Q4F, Q5F, Q4K: w = d q + m, one FMA) and Q8 (w = d q); a
 * weight of another format runs its int8 tiles for every M (kvserve_qgemm), so each weight's arithmetic is one.
 *
 * B tile of block b (16 rows x 64 bytes): row r holds, for each of the 16 outputs o, the bfloat16 pair w[o][32b + 2r],
 * w[o][32b + 2r + 1]. A tile: 16 rows x 32 bfloat16 (the rows' block b), 1 KiB in one piece (bf16_rows: rows K
 * apart made each tile load touch 16 pages; in one piece a 512-row call at K = 8192 takes 0.92-0.95x the time, the
 * default model's 64-row decode matmuls 0.96-0.97x, the same bits). C tiles 4..7: 2 row tiles x 2 groups
 * (bf16_tiles_2x2), or 1 x 4 for a few rows (bf16_tiles_1x4).
 */

#define T_AMXB __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,amx-tile,amx-bf16")))
/* Rows per pass over the decoded groups: decoding is the costly part (about 60 rows' worth of tile products per
 * block), so the groups are decoded once for up to this many rows, even when their activations spill from L2 (1B
 * shapes, 512 rows, 1 thread: 8192-wide down projection 0.92 ns per row, block and group at 512 rows a pass against
 * 2.44 at the int8 tiles' 1 MiB chunks, which are 96 rows there). */
#define BF16_CHUNK_ROWS 2048
/* Decoded groups a thread keeps at once when a pass's activations outgrow this many bytes too (see bf16_share):
 * with a pair of row tiles' activations beside them (128 KiB at K = 2048, 512 KiB at K = 8192) they stay within a
 * 2 MiB L2. */
#define BF16_DECODED_BYTES (1 << 20)

/* 1 if the CPU has AMX-BF16 (CPUID.(EAX=7, ECX=0):EDX bit 22) and AVX512-BF16 (leaf 7, ECX=1, EAX bit 5) besides
 * AMX-INT8's requirements, else 0; probed once (cached_probe). */
#ifndef KVSERVE_Q_EMULATE_AMX
static int amx_bf16_probe(void) {
    unsigned a, b, c, d, a1 = 0, b1, c1, d1;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & CPUID7_EDX_AMX_BF16) &&
           __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) && (a1 & (1u << 5)) && amx_usable();
}
#endif

static int amx_bf16_usable(void) {
#ifdef KVSERVE_Q_EMULATE_AMX
    return 0;
#else
    static int cached = -1;
    return cached_probe(&cached, amx_bf16_probe);
#endif
}

/* A buffer of at least `bytes` (64-byte aligned) kept by the calling thread for its next calls (slot 0: the
 * caller's bfloat16 rows; slot 1: a worker's decoded groups), so a step's ~120 matmuls do not map and fault in fresh
 * pages each time (glibc serves allocations of 128 KiB and more with mmap). NULL if it cannot grow. */
static void *bf16_scratch(int slot, size_t bytes) {
    static __thread void *buf[2];
    static __thread size_t cap[2];
    if (cap[slot] < bytes) {
        free(buf[slot]);
        cap[slot] = 0;
        buf[slot] = aligned_alloc(64, (bytes + 65535) / 65536 * 65536);
        if (!buf[slot]) return NULL;
        cap[slot] = (bytes + 65535) / 65536 * 65536;
    }
    return buf[slot];
}

/* Whether fmt has a bfloat16 decoder here. */
static int bf16_format(int fmt) {
    return fmt == FMT_Q4 || fmt == FMT_Q4F || fmt == FMT_Q5F || fmt == FMT_Q4K || fmt == FMT_Q8;
}

#ifndef KVSERVE_Q_EMULATE_AMX
/* Rows [m0, m1) of x [., K] float32 rounded to bfloat16 (round to nearest even: VCVTNE2PS2BF16) into xb in A-tile
 * order: row m's block b (32 values) at xb + ((m / 16) nb + b) 512 + (m % 16) 32, so each A tile (16 rows x one
 * block) is 1 KiB in one piece (nb = K / 32). */
T_AMXB static void bf16_rows(const float *x, int64_t m0, int64_t m1, int64_t K, uint16_t *xb) {
    const int64_t nb = K / 32;
    for (int64_t m = m0; m < m1; m++)
        for (int64_t k = 0; k < K; k += 32) {
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + m * K + k + 16), _mm512_loadu_ps(x + m * K + k));
            _mm512_store_si512((void *)(xb + ((m / 16) * nb + k / 32) * 512 + (m % 16) * 32), (__m512i)v);
        }
}

/* Two B tile rows (32 bfloat16 each) from four vectors of 16 outputs: row0 = the pairs (f0[o], f1[o]), row1 =
 * (f2[o], f3[o]) for o = 0..15, each float rounded to bfloat16 (nearest even, VCVTNE2PS2BF16). */
T_AMXB INLINE void bf16_pair_rows(__m512 f0, __m512 f1, __m512 f2, __m512 f3, uint16_t *row0, uint16_t *row1) {
    const __m512i il = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005,
                                         0x00160006, 0x00170007, 0x00180008, 0x00190009, 0x001a000a, 0x001b000b,
                                         0x001c000c, 0x001d000d, 0x001e000e, 0x001f000f); /* word 2o: o, 2o + 1: 16 + o */
    _mm512_store_si512((void *)row0, _mm512_permutexvar_epi16(il, (__m512i)_mm512_cvtne2ps_pbh(f1, f0)));
    _mm512_store_si512((void *)row1, _mm512_permutexvar_epi16(il, (__m512i)_mm512_cvtne2ps_pbh(f3, f2)));
}

static const float BF16_POW2[8] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 0x1p-28f}; /* 2^-4s */

/* One group's nb blocks (fmt: bf16_format) decoded to B tiles at bq (512 bfloat16 per block). A block's 64-byte
 * vectors hold one 32-bit lane per output (qgemm.c's layout: byte o*4 + i), so each weight is taken from its lane in
 * place: masked (4-bit: nibble s of the lane, q 2^(4s); Q8: byte i moved to the top, q 2^24 with its sign), converted
 * exactly (at most 8 significant bits), and scaled by d 2^-shift: the one FMA gives d q + m rounded once, as
 * fmaf(q, d, m) would (the power of two is exact), then the bfloat16 rounding. */
T_AMXB static void bf16_unpack_group(int fmt, const uint8_t *wg, int64_t nb, uint16_t *bq) {
    const int64_t bb = block_bytes(fmt);
    for (int64_t b = 0; b < nb; b++) {
        uint16_t *out = bq + b * 512;
        if (fmt == FMT_Q8) {
            const uint8_t *blk = wg + b * bb;
            const __m512 d = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk)),
                                           _mm512_set1_ps(0x1p-24f));
            const __m512i top = _mm512_set1_epi32((int)0xFF000000u);
            for (int j = 0; j < 8; j++) { /* inputs 4j..4j+3: rows 2j, 2j + 1 */
                const __m512i v = _mm512_loadu_si512((const void *)(blk + 32 + j * 64));
                __m512 f[4];
                for (int i = 0; i < 4; i++)
                    f[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(
                        i == 3 ? v : _mm512_slli_epi32(v, 24 - 8 * i), top)), d);
                bf16_pair_rows(f[0], f[1], f[2], f[3], out + j * 64, out + j * 64 + 32);
            }
            continue;
        }
        const int f32s = fmt == FMT_Q4K ? 3 : fmt == FMT_Q4F || fmt == FMT_Q5F;
        const uint8_t *blk = fmt == FMT_Q4K ? q4k_block(wg, b) : wg + b * bb;
        const int qo = fmt == FMT_Q4K ? 32 : fmt == FMT_Q4 ? 64 : 128;
        __m512 dw, mw;
        q4_scales_avx512(f32s, blk, fmt == FMT_Q4K ? q4k_super(wg, b) : NULL, &dw, &mw);
        if (fmt == FMT_Q5F) { /* 5-bit values: the unpacked bytes (q4_unpack_avx512), byte i of a lane at 2^(8i) */
            for (int j = 0; j < 4; j++) {
                __m512i lo, hi;
                q4_unpack_avx512(blk + qo + j * 64, blk + 384, j, &lo, &hi);
                for (int h = 0; h < 2; h++) {
                    const __m512i v = h ? hi : lo;
                    __m512 f[4];
                    for (int i = 0; i < 4; i++)
                        f[i] = _mm512_fmadd_ps(_mm512_cvtepu32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xFF << (8 * i)))),
                                               _mm512_mul_ps(dw, _mm512_set1_ps(BF16_POW2[2 * i])), mw);
                    bf16_pair_rows(f[0], f[1], f[2], f[3], out + h * 256 + j * 64, out + h * 256 + j * 64 + 32);
                }
            }
            continue;
        }
        __m512 ds[8]; /* d 2^-4s: nibble s of a lane (byte s / 2, high half when s is odd) */
        for (int s4 = 0; s4 < 8; s4++) ds[s4] = _mm512_mul_ps(dw, _mm512_set1_ps(BF16_POW2[s4]));
        for (int j = 0; j < 4; j++) {
            const __m512i v = _mm512_loadu_si512((const void *)(blk + qo + j * 64));
            for (int h = 0; h < 2; h++) { /* low nibbles: inputs 4j + i (rows 2j, 2j + 1); high: 16 + 4j + i */
                __m512 f[4];
                for (int i = 0; i < 4; i++) {
                    const int s4 = 2 * i + h;
                    f[i] = _mm512_fmadd_ps(_mm512_cvtepu32_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)(0xFu << (4 * s4))))),
                                           ds[s4], mw);
                }
                bf16_pair_rows(f[0], f[1], f[2], f[3], out + h * 256 + j * 64, out + h * 256 + j * 64 + 32);
            }
        }
    }
}

/* Palette 1: every tile 16 rows x 64 bytes (A tiles: 16 rows x 32 bfloat16; B tiles: 16 pair rows x 16 outputs; C
 * tiles 4..7: 16 x 16 float32). */
T_AMXB static void bf16_configure(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = AMX_ROWS, cfg.colsb[t] = 64;
    AMX_LOAD_CONFIG(cfg);
}

/* (gcc's tile intrinsics paste the tile number into the instruction, so each is a literal.) Every C tile sums the
 * blocks of one 16-row tile x one group in block order, from zero: the same operations whatever the shape below. */

/* Two 16-row tiles (a0, a1: A tiles in bf16_rows' order, 512 bfloat16 per block; a1 NULL: one) x two decoded
 * groups (b0, b1; b1 NULL: one): C tiles 4 (a0 b0), 5 (a0 b1), 6 (a1 b0), 7 (a1 b1) stored to cb[4][256]. A tiles 0, 1; B tiles 2, 3:
 * each loaded tile feeds two products. */
T_AMXB static void bf16_tiles_2x2(const uint16_t *a0, const uint16_t *a1, const uint16_t *b0,
                                  const uint16_t *b1, int64_t nb, float *cb) {
    _tile_zero(4);
    if (b1) _tile_zero(5);
    if (a1) _tile_zero(6);
    if (a1 && b1) _tile_zero(7);
    for (int64_t b = 0; b < nb; b++) {
        _tile_loadd(0, a0 + 512 * b, 64);
        _tile_loadd(2, b0 + 512 * b, 64);
        _tile_dpbf16ps(4, 0, 2);
        if (b1) { _tile_loadd(3, b1 + 512 * b, 64); _tile_dpbf16ps(5, 0, 3); }
        if (a1) {
            _tile_loadd(1, a1 + 512 * b, 64);
            _tile_dpbf16ps(6, 1, 2);
            if (b1) _tile_dpbf16ps(7, 1, 3);
        }
    }
    _tile_stored(4, cb, 64);
    if (b1) _tile_stored(5, cb + 256, 64);
    if (a1) _tile_stored(6, cb + 512, 64);
    if (a1 && b1) _tile_stored(7, cb + 768, 64);
}

/* One 16-row tile x four decoded groups (bq, bq + nb 512, ...): C tiles 4..7 (cb[4][256]), B tiles 1..3 in turn,
 * so a few rows (a decode step) keep four independent sums in flight instead of waiting on one. */
T_AMXB static void bf16_tiles_1x4(const uint16_t *a0, const uint16_t *bq, int64_t nb, float *cb) {
    const uint16_t *b0 = bq, *b1 = bq + nb * 512, *b2 = b1 + nb * 512, *b3 = b2 + nb * 512;
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t b = 0; b < nb; b++) {
        _tile_loadd(0, a0 + 512 * b, 64);
        _tile_loadd(1, b0 + 512 * b, 64);
        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(2, b1 + 512 * b, 64);
        _tile_dpbf16ps(5, 0, 2);
        _tile_loadd(3, b2 + 512 * b, 64);
        _tile_dpbf16ps(6, 0, 3);
        _tile_loadd(1, b3 + 512 * b, 64);
        _tile_dpbf16ps(7, 0, 1);
    }
    _tile_stored(4, cb, 64);
    _tile_stored(5, cb + 256, 64);
    _tile_stored(6, cb + 512, 64);
    _tile_stored(7, cb + 768, 64);
}

/* The first `rows` rows (<= 16) of a stored C tile cb [16, 16] to y [rows, 16] (row stride ldy), times oscale [16]
 * when given. */
T_AMXB INLINE void bf16_store(const float *cb, int64_t rows, float *y, int64_t ldy, const float *oscale) {
    const __m512 os = oscale ? _mm512_loadu_ps(oscale) : _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < rows; i++) {
        const __m512 v = _mm512_load_ps(cb + i * 16);
        _mm512_storeu_ps(y + i * ldy, oscale ? _mm512_mul_ps(v, os) : v);
    }
}

/* Rows [c0, c1) of xb (padded with zero rows to a multiple of 16) times ng (1..4) decoded groups at bq (nb 512
 * bfloat16 each): y[m, 16 i .. 16 i + 15] for group i, oscale (when given) from the first group's outputs. ng 4 with
 * at most 16 rows: bf16_tiles_1x4; else pairs of groups x pairs of row tiles. */
T_AMXB static void bf16_groups_rows(const uint16_t *xb, int64_t c0, int64_t c1, const uint16_t *bq,
                                    int64_t ng, int64_t nb, float *y, int64_t ldy, const float *oscale) {
    _Alignas(64) float cb[4 * 256];
    if (ng == 4 && c1 - c0 <= 16) {
        bf16_tiles_1x4(xb + c0 / 16 * nb * 512, bq, nb, cb);
        for (int t = 0; t < 4; t++)
            bf16_store(cb + t * 256, c1 - c0, y + c0 * ldy + t * G, ldy, oscale ? oscale + t * G : NULL);
        return;
    }
    for (int64_t gi = 0; gi < ng; gi += 2) {
        const uint16_t *b0 = bq + gi * nb * 512, *b1 = gi + 1 < ng ? b0 + nb * 512 : NULL;
        for (int64_t m0 = c0; m0 < c1; m0 += 32) {
            const uint16_t *a1 = m0 + 16 < c1 ? xb + (m0 / 16 + 1) * nb * 512 : NULL;
            bf16_tiles_2x2(xb + m0 / 16 * nb * 512, a1, b0, b1, nb, cb);
            const int64_t r0 = c1 - m0 < 16 ? c1 - m0 : 16, r1 = c1 - m0 - 16 < 16 ? c1 - m0 - 16 : 16;
            for (int t = 0; t < 4; t++) {
                const int64_t gt = gi + (t & 1), rows = t < 2 ? r0 : r1;
                if ((t & 1 && !b1) || (t >= 2 && !a1)) continue;
                bf16_store(cb + t * 256, rows, y + (m0 + (t >> 1) * 16) * ldy + gt * G, ldy,
                           oscale ? oscale + gt * G : NULL);
            }
        }
    }
}

/* Inside kvserve_qgemm's parallel region, every thread: its static share of the groups, over the rows in passes of
 * BF16_CHUNK_ROWS. A pass decodes a set of groups, then each pair of 16-row tiles runs over all of them while its A
 * tiles stay in the core's caches. A set is four groups, or, when the pass's bfloat16 activations are more than
 * BF16_DECODED_BYTES (they no longer stay in L2 beside the groups), up to BF16_DECODED_BYTES of groups: the
 * activations then stream from memory once per set instead of once per pair of groups (one row ran 1.30x slower with
 * the large sets: its decode no longer stayed in L1/L2). Returns 1 if this thread could not get its decode buffer
 * (nothing written by it), else 0. */
T_AMXB static int bf16_share(int fmt, const uint8_t *w, int64_t nb, int64_t groups, const uint16_t *xb, int64_t M,
                             float *y, int64_t ldy, const float *oscale) {
    const int64_t bb = block_bytes(fmt), mc = BF16_CHUNK_ROWS;
    int64_t g0, g1;
    thread_groups(groups, &g0, &g1);
    if (g0 >= g1) return 0;
    const int64_t pass_bytes = (M < mc ? M : mc) * nb * 64; /* rows x K bfloat16 */
    int64_t dg = pass_bytes > BF16_DECODED_BYTES ? BF16_DECODED_BYTES / (nb * 1024) / 4 * 4 : 4; /* 1 KiB a block */
    if (dg < 4) dg = 4;
    uint16_t *bq = bf16_scratch(1, (size_t)(dg * nb * 1024));
    if (!bq) return 1;
    bf16_configure();
    for (int64_t c0 = 0; c0 < M; c0 += mc) {
        const int64_t c1 = M - c0 < mc ? M : c0 + mc;
        for (int64_t g = g0; g < g1; g += dg) {
            const int64_t nd = g1 - g < dg ? g1 - g : dg;
            for (int64_t i = 0; i < nd; i++) bf16_unpack_group(fmt, w + (g + i) * nb * bb, nb, bq + i * nb * 512);
            const int64_t step = c1 - c0 <= 16 ? 16 : 32; /* a few rows: bf16_groups_rows' 1 x 4 tiles */
            for (int64_t m0 = c0; m0 < c1; m0 += step) {
                const int64_t m1 = c1 - m0 < step ? c1 : m0 + step;
                for (int64_t i = 0; i < nd; i += 4)
                    bf16_groups_rows(xb, m0, m1, bq + i * nb * 512, nd - i < 4 ? nd - i : 4, nb, y + (g + i) * G, ldy,
                                     oscale ? oscale + (g + i) * G : NULL);
            }
        }
    }
    _tile_release();
    return 0;
}
#endif

/* kvserve_qgemm with ACT_BF16 and a bf16_format weight (the caller checked the arguments and the CPU): x rounded
 * to bfloat16 (a buffer of M rounded up to 16 rows, the padding zero), then the groups over the threads. Returns 0,
 * or -2 when scratch memory could not be allocated. */
static int qgemm_bf16(int fmt, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t nb, int64_t groups,
                      const float *oscale, float *y, int64_t ldy) {
#ifdef KVSERVE_Q_EMULATE_AMX
    (void)fmt, (void)x, (void)M, (void)K, (void)w, (void)nb, (void)groups, (void)oscale, (void)y, (void)ldy;
    return -1;
#else
    const int64_t m16 = (M + 15) / 16 * 16;
    uint16_t *xb = bf16_scratch(0, (size_t)(m16 * K * 2));
    if (!xb) return -2;
    if (m16 > M) /* the last tile's padding rows, zeros: one run of (m16 - M) rows in each of its blocks */
        for (int64_t b = 0; b < nb; b++)
            memset(xb + ((M / 16) * nb + b) * 512 + (M % 16) * 32, 0, (size_t)((m16 - M) * 64));
    int failed = 0;
#pragma omp parallel if (M * K * groups * G >= SERIAL_MACS)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) bf16_rows(x, m, m + 1, K, xb);
        if (bf16_share(fmt, w, nb, groups, xb, M, y, ldy, oscale)) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
    }
    return failed ? -2 : 0;
#endif
}
