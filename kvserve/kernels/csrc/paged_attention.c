/* Paged attention for short queries (decode tokens, speculative verification spans), AVX2 + FMA, over a float32
 * or a bfloat16 KV cache (queries, scores, softmax and sums in float32 either way).
 *
 * PagedAttention (Kwon et al., SOSP 2023, section 4.1): each request's keys and values are read in place from the
 * global block pool through its block table, with no gathered copy. One task per request walks the request's
 * blocks once: all G = H_q / H_kv query heads of each KV head (GQA) and all of the request's query rows share each
 * key and value row while it is in cache. With fewer than two requests per thread (a batch-1 decode), at least
 * SPREAD_MIN_MACS of work and scores within SPREAD_MAX_SCORE_FLOATS, each request's work is spread over the threads
 * instead -- its keys' scores, then its softmaxes, then its weighted sums by KV head and 16 columns -- with the same
 * arithmetic, so the same bits (attend_spread). Softmax is
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
 *
 * The cache's element type is a template parameter: paged_attention_kv.h is included once per type and defines
 * kvserve_paged_attention_<type> and kvserve_rope_write_attend_<type> (f32, bf16). A bfloat16 cache halves the
 * bytes a decode step reads (attention of many long contexts is bound by reading them): keys and values are
 * rounded to bfloat16 when written (round to nearest even, as PyTorch's float -> bfloat16 cast, so the SDPA
 * path reads the same values) and widened to float32 exactly when read.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

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
static inline void prefetch_bytes(const void *p, int64_t n_bytes) {
    for (int64_t b = 0; b < n_bytes; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}

/* bfloat16 <-> float32. A bfloat16 is the top half of a float32, so widening is a 16-bit shift (exact). Narrowing
 * rounds to nearest, ties to even (overflow to infinity), as PyTorch's float -> bfloat16 conversion
 * (c10::BFloat16's round_to_nearest_even), bit for bit for every non-NaN value; a NaN becomes the quiet NaN 0x7fc0
 * (PyTorch's scalar path gives the same, its vectorized path 0xffff). */
static inline __m256 load8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0x7fc0;
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static inline void store_row_bf16(uint16_t *dst, const float *src, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(src + i);
        __m256i u = _mm256_castps_si256(x);
        __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                         _mm256_and_si256(_mm256_srli_epi32(u, 16),
                                                                          _mm256_set1_epi32(1))));
        r = _mm256_srli_epi32(r, 16);
        __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
        /* 8 x 32-bit -> 8 x 16-bit: pack within each 128-bit lane, then gather the two lanes' low halves */
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_castsi256_si128(packed));
    }
    for (; i < n; i++) dst[i] = bf16_round(src[i]);
}
static inline void store_row_f32(float *dst, const float *src, int64_t n) {
    memcpy(dst, src, sizeof(float) * (size_t)n);
}

/* Tasks with at least this many multiply-adds (queries x keys x D) in all are split over OpenMP threads; below it
 * one thread does them all (a decode step of one short request: waking a second thread costs more than it saves). */
#define PARALLEL_MIN_MACS (256 * 1024)

/* The spread kernel (a few requests' work split inside each request: attend_spread) runs from this many multiply-adds
 * (below, one thread); its weighted sums carry up to SPREAD_MAX_G query heads per pass (larger GQA groups take
 * several) and ask for each value line SPREAD_PREFETCH_KEYS keys ahead (measured: docs/benchmarks.md, "Batch-1
 * decode at long context"). */
#define SPREAD_MIN_MACS (192 * 1024)
#define SPREAD_MAX_G 4
#define SPREAD_PREFETCH_KEYS 32
/* ... and only while all its requests' scores together fit in this many floats (16 MiB): a batch-invariant step's
 * long prompt chunks keep one task per request, each with its own scratch. */
#define SPREAD_MAX_SCORE_FLOATS (4 * 1024 * 1024)

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

#define KV_T float
#define KV_NAME(x) x##_f32
#define KV_LOAD8 load8_f32
#define KV_STORE_ROW store_row_f32
#include "paged_attention_kv.h"

#define KV_T uint16_t
#define KV_NAME(x) x##_bf16
#define KV_LOAD8 load8_bf16
#define KV_STORE_ROW store_row_bf16
#include "paged_attention_kv.h"
