/* Paged attention for short queries (decode tokens, speculative verification spans), float32, AVX2 + FMA.
 *
 * PagedAttention (Kwon et al., SOSP 2023, section 4.1): each request's keys and values are read in place from the
 * global block pool through its block table, with no gathered copy. One task per request (or per request and KV
 * head, when there are few requests) walks the request's blocks once: all G = H_q / H_kv query heads of each KV
 * head (GQA) and all of the request's query rows share each key and value row while it is in cache. Softmax is
 * exact and in float32: scores for the whole context go to a scratch buffer, then max, exp, sum (8 lanes at a time),
 * and the weighted sum of values (in registers, one query head at a time). The block table is walked once per task
 * into a list of slot offsets (no integer division per key).
 *
 * kvserve_rope_write_attend_f32 is a decoder layer's whole attention step after the fused Q/K/V projection in one
 * call (RoPE on q and k, the K/V write into the cache slots, this kernel), so a layer makes one call instead of a
 * dozen PyTorch ops (each a dispatch and a new tensor) and a kernel call.
 *
 * Causality: query row i of a request with q_len rows and seq_len keys sits at position seq_len - q_len + i and
 * sees keys 0..that position.
 *
 * Layout: k_cache, v_cache: [num_blocks, block_size, H_kv, D] (one layer's K or V); q: row t, head h at
 * q + t * q_stride + h * D; out: row t, head h at out + t * out_stride + h * D. D must be a multiple of 8.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

/* q . k over d floats (d % 8 == 0) with four independent accumulator chains: one chain would wait on the FMA
 * latency at every step. */
static inline float dot(const float *a, const float *b, int64_t d) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 32 <= d; j += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 8), _mm256_loadu_ps(b + j + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 16), _mm256_loadu_ps(b + j + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 24), _mm256_loadu_ps(b + j + 24), s3);
    }
    for (; j < d; j += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), s0);
    return hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
}

/* p[0..n) = softmax(p[0..n)) in place (n >= 1), 8 lanes at a time. */
static void softmax(float *p, int64_t n) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(p + j));
    float m = -INFINITY, lanes[8];
    _mm256_storeu_ps(lanes, mv);
    for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
    for (; j < n; j++) m = p[j] > m ? p[j] : m;
    __m256 sv = _mm256_setzero_ps(), m8 = _mm256_set1_ps(m);
    for (j = 0; j + 8 <= n; j += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + j), m8));
        _mm256_storeu_ps(p + j, e);
        sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum(sv);
    for (; j < n; j++) { p[j] = expf(p[j] - m); sum += p[j]; }
    __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (j = 0; j + 8 <= n; j += 8) _mm256_storeu_ps(p + j, _mm256_mul_ps(_mm256_loadu_ps(p + j), inv));
    for (; j < n; j++) p[j] *= 1.0f / sum;
}

/* Keys are scattered over blocks and each row is read once, so the hardware prefetcher cannot guess the next one;
 * asking for the row PREFETCH_KEYS ahead hides the memory latency. */
#define PREFETCH_KEYS 8
static inline void prefetch_floats(const float *p, int64_t n_floats) {
    for (int64_t b = 0; b < n_floats * (int64_t)sizeof(float); b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}

/* a[0..d) = sum over keys j in [0, n) of p[j] * v[j][0..d) (v[j] = v_base + slot[j]), accumulated in ascending j
 * with one FMA per term, 32 floats (4 registers) at a time; stored to a. d % 8 == 0. */
static inline void weighted_sum(const float *p, const float *v_base, const int64_t *slot, int64_t n, int64_t d,
                                float *a) {
    int64_t c = 0;
    for (; c + 32 <= d; c += 32) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const float *v = v_base + slot[j] + c;
            __m256 pj = _mm256_set1_ps(p[j]);
            a0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v), a0);
            a1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 16), a2);
            a3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 24), a3);
        }
        _mm256_storeu_ps(a + c, a0);
        _mm256_storeu_ps(a + c + 8, a1);
        _mm256_storeu_ps(a + c + 16, a2);
        _mm256_storeu_ps(a + c + 24, a3);
    }
    for (; c < d; c += 8) {
        __m256 a0 = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++) a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v_base + slot[j] + c), a0);
        _mm256_storeu_ps(a + c, a0);
    }
}

