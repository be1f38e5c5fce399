/* Memory fences for shmsync's slot protocol, from the C11 atomics the compiler provides.
 *
 * full_fence(): atomic_thread_fence(memory_order_seq_cst): mfence on x86-64, dmb ish on aarch64,
 * sync on POWER. compiler_fence(): atomic_signal_fence(memory_order_seq_cst), no instruction at all:
 * what a TSO CPU needs between two stores or two loads. load_word(buffer, index): an 8-byte relaxed atomic load of word `index` of a
 * buffer, for measuring header access against a memoryview's (see benchmarks/fences_bench.py).
 * No executable memory is made at run time: this is compiled when the package is built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdatomic.h>
#include <stdint.h>

static PyObject *full_fence(PyObject *self, PyObject *unused) {
    atomic_thread_fence(memory_order_seq_cst);
    Py_RETURN_NONE;
}

static PyObject *compiler_fence(PyObject *self, PyObject *unused) {
    atomic_signal_fence(memory_order_seq_cst);
    Py_RETURN_NONE;
}

static PyObject *load_word(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "load_word(buffer, index)");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    Py_ssize_t index = PyLong_AsSsize_t(args[1]);
    if (index == -1 && PyErr_Occurred()) {
        PyBuffer_Release(&view);
        return NULL;
    }
    if (index < 0 || (index + 1) * (Py_ssize_t)sizeof(int64_t) > view.len || ((uintptr_t)view.buf & 7)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_IndexError, "word index out of range, or a buffer not aligned to 8 bytes");
        return NULL;
    }
    int64_t value = __atomic_load_n((int64_t *)view.buf + index, __ATOMIC_RELAXED);
    PyBuffer_Release(&view);
    return PyLong_FromLongLong(value);
}

static PyMethodDef methods[] = {
    {"full_fence", full_fence, METH_NOARGS, "A sequentially consistent memory fence."},
    {"compiler_fence", compiler_fence, METH_NOARGS, "A compiler barrier (no instruction)."},
    {"load_word", (PyCFunction)(void (*)(void))load_word, METH_FASTCALL, "A relaxed atomic load of an 8-byte word."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_atomics", "Memory fences from C11 atomics.", -1, methods};

PyMODINIT_FUNC PyInit__atomics(void) { return PyModule_Create(&module); }
