/* The paged-attention kernel for one instruction set and one KV-cache element type, included by paged_attention.c
 * once per (ISA, type) after paged_attention_isa.h, with that header's macros and:
 *   KV_T          the cache's element type (float, uint16_t holding bfloat16 bits, or int8_t);
 *   FN(x)         x with the ISA's and the type's suffixes (x##_f32_avx2, ...);
 *   KV_EXTRA      elements each (token, KV head) row holds after its d values (int8: its 2-byte scale; else 0),
 *                 so a row is d + KV_EXTRA elements and a slot h_kv of them;
 *   KV_SCALE(row, d)  for the row starting at row, what KV_LOADV multiplies by (int8: its scale in every lane;
 *                 others: anything, unused);
 *   KV_LOADV(p, s)  W consecutive elements at p (in a row whose KV_SCALE is s) as a V of float32: bfloat16 widened
 *                 exactly, int8 converted and times s (exact: q * s fits float32);
 *   KV_STORE_ROW(dst, src, h, d)  h rows of d float32 values at src (contiguous) stored as h rows of the cache
 *                 at dst (each d + KV_EXTRA elements).
 *   KV_AMX        1 for the AMX-BF16 build of a bfloat16 cache (qk_amx below: the scores on tiles), else 0.
 * The macros KV_T, FN, KV_EXTRA, KV_SCALE, KV_LOADV, KV_STORE_ROW and KV_AMX are undefined at the end, ready for the
 * next type. */

#ifndef KV_AMX
#define KV_AMX 0
#endif
#ifndef KV_PAIRS
#define KV_PAIRS 0
#endif
#if KV_AMX
/* Keys per score tile of the AMX build: one A tile's rows. */
#define TK 16
#else
#define TK KT
#endif

#if !KV_AMX
/* kt[k * KT + j] = key j0 + j's element k (k < d, j < KT), the key tile transposed; keys at or past nk are zeros.
 * key j's row is at k_cache + slot[j0 + j]. */
TGT static void FN(load_kt)(const KV_T *k_cache, const int64_t *slot, int64_t j0, int64_t nk, int64_t d, float *kt) {
    for (int64_t g = 0; g < KT; g += W) {
        for (int64_t c = 0; c < d; c += W) {
            V r[W];
            for (int64_t j = 0; j < W; j++)
                r[j] = g + j < nk ? KV_LOADV(k_cache + slot[j0 + g + j] + c, KV_SCALE(k_cache + slot[j0 + g + j], d))
                                  : VZERO;
            VTRANSPOSE(r);
            for (int64_t k = 0; k < W; k++) VSTORE(kt + (c + k) * KT + g, r[k]);
        }
    }
}
#endif

#if KV_PAIRS
/* The nv vectors of columns [c, c + nv W) of the value row v: with nv even, each 2W columns as one load split into
 * their even and odd columns (KV_LOAD_PAIRS: x[2h] the even, x[2h + 1] the odd columns of the h-th 2W), which
 * pv_store puts back in order; else KV_LOADV per W columns. Either way each column's value is the same float. */
#define PV_PAIRED(nv) ((nv) % 2 == 0)
#else
#define PV_PAIRED(nv) 0
#endif
TGT static inline __attribute__((always_inline)) void FN(pv_load)(const KV_T *v, int64_t c, int nv, V sc, V *x) {
#if KV_PAIRS
    if (PV_PAIRED(nv)) {
        for (int h = 0; h < nv / 2; h++) KV_LOAD_PAIRS(v + c + 2 * h * W, x[2 * h], x[2 * h + 1]);
        return;
    }
#endif
    for (int u = 0; u < nv; u++) x[u] = KV_LOADV(v + c + u * W, sc);
}

/* out[c .. c + nv W) from pv_load's vectors. */
TGT static inline __attribute__((always_inline)) void FN(pv_store)(float *out, int64_t c, int nv, const V *acc) {
#if KV_PAIRS
    if (PV_PAIRED(nv)) {
        for (int h = 0; h < nv / 2; h++) KV_STORE_PAIRS(out + c + 2 * h * W, acc[2 * h], acc[2 * h + 1]);
        return;
    }
#endif
    for (int u = 0; u < nv; u++) VSTORE(out + c + u * W, acc[u]);
}

