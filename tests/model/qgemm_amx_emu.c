/* Tests only: qgemm.c's AMX-INT8 path (csrc/qgemm_amx.h) with the tile operations written out in C, on top of the
 * SIMDe AVX-512 emulation (qgemm_avx512_emu.c), so the path's logic -- tile shapes, the B-tile unpacking, the
 * alternating C tiles, the row chunks and tails, the per-thread share of the groups -- runs and is checked on any
 * x86-64 CPU (tests/model/test_quant_kernels.py). Each operation follows its pseudocode in the Intel SDM (vol. 2,
 * TILELOADD, TILESTORED, TILEZERO, TDPBSSD, TDPBSUD): rows and bytes per row as the loaded configuration says,
 * int32 sums that wrap. It says nothing about speed. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static __thread struct {
    uint8_t t[8][16][64];
    int rows[8], colsb[8];
} emu_amx;

static void emu_ldtilecfg(const void *cfg) {
    const uint8_t *c = (const uint8_t *)cfg;
    memset(&emu_amx, 0, sizeof emu_amx);
    for (int i = 0; i < 8; i++) {
        uint16_t colsb;
        memcpy(&colsb, c + 16 + 2 * i, 2);
        emu_amx.colsb[i] = colsb;
        emu_amx.rows[i] = c[48 + i];
    }
}
static void emu_loadd(int t, const void *base, long stride) {
    for (int r = 0; r < emu_amx.rows[t]; r++) memcpy(emu_amx.t[t][r], (const uint8_t *)base + r * stride, emu_amx.colsb[t]);
}
static void emu_stored(int t, void *base, long stride) {
    for (int r = 0; r < emu_amx.rows[t]; r++) memcpy((uint8_t *)base + r * stride, emu_amx.t[t][r], emu_amx.colsb[t]);
}
static void emu_zero(int t) { memset(emu_amx.t[t], 0, sizeof emu_amx.t[t]); }
/* C[m][n] += sum over k of A[m][4k + i] * B[k][4n + i], A and B signed or unsigned bytes. */
static void emu_dp(int c, int a, int b, int a_signed, int b_signed) {
    for (int m = 0; m < emu_amx.rows[c]; m++)
        for (int n = 0; n < emu_amx.colsb[c] / 4; n++) {
            uint32_t acc;
            memcpy(&acc, &emu_amx.t[c][m][4 * n], 4);
            for (int k = 0; k < emu_amx.colsb[a] / 4; k++)
                for (int i = 0; i < 4; i++) {
                    uint8_t x = emu_amx.t[a][m][4 * k + i], w = emu_amx.t[b][k][4 * n + i];
                    int32_t xv = a_signed ? (int8_t)x : x, wv = b_signed ? (int8_t)w : w;
                    acc += (uint32_t)(xv * wv);
                }
            memcpy(&emu_amx.t[c][m][4 * n], &acc, 4);
        }
}
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbssd
#undef _tile_dpbsud
#define _tile_loadd(t, base, stride) emu_loadd(t, base, stride)
#define _tile_stored(t, base, stride) emu_stored(t, base, stride)
#define _tile_zero(t) emu_zero(t)
#define _tile_dpbssd(c, a, b) emu_dp(c, a, b, 1, 1)
#define _tile_dpbsud(c, a, b) emu_dp(c, a, b, 1, 0)
#define _tile_release() ((void)0)
#define AMX_LOAD_CONFIG(cfg) emu_ldtilecfg(&(cfg))
#define KVSERVE_Q_EMULATE_AMX 1
#include "qgemm_avx512_emu.c"
