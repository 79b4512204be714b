# cython: language_level=3
"""The public ops' compiled fast path: every check a public op makes, in C, for the common call.

A public op costs its kernel plus the API layer: checking and converting the operands, reading the
settings (environment, ISA cap, precision, tuning table), allocating the outputs. In Python that layer
took 3-16 us per call on Zen 2, more than a decode step's small kernels themselves
(bench/validation_cost.py). ``Fast`` makes the same checks in C for calls whose operands are already
what the kernels take (numpy arrays, native float32 / bf16-as-uint16 / int64, C-contiguous, shapes
and values valid) and whose backend is "auto" resolving to Cython; it allocates the outputs and calls
the tier's kernel. For anything else, including every invalid argument, it returns None and the
public op's Python checks run, with their messages. So a call gives the same bits and the same errors
either way; tests/test_fastpath.py holds the two paths to that.

Settings are resolved by the Python rules (``refresh``, dflash_kernels/_fastpath.py) and kept until
one of their inputs changes: the raw values of DFLASH_ISA / DFLASH_BACKEND / DFLASH_NUM_THREADS in
``os.environ`` (compared by identity, as dflash_kernels/_env.py does), ``settings_changed()`` (called
by set_isa and set_matmul_precision), and at least once a second (a tuning table written by another
process). Compiled once without tier flags: it only checks and dispatches.
"""

cimport numpy as cnp
from cpython.dict cimport PyDict_GetItem
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM
from libc.math cimport INFINITY, isfinite, pow
from libc.stdint cimport INT64_MAX, int64_t, uintptr_t

import numpy as np

cnp.import_array()

cdef extern from *:
    """
    #include <time.h>
    #ifdef __linux__
    #include <sched.h>
    static int dk_affinity_cpus(void) {  /* what os.sched_getaffinity(0) counts; 0 if unknown */
        cpu_set_t set;
        if (sched_getaffinity(0, sizeof set, &set)) return 0;
        return CPU_COUNT(&set);
    }
    #else
    static int dk_affinity_cpus(void) { return 0; }
    #endif
    static double dk_monotonic(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return ts.tv_sec + 1e-9 * ts.tv_nsec;
    }
    """
    int dk_affinity_cpus() nogil
    double dk_monotonic() nogil

cdef long _generation = 0
cdef dict _PARTS = {"highest": 3, "high": 2, "medium": 1}  # as dflash_kernels/_precision.py
cdef object _DECLINE = object()  # an operand the Python path must convert (never None: None means "absent")
cdef double REFRESH_S = 1.0  # settings re-resolved at least this often (the tuning table's check interval)


def settings_changed():
    """Forget the resolved settings: the next call resolves them again (set_isa, set_matmul_precision)."""
    global _generation
    _generation += 1


cdef inline bint _plain(object a, int typenum, int ndim):
    """A numpy array (not a subclass) of native `typenum`, `ndim` dims, C-contiguous."""
    if type(a) is not cnp.ndarray:
        return False
    cdef cnp.ndarray arr = <cnp.ndarray> a
    return (cnp.PyArray_NDIM(arr) == ndim and cnp.PyArray_TYPE(arr) == typenum
            and cnp.PyArray_IS_C_CONTIGUOUS(arr) and cnp.PyArray_ISNOTSWAPPED(arr))


cdef inline bint _plain_float(object a, int ndim):
    """float32 or bf16 (uint16) plain array."""
    return _plain(a, cnp.NPY_FLOAT32, ndim) or _plain(a, cnp.NPY_UINT16, ndim)


cdef inline Py_ssize_t _dim(object a, int i):
    return cnp.PyArray_DIM(<cnp.ndarray> a, i)


cdef object _f32(object a, int ndim):
    """A plain float32 array of `ndim` dims as it is, a plain bf16 (uint16) one upcast to a float32 copy
    (exact: the bits shifted up, as bf16_to_f32), anything else None."""
    if _plain(a, cnp.NPY_FLOAT32, ndim):
        return a
    if not _plain(a, cnp.NPY_UINT16, ndim):
        return None
    cdef cnp.ndarray src = <cnp.ndarray> a
    out = _empty(ndim, cnp.PyArray_DIMS(src), cnp.NPY_FLOAT32)
    cdef const unsigned short *p = <const unsigned short *> cnp.PyArray_DATA(src)
    cdef unsigned int *q = <unsigned int *> cnp.PyArray_DATA(<cnp.ndarray> out)
    cdef Py_ssize_t i
    for i in range(cnp.PyArray_SIZE(src)):
        q[i] = (<unsigned int> p[i]) << 16
    return out


