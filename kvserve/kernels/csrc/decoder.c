/* A Llama-family decoder's layers, all of them, in one call: the whole layer loop of a step whose projections are
 * quantized (kvserve_qgemm, in this library) and whose attention runs in the paged-attention kernel.
 *
 * Per layer, the same kernels in the same order as the Python loop of kvserve/model/llama.py, so the result is the
 * same bit for bit:
 *
 *   qkv  = qgemm(x, W_qkv) (+ bias)             x: the layer's normed input, [T, hidden]
 *   attn = rope_write_attend(qkv)               RoPE, K/V written to the cache slots, paged attention
 *   h   += qgemm(attn, W_o);  x = rms_norm(h)   one pass (add_rms_norm)
 *   gu   = qgemm(x, W_gate_up);  a = silu(gate) * up
 *   h   += qgemm(a, W_down);  x = rms_norm(h) with the next layer's weight (the last layer: the final norm's,
 *                                the LM head's input; or h only)
 *
 * What it saves is the interpreter: a decode step of a 30-layer model makes ~240 calls from Python into C (each with
 * its argument checks, a new output tensor and a ctypes crossing) where this makes one, which matters once the
 * weights are small enough that a batch-1 step takes a few milliseconds (measured in the README, "Quantized
 * weights", and docs/benchmarks.md).
 *
 * The float32 element-wise and attention kernels live in the other library (kvserve/kernels/cpu.py, built
 * with AVX2 flags); the caller passes their addresses, so each library keeps its build flags and no kernel exists
 * twice.
 */
#include <stdint.h>
#include <time.h>

int kvserve_qgemm(int fmt, int isa, int act, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                  const float *oscale, float *y, int64_t ldy);

typedef int (*rope_write_attend_fn)(float *qkv, int64_t qkv_stride, int64_t T, const float *cos, const float *sin,
                                    const int64_t *slot_mapping, void *k_cache, void *v_cache,
                                    const int64_t *block_tables, int64_t max_blocks, const int64_t *q_start,
                                    const int64_t *q_len, const int64_t *seq_len, int64_t num_reqs, int64_t h_q,
                                    int64_t h_kv, int64_t d, int64_t block_size, float scale, float *out,
                                    int64_t out_stride);
typedef void (*rms_norm_fn)(const float *x, const float *w, float *y, int64_t T, int64_t H, float eps);
typedef void (*add_rms_norm_fn)(float *h, const float *delta, const float *w, float *y, int64_t T, int64_t H,
                                float eps);
typedef void (*silu_mul_fn)(const float *gu, float *y, int64_t T, int64_t I);

/* One packed quantized weight (kvserve/quant/pack.py): fmt, the bytes, per-output scales or NULL, N x K
 * (N a multiple of 16: no padded outputs). */
typedef struct {
    int64_t fmt;
    const uint8_t *w;
    const float *oscale;
    int64_t n, k;
} QWeight;

typedef struct {
    const float *mlp_norm, *next_norm; /* [hidden]; next_norm: the next layer's input norm (the last layer: the
                                        * model's final norm, or NULL for none) */
    const float *qkv_bias;             /* [qkv.n] or NULL */
    QWeight qkv, o, gate_up, down;
} DecoderLayer;

/* The model: set once. */
typedef struct {
    int64_t num_layers, hidden, h_q, h_kv, d, intermediate;
    float eps, scale;
    int64_t isa, act; /* kvserve_qgemm's isa and activation ids */
    const float *attn_norm; /* [hidden]: layer 0's input norm */
    const DecoderLayer *layers;
    rms_norm_fn rms_norm;
    rope_write_attend_fn rope_write_attend[3]; /* by DecoderStep.kv_dtype: 0 float32 cache, 1 bfloat16, 2 int8 */
    add_rms_norm_fn add_rms_norm;
    silu_mul_fn silu_mul;
} DecoderStack;

/* One step: the flat batch's T rows, their rotations and cache slots, the requests to attend (all of the batch's:
 * every one goes through the paged-attention kernel), and the KV pool ([layers, 2, num_blocks, block_size, h_kv,
 * d (+ 2 for int8: each row's scale)] contiguous, float32, bfloat16 or int8 as kv_dtype says). */
