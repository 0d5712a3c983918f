/*
 * The machine's float32 FMA ceiling: every thread runs independent chains of vector FMAs on
 * accumulators that stay in registers, so nothing but the FMA units limits the rate.
 * ACC chains hide the FMA latency (latency × FMA ports ≤ ACC); each vector FMA is 2·LANES flops.
 * Built by bench/peak.py with -O2 -march=native -fopenmp.
 */
#include <stdint.h>
#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define ISA "avx512"
#define LANES 16
typedef __m512 vec;
#define SET1(v) _mm512_set1_ps(v)
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define SUM(v) _mm512_reduce_add_ps(v)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ISA "avx2"
#define LANES 8
typedef __m256 vec;
#define SET1(v) _mm256_set1_ps(v)
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
static float SUM(vec v) { float t[8]; _mm256_storeu_ps(t, v); return t[0]+t[1]+t[2]+t[3]+t[4]+t[5]+t[6]+t[7]; }
#else
#define ISA "portable"
#define LANES 4
typedef float vec __attribute__((vector_size(16)));
#define SET1(v) ((vec){v, v, v, v})
#define FMA(a, b, c) ((a) * (b) + (c))
static float SUM(vec v) { return v[0] + v[1] + v[2] + v[3]; }
#endif

#define ACC 12

const char *fma_isa(void) { return ISA; }

/* Flops of one call per thread. */
double fma_flops_per_thread(int64_t iters) { return 2.0 * LANES * ACC * (double)iters; }

/* Runs `iters` rounds of ACC FMAs on each of `threads` threads; the result only defeats dead-code removal. */
double fma_loop(int threads, int64_t iters)
{
    double total = 0.0;
    #pragma omp parallel num_threads(threads) reduction(+:total)
    {
        /* x ← x·a + b converges to b / (1 − a): values stay normal, never overflow or go denormal. */
        const vec a = SET1(0.999999f), b = SET1(1e-6f);
        vec acc[ACC];
        for (int k = 0; k < ACC; k++)
            acc[k] = SET1((float)(omp_get_thread_num() + k));
        for (int64_t i = 0; i < iters; i++) {
            #pragma GCC unroll 12
            for (int k = 0; k < ACC; k++)
                acc[k] = FMA(acc[k], a, b);
        }
        float s = 0.0f;
        for (int k = 0; k < ACC; k++)
            s += SUM(acc[k]);
        total += s;
    }
    return total;
}
