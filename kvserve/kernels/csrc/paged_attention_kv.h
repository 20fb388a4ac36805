/* The paged-attention kernels of paged_attention.c for one KV-cache element type, included once per type with:
 *   KV_T          the cache's element type (float, or uint16_t holding bfloat16 bits);
 *   KV_NAME(x)    x with the type's suffix (x##_f32, x##_bf16);
 *   KV_LOAD8(p)   8 consecutive elements at p as an __m256 of float32;
 *   KV_STORE_ROW(dst, src, n)  n float32 values at src stored as n elements at dst.
 * The macros are undefined at the end, ready for the next type. */

/* q . k over d values (d % 8 == 0; q float32, k a cache row of KV_T widened to float32) with four independent
 * accumulator chains: one chain would wait on the FMA latency at every step. */
static inline float KV_NAME(dot)(const float *a, const KV_T *b, int64_t d) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 32 <= d; j += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), KV_LOAD8(b + j), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 8), KV_LOAD8(b + j + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 16), KV_LOAD8(b + j + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 24), KV_LOAD8(b + j + 24), s3);
    }
    for (; j < d; j += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), KV_LOAD8(b + j), s0);
    return hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
}

/* a[0..d) = sum over keys j in [0, n) of p[j] * v[j][0..d) (v[j] = v_base + slot[j]), accumulated in ascending j
 * with one FMA per term, stored to a. d % 8 == 0. Up to 64 floats (8 registers) per pass: each register's chain
 * waits on the FMA latency once per key, so the more independent chains a pass carries, the fewer cycles per key
 * (and each value row is read once per pass). Every element's sum is the same chain whatever the pass width. */
static inline void KV_NAME(weighted_sum)(const float *p, const KV_T *v_base, const int64_t *slot, int64_t n,
                                         int64_t d, float *a) {
    int64_t c = 0;
    for (; c + 64 <= d; c += 64) {
        __m256 x[8];
        for (int u = 0; u < 8; u++) x[u] = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const KV_T *v = v_base + slot[j] + c;
            const __m256 pj = _mm256_set1_ps(p[j]);
            for (int u = 0; u < 8; u++) x[u] = _mm256_fmadd_ps(pj, KV_LOAD8(v + 8 * u), x[u]);
        }
        for (int u = 0; u < 8; u++) _mm256_storeu_ps(a + c + 8 * u, x[u]);
    }
    for (; c + 32 <= d; c += 32) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const KV_T *v = v_base + slot[j] + c;
            __m256 pj = _mm256_set1_ps(p[j]);
            a0 = _mm256_fmadd_ps(pj, KV_LOAD8(v), a0);
            a1 = _mm256_fmadd_ps(pj, KV_LOAD8(v + 8), a1);
            a2 = _mm256_fmadd_ps(pj, KV_LOAD8(v + 16), a2);
            a3 = _mm256_fmadd_ps(pj, KV_LOAD8(v + 24), a3);
        }
        _mm256_storeu_ps(a + c, a0);
        _mm256_storeu_ps(a + c + 8, a1);
        _mm256_storeu_ps(a + c + 16, a2);
        _mm256_storeu_ps(a + c + 24, a3);
    }
    for (; c < d; c += 8) {
        __m256 a0 = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++) a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), KV_LOAD8(v_base + slot[j] + c), a0);
        _mm256_storeu_ps(a + c, a0);
    }
}

/* out_h[0..16) = sum over keys j in [0, n) of p_h[j] * v[j][c..c+16) for the G <= SPREAD_MAX_G query heads h of one
 * KV head (p_h = p + h * p_stride, out_h = out + h * out_stride), v[j] = v_base + slot[j]: each value line is
 * read once for all G heads, and the pass carries 2 G independent chains. Every output element is the same chain as
 * in weighted_sum (one FMA per key, keys ascending, from zero), so the sums are equal bit for bit. The value line
 * SPREAD_PREFETCH_KEYS keys ahead is requested, as nothing else has brought it in. */
