# cython: language_level=3
"""Cython kernels for attention: flash-style online softmax over key tiles, GQA heads packed.

One core serves both ops. Keys are the virtual concatenation of two sources ([injected context |
block] for the drafter, [cache | nothing] for cached attention), each float32 or bf16, read in
place and upcast per tile into scratch. Query i sits at position q_off + i and sees the keys at
positions lo(i) .. hi(i) (see dflash_kernels/attention.py), so the mask is one interval per query.

Work item = (block of query positions, key split). Per key tile, every kv head g in turn: the
`group` query heads reading g are packed with the block's positions into up to QROWS rows, so a
K/V tile is loaded (transposed, upcast) once for all of them, and S = Q K^T, the masked online
softmax and acc += P V run on 4-row register blocks. The kv-head loop sits inside the tile loop
because one key's rows of all heads share a page: TLB misses are paid once per key, not per head.
The key split depends on the shape only (never on n_threads); the last split of a query block to
finish merges the partials in split order, so results are identical for every n_threads.

The SIMD micro-kernels (exp, 4-row blocks, K-tile transpose) are small C functions in the
verbatim block below: GCC vector extensions (AVX-512, AVX2 or SSE) and AVX2 intrinsics with a
scalar fallback.
"""

cimport numpy as cnp
from cython.parallel cimport prange, threadid
from libc.math cimport INFINITY
from libc.stdint cimport uint16_t, uint32_t

import numpy as np

cnp.import_array()

