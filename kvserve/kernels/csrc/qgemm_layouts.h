/* The packed layouts' constants, generated from kvserve/quant/layouts.py by `python -m
 * kvserve.quant.layouts`: do not edit by hand (a test compares this file with the generator's
 * output, and kvserve/kernels/qgemm.py compares the compiled values with the Python records at load). */
#ifndef KVSERVE_QGEMM_LAYOUTS_H
#define KVSERVE_QGEMM_LAYOUTS_H

#define QK 32
#define G 16
enum { FMT_Q4 = 0, FMT_Q8 = 1, FMT_Q4F = 2, FMT_Q6 = 3, FMT_Q5F = 4, FMT_Q4K = 5, FMT_MX4 = 6, FMT_Q2K = 7, FMT_Q3K = 8 };
/* Q4: fp16 d[16], fp16 m[16], 256 bytes of nibbles */
#define Q4_BLOCK 320
#define Q4_D 0
#define Q4_M 32
#define Q4_QS 64
/* Q8: fp16 d[16], 512 int8 */
#define Q8_BLOCK 544
#define Q8_D 0
#define Q8_QS 32
/* Q4F: float32 d[16], m[16], 256 bytes of nibbles */
#define Q4F_BLOCK 384
#define Q4F_D 0
#define Q4F_M 64
#define Q4F_QS 128
/* Q6: fp16 d[16], int8 sc_lo[16], sc_hi[16], 256 bytes of low nibbles, 128 of high 2-bit fields */
#define Q6_BLOCK 448
#define Q6_D 0
#define Q6_SC_LO 32
#define Q6_SC_HI 48
#define Q6_QL 64
#define Q6_QH 320
/* Q5F: a Q4F block, then 64 bytes of fifth bits */
#define Q5F_BLOCK 448
#define Q5F_D 0
#define Q5F_M 64
#define Q5F_QS 128
#define Q5F_QH 384
/* Q4K: per 8 blocks fp16 d[16], dmin[16]; per block (288 bytes) uint8 sc[16], mn[16], 256 bytes of nibbles */
#define Q4K_BLOCK 288
#define Q4K_AVG_BLOCK 296
#define Q4K_SC 0
#define Q4K_MN 16
#define Q4K_QS 32
#define Q4K_SUPER 2368
#define Q4K_SB_D 0
#define Q4K_SB_DMIN 32
#define Q4K_SB_BLOCKS 64
/* MX4: uint8 E8M0 exponent e[16], 256 bytes of 4-bit E2M1 codes (w = kvalues[code] * 2^(e - 128)) */
#define MX4_BLOCK 272
#define MX4_E 0
#define MX4_QS 16
/* Q2K: per 8 blocks fp16 d[16], dmin[16]; per block (160 bytes) uint8 sc | mn << 4 [2][16] (per 16 inputs), 128 bytes of 2-bit values as Q6's high fields */
#define Q2K_BLOCK 160
#define Q2K_AVG_BLOCK 168
#define Q2K_SCMN 0
#define Q2K_QS 32
#define Q2K_SUPER 1344
#define Q2K_SB_D 0
#define Q2K_SB_DMIN 32
#define Q2K_SB_BLOCKS 64
/* Q3K: per 8 blocks fp16 d[16]; per block (224 bytes) int8 sc[2][16] (per 16 inputs), 128 bytes of low 2-bit fields as Q2K's, 64 bytes of third bits as Q5F's fifth bits (w = d sc (q - 4), q in 0..7) */
#define Q3K_BLOCK 224
#define Q3K_AVG_BLOCK 228
#define Q3K_SC 0
#define Q3K_QS 32
#define Q3K_QH 160
#define Q3K_SUPER 1824
#define Q3K_SB_D 0
#define Q3K_SB_BLOCKS 32

#define KVSERVE_Q_LAYOUT_N 61
#define KVSERVE_Q_LAYOUT {QK, G, Q4K_BLOCK, Q2K_BLOCK, Q3K_BLOCK, FMT_Q4, Q4_BLOCK, Q4_D, Q4_M, Q4_QS, FMT_Q8, Q8_BLOCK, Q8_D, Q8_QS, FMT_Q4F, Q4F_BLOCK, Q4F_D, Q4F_M, Q4F_QS, FMT_Q6, Q6_BLOCK, Q6_D, Q6_SC_LO, Q6_SC_HI, Q6_QL, Q6_QH, FMT_Q5F, Q5F_BLOCK, Q5F_D, Q5F_M, Q5F_QS, Q5F_QH, FMT_Q4K, Q4K_AVG_BLOCK, Q4K_SC, Q4K_MN, Q4K_QS, Q4K_SUPER, Q4K_SB_D, Q4K_SB_DMIN, Q4K_SB_BLOCKS, FMT_MX4, MX4_BLOCK, MX4_E, MX4_QS, FMT_Q2K, Q2K_AVG_BLOCK, Q2K_SCMN, Q2K_QS, Q2K_SUPER, Q2K_SB_D, Q2K_SB_DMIN, Q2K_SB_BLOCKS, FMT_Q3K, Q3K_AVG_BLOCK, Q3K_SC, Q3K_QS, Q3K_QH, Q3K_SUPER, Q3K_SB_D, Q3K_SB_BLOCKS}

#endif
