/* A decoder's layers, all of them, in one call: the whole layer loop of a step whose projections are quantized
 * (kvserve_qgemm, in this library) and whose attention runs in the paged-attention kernel, for any layer the
 * model's DecoderSpec describes (kvserve/model/layer_spec.py; the caller declines a spec with an op missing here).
 *
 * Per layer, the same kernels in the same order as the Python loop of kvserve/model/decoder.py, so the result is
 * the same bit for bit (optional steps in brackets, as the layer's fields say):
 *
 *   in   = x (the layer's normed input) or, without pre-norms, h
 *   qkv  = qgemm(in, W_qkv) [+ bias]; [Q/K RMSNorm: per head over d, or over each whole projection]
 *   attn = rope_write_attend(qkv)                RoPE (the layer's table), K/V written to the cache slots, paged
 *                                                attention [window, soft-cap]
 *   d    = qgemm(attn, W_o) [+ bias] [* residual multiplier] [; d = rms_norm(d)  post-attention norm]
 *   h   += d;  x = rms_norm(h) (pre-MLP norm, one pass: add_rms_norm) -- or, without it, in = h
 *   gu   = qgemm(in, W_gate_up) [+ bias];  a = act(gate) * up
 *   d    = qgemm(a, W_down) [+ bias] [* residual multiplier] [; d = rms_norm(d)  post-MLP norm]
 *   h   += d;  x = rms_norm(h) with the next layer's input norm (the last layer: the final norm's, the LM
 *                                head's input), one pass -- or h only when the next layer has no input norm
 *
 * What it saves is the interpreter: a decode step of a 30-layer model makes ~240 calls from Python into C (each with
 * its argument checks, a new output tensor and a ctypes crossing) where this makes one, which matters once the
 * weights are small enough that a batch-1 step takes a few milliseconds (measured in the README, "Quantized
 * weights", and docs/benchmarks.md).
 *
 * The float32 element-wise and attention kernels live in the other library (kvserve/kernels/cpu.py, built
 * with AVX2 flags); the caller passes their addresses, so each library keeps its build flags and no kernel exists
 * twice. The activation is a pointer too: the SwiGLU kernel, or the caller's function for the GELU variants (which
 * computes them as the Python loop does).
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
                                    int64_t out_stride, int64_t window, float softcap, const float *sinks);
typedef void (*rms_norm_fn)(const float *x, const float *w, float *y, int64_t T, int64_t H, float eps);
typedef void (*add_rms_norm_fn)(float *h, const float *delta, const float *w, float *y, int64_t T, int64_t H,
                                float eps);
typedef void (*act_mul_fn)(const float *gu, float *y, int64_t T, int64_t I);
/* A layer's whole MLP run by the caller (a mixture of experts: kvserve/layers/moe.py): x [T, hidden] -> y [T, hidden];
 * returns 0, or non-zero on failure (the loop stops with -4). */
typedef int (*mlp_fn)(const float *x, float *y, int64_t T, int64_t layer);

/* One packed quantized weight (kvserve/quant/pack.py): fmt, the bytes, per-output scales or NULL, N x K
 * (N a multiple of 16: no padded outputs). */
typedef struct {
    int64_t fmt;
    const uint8_t *w;
    const float *oscale;
    int64_t n, k;
} QWeight;

enum { QK_NORM_NONE = 0, QK_NORM_HEAD = 1, QK_NORM_PROJ = 2 };
#define MAX_ROPES 4

/* One layer (LayerSpec). Every pointer may be NULL for "none" unless said otherwise. */
typedef struct {
    int64_t pre_norms;                 /* the layer's input is x (normed); 0: h itself (post-norm layers) */
    const float *mlp_norm;             /* [hidden] the pre-MLP norm (NULL: the MLP reads h) */
    const float *next_norm;            /* [hidden] the next layer's input norm (the last layer: the model's final
                                        * norm); NULL: h only */
    const float *post_attn_norm, *post_mlp_norm; /* [hidden] norms of the sub-layers' outputs */
    int64_t qk_norm;                   /* QK_NORM_*: weights [d] (per head) or [h_q d], [h_kv d] (projection) */
    const float *q_norm, *k_norm;
    int64_t rope;                      /* index of the layer's cos/sin in DecoderStep */
    int64_t window;                    /* attention window in tokens, 0: none */
    float softcap;                     /* attention-score soft-cap, 0: none */
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias; /* [qkv_width], [hidden], [2 intermediate], [hidden] */
    QWeight qkv, o, gate_up, down;     /* gate_up and down unused when mlp is set */
    mlp_fn mlp;                        /* NULL: the gated MLP of gate_up / down; else the caller's MLP (MoE) */
    QWeight qkv_rest[2];               /* the rest of a Q/K/V projection whose parts differ in format (a Q4_K_M
                                        * file's Q6_K v beside Q4_K q/k): qkv is its first part, these the next
                                        * columns (n = 0: none); each part its own matmul into qkv's rows */
    const float *sinks;                /* [h_q] attention-sink logits (gpt-oss), NULL: none */
} DecoderLayer;

