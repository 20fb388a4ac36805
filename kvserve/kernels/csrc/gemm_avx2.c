/* kvserve's CPU matmul for the model's projections: y[M, N] = x[M, K] . W[N, K]^T in float32, AVX2 + FMA.
 *
 * The weight is packed once at load into panels of NR = 16 output features: wp[N / 16][K][16] (N padded to a
 * multiple of 16 with zero rows). A panel is read front to back, so a decode step streams every weight byte
 * exactly once from memory, and each 16-float row of the panel is reused for up to MR = 6 rows of x held in
 * registers: 12 accumulators of 8 floats (the classic 6x16 register block of Goto & van de Geijn, "Anatomy of
 * High-Performance Matrix Multiplication", ACM TOMS 2008, with the weight as the packed panel). Panels are split
 * across OpenMP threads (the same libgomp runtime as PyTorch's, so torch.set_num_threads applies).
 *
 * 16-bit weights (GGUF F16 / BF16, kvserve_gemm_w16) are packed the same way as uint16 and widened in registers
 * (F16C vcvtph2ps; bfloat16: the bits shifted up 16), both exact, so the products and their order are the float32
 * kernel's: the outputs equal, bit for bit, kvserve_gemm_f32 on the widened weight, at half its bytes.
 *
 * Why: for the skinny x of decode steps (M = 4..16 rows) oneDNN and MKL stay well below the machine's memory or
 * FMA bound where this loop comes close; from M = 64 both are at the FMA bound. Measurements: docs/benchmarks.md,
 * "CPU kernels".
 */
#include <immintrin.h>
#include <stdint.h>

#define NR 16
#define MR 6
#define T_GEMM __attribute__((target("avx2,fma,f16c")))
enum { W_F32 = 0, W_F16 = 1, W_BF16 = 2 };

/* Accumulators a_i (features 0..7) and b_i (8..15) of x row i, as named variables: an array of __m256 makes
 * gcc spill them to the stack on every iteration. */
#define ZERO(i) __m256 a##i = _mm256_setzero_ps(), b##i = _mm256_setzero_ps();
#define FMA(i)                                                          \
    if (mr > i) {                                                       \
        __m256 xi = _mm256_broadcast_ss(x + (i) * ldx + k);             \
        a##i = _mm256_fmadd_ps(xi, w0, a##i);                           \
        b##i = _mm256_fmadd_ps(xi, w1, b##i);                           \
    }
#define STORE(i)                                                        \
    if (mr > i) {                                                       \
        _mm256_storeu_ps(y + (i) * ldy, a##i);                          \
        _mm256_storeu_ps(y + (i) * ldy + 8, b##i);                      \
    }

/* mr (1..MR) rows of x times one packed panel of weight type wt -> mr x 16 outputs. Inlined with a constant mr and
 * wt per case. */
T_GEMM static inline __attribute__((always_inline)) void block(const float *x, int64_t ldx, const void *wpv,
                                                                int64_t K, float *y, int64_t ldy, const int mr,
                                                                const int wt) {
    ZERO(0) ZERO(1) ZERO(2) ZERO(3) ZERO(4) ZERO(5)
    for (int64_t k = 0; k < K; k++) {
        __m256 w0, w1;
        if (wt == W_F32) {
            const float *wp = (const float *)wpv;
            w0 = _mm256_loadu_ps(wp + k * NR), w1 = _mm256_loadu_ps(wp + k * NR + 8);
        } else {
            const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)wpv + k * NR));
            const __m128i h0 = _mm256_castsi256_si128(h), h1 = _mm256_extracti128_si256(h, 1);
            if (wt == W_F16) {
                w0 = _mm256_cvtph_ps(h0), w1 = _mm256_cvtph_ps(h1);
            } else {
                w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h0), 16));
                w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h1), 16));
            }
        }
        FMA(0) FMA(1) FMA(2) FMA(3) FMA(4) FMA(5)
    }
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
}

#define CASE(n, wt) case n: block(x, ldx, wp, K, y, ldy, n, wt); break;
#define CASES(wt) switch (mr) { CASE(1, wt) CASE(2, wt) CASE(3, wt) CASE(4, wt) CASE(5, wt) CASE(6, wt) }
T_GEMM static void block_any(const float *x, int64_t ldx, const void *wp, int64_t K, float *y, int64_t ldy, int mr,
                             int wt) {
    if (wt == W_F16) { CASES(W_F16) } else if (wt == W_BF16) { CASES(W_BF16) } else { CASES(W_F32) }
}

T_GEMM static void gemm(int wt, const float *x, const void *wp, float *y, int64_t M, int64_t N, int64_t K) {
    const int64_t panels = N / NR, esize = wt == W_F32 ? 4 : 2;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        for (int64_t m = 0; m < M; m += MR) {
            int mr = (M - m) < MR ? (int)(M - m) : MR;
            block_any(x + m * K, K, (const char *)wp + p * K * NR * esize, K, y + m * N + p * NR, N, mr, wt);
        }
    }
}

/* x: [M, K] row-major; wp: [N / 16, K, 16]; y: [M, N] row-major. N must be a multiple of 16. */
void kvserve_gemm_f32(const float *x, const float *wp, float *y, int64_t M, int64_t N, int64_t K) {
    gemm(W_F32, x, wp, y, M, N, K);
}

/* As kvserve_gemm_f32 with wp uint16 [N / 16, K, 16]: float16 (bf16 = 0) or bfloat16 (bf16 = 1) weights. */
void kvserve_gemm_w16(const float *x, const uint16_t *wp, float *y, int64_t M, int64_t N, int64_t K, int bf16) {
    gemm(bf16 ? W_BF16 : W_F16, x, wp, y, M, N, K);
}

/* The panel width, so Python and C cannot disagree. */
int kvserve_gemm_panel(void) { return NR; }
