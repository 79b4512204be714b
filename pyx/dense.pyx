# cython: language_level=3
"""Cython kernels for the dense ops: linear (fp32 / bf16 weights), RMSNorm, RoPE, SwiGLU.

The inner loops live in C headers: dk_dense.h (FMA paths, GCC vector extensions: 8-float ymm on
the avx2 tier, 16-float zmm from avx512), dk_bf16dot.h (activation parts for the matmul precisions,
and the vdpbf16ps path of the avx512_bf16 and amx tiers) and dk_amx.h (AMX-BF16 tiles). setup.py
compiles this module once per tier; DK_TIER names the one this copy was built for. The Cython
functions validate nothing (the public wrappers do), split the work over OpenMP threads and own the
per-thread scratch. Every output element is computed by one thread in a fixed order, so results do
not depend on n_threads.
"""

import os

from cython.parallel cimport parallel, prange
from libc.math cimport cos, pow, sin, sqrtf
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

cdef extern from "<stdlib.h>" nogil:
    void *aligned_alloc(size_t alignment, size_t size)

cdef extern from "dk_threads.h" nogil:
    Py_ssize_t PARALLEL_ELEMS "DK_PARALLEL_ELEMS"
    int _threads "dk_threads"(Py_ssize_t work, Py_ssize_t per_thread, int n_threads)
    int dk_matmul_threads(Py_ssize_t M, Py_ssize_t N, Py_ssize_t K, int wbytes, int n_threads)

cdef extern from "dk_dense.h" nogil:
    int DK_MR, DK_NR, DK_KC, DK_VW
    void dk_pair_x(long M, long K, const float *x, float *xp2)
    void dk_group_direct(long M, long K, long N, long n0, long nr, int bf16, const float *x,
                         const float *xp2, const void *w, const float *bias, float *out)
    int DK_FB_NB
    long dk_fma_accbuf_floats()
    void dk_fma_block(long M, long K, long N, long nlo, long nhi, int bf16, const float *x, long ldx,
                      const void *w, const float *bias, float *out, float *wbuf, float *accbuf)
    void dk_silu_mul_row(const float *g, const float *u, float *o, long n)
    float dk_peak_fma(long iters)
    void dk_rms_norm_row(const float *x, const float *res, const float *w, float offset, float eps,
                         long h, float *o, float *new_res)
    void dk_rope_row(const float *x, const float *c, const float *s, long half, long d, float *o)

cdef extern from "dk_bf16dot.h" nogil:
    unsigned short dk_bf16_rne(unsigned int u)
    int DK_DP_BUILT, DK_DP_MR
    void dk_round_rows(long n, const float *x, int parts, float *xr)
    long dk_dp_ldx(long K)
    int dk_dp_pack(long m0, long mb, long M, long K, const float *x, int parts, unsigned short *xb)
    int DK_DP_NB
    long dk_dp_spill_bytes()
    float dk_peak_dp(long iters)
    void dk_dp_gemv(long M, long K, long N, long n0, long nr, int parts, const unsigned short *xb,
                    const unsigned short *w, const float *bias, float *out)
    void dk_dp_block(long M, long K, long N, long nlo, long nhi, int parts, const unsigned short *xb,
                     const unsigned short *w, const float *bias, float *out, void *spill)

cdef extern from "dk_packed.h" nogil:
    int DK_PK_NV, DK_PK_COLS
    long dk_pk_group(long M)
    long dk_pk_panel_elems(long K, int bf16)
    void dk_pk_run(long M, long K, long N, long plo, long phi, int bf16, const float *x, long ldx,
                   const void *P, const float *bias, float *out)
    long dk_pk_kpad(long K)
    long dk_pk_amx_rows(long M)
    int dk_pk_amx_split(long m0, long m1, long M, long K, const float *x, long ldx, int parts,
                        int tiled, unsigned short *xb)
    void dk_pk_amx_run(long M, long K, long N, long plo, long phi, int parts, const unsigned short *xb,
                   const unsigned short *P, const float *bias, float *out)
    void dk_pkdp_run(long M, long K, long N, long plo, long phi, int parts, const unsigned short *xb,
                     const unsigned short *P, const float *bias, float *out)

cdef extern from "dk_quant.h" nogil:
    int DK_Q4, DK_Q8, DK_Q4X, DK_Q8X
    long dk_q_group(long M)
    long dk_qx_group(long M)
    void dk_qx_quantize(long M, long K, const float *x, long ldx, int flip, signed char *xq, float *dx, float *sx)
    void dk_qx_run(long M, long K, long N, long plo, long phi, int fmt, const signed char *xq, const float *dx,
                   const float *sx, const unsigned char *P, const float *bias, float *out)
    long dk_q_panel_bytes(long K, int fmt)
    void dk_q_run(long M, long K, long N, long plo, long phi, int fmt, const float *x, long ldx,
                  const unsigned char *P, const float *bias, float *out)

