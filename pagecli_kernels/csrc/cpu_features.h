/*
 * What this CPU (and its OS) runs, read once when the library loads (cpu_features.c): the one
 * place of the library that asks the CPU and Linux. Every other file reads cpu_features() and
 * names a path by enum cpu_isa.
 */
#ifndef PAGECLI_CPU_FEATURES_H
#define PAGECLI_CPU_FEATURES_H

/* The instruction-set paths, narrowest first; a wider one needs the narrower ones' features
 * (native.py's ISAS, in this order). */
enum cpu_isa { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

struct cpu_features {
    int best_isa;    /* the widest path: AVX2 = AVX2+FMA+F16C; AVX-512 = those and F+BW+VL+DQ */
    int intel;       /* GenuineIntel (MKL runs its AVX-512 code on Intel's CPUs only) */
    int amd_family;  /* AMD's family, the extended one added (0x19 Zen 3/4, 0x1A Zen 5); else 0 */
    int avx512_bf16; /* VDPBF16PS */
    int avx512_vnni; /* VPDPWSSD, on a CPU that runs the AVX-512 path */
    int amx;         /* AMX-TILE and AMX-BF16 */
    int amx_granted; /* ... usable: this build has the tile intrinsics and Linux granted their
                        register state */
};

/* The features, read on first call (the library's constructor makes that call at load);
 * the library's own, not exported. */
__attribute__((visibility("hidden"))) const struct cpu_features *cpu_features(void);

/* Exported for native.py: 1 when this CPU runs path `isa`. */
int pagecli_isa_supported(int isa);
/* Exported for native.py: the features as bits (CPU_BIT_*), and AMD's family. */
enum {
    CPU_BIT_INTEL = 1,
    CPU_BIT_AVX512_BF16 = 2,
    CPU_BIT_AVX512_VNNI = 4,
    CPU_BIT_AMX = 8,
    CPU_BIT_AMX_GRANTED = 16,
};
int pagecli_cpu_feature_bits(void);
int pagecli_cpu_amd_family(void);

#endif