cdef extern from *:
    """
    #include "dk_exp.h"  /* dk_exp: the shared polynomial exp */

    /* Ask for a K or V row ahead of use (into L2): one kv head's rows are H_kv * D elements apart,
       often a whole page, and hardware prefetchers do not follow strides across pages. */
    static inline void dk_prefetch(const void* p, Py_ssize_t nbytes) {
        for (Py_ssize_t o = 0; o < nbytes; o += 64) __builtin_prefetch((const char*)p + o, 0, 2);
    }

    /* Register-blocked micro-kernels, written with GCC vector extensions so the accumulators
       (DK_RB rows x DK_NV vectors of DK_W floats) stay in registers: 8 x 2 vectors of 16 floats with
       AVX-512 (16 of 32 zmm: each K^T / V vector load feeds 8 FMAs), 4 x 2 of 8 with AVX2 (8 of 16
       ymm; 6 rows were no faster). Items that pack <= 4 rows (decode) use 4-row blocks. A block covers DK_CB = DK_NV * DK_W keys (in S)
       or head dims (in P V). */
    #if defined(__AVX512F__)
    #define DK_W 16
    #define DK_NV 2
    #ifndef DK_RB
    #define DK_RB 8
    #endif
    #else
    #define DK_W 8
    #define DK_NV 2
    #ifndef DK_RB
    #define DK_RB 4
    #endif
    #endif
    #define DK_CB (DK_NV * DK_W)
    typedef float dk_vf __attribute__((vector_size(DK_W * 4), aligned(4)));
    #define DK_LD(p) (*(const dk_vf*)(p))
    #define DK_ST(p, x) (*(dk_vf*)(p) = (x))

    #define DK_AI static inline __attribute__((always_inline))
    /* s[0:rb, 0:CB] (row stride lds) = q[0:rb, 0:D] (row stride D) . kt[0:D, 0:CB] (row stride ldk) */
    DK_AI void dk_qk_rows(const int rb, const float* q, Py_ssize_t D, const float* kt, Py_ssize_t ldk,
                          float* s, Py_ssize_t lds) {
        dk_vf a[DK_RB][DK_NV];
        for (int i = 0; i < rb; i++)
            for (int v = 0; v < DK_NV; v++) a[i][v] = (dk_vf){0};
        for (Py_ssize_t d = 0; d < D; d++) {
            dk_vf k[DK_NV];
            for (int v = 0; v < DK_NV; v++) k[v] = DK_LD(kt + d * ldk + v * DK_W);
            for (int i = 0; i < rb; i++) {
                float qi = q[i * D + d];
                for (int v = 0; v < DK_NV; v++) a[i][v] += qi * k[v];
            }
        }
        for (int i = 0; i < rb; i++)
            for (int v = 0; v < DK_NV; v++) DK_ST(s + i * lds + v * DK_W, a[i][v]);
    }

    /* acc[0:rb, 0:CB] (row stride lda) += p[0:rb, 0:n] (row stride ldp) . v[0:n, 0:CB] (row stride ldv) */
    DK_AI void dk_pv_rows(const int rb, const float* p, Py_ssize_t ldp, Py_ssize_t n, const float* vm,
                          Py_ssize_t ldv, float* acc, Py_ssize_t lda) {
        dk_vf a[DK_RB][DK_NV];
        for (int i = 0; i < rb; i++)
            for (int v = 0; v < DK_NV; v++) a[i][v] = DK_LD(acc + i * lda + v * DK_W);
        for (Py_ssize_t c = 0; c < n; c++) {
            dk_vf x[DK_NV];
            for (int v = 0; v < DK_NV; v++) x[v] = DK_LD(vm + c * ldv + v * DK_W);
            for (int i = 0; i < rb; i++) {
                float pi = p[i * ldp + c];
                for (int v = 0; v < DK_NV; v++) a[i][v] += pi * x[v];
            }
        }
        for (int i = 0; i < rb; i++)
            for (int v = 0; v < DK_NV; v++) DK_ST(acc + i * lda + v * DK_W, a[i][v]);
    }

    /* Row blocks of 4 (DK_RB_SMALL) or DK_RB rows: a decode step's few packed rows (e.g. GQA group
       2: 2 rows) would waste half of an 8-row block (1 query over 257 keys, 16/8 heads: 58 us with
       4-row blocks, 71 with 8; 16 queries over 4096 keys, 32/8: 6.7 ms with 4, 5.6 with 8). */
    #define DK_RB_SMALL 4
    static void dk_qk_block(int rb, const float* q, Py_ssize_t D, const float* kt, Py_ssize_t ldk,
                            float* s, Py_ssize_t lds) {
        if (rb == DK_RB) dk_qk_rows(DK_RB, q, D, kt, ldk, s, lds);
        else dk_qk_rows(DK_RB_SMALL, q, D, kt, ldk, s, lds);
    }
    static void dk_pv_block(int rb, const float* p, Py_ssize_t ldp, Py_ssize_t n, const float* vm,
                            Py_ssize_t ldv, float* acc, Py_ssize_t lda) {
        if (rb == DK_RB) dk_pv_rows(DK_RB, p, ldp, n, vm, ldv, acc, lda);
        else dk_pv_rows(DK_RB_SMALL, p, ldp, n, vm, ldv, acc, lda);
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
    #include <immintrin.h>
    static inline __m256 dk_ld8(const void* base, int bf16, Py_ssize_t i) {
        if (bf16) {
            __m128i h = _mm_loadu_si128((const __m128i*)((const unsigned short*)base + i));
            return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        }
        return _mm256_loadu_ps((const float*)base + i);
    }
    #endif

    /* kt[d * ldt + c] = element d of source row c (rows `stride` elements apart), c < n, d < D:
       the K tile transposed (and upcast), in 8 x 8 register transposes where AVX2 allows. */
    static void dk_load_kt(const void* base, int bf16, Py_ssize_t stride, Py_ssize_t D, Py_ssize_t n,
                           float* kt, Py_ssize_t ldt) {
        Py_ssize_t c = 0;
    #if defined(__AVX2__)
        Py_ssize_t D8 = D / 8 * 8;
        for (; c + 8 <= n; c += 8) {
            for (Py_ssize_t d = 0; d < D8; d += 8) {
                Py_ssize_t o = c * stride + d;
                __m256 r0 = dk_ld8(base, bf16, o), r1 = dk_ld8(base, bf16, o + stride);
                __m256 r2 = dk_ld8(base, bf16, o + 2 * stride), r3 = dk_ld8(base, bf16, o + 3 * stride);
                __m256 r4 = dk_ld8(base, bf16, o + 4 * stride), r5 = dk_ld8(base, bf16, o + 5 * stride);
                __m256 r6 = dk_ld8(base, bf16, o + 6 * stride), r7 = dk_ld8(base, bf16, o + 7 * stride);
                __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
                __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
                __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
                __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
                __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
                __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
                __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
                __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
                float* dst = kt + d * ldt + c;
                _mm256_storeu_ps(dst, _mm256_permute2f128_ps(u0, u4, 0x20));
                _mm256_storeu_ps(dst + ldt, _mm256_permute2f128_ps(u1, u5, 0x20));
                _mm256_storeu_ps(dst + 2 * ldt, _mm256_permute2f128_ps(u2, u6, 0x20));
                _mm256_storeu_ps(dst + 3 * ldt, _mm256_permute2f128_ps(u3, u7, 0x20));
                _mm256_storeu_ps(dst + 4 * ldt, _mm256_permute2f128_ps(u0, u4, 0x31));
                _mm256_storeu_ps(dst + 5 * ldt, _mm256_permute2f128_ps(u1, u5, 0x31));
                _mm256_storeu_ps(dst + 6 * ldt, _mm256_permute2f128_ps(u2, u6, 0x31));
                _mm256_storeu_ps(dst + 7 * ldt, _mm256_permute2f128_ps(u3, u7, 0x31));
            }
            for (Py_ssize_t d = D8; d < D; d++)
                for (Py_ssize_t i = 0; i < 8; i++)
                    kt[d * ldt + c + i] = dk_get(base, bf16, (c + i) * stride + d);
        }
    #endif
        for (; c < n; c++)
            for (Py_ssize_t d = 0; d < D; d++)
                kt[d * ldt + c] = dk_get(base, bf16, c * stride + d);
    }

    /* The last of a query block's key splits to finish merges them (acq_rel: it sees the others'
       partials), so one parallel region with a single barrier does the whole op. */
    static inline int dk_finish_split(int* remaining) {
        return __atomic_sub_fetch(remaining, 1, __ATOMIC_ACQ_REL) == 0;
    }
    """
    float dk_exp(float x) noexcept nogil
    void dk_prefetch(const void* p, Py_ssize_t nbytes) noexcept nogil
    int DK_CB
    int RB_BIG "DK_RB"          # query rows per register block
    int RB_SMALL "DK_RB_SMALL"  # ... when an item packs only that many rows (decode)
    void dk_qk_block(int rb, const float* q, Py_ssize_t D, const float* kt, Py_ssize_t ldk, float* s,
                     Py_ssize_t lds) noexcept nogil
    void dk_pv_block(int rb, const float* p, Py_ssize_t ldp, Py_ssize_t n, const float* v, Py_ssize_t ldv,
                     float* acc, Py_ssize_t lda) noexcept nogil
    int dk_finish_split(int* remaining) noexcept nogil
    void dk_load_kt(const void* base, int bf16, Py_ssize_t stride, Py_ssize_t D, Py_ssize_t n,
                    float* kt, Py_ssize_t ldt) noexcept nogil

