"""The attention core shared by attention.pyx and the fused layers (layers.pxi, in dense.pyx):
included, not imported, so that each extension module calls it at C level. See attention.pyx for
how the work is split."""

from cython.parallel cimport parallel, prange, threadid
from libc.math cimport INFINITY
from libc.stdint cimport int32_t, uint16_t, uint32_t
from libc.stdlib cimport free, malloc

cdef extern from "dk_attention.h":
    float dk_exp(float x) noexcept nogil
    void dk_prefetch(const void* p, Py_ssize_t nbytes) noexcept nogil
    int DK_CB
    int RB_BIG "DK_RB"          # query rows per register block
    int RB_SMALL "DK_RB_SMALL"  # ... when an item packs only that many rows (decode)
    int W "DK_W"       # floats per vector: the FMA tiles' rows come in multiples of it
    void dk_qkt_block(int nv, const float* kr, Py_ssize_t ldk, Py_ssize_t D, const float* qt, Py_ssize_t ldq,
                      float* st, Py_ssize_t lds) noexcept nogil
    void dk_pv_block(int rb, const float* pt, Py_ssize_t ldp, Py_ssize_t n, const float* v, Py_ssize_t ldv,
                     float* acc, Py_ssize_t lda, const float* alpha) noexcept nogil
    int KT "DK_KT"     # keys per tile: K and V tiles (2 x 16 KiB at D = 128) stay in L1
    void dk_softmax_cols(Py_ssize_t nr, float* st, Py_ssize_t lds, int masked, int32_t j0, const int32_t* lo,
                         const int32_t* hi, int round, float* m, float* l, float* alpha) noexcept nogil
    void dk_softmax_rows(int rb, float* s, Py_ssize_t lds, int32_t j0, const int32_t* lo, const int32_t* hi,
                         float* m, float* l, float* alpha) noexcept nogil
    void dk_rescale_rows(int rb, float* acc, Py_ssize_t lda, Py_ssize_t n, const float* alpha) noexcept nogil
    void dk_load_rows(const void* base, int bf16, Py_ssize_t stride, Py_ssize_t D, Py_ssize_t n,
                      float* dst, Py_ssize_t ldd) noexcept nogil
    # decode steps: K and V rows read in place
    int DIRECT_D "DK_DIRECT_D"
    int LD_F32 "DK_LD_F32"                  # how dk_qk_direct / dk_pv_direct read a source's rows
    int LD_BF16 "DK_LD_BF16"
    int LD_F32_ROUNDED "DK_LD_F32_ROUNDED"  # ... float32 rounded to bf16 ("medium")
    void dk_qk_direct(int rb, int ld, const float* q, Py_ssize_t rp, Py_ssize_t H, Py_ssize_t D, const void* k,
                      Py_ssize_t n, float* s, Py_ssize_t lds) noexcept nogil
    void dk_pv_direct(int rb, int ld, const float* p, Py_ssize_t ldp, Py_ssize_t rp, Py_ssize_t H, Py_ssize_t n,
                      const void* v, Py_ssize_t D, float* acc, Py_ssize_t lda) noexcept nogil
    # "medium" (see dk_attention.h): bf16 operands; ATT_DOT: vdpbf16ps kernels on pair words
    int ATT_DOT "DK_ATT_DOT"
    void dk_att_round_run(float* x, Py_ssize_t n) noexcept nogil
    uint32_t dk_att_elem(const void* base, int bf16, Py_ssize_t i) noexcept nogil
    void dk_qk2_block(int rb, const uint32_t* q2, Py_ssize_t D2, const uint32_t* kt2, Py_ssize_t ldk, float* s,
                      Py_ssize_t lds) noexcept nogil
    void dk_pv2_block(int rb, const uint32_t* p2, Py_ssize_t ldp, Py_ssize_t n2, const uint32_t* v2,
                      Py_ssize_t ldv, float* acc, Py_ssize_t lda) noexcept nogil
    void dk_att_bf16_inplace(float* x, Py_ssize_t n) noexcept nogil
    int ATT_AMX "DK_AMX_BUILT"
    void att_amx_begin "dk_amx_begin"() noexcept nogil
    void att_amx_end "dk_amx_end"() noexcept nogil
    void dk_qk_amx(int nparts, const uint32_t* q2, Py_ssize_t pstride, Py_ssize_t D2, const uint32_t* kt2,
                   Py_ssize_t ldk, float* s, Py_ssize_t lds) noexcept nogil
    void dk_pv_amx(int nparts, const uint32_t* p2, Py_ssize_t ldp, Py_ssize_t pstride, const uint32_t* v2,
                   Py_ssize_t ldv, float* acc, Py_ssize_t lda, Py_ssize_t Dp) noexcept nogil
    # "highest" on AMX: fp32 split into three exact bf16 parts (dk_bf16dot.h)
    uint32_t att_split "dk_split_run"(const float* x, long n, int parts, uint16_t* p0, uint16_t* p1,
                                      uint16_t* p2) noexcept nogil
    void dk_load_kt2(const void* base, int bf16, Py_ssize_t stride, Py_ssize_t D, Py_ssize_t n, uint32_t* kt2,
                     Py_ssize_t ldt) noexcept nogil
    void dk_load_v2(const void* base, int bf16, Py_ssize_t stride, Py_ssize_t D, Py_ssize_t n, uint32_t* v2,
                    Py_ssize_t ldv) noexcept nogil