cdef extern from "dk_amx.h" nogil:
    int DK_AMX_BUILT, DK_AMX_GROUP, DK_AMX_KB, DK_AMX_MB
    int dk_amx_ready()
    void dk_amx_begin()
    void dk_amx_end()
    float dk_peak_amx(long iters)
    long dk_amx_xsize(long M, long K, int parts)
    int dk_amx_pack_block(long mb, long M, long K, const float *x, long ldx, int parts, unsigned short *xb)
    long dk_amx_head(const unsigned short *w)
    void dk_amx_permute_x(long M, long K, long h, const float *x, float *xp)
    void dk_amx_group(long M, long K, long N, long n0, int parts, const unsigned short *xb,
                      const unsigned short *w, const float *bias, float *out, float *cacc,
                      unsigned short *w0)

cdef extern from *:
    """
    #ifndef DK_TIER
    #define DK_TIER "unknown"
    #endif
    """
    const char *DK_TIER


ctypedef fused wtype:
    float
    unsigned short  # bf16 bit patterns

ctypedef unsigned char gguf_byte

ctypedef fused ptype:  # a packed weight (linear_packed, the fused layers)
    float
    unsigned short  # bf16 bit patterns
    gguf_byte       # GGUF blocks (dk_quant.h), the format given apart

# Below this much work (multiply-adds / elements) one thread beats waking the OpenMP pool.


# DFLASH_AMX=0 turns the AMX path off (benchmarks compare it with the other paths in one process).
cdef int _amx_enabled = os.environ.get("DFLASH_AMX", "1") != "0"

TIER = DK_TIER.decode()

# linear's paths, as recorded in _last_path and named by path_name()
cdef enum:
    PATH_FMA_GEMV = 0     # M <= DK_MR: read-once GEMV on FMA (bf16 pairs upcast without a shuffle)
    PATH_FMA_BLOCK = 1    # larger M: K-chunked register tiles on FMA
    PATH_BF16DOT = 2      # vdpbf16ps over packed activation parts (precision "high" / "medium")
    PATH_AMX = 3          # AMX-BF16 tiles
    PATH_FMA_PACKED = 4   # weights packed at load (dk_packed.h): broadcast register tiles on FMA
    PATH_AMX_PACKED = 5   # weights packed at load: AMX tiles (M > DK_MR, bf16)
    PATH_BF16DOT_PACKED = 6  # weights packed at load: vdpbf16ps tiles ("high" / "medium", where it pays)
    PATH_FMA_QUANT = 7    # GGUF blocks in panels (dk_quant.h): expanded in registers, FMA tiles
    PATH_INT8_QUANT = 8   # blocks times int8 activations (dk_quant.h, DK_Q4X / DK_Q8X): integer dot products
_PATH_NAMES = ("fma-gemv", "fma-blocked", "bf16dot", "amx", "fma-packed", "amx-packed", "bf16dot-packed",
               "fma-quant", "int8-quant")
cdef int _last_path = -1


# vdpbf16ps does 32 multiply-adds per instruction, but its throughput differs by CPU: on Zen 4 it
# issues like an FMA (twice the FMA path's rate), on Sapphire Rapids at half the rate of an FMA
# (measured with peak_gflops: 120 against 240 GFLOP/s per core), where AMX is the bf16 engine.
# So the bf16dot path is taken only where a register-only loop shows it ahead of FMA by 20%,
# measured once per process (~20 ms) on the first call that could use it. set_bf16dot_enabled()
# forces it on or off (tests, benchmarks).
cdef int _dp_pays = -1  # -1: not measured yet


def set_bf16dot_enabled(enabled):
    """Force the vdpbf16ps path on (True) or off (False), or None to decide by measured peak rates.
    Returns the previous setting (None when undecided)."""
    global _dp_pays
    old = None if _dp_pays < 0 else bool(_dp_pays)
    _dp_pays = -1 if enabled is None else int(bool(enabled))
    return old


def bf16dot_pays():
    """Whether linear takes the vdpbf16ps path for "high" / "medium" on this CPU (measures once)."""
    global _dp_pays
    if not DK_DP_BUILT:
        return False
    if _dp_pays < 0:
        _dp_pays = int(peak_gflops("bf16dot", 1, 0.01) > 1.2 * peak_gflops("fma", 1, 0.01))
    return bool(_dp_pays)


def amx_available():
    """True when linear runs bf16-weight blocks (M > 4 rows) on AMX tiles here."""
    return bool(_amx_enabled and DK_AMX_BUILT and dk_amx_ready())


