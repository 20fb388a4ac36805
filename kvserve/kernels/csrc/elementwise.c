/* Row-wise float32 ops of the Llama block, AVX2 + FMA: RMSNorm and SwiGLU's silu(gate) * up.
 *
 * PyTorch runs RMSNorm in float32 on the CPU as five separate ops (pow, mean, add, rsqrt, mul) and silu * up as
 * two, each a pass over memory plus a dispatch (their share of a decode step: docs/benchmarks.md, "CPU kernels").
 * Each function here is one pass (the residual add before a norm rides along in the same pass). Rows are split
 * across OpenMP threads only when there is enough work.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "simd.h"

#define PARALLEL_MIN_ELEMENTS 65536

/* yt = xt / sqrt(mean(xt^2) + eps) * w for one row of H floats (H % 8 == 0); with delta, xt += delta first (the sum
 * is stored back into xt and normalized). */
static inline void norm_row(float *xt, const float *delta, const float *w, float *yt, int64_t H, float eps) {
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < H; i += 8) {
        __m256 v = _mm256_loadu_ps(xt + i);
        if (delta) {
            v = _mm256_add_ps(v, _mm256_loadu_ps(delta + i));
            _mm256_storeu_ps(xt + i, v);
        }
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum(ss) / (float)H + eps));
    for (int64_t i = 0; i < H; i += 8)
        _mm256_storeu_ps(yt + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xt + i), inv), _mm256_loadu_ps(w + i)));
}

/* y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w (Zhang & Sennrich 2019). x, y: [T, H]; w: [H]; H % 8 == 0. */
void kvserve_rms_norm_f32(const float *x, const float *w, float *y, int64_t T, int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (T * H >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++) norm_row((float *)x + t * H, NULL, w, y + t * H, H, eps);
}

/* The residual add and the next RMSNorm of a decoder layer in one pass: h[t] += delta[t] (in place), then
 * y[t] = rms_norm(h[t]) * w, the same arithmetic as the two separate ops. h, delta, y: [T, H]; w: [H]; H % 8 == 0. */
void kvserve_add_rms_norm_f32(float *h, const float *delta, const float *w, float *y, int64_t T, int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (T * H >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++) norm_row(h + t * H, delta + t * H, w, y + t * H, H, eps);
}

/* SwiGLU (Shazeer 2020): y[t, i] = silu(gu[t, i]) * gu[t, I + i], silu(g) = g / (1 + e^-g). gu: [T, 2I]; y: [T, I];
 * I % 8 == 0. */
void kvserve_silu_mul_f32(const float *gu, float *y, int64_t T, int64_t I) {
#pragma omp parallel for schedule(static) if (T * I >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *yt = y + t * I;
        for (int64_t i = 0; i < I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
            _mm256_storeu_ps(yt + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
        }
    }
}