cdef enum:
    KT = 32            # keys per tile: K^T and V tiles (2 x 16 KiB at D = 128) stay in L1
    QROWS = 64         # packed query rows (positions x group heads) per work item
    SPLIT_ITEMS = 16   # split key ranges until there are about this many work items ...
    SPLIT_MIN_KEYS = 128  # ... but keep at least this many keys per split


cdef struct Problem:
    const void* k1     # source 1 keys (T1, H_kv, D), float32 or bf16 bits
    const void* v1
    const void* k2     # source 2 keys (T2, H_kv, D)
    const void* v2
    int bf1            # source 1 stored as bf16
    int bf2
    Py_ssize_t T1, T2, T_q, H_q, H_kv, group, D, Dp
    Py_ssize_t q_off   # position of query 0
    Py_ssize_t window  # 0: no window
    int causal
    float scale
    Py_ssize_t qb_t    # query positions per work item
    Py_ssize_t n_qb    # query blocks
    Py_ssize_t split   # key splits per query block
    Py_ssize_t rb      # rows per register block: RB_SMALL when an item has no more rows, else RB_BIG
    Py_ssize_t rows    # packed rows per item, rounded up to rb


cdef inline Py_ssize_t _lo(const Problem* P, Py_ssize_t t) noexcept nogil:
    """First key position visible to query t."""
    cdef Py_ssize_t lo = 0
    if P.window > 0:
        lo = P.q_off + t - P.window + 1
        if lo < 0:
            lo = 0
    return lo


cdef inline Py_ssize_t _hi(const Problem* P, Py_ssize_t t) noexcept nogil:
    """Last key position visible to query t."""
    if P.causal:
        return P.q_off + t
    return P.T1 + P.T2 - 1