def bf16dot_available():
    """True when this tier has vdpbf16ps (AVX512-BF16) for the "high" / "medium" precisions."""
    return bool(DK_DP_BUILT)


def set_amx_enabled(enabled):
    """Turn the AMX path on or off for this process (benchmarks); returns the previous setting."""
    global _amx_enabled
    old = bool(_amx_enabled)
    _amx_enabled = bool(enabled)
    return old


cdef int _choose_path(Py_ssize_t M, Py_ssize_t K, Py_ssize_t N, bint bf16, int parts) noexcept nogil:
    """The path linear takes for these operands (the remainder of an AMX call, N % 32 columns, runs
    on the FMA paths)."""
    if bf16 and M > DK_MR and _amx_enabled and DK_AMX_BUILT and K % DK_AMX_KB == 0 \
            and N >= DK_AMX_GROUP and dk_amx_ready():
        return PATH_AMX
    if bf16 and DK_DP_BUILT and parts < 3 and _dp_pays == 1:
        return PATH_BF16DOT
    return PATH_FMA_GEMV if M <= DK_MR else PATH_FMA_BLOCK


cdef int _choose_packed_path(Py_ssize_t M, bint bf16, int parts) noexcept nogil:
    """The path linear_packed takes (x without inf / NaN): AMX tiles for bf16 blocks where the CPU
    has them, vdpbf16ps for "high" / "medium" where it measured ahead of FMA, else the FMA tiles."""
    if bf16 and M > DK_MR and _amx_enabled and DK_AMX_BUILT and dk_amx_ready():
        return PATH_AMX_PACKED
    if bf16 and parts < 3 and DK_DP_BUILT and _dp_pays == 1:
        return PATH_BF16DOT_PACKED
    return PATH_FMA_PACKED


def packed_path_name(Py_ssize_t M, int bf16, int parts=3):
    """"<tier>:<path>" that linear_packed takes for M rows and `parts` activation parts; bf16: the
    weight format (0 float32, 1 bf16, DK_Q4 / DK_Q8: GGUF blocks, always the quantized FMA tiles)."""
    if bf16 >= DK_Q4:
        return f"{TIER}:{_PATH_NAMES[PATH_INT8_QUANT if bf16 >= DK_Q4X else PATH_FMA_QUANT]}"
    if bf16 and parts < 3:
        bf16dot_pays()
    return f"{TIER}:{_PATH_NAMES[_choose_packed_path(M, bf16, parts)]}"


def path_name(Py_ssize_t M, Py_ssize_t K, Py_ssize_t N, bint bf16, int parts=3):
    """"<tier>:<path>" that linear takes for x (M, K), weight (N, K) and `parts` activation parts."""
    if bf16 and parts < 3:
        bf16dot_pays()
    return f"{TIER}:{_PATH_NAMES[_choose_path(M, K, N, bf16, parts)]}"


def last_path():
    """"<tier>:<path>" of the last linear call in this process that reached this module."""
    return f"{TIER}:{_PATH_NAMES[_last_path]}" if _last_path >= 0 else None


def peak_gflops(kind="fma", int n_threads=1, double seconds=0.2):
    """GFLOP/s of a register-only loop on this tier: "fma" (DK_VW-float FMAs), "bf16dot"
    (vdpbf16ps) or "amx" (TDPBF16PS tiles), run on n_threads threads at once; 0 where the tier or
    the CPU lacks the instruction. The ceiling that benchmarks quote next to the kernels' rates."""
    from time import perf_counter
    cdef long iters = 1 << 16, t
    cdef int dp = kind == "bf16dot", amx = kind == "amx"
    cdef double flops_per_iter = 4 * 2.0 * 16 * 16 * 32 if amx else (64.0 * 12 if dp else 2.0 * DK_VW * 12)
    cdef double elapsed = 0.0
    cdef float sink = 0.0  # the loops' results are used, so the compiler keeps them
    if kind not in ("fma", "bf16dot", "amx"):
        raise ValueError(f"kind must be 'fma', 'bf16dot' or 'amx', got {kind!r}")
    if (dp and not DK_DP_BUILT) or (amx and not amx_available()):
        return 0.0
    if amx:
        iters = 1 << 10
    while True:
        start = perf_counter()
        for t in prange(n_threads, nogil=True, num_threads=n_threads, schedule="static"):
            if amx:
                sink += dk_peak_amx(iters)
            elif dp:
                sink += dk_peak_dp(iters)
            else:
                sink += dk_peak_fma(iters)
        elapsed = perf_counter() - start
        if elapsed >= seconds and sink == sink:
            return flops_per_iter * iters * n_threads / elapsed / 1e9
        iters *= 2


