/* How many threads an op takes: the one rule for every Cython kernel that sizes its team by work. */
#ifndef DK_THREADS_H
#define DK_THREADS_H

/* Overridable at build time for experiments (CFLAGS="-DDK_PARALLEL_MACS=(1L<<20)"). */
#ifndef DK_PARALLEL_MACS
#define DK_PARALLEL_MACS (1L << 18)   /* multiply-adds per thread (matmuls, the LM-head scan) */
#endif
#ifndef DK_PARALLEL_BYTES
#define DK_PARALLEL_BYTES (1L << 17)  /* weight bytes per thread (a few-row matmul streams its weights) */
#endif
#ifndef DK_PARALLEL_ELEMS
#define DK_PARALLEL_ELEMS (1L << 15)  /* elements per thread (norms, RoPE, SwiGLU) */
#endif

/* One thread per `per_thread` units of `work`, at least 1, at most n_threads. Waking a thread costs
   more than a small share of work: with every thread for anything past one unit, the shipped
   4M-parameter pair's 16-row rounds ran 5-8x slower at 16 threads than at 1 (an Intel Xeon with 16
   cores). Results do not depend on the count. */
static inline int dk_threads(long work, long per_thread, int n_threads) {
    long n = work / per_thread;
    return n < 1 ? 1 : (n >= n_threads ? n_threads : (int)n);
}

/* A matmul's team: by its multiply-adds, or by its weights' bytes where few rows make the call a
   stream of the weights (a decode step's GEMV: one core's share of the memory bus is well under two
   cores'; a 576 x 576 bf16 GEMV on a Zen 4 took 0.67x the time on two threads from DRAM and 0.59x
   warm: bench/gemv_threads.py, docs/benchmarks.md session 26). */
static inline int dk_matmul_threads(long M, long N, long K, int wbytes, int n_threads) {
    int by_macs = dk_threads(M * N * K, DK_PARALLEL_MACS, n_threads);
    int by_bytes = dk_threads(N * K * wbytes, DK_PARALLEL_BYTES, n_threads);
    return by_macs > by_bytes ? by_macs : by_bytes;
}

#endif /* DK_THREADS_H */
