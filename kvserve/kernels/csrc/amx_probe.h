/* Whether this process may use the AMX tiles, shared by qgemm.c (qgemm_amx.h, qgemm_amx_bf16.h) and
 * paged_attention.c (its AMX build): the CPU must report the features (CPUID.(EAX=7, ECX=0):EDX bit 24 AMX-TILE,
 * 25 AMX-INT8, 22 AMX-BF16) and Linux must grant the process the tile data state on request
 * (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); the kernel's Documentation/arch/x86/xstate.rst). The grant
 * is process-wide and permanent, so each answer is probed once and cached: CPUID traps to the hypervisor in a VM. */
#ifndef KVSERVE_AMX_PROBE_H
#define KVSERVE_AMX_PROBE_H
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define CPUID7_EDX_AMX_BF16 (1u << 22)
#define CPUID7_EDX_AMX_TILE (1u << 24)
#define CPUID7_EDX_AMX_INT8 (1u << 25)

/* 1 if CPUID.(EAX=7, ECX=0):EDX has every bit of edx_bits and Linux grants this process the tile data, else 0. */
static inline int amx_granted(unsigned edx_bits) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || (d & edx_bits) != edx_bits) return 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) return 0;
    unsigned long perm = 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &perm)) return 0;
    return (perm >> XFEATURE_XTILEDATA) & 1;
}

/* *cached (-1: not yet probed) or, the first time, probe()'s answer stored there. The race between two first
 * callers is benign (both store the same value). */
static inline int cached_probe(int *cached, int (*probe)(void)) {
    int v = __atomic_load_n(cached, __ATOMIC_RELAXED);
    if (v < 0) __atomic_store_n(cached, v = probe(), __ATOMIC_RELAXED);
    return v;
}
#endif
