/* AMX tile products with their operands at each level of the memory hierarchy, one core: why the
   amx-packed path (pyx/dk_packed.h, dk_pk_amx_run_p) blocks prefill-sized linears so that one operand
   stays in L1 and the other in L2.

       gcc -O2 -mamx-tile -mamx-bf16 bench/amx_tiles.c -o /tmp/amx_tiles && /tmp/amx_tiles

   The 2 x 2 kernel of dk_pk_amx_2x2 (four C tiles, two A and two B tiles loaded per step, four
   TDPBF16PS) cycles through an A buffer and a B buffer of the sizes printed: both in L1 (16 KiB),
   both in L2 (256 KiB), both spilling L2 (1 MiB each on a 2 MiB L2), and one in L1 with the other in
   L2 or L3. The first line is the register-only loop (dense.peak_gflops("amx")). Each case runs twice:
   with zero operands, and with operands as real activations and weights are (bf16 values spread
   over [-1, 1)). Zero tiles load faster: on the Xeon with AMX of session 20 nonzero tiles from L1
   ran at about 82% of zero tiles' rate and from L2 at about 80%, so a kernel's ceiling on real data
   is the nonzero column. Linux only (AMX tile state is granted per process by arch_prctl). */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    unsigned char palette, start_row, reserved[14];
    unsigned short colsb[16];
    unsigned char rows[16];
} tilecfg;
static const tilecfg cfg = {.palette = 1, .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
                            .rows = {16, 16, 16, 16, 16, 16, 16, 16}};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* n bf16 values: zeros, or spread over [-1, 1) (a fixed linear congruential sequence) */
static void fill(unsigned short *p, long n, int nonzero) {
    unsigned state = 12345u;
    for (long i = 0; i < n; i++) {
        state = state * 1664525u + 1013904223u;
        float f = nonzero ? (float)(state >> 8) / (1 << 23) - 1.0f : 0.0f;
        unsigned u;
        memcpy(&u, &f, 4);
        p[i] = (unsigned short)(u >> 16);
    }
}

/* GFLOP/s of `steps` 2 x 2 steps, the A and B tiles read in turn from buffers of abytes / bbytes */
static double run(long abytes, long bbytes, long steps, int nonzero) {
    unsigned short *A = aligned_alloc(64, abytes), *B = aligned_alloc(64, bbytes);
    fill(A, abytes / 2, nonzero);
    fill(B, bbytes / 2, nonzero);
    long na = abytes / 2048, nb = bbytes / 2048, ia = 0, ib = 0;  /* 2 tiles (2 KiB) per step */
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    double t = now();
    for (long s = 0; s < steps; s++) {
        _tile_loadd(6, B + ib * 1024, 64); _tile_loadd(7, B + ib * 1024 + 512, 64);
        _tile_loadd(4, A + ia * 1024, 64); _tile_loadd(5, A + ia * 1024 + 512, 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        if (++ia == na) ia = 0;
        if (++ib == nb) ib = 0;
    }
    double e = now() - t;
    free(A);
    free(B);
    return 4.0 * steps * 16384 / e / 1e9;
}

int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) {
        fprintf(stderr, "no AMX tile state granted on this machine\n");
        return 1;
    }
    _tile_loadconfig(&cfg);
    unsigned short z[512] __attribute__((aligned(64)));
    fill(z, 512, 0);
    _tile_loadd(4, z, 64); _tile_loadd(5, z, 64); _tile_loadd(6, z, 64); _tile_loadd(7, z, 64);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    long n = 1 << 20;
    double t = now();
    for (long i = 0; i < n; i++) {
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    double peak = 4.0 * n * 16384 / (now() - t) / 1e9;
    printf("register-only: %.0f GFLOP/s\n", peak);
    printf("%-30s %-31s %s\n", "operands", "zero tiles", "nonzero tiles");
    const struct { const char *what; long a, b; } cases[] = {
        {"A, B 16 KiB each (L1)", 16 << 10, 16 << 10},
        {"A, B 256 KiB each (L2)", 256 << 10, 256 << 10},
        {"A, B 1 MiB each", 1 << 20, 1 << 20},
        {"A 1 MiB (L2), B 16 KiB (L1)", 1 << 20, 16 << 10},
        {"A 4 MiB (L3), B 16 KiB (L1)", 4 << 20, 16 << 10},
    };
    for (unsigned i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        double g0 = run(cases[i].a, cases[i].b, 1 << 20, 0), g1 = run(cases[i].a, cases[i].b, 1 << 20, 1);
        printf("%-30s %5.0f GFLOP/s (%3.0f%% of peak)   %5.0f GFLOP/s (%3.0f%%)\n", cases[i].what, g0,
               100 * g0 / peak, g1, 100 * g1 / peak);
    }
    return 0;
}
