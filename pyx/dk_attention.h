/* Attention micro-kernels behind pyx/attention_core.pxi (attention.pyx and the fused layers of
   dense.pyx): the FMA register blocks for S^T = K Q^T and acc += P V, the online softmax over a
   tile, the decode path's kernels on K and V read in place, the K/V tile copies, and the bf16 pair
   words with their vdpbf16ps and AMX kernels. */
#ifndef DK_ATTENTION_H
#define DK_ATTENTION_H

#include <Python.h>  /* Py_ssize_t */

#include <stdint.h>
#include <string.h>

#include "dk_amx.h"  /* tile config and permission, for "medium" on AMX */
#include "dk_exp.h"  /* dk_exp: the shared polynomial exp */
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* Ask for a K or V row ahead of use (into L2): one kv head's rows are H_kv * D elements apart,
   often a whole page, and hardware prefetchers do not follow strides across pages. */
static inline void dk_prefetch(const void* p, Py_ssize_t nbytes) {
    for (Py_ssize_t o = 0; o < nbytes; o += 64) __builtin_prefetch((const char*)p + o, 0, 1);
    /* An empty volatile asm is a side effect. Without it GCC 12's modref pass finds a caller that
       only prefetches (attention_core.pxi's _prefetch_keys) pure, and deletes every call to it:
       no attention build had a single prefetch instruction before session 27. */
    __asm__ volatile("");
}

/* Register-blocked micro-kernels for the FMA tiles, written with GCC vector extensions so the
   accumulators stay in registers. The scores are kept transposed, st[c, r] for key c and packed
   query row r: S^T = K Q^T takes K's rows as they are stored (a copy, no transpose: the 8 x 8
   register transposes of K^T took a sixth of a verification block's attention on AVX-512), and
   the online softmax runs down the keys with one vector lane per row, no horizontal reductions.

   S^T: DK_TKB keys x 2 vectors of rows (8 x 2 with AVX-512, 6 x 2 with AVX2), or DK_TKB1 keys x 1
   vector where the rows fill one vector only. P V: DK_RB rows x DK_NV vectors of head
   dims, 8 x 2 vectors of 16 floats with AVX-512 (16 of 32 zmm: each V vector load feeds 8 FMAs),
   6 x 2 of 8 with AVX2 (12 of 16 ymm: Zen 2 needs 10 independent FMAs in flight to reach its FMA
   rate; against 4 x 2, 16 queries over 4096 / 512 keys ran 2% / 6-9% faster there,
   bench/attention_ab.py, docs/benchmarks.md session 11). */
#if defined(__AVX512F__)
#define DK_W 16
#define DK_NV 2
#ifndef DK_RB
#define DK_RB 8
#endif
#define DK_TKB 8    /* keys per S^T block with 2 vectors of rows (16 accumulators) ... */
#define DK_TKB_REST 0  /* ... but the tile's last DK_TKB_REST keys, in blocks of 4 */
#define DK_TKB1 16  /* ... with 1 vector of rows */
#else
#define DK_W 8
#define DK_NV 2
#ifndef DK_RB
#define DK_RB 6
#endif
#define DK_TKB 6    /* 12 accumulators, as the P V blocks */
#define DK_TKB_REST 8  /* 32 keys = 4 x 6 + 2 x 4 */
#define DK_TKB1 8
#endif
#define DK_CB (DK_NV * DK_W)
#define DK_KT 32  /* keys per tile: K and V tiles (2 x 16 KiB at D = 128) stay in L1 */
typedef float dk_af __attribute__((vector_size(DK_W * 4), aligned(4)));
#define DK_LD(p) (*(const dk_af*)(p))
#define DK_ST(p, x) (*(dk_af*)(p) = (x))

#define DK_AI static inline __attribute__((always_inline))
/* st[0:kb, 0:nv W] (row stride lds) = kr[0:kb, 0:D] (row stride ldk) . qt[0:D, 0:nv W] (row stride ldq) */
DK_AI void dk_qkt_rows(const int kb, const int nv, const float* kr, Py_ssize_t ldk, Py_ssize_t D, const float* qt,
                       Py_ssize_t ldq, float* st, Py_ssize_t lds) {
    dk_af a[16][2];
    for (int i = 0; i < kb; i++)
        for (int v = 0; v < nv; v++) a[i][v] = (dk_af){0};
    for (Py_ssize_t d = 0; d < D; d++) {
        dk_af x[2];
        for (int v = 0; v < nv; v++) x[v] = DK_LD(qt + d * ldq + v * DK_W);
        for (int i = 0; i < kb; i++) {
            float ki = kr[i * ldk + d];
            for (int v = 0; v < nv; v++) a[i][v] += ki * x[v];
        }
    }
    for (int i = 0; i < kb; i++)
        for (int v = 0; v < nv; v++) DK_ST(st + i * lds + v * DK_W, a[i][v]);
}

/* st[0:DK_KT, 0:nv W] = the tile's DK_KT keys (kr, rows of D, row stride ldk) . qt[0:D, 0:nv W],
   nv = 1 or 2 (kept out of line, as dk_pv_block: inlined into the tile loop, the accumulators
   spilled) */