cdef inline bint _same_shape(object a, object b, int ndim):
    """Two plain arrays of `ndim` dims, of one shape."""
    return cnp.PyArray_CompareLists(cnp.PyArray_DIMS(<cnp.ndarray> a), cnp.PyArray_DIMS(<cnp.ndarray> b), ndim)


cdef inline bint _ids_in(object a, int64_t low, int64_t high):
    """Every value of a plain int64 array in [low, high)."""
    cdef cnp.ndarray arr = <cnp.ndarray> a
    cdef const int64_t *p = <const int64_t *> cnp.PyArray_DATA(arr)
    cdef Py_ssize_t i, n = cnp.PyArray_SIZE(arr)
    for i in range(n):
        if p[i] < low or p[i] >= high:
            return False
    return True


ctypedef fused real_t:
    float
    double


cdef inline bint _reals_in(const real_t *p, Py_ssize_t n, double low, double high, bint low_closed):
    """Every p[i] in [low, high) (low_closed) or (low, high); NaN never is."""
    cdef Py_ssize_t i
    for i in range(n):
        if not ((p[i] >= low if low_closed else p[i] > low) and p[i] < high):
            return False
    return True


cdef inline bint _finite_positive(object a):
    """Every value of a plain float64 array finite and > 0."""
    return _reals_in(<const double *> cnp.PyArray_DATA(<cnp.ndarray> a), cnp.PyArray_SIZE(<cnp.ndarray> a),
                     0.0, INFINITY, False)


cdef inline bint _finite(object a):
    """Every value of a plain float32 array finite."""
    return _reals_in(<const float *> cnp.PyArray_DATA(<cnp.ndarray> a), cnp.PyArray_SIZE(<cnp.ndarray> a),
                     -INFINITY, INFINITY, False)


cdef inline bint _unit_interval(object a):
    """Every value of a plain float64 array in [0, 1)."""
    return _reals_in(<const double *> cnp.PyArray_DATA(<cnp.ndarray> a), cnp.PyArray_SIZE(<cnp.ndarray> a),
                     0.0, 1.0, True)


cdef inline bint _all_zero(object a):
    cdef cnp.ndarray arr = <cnp.ndarray> a
    cdef const int64_t *p = <const int64_t *> cnp.PyArray_DATA(arr)
    cdef Py_ssize_t i
    for i in range(cnp.PyArray_SIZE(arr)):
        if p[i]:
            return False
    return True


cdef inline bint _real(object v, double *out):
    """A float, or an int a double holds exactly (larger ones: the Python path)."""
    if type(v) is float:
        out[0] = v
        return True
    if _exact_int(v) and -2**53 < v < 2**53:
        out[0] = v
        return True
    return False


cdef tuple _verify_outputs(cnp.npy_intp *dims):
    """(num_draft, num_accepted, out) of a verify round over dims = (B, K + 1): num_draft all K."""
    num = _empty(1, dims, cnp.NPY_INT64)
    cdef int64_t *every = <int64_t *> cnp.PyArray_DATA(<cnp.ndarray> num)
    cdef Py_ssize_t b
    for b in range(dims[0]):
        every[b] = dims[1] - 1  # every row drafts K
    return num, _empty(1, dims, cnp.NPY_INT64), _empty(2, dims, cnp.NPY_INT64)


cdef inline object _empty(int ndim, cnp.npy_intp *dims, int typenum):
    return cnp.PyArray_EMPTY(ndim, dims, typenum, 0)


cdef inline bint _is_auto(object backend):
    return backend is None or (type(backend) is str and backend == "auto")


cdef inline bint _exact_int(object v):
    return type(v) is int  # bool is not int here (type(True) is bool)