cdef inline void _load_row(const void* base, int bf16, Py_ssize_t off, Py_ssize_t n, float* dst) noexcept nogil:
    """dst[0:n] = float32 of the row at element offset `off` (bf16: exact, bits << 16)."""
    cdef Py_ssize_t d
    cdef const uint16_t* b
    cdef const float* f
    cdef uint32_t* u = <uint32_t*>dst
    if bf16:
        b = <const uint16_t*>base + off
        for d in range(n):
            u[d] = (<uint32_t>b[d]) << 16
    else:
        f = <const float*>base + off
        for d in range(n):
            dst[d] = f[d]


cdef inline const char* _row_ptr(const Problem* P, int value, Py_ssize_t g, Py_ssize_t j, int* bf16) noexcept nogil:
    """Address of key (value=0) or value (value=1) row j of kv head g, in whichever source holds it."""
    cdef Py_ssize_t row
    cdef const void* base
    if j < P.T1:
        base, row, bf16[0] = (P.v1 if value else P.k1), j, P.bf1
    else:
        base, row, bf16[0] = (P.v2 if value else P.k2), j - P.T1, P.bf2
    return <const char*>base + (row * P.H_kv + g) * P.D * (2 if bf16[0] else 4)


cdef void _prefetch_keys(const Problem* P, Py_ssize_t g, Py_ssize_t j_begin, Py_ssize_t j_end) noexcept nogil:
    """Software prefetch of K and V rows j_begin..j_end-1 of kv head g (clipped to the keys)."""
    cdef Py_ssize_t j, nbytes
    cdef int bf
    if j_end > P.T1 + P.T2:
        j_end = P.T1 + P.T2
    for j in range(j_begin, j_end):
        nbytes = P.D * (2 if (P.bf1 if j < P.T1 else P.bf2) else 4)
        dk_prefetch(_row_ptr(P, 0, g, j, &bf), nbytes)
        dk_prefetch(_row_ptr(P, 1, g, j, &bf), nbytes)


cdef const float* _load_tile(const Problem* P, Py_ssize_t g, Py_ssize_t j0, Py_ssize_t kn,
                             float* kt, float* vt, Py_ssize_t* ldv) noexcept nogil:
    """Fill kt (D, KT) = K[j0:j0+kn, g]^T (keys >= kn zero) and return V[j0:j0+kn, g] with its row
    stride in ldv: in place for float32 rows of one source (D a multiple of DK_CB), else upcast
    into vt (KT, Dp), dims >= D zero (the P V kernel reads only kn rows)."""
    cdef Py_ssize_t c, d, D = P.D, Dp = P.Dp, stride = P.H_kv * P.D
    cdef Py_ssize_t n1 = min(max(P.T1 - j0, 0), kn)  # keys of the tile in source 1
    cdef int bf
    cdef const char* base
    if n1 > 0:
        dk_load_kt(<const char*>P.k1 + (j0 * P.H_kv + g) * D * (2 if P.bf1 else 4), P.bf1, stride, D, n1, kt, KT)
    if kn > n1:
        dk_load_kt(<const char*>P.k2 + ((j0 + n1 - P.T1) * P.H_kv + g) * D * (2 if P.bf2 else 4), P.bf2, stride, D,
                   kn - n1, kt + n1, KT)
    for d in range(D):
        for c in range(kn, KT):
            kt[d * KT + c] = 0.0
    base = _row_ptr(P, 1, g, j0, &bf)
    if Dp == D and not bf and (n1 == kn or n1 == 0):
        ldv[0] = stride
        return <const float*>base
    for c in range(kn):
        base = _row_ptr(P, 1, g, j0 + c, &bf)
        _load_row(base, bf, 0, D, vt + c * Dp)
        for d in range(D, Dp):
            vt[c * Dp + d] = 0.0
    ldv[0] = Dp
    return vt


