/* A kernel-only timing of kvserve_qgemm (kvserve/kernels/csrc/qgemm.c), without Python: random packed weights of
 * one format (random bytes, scales set to small finite values), random activations, and for each row count the
 * fastest call by this thread's CPU time (so time the thread spent descheduled on a shared machine is not counted)
 * over at least `seconds`. Prints ns per (row, 32-value block, 16-output group): the unit of the kernels' work.
 *
 * Build against any checkout's sources (to compare two commits, build one binary from each):
 *   gcc -O3 -fopenmp benchmarks/qgemm_bench.c kvserve/kernels/csrc/qgemm.c -o /tmp/qgemm_bench -lm
 *   OMP_NUM_THREADS=1 /tmp/qgemm_bench FMT ISA ACT N K ROWS [SECONDS]
 * FMT: 0 Q4 (Q4_0/Q4_1), 1 Q8 (Q8_0), 2 Q4F, 3 Q6 (Q6_K), 4 Q5F, 5 Q4K (Q4_K); ISA: 1 avx2, 2 avx512_vnni,
 * 3 amx_int8; ACT: 0 int8, 1 int8x2; N, K: the weight's out x in (N a multiple of 16, K of 256); ROWS: e.g.
 * 1,16,64,512. Results: docs/quantization.md ("Many rows"). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int kvserve_qgemm(int fmt, int isa, int act, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                  const float *oscale, float *y, int64_t ldy);

static double cpu_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static const int64_t BLOCK_BYTES[] = {320, 544, 384, 448, 448, 296}; /* per 16 x 32 block (Q4K: on average) */

int main(int argc, char **argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s FMT ISA ACT N K ROWS [SECONDS]\n", argv[0]);
        return 2;
    }
    const int fmt = atoi(argv[1]), isa = atoi(argv[2]), act = atoi(argv[3]);
    const int64_t N = atoll(argv[4]), K = atoll(argv[5]), nb = K / 32, groups = N / 16;
    const double seconds = argc > 7 ? atof(argv[7]) : 0.3;
    if (fmt < 0 || fmt > 5) return 2;
    const int64_t bytes = groups * nb * BLOCK_BYTES[fmt];
    uint8_t *w = aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
    srand(1);
    for (int64_t i = 0; i < bytes; i++) w[i] = (uint8_t)rand();
    for (int64_t g = 0; g < groups; g++) /* finite scales: float16 0x2000-0x23ff, or float32 0.01-0.04 */
        for (int64_t b = 0; b < nb; b++) {
            if (fmt == 5) {
                uint8_t *sb = w + g * nb * 296 + b / 8 * 2368;
                if (b % 8 == 0)
                    for (int i = 0; i < 32; i++) ((uint16_t *)sb)[i] = (uint16_t)(0x2000 + (rand() & 0x3ff));
                for (int i = 0; i < 32; i++) sb[64 + b % 8 * 288 + i] &= 63; /* 6-bit sc, mn */
            } else if (fmt == 2 || fmt == 4) {
                float *f = (float *)(w + (g * nb + b) * BLOCK_BYTES[fmt]);
                for (int i = 0; i < 32; i++) f[i] = 0.01f * (float)(1 + (i & 3));
            } else {
                uint16_t *h = (uint16_t *)(w + (g * nb + b) * BLOCK_BYTES[fmt]);
                for (int i = 0; i < (fmt == 0 ? 32 : 16); i++) h[i] = (uint16_t)(0x2000 + (rand() & 0x3ff));
            }
        }
    int64_t rows[64], nrows = 0, mmax = 0;
    for (char *p = strtok(argv[6], ","); p && nrows < 64; p = strtok(NULL, ",")) {
        rows[nrows] = atoll(p);
        if (rows[nrows] > mmax) mmax = rows[nrows];
        nrows++;
    }
    float *x = malloc(sizeof(float) * (size_t)(mmax * K)), *y = malloc(sizeof(float) * (size_t)(mmax * N));
    for (int64_t i = 0; i < mmax * K; i++) x[i] = (float)rand() / (float)RAND_MAX - 0.5f;
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t M = rows[r];
        int rc = kvserve_qgemm(fmt, isa, act, x, M, K, w, N, NULL, y, N);
        if (rc) {
            fprintf(stderr, "kvserve_qgemm returned %d\n", rc);
            return 1;
        }
        double best = 1e30, t0 = cpu_seconds();
        for (int calls = 0; calls < 5 || cpu_seconds() - t0 < seconds; calls++) {
            const double t = cpu_seconds();
            kvserve_qgemm(fmt, isa, act, x, M, K, w, N, NULL, y, N);
            const double dt = cpu_seconds() - t;
            best = dt < best ? dt : best;
        }
        printf("fmt %d isa %d act %d N %ld K %ld M %4ld: %10.1f us  %.2f ns per (row, block, group)\n", fmt, isa,
               act, (long)N, (long)K, (long)M, best * 1e6, best * 1e9 / ((double)M * nb * groups));
    }
    return 0;
}