static inline void KV_NAME(weighted_sum16)(const float *p, int64_t p_stride, int G, const KV_T *v_base,
                                           const int64_t *slot, int64_t n, float *out, int64_t out_stride) {
    __m256 lo[SPREAD_MAX_G], hi[SPREAD_MAX_G];
    for (int h = 0; h < G; h++) lo[h] = hi[h] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        if (j + SPREAD_PREFETCH_KEYS < n)
            _mm_prefetch((const char *)(v_base + slot[j + SPREAD_PREFETCH_KEYS]), _MM_HINT_T0);
        const KV_T *v = v_base + slot[j];
        const __m256 v0 = KV_LOAD8(v), v1 = KV_LOAD8(v + 8);
        for (int h = 0; h < G; h++) {
            const __m256 pj = _mm256_set1_ps(p[h * p_stride + j]);
            lo[h] = _mm256_fmadd_ps(pj, v0, lo[h]);
            hi[h] = _mm256_fmadd_ps(pj, v1, hi[h]);
        }
    }
    for (int h = 0; h < G; h++) {
        _mm256_storeu_ps(out + h * out_stride, lo[h]);
        _mm256_storeu_ps(out + h * out_stride + 8, hi[h]);
    }
}

/* The attention of a few requests (fewer than two per thread), spread over the threads *inside* each request with
 * the arithmetic of KV_NAME(attend) unchanged, so the result is the same bit for bit (and the same whichever way a
 * step is split; batch invariance holds). Per-request tasks would leave threads idle: one decode request is one
 * task (or one per KV head: 3 for 2 threads).
 *   1. scores: each request's keys in contiguous chunks, a task per chunk; every score is one dot product of a
 *      query head and a whole key row, whoever computes it;
 *   2. softmax: a task per (query row, head);
 *   3. weighted sums: a task per (query row, KV head, 16 columns): all G query heads of the KV head at once, each
 *      output element the same chain over the keys as in weighted_sum.
 * Returns 0, or -1 when scratch memory could not be allocated (nothing written). */
static int KV_NAME(attend_spread)(const float *q, int64_t q_stride, const KV_T *k_cache, const KV_T *v_cache,
                                  const int64_t *block_tables, int64_t max_blocks, const int64_t *q_start,
                                  const int64_t *q_len, const int64_t *seq_len, int64_t num_reqs, int64_t h_q,
                                  int64_t h_kv, int64_t d, int64_t block_size, float scale, float *out,
                                  int64_t out_stride, int threads) {
    const int64_t g = h_q / h_kv, row = h_kv * d, cols = d / 16;
    /* per request: its slot list and scores [q_len][h_q][L] in one buffer; offsets (elements) in base[] */
    int64_t *base = malloc(sizeof(int64_t) * (size_t)(3 * (num_reqs + 1)));
    if (!base) return -1;
    int64_t *slot_off = base, *score_off = base + num_reqs + 1, *chunk0 = base + 2 * num_reqs + 2;
    const int64_t chunks_per_req = (2 * threads + num_reqs - 1) / num_reqs;
    slot_off[0] = score_off[0] = chunk0[0] = 0;
    for (int64_t r = 0; r < num_reqs; r++) {
        slot_off[r + 1] = slot_off[r] + seq_len[r];
        score_off[r + 1] = score_off[r] + q_len[r] * h_q * seq_len[r];
        chunk0[r + 1] = chunk0[r] + (seq_len[r] < chunks_per_req ? seq_len[r] : chunks_per_req);
    }
    const int64_t n_chunks = chunk0[num_reqs];
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)slot_off[num_reqs] + sizeof(float) * (size_t)score_off[num_reqs]);
    if (!slots) { free(base); return -1; }
    float *scores = (float *)(slots + slot_off[num_reqs]);
    /* the (query row, ...) task lists of phases 2 and 3 are indexed through the rows' prefix sums */
    int64_t n_rows = 0;
    for (int64_t r = 0; r < num_reqs; r++) n_rows += q_len[r];
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < num_reqs; r++) { /* the block tables walked once, without a division per key */
            const int64_t *table = block_tables + r * max_blocks;
            int64_t *slot = slots + slot_off[r];
            for (int64_t j = 0, b = 0, o = 0; j < seq_len[r]; j++) {
                slot[j] = (table[b] * block_size + o) * row;
                if (++o == block_size) { o = 0; b++; }
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < n_chunks; c++) {
            int64_t r = 0;
            while (chunk0[r + 1] <= c) r++;
            const int64_t nc = chunk0[r + 1] - chunk0[r], L = seq_len[r], n = q_len[r], first = L - n;
            const int64_t j0 = L * (c - chunk0[r]) / nc, j1 = L * (c - chunk0[r] + 1) / nc;
            const int64_t *slot = slots + slot_off[r];
            const float *qr = q + q_start[r] * q_stride;
            float *s = scores + score_off[r];
            for (int64_t j = j0; j < j1; j++) {
                const KV_T *kj = k_cache + slot[j];
                if (j + PREFETCH_KEYS < j1)
                    prefetch_bytes(k_cache + slot[j + PREFETCH_KEYS], row * (int64_t)sizeof(KV_T));
                for (int64_t i = (j > first ? j - first : 0); i < n; i++)
                    for (int64_t h = 0; h < h_q; h++)
                        s[(i * h_q + h) * L + j] = scale * KV_NAME(dot)(qr + i * q_stride + h * d, kj + (h / g) * d, d);
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < n_rows * h_q; t++) {
            int64_t r = 0, i = t / h_q;
            while (i >= q_len[r]) i -= q_len[r++];
            const int64_t L = seq_len[r];
            softmax(scores + score_off[r] + (i * h_q + t % h_q) * L, L - q_len[r] + i + 1);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < n_rows * h_kv * cols; t++) {
            int64_t r = 0, i = t / (h_kv * cols);
            while (i >= q_len[r]) i -= q_len[r++];
            const int64_t kh = t / cols % h_kv, c = t % cols, L = seq_len[r], h0 = kh * g;
            const int64_t *slot = slots + slot_off[r];
            for (int64_t e = 0; e < g; e += SPREAD_MAX_G)
                KV_NAME(weighted_sum16)(scores + score_off[r] + (i * h_q + h0 + e) * L, L,
                                        (int)(g - e < SPREAD_MAX_G ? g - e : SPREAD_MAX_G),
                                        v_cache + kh * d + 16 * c, slot, L - q_len[r] + i + 1,
                                        out + (q_start[r] + i) * out_stride + (h0 + e) * d + 16 * c, d);
        }
    }
    free(slots);
    free(base);
    return 0;
}