__attribute__((noinline)) static void dk_qkt_block(int nv, const float* kr, Py_ssize_t ldk, Py_ssize_t D,
                                                   const float* qt, Py_ssize_t ldq, float* st, Py_ssize_t lds) {
    int c = 0;
    if (nv == 2) {
        for (; c < DK_KT - DK_TKB_REST; c += DK_TKB)
            dk_qkt_rows(DK_TKB, 2, kr + c * ldk, ldk, D, qt, ldq, st + c * lds, lds);
        for (; c < DK_KT; c += 4) dk_qkt_rows(4, 2, kr + c * ldk, ldk, D, qt, ldq, st + c * lds, lds);
    } else {
        for (; c < DK_KT; c += DK_TKB1) dk_qkt_rows(DK_TKB1, 1, kr + c * ldk, ldk, D, qt, ldq, st + c * lds, lds);
    }
}

/* acc[0:rb, 0:CB] (row stride lda) = acc * alpha[i] + pt[0:n, 0:rb]^T (pt: the probabilities
   transposed, row stride ldp) . v[0:n, 0:CB] (row stride ldv): the online softmax's rescale rides
   on the accumulators' load */
DK_AI void dk_pv_rows(const int rb, const float* pt, Py_ssize_t ldp, Py_ssize_t n, const float* vm,
                      Py_ssize_t ldv, float* acc, Py_ssize_t lda, const float* alpha) {
    dk_af a[DK_RB][DK_NV];
    for (int i = 0; i < rb; i++)
        for (int v = 0; v < DK_NV; v++) a[i][v] = DK_LD(acc + i * lda + v * DK_W) * alpha[i];
    for (Py_ssize_t c = 0; c < n; c++) {
        dk_af x[DK_NV];
        for (int v = 0; v < DK_NV; v++) x[v] = DK_LD(vm + c * ldv + v * DK_W);
        for (int i = 0; i < rb; i++) {
            float pi = pt[c * ldp + i];
            for (int v = 0; v < DK_NV; v++) a[i][v] += pi * x[v];
        }
    }
    for (int i = 0; i < rb; i++)
        for (int v = 0; v < DK_NV; v++) DK_ST(acc + i * lda + v * DK_W, a[i][v]);
}

/* Row blocks of DK_RB rows, then 4 and 2 for the rest (rows come in multiples of DK_W: 2 and 4
   complete them with AVX2's 6-row blocks). Small row blocks also serve a decode step's few packed
   rows (e.g. GQA group 2: 2 rows), which an 8-row block would waste (1 query over 257 keys, 16/8
   heads: 58 us with 4-row blocks, 71 with 8; 16 queries over 4096 keys, 32/8: 6.7 ms with 4, 5.6
   with 8). */
#define DK_RB_SMALL 4
__attribute__((noinline)) static void dk_pv_block(int rb, const float* pt, Py_ssize_t ldp, Py_ssize_t n,
                                                  const float* vm, Py_ssize_t ldv, float* acc, Py_ssize_t lda,
                                                  const float* alpha) {
    if (rb == DK_RB) dk_pv_rows(DK_RB, pt, ldp, n, vm, ldv, acc, lda, alpha);
    else if (rb == DK_RB_SMALL) dk_pv_rows(DK_RB_SMALL, pt, ldp, n, vm, ldv, acc, lda, alpha);
    else dk_pv_rows(2, pt, ldp, n, vm, ldv, acc, lda, alpha);
}

/* One stored element (float32, or bf16 bits: exact upcast by << 16). */
static inline float dk_get(const void* base, int bf16, Py_ssize_t i) {
    if (bf16) {
        union { unsigned int u; float f; } x;
        x.u = (unsigned int)((const unsigned short*)base)[i] << 16;
        return x.f;
    }
    return ((const float*)base)[i];
}

#if defined(__AVX2__)
static inline __m256 dk_ld8(const void* base, int bf16, Py_ssize_t i) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i*)((const unsigned short*)base + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float*)base + i);
}
#endif

/* A decode step packs only a few query rows (the GQA group) per kv head, too few to pay for a
   transposed K tile and a copied V tile: each K element fed at most 4 FMAs, and per head the reads
   jumped a whole cache row (H_kv * D elements) from key to key. Below (bench/attention_ab.py: 0.58-0.64
   of the tiled time on a Zen 4, docs/benchmarks.md session 16), K and V rows are
   read in place (float32, bf16 upcast in registers, or float32 rounded to bf16 for "medium"): S by
   dot products on K rows, P V with the accumulators in registers for DK_PVN vectors of dims at a
   time. */
#if defined(__AVX512F__)
#define DK_PVN 4
#else
#define DK_PVN 2
#endif
#define DK_DIRECT_D (DK_PVN * DK_W)  /* the direct path needs D a multiple of this (and so of 2 DK_W) */

/* x rounded to bf16 (nearest even; a NaN stays a quiet NaN), as dk_att_round_run does in place */
typedef uint32_t dk_au __attribute__((vector_size(DK_W * 4), aligned(4)));
DK_AI dk_af dk_att_round_vec(dk_af x) {
    dk_au u = (dk_au)x;
    dk_au r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    dk_au nan = (dk_au)((u & 0x7FFFFFFFu) > 0x7F800000u);
    return (dk_af)((nan & (u | 0x400000u)) | (~nan & r));
}