/* Tasks with at least this many multiply-adds (queries x keys x D) in all are split over OpenMP threads; below it
 * one thread does them all (a decode step of one short request: waking a second thread costs more than it saves). */
#define PARALLEL_MIN_MACS (256 * 1024)

/* Attention of num_reqs requests (see the file comment). Returns 0, or -1 when scratch memory could not be
 * allocated. */
static int attend(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                  const int64_t *block_tables, int64_t max_blocks, const int64_t *q_start, const int64_t *q_len,
                  const int64_t *seq_len, int64_t num_reqs, int64_t h_q, int64_t h_kv, int64_t d, int64_t block_size,
                  float scale, float *out, int64_t out_stride) {
    const int64_t g = h_q / h_kv, row = h_kv * d; /* query heads per KV head; floats per cache slot */
    int64_t macs = 0;
    for (int64_t r = 0; r < num_reqs; r++) macs += q_len[r] * seq_len[r];
    macs *= h_q * d;
    const int threads = omp_get_max_threads(), parallel = threads > 1 && macs >= PARALLEL_MIN_MACS;
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
        /* slot[L]: offset (floats) of KV head k0 of key j in the cache; then scores [n * hq][L] */
        int64_t *slot = malloc(sizeof(int64_t) * (size_t)L + sizeof(float) * (size_t)(n * hq) * (size_t)L);
        if (!slot) { failed = 1; continue; }
        float *s = (float *)(slot + L);
        for (int64_t j = 0, b = 0, o = 0; j < L; j++) { /* the block table walked once, without a division per key */
            slot[j] = (table[b] * block_size + o) * row + k0 * d;
            if (++o == block_size) { o = 0; b++; }
        }
        for (int64_t j = 0; j < L; j++) {
            const float *kj = k_cache + slot[j];
            if (j + PREFETCH_KEYS < L) { /* this key's and value's rows, ahead (values: for the weighted sums) */
                prefetch_floats(k_cache + slot[j + PREFETCH_KEYS], nk * d);
                prefetch_floats(v_cache + slot[j + PREFETCH_KEYS], nk * d);
            }
            for (int64_t i = (j > first ? j - first : 0); i < n; i++) /* rows that see key j */
                for (int64_t kh = 0, h = 0; kh < nk; kh++)
                    for (int64_t e = 0; e < g; e++, h++)
                        s[(i * hq + h) * L + j] = scale * dot(qr + i * q_stride + h * d, kj + kh * d, d);
        }
        for (int64_t i = 0; i < n; i++)
            for (int64_t kh = 0, h = 0; kh < nk; kh++)
                for (int64_t e = 0; e < g; e++, h++) {
                    float *p = s + (i * hq + h) * L;
                    softmax(p, first + i + 1); /* row i sees keys 0 .. first + i */
                    weighted_sum(p, v_cache + kh * d, slot, first + i + 1, d,
                                 out + (q_start[r] + i) * out_stride + (k0 * g + h) * d);
                }
        free(slot);
    }
    return failed ? -1 : 0;
}

/* The kernel above for rows q (row stride q_stride floats) written to out (row stride out_stride). */
int kvserve_paged_attention_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                                const int64_t *block_tables, int64_t max_blocks, const int64_t *q_start,
                                const int64_t *q_len, const int64_t *seq_len, int64_t num_reqs, int64_t h_q,
                                int64_t h_kv, int64_t d, int64_t block_size, float scale, float *out,
                                int64_t out_stride) {
    return attend(q, q_stride, k_cache, v_cache, block_tables, max_blocks, q_start, q_len, seq_len, num_reqs, h_q,
                  h_kv, d, block_size, scale, out, out_stride);
}

