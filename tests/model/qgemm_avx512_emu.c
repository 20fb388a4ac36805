/* Tests only: qgemm.c compiled with SIMDe's portable implementations of the AVX-512 intrinsics (the Debian package
 * libsimde-dev), so the AVX-512 VNNI path's logic -- layouts, the q_x + 128 correction, tiles, epilogues -- runs
 * and is checked on a CPU without AVX-512 (tests/model/test_quant_kernels.py). It says nothing about speed, nor
 * about the real instructions' encoding. Written out below (always inlined: called from qgemm.c's AVX2-target
 * functions, an out-of-line call would pass the vector under a different ABI): intrinsics SIMDe 0.7 lacks, and the
 * FMAs, which SIMDe without a native FMA computes as a product and a sum rounded apart: the kernels depend on the
 * single rounding (the int8-pair quantizer's residual x - q1 d1 is exact only so; with two roundings q2 moves by one
 * at some values and the path's bits are no longer the native path's). */
#include <immintrin.h>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
static float emu_h2f(uint16_t h) {
    uint32_t e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? ldexpf((float)m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexpf((float)(m + 1024), (int)e - 25);
    return (h >> 15) ? -v : v;
}
static inline __attribute__((always_inline)) simde__m512 emu_mm512_cvtph_ps(simde__m256i h) {
    uint16_t in[16]; float out[16];
    memcpy(in, &h, 32);
    for (int i = 0; i < 16; i++) out[i] = emu_h2f(in[i]);
    return simde_mm512_loadu_ps(out);
}
#define _mm512_cvtph_ps(h) emu_mm512_cvtph_ps(h)
static inline __attribute__((always_inline)) simde__m512 emu_mm512_cvtepi32_ps(simde__m512i a) {
    int32_t in[16]; float out[16];
    memcpy(in, &a, 64);
    for (int i = 0; i < 16; i++) out[i] = (float)in[i];
    return simde_mm512_loadu_ps(out);
}
#define _mm512_cvtepi32_ps(a) emu_mm512_cvtepi32_ps(a)
static inline __attribute__((always_inline)) simde__m512i emu_mm512_cvtepi8_epi32(simde__m128i a) {
    int8_t in[16]; int32_t out[16];
    memcpy(in, &a, 16);
    for (int i = 0; i < 16; i++) out[i] = in[i];
    return simde_mm512_loadu_si512(out);
}
#define _mm512_cvtepi8_epi32(a) emu_mm512_cvtepi8_epi32(a)
static inline __attribute__((always_inline)) simde__m512i emu_mm512_cvtepu8_epi32(simde__m128i a) {
    uint8_t in[16]; int32_t out[16];
    memcpy(in, &a, 16);
    for (int i = 0; i < 16; i++) out[i] = in[i];
    return simde_mm512_loadu_si512(out);
}
#define _mm512_cvtepu8_epi32(a) emu_mm512_cvtepu8_epi32(a)
/* r = a b + c per lane, rounded once (fmaf; sign -1: the fnmadd form -(a b) + c). */
static inline __attribute__((always_inline)) void emu_fma_lanes(float *r, const float *b, const float *c, int n, float sign) {
    for (int i = 0; i < n; i++) r[i] = fmaf(sign * r[i], b[i], c[i]);
}
#define EMU_FMA(name, vec, n, sign)                                                                     \
    static inline __attribute__((always_inline)) vec name(vec a, vec b, vec c) {                        \
        float r[n], bb[n], cc[n];                                                                       \
        memcpy(r, &a, sizeof r), memcpy(bb, &b, sizeof bb), memcpy(cc, &c, sizeof cc);                  \
        emu_fma_lanes(r, bb, cc, n, sign);                                                              \
        memcpy(&a, r, sizeof r);                                                                        \
        return a;                                                                                       \
    }
EMU_FMA(emu_mm256_fmadd_ps, simde__m256, 8, 1.0f)
EMU_FMA(emu_mm256_fnmadd_ps, simde__m256, 8, -1.0f)
EMU_FMA(emu_mm512_fmadd_ps, simde__m512, 16, 1.0f)
#undef _mm256_fmadd_ps
#undef _mm256_fnmadd_ps
#undef _mm512_fmadd_ps
#define _mm256_fmadd_ps(a, b, c) emu_mm256_fmadd_ps(a, b, c)
#define _mm256_fnmadd_ps(a, b, c) emu_mm256_fnmadd_ps(a, b, c)
#define _mm512_fmadd_ps(a, b, c) emu_mm512_fmadd_ps(a, b, c)
#define KVSERVE_Q_EMULATE_AVX512 1
#include "../../kvserve/kernels/csrc/qgemm.c"
