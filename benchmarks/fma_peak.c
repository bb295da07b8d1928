/*
 * This machine's float32 compute ceiling, for the benchmarks' floors: FLOP/s of twelve
 * independent fused multiply-add chains per thread, in registers, on the widest vectors the
 * CPU has (512 bits with AVX-512, else 256 with AVX2 and FMA, else scalar). Twelve chains
 * cover the FMA latency (4 cycles) times the FMA units (2) on the cores we run on. Built by
 * benchmarks/fma_peak.py through pagecli_kernels.native.build_and_load.
 */
#include <omp.h>
#include <stdint.h>

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx512f"))) static float chains512(int64_t iters) {
    __m512 a[12];
    const __m512 b = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps((float)i);
    for (int64_t n = 0; n < iters; n++)
        for (int i = 0; i < 12; i++) a[i] = _mm512_fmadd_ps(a[i], b, c);
    __m512 s = a[0];
    for (int i = 1; i < 12; i++) s = _mm512_add_ps(s, a[i]);
    return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx2,fma"))) static float chains256(int64_t iters) {
    __m256 a[12];
    const __m256 b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    for (int i = 0; i < 12; i++) a[i] = _mm256_set1_ps((float)i);
    for (int64_t n = 0; n < iters; n++)
        for (int i = 0; i < 12; i++) a[i] = _mm256_fmadd_ps(a[i], b, c);
    __m256 s = a[0];
    for (int i = 1; i < 12; i++) s = _mm256_add_ps(s, a[i]);
    float out[8];
    _mm256_storeu_ps(out, s);
    return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}
#endif

static float chains1(int64_t iters) {
    float a[12];
    for (int i = 0; i < 12; i++) a[i] = (float)i;
    for (int64_t n = 0; n < iters; n++)
        for (int i = 0; i < 12; i++) a[i] = __builtin_fmaf(a[i], 0.999999f, 1e-7f);
    float s = 0.0f;
    for (int i = 0; i < 12; i++) s += a[i];
    return s;
}

/* Floats per vector of the path this CPU takes. */
int pagecli_fma_lanes(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 16;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 8;
#endif
    return 1;
}

/* Seconds for `iters` rounds of the twelve chains on each of `threads` threads (each round:
 * 12 x lanes x 2 FLOP per thread). *sink receives the sums, so that none is left out. */
double pagecli_fma_run(int threads, int64_t iters, float *sink) {
    const int lanes = pagecli_fma_lanes();
    float total = 0.0f;
    const double start = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
#if defined(__x86_64__)
        if (lanes == 16) total += chains512(iters);
        else if (lanes == 8) total += chains256(iters);
        else
#endif
            total += chains1(iters);
    }
    const double seconds = omp_get_wtime() - start;
    *sink = total;
    return seconds;
}
