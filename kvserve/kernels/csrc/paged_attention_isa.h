/* The float32 building blocks of the paged-attention kernel for one instruction set, included once per ISA by
 * paged_attention.c with:
 *   TGT           the functions' attribute (a target("...") for AVX-512; empty for AVX2, the library's baseline);
 *   ISA(x)        x with the ISA's suffix (x##_avx2, x##_avx512);
 *   W             float lanes per vector (8, 16); V the vector type;
 *   VZERO, VSET1(x), VLOAD(p), VSTORE(p, v), VFMA(a, b, c) (= a * b + c, one rounding), VADD, VSUB, VMUL, VDIV,
 *   VMAX, VKEEP_GE(v, x, c) (v in the lanes where x >= c, else 0), VEXP(v) (e^v per lane), VTANH(v) (tanh v per lane), VHSUM(v) (the lanes' sum in a fixed tree), VHMAX(v) (the largest lane),
 *   VKEEP(v, n)   v with lanes n.. set to 0 (0 <= n <= W), VTRANSPOSE(r) (an array of W vectors transposed in place).
 *
 * Every function below computes each output element with one fixed sequence of float operations that depends only
 * on that element's inputs -- never on how many rows or keys a call takes, where in a tile an element sits, or which
 * thread runs it (the kernel's batch invariance: paged_attention.c). */

/* Rows per score tile and per weighted-sum tile, and vectors (of W floats) per weighted-sum tile's columns. */
#define QK_ROWS 6
#define PV_ROWS 4
#define PV_VECS (W == 16 ? 4 : 2)
/* Keys per key tile: the score tile's width, two vectors. */
#define KT (2 * W)

/* Scores of nr (<= QK_ROWS, a compile-time constant where inlined) query rows against one key tile:
 * s[r * s_stride + j] = sum over k = 0 .. d-1, in order, of q[r * d + k] * kt[k * KT + j] (one FMA per term, from
 * zero), for j < KT. q: the rows' queries (already scaled); kt: the tile's keys transposed, [d][KT]. */
TGT static inline __attribute__((always_inline)) void ISA(qk_rows)(const float *q, int nr, const float *kt, int64_t d,
                                                                   float *s, int64_t s_stride) {
    V acc[QK_ROWS][2];
    for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = VZERO;
    for (int64_t k = 0; k < d; k++) {
        const V k0 = VLOAD(kt + k * KT), k1 = VLOAD(kt + k * KT + W);
        for (int r = 0; r < nr; r++) {
            const V b = VSET1(q[r * d + k]);
            acc[r][0] = VFMA(b, k0, acc[r][0]);
            acc[r][1] = VFMA(b, k1, acc[r][1]);
        }
    }
    for (int r = 0; r < nr; r++) {
        VSTORE(s + r * s_stride, acc[r][0]);
        VSTORE(s + r * s_stride + W, acc[r][1]);
    }
}

/* qk_rows for any number of rows, QK_ROWS at a time. */
TGT static void ISA(qk_tile)(const float *q, int64_t rows, const float *kt, int64_t d, float *s, int64_t s_stride) {
    int64_t r = 0;
    for (; r + QK_ROWS <= rows; r += QK_ROWS) ISA(qk_rows)(q + r * d, QK_ROWS, kt, d, s + r * s_stride, s_stride);
    switch (rows - r) {
    case 5: ISA(qk_rows)(q + r * d, 5, kt, d, s + r * s_stride, s_stride); break;
    case 4: ISA(qk_rows)(q + r * d, 4, kt, d, s + r * s_stride, s_stride); break;
    case 3: ISA(qk_rows)(q + r * d, 3, kt, d, s + r * s_stride, s_stride); break;
    case 2: ISA(qk_rows)(q + r * d, 2, kt, d, s + r * s_stride, s_stride); break;
    case 1: ISA(qk_rows)(q + r * d, 1, kt, d, s + r * s_stride, s_stride); break;
    default: break;
    }
}

/* A score more than SOFTMAX_FLUSH below its row's maximum gets probability exactly 0. e^-64 = 1.6e-28 of the
 * largest term is 20 orders of magnitude below float32's resolution of the row's output, and the cut keeps every
 * probability (>= 1.6e-28 / keys) and its products in the weighted sum out of float32's subnormal range, where
 * Intel CPUs take a microcode assist on each operation: without it a peaked softmax (one score ~90 above most, common
 * in long prompts) made a 1,000-token prefill's weighted sums 3-10x slower. */
#define SOFTMAX_FLUSH 64.0f

/* p[0..n) = softmax(p[0..n)) in place (n >= 1; p readable and writable up to n rounded up to W): with cap > 0,
 * first p_j = cap * tanh(p_j / cap) (soft-capping); then m = max p, e_j = e^(p_j - m) (0 where p_j - m <
 * -SOFTMAX_FLUSH), sum = the lane sums (lane l adds e_j for j = l mod W in ascending j, from zero) in VHSUM's tree,
 * p_j = e_j * (1 / sum). An attention sink (gpt-oss; sink > -INFINITY) is one more logit in the denominator only:
 * m = max(max p, sink), and sum gets e^(sink - m) (0 below -SOFTMAX_FLUSH) added after the lane tree; sink
 * -INFINITY (none) changes no bit: m is max p and the added term is +0. */
TGT static void ISA(softmax)(float *p, int64_t n, float cap, float sink) {
    const int64_t full = n / W * W;
    if (cap > 0) {
        const V c = VSET1(cap);
        for (int64_t j = 0; j < n; j += W) VSTORE(p + j, VMUL(c, VTANH(VDIV(VLOAD(p + j), c))));
    }
    V mv = VSET1(-INFINITY);
    for (int64_t j = 0; j < full; j += W) mv = VMAX(mv, VLOAD(p + j));
    float m = VHMAX(mv);
    for (int64_t j = full; j < n; j++) m = p[j] > m ? p[j] : m;
    m = sink > m ? sink : m;
    const V m8 = VSET1(m), flush = VSET1(-SOFTMAX_FLUSH);
    V sv = VZERO;
    for (int64_t j = 0; j < full; j += W) {
        const V x = VSUB(VLOAD(p + j), m8), e = VKEEP_GE(VEXP(x), x, flush);
        VSTORE(p + j, e);
        sv = VADD(sv, e);
    }
    if (full < n) { /* the tail vector: lanes past n count as zero */
        const V x = VSUB(VLOAD(p + full), m8), e = VKEEP(VKEEP_GE(VEXP(x), x, flush), n - full);
        VSTORE(p + full, e);
        sv = VADD(sv, e);
    }
    float sum = VHSUM(sv);
    if (sink > -INFINITY && sink - m >= -SOFTMAX_FLUSH) sum += expf(sink - m);
    const V inv = VSET1(1.0f / sum);
    for (int64_t j = 0; j < n; j += W) VSTORE(p + j, VMUL(VLOAD(p + j), inv));
}
