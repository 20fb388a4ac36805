/* AVX2 helpers shared by kvserve's kernels. */
#ifndef KVSERVE_SIMD_H
#define KVSERVE_SIMD_H
#include <immintrin.h>

/* Sum of the 8 lanes. */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x per lane: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 polynomial (Cephes expf), 2^n through the
 * exponent bits. Relative error ~1e-7; x below -87.3 gives 0, above 88.3 gives +inf clamped to FLT_MAX range.
 * Defined for one vector width: ATTR its target attribute, V / VI its float / int vector types, P the intrinsics'
 * prefix (_mm256, _mm512), ROUND its round-to-nearest and CASTI its int -> float bit cast. */
#define KVSERVE_DEFINE_EXP(NAME, ATTR, V, VI, P, ROUND, CASTI)                                                     \
    ATTR static inline V NAME(V x) {                                                                                \
        x = P##_min_ps(P##_max_ps(x, P##_set1_ps(-87.3f)), P##_set1_ps(88.3f));                                     \
        const V n = ROUND(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)),                                          \
                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                                            \
        V r = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);                                                       \
        r = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), r);                                                      \
        V p = P##_set1_ps(1.9875691500e-4f);                                                                         \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.3981999507e-3f));                                                      \
        p = P##_fmadd_ps(p, r, P##_set1_ps(8.3334519073e-3f));                                                      \
        p = P##_fmadd_ps(p, r, P##_set1_ps(4.1665795894e-2f));                                                      \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.6666665459e-1f));                                                      \
        p = P##_fmadd_ps(p, r, P##_set1_ps(5.0000001201e-1f));                                                      \
        p = P##_fmadd_ps(p, P##_mul_ps(r, r), P##_add_ps(r, P##_set1_ps(1.0f)));                                    \
        const VI e = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23);                    \
        return P##_mul_ps(p, CASTI(e));                                                                              \
    }

/* e^x for 8 floats (AVX2 + FMA). */
KVSERVE_DEFINE_EXP(exp256, , __m256, __m256i, _mm256, _mm256_round_ps, _mm256_castsi256_ps)

/* tanh x per lane, by Cephes tanhf's method: with a = |x|, a + a^3 P(a^2) (a degree-4 polynomial in a^2) for
 * a < 0.625, else 1 - 2 / (e^(2a) + 1) (EXP, the e^x above: saturates to 1 for large a), the sign of x put back.
 * Relative error a few float32 ulps; one fixed sequence of operations per lane. SELECT_LT(a, c, lt, ge): per lane,
 * lt where a < c, else ge. Other parameters as KVSERVE_DEFINE_EXP's. */
#define KVSERVE_DEFINE_TANH(NAME, ATTR, V, P, EXP, SELECT_LT)                                                      \
    ATTR static inline V NAME(V x) {                                                                                \
        const V sign = P##_set1_ps(-0.0f), one = P##_set1_ps(1.0f);                                                 \
        const V a = P##_andnot_ps(sign, x), z = P##_mul_ps(a, a);                                                   \
        V p = P##_set1_ps(-5.70498872745e-3f);                                                                       \
        p = P##_fmadd_ps(p, z, P##_set1_ps(2.06390887954e-2f));                                                     \
        p = P##_fmadd_ps(p, z, P##_set1_ps(-5.37397155531e-2f));                                                    \
        p = P##_fmadd_ps(p, z, P##_set1_ps(1.33314422036e-1f));                                                     \
        p = P##_fmadd_ps(p, z, P##_set1_ps(-3.33332819422e-1f));                                                    \
        const V small = P##_fmadd_ps(P##_mul_ps(p, z), a, a);                                                       \
        const V e = EXP(P##_add_ps(a, a));                                                                          \
        const V large = P##_sub_ps(one, P##_div_ps(P##_set1_ps(2.0f), P##_add_ps(e, one)));                         \
        return P##_or_ps(SELECT_LT(a, P##_set1_ps(0.625f), small, large), P##_and_ps(sign, x));                     \
    }

static inline __m256 select_lt256(__m256 a, __m256 c, __m256 lt, __m256 ge) {
    return _mm256_blendv_ps(ge, lt, _mm256_cmp_ps(a, c, _CMP_LT_OQ));
}
/* tanh x for 8 floats (AVX2 + FMA). */
KVSERVE_DEFINE_TANH(tanh256, , __m256, _mm256, exp256, select_lt256)

#endif
