/* Row-wise float32 ops of the Llama block, AVX2 + FMA: RMSNorm and SwiGLU's silu(gate) * up.
 *
 * PyTorch runs RMSNorm in float32 on the CPU as five separate ops (pow, mean, add, rsqrt, mul) and silu * up as
 * two, each a pass over memory plus a dispatch (their share of a decode step: docs/benchmarks.md, "CPU kernels").
 * Each function here is one pass. Rows are split across OpenMP threads only when there is enough work.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "simd.h"

#define PARALLEL_MIN_ELEMENTS 65536

/* y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w (Zhang & Sennrich 2019). x, y: [T, H]; w: [H]; H % 8 == 0. */
void kvserve_rms_norm_f32(const float *x, const float *w, float *y, int64_t T, int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (T * H >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * H;
        float *yt = y + t * H;
        __m256 ss = _mm256_setzero_ps();
        for (int64_t i = 0; i < H; i += 8) {
            __m256 v = _mm256_loadu_ps(xt + i);
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum(ss) / (float)H + eps));
        for (int64_t i = 0; i < H; i += 8)
            _mm256_storeu_ps(yt + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xt + i), inv), _mm256_loadu_ps(w + i)));
    }
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