/* The model: set once. */
typedef struct {
    int64_t num_layers, hidden, h_q, h_kv, d, intermediate;
    float eps, scale, residual_multiplier;
    int64_t isa, act; /* kvserve_qgemm's isa and activation ids */
    const float *attn_norm; /* [hidden]: layer 0's input norm (NULL when it has none) */
    const DecoderLayer *layers;
    rms_norm_fn rms_norm;
    rope_write_attend_fn rope_write_attend[3]; /* by DecoderStep.kv_dtype: 0 float32 cache, 1 bfloat16, 2 int8 */
    add_rms_norm_fn add_rms_norm;
    act_mul_fn act_mul; /* gu [T, 2 intermediate] -> [T, intermediate]: act(gate) * up */
} DecoderStack;

/* One step: the flat batch's T rows, their rotations and cache slots, the requests to attend (all of the batch's:
 * every one goes through the paged-attention kernel), and the KV pool ([layers, 2, num_blocks, block_size, h_kv,
 * d (+ 2 for int8: each row's scale)] contiguous, float32, bfloat16 or int8 as kv_dtype says). */
typedef struct {
    int64_t T;
    const float *cos[MAX_ROPES], *sin[MAX_ROPES]; /* [T, d] each: the rotations DecoderLayer.rope indexes */
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

/* y[t] += b for each of the T rows of n floats (a projection's bias), then y *= m unless m is 1 (Granite's
 * residual multiplier): the Python loop's "y + b" and "y * m", element by element. */
static void bias_scale(float *y, const float *b, float m, int64_t T, int64_t n) {
    if (b)
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < n; j++) y[t * n + j] += b[j];
    if (m != 1.0f)
        for (int64_t j = 0; j < T * n; j++) y[j] *= m;
}

/* The width of a layer's Q/K/V projection (its parts': DecoderLayer.qkv_rest). */
static int64_t qkv_width(const DecoderLayer *L) { return L->qkv.n + L->qkv_rest[0].n + L->qkv_rest[1].n; }

/* The Q/K norms of qkv's T rows (stride nqkv), in place: per head over d (rms_norm of h rows of d) or over each
 * whole projection (one row of h d). */
static void qk_norm(const DecoderStack *s, const DecoderLayer *L, float *qkv, int64_t T, int64_t nqkv) {
    const int64_t d = s->d, qd = s->h_q * d, kd = s->h_kv * d;
    const int head = L->qk_norm == QK_NORM_HEAD;
    for (int64_t t = 0; t < T; t++) {
        float *q = qkv + t * nqkv, *k = q + qd;
        s->rms_norm(q, L->q_norm, q, head ? s->h_q : 1, head ? d : qd, s->eps);
        s->rms_norm(k, L->k_norm, k, head ? s->h_kv : 1, head ? d : kd, s->eps);
    }
}

static void add_into(float *h, const float *delta, int64_t n) {
    for (int64_t j = 0; j < n; j++) h[j] += delta[j];
}

/* Runs every layer. h [T, hidden]: the residual stream (the embeddings in; the last layer's output, before the
 * final norm, out). Scratch: x [T, hidden] (each layer's normed input), qkv [T, qkv.n], attn [T, h_q d],
 * delta [T, hidden], gu [T, 2 intermediate], act [T, intermediate]. Returns 0;
 * -1 for inconsistent shapes (nothing done); -4 when a caller's MLP failed, -2 when a matmul could not allocate
 * scratch memory and -3 when the
 * attention could not, both mid-way: h, x and this step's cache slots are then partly written (the caller recomputes
 * the step from the embeddings; rewriting a slot with the same values is harmless). */