/* How the direct kernels read a K or V row: float32 as it is, bf16 bits (upcast exactly, << 16), or
   float32 rounded to bf16 ("medium" over a float32 cache) */
#define DK_LD_F32 0
#define DK_LD_BF16 1
#define DK_LD_F32_ROUNDED 2

/* DK_W elements of a row from element i, read as `ld` says */
DK_AI dk_af dk_ldw(const void* base, const int ld, Py_ssize_t i) {
    if (ld == DK_LD_F32) return DK_LD((const float*)base + i);
    if (ld == DK_LD_F32_ROUNDED) return dk_att_round_vec(DK_LD((const float*)base + i));
#if defined(__AVX512F__)
    __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)base + i)));
    return (dk_af)_mm512_slli_epi32(h, 16);
#elif defined(__AVX2__)
    return (dk_af)dk_ld8(base, 1, i);
#else
    dk_af x;
    for (int l = 0; l < DK_W; l++) x[l] = dk_get(base, 1, i + l);
    return x;
#endif
}

DK_AI float dk_att_hsum(dk_af x) {  /* a shuffle tree (gcc left the lane loop as 15 scalar adds) */
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)x);
#elif defined(__AVX2__)
    __m128 h = _mm_add_ps(_mm256_castps256_ps128((__m256)x), _mm256_extractf128_ps((__m256)x, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#else
    float t = 0.0f;
    for (int l = 0; l < DK_W; l++) t += x[l];
    return t;
#endif
}

/* The online softmax over one key tile (DK_KT keys), a block of rows at a time, in vector registers.
   The loops it replaced (one row at a time, the max and sum left to gcc) took a fifth of a
   verification block's attention on AVX-512 (16 queries over 4096 keys). */
#define DK_KV (DK_KT / DK_W)  /* vectors per tile row */
typedef int32_t dk_ai __attribute__((vector_size(DK_W * 4), aligned(4)));

/* dk_exp on a vector (dk_exp.h) */
DK_AI dk_af dk_exp_vec(dk_af x) {
#if defined(__AVX512F__)
    return (dk_af)dk_exp16((__m512)x);
#elif defined(__AVX2__)
    return (dk_af)dk_exp8((__m256)x);
#else
    for (int i = 0; i < DK_W; i++) x[i] = dk_exp(x[i]);
    return x;
#endif
}

DK_AI float dk_att_hmax(dk_af x) {
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps((__m512)x);
#elif defined(__AVX2__)
    __m128 h = _mm_max_ps(_mm256_castps256_ps128((__m256)x), _mm256_extractf128_ps((__m256)x, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
    float t = x[0];
    for (int i = 1; i < DK_W; i++) t = x[i] > t ? x[i] : t;
    return t;
#endif
}

/* Rows i < rb of s (row stride lds), a tile of DK_KT keys at positions j0.., of which row i sees
   positions lo[i]..hi[i] (as dk_softmax_cols; none when hi < lo): each row becomes exp(s - m_new), 0 where masked; m[i] and l[i], the row's running max and sum,
   move to the new max, and alpha[i] = exp(m_old - m_new) is the factor its accumulator takes (1
   when the max stays). */
static void dk_softmax_rows(int rb, float* s, Py_ssize_t lds, int32_t j0, const int32_t* lo, const int32_t* hi,
                            float* m, float* l, float* alpha) {
    dk_ai iota;
    for (int i = 0; i < DK_W; i++) iota[i] = i;
    for (int i = 0; i < rb; i++) {
        float* row = s + i * lds;
        int32_t c_lo = lo[i] - j0 > 0 ? lo[i] - j0 : 0;  /* the row's visible keys of this tile */
        int32_t c_hi = hi[i] - j0 < DK_KT - 1 ? hi[i] - j0 : DK_KT - 1;
        alpha[i] = 1.0f;
        if (c_hi < c_lo) {  /* nothing visible: the row adds nothing */
            for (int v = 0; v < DK_KV; v++) DK_ST(row + v * DK_W, (dk_af){0});
            continue;
        }
        dk_af x[DK_KV], mx;
        for (int v = 0; v < DK_KV; v++) x[v] = DK_LD(row + v * DK_W);
        if (c_lo > 0 || c_hi < DK_KT - 1) {
            dk_ai ninf = (dk_ai)((dk_af){0} - __builtin_inff());
            for (int v = 0; v < DK_KV; v++) {
                dk_ai key = iota + v * DK_W;
                dk_ai keep = (key >= c_lo) & (key <= c_hi);
                x[v] = (dk_af)(((dk_ai)x[v] & keep) | (ninf & ~keep));
            }
        }
        mx = x[0];
        for (int v = 1; v < DK_KV; v++) {
            dk_ai gt = x[v] > mx;
            mx = (dk_af)(((dk_ai)x[v] & gt) | ((dk_ai)mx & ~gt));
        }
        float mt = dk_att_hmax(mx), mn = mt > m[i] ? mt : m[i];
        dk_af sum = {0};
        for (int v = 0; v < DK_KV; v++) {
            dk_af p = dk_exp_vec(x[v] - mn);
            DK_ST(row + v * DK_W, p);
            sum += p;
        }
        if (mn != m[i]) {
            alpha[i] = dk_exp(m[i] - mn);  /* 0 on the first visible tile (m = -inf) */
            m[i] = mn;
        }
        l[i] = l[i] * alpha[i] + dk_att_hsum(sum);
    }
}

DK_AI dk_af dk_att_vmax(dk_af a, dk_af b) {  /* b where either is NaN, as maxps */
#if defined(__AVX512F__)
    return (dk_af)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(__AVX2__)
    return (dk_af)_mm256_max_ps((__m256)a, (__m256)b);
#else
    dk_ai gt = a > b;
    return (dk_af)(((dk_ai)a & gt) | ((dk_ai)b & ~gt));
#endif
}

/* The online softmax over one tile of transposed scores, st[c * lds + r] for keys c < DK_KT (at
   positions j0 + c) and rows r < nr (a multiple of DK_W), one vector of rows at a time. When
   `masked`, row r sees the positions lo[r]..hi[r] only (else all of the tile). Each score becomes
   exp(s - m_new), 0 where masked (rounded to bf16 when `round`, the sums unrounded); m[r], l[r] (the running max and sum) move to the new max and
   alpha[r] = exp(m_old - m_new) is the factor the row's accumulator takes (1 when the max stays;
   a row that has seen no key keeps m = -inf, l = 0). */
static void dk_softmax_cols(Py_ssize_t nr, float* st, Py_ssize_t lds, int masked, int32_t j0, const int32_t* lo,
                            const int32_t* hi, int round, float* m, float* l, float* alpha) {
    const dk_af ninf = (dk_af){0} - __builtin_inff();
    for (Py_ssize_t r = 0; r < nr; r += DK_W) {
        dk_af mx[4] = {ninf, ninf, ninf, ninf}, sum[4] = {{0}, {0}, {0}, {0}};  /* 4 chains each */
        if (masked) {
            dk_ai lo_v = *(const dk_ai*)(lo + r), hi_v = *(const dk_ai*)(hi + r);
            for (int c = 0; c < DK_KT; c++) {
                dk_ai keep = (lo_v <= j0 + c) & (hi_v >= j0 + c);
                dk_af x = (dk_af)(((dk_ai)DK_LD(st + c * lds + r) & keep) | ((dk_ai)ninf & ~keep));
                DK_ST(st + c * lds + r, x);
                mx[c % 4] = dk_att_vmax(x, mx[c % 4]);
            }
        } else {
            for (int c = 0; c < DK_KT; c++) mx[c % 4] = dk_att_vmax(DK_LD(st + c * lds + r), mx[c % 4]);
        }
        dk_af m_old = DK_LD(m + r);
        dk_af m_new = dk_att_vmax(dk_att_vmax(dk_att_vmax(mx[0], mx[1]), dk_att_vmax(mx[2], mx[3])), m_old);
        dk_ai none = m_new == ninf;  /* no key yet: subtract 0, not -inf (-inf - -inf is NaN) */
        dk_af base = (dk_af)((dk_ai)m_new & ~none);
        for (int c = 0; c < DK_KT; c++) {
            dk_af p = dk_exp_vec(DK_LD(st + c * lds + r) - base);
            DK_ST(st + c * lds + r, round ? dk_att_round_vec(p) : p);  /* "medium": P rounded, not l */
            sum[c % 4] += p;
        }
        dk_af a = dk_exp_vec(m_old - base);
        DK_ST(alpha + r, a);
        DK_ST(l + r, DK_LD(l + r) * a + ((sum[0] + sum[1]) + (sum[2] + sum[3])));
        DK_ST(m + r, m_new);
    }
}

/* acc[i, 0:n] (row stride lda) *= alpha[i], i < rb, where alpha is not 1: the paths whose P V
   kernels take no alpha (vdpbf16ps, AMX, the decode path) */
static void dk_rescale_rows(int rb, float* acc, Py_ssize_t lda, Py_ssize_t n, const float* alpha) {
    for (int i = 0; i < rb; i++)
        if (alpha[i] != 1.0f)
            for (Py_ssize_t d = 0; d < n; d++) acc[i * lda + d] *= alpha[i];
}

/* s[i] = q[i, 0:D] . k[0:D], i < rb; two accumulators per row halve the FMA chain. D a multiple
   of 2 DK_W. */
DK_AI void dk_qk_direct_rows(const int rb, const int ld, const float* q, Py_ssize_t D, const void* k,
                             Py_ssize_t lds, float* s) {
    dk_af a[DK_RB_SMALL][2];
    for (int i = 0; i < rb; i++) a[i][0] = a[i][1] = (dk_af){0};
    for (Py_ssize_t d = 0; d < D; d += 2 * DK_W) {
        dk_af x0 = dk_ldw(k, ld, d), x1 = dk_ldw(k, ld, d + DK_W);
        for (int i = 0; i < rb; i++) {
            a[i][0] += DK_LD(q + i * D + d) * x0;
            a[i][1] += DK_LD(q + i * D + d + DK_W) * x1;
        }
    }
    for (int i = 0; i < rb; i++) s[i * lds] = dk_att_hsum(a[i][0] + a[i][1]);
}

/* acc[i, 0:D] (row stride lda) += p[i, 0:n] (row stride ldp) . V rows 0:n (`stride` elements
   apart), i < rb: the accumulators stay in registers over the n keys. D a multiple of DK_DIRECT_D. */
DK_AI void dk_pv_direct_rows(const int rb, const int ld, const float* p, Py_ssize_t ldp, Py_ssize_t n,
                             const void* vm, Py_ssize_t stride, Py_ssize_t D, float* acc, Py_ssize_t lda) {
    for (Py_ssize_t d0 = 0; d0 < D; d0 += DK_DIRECT_D) {
        dk_af a[DK_RB_SMALL][DK_PVN];
        for (int i = 0; i < rb; i++)
            for (int w = 0; w < DK_PVN; w++) a[i][w] = DK_LD(acc + i * lda + d0 + w * DK_W);
        for (Py_ssize_t c = 0; c < n; c++) {
            dk_af x[DK_PVN];
            for (int w = 0; w < DK_PVN; w++) x[w] = dk_ldw(vm, ld, c * stride + d0 + w * DK_W);
            for (int i = 0; i < rb; i++) {
                float pi = p[i * ldp + c];
                for (int w = 0; w < DK_PVN; w++) a[i][w] += pi * x[w];
            }
        }
        for (int i = 0; i < rb; i++)
            for (int w = 0; w < DK_PVN; w++) DK_ST(acc + i * lda + d0 + w * DK_W, a[i][w]);
    }
}

/* For keys c < n and kv heads g < H, in address order (key c's rows of all heads are contiguous:
   (n, H, D) from k or v, read as `ld` says); rp rows per head, of which rb <= DK_RB_SMALL count:
   s[(g rp + i) lds + c] = q[g rp + i, 0:D] . K[c, g], and acc[g rp + i, 0:D] (row stride lda) +=
   p[(g rp + i) ldp + c] V[c, g]. Specialised on rb and ld. */
#ifndef DK_PV_KEYS
#define DK_PV_KEYS 4
#endif
#define DK_DIRECT_LDS(CALL, R) \
    if (ld == DK_LD_BF16) CALL(R, DK_LD_BF16) \
    else if (ld == DK_LD_F32_ROUNDED) CALL(R, DK_LD_F32_ROUNDED) \
    else CALL(R, DK_LD_F32)
#define DK_DIRECT_CASES(CALL) \
    if (rb <= 2) { DK_DIRECT_LDS(CALL, 2) } else { DK_DIRECT_LDS(CALL, DK_RB_SMALL) }
#define DK_ELEM(B) ((B) == DK_LD_BF16 ? 2 : 4)
static void dk_qk_direct(int rb, int ld, const float* q, Py_ssize_t rp, Py_ssize_t H, Py_ssize_t D,
                         const void* k, Py_ssize_t n, float* s, Py_ssize_t lds) {
#define DK_QKD(R, B) \
    { for (Py_ssize_t c = 0; c < n; c++) \
          for (Py_ssize_t g = 0; g < H; g++) \
              dk_qk_direct_rows(R, B, q + g * rp * D, D, (const char*)k + (c * H + g) * D * DK_ELEM(B), lds, \
                                s + g * rp * lds + c); }
    DK_DIRECT_CASES(DK_QKD)
#undef DK_QKD
}
static void dk_pv_direct(int rb, int ld, const float* p, Py_ssize_t ldp, Py_ssize_t rp, Py_ssize_t H,
                         Py_ssize_t n, const void* v, Py_ssize_t D, float* acc, Py_ssize_t lda) {
#define DK_PVD(R, B) \
    { for (Py_ssize_t c = 0; c < n; c += DK_PV_KEYS) \
          for (Py_ssize_t g = 0; g < H; g++) \
              dk_pv_direct_rows(R, B, p + g * rp * ldp + c, ldp, n - c < DK_PV_KEYS ? n - c : DK_PV_KEYS, \
                                (const char*)v + (c * H + g) * D * DK_ELEM(B), H * D, D, acc + g * rp * lda, lda); }
    DK_DIRECT_CASES(DK_PVD)
#undef DK_PVD
}
#undef DK_DIRECT_CASES
#undef DK_DIRECT_LDS
#undef DK_ELEM

/* dst[c * ldd + d] = element d of source row c (rows `stride` elements apart), c < n, d < D: a K or V
   tile copied (and upcast) into contiguous rows, where "medium" rounds a float32 source's. Read in place, a tile's
   rows sit a whole cache row apart (H_kv * D elements, 4 KiB at 8 x 128 fp32) and share L1 sets; the
   copy costs about what those conflicts did (bench/attention_ab.py: 0.98-1.05x on fp32 K/V). */
static void dk_load_rows(const void* base, int bf16, Py_ssize_t stride, Py_ssize_t D, Py_ssize_t n,
                         float* dst, Py_ssize_t ldd) {
    for (Py_ssize_t c = 0; c < n; c++) {
        Py_ssize_t d = 0;
        float* row = dst + c * ldd;
#if defined(__AVX512F__)
        if (bf16) {
            const uint16_t* src = (const uint16_t*)base + c * stride;
            for (; d + 16 <= D; d += 16)
                _mm512_storeu_ps(row + d, _mm512_castsi512_ps(_mm512_slli_epi32(
                                               _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(src + d))), 16)));
        } else {
            const float* src = (const float*)base + c * stride;
            for (; d + 16 <= D; d += 16) _mm512_storeu_ps(row + d, _mm512_loadu_ps(src + d));
        }
#endif
#if defined(__AVX2__)
        for (; d + 8 <= D; d += 8) _mm256_storeu_ps(row + d, dk_ld8(base, bf16, c * stride + d));
#endif
        for (; d < D; d++) row[d] = dk_get(base, bf16, c * stride + d);
    }
}

/* "medium" precision: both products take bf16 operands (the scaled queries, K, V and the
   probabilities P, each rounded to nearest even), with exact products summed in fp32, as torch's
   bf16 SDPA computes. Where vdpbf16ps pays (DK_ATT_DOT built, measured ahead of FMA) or AMX is
   granted, the operands are packed in pairs: the queries' dims (d, d+1), K^T's rows (d, d+1) for 16
   keys, P's keys (c, c+1) and V's rows (c, c+1) for 16 dims, each pair one 32-bit word, first
   element low. vdpbf16ps does two products per lane on them, and they are AMX's tile layouts.
   Elsewhere the same operands are rounded in place and the FMA kernels above run. */
static inline uint32_t dk_att_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u >> 16) | 0x40u;  /* NaN stays a (quiet) NaN */
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
/* x[0:n] rounded to bf16 in place (nearest even, as dk_att_bits); branch-free so that gcc
   vectorises it (the FMA tiers' "medium") */
