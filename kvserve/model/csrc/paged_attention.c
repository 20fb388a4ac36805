/* Paged attention for short queries (decode tokens, speculative verification spans), float32, AVX2 + FMA.
 *
 * PagedAttention (Kwon et al., SOSP 2023, section 4.1): each request's keys and values are read in place from the
 * global block pool through its block table, with no gathered copy. One task per (request, KV head) walks the
 * request's blocks once: all G = H_q / H_kv query heads of that KV head (GQA) and all of the request's query rows
 * share each key and value row while it is in cache. Softmax is exact and in float32: scores for the whole context
 * go to a scratch buffer, then max, exp, sum, and the weighted sum of values.
 *
 * Causality: query row i of a request with q_len rows and seq_len keys sits at position seq_len - q_len + i and
 * sees keys 0..that position.
 *
 * Layout: k_cache, v_cache: [num_blocks, block_size, H_kv, D] (one layer's K or V); q: row t, head h at
 * q + t * q_stride + h * D; out: row t, head h at out + t * out_stride + h * D. D must be a multiple of 8.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float dot(const float *a, const float *b, int64_t d) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
    for (int64_t j = 8; j < d; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc);
    return hsum(acc);
}

/* Returns 0, or -1 when scratch memory could not be allocated (the caller then uses its fallback). */
int kvserve_paged_attention_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                                const int64_t *block_tables, int64_t max_blocks, const int64_t *q_start,
                                const int64_t *q_len, const int64_t *seq_len, int64_t num_reqs, int64_t h_q,
                                int64_t h_kv, int64_t d, int64_t block_size, float scale, float *out,
                                int64_t out_stride) {
    const int64_t g = h_q / h_kv, row = h_kv * d; /* query heads per KV head; floats per cache slot */
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (int64_t task = 0; task < num_reqs * h_kv; task++) {
        const int64_t r = task / h_kv, hk = task % h_kv, n = q_len[r], L = seq_len[r], first = L - n;
        const int64_t *table = block_tables + r * max_blocks;
        /* scores [n * g][L], then accumulators [n * g][d] */
        float *s = malloc(sizeof(float) * (size_t)(n * g) * (size_t)(L + d));
        if (!s) { failed = 1; continue; }
        float *acc = s + n * g * L;
        for (int64_t j = 0; j < L; j++) {
            const float *kj = k_cache + (table[j / block_size] * block_size + j % block_size) * row + hk * d;
            for (int64_t i = (j > first ? j - first : 0); i < n; i++) /* rows that see key j */
                for (int64_t h = 0; h < g; h++)
                    s[(i * g + h) * L + j] = scale * dot(q + (q_start[r] + i) * q_stride + (hk * g + h) * d, kj, d);
        }
        for (int64_t i = 0; i < n; i++) {
            const int64_t ctx = first + i + 1;
            for (int64_t h = 0; h < g; h++) {
                float *si = s + (i * g + h) * L, m = -INFINITY, sum = 0.f;
                for (int64_t j = 0; j < ctx; j++) m = si[j] > m ? si[j] : m;
                for (int64_t j = 0; j < ctx; j++) { si[j] = expf(si[j] - m); sum += si[j]; }
                for (int64_t j = 0; j < ctx; j++) si[j] /= sum;
                for (int64_t c = 0; c < d; c++) acc[(i * g + h) * d + c] = 0.f;
            }
        }
        for (int64_t j = 0; j < L; j++) {
            const float *vj = v_cache + (table[j / block_size] * block_size + j % block_size) * row + hk * d;
            for (int64_t i = (j > first ? j - first : 0); i < n; i++)
                for (int64_t h = 0; h < g; h++) {
                    float *a = acc + (i * g + h) * d;
                    __m256 p = _mm256_set1_ps(s[(i * g + h) * L + j]);
                    for (int64_t c = 0; c < d; c += 8)
                        _mm256_storeu_ps(a + c, _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + c), _mm256_loadu_ps(a + c)));
                }
        }
        for (int64_t i = 0; i < n; i++)
            for (int64_t h = 0; h < g; h++) {
                float *o = out + (q_start[r] + i) * out_stride + (hk * g + h) * d;
                for (int64_t c = 0; c < d; c++) o[c] = acc[(i * g + h) * d + c];
            }
        free(s);
    }
    return failed ? -1 : 0;
}
