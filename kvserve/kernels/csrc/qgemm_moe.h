/* A mixture-of-experts layer's expert matmuls in one call per projection (kvserve/layers/grouped_experts.py):
 * the step's T * topk (row, rank) pairs grouped by expert, each chosen expert's quantized weight run once over its
 * pairs with the kvserve_qgemm paths (qgemm_share), all experts inside one OpenMP parallel region whose threads split
 * every expert's output groups (no barrier between experts), so two threads help at one token. Included by qgemm.c.
 *
 * Bits: a pair's activations are quantized as kvserve_qgemm quantizes a row, and a row's outputs do not depend on
 * the other rows of its expert (qgemm.c), so each slot equals kvserve_qgemm of that expert on that row alone; an
 * expert's bias (gpt-oss) is added to each of its slots as one rounded float add, as PyTorch's `y + bias`
 * (kvserve.layers.moe.ExpertMLP); the combine sums each row's slots in rank order with each product and sum rounded
 * on its own, as PyTorch's `slots[:, 0] * w[:, :1]` then `y + slots[:, r] * w[:, r:r+1]` (kvserve.layers.moe.MoE). */

/* Pairs p = t * topk + r grouped by expert, p ascending within each (a stable counting sort, as
 * torch.argsort(ids.flatten(), stable=True)): order[P] the pairs, start[E + 1] each expert's first index, pos[P]
 * each pair's index in order. Returns -1 for an id outside [0, E). */
static int moe_group(const int64_t *ids, int64_t P, int64_t E, int64_t *order, int64_t *start, int64_t *pos) {
    for (int64_t e = 0; e <= E; e++) start[e] = 0;
    for (int64_t p = 0; p < P; p++) {
        if (ids[p] < 0 || ids[p] >= E) return -1;
        start[ids[p] + 1]++;
    }
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t p = 0; p < P; p++) pos[p] = start[ids[p]]++;
    for (int64_t e = E; e > 0; e--) start[e] = start[e - 1];
    start[0] = 0;
    for (int64_t p = 0; p < P; p++) order[pos[p]] = p;
    return 0;
}

/* out[t] = sum over r in rank order of slot[pos[t * topk + r]] * wt[t, r], each product and sum rounded on its own
 * (no fused multiply-add: PyTorch's separate mul and add); with bias [E, N], each slot is first (slot + bias[e])
 * rounded, e its expert ids[t * topk + r]. */
__attribute__((optimize("fp-contract=off"))) static void moe_combine(const float *slots, int64_t ldy,
                                                                      const int64_t *pos, const float *wt,
                                                                      const int64_t *ids, const float *bias,
                                                                      int64_t t, int64_t topk, int64_t N, float *out) {
    float *o = out + t * N;
    for (int64_t r = 0; r < topk; r++) {
        const float *sr = slots + pos[t * topk + r] * ldy;
        const float wr = wt[t * topk + r];
        if (bias) {
            const float *b = bias + ids[t * topk + r] * N;
            if (r == 0)
                for (int64_t n = 0; n < N; n++) o[n] = (sr[n] + b[n]) * wr;
            else
                for (int64_t n = 0; n < N; n++) o[n] = o[n] + (sr[n] + b[n]) * wr;
        } else if (r == 0) {
            for (int64_t n = 0; n < N; n++) o[n] = sr[n] * wr;
        } else {
            for (int64_t n = 0; n < N; n++) o[n] = o[n] + sr[n] * wr;
        }
    }
}

/* y's grouped row i (of expert e) += bias[e], each sum rounded on its own (PyTorch's `h + bias`). */
__attribute__((optimize("fp-contract=off"))) static void moe_add_bias(float *y, int64_t ldy, const float *bias,
                                                                       int64_t e, int64_t i, int64_t N) {
    float *yr = y + i * ldy;
    const float *b = bias + e * N;
    for (int64_t n = 0; n < N; n++) yr[n] = yr[n] + b[n];
}

/* One projection of every chosen expert: the input of pair p is x's row p / topk ("up": x [T, K], the layer's input)
 * or row pos[p] of x ("down": x [T * topk, K], the previous call's output after the activation, in its grouped
 * order); its output goes to y's row pos[p] (y [T * topk, ldy], grouped by expert: the next call's input order).
 * With wt and out (down only), out[T, N] = each row's slots weighted by wt [T, topk] in rank order (moe_combine).
 * bias: NULL, or float32 [E, N] contiguous: expert e's bias added to each of its slots (before the combine).
 *
 * fmt / isa / act: as kvserve_qgemm, shared by all experts (ACT_BF16, where the path allows it: the experts run
 * their int8 tiles); w[e] the address of expert e's packed [N, K] weight,
 * oscale NULL or oscale[e] an address of N floats or 0. ids [T, topk] in [0, E). Returns 0; -1 for bad arguments or
 * an id outside [0, E); -2 when scratch memory could not be allocated. */
int kvserve_moe_gemm(int fmt, int isa, int act, int down, const float *x, int64_t T, int64_t K, const int64_t *ids,
                     int64_t topk, int64_t E, const int64_t *w, const int64_t *oscale, const float *bias,
                     int64_t N, float *y, int64_t ldy, const float *wt, float *out) {
    if (!block_bytes(fmt) || !kvserve_q_act_supported(isa, act) || K % k_multiple(fmt) || N % G || T < 0 ||
        topk < 1 || E < 1 || ldy < N || (out && !down) || (out && !wt))
        return -1;
    if (act == ACT_BF16) act = ACT_INT8;
    const int64_t P = T * topk;
    if (P == 0) return 0;
    const int pair = act == ACT_PAIR;
    const int64_t nb = K / QK, groups = N / G, xrow = pair ? 2 * K : K;
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(2 * P + E + 1));
    int8_t *xq = malloc((size_t)(P * xrow));
    float *xd = malloc(sizeof(float) * (size_t)(2 * P * nb));
    if (!order || !xq || !xd) {
        free(order), free(xq), free(xd);
        return -2;
    }
    int64_t *pos = order + P, *start = pos + P;
    if (moe_group(ids, P, E, order, start, pos)) {
        free(order), free(xq), free(xd);
        return -1;
    }
    float *xs = xd + P * nb;
    int failed = 0;
#pragma omp parallel if (P * N * K >= SERIAL_MACS)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < P; i++) { /* grouped row i: pair order[i] */
            const float *xr = down ? x + i * K : x + order[i] / topk * K;
            quantize_row_avx2(xr, K, xq + i * xrow, xd + i * nb, xs + i * nb, pair);
        }
        for (int64_t e = 0; e < E; e++) {
            const int64_t i0 = start[e], c = start[e + 1] - i0;
            if (!c) continue;
            const float *os = oscale && oscale[e] ? (const float *)(intptr_t)oscale[e] : NULL;
            if (qgemm_share(fmt, isa, pair, (const uint8_t *)(intptr_t)w[e], nb, groups, xq + i0 * xrow,
                            xd + i0 * nb, xs + i0 * nb, c, K, y + i0 * ldy, ldy, os))
                __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        }
        if (out) {
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) moe_combine(y, ldy, pos, wt, ids, bias, t, topk, N, out);
        } else if (bias) {
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t i = 0; i < P; i++) moe_add_bias(y, ldy, bias, ids[order[i]], i, N);
        }
    }
    free(order), free(xq), free(xd);
    return failed ? -2 : 0;
}
