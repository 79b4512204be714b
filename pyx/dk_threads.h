/* How many threads an op takes: the one rule for every Cython kernel that sizes its team by work. */
#ifndef DK_THREADS_H
#define DK_THREADS_H

/* Overridable at build time for experiments (CFLAGS="-DDK_PARALLEL_MACS=(1L<<20)"). */
#ifndef DK_PARALLEL_MACS
#define DK_PARALLEL_MACS (1L << 18)   /* multiply-adds per thread (matmuls, the LM-head scan) */
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

#endif /* DK_THREADS_H */
