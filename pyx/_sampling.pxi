# Per-row sampling helpers shared by pyx/acceptance.pyx and pyx/denoise.pyx (textual include).
#
# A processed logits row lives in a float32 scratch row e (V,): raw logits first, then in place the
# unnormalised filtered probabilities e_i = exp((z_i - max) / temperature) (0 where filtered out),
# with float64 sums per block of BS entries (bsum) so that an inverse-CDF draw rescans one block.
# Same algorithm, step for step, as dflash_kernels/_numba/acceptance.py.

from libc.math cimport INFINITY

cdef extern from *:
    """
    #include "dk_exp.h"
    """
    double exp_span "dk_exp_span"(float *e, long n, float m, float inv_t, float thr) nogil

ctypedef fused wtype:
    float
    unsigned short

cdef enum:
    BS = 512      # entries per float64 block sum
    STRIP = 64    # lanes of the vectorised max
    OK = 0        # status codes, as in the Numba kernels
    BAD_LOGIT = 1
    NO_FINITE = 2
    BAD_Q = 3


cdef inline void load_row(const wtype *src, float *dst, Py_ssize_t n) noexcept nogil:
    """float32 copy of a float32 or bf16 (u16 << 16, exact) row."""
    cdef Py_ssize_t i
    cdef unsigned int *u = <unsigned int *> dst
    for i in range(n):
        if wtype is float:
            dst[i] = src[i]
        else:
            u[i] = (<unsigned int> src[i]) << 16