/* Attention of num_reqs requests (see the file comment). Returns 0, or -1 when scratch memory could not be
 * allocated. */
static int KV_NAME(attend)(const float *q, int64_t q_stride, const KV_T *k_cache, const KV_T *v_cache,
                  const int64_t *block_tables, int64_t max_blocks, const int64_t *q_start, const int64_t *q_len,
                  const int64_t *seq_len, int64_t num_reqs, int64_t h_q, int64_t h_kv, int64_t d, int64_t block_size,
                  float scale, float *out, int64_t out_stride) {
    const int64_t g = h_q / h_kv, row = h_kv * d; /* query heads per KV head; floats per cache slot */
    int64_t macs = 0;
    for (int64_t r = 0; r < num_reqs; r++) macs += q_len[r] * seq_len[r];
    macs *= h_q * d;
    const int threads = omp_get_max_threads(), parallel = threads > 1 && macs >= PARALLEL_MIN_MACS;
    /* the spread keeps every request's scores (macs / d floats) at once: long prompt chunks stay per request */
    if (threads > 1 && macs >= SPREAD_MIN_MACS && num_reqs < 2 * threads && d % 16 == 0 &&
        macs / d <= SPREAD_MAX_SCORE_FLOATS)
        return KV_NAME(attend_spread)(q, q_stride, k_cache, v_cache, block_tables, max_blocks, q_start, q_len, seq_len,
                                      num_reqs, h_q, h_kv, d, block_size, scale, out, out_stride, threads);
    /* A task is one request and nk of its KV heads. On one thread, or with enough requests to keep every thread
     * busy, a task takes all heads, so it reads each cache slot as one contiguous row (which the hardware prefetcher
     * follows); otherwise one KV head each, for parallelism. The heads' arithmetic is the same either way. */
    const int64_t nk = !parallel || num_reqs >= 2 * threads ? h_kv : 1, per_req = h_kv / nk, hq = nk * g;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed) if (parallel)
    for (int64_t task = 0; task < num_reqs * per_req; task++) {
        const int64_t r = task / per_req, k0 = (task % per_req) * nk, n = q_len[r], L = seq_len[r], first = L - n;
        const int64_t *table = block_tables + r * max_blocks;
        const float *qr = q + q_start[r] * q_stride + k0 * g * d; /* query head h of row i: qr + i*q_stride + h*d */
        /* slot[L]: offset (elements) of KV head k0 of key j in the cache; then scores [n * hq][L] */
        int64_t *slot = malloc(sizeof(int64_t) * (size_t)L + sizeof(float) * (size_t)(n * hq) * (size_t)L);
        if (!slot) { failed = 1; continue; }
        float *s = (float *)(slot + L);
        for (int64_t j = 0, b = 0, o = 0; j < L; j++) { /* the block table walked once, without a division per key */
            slot[j] = (table[b] * block_size + o) * row + k0 * d;
            if (++o == block_size) { o = 0; b++; }
        }
        for (int64_t j = 0; j < L; j++) {
            const KV_T *kj = k_cache + slot[j];
            if (j + PREFETCH_KEYS < L) { /* this key's and value's rows, ahead (values: for the weighted sums) */
                prefetch_bytes(k_cache + slot[j + PREFETCH_KEYS], nk * d * (int64_t)sizeof(KV_T));
                prefetch_bytes(v_cache + slot[j + PREFETCH_KEYS], nk * d * (int64_t)sizeof(KV_T));
            }
            for (int64_t i = (j > first ? j - first : 0); i < n; i++) /* rows that see key j */
                for (int64_t kh = 0, h = 0; kh < nk; kh++)
                    for (int64_t e = 0; e < g; e++, h++)
                        s[(i * hq + h) * L + j] = scale * KV_NAME(dot)(qr + i * q_stride + h * d, kj + kh * d, d);
        }
        for (int64_t i = 0; i < n; i++)
            for (int64_t kh = 0, h = 0; kh < nk; kh++)
                for (int64_t e = 0; e < g; e++, h++) {
                    float *p = s + (i * hq + h) * L;
                    softmax(p, first + i + 1); /* row i sees keys 0 .. first + i */
                    KV_NAME(weighted_sum)(p, v_cache + kh * d, slot, first + i + 1, d,
                                          out + (q_start[r] + i) * out_stride + (k0 * g + h) * d);
                }
        free(slot);
    }
    return failed ? -1 : 0;
}