static void dk_att_round_run(float* restrict x, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t u, r;
        memcpy(&u, x + i, 4);
        r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
        r = (u & 0x7FFFFFFFu) > 0x7F800000u ? u | 0x400000u : r;  /* NaN stays a (quiet) NaN */
        memcpy(x + i, &r, 4);
    }
}
/* The bf16 bits of element i of a row of float32 (rounded) or bf16 bits. */
static inline uint32_t dk_att_elem(const void* base, int bf16, Py_ssize_t i) {
    return bf16 ? ((const uint16_t*)base)[i] : dk_att_bits(((const float*)base)[i]);
}
/* One pair word from elements i and i + step of a row of float32 or bf16 bits. */
static inline uint32_t dk_att_pair(const void* base, int bf16, Py_ssize_t i, Py_ssize_t step) {
    return dk_att_elem(base, bf16, i) | dk_att_elem(base, bf16, i + step) << 16;
}

#if defined(__AVX512BF16__)
#define DK_ATT_DOT 1
/* s[0:rb, 0:32] = q2[0:rb, 0:D2] . kt2[0:D2, 0:32]: D2 = D / 2 pair words per query row */
DK_AI void dk_qk2_rows(const int rb, const uint32_t* q2, Py_ssize_t D2, const uint32_t* kt2, Py_ssize_t ldk,
                       float* s, Py_ssize_t lds) {
    __m512 a[DK_RB][2];
    for (int i = 0; i < rb; i++) a[i][0] = a[i][1] = _mm512_setzero_ps();
    for (Py_ssize_t d = 0; d < D2; d++) {
        __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt2 + d * ldk);
        __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt2 + d * ldk + 16);
        for (int i = 0; i < rb; i++) {
            __m512bh qi = (__m512bh)_mm512_set1_epi32((int)q2[i * D2 + d]);
            a[i][0] = _mm512_dpbf16_ps(a[i][0], qi, k0);
            a[i][1] = _mm512_dpbf16_ps(a[i][1], qi, k1);
        }
    }
    for (int i = 0; i < rb; i++) {
        _mm512_storeu_ps(s + i * lds, a[i][0]);
        _mm512_storeu_ps(s + i * lds + 16, a[i][1]);
    }
}
/* acc[0:rb, 0:32] += p2[0:rb, 0:n2] . v2[0:n2, 0:32]: n2 key pairs */
DK_AI void dk_pv2_rows(const int rb, const uint32_t* p2, Py_ssize_t ldp, Py_ssize_t n2, const uint32_t* v2,
                       Py_ssize_t ldv, float* acc, Py_ssize_t lda) {
    __m512 a[DK_RB][2];
    for (int i = 0; i < rb; i++) {
        a[i][0] = _mm512_loadu_ps(acc + i * lda);
        a[i][1] = _mm512_loadu_ps(acc + i * lda + 16);
    }
    for (Py_ssize_t c = 0; c < n2; c++) {
        __m512bh x0 = (__m512bh)_mm512_loadu_si512(v2 + c * ldv);
        __m512bh x1 = (__m512bh)_mm512_loadu_si512(v2 + c * ldv + 16);
        for (int i = 0; i < rb; i++) {
            __m512bh pi = (__m512bh)_mm512_set1_epi32((int)p2[i * ldp + c]);
            a[i][0] = _mm512_dpbf16_ps(a[i][0], pi, x0);
            a[i][1] = _mm512_dpbf16_ps(a[i][1], pi, x1);
        }
    }
    for (int i = 0; i < rb; i++) {
        _mm512_storeu_ps(acc + i * lda, a[i][0]);
        _mm512_storeu_ps(acc + i * lda + 16, a[i][1]);
    }
}
static void dk_qk2_block(int rb, const uint32_t* q2, Py_ssize_t D2, const uint32_t* kt2, Py_ssize_t ldk,
                         float* s, Py_ssize_t lds) {
    if (rb == DK_RB) dk_qk2_rows(DK_RB, q2, D2, kt2, ldk, s, lds);
    else dk_qk2_rows(DK_RB_SMALL, q2, D2, kt2, ldk, s, lds);
}
static void dk_pv2_block(int rb, const uint32_t* p2, Py_ssize_t ldp, Py_ssize_t n2, const uint32_t* v2,
                         Py_ssize_t ldv, float* acc, Py_ssize_t lda) {
    if (rb == DK_RB) dk_pv2_rows(DK_RB, p2, ldp, n2, v2, ldv, acc, lda);
    else dk_pv2_rows(DK_RB_SMALL, p2, ldp, n2, v2, ldv, acc, lda);
}
/* x[0:n] rounded to bf16, stored as n bf16 at x's start: the pair words of an even-length row
   (a pair is two consecutive bf16, first element low). Safe in place: chunk i writes bytes
   [64 i, 64 i + 64), below the next chunk's unread floats at [128 (i + 1), ...). */
