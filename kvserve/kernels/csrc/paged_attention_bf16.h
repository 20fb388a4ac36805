/* A bfloat16 cache read into AVX-512 registers: paged_attention_kv.h's cache-type macros for the AVX-512 and AMX
 * builds of paged_attention.c (which define FN, and KV_AMX for the AMX build, before including this), then that
 * header, which undefines them all again. */
#define KV_T uint16_t
#define KV_EXTRA 0
#define KV_SCALE(row, d) ((void)(row), (void)(d), VZERO)
#define KV_LOADV(p, s) ((void)(s), load16_bf16(p))
#define KV_PAIRS 1
#define KV_LOAD_PAIRS load32_bf16_pairs
#define KV_STORE_PAIRS store32_pairs
#define KV_STORE_ROW store_rows_bf16
#include "paged_attention_kv.h"