int kvserve_decoder_stack(const DecoderStack *s, const DecoderStep *p, float *h, float *x, float *qkv, float *attn,
                          float *delta, float *gu, float *act) {
    const int64_t T = p->T, H = s->hidden, qd = s->h_q * s->d, I = s->intermediate;
    const float res = s->residual_multiplier;
    if (p->kv_dtype < 0 || p->kv_dtype > 2) return -1;
    const rope_write_attend_fn attend = s->rope_write_attend[p->kv_dtype];
    for (int64_t i = 0; i < s->num_layers; i++) {
        const DecoderLayer *L = s->layers + i;
        if (L->qkv.k != H || qkv_width(L) != (s->h_q + 2 * s->h_kv) * s->d || L->o.k != qd || L->o.n != H ||
            (L->qkv_rest[0].n && L->qkv_rest[0].k != H) || (L->qkv_rest[1].n && L->qkv_rest[1].k != H) ||
            (!L->mlp && (L->gate_up.k != H || L->gate_up.n != 2 * I || L->down.k != I || L->down.n != H)) ||
            L->rope < 0 ||
            L->rope >= MAX_ROPES || !p->cos[L->rope] || !p->sin[L->rope] || (L->qk_norm && !(L->q_norm && L->k_norm)))
            return -1;
    }
    int64_t t0 = p->timing_ns ? now_ns() : 0;
    if (s->layers[0].pre_norms) s->rms_norm(h, s->attn_norm, x, T, H, s->eps);
    lap(p, &t0, T_ELEMENTWISE);
    for (int64_t i = 0; i < s->num_layers; i++) {
        const DecoderLayer *L = s->layers + i;
        const int64_t nqkv = qkv_width(L);
        char *k_cache = (char *)p->kv_cache + i * p->layer_bytes, *v_cache = k_cache + p->layer_bytes / 2;
        const float *in = L->pre_norms ? x : h;
        const QWeight *parts[3] = {&L->qkv, &L->qkv_rest[0], &L->qkv_rest[1]};
        for (int64_t j = 0, col = 0; j < 3; col += parts[j]->n, j++)
            if (parts[j]->n && kvserve_qgemm((int)parts[j]->fmt, (int)s->isa, (int)s->act, in, T, H, parts[j]->w,
                                             parts[j]->n, parts[j]->oscale, qkv + col, nqkv))
                return -2;
        bias_scale(qkv, L->qkv_bias, 1.0f, T, nqkv);
        lap(p, &t0, T_MATMUL);
        if (L->qk_norm) qk_norm(s, L, qkv, T, nqkv);
        lap(p, &t0, T_ELEMENTWISE);
        if (attend(qkv, nqkv, T, p->cos[L->rope], p->sin[L->rope], p->slot_mapping, k_cache, v_cache, p->block_tables,
                   p->max_blocks, p->q_start, p->q_len, p->seq_len, p->num_reqs, s->h_q, s->h_kv, s->d, p->block_size,
                   s->scale, attn, qd, L->window, L->softcap, L->sinks))
            return -3;
        lap(p, &t0, T_ATTENTION);
        if (kvserve_qgemm((int)L->o.fmt, (int)s->isa, (int)s->act, attn, T, qd, L->o.w, H, L->o.oscale, delta, H))
            return -2;
        bias_scale(delta, L->o_bias, res, T, H);
        lap(p, &t0, T_MATMUL);
        if (L->post_attn_norm) s->rms_norm(delta, L->post_attn_norm, delta, T, H, s->eps);
        if (L->mlp_norm) {
            s->add_rms_norm(h, delta, L->mlp_norm, x, T, H, s->eps);
            in = x;
        } else {
            add_into(h, delta, T * H);
            in = h;
        }
        lap(p, &t0, T_ELEMENTWISE);
        if (L->mlp) {
            if (L->mlp(in, delta, T, i)) return -4;
            bias_scale(delta, NULL, res, T, H);
            lap(p, &t0, T_MATMUL);
        } else {
            if (kvserve_qgemm((int)L->gate_up.fmt, (int)s->isa, (int)s->act, in, T, H, L->gate_up.w, 2 * I,
                              L->gate_up.oscale, gu, 2 * I))
                return -2;
            bias_scale(gu, L->gate_up_bias, 1.0f, T, 2 * I);
            lap(p, &t0, T_MATMUL);
            s->act_mul(gu, act, T, I);
            lap(p, &t0, T_ELEMENTWISE);
            if (kvserve_qgemm((int)L->down.fmt, (int)s->isa, (int)s->act, act, T, I, L->down.w, H, L->down.oscale,
                              delta, H))
                return -2;
            bias_scale(delta, L->down_bias, res, T, H);
            lap(p, &t0, T_MATMUL);
        }
        if (L->post_mlp_norm) s->rms_norm(delta, L->post_mlp_norm, delta, T, H, s->eps);
        if (L->next_norm)
            s->add_rms_norm(h, delta, L->next_norm, x, T, H, s->eps);
        else
            add_into(h, delta, T * H);
        lap(p, &t0, T_ELEMENTWISE);
    }
    return 0;
}
