/*
 * The machine's memory bandwidth, as the depthwise rows of the bench are judged against it: each
 * thread streams its share of a large array a into another, b[i] = s * a[i] (one stream read, one
 * written, as a depthwise layer reads x and writes y). The arrays are far larger than any cache and
 * first touched by the threads that stream them. Built by bench/bandwidth.py with -O3 -march=native
 * -fopenmp (vectorized, as the kernels are).
 */
#include <stdint.h>
#include <stdlib.h>

static float *a, *b;
static int64_t count;

/* Allocate the two arrays of n floats each, written once in the threads' static order; 0 on failure. */
int stream_alloc(int64_t n, int threads)
{
    a = aligned_alloc(64, (size_t)n * sizeof(float));
    b = aligned_alloc(64, (size_t)n * sizeof(float));
    if (!a || !b)
        return 0;
    count = n;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        a[i] = (float)(i & 1023);
        b[i] = 0.0f;
    }
    return 1;
}

void stream_free(void)
{
    free(a);
    free(b);
}

/* Bytes one call moves: every element of a read once, every element of b written once. */
double stream_bytes(void) { return 2.0 * (double)count * sizeof(float); }

/* One pass, b = s * a, on `threads` threads; returns an element of b so the pass is not dropped. */
float stream_scale(int threads, float s)
{
    const float *restrict src = a;
    float *restrict dst = b;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < count; i++)
        dst[i] = s * src[i];
    return b[count / 2];
}