typedef struct {
    int64_t T;
    const float *cos, *sin;      /* [T, d] */
    const int64_t *slot_mapping; /* [T] */
    const int64_t *block_tables; /* [num_reqs, max_blocks] */
    int64_t max_blocks;
    const int64_t *q_start, *q_len, *seq_len; /* [num_reqs] */
    int64_t num_reqs, block_size;
    void *kv_cache;
    int64_t kv_dtype;     /* 0: float32 elements, 1: bfloat16, 2: int8 */
    int64_t layer_bytes;  /* bytes of one layer's K and V together */
    int64_t *timing_ns;   /* NULL, or [3] nanoseconds added up: matmuls, attention, norms + activation (profiling) */
} DecoderStep;

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* With p->timing_ns set, the time since *t0 is added to bucket `what` and *t0 moves on; else nothing. */
static inline void lap(const DecoderStep *p, int64_t *t0, int what) {
    if (!p->timing_ns) return;
    int64_t t = now_ns();
    p->timing_ns[what] += t - *t0;
    *t0 = t;
}
enum { T_MATMUL = 0, T_ATTENTION = 1, T_ELEMENTWISE = 2 };

/* Runs every layer. h [T, hidden]: the residual stream (the embeddings in; the last layer's output, before the
 * final norm, out). Scratch: x [T, hidden] (each layer's normed input), qkv [T, qkv.n], attn [T, h_q d],
 * delta [T, hidden], gu [T, 2 intermediate], act [T, intermediate]. Returns 0;
 * -1 for inconsistent shapes (nothing done); -2 when a matmul could not allocate scratch memory and -3 when the
 * attention could not, both mid-way: h, x and this step's cache slots are then partly written (the caller recomputes
 * the step from the embeddings; rewriting a slot with the same values is harmless). */
int kvserve_decoder_stack(const DecoderStack *s, const DecoderStep *p, float *h, float *x, float *qkv, float *attn,
                          float *delta, float *gu, float *act) {
    const int64_t T = p->T, H = s->hidden, qd = s->h_q * s->d, I = s->intermediate;
    if (p->kv_dtype < 0 || p->kv_dtype > 2) return -1;
    const rope_write_attend_fn attend = s->rope_write_attend[p->kv_dtype];
    for (int64_t i = 0; i < s->num_layers; i++) {
        const DecoderLayer *L = s->layers + i;
        if (L->qkv.k != H || L->qkv.n != (s->h_q + 2 * s->h_kv) * s->d || L->o.k != qd || L->o.n != H ||
            L->gate_up.k != H || L->gate_up.n != 2 * I || L->down.k != I || L->down.n != H)
            return -1;
    }
    int64_t t0 = p->timing_ns ? now_ns() : 0;
    s->rms_norm(h, s->attn_norm, x, T, H, s->eps);
    lap(p, &t0, T_ELEMENTWISE);
    for (int64_t i = 0; i < s->num_layers; i++) {
        const DecoderLayer *L = s->layers + i;
        const int64_t nqkv = L->qkv.n;
        char *k_cache = (char *)p->kv_cache + i * p->layer_bytes, *v_cache = k_cache + p->layer_bytes / 2;
        if (kvserve_qgemm((int)L->qkv.fmt, (int)s->isa, (int)s->act, x, T, H, L->qkv.w, nqkv, L->qkv.oscale, qkv,
                          nqkv))
            return -2;
        if (L->qkv_bias)
            for (int64_t t = 0; t < T; t++)
                for (int64_t n = 0; n < nqkv; n++) qkv[t * nqkv + n] += L->qkv_bias[n];
        lap(p, &t0, T_MATMUL);
        if (attend(qkv, nqkv, T, p->cos, p->sin, p->slot_mapping, k_cache, v_cache, p->block_tables, p->max_blocks,
                   p->q_start, p->q_len, p->seq_len, p->num_reqs, s->h_q, s->h_kv, s->d, p->block_size, s->scale, attn,
                   qd))
            return -3;
        lap(p, &t0, T_ATTENTION);
        if (kvserve_qgemm((int)L->o.fmt, (int)s->isa, (int)s->act, attn, T, qd, L->o.w, H, L->o.oscale, delta, H))
            return -2;
        lap(p, &t0, T_MATMUL);
        s->add_rms_norm(h, delta, L->mlp_norm, x, T, H, s->eps);
        lap(p, &t0, T_ELEMENTWISE);
        if (kvserve_qgemm((int)L->gate_up.fmt, (int)s->isa, (int)s->act, x, T, H, L->gate_up.w, 2 * I,
                          L->gate_up.oscale, gu, 2 * I))
            return -2;
        lap(p, &t0, T_MATMUL);
        s->silu_mul(gu, act, T, I);
        lap(p, &t0, T_ELEMENTWISE);
        if (kvserve_qgemm((int)L->down.fmt, (int)s->isa, (int)s->act, act, T, I, L->down.w, H, L->down.oscale, delta,
                          H))
            return -2;
        lap(p, &t0, T_MATMUL);
        if (L->next_norm) {
            s->add_rms_norm(h, delta, L->next_norm, x, T, H, s->eps);
        } else {
            for (int64_t j = 0; j < T * H; j++) h[j] += delta[j];
        }
        lap(p, &t0, T_ELEMENTWISE);
    }
    return 0;
}
