/* Paged attention over a float32, bfloat16 or int8 KV cache (queries, scores, softmax and sums in float32 always),
 * one kernel for every query length -- decode tokens, speculative verification spans, prompt chunks of any length,
 * the tails of prefix-cache hits -- in three instruction-set builds (AVX2 + FMA, AVX-512, and AMX: AVX-512 with a
 * bfloat16 cache's scores on AMX-BF16 tiles) chosen by the caller.
 *
 * PagedAttention (Kwon et al., SOSP 2023, section 4.1): each request's keys and values are read in place from the
 * global block pool through its block table, with no gathered copy. The work is split into tasks of (request, KV head,
 * block of about TASK_ROWS query rows: tokens x the G = H_q / H_kv query heads of the KV head, GQA), spread over OpenMP
 * threads (a (request, query block)'s KV heads to one thread together when there are many). A task walks its keys in
 * tiles of KT: the tile is transposed once ([d][KT], so one vector holds one element of KT / 2 keys) and every row of
 * the task that sees it gets its scores from a register-tiled product (paged_attention_isa.h, qk_rows); then each row's
 * softmax, exact and in float32 over all its keys (no online rescaling), then the weighted sums of the values, a tile
 * of rows and columns at a time (pv_rows).
 *
 * Masks. Causal, optionally with a sliding window (Mistral, Gemma; Beltagy et al. 2020, Longformer): the row at
 * position p sees the keys lo .. p, lo = max(0, p - window + 1) (Hugging Face's sliding_window: p - window < j <= p;
 * window 0: lo = 0). Keys outside are never read for that row: no score, no exponential, no term in any sum -- not a
 * masked value that could round to something other than nothing. Optional attention-logit soft-capping (Gemma 2):
 * each score s becomes cap * tanh(s / cap) before the softmax (cap 0: none). Optional attention sinks (gpt-oss;
 * Xiao et al. 2024, "Efficient streaming language models with attention sinks"): a learned logit per query head
 * that joins each row's softmax denominator (and its maximum) but weighs no value (sinks NULL: none).
 *
 * Batch invariance. Every number a query row produces is one fixed sequence of float operations on that row's query
 * and the keys and values at positions lo .. its own:
 *   score_j  = sum over k = 0 .. d-1 in order of (q_k * scale) * K_jk, one FMA per term from zero;
 *              with a cap, then cap * tanh(score_j / cap) (simd.h's tanh, each lane on its own);
 *   p_j      = e^(score_j - max) * (1 / sum), the sum over lanes ((j - lo) mod W) in ascending j, then a fixed lane
 *              tree; exactly 0 where score_j - max < -SOFTMAX_FLUSH (paged_attention_isa.h);
 *   out_c    = sum over j = lo .. position in order of p_j * V_jc, one FMA per term from zero.
 * lo depends on the row's position and the window only, so a key tile outside the windows of all a task's rows is
 * not computed, and a task starts its key walk at its first row's lo: neither changes any row's sequence.
 * No reduction is split across tiles, tasks or threads, so the result does not depend on the chunk the row arrived
 * in, the other rows of its request or of the step, the batch, the tiling or the thread count. With row-wise
 * matmuls, norms and RoPE, a token's logits are then bit-identical however it is scheduled. The builds round
 * differently (W = 8 or 16 lanes in the softmax sum; AMX's scores below), so results are identical per ISA, not
 * across ISAs.
 *
 * The AMX build (bfloat16 cache; float32 and int8 caches run the AVX-512 kernel under its names). A decode task
 * holds a few query rows (3 for the default model: the query heads of one KV head), so transposing each key tile
 * for the score product costs as much as the product. On AMX-BF16 the keys need no transpose: a tile's 16 key rows
 * are the A operand as they lie in the cache (read in place when they are consecutive slots of one block), the
 * task's queries, scaled and rounded to bfloat16 once, the B operand, and TDPBF16PS sums each score in float32:
 *   score_j  = the tile unit's sum over the head's chunks of 32 elements, in order, of bf16(q_k * scale) * K_jk,
 * each element of C from its own key row and query row only, so the batch invariance above holds unchanged (the
 * tests check every chunking, thread count and neighbour bit for bit). Key tiles start at multiples of 16 keys.
 * The softmax and the weighted sums are the AVX-512 build's. Measured: one layer's batch-64 decode step 0.89x the
 * AVX-512 build's time, a 1,000-token prompt's 0.82x (docs/kv_cache_dtype.md, "The AMX build").
 *
 * kvserve_rope_write_attend_sink_<type>_<isa> (and kvserve_rope_write_attend_sw_<...>, the same without sinks, and
 * kvserve_rope_write_attend_<...>, without a window or a cap either) is a decoder layer's whole attention step
 * after the fused Q/K/V projection in one call (RoPE on q and k, the K/V write into the cache slots, this kernel),
 * so a layer makes one call instead of a dozen PyTorch ops (each a dispatch and a new tensor) and a kernel call.
 *
 * Prefetching. A task reads its keys and values once, but from scattered blocks (a KV head's row of a token is
 * 64-256 bytes, a block a few KiB, blocks anywhere in the pool), where the hardware prefetchers lose the stream at
 * every block edge; a decode step of many short requests (batch 64 x 128-256 keys) was bound by those misses. Each
 * key tile therefore prefetches the next tile's key rows (into L1) and its own value rows (into L2, read after the
 * softmax). Prefetches change no arithmetic: the same bits (benchmarks/kv_cache_dtype.py --measure attention
 * --baseline-lib OLD.so compares two builds call by call).
 *
 * Causality: query row i of a request with q_len rows and seq_len keys sits at position seq_len - q_len + i and
 * sees keys lo..that position (Masks, above).
 *
 * Layout: k_cache, v_cache: [num_blocks, block_size, H_kv, D] (one layer's K or V; int8: D + 2, each row's
 * bfloat16 scale after its values); q: row t, head h at
 * q + t * q_stride + h * D; out: row t, head h at out + t * out_stride + h * D. D must be a multiple of 8 (AVX2) or
 * 16 (AVX-512).
 *
 * The cache's element type and the ISA are template parameters: paged_attention_isa.h is included once per ISA and
 * paged_attention_kv.h once per (ISA, type), defining kvserve_paged_attention_<type>_<isa> and
 * kvserve_rope_write_attend[_sw]_<type>_<isa> (type f32, bf16, i8; isa avx2, avx512). A bfloat16 cache halves the
 * bytes a decode step reads (attention of many long contexts is bound by reading them): keys and values are rounded
 * to bfloat16 when written (round to nearest even, as PyTorch's float -> bfloat16 cast, so the reference path reads
 * the same values) and widened to float32 exactly when read. An int8 cache takes 66 bytes a row of 64 (store_rows_i8:
 * a scale per token and KV head), read as q * s, exact in float32: attention over it is the float32 kernel over
 * those values, bit for bit, so it keeps the batch invariance above; the only change is the quantization of what is
 * stored, once, when a token's K/V are written.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

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
static inline void store_rows_bf16(uint16_t *dst, const float *src, int64_t h, int64_t d) {
    store_row_bf16(dst, src, h * d);
}
static inline void store_rows_f32(float *dst, const float *src, int64_t h, int64_t d) {
    memcpy(dst, src, sizeof(float) * (size_t)(h * d));
}

/* int8 rows (kv_cache_dtype "int8"; kvserve/attention/kv_layout.py): each (token, KV head) row is d int8 values q
 * then a bfloat16 scale s (2 bytes, little-endian), and reads as q * s, exact in float32 (7-bit q, 8-bit
 * significand s). Writing, per row: s = bf16_round(max |x| / 127) (float32 division), q = clamp(round_half_even(x
 * / s), -127, 127) (float32 division), bit for bit as kv_layout.quantize_int8; a zero scale stores q = 0, and a row
 * with a NaN or an infinity q = 0 and the NaN scale 0x7fc0 (it reads as NaN). d: a multiple of 8. */
