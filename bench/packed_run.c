/* pyx/dk_packed.h's dk_pk_run alone, in C, bf16 weights: the packed linear's own rate without the
   Python call, the activation copy or the thread start, against where the weights live.

       gcc -O3 -fwrapv -fopenmp -march=x86-64-v3 -fassociative-math -fno-signed-zeros -fno-trapping-math \
           -ffp-contract=fast -Ipyx -DROWS=16 -DCOLS=12288 -DDEPTH=2048 -DNT=2 bench/packed_run.c -o /tmp/packed_run
       /tmp/packed_run

   (the flags the extension is built with for the avx2 tier: setup.py's, and -fwrapv from Python's own;
   without -fwrapv gcc compiled this loop nest to half the speed). N x K bf16 weights in huge pages, as
   dk.pack_weight allocates them: 12288 x 2048 (48 MiB) streams from DRAM, 256 x 1024 (512 KiB) stays
   in L2. NT threads split the panels as linear_packed does (contiguous runs). Values are arbitrary:
   only the time is read. */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

#include "dk_packed.h"

#ifndef ROWS
#define ROWS 16  /* M (the names M, N, K are dk_packed.h's parameters) */
#endif
#ifndef COLS
#define COLS 12288  /* N */
#endif
#ifndef DEPTH
#define DEPTH 2048  /* K */
#endif
#ifndef NT
#define NT 1
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
    const long M = ROWS, N = COLS, K = DEPTH;
    const long ldx = (K + 15) / 16 * 16 + 16, npanels = (N + 15) / 16, huge = 1L << 21;
    const size_t pbytes = (size_t)npanels * dk_pk_panel_elems(K, 1) * 2, alloc = (pbytes + huge - 1) / huge * huge;
    uint16_t *P = aligned_alloc(huge, alloc);
    float *x = aligned_alloc(64, (M * ldx * sizeof(float) + 63) / 64 * 64);
    float *out = aligned_alloc(64, (M * N * sizeof(float) + 63) / 64 * 64);
    if (!P || !x || !out) return 1;
    madvise(P, alloc, MADV_HUGEPAGE);
    for (size_t i = 0; i < pbytes / 2; i++) P[i] = (uint16_t)(0x3f80 + i % 7);
    for (long i = 0; i < M * ldx; i++) x[i] = 0.25f + (i % 5) * 0.01f;
    const double flop = 2.0 * M * N * K;
    const int reps = (int)(4e9 / flop) + 1;
    for (int r = 0; r < 5; r++) {
        double t = now();
        for (int i = 0; i < reps; i++) {
#pragma omp parallel num_threads(NT)
            {
                long th = omp_get_thread_num(), lo = npanels * th / NT, hi = npanels * (th + 1) / NT;
                dk_pk_run(M, K, N, lo, hi, 1, x, ldx, P, NULL, out);
            }
        }
        printf("M=%ld N=%ld K=%ld, %d threads: %.1f GFLOP/s\n", M, N, K, NT, flop * reps / (now() - t) / 1e9);
    }
    free(P);
    free(x);
    free(out);
    return 0;
}