cdef enum:
    MAX_RB = 16        # rows per register block, at most (AMX's 16-row tiles)
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
    Py_ssize_t rb      # rows per register block (pair words: RB_BIG, 16 on AMX; decode: 2 or 4); on the FMA
                       # tiles W, the rows' rounding (their P V blocks are chosen per tile)
    Py_ssize_t rows    # packed rows per item, rounded up to rb
    int medium         # "medium" precision: queries, K, V and P rounded to bf16
    int dot            # ... on pair words: vdpbf16ps (AVX512-BF16 built, where it pays, D even) or AMX
    int amx            # AMX tiles (AMX built and granted, D a multiple of 32): 16-row blocks, at "medium",
                       # or at "highest" over bf16 keys and values
    int nparts         # the queries' and P's bf16 parts on the pair words: 1 ("medium") or 3 (exact, AMX)
    int direct         # few rows per item (decode): K and V read in place, no tiles (FMA, at any precision)
    int fma            # the FMA tiles (neither direct nor dot): scores transposed, rows in whole vectors


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


cdef void _direct_tile(const Problem* P, Py_ssize_t j0, Py_ssize_t kn, const float* qp, float* sc, float* m,
                       float* l, float* acc, const int32_t* lo, const int32_t* hi) noexcept nogil:
    """The decode path (P.direct) over keys j0..j0+kn-1 for every kv head at once: one key's rows of
    all heads are contiguous, so K and V are read in place in address order. S on K rows, the masked
    online softmax per row, acc += P V; rows >= R (padding) see no key. sc is (H_kv, rows, KT). At
    "medium", K, V (a float32 source's, as they are read) and P are rounded to bf16; the queries were
    rounded when packed."""
    cdef Py_ssize_t n1 = min(max(P.T1 - j0, 0), kn), H = P.H_kv, Rp = P.rows, g
    cdef int bf
    cdef const char* rows
    if n1 > 0:
        rows = _row_ptr(P, 0, 0, j0, &bf)
        dk_qk_direct(P.rb, _ld(P, bf), qp, Rp, H, P.D, rows, n1, sc, KT)
    if kn > n1:
        rows = _row_ptr(P, 0, 0, j0 + n1, &bf)
        dk_qk_direct(P.rb, _ld(P, bf), qp, Rp, H, P.D, rows, kn - n1, sc + n1, KT)
    cdef float alpha[MAX_RB]
    for g in range(H):  # (a row's bounds are the same for every head)
        dk_softmax_rows(Rp, sc + g * Rp * KT, KT, <int32_t>j0, lo, hi, m + g * Rp, l + g * Rp, alpha)
        dk_rescale_rows(Rp, acc + g * Rp * P.Dp, P.Dp, P.Dp, alpha)
        if P.medium:  # P rounded (l kept the unrounded sum, as on the tiles)
            dk_att_round_run(sc + g * Rp * KT, Rp * KT)
    if n1 > 0:
        rows = _row_ptr(P, 1, 0, j0, &bf)
        dk_pv_direct(P.rb, _ld(P, bf), sc, KT, Rp, H, n1, rows, P.D, acc, P.Dp)
    if kn > n1:
        rows = _row_ptr(P, 1, 0, j0 + n1, &bf)
        dk_pv_direct(P.rb, _ld(P, bf), sc + n1, KT, Rp, H, kn - n1, rows, P.D, acc, P.Dp)