/* Weighted sums of nr (<= PV_ROWS) rows over columns [c, c + nv W) (nv <= PV_VECS; both compile-time constants
 * where inlined):
 * out_r[c'] = sum over keys j = lo[r] .. n[r]-1, in order, of p_r[j] * v[j][c'] (one FMA per term, from zero), with
 * p_r = p + r * p_stride, out_r = out[r], v[j] = v_cache + slot[j]. lo and n are ascending (a = lo[nr-1] the
 * greatest first key, b = n[0] the least end): each row's keys before a alone, then the keys [a, b) all rows see
 * together (each value vector loaded once for nr rows), then each row's keys from max(a, b) alone; each element's
 * chain is the same either way. */
TGT static inline __attribute__((always_inline)) void FN(pv_rows)(const float *p, int64_t p_stride, int nr,
                                                                   const int64_t *lo, const int64_t *n,
                                                                   const KV_T *v_cache, const int64_t *slot,
                                                                   int64_t c, int nv, int64_t d, float **out) {
    V acc[PV_ROWS][PV_VECS], x[PV_VECS];
    const int64_t a = lo[nr - 1], b = n[0];
    for (int r = 0; r < nr; r++) {
        for (int u = 0; u < nv; u++) acc[r][u] = VZERO;
        for (int64_t j = lo[r], e = a < n[r] ? a : n[r]; j < e; j++) {
            const KV_T *v = v_cache + slot[j];
            const V w = VSET1(p[r * p_stride + j]);
            FN(pv_load)(v, c, nv, KV_SCALE(v, d), x);
            for (int u = 0; u < nv; u++) acc[r][u] = VFMA(w, x[u], acc[r][u]);
        }
    }
    for (int64_t j = a; j < b; j++) {
        const KV_T *v = v_cache + slot[j];
        FN(pv_load)(v, c, nv, KV_SCALE(v, d), x);
        for (int r = 0; r < nr; r++) {
            const V b = VSET1(p[r * p_stride + j]);
            for (int u = 0; u < nv; u++) acc[r][u] = VFMA(b, x[u], acc[r][u]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int64_t j = a > b ? a : b; j < n[r]; j++) {
            const KV_T *v = v_cache + slot[j];
            const V b = VSET1(p[r * p_stride + j]);
            FN(pv_load)(v, c, nv, KV_SCALE(v, d), x);
            for (int u = 0; u < nv; u++) acc[r][u] = VFMA(b, x[u], acc[r][u]);
        }
    for (int r = 0; r < nr; r++) FN(pv_store)(out[r], c, nv, acc[r]);
}
#undef PV_PAIRED

/* pv_rows over every column of d (a multiple of W) for nr rows: tiles of PV_VECS vectors, then single vectors. */
#define PV_CASES(c, nv)                                                              \
    switch (nr) {                                                                    \
    case 4: FN(pv_rows)(p, p_stride, 4, lo, n, v_cache, slot, c, nv, d, out); break; \
    case 3: FN(pv_rows)(p, p_stride, 3, lo, n, v_cache, slot, c, nv, d, out); break; \
    case 2: FN(pv_rows)(p, p_stride, 2, lo, n, v_cache, slot, c, nv, d, out); break; \
    default: FN(pv_rows)(p, p_stride, 1, lo, n, v_cache, slot, c, nv, d, out); break;\
    }
TGT static void FN(pv_tile)(const float *p, int64_t p_stride, int64_t nr, const int64_t *lo, const int64_t *n,
                            const KV_T *v_cache, const int64_t *slot, int64_t d, float **out) {
    int64_t c = 0;
    for (; c + PV_VECS * W <= d; c += PV_VECS * W) PV_CASES(c, PV_VECS)
    for (; c < d; c += W) PV_CASES(c, 1)
}
#undef PV_CASES

#if KV_AMX
/* The B tiles of the AMX score product: for each group of 16 rows g and each chunk of 32 head elements c (nc =
 * ceil(d / 32)), bt + (g * nc + c) * 256 holds the 16 x 16 dwords B[kk][n] = the bfloat16 pair (q_n[32c + 2kk],
 * q_n[32c + 2kk + 1]) of row 16g + n's scaled query rounded to bfloat16 (bf16_round: nearest, ties to even); rows
 * past R and elements past d are zeros. */
TGT static void FN(q_tiles)(const float *qs, int64_t R, int64_t d, uint32_t *bt) {
    const int64_t nc = (d + 31) / 32, ng = (R + 15) / 16;
    for (int64_t g = 0; g < ng; g++)
        for (int64_t c = 0; c < nc; c++) {
            uint32_t *b = bt + (g * nc + c) * 256;
            const int64_t rows = R - 16 * g < 16 ? R - 16 * g : 16;
            const int64_t pairs = d - 32 * c < 32 ? (d - 32 * c) / 2 : 16; /* d is a multiple of 16 */
            if (rows < 16 || pairs < 16) memset(b, 0, 1024);
            const __m512i col = tile_column0();
            const __mmask16 live = (__mmask16)((1u << pairs) - 1);
            /* the chunk's 2 pairs floats of a row: the first 16 (mask m0) and the rest (m1) */
            const __mmask16 m0 = pairs >= 8 ? 0xFFFF : (__mmask16)((1u << (2 * pairs)) - 1);
            const __mmask16 m1 = pairs > 8 ? (__mmask16)((1u << (2 * pairs - 16)) - 1) : 0;
            for (int64_t n = 0; n < rows; n++) { /* row n's floats rounded (bf16_round's arithmetic, 16 at a time),
                                                  * its pair kk scattered to b[kk * 16 + n] */
                const float *x = qs + (16 * g + n) * d + 32 * c;
                const __m512i lo = bf16_round16(_mm512_maskz_loadu_ps(m0, x));
                const __m512i hi = bf16_round16(_mm512_maskz_loadu_ps(m1, x + 16));
                const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo)),
                                                     _mm512_cvtepi32_epi16(hi), 1);
                _mm512_mask_i32scatter_epi32(b + n, live, col, v, 4);
            }
        }
}

