/*
 * The CPU's features, read once: the only file of the library that runs cpuid or
 * __builtin_cpu_*, or asks Linux for AMX's register state (cpu_features.h says what each
 * field means). The library is built for the architecture's baseline; these features decide
 * which of its target-attributed functions may run.
 *
 * AMX: Linux hands a process the tiles' register state only when asked (arch_prctl
 * ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, 18, Linux 5.16 on); without it the first tile
 * instruction kills the process. Asked once, here, at load, for the whole process (torch's
 * oneDNN asks the same), and only where this build has the tile intrinsics (amx.h).
 */
#include "cpu_features.h"

#include "quant_blocks.h"

#include "amx.h"

#if QUANT_X86
#include <cpuid.h>
#endif
#if AMX_X86
#include <sys/syscall.h>
#include <unistd.h>
#endif

static struct cpu_features features;
static int features_read;

#if AMX_X86
static int amx_granted(void) {
    unsigned long permitted = 0;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18)) return 0;
    if (syscall(SYS_arch_prctl, 0x1022 /* ARCH_GET_XCOMP_PERM */, &permitted)) return 0;
    return (permitted >> 18) & 1;
}
#endif

static void read_features(struct cpu_features *f) {
    f->best_isa = ISA_PORTABLE;
#if QUANT_X86
    __builtin_cpu_init();
    unsigned eax = 0, ebx, ecx = 0, edx;
    const int leaf1_ok = __get_cpuid(1, &eax, &ebx, &ecx, &edx);
    const unsigned signature = eax;
    /* Every function of the AVX2 path may use AVX2, FMA and F16C (TARGET_AVX2), the AVX-512
     * ones F, BW, VL (TARGET_AVX512) and DQ (paged_attention_cpu.c) too. F16C: bit 29 of
     * leaf 1's ecx (older compilers' __builtin_cpu_supports does not know it). */
    const int f16c = leaf1_ok && (ecx >> 29 & 1);
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
    const int avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                       __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    f->best_isa = avx512 ? ISA_AVX512 : avx2 ? ISA_AVX2 : ISA_PORTABLE;
    f->intel = __builtin_cpu_is("intel");
    f->avx512_vnni = avx512 && __builtin_cpu_supports("avx512vnni");
    if (__builtin_cpu_is("amd") && leaf1_ok) {
        f->amd_family = (signature >> 8) & 0xf;
        if (f->amd_family == 0xf) f->amd_family += (signature >> 20) & 0xff; /* extended */
    }
    if (__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) f->avx512_bf16 = (eax >> 5) & 1;
    /* AMX-BF16 (bit 22) and AMX-TILE (bit 24) of leaf 7's edx */
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx))
        f->amx = (edx >> 22 & 1) && (edx >> 24 & 1);
#endif
#if AMX_X86
    if (f->amx) f->amx_granted = amx_granted();
#endif
}

const struct cpu_features *cpu_features(void) {
    if (!features_read) { /* at load (below), before any other thread can call */
        read_features(&features);
        features_read = 1;
    }
    return &features;
}

__attribute__((constructor)) static void read_at_load(void) { cpu_features(); }

int pagecli_isa_supported(int isa) {
    return isa >= ISA_PORTABLE && isa <= cpu_features()->best_isa;
}

int pagecli_cpu_feature_bits(void) {
    const struct cpu_features *f = cpu_features();
    return (f->intel ? CPU_BIT_INTEL : 0) | (f->avx512_bf16 ? CPU_BIT_AVX512_BF16 : 0) |
           (f->avx512_vnni ? CPU_BIT_AVX512_VNNI : 0) | (f->amx ? CPU_BIT_AMX : 0) |
           (f->amx_granted ? CPU_BIT_AMX_GRANTED : 0);
}

int pagecli_cpu_amd_family(void) { return cpu_features()->amd_family; }