cdef inline int _ld(const Problem* P, int bf16) noexcept nogil:
    """How the direct kernels read the rows of a source stored as bf16 (bf16 = 1) or float32."""
    if bf16:
        return LD_BF16
    return LD_F32_ROUNDED if P.medium else LD_F32


cdef void _load_tile(const Problem* P, Py_ssize_t g, Py_ssize_t j0, Py_ssize_t kn, float* kt,
                     float* vt) noexcept nogil:
    """Fill kt (KT, D) = K[j0:j0+kn, g] (keys >= kn zero; kt NULL: V only) and vt (KT, Dp) =
    V[j0:j0+kn, g] (upcast, dims >= D zero; the P V kernels read only kn rows), rounded at "medium"."""
    cdef Py_ssize_t c, d, D = P.D, Dp = P.Dp, stride = P.H_kv * P.D
    cdef Py_ssize_t n1 = min(max(P.T1 - j0, 0), kn)  # keys of the tile in source 1
    cdef int bf
    if P.dot:  # pair words: kt (D / 2, KT), vt (KT / 2, Dp); a pair straddling the sources is joined
        _load_tile_pairs(P, g, j0, kn, n1, <uint32_t*>kt, <uint32_t*>vt)
        return
    if kt != NULL:
        if n1 > 0:
            dk_load_rows(_row_ptr(P, 0, g, j0, &bf), P.bf1, stride, D, n1, kt, D)
        if kn > n1:
            dk_load_rows(_row_ptr(P, 0, g, j0 + n1, &bf), P.bf2, stride, D, kn - n1, kt + n1 * D, D)
        for c in range(kn * D, KT * D):
            kt[c] = 0.0
    if n1 > 0:
        dk_load_rows(_row_ptr(P, 1, g, j0, &bf), P.bf1, stride, D, n1, vt, Dp)
    if kn > n1:
        dk_load_rows(_row_ptr(P, 1, g, j0 + n1, &bf), P.bf2, stride, D, kn - n1, vt + n1 * Dp, Dp)
    if Dp > D:
        for c in range(kn):
            for d in range(D, Dp):
                vt[c * Dp + d] = 0.0
    if P.medium:  # a float32 source's keys rounded (a bf16 source's are bf16 already)
        if n1 > 0 and not P.bf1:
            dk_att_round_run(kt, n1 * D)
            dk_att_round_run(vt, n1 * Dp)
        if kn > n1 and not P.bf2:
            dk_att_round_run(kt + n1 * D, (kn - n1) * D)
            dk_att_round_run(vt + n1 * Dp, (kn - n1) * Dp)