cdef inline float row_max(const float *e, Py_ssize_t n, int *status) noexcept nogil:
    """max of e[:n]; status BAD_LOGIT on NaN or +inf, NO_FINITE when all are -inf."""
    cdef float strip[STRIP]
    cdef Py_ssize_t j, k, i
    cdef int nan = 0
    cdef float v, m = -INFINITY
    for k in range(STRIP):
        strip[k] = -INFINITY
    for j in range(n // STRIP):  # lane-wise maxima: vectorises where a scalar max chain does not
        for k in range(STRIP):
            v = e[j * STRIP + k]
            strip[k] = v if v > strip[k] else strip[k]
            nan += v != v
    for k in range(STRIP):
        m = strip[k] if strip[k] > m else m
    for i in range(n - n % STRIP, n):
        v = e[i]
        m = v if v > m else m
        nan += v != v
    if nan or m == INFINITY:
        status[0] = BAD_LOGIT
    elif m == -INFINITY:
        status[0] = NO_FINITE
    else:
        status[0] = OK
    return m


cdef inline Py_ssize_t row_argmax(const float *e, Py_ssize_t n, int *status) noexcept nogil:
    """First index of the max (NaN -> BAD_LOGIT; +inf is a valid max; all -inf -> NO_FINITE, as the
    torch reference and the sampled path raise)."""
    cdef Py_ssize_t i, arg = 0
    cdef float v, best = -INFINITY
    status[0] = OK
    for i in range(n):
        v = e[i]
        if v > best:
            best = v
            arg = i
        elif v != v:
            status[0] = BAD_LOGIT
            return 0
    if best == -INFINITY:
        status[0] = NO_FINITE
    return arg


cdef inline void _sift_down(float *heap, Py_ssize_t i, Py_ssize_t k) noexcept nogil:
    cdef float v = heap[i]
    cdef Py_ssize_t c
    while True:
        c = 2 * i + 1
        if c >= k:
            break
        if c + 1 < k and heap[c + 1] < heap[c]:
            c += 1
        if heap[c] >= v:
            break
        heap[i] = heap[c]
        i = c
    heap[i] = v


cdef inline float kth_largest(const float *e, Py_ssize_t n, Py_ssize_t k, float *heap) noexcept nogil:
    """The k-th largest of e[:n] (a min-heap of the k largest seen so far)."""
    cdef Py_ssize_t i
    for i in range(k):
        heap[i] = e[i]
    for i in range(k // 2 - 1, -1, -1):
        _sift_down(heap, i, k)
    for i in range(k, n):
        if e[i] > heap[0]:
            heap[0] = e[i]
            _sift_down(heap, 0, k)
    return heap[0]


cdef inline double exp_pass(float *e, Py_ssize_t n, float m, float inv_t, float thr, double *bsum) noexcept nogil:
    """e_i <- exp((e_i - m) * inv_t) where e_i >= thr else 0; block sums into bsum; the total."""
    cdef Py_ssize_t j
    cdef double total = 0.0
    for j in range((n + BS - 1) // BS):  # the pass in vector intrinsics (dk_exp.h)
        bsum[j] = exp_span(e + j * BS, min(n, (j + 1) * BS) - j * BS, m, inv_t, thr)
        total += bsum[j]
    return total


cdef inline double block_sums(const float *e, Py_ssize_t n, double *bsum) noexcept nogil:
    cdef Py_ssize_t j, i, hi
    cdef double acc, total = 0.0
    for j in range((n + BS - 1) // BS):
        acc = 0.0
        hi = min(n, (j + 1) * BS)
        for i in range(j * BS, hi):
            acc += e[i]
        bsum[j] = acc
        total += acc
    return total


cdef inline float mass_threshold(const float *e, Py_ssize_t n, double target, float *work) noexcept nogil:
    """Largest value t among e[:n] with sum(e_i for e_i >= t) >= target (weighted quickselect)."""
    cdef Py_ssize_t i, cnt = 0, lo, hi, gt, lt
    cdef float a, b, c, piv, v, last
    cdef double above = 0.0, g_mass, eq_mass
    for i in range(n):  # candidates: the positive weights
        if e[i] > 0:
            work[cnt] = e[i]
            cnt += 1
    lo, hi = 0, cnt
    last = work[0]
    while lo < hi:
        a, b, c = work[lo], work[(lo + hi) // 2], work[hi - 1]  # median of three pivot
        piv = max(min(a, b), min(max(a, b), c))
        gt, i, lt = lo, lo, hi  # three-way partition of work[lo:hi]: [> piv | == piv | < piv]
        g_mass = 0.0
        eq_mass = 0.0
        while i < lt:
            v = work[i]
            if v > piv:
                work[i] = work[gt]
                work[gt] = v
                gt += 1
                i += 1
                g_mass += v
            elif v < piv:
                lt -= 1
                work[i] = work[lt]
                work[lt] = v
            else:
                eq_mass += v
                i += 1
        last = piv
        if above + g_mass >= target:
            hi = gt  # the threshold lies among the greater values
        elif above + g_mass + eq_mass >= target:
            return piv
        else:
            above += g_mass + eq_mass
            lo = lt
    return last  # rounding left the target unreached: keep everything seen


cdef inline int prepare_row(float *e, Py_ssize_t n, float inv_t, Py_ssize_t top_k, double top_p,
                            double *bsum, float *work, double *total) noexcept nogil:
    """Raw logits in e -> filtered unnormalised probabilities; total into total[0]; the status."""
    cdef int status
    cdef Py_ssize_t i
    cdef float cut, thr = -INFINITY
    cdef float m = row_max(e, n, &status)
    if status != OK:
        return status
    if 0 < top_k < n:
        thr = kth_largest(e, n, top_k, work)
    total[0] = exp_pass(e, n, m, inv_t, thr, bsum)
    if top_p < 1.0:
        cut = mass_threshold(e, n, top_p * total[0], work)
        for i in range(n):
            e[i] = e[i] if e[i] >= cut else 0.0
        total[0] = block_sums(e, n, bsum)
    return OK


cdef inline Py_ssize_t sample_row(const float *e, Py_ssize_t n, const double *bsum, double total,
                                  double u) noexcept nogil:
    """Inverse CDF: first index whose running sum (index order) exceeds u * total."""
    cdef double target = u * total, acc = 0.0
    cdef Py_ssize_t j, i
    for j in range((n + BS - 1) // BS):
        if acc + bsum[j] > target:
            for i in range(j * BS, min(n, (j + 1) * BS)):
                acc += e[i]
                if acc > target:
                    return i
            break  # rounding: the block scan fell short, take the last positive weight
        acc += bsum[j]
    for i in range(n - 1, -1, -1):
        if e[i] > 0:
            return i
    return 0