static inline float bf16_widen(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline float row_scale_i8(const int8_t *row, int64_t d) {
    uint16_t b;
    memcpy(&b, row + d, sizeof b);
    return bf16_widen(b);
}

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

/* Every 64-byte line of the n bytes at p prefetched (hint: _MM_HINT_T0 into L1, _MM_HINT_T1 into L2). */
#define prefetch_row(p, n, hint)                                                                                   \
    do {                                                                                                           \
        const char *p_ = (const char *)(p);                                                                        \
        for (int64_t o_ = 0; o_ < (n); o_ += 64) _mm_prefetch(p_ + o_, hint);                                     \
        _mm_prefetch(p_ + (n) - 1, hint);                                                                          \
    } while (0)

/* The first key the query at position pos sees: pos - window + 1, or 0 (window 0: no window; Masks, above). */
static inline int64_t first_key(int64_t pos, int64_t window) {
    return window > 0 && pos + 1 > window ? pos + 1 - window : 0;
}

/* Tasks with at least this many multiply-adds (queries x keys x D) in all are split over OpenMP threads; below it
 * one thread does them all (a decode step of one short request: waking a second thread costs more than it saves). */
#define PARALLEL_MIN_MACS (256 * 1024)
/* Rows (query tokens x G heads) per task, and the most scores a task keeps (4 MiB: long contexts get fewer rows). */
#define TASK_ROWS 64
#define TASK_SCORE_FLOATS (1024 * 1024)
/* A thread takes a (request, query block)'s tasks of every KV head together where there are at least this many such
 * groups per thread (attend below): 0.90x the time of one task at a time on a batch-64 decode step's cold caches. */
#define TASK_GROUPS_PER_THREAD 8

/* ---- AVX2 + FMA (the library's baseline flags) ---- */
static inline __m256 keep8(__m256 v, int64_t n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lane)));
}
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
/* r[0..8) transposed in place (8 x 8 floats). */
static inline void transpose8(__m256 *r) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xee);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xee);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xee);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xee);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20); r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20); r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31); r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31); r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