static void dk_att_bf16_inplace(float* x, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
        _mm512_storeu_si512((uint16_t*)x + i, (__m512i)b);
    }
    for (; i < n; i++) {
        uint16_t h = (uint16_t)dk_att_bits(x[i]);
        memcpy((uint16_t*)x + i, &h, 2);
    }
}
#else
#define DK_ATT_DOT 0
static void dk_qk2_block(int rb, const uint32_t* q2, Py_ssize_t D2, const uint32_t* kt2, Py_ssize_t ldk,
                         float* s, Py_ssize_t lds) {}
static void dk_pv2_block(int rb, const uint32_t* p2, Py_ssize_t ldp, Py_ssize_t n2, const uint32_t* v2,
                         Py_ssize_t ldv, float* acc, Py_ssize_t lda) {}
static void dk_att_bf16_inplace(float* x, Py_ssize_t n) {}
#endif

#if DK_AMX_BUILT
/* AMX tiles on the pair words above: one TDPBF16PS multiplies a 16-row A tile of bf16 pairs by a B
   tile of 16 pair rows x 16 columns: q2 rows by K^T's dim pairs (kt2) for S, P's key-pair words by
   V's key pairs (v2) for P V. "medium" takes one bf16 part of the queries and of P; "highest" over
   a bf16 cache takes three (x = x1 + x2 + x3, exact: dk_split_run), each multiplied by the same
   exact bf16 K or V, so that every product is exact and only the fp32 summation order differs
   from the FMA tiles. Tiles: 0-1 C, 2, 5, 6 A (the parts), 3-4 B. */

