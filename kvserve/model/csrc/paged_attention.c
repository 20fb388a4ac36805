/* Paged attention for short queries (decode tokens, speculative verification spans), float32, AVX2 + FMA.
 *
 * PagedAttention (Kwon et al., SOSP 2023, section 4.1): each request's keys and values are read in place from the
 * global block pool through its block table, with no gathered copy. One task per request (or per request and KV
 * head, when there are few requests) walks the request's blocks once: all G = H_q / H_kv query heads of each KV
 * head (GQA) and all of the request's query rows share each key and value row while it is in cache. Softmax is exact and in float32: scores for the whole context
 * go to a scratch buffer, then max, exp, sum (8 lanes at a time), and the weighted sum of values.
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
 * asking for the row PREFETCH_KEYS ahead, through the block table, hides the memory latency. */
#define PREFETCH_KEYS 8
static inline void prefetch_row(const float *cache, const int64_t *table, int64_t j, int64_t block_size, int64_t row,
                                int64_t offset, int64_t n_floats) {
    const char *p = (const char *)(cache + (table[j / block_size] * block_size + j % block_size) * row + offset);
    for (int64_t b = 0; b < n_floats * (int64_t)sizeof(float); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

/* Returns 0, or -1 when scratch memory could not be allocated (the caller then uses its fallback). */
int kvserve_paged_attention_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                                const int64_t *block_tables, int64_t max_blocks, const int64_t *q_start,
                                const int64_t *q_len, const int64_t *seq_len, int64_t num_reqs, int64_t h_q,
                                int64_t h_kv, int64_t d, int64_t block_size, float scale, float *out,
                                int64_t out_stride) {
    const int64_t g = h_q / h_kv, row = h_kv * d; /* query heads per KV head; floats per cache slot */
    /* A task is one request and nk of its KV heads. With enough requests to keep every thread busy a task takes all
     * heads, so it reads each cache slot as one contiguous row; otherwise one KV head each, for parallelism. */
    const int64_t nk = num_reqs >= 2 * omp_get_max_threads() ? h_kv : 1, per_req = h_kv / nk, hq = nk * g;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (int64_t task = 0; task < num_reqs * per_req; task++) {
        const int64_t r = task / per_req, k0 = (task % per_req) * nk, n = q_len[r], L = seq_len[r], first = L - n;
        const int64_t *table = block_tables + r * max_blocks;
        const float *qr = q + q_start[r] * q_stride + k0 * g * d; /* query head h of row i: qr + i*q_stride + h*d */
        /* scores [n * hq][L], then accumulators [n * hq][d]; query head h reads KV head k0 + h / g */
        float *s = malloc(sizeof(float) * (size_t)(n * hq) * (size_t)(L + d));
        if (!s) { failed = 1; continue; }
        float *acc = s + n * hq * L;
        for (int64_t j = 0; j < L; j++) {
            const float *kj = k_cache + (table[j / block_size] * block_size + j % block_size) * row + k0 * d;
            if (j + PREFETCH_KEYS < L) prefetch_row(k_cache, table, j + PREFETCH_KEYS, block_size, row, k0 * d, nk * d);
            for (int64_t i = (j > first ? j - first : 0); i < n; i++) /* rows that see key j */
                for (int64_t h = 0; h < hq; h++)
                    s[(i * hq + h) * L + j] = scale * dot(qr + i * q_stride + h * d, kj + (h / g) * d, d);
        }
        for (int64_t i = 0; i < n; i++)
            for (int64_t h = 0; h < hq; h++) {
                softmax(s + (i * hq + h) * L, first + i + 1);  /* row i sees keys 0 .. first + i */
                for (int64_t c = 0; c < d; c++) acc[(i * hq + h) * d + c] = 0.f;
            }
        for (int64_t j = 0; j < L; j++) {
            const float *vj = v_cache + (table[j / block_size] * block_size + j % block_size) * row + k0 * d;
            if (j + PREFETCH_KEYS < L) prefetch_row(v_cache, table, j + PREFETCH_KEYS, block_size, row, k0 * d, nk * d);
            for (int64_t i = (j > first ? j - first : 0); i < n; i++)
                for (int64_t h = 0; h < hq; h++) {
                    float *a = acc + (i * hq + h) * d;
                    const float *v = vj + (h / g) * d;
                    __m256 p = _mm256_set1_ps(s[(i * hq + h) * L + j]);
                    for (int64_t c = 0; c < d; c += 8)
                        _mm256_storeu_ps(a + c, _mm256_fmadd_ps(p, _mm256_loadu_ps(v + c), _mm256_loadu_ps(a + c)));
                }
        }
        for (int64_t i = 0; i < n; i++)
            for (int64_t h = 0; h < hq; h++) {
                float *o = out + (q_start[r] + i) * out_stride + (k0 * g + h) * d;
                for (int64_t c = 0; c < d; c++) o[c] = acc[(i * hq + h) * d + c];
            }
        free(s);
    }
    return failed ? -1 : 0;
}