/* Scores of rows [r0, r1) against the 16 keys j0 .. j0 + 15 on AMX-BF16 tiles: C[m][n] = key m . row n, summed in
 * float32 by TDPBF16PS over the head's chunks of 32 elements in order (tile 0 C, 1 the keys' chunk, 2 the rows'),
 * then s[r * s_stride + j0 + m] = C[m][r - 16g]. Each C element is computed from its own key row and query row only,
 * so a row's score of a key never depends on the other keys or rows of the tile (TDPBF16PS's own rounding: Intel
 * SDM vol. 2; checked in tests/attention/test_paged_attention_kernel.py). The A tile is read from the pool in
 * place when the 16 keys are consecutive slots of one block and d is a multiple of 32, else from a copy in stage
 * ([16][ceil(d / 32) 32], zeros past nk and past d). */
TGT static void FN(qk_amx)(const KV_T *k_cache, const int64_t *slot, int64_t j0, int64_t nk, int64_t row,
                           int64_t d, int64_t block_size, int64_t base, const uint32_t *bt, int64_t r0, int64_t r1,
                           uint16_t *stage, float *s, int64_t s_stride) {
    const int64_t nc = (d + 31) / 32;
    const KV_T *a = k_cache + slot[j0];
    int64_t a_stride = row * (int64_t)sizeof(KV_T);
    const int in_block = block_size % 16 == 0 && (base + j0) % 16 == 0; /* the 16 keys share a block */
    if (!(d % 32 == 0 && in_block && (j0 + 15 >= nk || slot[j0 + 15] - slot[j0] == 15 * row))) {
        memset(stage, 0, sizeof(KV_T) * (size_t)(16 * 32 * nc));
        for (int64_t m = 0; m < 16 && j0 + m < nk; m++)
            memcpy(stage + m * 32 * nc, k_cache + slot[j0 + m], sizeof(KV_T) * (size_t)d);
        a = stage, a_stride = 32 * nc * (int64_t)sizeof(KV_T);
    }
    float cbuf[256] __attribute__((aligned(64)));
    for (int64_t g = r0 / 16; g * 16 < r1; g++) {
        _tile_zero(0);
        for (int64_t c = 0; c < nc; c++) {
            _tile_loadd(1, a + 32 * c, a_stride);
            _tile_loadd(2, bt + (g * nc + c) * 256, 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, cbuf, 64);
        const int64_t n0 = r0 > 16 * g ? r0 - 16 * g : 0, n1 = r1 < 16 * g + 16 ? r1 - 16 * g : 16;
        if (n1 - n0 <= 4) { /* a few rows (decode): each row's column of C gathered */
            const __m512i col = tile_column0();
            for (int64_t n = n0; n < n1; n++)
                VSTORE(s + (16 * g + n) * s_stride + j0,
                       _mm512_i32gather_ps(_mm512_add_epi32(col, _mm512_set1_epi32((int)n)), cbuf, 4));
        } else {
            V r[W];
            for (int m = 0; m < W; m++) r[m] = VLOAD(cbuf + m * 16);
            VTRANSPOSE(r);
            for (int64_t n = n0; n < n1; n++) VSTORE(s + (16 * g + n) * s_stride + j0, r[n]);
        }
    }
}
#endif

/* One task: KV head kh of request r, its query tokens i0 .. i1-1 (of n, the first at position first = L - n, so
 * token i sees keys lo_i .. first + i, lo_i = first_key(first + i, window)), all G query heads of kh: rows
 * (i - i0) * G + e. The task's keys are base = lo_i0 .. L1 - 1 with L1 = first + i1 (the keys the last row sees);
 * below, key j is at index j - base of slot and of each row's scores. The keys of each key tile are transposed once
 * for the task's rows whose windows reach it; the scores of a row stay in scratch until its softmax (soft-capped
 * when cap > 0), then its weighted sum. Scratch: slots [L1 - base], scaled queries [R][d], the key tile [d][KT],
 * scores [R][Lp] (Lp: L1 - base plus a vector's slack, rounded up to KT). Returns 0, or -1 when the scratch could
 * not be allocated. */
TGT static int FN(attend_task)(const float *q, int64_t q_stride, const KV_T *k_cache, const KV_T *v_cache,
                               const int64_t *table, int64_t n, int64_t L, int64_t i0, int64_t i1, int64_t kh,
                               int64_t G, int64_t h_kv, int64_t d, int64_t block_size, float scale, int64_t window,
                               float cap, const float *sinks, float *out, int64_t out_stride) {
    const int64_t first = L - n, L1 = first + i1, R = (i1 - i0) * G;
#if KV_AMX
    const int64_t base = first_key(first + i0, window) / TK * TK; /* key tiles at multiples of 16 (qk_amx) */
    const int64_t bt_floats = (R + 15) / 16 * ((d + 31) / 32) * 256; /* q_tiles' dwords */
#else
    const int64_t base = first_key(first + i0, window), bt_floats = 0;
#endif
    const int64_t nk = L1 - base, Lp = (nk + W + KT - 1) / KT * KT;
    int64_t *slot = malloc(sizeof(int64_t) * (size_t)nk + 64 +
                           sizeof(float) * (size_t)(R * d + d * KT + R * Lp + bt_floats));
    if (!slot) return -1;
    float *qs = (float *)(((uintptr_t)(slot + nk) + 63) & ~(uintptr_t)63), *kt = qs + R * d, *s = kt + d * KT;
    const int64_t row = h_kv * (d + KV_EXTRA), row_bytes = (d + KV_EXTRA) * (int64_t)sizeof(KV_T);
    /* the block table walked once from key base, without a division per key */
    for (int64_t j = 0, b = base / block_size, o = base % block_size; j < nk; j++) {
        slot[j] = (table[b] * block_size + o) * row + kh * (d + KV_EXTRA);
        if (++o == block_size) { o = 0; b++; }
    }
    for (int64_t i = i0; i < i1; i++)
        for (int64_t e = 0; e < G; e++) {
            const float *src = q + i * q_stride + (kh * G + e) * d;
            float *dst = qs + ((i - i0) * G + e) * d;
            for (int64_t k = 0; k < d; k++) dst[k] = src[k] * scale;
        }
#if KV_AMX
    uint32_t *bt = (uint32_t *)(s + R * Lp);
    FN(q_tiles)(qs, R, d, bt);
#endif
    for (int64_t j0 = 0; j0 < nk; j0 += TK) {
        /* the rows that see a key of j0 .. j0 + TK - 1 (absolute: + base): tokens from max(i0, first key - first)
         * up to those whose window starts at or before the tile's last key */
        const int64_t ja = base + j0, i_lo = ja - first > i0 ? ja - first : i0;
        const int64_t i_hi = window > 0 && ja + TK - 1 + window - first < i1 ? ja + TK - 1 + window - first : i1;
        if (i_hi <= i_lo) continue;
        /* the next tile's keys towards L1 and this tile's values towards L2 (read after the softmax): the rows sit
         * in scattered blocks, where the hardware prefetchers lose the stream at every block edge */
        for (int64_t j = j0 + TK, e = j0 + 2 * TK < nk ? j0 + 2 * TK : nk; j < e; j++)
            prefetch_row(k_cache + slot[j], row_bytes, _MM_HINT_T0);
        for (int64_t j = j0, e = j0 + TK < nk ? j0 + TK : nk; j < e; j++)
            prefetch_row(v_cache + slot[j], row_bytes, _MM_HINT_T1);
        const int64_t r0 = (i_lo - i0) * G;
#if KV_AMX
        FN(qk_amx)(k_cache, slot, j0, nk, row, d, block_size, base, bt, r0, (i_hi - i0) * G, (uint16_t *)kt, s, Lp);
#else
        FN(load_kt)(k_cache, slot, j0, nk - j0 < KT ? nk - j0 : KT, d, kt);
        ISA(qk_tile)(qs + r0 * d, (i_hi - i_lo) * G, kt, d, s + r0 * Lp + j0, Lp);
#endif
    }
    int64_t ll[PV_ROWS], nn[PV_ROWS];
    float *o[PV_ROWS];
    for (int64_t r = 0; r < R; r++) {
        const int64_t pos = first + i0 + r / G, lo = first_key(pos, window) - base;
        ISA(softmax)(s + r * Lp + lo, pos + 1 - base - lo, cap, sinks ? sinks[kh * G + r % G] : -INFINITY);
    }
    for (int64_t r = 0; r < R; r += PV_ROWS) {
        const int64_t nr = R - r < PV_ROWS ? R - r : PV_ROWS;
        for (int64_t t = 0; t < nr; t++) {
            const int64_t i = i0 + (r + t) / G, e = (r + t) % G;
            ll[t] = first_key(first + i, window) - base;
            nn[t] = first + i + 1 - base;
            o[t] = out + i * out_stride + (kh * G + e) * d;
        }
        FN(pv_tile)(s + r * Lp, Lp, nr, ll, nn, v_cache, slot, d, o);
    }
    free(slot);
    return 0;
}

/* Attention of num_reqs requests (paged_attention.c's file comment), one task per (request, KV head, block of
 * query tokens), the longest first. Returns 0, or -1 when scratch memory could not be allocated. */
TGT static int FN(attend)(const float *q, int64_t q_stride, const KV_T *k_cache, const KV_T *v_cache,
                          const int64_t *block_tables, int64_t max_blocks, const int64_t *q_start,
                          const int64_t *q_len, const int64_t *seq_len, int64_t num_reqs, int64_t h_q, int64_t h_kv,
                          int64_t d, int64_t block_size, float scale, int64_t window, float cap,
                          const float *sinks, float *out, int64_t out_stride) {
#if KV_AMX
    if (!kvserve_attention_amx_usable()) return -1; /* also asks Linux for the tiles, once */
#endif
    const int64_t G = h_q / h_kv;
    int64_t macs = 0, n_tasks = 0, max_len = 1;
    for (int64_t r = 0; r < num_reqs; r++) max_len = seq_len[r] > max_len ? seq_len[r] : max_len;
    /* query tokens per task: about TASK_ROWS rows, fewer where the scores would pass TASK_SCORE_FLOATS (a task's
     * keys: at most its tokens plus the window) */
    int64_t qb = TASK_ROWS / G, keys = window > 0 && window + TASK_ROWS < max_len ? window + TASK_ROWS : max_len;
    if (qb * G * keys > TASK_SCORE_FLOATS) qb = TASK_SCORE_FLOATS / (G * keys);
    qb = qb < 1 ? 1 : qb;
    for (int64_t r = 0; r < num_reqs; r++) {
        macs += q_len[r] * (window > 0 && window + q_len[r] < seq_len[r] ? window + q_len[r] : seq_len[r]);
        n_tasks += (q_len[r] + qb - 1) / qb * h_kv;
    }
    macs *= h_q * d;
    const int parallel = omp_get_max_threads() > 1 && macs >= PARALLEL_MIN_MACS;
    /* a thread takes the h_kv tasks of one (request, query block) at a time where there are enough of them
     * (TASK_GROUPS_PER_THREAD a thread): they read the same blocks (each slot row holds every KV head), so the
     * lines the first task brings in serve the others from the thread's own caches */
    const int64_t chunk = n_tasks >= TASK_GROUPS_PER_THREAD * h_kv * omp_get_max_threads() ? h_kv : 1;
    /* task t: (request, query block, KV head), requests in order, each request's blocks from its last (most keys) */
    int64_t *task0 = malloc(sizeof(int64_t) * (size_t)(num_reqs + 1));
    if (!task0) return -1;
    task0[0] = 0;
    for (int64_t r = 0; r < num_reqs; r++) task0[r + 1] = task0[r] + (q_len[r] + qb - 1) / qb * h_kv;
    int failed = 0;
#pragma omp parallel reduction(| : failed) if (parallel)
    {
#if KV_AMX
    amx_attention_configure(); /* each thread's tiles, for all its tasks */
#endif
#pragma omp for schedule(dynamic, chunk)
    for (int64_t t = 0; t < n_tasks; t++) {
        int64_t r = 0;
        while (task0[r + 1] <= t) r++;
        const int64_t local = t - task0[r], nb = (q_len[r] + qb - 1) / qb, blk = nb - 1 - local / h_kv;
        const int64_t i0 = blk * qb, i1 = i0 + qb < q_len[r] ? i0 + qb : q_len[r];
        failed |= FN(attend_task)(q + q_start[r] * q_stride, q_stride, k_cache, v_cache,
                                  block_tables + r * max_blocks, q_len[r], seq_len[r], i0, i1, local % h_kv, G, h_kv,
                                  d, block_size, scale, window, cap, sinks, out + q_start[r] * out_stride,
                                  out_stride) != 0;
    }
#if KV_AMX
    _tile_release();
#endif
    }
    free(task0);
    return failed ? -1 : 0;
}

/* The kernel above for rows q (row stride q_stride floats) written to out (row stride out_stride); window: the
 * sliding window in keys (0: none), softcap: the attention-logit cap (0: none), sinks: h_q floats, each query
 * head's attention-sink logit (softmax above; NULL: none). */
int FN(kvserve_paged_attention)(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                                const int64_t *block_tables, int64_t max_blocks, const int64_t *q_start,
                                const int64_t *q_len, const int64_t *seq_len, int64_t num_reqs, int64_t h_q,
                                int64_t h_kv, int64_t d, int64_t block_size, float scale, float *out,
                                int64_t out_stride, int64_t window, float softcap, const float *sinks) {
    return FN(attend)(q, q_stride, (const KV_T *)k_cache, (const KV_T *)v_cache, block_tables, max_blocks, q_start,
                      q_len, seq_len, num_reqs, h_q, h_kv, d, block_size, scale, window, softcap, sinks, out,
                      out_stride);
}

/* One attention layer's work after the fused Q/K/V projection, in one call:
 *   1. RoPE on the query and key heads of every row of qkv, in place (row t: H_q query heads, H_kv key heads,
 *      H_kv value heads of d floats, at qkv + t * qkv_stride), with cos/sin rows t of cos, sin ([T, d]);
 *   2. each row's key and value heads stored (KV_STORE_ROW) into cache slot slot_mapping[t] (k_cache, v_cache:
 *      [slots, H_kv, d + KV_EXTRA] of KV_T);
 *   3. attention of the num_reqs requests given (0: none) over their paged K/V into out (row stride out_stride),
 *      as kvserve_paged_attention_<type>_<isa> (with its window and softcap). Rows of other requests are not
 *      written.
 * Returns 0, or -1 when step 3 could not allocate scratch memory (steps 1 and 2 are then done, out not written). */
int FN(kvserve_rope_write_attend_sink)(float *qkv, int64_t qkv_stride, int64_t T, const float *cos,
                                       const float *sin, const int64_t *slot_mapping, void *k_cache, void *v_cache,
                                       const int64_t *block_tables, int64_t max_blocks, const int64_t *q_start,
                                       const int64_t *q_len, const int64_t *seq_len, int64_t num_reqs, int64_t h_q,
                                       int64_t h_kv, int64_t d, int64_t block_size, float scale, float *out,
                                       int64_t out_stride, int64_t window, float softcap, const float *sinks) {
    const int64_t row = h_kv * (d + KV_EXTRA);
#pragma omp parallel for schedule(static) if (T * (h_q + h_kv) * d >= PARALLEL_MIN_ROPE_FLOATS)
    for (int64_t t = 0; t < T; t++) {
        float *x = qkv + t * qkv_stride;
        rope_heads(x, h_q + h_kv, d, cos + t * d, sin + t * d);
        KV_STORE_ROW((KV_T *)k_cache + slot_mapping[t] * row, x + h_q * d, h_kv, d);
        KV_STORE_ROW((KV_T *)v_cache + slot_mapping[t] * row, x + (h_q + h_kv) * d, h_kv, d);
    }
    if (num_reqs == 0) return 0;
    return FN(attend)(qkv, qkv_stride, (const KV_T *)k_cache, (const KV_T *)v_cache, block_tables, max_blocks,
                      q_start, q_len, seq_len, num_reqs, h_q, h_kv, d, block_size, scale, window, softcap, sinks,
                      out, out_stride);
}

/* kvserve_rope_write_attend_sink with no sinks (the signature decoder.c's layer loop calls: a window and a cap). */
int FN(kvserve_rope_write_attend_sw)(float *qkv, int64_t qkv_stride, int64_t T, const float *cos, const float *sin,
                                     const int64_t *slot_mapping, void *k_cache, void *v_cache,
                                     const int64_t *block_tables, int64_t max_blocks, const int64_t *q_start,
                                     const int64_t *q_len, const int64_t *seq_len, int64_t num_reqs, int64_t h_q,
                                     int64_t h_kv, int64_t d, int64_t block_size, float scale, float *out,
                                     int64_t out_stride, int64_t window, float softcap) {
    return FN(kvserve_rope_write_attend_sink)(qkv, qkv_stride, T, cos, sin, slot_mapping, k_cache, v_cache,
                                              block_tables, max_blocks, q_start, q_len, seq_len, num_reqs, h_q, h_kv,
                                              d, block_size, scale, out, out_stride, window, softcap, NULL);
}

/* kvserve_rope_write_attend_sw with no window and no cap (the signature decoder.c's layer loop calls). */
int FN(kvserve_rope_write_attend)(float *qkv, int64_t qkv_stride, int64_t T, const float *cos, const float *sin,
                                  const int64_t *slot_mapping, void *k_cache, void *v_cache,
                                  const int64_t *block_tables, int64_t max_blocks, const int64_t *q_start,
                                  const int64_t *q_len, const int64_t *seq_len, int64_t num_reqs, int64_t h_q,
                                  int64_t h_kv, int64_t d, int64_t block_size, float scale, float *out,
                                  int64_t out_stride) {
    return FN(kvserve_rope_write_attend_sw)(qkv, qkv_stride, T, cos, sin, slot_mapping, k_cache, v_cache,
                                            block_tables, max_blocks, q_start, q_len, seq_len, num_reqs, h_q, h_kv, d,
                                            block_size, scale, out, out_stride, 0, 0.0f);
}

#undef KV_T
#undef FN
#undef KV_EXTRA
#undef KV_SCALE
#undef KV_LOADV
#undef KV_STORE_ROW
#undef KV_AMX
#undef KV_PAIRS
#undef KV_LOAD_PAIRS
#undef KV_STORE_PAIRS
#undef TK