cdef int _linear_amx(const float *xp, const unsigned short *wp, const float *bp, float *op, Py_ssize_t M,
                     Py_ssize_t K, Py_ssize_t N, int parts, int nt):
    """AMX part of linear (see dk_amx.h): output columns [0, N - N % 32); returns how many were done."""
    cdef Py_ssize_t g, m, finite = 0
    cdef unsigned short *xb
    cdef Py_ssize_t nmb = (M + DK_AMX_MB - 1) // DK_AMX_MB
    cdef Py_ssize_t h = dk_amx_head(wp)
    cdef float *xperm = NULL
    xb = <unsigned short *> malloc(dk_amx_xsize(M, K, parts) * sizeof(unsigned short))
    if xb == NULL:
        return 0
    if h:  # weights off a 64-byte boundary: K steps start at it (dk_amx.h), x packed to match
        xperm = <float *> malloc(M * K * sizeof(float))
        if xperm == NULL:
            free(xb)
            return 0
        dk_amx_permute_x(M, K, h, xp, xperm)
        xp = xperm
    for m in prange(nmb, nogil=True, num_threads=min(nt, nmb)):
        finite += dk_amx_pack_block(m, M, K, xp, K, parts, xb)
    free(xperm)
    if finite != nmb:  # inf / NaN in x
        free(xb)
        return 0
    cdef float *cacc
    cdef unsigned short *w0
    with nogil, parallel(num_threads=nt):
        cacc = <float *> malloc(nmb * 2 * 256 * sizeof(float))
        w0 = <unsigned short *> aligned_alloc(64, DK_AMX_GROUP * DK_AMX_KB * sizeof(unsigned short))
        dk_amx_begin()
        # static: a contiguous run of groups per thread, one stream for the hardware prefetchers
        for g in prange(N // DK_AMX_GROUP, schedule="static"):
            dk_amx_group(M, K, N, g * DK_AMX_GROUP, parts, xb, wp, bp, op, cacc, w0)
        dk_amx_end()
        free(cacc)
        free(w0)
    free(xb)
    return N // DK_AMX_GROUP * DK_AMX_GROUP


cdef int _linear_bf16dot(const float *xp, const unsigned short *wp, const float *bp, float *op, Py_ssize_t M,
                         Py_ssize_t K, Py_ssize_t N, int parts, int nt):
    """vdpbf16ps path (see dk_bf16dot.h); returns 0 (nothing done) when x holds inf / NaN."""
    cdef Py_ssize_t ldx = dk_dp_ldx(K), ngroups = (N + 3) // 4, g, n0, b, m0, mb, i, finite = 0
    cdef unsigned short *xb = <unsigned short *> malloc(parts * M * ldx * sizeof(unsigned short))
    if xb == NULL:
        raise MemoryError()
    for i in prange(M, nogil=True, num_threads=_threads(M * K, PARALLEL_ELEMS, nt)):
        finite += dk_dp_pack(i, 1, M, K, xp, parts, xb)
    if finite != M:
        free(xb)
        return 0
    cdef void *spill
    if M <= DK_DP_MR:  # memory bound: weight rows split over threads, each read once (see linear)
        for g in prange(ngroups, nogil=True, num_threads=nt, schedule="guided", chunksize=8):
            n0 = g * 4
            dk_dp_gemv(M, K, N, n0, min(<Py_ssize_t> 4, N - n0), parts, xb, wp, bp, op)
    else:
        with nogil, parallel(num_threads=nt):
            spill = aligned_alloc(64, dk_dp_spill_bytes())
            for b in prange((N + DK_DP_NB - 1) // DK_DP_NB, schedule="dynamic"):
                dk_dp_block(M, K, N, b * DK_DP_NB, min(N, (b + 1) * DK_DP_NB), parts, xb, wp, bp, op, spill)
            free(spill)
    free(xb)
    return 1


def linear(const float[:, ::1] x, const wtype[:, ::1] weight, const float[::1] bias, float[:, ::1] out,
           *, int n_threads, int parts=3):
    """out (M, N) = round(x (M, K), parts) @ weight (N, K)^T + bias (N,); weight fp32 or bf16 (uint16).

    parts: the activations' bf16 parts (3: exact, "highest"; 2: "high"; 1: "medium"), dk_bf16dot.h.
    """
    global _last_path
    cdef Py_ssize_t M = x.shape[0], K = x.shape[1], N = weight.shape[0]
    cdef Py_ssize_t ngroups = (N + DK_NR - 1) // DK_NR, g, n0, b, m0, mb
    cdef int bf16 = 0 if wtype is float else 1
    cdef const float *xp = &x[0, 0]
    cdef const void *wp = <const void *> &weight[0, 0]
    cdef const float *bp = NULL if bias is None else &bias[0]
    cdef float *op = &out[0, 0]
    cdef float *wbuf
    cdef float *accbuf
    cdef float *xp2
    cdef float *xr = NULL
    cdef float *xpad
    cdef Py_ssize_t ldx, m, n_lo
    cdef int nt = dk_matmul_threads(M, N, K, 2 if bf16 else 4, n_threads)
    cdef Py_ssize_t g0 = 0  # first column group left to the FMA paths
    if bf16 and parts < 3 and _dp_pays < 0:
        bf16dot_pays()
    cdef int path = _choose_path(M, K, N, bf16, parts)
    _last_path = path
    if path == PATH_AMX:
        g0 = _linear_amx(xp, <const unsigned short *> wp, bp, op, M, K, N, parts, nt) // DK_NR
        if g0 == ngroups:
            return
    elif path == PATH_BF16DOT:
        if _linear_bf16dot(xp, <const unsigned short *> wp, bp, op, M, K, N, parts, nt):
            return
    if parts < 3:  # the FMA paths compute exact products: give them the rounded activations
        xr = <float *> malloc(M * K * sizeof(float))
        if xr == NULL:
            raise MemoryError()
        with nogil:
            dk_round_rows(M * K, xp, parts, xr)
        xp = xr
    try:
        if M <= DK_MR:
            # Memory bound: weight rows split over threads, each read once with x in registers/L1.
            # Guided chunks: long contiguous runs per thread first (28.2 GB/s from DRAM over 1 GB of
            # Qwen3-1.7B layer weights, against 26.6 with dynamic 32-row chunks; stream read 34.5),
            # then small ones that keep both threads busy on a shared, noisy machine. Every output is
            # computed by one thread in a fixed order, so the result does not depend on the schedule.
            xp2 = NULL
            if bf16:
                xp2 = <float *> malloc(M * K * sizeof(float))
                if xp2 == NULL:
                    raise MemoryError()
                dk_pair_x(M, K, xp, xp2)
            for g in prange(ngroups, nogil=True, num_threads=nt, schedule="guided", chunksize=8):
                n0 = g * DK_NR
                dk_group_direct(M, K, N, n0, min(<Py_ssize_t> DK_NR, N - n0), bf16, xp, xp2, wp, bp, op)
            free(xp2)
            return
        # Compute bound: blocks of DK_FB_NB weight rows split over threads (dk_fma_block). x is copied
        # once with a padded row stride: (M, ldx); ldx = K rounded up to 16 floats plus 16, so a
        # 4 KiB-multiple row stride (K = 1024, 4096, ...) gets 64 bytes more.
        ldx = (K + 15) // 16 * 16 + 16
        xpad = <float *> malloc(M * ldx * sizeof(float))
        if xpad == NULL:
            raise MemoryError()
        for m in range(M):
            memcpy(&xpad[m * ldx], &xp[m * K], K * sizeof(float))
        n_lo = g0 * DK_NR  # columns an AMX call left (N % 32), else 0
        with nogil, parallel(num_threads=nt):
            wbuf = <float *> aligned_alloc(64, DK_NR * DK_KC * sizeof(float))
            accbuf = <float *> aligned_alloc(64, dk_fma_accbuf_floats() * sizeof(float))
            for b in prange((N - n_lo + DK_FB_NB - 1) // DK_FB_NB, schedule="dynamic"):
                dk_fma_block(M, K, N, n_lo + b * DK_FB_NB, min(N, n_lo + (b + 1) * DK_FB_NB), bf16, xpad, ldx,
                             wp, bp, op, wbuf, accbuf)
            free(wbuf)
            free(accbuf)
        free(xpad)
    finally:
        free(xr)


cdef unsigned short *_split_x(const float *xp, Py_ssize_t M, Py_ssize_t K, int parts, int tiled,
                              int nt) except? NULL:
    """x split into its bf16 parts for the AMX / vdpbf16ps tiles (dk_pk_amx_split; tiled: as AMX A
    tiles). NULL (no exception) when x holds inf / NaN: the caller takes the FMA tiles."""
    cdef Py_ssize_t rows = dk_pk_amx_rows(M), nblk = rows // 16, b, finite = 0
    cdef unsigned short *xb = <unsigned short *> aligned_alloc(
        64, (parts * rows * dk_pk_kpad(K) * sizeof(unsigned short) + 63) // 64 * 64)
    if xb == NULL:
        raise MemoryError()
    for b in prange(nblk, nogil=True, num_threads=min(nt, nblk)):
        finite += dk_pk_amx_split(b * 16, b * 16 + 16, M, K, xp, K, parts, tiled, xb)
    if finite != nblk:
        free(xb)
        return NULL
    return xb


cdef int _linear_packed_amx(const float *xp, const unsigned short *P, const float *bp, float *op,
                            Py_ssize_t M, Py_ssize_t K, Py_ssize_t N, int parts, int nt) except -1:
    """amx-packed path (dk_packed.h); returns 0 (nothing done) when x holds inf / NaN."""
    cdef Py_ssize_t t, npanels = (N + DK_PK_COLS - 1) // DK_PK_COLS, npairs = (npanels + 1) // 2
    cdef int nth = min(nt, npairs)
    cdef unsigned short *xb = _split_x(xp, M, K, parts, 1, nt)
    if xb == NULL:
        return 0
    # a contiguous run of panel pairs per thread, each panel one stream
    for t in prange(nth, nogil=True, num_threads=nth, schedule="static"):
        dk_amx_begin()
        dk_pk_amx_run(M, K, N, 2 * (npairs * t // nth), min(npanels, 2 * (npairs * (t + 1) // nth)), parts, xb,
                      P, bp, op)
        dk_amx_end()
    free(xb)
    return 1


cdef int _linear_packed_bf16dot(const float *xp, const unsigned short *P, const float *bp, float *op,
                                Py_ssize_t M, Py_ssize_t K, Py_ssize_t N, int parts, int nt) except -1:
    """bf16dot-packed path (dk_packed.h); returns 0 (nothing done) when x holds inf / NaN."""
    cdef Py_ssize_t g, npanels = (N + DK_PK_COLS - 1) // DK_PK_COLS
    cdef Py_ssize_t ngroups = (npanels + DK_PK_NV - 1) // DK_PK_NV
    cdef unsigned short *xb = _split_x(xp, M, K, parts, 0, nt)
    if xb == NULL:
        return 0
    for g in prange(ngroups, nogil=True, num_threads=min(nt, ngroups), schedule="static"):
        dk_pkdp_run(M, K, N, g * DK_PK_NV, min(npanels, (g + 1) * DK_PK_NV), parts, xb, P, bp, op)
    free(xb)
    return 1


def linear_packed(const float[:, ::1] x, const ptype[::1] packed, const float[::1] bias, float[:, ::1] out,
                  *, int n_threads, int parts=3, bint weights_finite=True, int quant=0):
    """out (M, N) = round(x (M, K), parts) @ W^T + bias, W (N, K) given packed (dk_packed.h: ceil(N/16)
    panels of dk_pk_panel_elems(K) values, fp32 or bf16 bit patterns; or bytes of GGUF blocks,
    dk_quant.h, of format quant: DK_Q4, DK_Q8, or DK_Q4X / DK_Q8X: times int8 activations). N is
    out's width.

    weights_finite=False (W holds inf or NaN; PackedWeight.finite) keeps to the FMA tiles: the AMX
    and vdpbf16ps tiles multiply every activation part, and a part that is 0 times an infinite
    weight gives NaN where x * inf is +-inf."""
    cdef Py_ssize_t M = x.shape[0], K = x.shape[1], N = out.shape[1]
    cdef int bf16 = 0 if ptype is float else (quant if ptype is gguf_byte else 1)
    cdef Py_ssize_t npanels = (N + DK_PK_COLS - 1) // DK_PK_COLS
    if ptype is gguf_byte and (quant not in (DK_Q4, DK_Q8, DK_Q4X, DK_Q8X) or K % 32):
        raise ValueError(f"linear_packed: quant must be {DK_Q4} (Q4), {DK_Q8} (Q8), {DK_Q4X} (Q4 x int8) or {DK_Q8X} "
                         f"(Q8 x int8) with K a multiple of 32, got {quant} and K = {K}")
    if packed.shape[0] != npanels * _panel_size(K, bf16) or out.shape[0] != M \
            or (bias is not None and bias.shape[0] != N):
        raise ValueError(f"linear_packed: packed weight of {packed.shape[0]} values does not fit x {(M, K)}, "
                         f"out {(out.shape[0], N)}")
    if M == 0 or N == 0:
        return
    _linear_packed_run(&x[0, 0] if K else NULL, M, K, N, &packed[0] if packed.shape[0] else NULL, bf16,
                       NULL if bias is None else &bias[0], &out[0, 0], n_threads, parts, weights_finite)


cdef inline Py_ssize_t _panel_size(Py_ssize_t K, int fmt) noexcept nogil:
    """Elements (bytes for GGUF blocks) of one packed panel of K."""
    return dk_q_panel_bytes(K, fmt) if fmt >= DK_Q4 else dk_pk_panel_elems(K, fmt)


cdef int _linear_packed_run(const float *xp, Py_ssize_t M, Py_ssize_t K, Py_ssize_t N, const void *wp, int bf16,
                            const float *bp, float *op, int n_threads, int parts, bint weights_finite) except -1:
    """linear_packed on raw pointers (x C-contiguous, M, N > 0): linear_packed and the fused layers.
    bf16: the weight format, 0 float32, 1 bf16, DK_Q4 / DK_Q8 / DK_Q4X / DK_Q8X GGUF blocks (K a multiple of 32)."""
    global _last_path
    cdef Py_ssize_t m, g
    cdef Py_ssize_t npanels = (N + DK_PK_COLS - 1) // DK_PK_COLS
    cdef Py_ssize_t gp = dk_qx_group(M) if bf16 >= DK_Q4X else (dk_q_group(M) if bf16 >= DK_Q4 else dk_pk_group(M))
    cdef Py_ssize_t ngroups = (npanels + gp - 1) // gp
    cdef bint quant = bf16 >= DK_Q4  # GGUF blocks: always the quantized FMA tiles (dk_quant.h)
    _last_path = PATH_FMA_QUANT if quant else PATH_FMA_PACKED
    if K == 0:  # an empty sum: only the bias is left
        for m in range(M):
            for g in range(N):
                op[m * N + g] = 0.0 if bp == NULL else bp[g]
        return 0
    cdef int nt = dk_matmul_threads(M, N, K, 1 if quant else (2 if bf16 else 4), n_threads)
    if bf16 == 1 and parts < 3 and _dp_pays < 0:
        bf16dot_pays()
    cdef int path = _last_path  # GGUF blocks, or weights not finite: the FMA tiles
    if weights_finite and not quant:
        path = _choose_packed_path(M, bf16 == 1, parts)
    _last_path = path
    if path == PATH_AMX_PACKED:
        if _linear_packed_amx(xp, <const unsigned short *> wp, bp, op, M, K, N, parts, nt):
            return 0
    elif path == PATH_BF16DOT_PACKED:
        if _linear_packed_bf16dot(xp, <const unsigned short *> wp, bp, op, M, K, N, parts, nt):
            return 0
    if bf16 >= DK_Q4X:
        return _linear_int8_run(xp, M, K, N, bf16, <const unsigned char *> wp, bp, op, npanels, gp, nt)
    # (the FMA tiles also for inf / NaN in x: IEEE results)
    _last_path = PATH_FMA_QUANT if quant else PATH_FMA_PACKED
    # x copied once (rounded to `parts` bf16 parts, below "highest") with a padded row stride: the
    # tiles broadcast from DK_PK_MR rows at once, which a 4 KiB-multiple stride would put into one
    # L1 set.
    cdef Py_ssize_t ldx = (K + 15) // 16 * 16 + 16
    cdef float *xpad = <float *> malloc(max(M * ldx, 1) * sizeof(float))
    if xpad == NULL:
        raise MemoryError()
    with nogil:
        for m in range(M):
            if parts < 3:
                dk_round_rows(K, xp + m * K, parts, &xpad[m * ldx])
            else:
                memcpy(&xpad[m * ldx], xp + m * K, K * sizeof(float))
        # static: a contiguous run of panels per thread (one stream per panel for the prefetchers);
        # each output is computed by one thread in a fixed order whatever the split
        for g in prange(ngroups, num_threads=min(nt, ngroups), schedule="static"):
            if quant:  # bit-identical to the float32 panels of the blocks' expansion
                dk_q_run(M, K, N, g * gp, min(npanels, (g + 1) * gp), bf16, xpad, ldx, <const unsigned char *> wp,
                         bp, op)
            else:
                dk_pk_run(M, K, N, g * gp, min(npanels, (g + 1) * gp), bf16, xpad, ldx, wp, bp, op)
    free(xpad)
    return 0

cdef int _linear_int8_run(const float *xp, Py_ssize_t M, Py_ssize_t K, Py_ssize_t N, int fmt, const unsigned char *wp,
                          const float *bp, float *op, Py_ssize_t npanels, Py_ssize_t gp, int nt) except -1:
    """DK_Q4X / DK_Q8X: x quantized once (int8 per block of 32 k), then every thread's panels."""
    global _last_path
    _last_path = PATH_INT8_QUANT
    cdef Py_ssize_t g, nblk = K // 32, ngroups = (npanels + gp - 1) // gp
    cdef signed char *xq = <signed char *> malloc(M * K)
    cdef float *dx = <float *> malloc(2 * M * nblk * sizeof(float))
    if xq == NULL or dx == NULL:
        free(xq)
        free(dx)
        raise MemoryError()
    with nogil:
        dk_qx_quantize(M, K, xp, K, fmt == DK_Q8X, xq, dx, dx + M * nblk)
        for g in prange(ngroups, num_threads=min(nt, ngroups), schedule="static"):
            dk_qx_run(M, K, N, g * gp, min(npanels, (g + 1) * gp), fmt, xq, dx, dx + M * nblk, wp, bp, op)
    free(xq)
    free(dx)
    return 0


def silu_and_mul(const float[:, ::1] x, float[:, ::1] out, *, int n_threads):
    """out (M, I) = silu(x[:, :I]) * x[:, I:]."""
    cdef Py_ssize_t m, n = out.shape[1]
    cdef int nt = _threads(out.shape[0] * n, PARALLEL_ELEMS, n_threads)
    if n == 0:
        return
    for m in prange(out.shape[0], nogil=True, num_threads=nt, schedule="static"):
        dk_silu_mul_row(&x[m, 0], &x[m, n], &out[m, 0], n)


def rms_norm(const float[:, ::1] x, const float[::1] w, float[:, ::1] out, *, int n_threads, float eps,
             float offset=0.0):
    """out (M, H) = x * rsqrt(mean(x^2) + eps) * (offset + w)."""
    cdef Py_ssize_t m, h = x.shape[1]
    cdef int nt = _threads(x.shape[0] * h, PARALLEL_ELEMS, n_threads)
    for m in prange(x.shape[0], nogil=True, num_threads=nt, schedule="static"):
        dk_rms_norm_row(&x[m, 0], NULL, &w[0], offset, eps, h, &out[m, 0], NULL)


def rms_norm_residual(const float[:, ::1] x, const float[:, ::1] residual, const float[::1] w,
                      float[:, ::1] out, float[:, ::1] new_residual, *, int n_threads, float eps,
                      float offset=0.0):
    """new_residual = x + residual; out = rms_norm(new_residual)."""
    cdef Py_ssize_t m, h = x.shape[1]
    cdef int nt = _threads(x.shape[0] * h, PARALLEL_ELEMS, n_threads)
    for m in prange(x.shape[0], nogil=True, num_threads=nt, schedule="static"):
        dk_rms_norm_row(&x[m, 0], &residual[m, 0], &w[0], offset, eps, h, &out[m, 0], &new_residual[m, 0])


def apply_rope(const float[:, :, ::1] x, const long long[::1] positions, float[:, :, ::1] out, *,
               int n_threads, double theta, int rotary_dim, const double[::1] inv_freq=None):
    """out (T, H, D) = NeoX rotate-half RoPE of x over the first rotary_dim dims (out may be x);
    frequencies theta^(-2j/rotary_dim), or inv_freq (rotary_dim/2 of them: scaled RoPE) when given."""
    cdef Py_ssize_t T = x.shape[0], H = x.shape[1], D = x.shape[2], half = rotary_dim // 2
    cdef Py_ssize_t t, r
    cdef float *table = <float *> malloc(2 * T * half * sizeof(float))  # (T, 2, half): cos | sin
    cdef int nt = _threads(T * H * D, PARALLEL_ELEMS, n_threads)
    if table == NULL:
        raise MemoryError()
    try:
        with nogil:
            _rope_table(&positions[0] if T else NULL, T, half, rotary_dim, theta,
                        &inv_freq[0] if inv_freq is not None else NULL, table)
        for r in prange(T * H, nogil=True, num_threads=nt, schedule="static"):
            t = r // H
            dk_rope_row(&x[t, r % H, 0], &table[2 * t * half], &table[(2 * t + 1) * half], half, D,
                        &out[t, r % H, 0])
    finally:
        free(table)


cdef void _rope_table(const long long *positions, Py_ssize_t T, Py_ssize_t half, int rotary_dim, double theta,
                      const double *inv_freq, float *table) noexcept nogil:
    """table (T, 2, half) = cos | sin of positions[t] * frequency j: theta^(-2j/rotary_dim), or inv_freq
    (scaled RoPE) when not NULL. Angles in float64: pos * inv_freq reaches ~2.6e5 rad, where fp32
    would be off by ~1e-2."""
    cdef Py_ssize_t t, j
    cdef double angle, f
    for j in range(half):
        f = inv_freq[j] if inv_freq != NULL else pow(theta, -2.0 * j / rotary_dim)
        for t in range(T):
            angle = positions[t] * f
            table[(2 * t) * half + j] = <float> cos(angle)
            table[(2 * t + 1) * half + j] = <float> sin(angle)


# The fused decoder layers (dflash_kernels/layers.py) need linear_packed's paths and state, which live
# in this module, and the attention core, included here as in attention.pyx.
include "attention_core.pxi"
include "layers.pxi"
# and the Gated DeltaNet core, for the fused Qwen3.5 linear-attention layer
from libc.math cimport expf
from libc.stdint cimport int64_t
from libc.string cimport memset

include "gdn_core.pxi"
include "gdn_layer.pxi"