static inline void store_rows_i8(int8_t *dst, const float *src, int64_t h, int64_t d) {
    const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(3.40282347e38f);
    for (int64_t e = 0; e < h; e++) {
        const float *x = src + e * d;
        int8_t *q = dst + e * (d + 2);
        __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) {
            const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
            amax = _mm256_max_ps(amax, a);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ)); /* infinite or NaN */
        }
        const int finite = _mm256_movemask_ps(bad) == 0;
        const uint16_t sb = finite ? bf16_round(hmax8(amax) / 127.0f) : 0x7fc0;
        const float s = bf16_widen(sb);
        if (finite && s > 0) {
            const __m256 sv = _mm256_set1_ps(s), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
            for (int64_t i = 0; i < d; i += 8) {
                __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), sv),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                const __m256i n = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
                const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
                _mm_storel_epi64((__m128i *)(q + i), _mm_packs_epi16(w, w));
            }
        } else {
            memset(q, 0, (size_t)d);
        }
        memcpy(q + d, &sb, sizeof sb);
    }
}
/* W int8 values at p as float32, times the row's scale s. */
static inline __m256 load8_i8(const int8_t *p, __m256 s) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))), s);
}

#define TGT
#define ISA(x) x##_avx2
#define W 8
#define V __m256
#define VZERO _mm256_setzero_ps()
#define VSET1 _mm256_set1_ps
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VFMA _mm256_fmadd_ps
#define VADD _mm256_add_ps
#define VSUB _mm256_sub_ps
#define VMUL _mm256_mul_ps
#define VDIV _mm256_div_ps
#define VMAX _mm256_max_ps
#define VKEEP_GE(v, x, c) _mm256_and_ps(v, _mm256_cmp_ps(x, c, _CMP_GE_OQ))
#define VEXP exp256
#define VTANH tanh256
#define VHSUM hsum
#define VHMAX hmax8
#define VKEEP keep8
#define VTRANSPOSE transpose8
#include "paged_attention_isa.h"