/* s[0:16, 0:32] (row stride lds) = sum over the np (1 or 3) parts of q2[0:16, 0:D2] (row stride D2
   words; part p at q2 + p * pstride) . kt2[0:D2, 0:32] (row stride ldk words); D2 a multiple of 16 */
static void dk_qk_amx(int np, const uint32_t* q2, Py_ssize_t pstride, Py_ssize_t D2, const uint32_t* kt2,
                      Py_ssize_t ldk, float* s, Py_ssize_t lds) {
    _tile_zero(0);
    _tile_zero(1);
    for (Py_ssize_t d = 0; d < D2; d += 16) {
        _tile_loadd(2, q2 + d, D2 * 4);
        _tile_loadd(3, kt2 + d * ldk, ldk * 4);
        _tile_loadd(4, kt2 + d * ldk + 16, ldk * 4);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
        if (np > 1) {
            _tile_loadd(5, q2 + pstride + d, D2 * 4);
            _tile_loadd(6, q2 + 2 * pstride + d, D2 * 4);
            _tile_dpbf16ps(0, 5, 3);
            _tile_dpbf16ps(1, 5, 4);
            _tile_dpbf16ps(0, 6, 3);
            _tile_dpbf16ps(1, 6, 4);
        }
    }
    _tile_stored(0, s, lds * 4);
    _tile_stored(1, s + 16, lds * 4);
}

