/*
 * Collectives of tensor-parallel ranks on one host through a shared memory segment
 * (layers/parallel.py). gloo's all-reduce of one hidden row takes about a millisecond between
 * two processes on one machine (its sockets and I/O threads); a decode step makes two per
 * layer. Here a rank copies its tensor into its slot, publishes the collective's number, waits
 * until every rank has published it, and reads the others' slots: a few microseconds.
 *
 * Segment layout: a header of 64-byte lines (line r: rank r's published number; the line
 * after the ranks': the abort flag), then two banks (by the collective number's parity) of
 * `size` slots of `slot_floats` floats. Reusing a bank two collectives later is safe: a rank
 * that has passed collective s-1 has seen every rank publish s-1, and each rank publishes s-1
 * only after it finished reading the slots of s-2.
 *
 * The sum runs over the slots in rank order on every rank, so every rank holds the same bits
 * (as with gloo). A wait ends with -1 on its time limit and -2 when the abort flag is set
 * (rank 0 sets it when a worker dies), so a dead peer never hangs the others.
 */
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "cpu_entry_points.h"

#define LINE_LONGS 8 /* 64 bytes */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

int64_t pagecli_shm_header_bytes(int32_t size) { return (int64_t)(size + 1) * LINE_LONGS * 8; }

static float *slot(char *base, int64_t slot_floats, int32_t size, int64_t number, int32_t rank) {
    float *banks = (float *)(base + pagecli_shm_header_bytes(size));
    return banks + ((number & 1) * size + rank) * slot_floats;
}

/* Publish this rank's `n` floats as collective `number` and wait for every rank's. */
static int publish_and_wait(char *base, int64_t slot_floats, int32_t rank, int32_t size,
                            int64_t number, const float *x, int64_t n, double timeout_s) {
    _Atomic int64_t *lines = (_Atomic int64_t *)base;
    memcpy(slot(base, slot_floats, size, number, rank), x, (size_t)n * sizeof(float));
    atomic_store_explicit(&lines[rank * LINE_LONGS], number, memory_order_release);
    double deadline = 0.0;
    for (int32_t r = 0; r < size; r++) {
        int64_t spins = 0;
        while (atomic_load_explicit(&lines[r * LINE_LONGS], memory_order_acquire) < number) {
            cpu_relax();
            if ((++spins & 1023) != 0) continue;
            if (atomic_load_explicit(&lines[size * LINE_LONGS], memory_order_relaxed)) return -2;
            if (spins > (1 << 16)) sched_yield(); /* a long wait: let the peer have the core */
            double t = now_s();
            if (deadline == 0.0) deadline = t + timeout_s;
            if (t > deadline) return -1;
        }
    }
    return 0;
}

int pagecli_shm_all_reduce(char *base, int64_t slot_floats, int32_t rank, int32_t size,
                           int64_t number, float *x, int64_t n, double timeout_s) {
    if (n > slot_floats) return -3;
    int status = publish_and_wait(base, slot_floats, rank, size, number, x, n, timeout_s);
    if (status) return status;
    const float *first = slot(base, slot_floats, size, number, 0);
    memcpy(x, first, (size_t)n * sizeof(float));
    for (int32_t r = 1; r < size; r++) {
        const float *other = slot(base, slot_floats, size, number, r);
        for (int64_t i = 0; i < n; i++) x[i] += other[i];
    }
    return 0;
}

int pagecli_shm_gather(char *base, int64_t slot_floats, int32_t rank, int32_t size,
                       int64_t number, const float *x, int64_t n, float *out, double timeout_s) {
    if (n > slot_floats) return -3;
    int status = publish_and_wait(base, slot_floats, rank, size, number, x, n, timeout_s);
    if (status || out == NULL) return status;
    for (int32_t r = 0; r < size; r++)
        memcpy(out + r * n, slot(base, slot_floats, size, number, r), (size_t)n * sizeof(float));
    return 0;
}

void pagecli_shm_abort(char *base, int32_t size) {
    _Atomic int64_t *lines = (_Atomic int64_t *)base;
    atomic_store_explicit(&lines[size * LINE_LONGS], 1, memory_order_release);
}