cdef class Fast:
    """The fast path of each public op: ``op(<the public op's arguments>)`` returns its result, or None
    where the public op's Python path must run (anything not plainly valid)."""

    cdef object _refresh
    cdef dict _environ
    cdef tuple _keys, _raws
    cdef long _generation
    cdef double _resolved_at
    cdef bint _ready
    cdef object dense, attention, acceptance, denoise, linear_attention, delegates, packed_type, draw_uniforms
    cdef object tensor_type, from_numpy, torch_f32, torch_bf16, torch_i16, torch_i64, torch_f64, torch_strided
    cdef double _min_temperature
    cdef int _env_threads, _parts
    cdef object _max_threads

    def __init__(self, refresh, environ_data, keys):
        """refresh() -> dict of the settings by the Python rules (dflash_kernels/_fastpath.py: the Cython
        kernel module of each family where "auto" runs Cython, else None; DFLASH_NUM_THREADS, 0 if unset;
        the largest n_threads; the default precision's parts; ``delegates`` where a tuning table exists,
        else None; and the Python helpers it calls). environ_data: os.environ's raw dict; keys: its keys
        to watch."""
        self._refresh, self._environ, self._keys = refresh, environ_data, tuple(keys)
        self._ready = False

    cdef bint _fresh(self) except -1:
        """The settings are resolved and current; False if they cannot be (a bad value: the Python
        path raises its error)."""
        cdef Py_ssize_t i
        cdef PyObject *raw
        cdef double now = dk_monotonic()
        if self._ready and self._generation == _generation and now - self._resolved_at < REFRESH_S:
            for i in range(len(self._keys)):
                raw = PyDict_GetItem(self._environ, <object> PyTuple_GET_ITEM(self._keys, i))
                if raw == NULL:
                    raw = <PyObject *> None  # as dict.get stored it
                if raw != PyTuple_GET_ITEM(self._raws, i):
                    break
            else:
                return True
        raws = tuple([self._environ.get(k) for k in self._keys])
        self._ready = False
        try:
            found = self._refresh()
        except (ValueError, TypeError, RuntimeError):
            return False  # the Python path raises it, with its message
        self.dense, self.attention, self.acceptance = found["dense"], found["attention"], found["acceptance"]
        self.denoise, self.linear_attention = found["denoise"], found["linear_attention"]
        self._env_threads, self._max_threads, self._parts = found["env_threads"], found["max_threads"], found["parts"]
        self.delegates, self.packed_type = found["delegates"], found["packed_type"]
        self.draw_uniforms, self._min_temperature = found["draw_uniforms"], found["min_temperature"]
        torch = found["torch"]
        self.tensor_type, self.from_numpy = torch.Tensor, torch.from_numpy
        self.torch_f32, self.torch_bf16, self.torch_i16 = torch.float32, torch.bfloat16, torch.int16
        self.torch_i64, self.torch_f64, self.torch_strided = torch.int64, torch.float64, torch.strided
        self._raws, self._generation, self._resolved_at, self._ready = raws, _generation, now, True
        return True

    cdef object _numpy(self, object a):
        """a as the kernels take it: a torch.Tensor (not a subclass) of float32, bf16, int64 or float64 as its
        numpy view
        (bf16 as uint16, zero-copy), anything else as it is; _DECLINE where the Python path must
        convert or refuse it (a tensor that requires grad, lives on another device, has another dtype
        or layout, or is a negative view)."""
        if type(a) is not self.tensor_type:
            return a
        if a.requires_grad or not a.is_cpu:  # asked first: numpy() would throw from C++ (ASan stops on that)
            return _DECLINE
        dtype = a.dtype
        cdef int typenum
        if dtype is self.torch_f32:
            typenum = cnp.NPY_FLOAT32
        elif dtype is self.torch_bf16:
            typenum = cnp.NPY_UINT16
        elif dtype is self.torch_i64:
            typenum = cnp.NPY_INT64
        elif dtype is self.torch_f64:
            typenum = cnp.NPY_FLOAT64
        else:
            return _DECLINE
        if a.layout is not self.torch_strided or a.is_neg():
            return _DECLINE  # sparse, or a negative view: the Python path refuses or resolves it
        # A dense C-contiguous tensor's memory as an array over its data pointer, the tensor its base:
        # what numpy() returns, in about half its time (0.75 us; bf16, through an int16 view, 1.4 us)
        cdef uintptr_t data
        cdef cnp.npy_intp dims[8]
        cdef int i, ndim
        if a.is_contiguous():
            data = a.data_ptr()
            shape = a.shape
            ndim = len(shape)
            if data != 0 and ndim <= 8:  # (an empty tensor may have no data: numpy() below)
                for i in range(ndim):
                    dims[i] = shape[i]
                arr = cnp.PyArray_SimpleNewFromData(ndim, dims, typenum, <void *> data)
                cnp.set_array_base(<cnp.ndarray> arr, a)  # the tensor, and through it the memory, lives on
                return arr
        try:  # a strided view (the Python path's checks decide), an empty tensor
            if typenum != cnp.NPY_UINT16:
                return a.numpy()
            return a.view(self.torch_i16).numpy().view(np.uint16)
        except (RuntimeError, TypeError):  # none known: the Python path names the argument
            return _DECLINE

    cdef object _result(self, object out, bint torch_out):
        """out in the caller's framework (float32 and int64 outputs; the Python path's wrap())."""
        return self.from_numpy(out) if torch_out else out

    cdef bint _any_torch(self, tuple operands):
        cdef object a
        for a in operands:
            if type(a) is self.tensor_type:
                return True
        return False

    cdef int _threads(self, object n_threads) except -2:
        """n_threads resolved as ``resolve_threads`` does, or -1 (the Python path decides)."""
        cdef int n
        if n_threads is None:
            if self._env_threads:
                return self._env_threads
            n = dk_affinity_cpus()
            return n if n > 0 else -1
        if _exact_int(n_threads) and 1 <= n_threads <= self._max_threads:
            return n_threads
        return -1

    cdef int _precision(self, object precision) except -2:
        if precision is None:
            return self._parts
        if type(precision) is str:
            found = _PARTS.get(precision)
            if found is not None:
                return found
        return -1

    def linear(self, x, weight, bias, precision, n_threads, backend):
        if not _is_auto(backend) or not self._fresh() or self.dense is None:
            return None
        cdef int parts = self._precision(precision), nt = self._threads(n_threads)
        cdef bint torch_out = type(x) is self.tensor_type  # the result is a tensor if x is one
        x, weight, bias = _f32(self._numpy(x), 2), self._numpy(weight), self._numpy(bias)
        if parts < 0 or nt < 0 or x is None or weight is _DECLINE or bias is _DECLINE:
            return None
        cdef cnp.npy_intp dims[2]
        cdef Py_ssize_t k = _dim(x, 1)
        dims[0] = _dim(x, 0)
        packed = type(weight) is self.packed_type
        if packed:  # PackedWeight (shape (N, K), its panels in .data): the Cython kernels' own layout
            n_packed, k_packed = weight.shape
            dims[1] = n_packed
            if k_packed != k:
                return None
        elif _plain_float(weight, 2):
            dims[1] = _dim(weight, 0)
            if _dim(weight, 1) != k:
                return None
        else:
            return None
        if dims[0] == 0 or dims[1] == 0 or k == 0:
            return None
        if bias is not None:
            bias = _f32(bias, 1)
            if bias is None or _dim(bias, 0) != dims[1]:
                return None
        if packed:
            out = _empty(2, dims, cnp.NPY_FLOAT32)
            self.dense.linear_packed(x, weight.data, bias, out, n_threads=nt, parts=parts,
                                     weights_finite=weight.finite, quant=weight.quant)
            return self._result(out, torch_out)
        if self.delegates is not None and self.delegates(dims[0], dims[1], k,
                                                         cnp.PyArray_TYPE(<cnp.ndarray> weight) == cnp.NPY_UINT16,
                                                         parts, nt):
            return None  # torch runs this shape (tune_linear): the Python path calls it
        out = _empty(2, dims, cnp.NPY_FLOAT32)
        self.dense.linear(x, weight, bias, out, n_threads=nt, parts=parts)
        return self._result(out, torch_out)

    def rms_norm(self, x, w, eps, offset, residual, n_threads, backend):
        if not _is_auto(backend) or not self._fresh() or self.dense is None:
            return None
        cdef int nt = self._threads(n_threads)
        cdef bint torch_out = type(x) is self.tensor_type
        x, w, residual = self._numpy(x), self._numpy(w), self._numpy(residual)
        if nt < 0 or residual is _DECLINE or type(x) is not cnp.ndarray or type(eps) is not float \
                or type(offset) is not float:
            return None
        cdef int ndim = cnp.PyArray_NDIM(<cnp.ndarray> x)
        x, w = _f32(x, ndim), _f32(w, 1)
        if ndim < 1 or x is None or w is None:
            return None
        cdef Py_ssize_t h = _dim(x, ndim - 1), size = cnp.PyArray_SIZE(<cnp.ndarray> x)
        cdef double e = eps, o = offset
        if h == 0 or size == 0 or _dim(w, 0) != h or not (e >= 0.0 and isfinite(e)) or not isfinite(o):
            return None
        if residual is not None:
            residual = _f32(residual, ndim)
            if residual is None or not _same_shape(x, residual, ndim):
                return None
        cdef cnp.npy_intp rows[2]
        rows[0], rows[1] = size // h, h
        out = _empty(ndim, cnp.PyArray_DIMS(<cnp.ndarray> x), cnp.NPY_FLOAT32)
        x2, out2 = (x, out) if ndim == 2 else (_rows(x, rows), _rows(out, rows))
        if residual is None:
            self.dense.rms_norm(x2, w, out2, n_threads=nt, eps=eps, offset=offset)
            return self._result(out, torch_out)
        new_res = _empty(ndim, cnp.PyArray_DIMS(<cnp.ndarray> x), cnp.NPY_FLOAT32)
        r2, new2 = (residual, new_res) if ndim == 2 else (_rows(residual, rows), _rows(new_res, rows))
        self.dense.rms_norm_residual(x2, r2, w, out2, new2, n_threads=nt, eps=eps, offset=offset)
        return self._result(out, torch_out), self._result(new_res, torch_out)

    def apply_rope(self, x, positions, theta, rotary_dim, inv_freq, out, n_threads, backend):
        if not _is_auto(backend) or not self._fresh() or self.dense is None:
            return None
        cdef int nt = self._threads(n_threads)
        cdef bint torch_out = type(x) is self.tensor_type
        given_out = out  # returned as it was passed (a tensor stays one)
        x, positions, inv_freq, out = self._numpy(x), self._numpy(positions), self._numpy(inv_freq), self._numpy(out)
        x = _f32(x, 3)
        if nt < 0 or out is _DECLINE or x is None or not _plain(positions, cnp.NPY_INT64, 1):
            return None
        cdef Py_ssize_t t = _dim(x, 0), d = _dim(x, 2)
        cdef double th = 0.0  # set by _real
        if cnp.PyArray_SIZE(<cnp.ndarray> x) == 0 or _dim(positions, 0) != t or not _ids_in(positions, 0, INT64_MAX):
            return None
        if not _real(theta, &th) or not (isfinite(th) and th > 0):
            return None
        if rotary_dim is None:
            rotary_dim = d
        elif not (_exact_int(rotary_dim) and 2 <= rotary_dim <= d and rotary_dim % 2 == 0):
            return None
        if inv_freq is not None and not (_plain(inv_freq, cnp.NPY_FLOAT64, 1) and _dim(inv_freq, 0) == rotary_dim // 2
                                         and _finite_positive(inv_freq)):
            return None
        if out is None:
            out = _empty(3, cnp.PyArray_DIMS(<cnp.ndarray> x), cnp.NPY_FLOAT32)
        elif not (_plain(out, cnp.NPY_FLOAT32, 3) and cnp.PyArray_ISWRITEABLE(<cnp.ndarray> out)
                  and _same_shape(x, out, 3)):
            return None
        self.dense.apply_rope(x, positions, out, n_threads=nt, theta=th, rotary_dim=rotary_dim, inv_freq=inv_freq)
        return given_out if given_out is not None else self._result(out, torch_out)

    def silu_and_mul(self, gate_up, n_threads, backend):
        if not _is_auto(backend) or not self._fresh() or self.dense is None:
            return None
        cdef int nt = self._threads(n_threads)
        cdef bint torch_out = type(gate_up) is self.tensor_type
        gate_up = _f32(self._numpy(gate_up), 2)
        if nt < 0 or gate_up is None:
            return None
        cdef cnp.npy_intp dims[2]
        dims[0], dims[1] = _dim(gate_up, 0), _dim(gate_up, 1) // 2
        if dims[0] == 0 or dims[1] == 0 or _dim(gate_up, 1) % 2:
            return None
        out = _empty(2, dims, cnp.NPY_FLOAT32)
        self.dense.silu_and_mul(gate_up, out, n_threads=nt)
        return self._result(out, torch_out)

    cdef int _attention_args(self, q, scale, window, precision, n_threads, backend, double *sc) except -2:
        """Threads for an attention call whose q, scale, window, precision, n_threads and backend are
        plain, else -1; sc receives the scale."""
        if not _is_auto(backend) or not self._fresh() or self.attention is None:
            return -1
        if not (window is None or (_exact_int(window) and 1 <= window < 2**62)):
            return -1
        if self._precision(precision) < 0 or not _plain(q, cnp.NPY_FLOAT32, 3):
            return -1
        cdef Py_ssize_t t_q = _dim(q, 0), h_q = _dim(q, 1), d = _dim(q, 2)
        if t_q == 0 or h_q == 0 or d == 0:
            return -1
        if scale is None:
            sc[0] = pow(<double> d, -0.5)  # what Python's d ** -0.5 computes
        elif type(scale) is float and isfinite(<double> scale):
            sc[0] = scale
        else:
            return -1
        return self._threads(n_threads)

    cdef bint _kv(self, k, v, Py_ssize_t h_q, Py_ssize_t d):
        """k, v: plain (T, H_kv, D) pair of one dtype, D = d, H_kv dividing h_q."""
        if not _plain_float(k, 3) or not _plain_float(v, 3):
            return False
        return (cnp.PyArray_TYPE(<cnp.ndarray> k) == cnp.PyArray_TYPE(<cnp.ndarray> v) and _same_shape(k, v, 3)
                and _dim(k, 2) == d and _dim(k, 1) >= 1 and h_q % _dim(k, 1) == 0)

    def cached_attention(self, q, k_cache, v_cache, causal, scale, window, precision, n_threads, backend):
        cdef double sc
        cdef bint torch_out = type(q) is self.tensor_type or type(k_cache) is self.tensor_type \
            or type(v_cache) is self.tensor_type
        q, k_cache, v_cache = _f32(self._numpy(q), 3), self._numpy(k_cache), self._numpy(v_cache)
        cdef int nt = self._attention_args(q, scale, window, precision, n_threads, backend, &sc)
        if nt < 0 or type(causal) is not bool or not self._kv(k_cache, v_cache, _dim(q, 1), _dim(q, 2)) \
                or _dim(q, 0) > _dim(k_cache, 0):
            return None
        out = _empty(3, cnp.PyArray_DIMS(<cnp.ndarray> q), cnp.NPY_FLOAT32)
        self.attention.cached_attention(q, k_cache, v_cache, out, n_threads=nt, causal=causal, scale=sc,
                                        window=window, parts=self._precision(precision))
        return self._result(out, torch_out)

    def injected_kv_attention(self, q, k_ctx, v_ctx, k_blk, v_blk, scale, causal_block, window, precision,
                              n_threads, backend):
        cdef double sc
        cdef bint torch_out = False
        for a in (q, k_ctx, v_ctx, k_blk, v_blk):
            torch_out = torch_out or type(a) is self.tensor_type
        q, k_ctx, v_ctx = _f32(self._numpy(q), 3), self._numpy(k_ctx), self._numpy(v_ctx)
        k_blk, v_blk = self._numpy(k_blk), self._numpy(v_blk)
        cdef int nt = self._attention_args(q, scale, window, precision, n_threads, backend, &sc)
        if nt < 0 or type(causal_block) is not bool or not self._kv(k_ctx, v_ctx, _dim(q, 1), _dim(q, 2)) \
                or not self._kv(k_blk, v_blk, _dim(q, 1), _dim(q, 2)) or _dim(k_blk, 1) != _dim(k_ctx, 1) \
                or _dim(k_blk, 0) != _dim(q, 0):
            return None
        out = _empty(3, cnp.PyArray_DIMS(<cnp.ndarray> q), cnp.NPY_FLOAT32)
        self.attention.injected_kv_attention(q, k_ctx, v_ctx, k_blk, v_blk, out, n_threads=nt, scale=sc,
                                             causal_block=causal_block, window=window,
                                             parts=self._precision(precision))
        return self._result(out, torch_out)

    cdef bint _sampling(self, temperature, top_k, top_p, double *t, Py_ssize_t *k, double *p) except -1:
        """check_sampling's rules (dflash_kernels/acceptance.py): False where it would raise."""
        if not _real(temperature, t) or not (t[0] >= 0 and isfinite(t[0])) or not _real(top_p, p) \
                or not (0.0 < p[0] <= 1.0) or not (_exact_int(top_k) and 0 <= top_k < 2**62):
            return False
        if t[0] < self._min_temperature:
            t[0] = 0.0
        k[0] = top_k
        return True

    def denoise_block(self, hidden, lm_head, temperature, top_k, top_p, generator, uniforms, precision, n_threads,
                      backend):
        if not _is_auto(backend) or not self._fresh() or self.denoise is None:
            return None
        cdef double t = 0.0, p = 0.0  # set by _sampling
        cdef Py_ssize_t k = 0
        cdef int nt = self._threads(n_threads)
        cdef bint torch_out = self._any_torch((hidden, lm_head))
        hidden, lm_head, uniforms = self._numpy(hidden), self._numpy(lm_head), self._numpy(uniforms)
        # activations rounded to bf16 ("high", "medium"): the Python path rounds them with torch
        if nt < 0 or self._precision(precision) != 3 or not self._sampling(temperature, top_k, top_p, &t, &k, &p):
            return None
        hidden = _f32(hidden, 2)
        if hidden is None or not _plain_float(lm_head, 2):
            return None
        cdef cnp.npy_intp rows = _dim(hidden, 0)
        if rows == 0 or _dim(hidden, 1) == 0 or _dim(lm_head, 0) == 0 or _dim(lm_head, 1) != _dim(hidden, 1) \
                or not _finite(hidden):
            return None
        u = None
        if t > 0:
            if uniforms is None:
                u = self.draw_uniforms(generator, (rows,))
            elif _plain(uniforms, cnp.NPY_FLOAT64, 1) and _dim(uniforms, 0) == rows and _unit_interval(uniforms):
                u = uniforms
            else:
                return None
        tokens, status = cnp.PyArray_ZEROS(1, &rows, cnp.NPY_INT64, 0), cnp.PyArray_ZEROS(1, &rows, cnp.NPY_INT64, 0)
        self.denoise.denoise_block(hidden, lm_head, tokens, status, n_threads=nt, temperature=t, top_k=k, top_p=p,
                                   uniforms=u)
        # a non-finite logit row: the Python path raises its error (the rows' status does not depend on u)
        return self._result(tokens, torch_out) if _all_zero(status) else None

    def rejection_sample(self, draft_tokens, target_logits, draft_probs, temperature, top_k, top_p, num_draft,
                         uniforms, generator, n_threads, backend):
        """With uniforms given only: a re-run of the Python path (after a status error) sees the same."""
        if not _is_auto(backend) or not self._fresh() or self.acceptance is None or num_draft is not None:
            return None
        cdef double t = 0.0, p = 0.0  # set by _sampling
        cdef Py_ssize_t k = 0
        cdef int nt = self._threads(n_threads)
        cdef bint torch_out = self._any_torch((draft_tokens, target_logits))
        draft_tokens, target_logits = self._numpy(draft_tokens), self._numpy(target_logits)
        draft_probs, uniforms = self._numpy(draft_probs), self._numpy(uniforms)
        if nt < 0 or draft_probs is _DECLINE or not self._sampling(temperature, top_k, top_p, &t, &k, &p):
            return None
        if not _plain(draft_tokens, cnp.NPY_INT64, 2) or not _plain_float(target_logits, 3):
            return None
        cdef cnp.npy_intp dims[2]
        dims[0], dims[1] = _dim(draft_tokens, 0), _dim(draft_tokens, 1) + 1
        cdef Py_ssize_t v = _dim(target_logits, 2)
        if _dim(target_logits, 0) != dims[0] or _dim(target_logits, 1) != dims[1] or v == 0 \
                or not _ids_in(draft_tokens, 0, v):
            return None
        if draft_probs is not None and not (_plain_float(draft_probs, 3) and _dim(draft_probs, 0) == dims[0]
                                             and _dim(draft_probs, 1) == dims[1] - 1 and _dim(draft_probs, 2) == v):
            return None
        if not (_plain(uniforms, cnp.NPY_FLOAT64, 3) and _dim(uniforms, 0) == dims[0] and _dim(uniforms, 1) == dims[1]
                and _dim(uniforms, 2) == 2 and _unit_interval(uniforms)):
            return None
        num, accepted, out = _verify_outputs(dims)
        status = cnp.PyArray_ZEROS(1, dims, cnp.NPY_INT64, 0)
        self.acceptance.rejection_sample(draft_tokens, target_logits, draft_probs, num, accepted, out, status,
                                         n_threads=nt, uniforms=uniforms, temperature=t, top_k=k, top_p=p)
        if not _all_zero(status):
            return None
        return self._result(accepted, torch_out), self._result(out, torch_out)

    def gated_delta_rule(self, q, k, v, g, beta, state, checkpoints, use_qk_l2norm, scale, chunk_size,
                         checkpoints_out, n_threads, backend):
        if not _is_auto(backend) or not self._fresh() or self.linear_attention is None:
            return None
        if not (checkpoints is False or checkpoints is None) or checkpoints_out is not None \
                or type(use_qk_l2norm) is not bool:
            return None
        cdef int nt = self._threads(n_threads)
        cdef bint torch_out = self._any_torch((q, k, v, state))
        q, k, v = _f32(self._numpy(q), 3), _f32(self._numpy(k), 3), _f32(self._numpy(v), 3)
        g, beta = _f32(self._numpy(g), 2), _f32(self._numpy(beta), 2)
        state = self._numpy(state)  # a view: the tensor's memory is updated in place
        if nt < 0 or not _plain(q, cnp.NPY_FLOAT32, 3) or not _plain(k, cnp.NPY_FLOAT32, 3) \
                or not _plain(v, cnp.NPY_FLOAT32, 3) or not _plain(g, cnp.NPY_FLOAT32, 2) \
                or not _plain(beta, cnp.NPY_FLOAT32, 2) or not _plain(state, cnp.NPY_FLOAT32, 3) \
                or not cnp.PyArray_ISWRITEABLE(<cnp.ndarray> state):
            return None
        cdef cnp.npy_intp t = _dim(q, 0), hk = _dim(q, 1), dk = _dim(q, 2), hv = _dim(v, 1), dv = _dim(v, 2)
        if t == 0 or hk == 0 or hv == 0 or dk == 0 or dv == 0 or hv % hk or _dim(v, 0) != t \
                or not _same_shape(q, k, 3) \
                or _dim(g, 0) != t or _dim(g, 1) != hv or _dim(beta, 0) != t or _dim(beta, 1) != hv \
                or _dim(state, 0) != hv or _dim(state, 1) != dk or _dim(state, 2) != dv:
            return None
        cdef double sc
        if scale is None:
            sc = pow(<double> dk, -0.5)
        elif type(scale) is float:
            sc = scale
        else:
            return None
        if chunk_size is None:
            chunk_size = -1  # the backend's choice
        elif not (_exact_int(chunk_size) and 0 <= chunk_size < 2**31):
            return None
        slot = _empty(1, &t, cnp.NPY_INT64)
        cdef int64_t *kept = <int64_t *> cnp.PyArray_DATA(<cnp.ndarray> slot)
        cdef Py_ssize_t i
        for i in range(t):
            kept[i] = -1  # no checkpoints
        cdef cnp.npy_intp o_dims[3]
        cdef cnp.npy_intp c_dims[4]
        o_dims[0], o_dims[1], o_dims[2] = t, hv, dv
        c_dims[0], c_dims[1], c_dims[2], c_dims[3] = 0, hv, dk, dv
        o, ckpts = _empty(3, o_dims, cnp.NPY_FLOAT32), _empty(4, c_dims, cnp.NPY_FLOAT32)
        self.linear_attention.gated_delta_rule(q, k, v, g, beta, state, slot, o, state, ckpts, n_threads=nt,
                                               scale=sc, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
        return self._result(o, torch_out)

    def accept_greedy(self, draft_tokens, target_tokens, num_draft, vocab_size, n_threads, backend):
        if not _is_auto(backend) or not self._fresh() or self.acceptance is None or num_draft is not None:
            return None
        cdef int nt = self._threads(n_threads)
        cdef bint torch_out = self._any_torch((draft_tokens, target_tokens))
        draft_tokens, target_tokens = self._numpy(draft_tokens), self._numpy(target_tokens)
        if nt < 0 or not _plain(draft_tokens, cnp.NPY_INT64, 2) or not _plain(target_tokens, cnp.NPY_INT64, 2):
            return None
        cdef cnp.npy_intp dims[2]
        dims[0], dims[1] = _dim(draft_tokens, 0), _dim(draft_tokens, 1) + 1
        if _dim(target_tokens, 0) != dims[0] or _dim(target_tokens, 1) != dims[1]:
            return None
        cdef int64_t high = INT64_MAX
        if vocab_size is not None:
            if not (_exact_int(vocab_size) and 0 < vocab_size <= INT64_MAX):
                return None
            high = vocab_size
        if not _ids_in(draft_tokens, 0, high) or not _ids_in(target_tokens, 0, high):
            return None
        num, accepted, out = _verify_outputs(dims)
        self.acceptance.accept_greedy(draft_tokens, target_tokens, num, accepted, out, n_threads=nt)
        return self._result(accepted, torch_out), self._result(out, torch_out)


cdef object _rows(object a, cnp.npy_intp *rows):
    """The (rows[0], rows[1]) view of a C-contiguous array."""
    cdef cnp.PyArray_Dims shape
    shape.ptr, shape.len = rows, 2
    return cnp.PyArray_Newshape(<cnp.ndarray> a, &shape, cnp.NPY_CORDER)