/* acc[0:16, 0:Dp] (row stride lda) += sum over the np parts of p2[0:16, 0:16] (row stride ldp
   words; part p at p2 + p * pstride) . v2[0:16, 0:Dp] (row stride ldv words): 32 keys; Dp a
   multiple of 32 */
static void dk_pv_amx(int np, const uint32_t* p2, Py_ssize_t ldp, Py_ssize_t pstride, const uint32_t* v2,
                      Py_ssize_t ldv, float* acc, Py_ssize_t lda, Py_ssize_t Dp) {
    _tile_loadd(2, p2, ldp * 4);
    if (np > 1) {
        _tile_loadd(5, p2 + pstride, ldp * 4);
        _tile_loadd(6, p2 + 2 * pstride, ldp * 4);
    }
    for (Py_ssize_t c = 0; c < Dp; c += 32) {
        _tile_loadd(0, acc + c, lda * 4);
        _tile_loadd(1, acc + c + 16, lda * 4);
        _tile_loadd(3, v2 + c, ldv * 4);
        _tile_loadd(4, v2 + c + 16, ldv * 4);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
        if (np > 1) {
            _tile_dpbf16ps(0, 5, 3);
            _tile_dpbf16ps(1, 5, 4);
            _tile_dpbf16ps(0, 6, 3);
            _tile_dpbf16ps(1, 6, 4);
        }
        _tile_stored(0, acc + c, lda * 4);
        _tile_stored(1, acc + c + 16, lda * 4);
    }
}
#else
static void dk_qk_amx(int np, const uint32_t* q2, Py_ssize_t pstride, Py_ssize_t D2, const uint32_t* kt2,
                      Py_ssize_t ldk, float* s, Py_ssize_t lds) {}