cdef inline float _row_max(const float* s) noexcept nogil:
    """max of s[0:KT]; 8 independent lanes so gcc can vectorise without -ffinite-math."""
    cdef float mx[8]
    cdef float x, best
    cdef int c, lane
    for lane in range(8):
        mx[lane] = s[lane]
    for c in range(1, KT // 8):
        for lane in range(8):
            x = s[c * 8 + lane]
            mx[lane] = x if x > mx[lane] else mx[lane]
    best = mx[0]
    for lane in range(1, 8):
        best = mx[lane] if mx[lane] > best else best
    return best


cdef inline void _softmax_update(float* srow, float* m, float* l, float* accrow, Py_ssize_t Dp,
                                 Py_ssize_t c_lo, Py_ssize_t c_hi) noexcept nogil:
    """Online softmax of one row: keys c_lo..c_hi of the tile are visible (maybe none).

    srow becomes the tile's unnormalised probabilities; the running max m, sum l and accumulator
    row are rescaled to the new max."""
    cdef Py_ssize_t c, d
    cdef float mt, mn, alpha, tot = 0.0, p
    if c_hi < c_lo:  # nothing visible in this tile for this row: contributes nothing
        for c in range(KT):
            srow[c] = 0.0
        return
    for c in range(c_lo):
        srow[c] = -INFINITY
    for c in range(c_hi + 1, KT):
        srow[c] = -INFINITY
    mt = _row_max(srow)
    mn = mt if mt > m[0] else m[0]
    for c in range(KT):
        p = dk_exp(srow[c] - mn)
        srow[c] = p
        tot += p
    if mn != m[0]:
        alpha = dk_exp(m[0] - mn)  # 0 on the first visible tile (m = -inf)
        l[0] *= alpha
        for d in range(Dp):
            accrow[d] *= alpha
        m[0] = mn
    l[0] += tot


cdef inline Py_ssize_t _scratch_size(const Problem* P) noexcept nogil:
    """Floats of per-thread scratch: packed queries of all heads, K^T and V tiles, scores, and
    m, l, acc of all heads."""
    cdef Py_ssize_t Rp = P.rows, H = P.H_kv
    return H * Rp * P.D + P.D * KT + KT * P.Dp + Rp * KT + H * (2 * Rp + Rp * P.Dp)


cdef void _item(const Problem* P, const float* q, Py_ssize_t item, float* out,
                float* part_m, float* part_l, float* part_acc, float* buf) noexcept nogil:
    """One work item (query block b, key split s): online softmax over its keys, for every kv head.

    The kv-head loop sits inside the key-tile loop: one key's rows of all heads share a page (the
    cache is (T, H_kv, D)), so the TLB misses of a tile are paid once, not once per head."""
    cdef Py_ssize_t split = P.split, D = P.D, Dp = P.Dp, Rp = P.rows, group = P.group, H = P.H_kv
    cdef Py_ssize_t s = item % split
    cdef Py_ssize_t b = item // split
    cdef Py_ssize_t t0 = b * P.qb_t
    cdef Py_ssize_t nt = min(P.qb_t, P.T_q - t0)
    cdef Py_ssize_t R = nt * group
    cdef Py_ssize_t g, r, r0, c0, d, t, h, tile, j0, kn, c_lo, c_hi, ldv, g_pf, j_pf, pf_per_block
    cdef const float* vsrc
    cdef Py_ssize_t lo_min = _lo(P, t0), hi_max = _hi(P, t0 + nt - 1)
    cdef Py_ssize_t n_tiles = (hi_max - lo_min + KT) // KT
    cdef float inv
    cdef float* qp = buf                 # (H_kv, Rp, D) scaled queries, row r = (t - t0) * group + head
    cdef float* kt = qp + H * Rp * D     # (D, KT)
    cdef float* vt = kt + D * KT         # (KT, Dp)
    cdef float* sc = vt + KT * Dp        # (Rp, KT) scores, then probabilities
    cdef float* m                        # (H_kv, Rp) running max
    cdef float* l                        # (H_kv, Rp) running sum
    cdef float* acc                      # (H_kv, Rp, Dp) unnormalised output
    cdef float* qg
    cdef float* mg
    cdef float* lg
    cdef float* ag
    if split == 1:                       # this thread's m, l, acc
        m = sc + Rp * KT
        l = m + H * Rp
        acc = l + H * Rp
    else:                                # the item's slots in the partials
        m = part_m + item * H * Rp
        l = part_l + item * H * Rp
        acc = part_acc + item * H * Rp * Dp
    for r in range(H * Rp):
        m[r] = -INFINITY
        l[r] = 0.0
        for d in range(Dp):
            acc[r * Dp + d] = 0.0
        for d in range(D):
            qp[r * D + d] = 0.0
    for g in range(H):  # pack each kv head's group: query head g * group + r % group
        for r in range(R):
            t = t0 + r // group
            h = g * group + r % group
            for d in range(D):
                qp[(g * Rp + r) * D + d] = q[(t * P.H_q + h) * D + d] * P.scale

    for tile in range(s * n_tiles // split, (s + 1) * n_tiles // split):
        j0 = lo_min + tile * KT
        kn = min(<Py_ssize_t>KT, hi_max + 1 - j0)
        for g in range(H):
            qg, mg, lg, ag = qp + g * Rp * D, m + g * Rp, l + g * Rp, acc + g * Rp * Dp
            vsrc = _load_tile(P, g, j0, kn, kt, vt, &ldv)
            # the next (head, tile) to load: spread its prefetch over this head's row blocks
            g_pf, j_pf = g + 1, j0
            if g + 1 == H:
                g_pf, j_pf = 0, j0 + KT
                if tile + 1 == (s + 1) * n_tiles // split:
                    j_pf = hi_max + 1  # this item's last tile: nothing to prefetch
            pf_per_block = (KT + Rp // P.rb - 1) // (Rp // P.rb)
            # per block of 4 query rows: S = Q K^T, masked online softmax, acc += P V (the
            # block's scores stay in L1 between the three steps; kt and vt are streamed)
            for r0 in range(Rp // P.rb):
                if j_pf <= hi_max:
                    _prefetch_keys(P, g_pf, j_pf + r0 * pf_per_block,
                                   min(j_pf + (r0 + 1) * pf_per_block, hi_max + 1))
                for c0 in range(KT // DK_CB):
                    dk_qk_block(P.rb, qg + r0 * P.rb * D, D, kt + c0 * DK_CB, KT, sc + r0 * P.rb * KT + c0 * DK_CB,
                                KT)
                for r in range(r0 * P.rb, r0 * P.rb + P.rb):
                    if r < R:
                        t = t0 + r // group
                        c_lo = max(_lo(P, t) - j0, 0)
                        c_hi = min(_hi(P, t) - j0, kn - 1)
                    else:  # padding rows
                        c_lo, c_hi = 1, 0
                    _softmax_update(sc + r * KT, mg + r, lg + r, ag + r * Dp, Dp, c_lo, c_hi)
                for c0 in range(Dp // DK_CB):
                    dk_pv_block(P.rb, sc + r0 * P.rb * KT, KT, kn, vsrc + c0 * DK_CB, ldv,
                                ag + r0 * P.rb * Dp + c0 * DK_CB, Dp)

    if split == 1:
        for g in range(H):
            for r in range(R):
                t = t0 + r // group
                h = g * group + r % group
                inv = 1.0 / l[g * Rp + r]
                for d in range(D):
                    out[(t * P.H_q + h) * D + d] = acc[(g * Rp + r) * Dp + d] * inv


cdef void _merge(const Problem* P, Py_ssize_t unit, float* out, const float* part_m,
                 const float* part_l, const float* part_acc) noexcept nogil:
    """Combine the key splits of (query block, kv head) `unit` in split order."""
    cdef Py_ssize_t split = P.split, Rp = P.rows, Dp = P.Dp, D = P.D, group = P.group, H = P.H_kv
    cdef Py_ssize_t b = unit // H, g = unit % H
    cdef Py_ssize_t t0 = b * P.qb_t, nt = min(P.qb_t, P.T_q - t0)
    cdef Py_ssize_t r, s, d, t, h, i
    cdef float mx, w, tot
    cdef float* o
    for r in range(nt * group):
        t = t0 + r // group
        h = g * group + r % group
        o = out + (t * P.H_q + h) * D
        mx = -INFINITY
        for s in range(split):
            i = ((b * split + s) * H + g) * Rp + r
            if part_m[i] > mx:
                mx = part_m[i]
        for d in range(D):
            o[d] = 0.0
        tot = 0.0
        for s in range(split):
            i = ((b * split + s) * H + g) * Rp + r
            if part_l[i] == 0.0:  # this split saw no key of the row
                continue
            w = dk_exp(part_m[i] - mx)
            tot += w * part_l[i]
            for d in range(D):
                o[d] += w * part_acc[i * Dp + d]
        w = 1.0 / tot
        for d in range(D):
            o[d] *= w


cdef const void* _ptr(cnp.ndarray a):
    return <const void*>cnp.PyArray_DATA(a)


def _attend(q, k1, v1, k2, v2, out, Py_ssize_t q_off, bint causal, window, float scale, int n_threads):
    cdef Problem P
    cdef Py_ssize_t n_items, it, n_base
    cdef int nth = max(1, n_threads)
    P.k1, P.v1, P.k2, P.v2 = _ptr(k1), _ptr(v1), _ptr(k2), _ptr(v2)
    P.bf1 = k1.dtype == np.uint16
    P.bf2 = k2.dtype == np.uint16
    P.T1, P.T2 = k1.shape[0], k2.shape[0]
    P.T_q, P.H_q, P.D = q.shape[0], q.shape[1], q.shape[2]
    P.H_kv = k1.shape[1]
    P.group = P.H_q // P.H_kv
    P.Dp = (P.D + DK_CB - 1) // DK_CB * DK_CB
    P.q_off = q_off
    P.window = 0 if window is None else window
    P.causal = causal
    P.scale = scale
    P.qb_t = max(1, QROWS // P.group)
    P.n_qb = (P.T_q + P.qb_t - 1) // P.qb_t
    P.rows = min(P.qb_t, P.T_q) * P.group
    P.rb = RB_SMALL if P.rows <= RB_SMALL else RB_BIG
    P.rows = (P.rows + P.rb - 1) // P.rb * P.rb
    n_base = P.n_qb
    P.split = 1
    if n_base < SPLIT_ITEMS:
        P.split = max(1, min((SPLIT_ITEMS + n_base - 1) // n_base, (P.T1 + P.T2) // SPLIT_MIN_KEYS))
    n_items = n_base * P.split
    cdef cnp.ndarray qa = q
    cdef cnp.ndarray oa = out
    cdef const float* qptr = <const float*>cnp.PyArray_DATA(qa)
    cdef float* optr = <float*>cnp.PyArray_DATA(oa)
    cdef cnp.ndarray pm, pl, pacc
    cdef float* pmp = NULL
    cdef float* plp = NULL
    cdef float* pap = NULL
    if P.split > 1:  # per-item partials (m, l, acc), merged in split order below
        pm = np.empty(n_items * P.H_kv * P.rows, np.float32)
        pl = np.empty(n_items * P.H_kv * P.rows, np.float32)
        pacc = np.empty(n_items * P.H_kv * P.rows * P.Dp, np.float32)
        pmp = <float*>cnp.PyArray_DATA(pm)
        plp = <float*>cnp.PyArray_DATA(pl)
        pap = <float*>cnp.PyArray_DATA(pacc)
    nth = <int>min(<Py_ssize_t>nth, n_items)
    cdef Py_ssize_t n_scratch = _scratch_size(&P)
    cdef cnp.ndarray scratch = np.empty(nth * n_scratch, np.float32)
    cdef float* sp = <float*>cnp.PyArray_DATA(scratch)
    cdef cnp.ndarray remaining = np.full(n_base, P.split, np.intc)  # unfinished splits per query block
    cdef int* rem = <int*>cnp.PyArray_DATA(remaining)
    cdef Py_ssize_t g
    with nogil:
        for it in prange(n_items, num_threads=nth, schedule="dynamic"):
            _item(&P, qptr, it, optr, pmp, plp, pap, sp + threadid() * n_scratch)
            if P.split > 1 and dk_finish_split(rem + it // P.split):
                for g in range(P.H_kv):
                    _merge(&P, (it // P.split) * P.H_kv + g, optr, pmp, plp, pap)


def injected_kv_attention(q, k_ctx, v_ctx, k_blk, v_blk, out, *, int n_threads, float scale,
                          bint causal_block, window):
    _attend(q, k_ctx, v_ctx, k_blk, v_blk, out, k_ctx.shape[0], causal_block, window, scale, n_threads)


def cached_attention(q, k_cache, v_cache, out, *, int n_threads, bint causal, float scale, window):
    empty = k_cache[:0]
    _attend(q, k_cache, v_cache, empty, empty, out, k_cache.shape[0] - q.shape[0], causal, window,
            scale, n_threads)
