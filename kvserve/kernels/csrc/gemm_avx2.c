/* kvserve's CPU matmul for the model's projections: y[M, N] = x[M, K] . W[N, K]^T in float32, AVX2 + FMA.
 *
 * The weight is packed once at load into panels of NR = 16 output features: wp[N / 16][K][16] (N padded to a
 * multiple of 16 with zero rows). A panel is read front to back, so a decode step streams every weight byte
 * exactly once from memory, and each 16-float row of the panel is reused for up to MR = 6 rows of x held in
 * registers: 12 accumulators of 8 floats (the classic 6x16 register block of Goto & van de Geijn, "Anatomy of
 * High-Performance Matrix Multiplication", ACM TOMS 2008, with the weight as the packed panel). Panels are split
 * across OpenMP threads (the same libgomp runtime as PyTorch's, so torch.set_num_threads applies).
 *
 * Why: for the skinny x of decode steps (M = 4..16 rows) oneDNN and MKL stay well below the machine's memory or
 * FMA bound where this loop comes close; from M = 64 both are at the FMA bound. Measurements: docs/benchmarks.md,
 * "CPU kernels".
 */
#include <immintrin.h>
#include <stdint.h>

#define NR 16
#define MR 6

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

/* mr (1..MR) rows of x times one packed panel -> mr x 16 outputs. Inlined with a constant mr per case. */
static inline __attribute__((always_inline)) void block(const float *x, int64_t ldx, const float *wp, int64_t K,
                                                         float *y, int64_t ldy, const int mr) {
    ZERO(0) ZERO(1) ZERO(2) ZERO(3) ZERO(4) ZERO(5)
    for (int64_t k = 0; k < K; k++) {
        __m256 w0 = _mm256_loadu_ps(wp + k * NR), w1 = _mm256_loadu_ps(wp + k * NR + 8);
        FMA(0) FMA(1) FMA(2) FMA(3) FMA(4) FMA(5)
    }
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
}

#define CASE(n) case n: block(x, ldx, wp, K, y, ldy, n); break;
static void block_any(const float *x, int64_t ldx, const float *wp, int64_t K, float *y, int64_t ldy, int mr) {
    switch (mr) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) }
}

/* x: [M, K] row-major; wp: [N / 16, K, 16]; y: [M, N] row-major. N must be a multiple of 16. */
void kvserve_gemm_f32(const float *x, const float *wp, float *y, int64_t M, int64_t N, int64_t K) {
    int64_t panels = N / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        for (int64_t m = 0; m < M; m += MR) {
            int mr = (M - m) < MR ? (int)(M - m) : MR;
            block_any(x + m * K, K, wp + p * K * NR, K, y + m * N + p * NR, N, mr);
        }
    }
}

/* The panel width, so Python and C cannot disagree. */
int kvserve_gemm_panel(void) { return NR; }
