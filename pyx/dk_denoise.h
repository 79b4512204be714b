/* Micro-kernels behind pyx/denoise.pyx: the LM-head block dot products of denoise_block. */
#ifndef DK_DENOISE_H
#define DK_DENOISE_H

#include <Python.h>  /* Py_ssize_t */

/* Dot products of all T hidden rows with a block of VB vocab rows, streamed over H in chunks of
   HC so that the 4 hidden rows and the VB x HC weight chunk of a tile stay in L1 (partial sums of
   every (row, vocab) pair wait in `part`, eight lanes each). Register tile: 4 hidden rows x 3
   vocab rows = 12 eight-lane accumulators. Every pair runs the same instruction sequence, so equal
   rows give bit-equal logits. bf16 weights (wu) are upcast chunk by chunk into wbuf. */
#define DFLASH_VB 24
#define DFLASH_HC 128
typedef float dflash_v8f __attribute__((vector_size(32), aligned(4)));
static inline float dflash_hsum(dflash_v8f a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}
static void dflash_block_dots(const float *x, Py_ssize_t t_sz, Py_ssize_t h_sz, const float *wf,
                              const unsigned short *wu, Py_ssize_t v0, Py_ssize_t nv,
                              dflash_v8f *part, float *wbuf, float *res) {
    const float *ws[DFLASH_VB];
    const float *xs[4];
    Py_ssize_t ti[4];
    Py_ssize_t t, t0, a, c, h, hc, vt;
    for (t = 0; t < t_sz * DFLASH_VB; t++) { part[t] = (dflash_v8f){0}; res[t] = 0.0f; }
    for (hc = 0; hc < h_sz; hc += DFLASH_HC) {
        Py_ssize_t hn = h_sz - hc < DFLASH_HC ? h_sz - hc : DFLASH_HC, h8 = hn - hn % 8;
        for (c = 0; c < DFLASH_VB; c++) {  /* rows past nv repeat the last one */
            Py_ssize_t v = v0 + (c < nv ? c : nv - 1);
            if (wu) {
                unsigned int *u = (unsigned int *)(wbuf + c * DFLASH_HC);
                for (h = 0; h < hn; h++) u[h] = (unsigned int)wu[v * h_sz + hc + h] << 16;
                ws[c] = wbuf + c * DFLASH_HC;
            } else {
                ws[c] = wf + v * h_sz + hc;
            }
        }
        for (t0 = 0; t0 < t_sz; t0 += 4) {
            for (a = 0; a < 4; a++) {  /* rows past t_sz repeat the last one (same values stored) */
                ti[a] = t0 + a < t_sz ? t0 + a : t_sz - 1;
                xs[a] = x + ti[a] * h_sz + hc;
            }
            for (vt = 0; vt < nv; vt += 3) {
                dflash_v8f acc[4][3];
                float tail[4][3];
                for (a = 0; a < 4; a++)
                    for (c = 0; c < 3; c++) {
                        acc[a][c] = part[ti[a] * DFLASH_VB + vt + c];
                        tail[a][c] = res[ti[a] * DFLASH_VB + vt + c];
                    }
                for (h = 0; h < h8; h += 8) {
                    dflash_v8f wa = *(const dflash_v8f *)(ws[vt] + h);
                    dflash_v8f wb = *(const dflash_v8f *)(ws[vt + 1] + h);
                    dflash_v8f wc = *(const dflash_v8f *)(ws[vt + 2] + h);
                    for (a = 0; a < 4; a++) {
                        dflash_v8f xv = *(const dflash_v8f *)(xs[a] + h);
                        acc[a][0] += xv * wa;
                        acc[a][1] += xv * wb;
                        acc[a][2] += xv * wc;
                    }
                }
                for (h = h8; h < hn; h++)
                    for (a = 0; a < 4; a++)
                        for (c = 0; c < 3; c++) tail[a][c] += xs[a][h] * ws[vt + c][h];
                for (a = 0; a < 4; a++)
                    for (c = 0; c < 3; c++) {
                        part[ti[a] * DFLASH_VB + vt + c] = acc[a][c];
                        res[ti[a] * DFLASH_VB + vt + c] = tail[a][c];
                    }
            }
        }
    }
    for (t = 0; t < t_sz * DFLASH_VB; t++) res[t] = dflash_hsum(part[t]) + res[t];
}

#endif /* DK_DENOISE_H */