#define KV_T float
#define FN(x) x##_f32_avx2
#define KV_EXTRA 0
#define KV_SCALE(row, d) ((void)(row), (void)(d), VZERO)
#define KV_LOADV(p, s) ((void)(s), load8_f32(p))
#define KV_STORE_ROW store_rows_f32
#include "paged_attention_kv.h"

#define KV_T uint16_t
#define FN(x) x##_bf16_avx2
#define KV_EXTRA 0
#define KV_SCALE(row, d) ((void)(row), (void)(d), VZERO)
#define KV_LOADV(p, s) ((void)(s), load8_bf16(p))
#define KV_STORE_ROW store_rows_bf16
#include "paged_attention_kv.h"

#define KV_T int8_t
#define FN(x) x##_i8_avx2
#define KV_EXTRA 2
#define KV_SCALE(row, d) _mm256_set1_ps(row_scale_i8(row, d))
#define KV_LOADV load8_i8
#define KV_STORE_ROW store_rows_i8
#include "paged_attention_kv.h"

#undef TGT
#undef ISA
#undef W
#undef V
#undef VZERO
#undef VSET1
#undef VLOAD
#undef VSTORE
#undef VFMA
#undef VADD
#undef VSUB
#undef VMUL
#undef VDIV
#undef VMAX
#undef VKEEP_GE
#undef VEXP
#undef VTANH
#undef VHSUM
#undef VHMAX
#undef VKEEP
#undef VTRANSPOSE
#undef QK_ROWS
#undef PV_ROWS
#undef PV_VECS
#undef KT

/* ---- AVX-512 (F, with the others every AVX-512 CPU kvserve runs on has), by function attribute: built everywhere,
 * called only where the caller found the CPU supports it ---- */
#define T512 __attribute__((target("avx2,fma,avx512f,avx512dq,avx512bw,avx512vl")))
/* bf16_round of 16 floats, each in the low 16 bits of its 32-bit lane (the same integer arithmetic; NaN: 0x7fc0). */
T512 static inline __m512i bf16_round16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                        _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)))), 16);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}
/* 32 bfloat16 at p widened exactly: *even = columns 0, 2, .., 30, *odd = 1, 3, .., 31 (one load, one op each). */
#define load32_bf16_pairs(p, even, odd)                                                                        \
    do {                                                                                                       \
        const __m512i u_ = _mm512_loadu_si512((const void *)(p));                                              \
        (even) = _mm512_castsi512_ps(_mm512_slli_epi32(u_, 16));                                               \
        (odd) = _mm512_castsi512_ps(_mm512_and_si512(u_, _mm512_set1_epi32((int)0xFFFF0000u)));               \
    } while (0)
/* out[0 .. 31] from even (columns 0, 2, ..) and odd (1, 3, ..) in order. */
#define store32_pairs(out, even, odd)                                                                          \
    do {                                                                                                       \
        const __m512i lo_ = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);        \
        _mm512_storeu_ps((out), _mm512_permutex2var_ps((even), lo_, (odd)));                                   \
        const __m512i hi_ = _mm512_add_epi32(lo_, _mm512_set1_epi32(8));                                      \
        _mm512_storeu_ps((out) + 16, _mm512_permutex2var_ps((even), hi_, (odd)));                              \
    } while (0)