/* The kernel above for rows q (row stride q_stride floats) written to out (row stride out_stride). */
int KV_NAME(kvserve_paged_attention)(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                                const int64_t *block_tables, int64_t max_blocks, const int64_t *q_start,
                                const int64_t *q_len, const int64_t *seq_len, int64_t num_reqs, int64_t h_q,
                                int64_t h_kv, int64_t d, int64_t block_size, float scale, float *out,
                                int64_t out_stride) {
    return KV_NAME(attend)(q, q_stride, (const KV_T *)k_cache, (const KV_T *)v_cache, block_tables, max_blocks,
                           q_start, q_len, seq_len, num_reqs, h_q, h_kv, d, block_size, scale, out, out_stride);
}

/* One attention layer's work after the fused Q/K/V projection, in one call:
 *   1. RoPE on the query and key heads of every row of qkv, in place (row t: H_q query heads, H_kv key heads,
 *      H_kv value heads of d floats, at qkv + t * qkv_stride), with cos/sin rows t of cos, sin ([T, d]);
 *   2. each row's key and value heads stored (KV_STORE_ROW) into cache slot slot_mapping[t] (k_cache, v_cache:
 *      [slots, H_kv, d] of KV_T);
 *   3. attention of the num_reqs requests given (the short queries; 0: none) over their paged K/V into out (row
 *      stride out_stride), as kvserve_paged_attention_<type>. Rows of other requests are not written.
 * Returns 0, or -1 when step 3 could not allocate scratch memory (steps 1 and 2 are then done, out not written). */
int KV_NAME(kvserve_rope_write_attend)(float *qkv, int64_t qkv_stride, int64_t T, const float *cos, const float *sin,
                                  const int64_t *slot_mapping, void *k_cache, void *v_cache,
                                  const int64_t *block_tables, int64_t max_blocks, const int64_t *q_start,
                                  const int64_t *q_len, const int64_t *seq_len, int64_t num_reqs, int64_t h_q,
                                  int64_t h_kv, int64_t d, int64_t block_size, float scale, float *out,
                                  int64_t out_stride) {
    const int64_t row = h_kv * d;
#pragma omp parallel for schedule(static) if (T * (h_q + h_kv) * d >= PARALLEL_MIN_ROPE_FLOATS)
    for (int64_t t = 0; t < T; t++) {
        float *x = qkv + t * qkv_stride;
        rope_heads(x, h_q + h_kv, d, cos + t * d, sin + t * d);
        KV_STORE_ROW((KV_T *)k_cache + slot_mapping[t] * row, x + h_q * d, row);
        KV_STORE_ROW((KV_T *)v_cache + slot_mapping[t] * row, x + (h_q + h_kv) * d, row);
    }
    if (num_reqs == 0) return 0;
    return KV_NAME(attend)(qkv, qkv_stride, (const KV_T *)k_cache, (const KV_T *)v_cache, block_tables, max_blocks,
                           q_start, q_len, seq_len, num_reqs, h_q, h_kv, d, block_size, scale, out, out_stride);
}

#undef KV_T
#undef KV_NAME
#undef KV_LOAD8
#undef KV_STORE_ROW