/* RoPE, rotate-half form (GPT-NeoX; Hugging Face Llama's apply_rotary_pos_emb; Su et al. 2021), in place on n heads
 * of d floats at x: with a = x[:d/2], b = x[d/2:], x = [a cos_lo - b sin_lo, b cos_hi + a sin_hi] (cos, sin: the
 * d-float rows of this token). Each product is rounded, then added, with no fused multiply-add, exactly as
 * PyTorch's x * cos + rotate_half(x) * sin, so both give the same bits. */
__attribute__((optimize("fp-contract=off"))) static void rope_heads(float *x, int64_t n, int64_t d, const float *c,
                                                                    const float *s) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < n; h++) {
        float *lo = x + h * d, *hi = lo + half;
        int64_t i = 0;
        for (; i + 8 <= half; i += 8) {
            __m256 a = _mm256_loadu_ps(lo + i), b = _mm256_loadu_ps(hi + i);
            __m256 ac = _mm256_mul_ps(a, _mm256_loadu_ps(c + i)), bs = _mm256_mul_ps(b, _mm256_loadu_ps(s + i));
            __m256 bc = _mm256_mul_ps(b, _mm256_loadu_ps(c + half + i));
            __m256 as = _mm256_mul_ps(a, _mm256_loadu_ps(s + half + i));
            _mm256_storeu_ps(lo + i, _mm256_sub_ps(ac, bs));
            _mm256_storeu_ps(hi + i, _mm256_add_ps(bc, as));
        }
        for (; i < half; i++) {
            float a = lo[i], b = hi[i];
            float ac = a * c[i], bs = b * s[i], bc = b * c[half + i], as = a * s[half + i];
            lo[i] = ac - bs;
            hi[i] = bc + as;
        }
    }
}

#define PARALLEL_MIN_ROPE_FLOATS 65536

/* One attention layer's work after the fused Q/K/V projection, in one call:
 *   1. RoPE on the query and key heads of every row of qkv, in place (row t: H_q query heads, H_kv key heads,
 *      H_kv value heads of d floats, at qkv + t * qkv_stride), with cos/sin rows t of cos, sin ([T, d]);
 *   2. each row's key and value heads copied into cache slot slot_mapping[t] (k_cache, v_cache: [slots, H_kv, d]);
 *   3. attention of the num_reqs requests given (the short queries; 0: none) over their paged K/V into out (row
 *      stride out_stride), as kvserve_paged_attention_f32. Rows of other requests are not written.
 * Returns 0, or -1 when step 3 could not allocate scratch memory (steps 1 and 2 are then done, out not written). */
int kvserve_rope_write_attend_f32(float *qkv, int64_t qkv_stride, int64_t T, const float *cos, const float *sin,
                                  const int64_t *slot_mapping, float *k_cache, float *v_cache,
                                  const int64_t *block_tables, int64_t max_blocks, const int64_t *q_start,
                                  const int64_t *q_len, const int64_t *seq_len, int64_t num_reqs, int64_t h_q,
                                  int64_t h_kv, int64_t d, int64_t block_size, float scale, float *out,
                                  int64_t out_stride) {
    const int64_t row = h_kv * d;
#pragma omp parallel for schedule(static) if (T * (h_q + h_kv) * d >= PARALLEL_MIN_ROPE_FLOATS)
    for (int64_t t = 0; t < T; t++) {
        float *x = qkv + t * qkv_stride;
        rope_heads(x, h_q + h_kv, d, cos + t * d, sin + t * d);
        memcpy(k_cache + slot_mapping[t] * row, x + h_q * d, sizeof(float) * (size_t)row);
        memcpy(v_cache + slot_mapping[t] * row, x + (h_q + h_kv) * d, sizeof(float) * (size_t)row);
    }
    if (num_reqs == 0) return 0;
    return attend(qkv, qkv_stride, k_cache, v_cache, block_tables, max_blocks, q_start, q_len, seq_len, num_reqs, h_q,
                  h_kv, d, block_size, scale, out, out_stride);
}