cdef void _load_tile_pairs(const Problem* P, Py_ssize_t g, Py_ssize_t j0, Py_ssize_t kn, Py_ssize_t n1,
                           uint32_t* kt2, uint32_t* v2) noexcept nogil:
    """The tile as pair words (see dk_attention.h): kt2 (D / 2, KT) = K^T in dim pairs, keys >= kn
    zero; v2 (KT / 2, Dp) = V in key pairs, a missing last key and dims >= D zero. n1 keys come
    from source 1; when a key pair straddles the two sources, it is built from both."""
    cdef Py_ssize_t c, d, D = P.D, Dp = P.Dp, stride = P.H_kv * P.D, n_odd = 0
    cdef int bf, bf_b
    cdef const char* a
    cdef const char* b
    # (each source's dtype is its own flag: _row_ptr's out-argument is not read in the same call,
    # whose argument order C leaves unspecified)
    if n1 > 0:
        dk_load_kt2(_row_ptr(P, 0, g, j0, &bf), P.bf1, stride, D, n1, kt2, KT)
    if kn > n1:
        dk_load_kt2(_row_ptr(P, 0, g, j0 + n1, &bf), P.bf2, stride, D, kn - n1, kt2 + n1, KT)
    for d in range(D // 2):
        for c in range(kn, KT):
            kt2[d * KT + c] = 0
    if n1 % 2 and kn > n1:  # keys n1 - 1 (source 1) and n1 (source 2) share a pair word
        n_odd = 1
        a = _row_ptr(P, 1, g, j0 + n1 - 1, &bf)
        b = _row_ptr(P, 1, g, j0 + n1, &bf_b)
        for d in range(D):
            v2[(n1 // 2) * Dp + d] = dk_att_elem(a, bf, d) | dk_att_elem(b, bf_b, d) << 16
    if n1 - n_odd > 0:
        dk_load_v2(_row_ptr(P, 1, g, j0, &bf), P.bf1, stride, D, n1 - n_odd, v2, Dp)
    if kn - n1 - n_odd > 0:
        dk_load_v2(_row_ptr(P, 1, g, j0 + n1 + n_odd, &bf), P.bf2, stride, D, kn - n1 - n_odd,
                   v2 + ((n1 + n_odd) // 2) * Dp, Dp)
    if Dp > D:
        for c in range((kn + 1) // 2):
            for d in range(D, Dp):
                v2[c * Dp + d] = 0
    for c in range((kn + 1) // 2, KT // 2):  # AMX's B tile reads all KT / 2 key pairs
        for d in range(Dp):
            v2[c * Dp + d] = 0


cdef inline Py_ssize_t _q_floats(const Problem* P) noexcept nogil:
    """Floats of one query block's packed queries: (H_kv, Rp, D), or their nparts parts as pair words
    (nparts x (H_kv, Rp, D / 2) words) and a row of D floats to split from."""
    if P.nparts == 3:
        return 3 * P.H_kv * P.rows * P.D // 2 + P.D
    return P.H_kv * P.rows * P.D


cdef inline Py_ssize_t _scratch_size(const Problem* P) noexcept nogil:
    """Floats of per-thread scratch: packed queries of all heads, K^T and V tiles, scores, and
    m, l, acc of all heads, P's parts (nparts = 3)."""
    cdef Py_ssize_t Rp = P.rows, H = P.H_kv
    return (_q_floats(P) + P.D * KT + KT * P.Dp + (H if P.direct else 1) * Rp * KT + H * (2 * Rp + Rp * P.Dp)
            + 3 * Rp + 3 * MAX_RB * KT // 2)


cdef void _pack_queries(const Problem* P, const float* q, Py_ssize_t b, float* qp) noexcept nogil:
    """Query block b's scaled queries, packed per kv head into qp: (H_kv, Rp, D), row r = (t - t0) *
    group + head, or (H_kv, D, Rp) on the FMA tiles; padding rows zero; rounded at "medium", as D / 2
    pair words for P.dot, or as three exact parts of them ("highest" on AMX, see _q_floats)."""
    cdef Py_ssize_t H = P.H_kv, Rp = P.rows, D = P.D, group = P.group, t0 = b * P.qb_t
    cdef Py_ssize_t R = min(P.qb_t, P.T_q - t0) * group
    cdef Py_ssize_t g, r, d, t, h, row, n2 = H * Rp * D // 2
    cdef float* dst
    cdef uint16_t* q16 = <uint16_t*>qp
    if P.nparts == 3:  # three parts as pair words (3 n2 words), split from a row of scaled floats after them
        for r in range(6 * n2):
            q16[r] = 0
    else:
        for r in range(H * Rp * D):
            qp[r] = 0.0
    for g in range(H):  # each kv head's group: query head g * group + r % group
        for r in range(R):
            t = t0 + r // group
            h = g * group + r % group
            row = (t * P.H_q + h) * D
            if P.fma:  # transposed (strided stores; shared by the key splits, so made once per block)
                for d in range(D):
                    qp[(g * D + d) * Rp + r] = q[row + d] * P.scale
                continue
            dst = qp + 3 * n2 if P.nparts == 3 else qp + (g * Rp + r) * D
            for d in range(D):
                dst[d] = q[row + d] * P.scale
            if P.nparts == 3:
                att_split(dst, D, 3, q16 + (g * Rp + r) * D, q16 + 2 * n2 + (g * Rp + r) * D,
                          q16 + 4 * n2 + (g * Rp + r) * D)
    if P.dot and P.nparts == 1:  # each row's rounded dims as D / 2 pair words
        dk_att_bf16_inplace(qp, H * Rp * D)
    elif P.medium:
        dk_att_round_run(qp, H * Rp * D)


cdef void _fma_tile(const Problem* P, Py_ssize_t R, Py_ssize_t j0, Py_ssize_t kn, const float* qt, const float* kt,
                    Py_ssize_t ldk, const float* vt, float* st, float* m, float* l, float* acc, const int32_t* lo,
                    const int32_t* hi, int masked, float* alpha, Py_ssize_t g_pf, Py_ssize_t j_pf,
                    Py_ssize_t j_end) noexcept nogil:
    """One kv head's tile on the FMA tiles: st (KT, Rp) = K Q^T from qt (D, Rp) and the K rows kt
    (row stride ldk: the tile's copy, or the cache's rows in place),
    the online softmax down the keys (masked by lo/hi when `masked`), then acc += P V by row
    blocks, the rescale riding on them; only the vectors of rows that hold the R real rows, and P V
    for those rows (rounded up to 2). Prefetches keys j_pf.. (up to j_end) of kv head g_pf, the
    next tile to load, spread over the row blocks."""
    cdef Py_ssize_t Rp = P.rows, D = P.D, Dp = P.Dp, r0 = 0, rb, c0
    cdef Py_ssize_t Rv = (R + W - 1) // W * W, R2 = (R + 1) // 2 * 2
    cdef Py_ssize_t n_blocks = (R2 + RB_BIG - 1) // RB_BIG
    cdef Py_ssize_t pf = (KT + n_blocks - 1) // n_blocks, pf_at = j_pf
    while r0 < Rv:  # S^T by 2 vectors of rows (the last by 1 when the rows fill an odd number)
        dk_qkt_block(2 if r0 + 2 * W <= Rv else 1, kt, ldk, D, qt + r0, Rp, st + r0, Rp)
        r0 += 2 * W
    dk_softmax_cols(Rv, st, Rp, masked, <int32_t>j0, lo, hi, P.medium, m, l, alpha)  # "medium": P rounded
    r0 = 0
    while r0 < R2:  # blocks of RB_BIG rows, then 4 and 2
        rb = RB_BIG if r0 + RB_BIG <= R2 else (RB_SMALL if r0 + RB_SMALL <= R2 else 2)
        if pf_at < j_end:
            _prefetch_keys(P, g_pf, pf_at, min(pf_at + pf, j_end))
            pf_at += pf
        for c0 in range(Dp // DK_CB):
            dk_pv_block(rb, st + r0, Rp, kn, vt + c0 * DK_CB, Dp, acc + r0 * Dp + c0 * DK_CB, Dp, alpha + r0)
        r0 += rb


cdef void _item(const Problem* P, const float* q, const float* q_packed, Py_ssize_t item, float* out,
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
    cdef Py_ssize_t g, r, r0, c0, d, t, h, tile, j0, kn, g_pf, j_pf, pf_per_block
    cdef float alpha[MAX_RB]   # the pair words' online softmax: the rescale of a block's accumulator rows
    cdef Py_ssize_t lo_min = _lo(P, t0), hi_max = _hi(P, t0 + nt - 1)
    cdef Py_ssize_t n_tiles = (hi_max - lo_min + KT) // KT
    cdef float inv
    cdef int bf
    cdef const float* kin                # the tile's K rows for the FMA tiles: kt, or the cache in place
    cdef Py_ssize_t ldk
    # The FMA tiles read a float32 tile's K rows in place, with no copy: S^T broadcasts them one
    # element at a time, so their stride (a whole cache row) costs nothing, while their copy took
    # 13-25% of the tiles' time (bench/attention_ab.py: 0.90-0.95 of the time on 16 queries over
    # 4096 keys, every tier, docs/benchmarks.md session 28). V stays copied: P V loads V rows as
    # vectors, 6-8 FMAs each, and read in place at their stride they cost avx2 1.12x the time.
    cdef bint k_in_place = P.fma and not P.medium, tile_in_place
    cdef int32_t lo_top = 0, hi_bot = <int32_t>hi_max  # the tiles that every row sees whole lie in lo_top..hi_bot
    cdef float* qp = buf                 # (H_kv, Rp, D) scaled queries, row r = (t - t0) * group + head;
                                         # (H_kv, D, Rp) on the FMA tiles
    cdef const uint32_t* q2 = <uint32_t*>buf  # P.dot: (H_kv, Rp, D / 2) the same as pair words
                                         # (both in q_packed when the block's key splits share it)
    cdef float* kt = buf + _q_floats(P)  # (KT, D) K rows; P.dot: (D / 2, KT) K^T as pair words
    cdef float* vt = kt + D * KT         # (KT, Dp)
    cdef float* sc = vt + KT * Dp        # (Rp, KT) scores, then probabilities; (H_kv, Rp, KT) if P.direct;
                                         # (KT, Rp) on the FMA tiles
    cdef int32_t* lo_abs = <int32_t*>(sc + (H if P.direct else 1) * Rp * KT)  # (Rp) row r sees the key
    cdef int32_t* hi_abs = lo_abs + Rp   # ... positions lo_abs[r]..hi_abs[r] (padding rows: none)
    cdef float* alpha_r = <float*>(hi_abs + Rp)  # (Rp) FMA tiles: the rows' rescale in a tile
    cdef uint32_t* p3 = <uint32_t*>(alpha_r + Rp)  # nparts = 3: (3, P.rb, KT / 2) P's parts as pair words
    cdef Py_ssize_t q_pstride = H * Rp * D // 2  # nparts = 3: words between the queries' parts
    cdef float* m                        # (H_kv, Rp) running max
    cdef float* l                        # (H_kv, Rp) running sum
    cdef float* acc                      # (H_kv, Rp, Dp) unnormalised output
    cdef float* qg
    cdef float* mg
    cdef float* lg
    cdef float* ag
    if split == 1:                       # this thread's m, l, acc
        m = <float*>p3 + 3 * MAX_RB * KT // 2
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
    if q_packed != NULL:  # the block's queries, packed once for all its key splits
        qp = <float*>q_packed + b * _q_floats(P)
        q2 = <const uint32_t*>qp
    else:
        _pack_queries(P, q, b, qp)
    for r in range(Rp):  # each row's visible key positions, once for all the item's tiles
        if r < R:
            t = t0 + r // group
            lo_abs[r], hi_abs[r] = <int32_t>_lo(P, t), <int32_t>_hi(P, t)
            lo_top, hi_bot = max(lo_top, lo_abs[r]), min(hi_bot, hi_abs[r])
        else:
            lo_abs[r], hi_abs[r] = <int32_t>hi_max + 1, -1
    if P.amx:
        att_amx_begin()

    for tile in range(s * n_tiles // split, (s + 1) * n_tiles // split):
        j0 = lo_min + tile * KT
        kn = min(<Py_ssize_t>KT, hi_max + 1 - j0)
        if P.direct:
            _direct_tile(P, j0, kn, qp, sc, m, l, acc, lo_abs, hi_abs)
            continue
        # a whole tile of float32 keys in one source: its K rows read in place
        tile_in_place = k_in_place and kn == KT and (j0 + KT <= P.T1 or j0 >= P.T1) \
            and not (P.bf1 if j0 < P.T1 else P.bf2)
        for g in range(H):
            qg, mg, lg, ag = qp + g * Rp * D, m + g * Rp, l + g * Rp, acc + g * Rp * Dp
            if tile_in_place:
                kin, ldk = <const float*>_row_ptr(P, 0, g, j0, &bf), H * D
                _load_tile(P, g, j0, kn, NULL, vt)
            else:
                _load_tile(P, g, j0, kn, kt, vt)
                kin, ldk = kt, D
            # the next (head, tile) to load: spread its prefetch over this head's row blocks
            g_pf, j_pf = g + 1, j0
            if g + 1 == H:
                g_pf, j_pf = 0, j0 + KT
                if tile + 1 == (s + 1) * n_tiles // split:
                    j_pf = hi_max + 1  # this item's last tile: nothing to prefetch
            if P.fma:
                _fma_tile(P, R, j0, kn, qg, kin, ldk, vt, sc, mg, lg, ag, lo_abs, hi_abs,
                          j0 < lo_top or j0 + KT - 1 > hi_bot,
                          alpha_r, g_pf, j_pf, min(j_pf + KT, hi_max + 1))
                continue
            pf_per_block = (KT + Rp // P.rb - 1) // (Rp // P.rb)
            # bf16 pair words (vdpbf16ps, AMX), per block of P.rb query rows (8, or 16 on AMX): S =
            # Q K^T, masked online softmax, P packed as pair words, acc += P V (the block's scores
            # stay in L1 between the steps; kt and vt are streamed)
            for r0 in range(Rp // P.rb):
                if j_pf <= hi_max:
                    _prefetch_keys(P, g_pf, j_pf + r0 * pf_per_block,
                                   min(j_pf + (r0 + 1) * pf_per_block, hi_max + 1))
                if P.amx:
                    dk_qk_amx(P.nparts, q2 + (g * Rp + r0 * P.rb) * (D // 2), q_pstride, D // 2, <uint32_t*>kt, KT,
                              sc + r0 * P.rb * KT, KT)
                for c0 in range(0 if P.amx else KT // DK_CB):
                    dk_qk2_block(P.rb, q2 + (g * Rp + r0 * P.rb) * (D // 2), D // 2, <uint32_t*>kt + c0 * DK_CB,
                                 KT, sc + r0 * P.rb * KT + c0 * DK_CB, KT)
                dk_softmax_rows(P.rb, sc + r0 * P.rb * KT, KT, <int32_t>j0, lo_abs + r0 * P.rb, hi_abs + r0 * P.rb,
                                mg + r0 * P.rb, lg + r0 * P.rb, alpha)
                if P.nparts == 3:  # P's rows as three parts of KT / 2 pair words each, exact
                    for r in range(P.rb):
                        att_split(sc + (r0 * P.rb + r) * KT, KT, 3, <uint16_t*>(p3 + r * (KT // 2)),
                                  <uint16_t*>(p3 + (P.rb + r) * (KT // 2)), <uint16_t*>(p3 + (2 * P.rb + r) * (KT // 2)))
                else:
                    for r in range(r0 * P.rb, r0 * P.rb + P.rb):  # P's rows as KT / 2 pair words at their starts
                        dk_att_bf16_inplace(sc + r * KT, KT)       # (l kept the unrounded sums)
                dk_rescale_rows(P.rb, ag + r0 * P.rb * Dp, Dp, Dp, alpha)
                if P.amx and P.nparts == 3:
                    dk_pv_amx(3, p3, KT // 2, P.rb * (KT // 2), <const uint32_t*>vt, Dp, ag + r0 * P.rb * Dp, Dp, Dp)
                elif P.amx:
                    dk_pv_amx(1, <uint32_t*>sc + r0 * P.rb * KT, KT, 0, <const uint32_t*>vt, Dp, ag + r0 * P.rb * Dp,
                              Dp, Dp)
                for c0 in range(0 if P.amx else Dp // DK_CB):
                    dk_pv2_block(P.rb, <uint32_t*>sc + r0 * P.rb * KT, KT, (kn + 1) // 2,
                                 <const uint32_t*>vt + c0 * DK_CB, Dp, ag + r0 * P.rb * Dp + c0 * DK_CB, Dp)
    if P.amx:
        att_amx_end()

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


cdef void _problem_init(Problem* P, const void* k1, const void* v1, int bf1, Py_ssize_t T1, const void* k2,
                        const void* v2, int bf2, Py_ssize_t T2, Py_ssize_t T_q, Py_ssize_t H_q,
                        Py_ssize_t H_kv, Py_ssize_t D, Py_ssize_t q_off, Py_ssize_t window, int causal,
                        float scale, int parts, int bf16dot, int amx) noexcept nogil:
    """Fill P: queries (T_q, H_q, D) at positions q_off.., keys [source 1 | source 2], each (T, H_kv, D)
    float32 (bf = 0) or bf16 bits; window 0: none. The work split follows from the shape alone.
    parts: the precision's bf16 parts (1: "medium"); bf16dot: vdpbf16ps pays on this CPU (the
    dense module's measured rule: twice the FMA rate on Zen 4, half on Sapphire Rapids); amx: AMX
    tiles are enabled and granted (dense.amx_available)."""
    P.k1, P.v1, P.k2, P.v2 = k1, v1, k2, v2
    P.bf1, P.bf2 = bf1, bf2
    P.T1, P.T2 = T1, T2
    P.T_q, P.H_q, P.D = T_q, H_q, D
    P.H_kv = H_kv
    P.group = H_q // H_kv
    P.Dp = (D + DK_CB - 1) // DK_CB * DK_CB
    P.q_off = q_off
    P.window = window
    P.causal = causal
    P.scale = scale
    P.medium = parts == 1  # "high" (2 parts) computes as "highest": exact operands
    P.qb_t = max(1, QROWS // P.group)
    P.n_qb = (T_q + P.qb_t - 1) // P.qb_t
    P.rows = min(P.qb_t, T_q) * P.group
    # the decode path: its kernels take 2 or 4 rows and D in whole groups of vectors (dk_attention.h);
    # at "medium" they run FMA on the rounded operands, as the FMA tiers' tiles do
    P.direct = P.rows <= RB_SMALL and D % DIRECT_D == 0
    P.amx = ATT_AMX and amx and D % 32 == 0 and not P.direct and (
        P.medium or ((bf1 or T1 == 0) and (bf2 or T2 == 0)))  # "highest": exact parts need bf16 K and V
    P.nparts = 3 if P.amx and not P.medium else 1
    P.dot = (P.amx or (P.medium and ATT_DOT and bf16dot and D % 2 == 0)) and not P.direct
    P.fma = not P.direct and not P.dot
    P.rb = RB_BIG
    if P.amx:
        P.rb = 16  # one tile of rows
    if P.direct:
        P.rb = 2 if P.rows <= 2 else RB_SMALL
    if P.fma:
        P.rb = W   # whole vectors of rows (the row blocks of P V are chosen per tile)
    P.rows = (P.rows + P.rb - 1) // P.rb * P.rb
    P.split = 1
    if P.n_qb < SPLIT_ITEMS:
        P.split = max(1, min((SPLIT_ITEMS + P.n_qb - 1) // P.n_qb, (T1 + T2) // SPLIT_MIN_KEYS))


cdef int _attend_rows(const Problem* Ps, Py_ssize_t T, const float* q, Py_ssize_t q_stride, float* out,
                      int n_threads) noexcept nogil:
    """Problems Ps[0:T] of one query row each (their queries at q + t q_stride, outputs at out + t
    q_stride) in one parallel region, each row by one thread: a row's result does not depend on the
    thread count (the work split follows from the shape alone), and a parallel region and its
    allocations per row cost more than a short row's attention (SmolLM2's verification rows: about
    10 us a row and layer). -1 when out of memory."""
    cdef Py_ssize_t t
    cdef int rc = 0
    cdef int nth = <int>min(<Py_ssize_t>max(1, n_threads), T)
    for t in prange(T, num_threads=nth, schedule="dynamic"):
        rc |= _attend_run(&Ps[t], q + t * q_stride, out + t * q_stride, 1)
    return rc


cdef int _attend_run(const Problem* P, const float* q, float* out, int n_threads) noexcept nogil:
    """out (T_q, H_q, D) = attention of q (T_q, H_q, D, contiguous) over P's keys; -1 when out of
    memory (nothing written)."""
    cdef Py_ssize_t n_items = P.n_qb * P.split, it, u
    cdef Py_ssize_t n_part = n_items * P.H_kv * P.rows
    cdef float* pm = NULL
    cdef float* pl = NULL
    cdef float* pacc = NULL
    if P.split > 1:  # per-item partials (m, l, acc), merged in split order
        pm = <float*>malloc(n_part * sizeof(float))
        pl = <float*>malloc(n_part * sizeof(float))
        pacc = <float*>malloc(n_part * P.Dp * sizeof(float))
    cdef int nth = <int>min(<Py_ssize_t>max(1, n_threads), n_items)
    cdef Py_ssize_t n_scratch = _scratch_size(P)
    cdef float* sp = <float*>malloc(nth * n_scratch * sizeof(float))
    cdef Py_ssize_t n_pack = _q_floats(P)
    cdef float* qs = NULL  # split > 1: each query block's packed queries, shared by its key splits
    if P.split > 1:
        qs = <float*>malloc(P.n_qb * n_pack * sizeof(float))
    if sp == NULL or (P.split > 1 and (pm == NULL or pl == NULL or pacc == NULL or qs == NULL)):
        free(pm); free(pl); free(pacc); free(sp); free(qs)
        return -1
    if P.split == 1:
        for it in prange(n_items, num_threads=nth, schedule="dynamic"):
            _item(P, q, NULL, it, out, pm, pl, pacc, sp + threadid() * n_scratch)
    else:
        # one parallel region: pack each block's queries, the items, then the merges, each
        # (query block, kv head) by one thread (one thread merging a whole block's heads took 5%
        # of a verification block's attention at 2 threads: 16 splits' partials are 4 MiB there)
        with parallel(num_threads=nth):
            for it in prange(P.n_qb, schedule="static"):
                _pack_queries(P, q, it, qs + it * n_pack)
            for it in prange(n_items, schedule="dynamic"):
                _item(P, q, qs, it, out, pm, pl, pacc, sp + threadid() * n_scratch)
            for u in prange(P.n_qb * P.H_kv, schedule="static"):
                _merge(P, u, out, pm, pl, pacc)
    free(pm); free(pl); free(pacc); free(sp); free(qs)
    return 0