static void dk_pv_amx(int np, const uint32_t* p2, Py_ssize_t ldp, Py_ssize_t pstride, const uint32_t* v2,
                      Py_ssize_t ldv, float* acc, Py_ssize_t lda, Py_ssize_t Dp) {}
#endif

#if defined(__AVX512BF16__)
/* r[0:16] (16 rows of 16 32-bit words) transposed in place: r[j] becomes column j. Lane-local
   unpacks pair the rows up to 4 x 4 blocks, 128-bit lane shuffles move the blocks. */
DK_AI void dk_tr16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  /* r[4g + e], lane L: element 4L + e of rows 4g..4g+3 */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int e = 0; e < 4; e++) {
        __m512i x0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x88), x1 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xDD);
        __m512i y0 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x88), y1 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xDD);
        t[e] = _mm512_shuffle_i32x4(x0, y0, 0x88);       /* column e */
        t[4 + e] = _mm512_shuffle_i32x4(x1, y1, 0x88);   /* 4 + e */
        t[8 + e] = _mm512_shuffle_i32x4(x0, y0, 0xDD);   /* 8 + e */
        t[12 + e] = _mm512_shuffle_i32x4(x1, y1, 0xDD);  /* 12 + e */
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* 32 consecutive elements of a row of float32 (rounded, nearest even) or bf16 bits as 16 pair words */
DK_AI __m512i dk_att_pairs32(const void* base, int bf16, Py_ssize_t i) {
    if (bf16) return _mm512_loadu_si512((const uint16_t*)base + i);
    const float* x = (const float*)base + i;
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
}

/* Pair words (a[j], b[j]) for j < 16 from 16 elements of rows a and b (float32 rounded, or bf16) */
DK_AI __m512i dk_att_zip16(const void* base, int bf16, Py_ssize_t ia, Py_ssize_t ib) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512i ab;
    if (bf16) {
        const uint16_t* x = (const uint16_t*)base;
        ab = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(x + ia))),
                                _mm256_loadu_si256((const __m256i*)(x + ib)), 1);
    } else {
        const float* x = (const float*)base;
        ab = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + ib), _mm512_loadu_ps(x + ia));
    }
    return _mm512_permutexvar_epi16(idx, ab);  /* a's elements low, b's high, interleaved */
}
#endif

/* kt2[d2 * ldt + c] = pair word (dims 2 d2, 2 d2 + 1) of source row c, c < n, d2 < D / 2 (D even):
   K^T in pairs. Blocks of 16 keys x 32 dims go through registers: each key's 32 elements become
   16 pair words in one vector (a bf16 row is that already), and a 16 x 16 transpose of words
   turns them into K^T's rows (the two passes it replaced, a float transpose and then the rounding,
   took 45% of a 32-key tile's time on AMX over a float32 cache). */
static void dk_load_kt2(const void* base, int bf16, Py_ssize_t stride, Py_ssize_t D, Py_ssize_t n,
                        uint32_t* kt2, Py_ssize_t ldt) {
    Py_ssize_t c0 = 0, D32 = 0;
#if defined(__AVX512BF16__)
    D32 = D / 32 * 32;
    for (; c0 + 16 <= n; c0 += 16)
        for (Py_ssize_t d = 0; d < D32; d += 32) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = dk_att_pairs32(base, bf16, (c0 + i) * stride + d);
            dk_tr16(r);
            for (int j = 0; j < 16; j++) _mm512_storeu_si512(kt2 + (d / 2 + j) * ldt + c0, r[j]);
        }
#endif
    for (Py_ssize_t c = 0; c < n; c++)  /* the rest: dims past D32 of the keys above, every dim of the others */
        for (Py_ssize_t d2 = c < c0 ? D32 / 2 : 0; d2 < D / 2; d2++)
            kt2[d2 * ldt + c] = dk_att_pair(base, bf16, c * stride + 2 * d2, 1);
}

/* v2[c2 * ldv + d] = pair word (rows 2 c2, 2 c2 + 1) of dim d, c2 < ceil(n / 2), d < D: V in key
   pairs; a missing last row reads as 0. */
static void dk_load_v2(const void* base, int bf16, Py_ssize_t stride, Py_ssize_t D, Py_ssize_t n,
                       uint32_t* v2, Py_ssize_t ldv) {
    for (Py_ssize_t c = 0; c + 1 < n; c += 2) {
        Py_ssize_t d = 0;
        uint32_t* dst = v2 + (c / 2) * ldv;
#if defined(__AVX512BF16__)
        for (; d + 16 <= D; d += 16) _mm512_storeu_si512(dst + d, dk_att_zip16(base, bf16, c * stride + d, (c + 1) * stride + d));
#endif
        for (; d < D; d++) dst[d] = dk_att_pair(base, bf16, c * stride + d, stride);
    }
    if (n % 2) {
        uint32_t* dst = v2 + (n / 2) * ldv;
        for (Py_ssize_t d = 0; d < D; d++) dst[d] = dk_att_elem(base, bf16, (n - 1) * stride + d);
    }
}

#endif /* DK_ATTENTION_H */