T512 static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
T512 static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
T512 static inline __m512 load16_i8(const int8_t *p, __m512 s) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))), s);
}
T512 static inline __m512 keep16(__m512 v, int64_t n) { return _mm512_maskz_mov_ps((__mmask16)((1u << n) - 1), v); }
T512 static inline float hsum16(__m512 v) {
    const __m256 s = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    return hsum(s);
}
T512 static inline float hmax16(__m512 v) { return _mm512_reduce_max_ps(v); }
/* e^x for 16 floats (simd.h's method). */
KVSERVE_DEFINE_EXP(exp512, T512, __m512, __m512i, _mm512, _mm512_roundscale_ps, _mm512_castsi512_ps)
T512 static inline __m512 select_lt512(__m512 a, __m512 c, __m512 lt, __m512 ge) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, c, _CMP_LT_OQ), ge, lt);
}
/* tanh x for 16 floats (simd.h's method). */
KVSERVE_DEFINE_TANH(tanh512, T512, __m512, _mm512, exp512, select_lt512)
/* r[0..16) transposed in place (16 x 16 floats): 4 x 4 blocks within each 128-bit lane, then the lanes. */
T512 static inline void transpose16(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

#define TGT T512
#define ISA(x) x##_avx512
#define W 16
#define V __m512
#define VZERO _mm512_setzero_ps()
#define VSET1 _mm512_set1_ps
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VFMA _mm512_fmadd_ps
#define VADD _mm512_add_ps
#define VSUB _mm512_sub_ps
#define VMUL _mm512_mul_ps
#define VDIV _mm512_div_ps
#define VMAX _mm512_max_ps
#define VKEEP_GE(v, x, c) _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, c, _CMP_GE_OQ), v)
#define VEXP exp512
#define VTANH tanh512
#define VHSUM hsum16
#define VHMAX hmax16
#define VKEEP keep16
#define VTRANSPOSE transpose16
#include "paged_attention_isa.h"

#define KV_T float
#define FN(x) x##_f32_avx512
#define KV_EXTRA 0
#define KV_SCALE(row, d) ((void)(row), (void)(d), VZERO)
#define KV_LOADV(p, s) ((void)(s), load16_f32(p))
#define KV_STORE_ROW store_rows_f32
#include "paged_attention_kv.h"

#define FN(x) x##_bf16_avx512
#include "paged_attention_bf16.h"

#define KV_T int8_t
#define FN(x) x##_i8_avx512
#define KV_EXTRA 2
#define KV_SCALE(row, d) _mm512_set1_ps(row_scale_i8(row, d))
#define KV_LOADV load16_i8
#define KV_STORE_ROW store_rows_i8
#include "paged_attention_kv.h"

/* ---- AMX-BF16 (Sapphire Rapids and later): the AVX-512 build, with the scores of a bfloat16 cache computed on
 * tiles (paged_attention_kv.h, qk_amx: a key tile is 16 cache rows read in place, no transpose); float32 and int8
 * caches run the AVX-512 kernel unchanged under this build's names ---- */
#include "amx_probe.h"

static int amx_bf16_tiles(void) { return amx_granted(CPUID7_EDX_AMX_TILE | CPUID7_EDX_AMX_BF16); }

/* 1 if the CPU has AMX-TILE and AMX-BF16 and Linux grants this process the tile data (amx_probe.h), else 0; probed
 * once. The AMX build's kernels call it first (it is also what asks Linux for the tiles). */
int kvserve_attention_amx_usable(void) {
    static int cached = -1;
    return cached_probe(&cached, amx_bf16_tiles);
}

#define TAMX __attribute__((target("avx2,fma,avx512f,avx512dq,avx512bw,avx512vl,amx-tile,amx-bf16")))
/* The offsets of a 16 x 16 tile's column 0 (row m at 16 m): a row's column n is gathered at these plus n. */
TAMX static inline __m512i tile_column0(void) {
    return _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
}

/* Palette 1, tiles 0-2 of 16 rows x 64 bytes (qk_amx's C, key and query tiles). */
TAMX static void amx_attention_configure(void) {
    struct {
        uint8_t palette_id, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 3; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg)); /* names the whole struct (gcc 12's _tile_loadconfig does not) */
}

#undef TGT
#define TGT TAMX
#define FN(x) x##_bf16_amx
#define KV_AMX 1
#include "paged_attention_bf16.h"

/* The float32 and int8 caches' functions under the AMX build's names: the AVX-512 kernel's. */
#define AMX_ALIAS(name, type) \
    __typeof__(name##_##type##_avx512) name##_##type##_amx __attribute__((alias(#name "_" #type "_avx512")));
#define AMX_ALIASES(type)                                  \
    AMX_ALIAS(kvserve_paged_attention, type)               \
    AMX_ALIAS(kvserve_rope_write_attend, type)             \
    AMX_ALIAS(kvserve_rope_write_attend_sw, type)          \
    AMX_ALIAS(kvserve_rope_write_attend_sink, type)
AMX_ALIASES(f32)
AMX_ALIASES(i8)
