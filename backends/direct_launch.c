/* One C call that allocates a compiled Triton kernel's outputs and launches it.

   A bound launch from Python makes two calls into C: torch's allocation of the output, then
   Triton's launcher. On the autograd engine's thread each such call costs about twice what it
   costs on the main thread, so a backward that makes two pays the second at that rate
   (docs/benchmarks.md, run AQ). A Launch object holds everything constant about one launch
   (the function, grid, block, shared memory and the kernel's parameter values) and, per call,
   reads the addresses of its input tensors, allocates its outputs with new_empty and launches
   through the driver API: one call.

   Built at first use with Triton's own C build (the compiler and Python headers Triton's
   launchers need); the CUDA driver is opened with dlopen, so no CUDA headers are needed. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef int CUresult;
typedef void *CUfunction;
typedef void *CUstream;
typedef void *CUcontext;

typedef CUresult (*launch_kernel_t)(CUfunction, unsigned, unsigned, unsigned, unsigned,
                                    unsigned, unsigned, unsigned, CUstream, void **, void **);
typedef CUresult (*ctx_get_t)(CUcontext *);
typedef CUresult (*ctx_push_t)(CUcontext);
typedef CUresult (*ctx_pop_t)(CUcontext *);
typedef CUresult (*error_string_t)(CUresult, const char **);

static launch_kernel_t cu_launch_kernel;
static ctx_get_t cu_ctx_get_current;
static ctx_push_t cu_ctx_push_current;
static ctx_pop_t cu_ctx_pop_current;
static error_string_t cu_get_error_string;

#define MAX_SLOTS 96   /* kernel parameters, each in an 8-byte slot (the norm kernel has 66) */
#define MAX_FILLS 16   /* addresses written per call */
#define MAX_MAKES 8    /* outputs allocated per call */

static PyObject *data_ptr_name;
static PyObject *new_empty_name;

/* A parameter slot written per call: from call argument (or output) `source`, plus `offset`. */
typedef struct {
    Py_ssize_t source;
    Py_ssize_t slot;
    int64_t offset;
} Fill;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    CUfunction function;
    CUcontext context;
    unsigned grid[3];
    unsigned threads;
    unsigned shared;
    Py_ssize_t n_slots;
    uint64_t slots[MAX_SLOTS];
    Py_ssize_t n_inputs;
    Py_ssize_t n_takes;
    Fill takes[MAX_FILLS];
    Py_ssize_t n_makes;
    Py_ssize_t templates[MAX_MAKES];
    PyObject *shapes[MAX_MAKES];
    Py_ssize_t n_fills;
    Fill fills[MAX_FILLS];
} Launch;

/* open_driver(path): take the driver's functions from the shared library at `path`
   (libcuda.so.1; the tests pass a stand-in that records launches). */
static PyObject *open_driver(PyObject *Py_UNUSED(module), PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) {
        return NULL;
    }
    void *handle = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (handle == NULL) {
        handle = dlopen(path, RTLD_NOW);
    }
    if (handle == NULL) {
        PyErr_Format(PyExc_RuntimeError, "the CUDA driver (%s) could not be opened", path);
        return NULL;
    }
    ctx_get_t get = (ctx_get_t)dlsym(handle, "cuCtxGetCurrent");
    ctx_push_t push = (ctx_push_t)dlsym(handle, "cuCtxPushCurrent_v2");
    ctx_pop_t pop = (ctx_pop_t)dlsym(handle, "cuCtxPopCurrent_v2");
    error_string_t error = (error_string_t)dlsym(handle, "cuGetErrorString");
    launch_kernel_t launch = (launch_kernel_t)dlsym(handle, "cuLaunchKernel");
    if (!get || !push || !pop || !error || !launch) {
        PyErr_Format(PyExc_RuntimeError,
                     "the CUDA driver (%s) lacks cuLaunchKernel or its context functions", path);
        return NULL;
    }
    cu_ctx_get_current = get;
    cu_ctx_push_current = push;
    cu_ctx_pop_current = pop;
    cu_get_error_string = error;
    cu_launch_kernel = launch;
    Py_RETURN_NONE;
}

static int driver_error(CUresult code, const char *what) {
    const char *text = NULL;
    if (cu_get_error_string(code, &text) != 0 || text == NULL) {
        text = "unknown error";
    }
    PyErr_Format(PyExc_RuntimeError, "%s failed: CUDA error %d (%s)", what, code, text);
    return -1;
}

/* The device address of `obj`: an int as it is, else obj.data_ptr(), 1 when that is not
   16-byte aligned. */
static int address_of(PyObject *obj, uint64_t *address) {
    if (PyLong_Check(obj)) {
        *address = PyLong_AsUnsignedLongLong(obj);
        return PyErr_Occurred() ? -1 : 0;
    }
    PyObject *args[1] = {obj};
    PyObject *value = PyObject_VectorcallMethod(
        data_ptr_name, args, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (value == NULL) {
        return -1;
    }
    *address = PyLong_AsUnsignedLongLong(value);
    Py_DECREF(value);
    return PyErr_Occurred() ? -1 : (*address & 15) != 0;
}

/* launch(stream, *inputs): the outputs (one, a tuple of several, or None when none), or
   NotImplemented, launching nothing, when an input tensor's address is not 16-byte aligned:
   the kernels bound here were compiled for aligned tensors. */
static PyObject *launch_call(PyObject *callable, PyObject *const *args, size_t nargsf,
                             PyObject *kwnames) {
    Launch *self = (Launch *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) {
        PyErr_SetString(PyExc_TypeError, "a Launch takes no keyword arguments");
        return NULL;
    }
    if (nargs != 1 + self->n_inputs) {
        PyErr_Format(PyExc_TypeError, "a Launch takes the stream and %zd inputs, got %zd arguments",
                     self->n_inputs, nargs);
        return NULL;
    }
    uint64_t stream = PyLong_AsUnsignedLongLong(args[0]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    uint64_t values[MAX_SLOTS];
    void *params[MAX_SLOTS];
    memcpy(values, self->slots, sizeof(uint64_t) * self->n_slots);
    int unaligned = 0;
    for (Py_ssize_t i = 0; i < self->n_takes; ++i) {
        uint64_t address;
        int status = address_of(args[1 + self->takes[i].source], &address);
        if (status < 0) {
            return NULL;
        }
        unaligned |= status;
        values[self->takes[i].slot] = address + (uint64_t)self->takes[i].offset;
    }
    if (unaligned) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *outputs[MAX_MAKES];
    uint64_t addresses[MAX_MAKES];
    Py_ssize_t made = 0;
    for (; made < self->n_makes; ++made) {
        PyObject *call_args[2] = {args[1 + self->templates[made]], self->shapes[made]};
        outputs[made] = PyObject_VectorcallMethod(
            new_empty_name, call_args, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (outputs[made] == NULL || address_of(outputs[made], &addresses[made]) < 0) {
            if (outputs[made] != NULL) {
                ++made;
            }
            goto fail;
        }
    }
    for (Py_ssize_t i = 0; i < self->n_fills; ++i) {
        values[self->fills[i].slot] = addresses[self->fills[i].source] +
                                      (uint64_t)self->fills[i].offset;
    }
    for (Py_ssize_t i = 0; i < self->n_slots; ++i) {
        params[i] = &values[i];
    }
    CUcontext current = NULL;
    CUresult code = cu_ctx_get_current(&current);
    if (code != 0) {
        driver_error(code, "cuCtxGetCurrent");
        goto fail;
    }
    int pushed = current != self->context;
    if (pushed && (code = cu_ctx_push_current(self->context)) != 0) {
        driver_error(code, "cuCtxPushCurrent");
        goto fail;
    }
    code = cu_launch_kernel(self->function, self->grid[0], self->grid[1], self->grid[2],
                            self->threads, 1, 1, self->shared, (CUstream)(uintptr_t)stream,
                            params, NULL);
    if (pushed) {
        CUcontext popped;
        cu_ctx_pop_current(&popped);
    }
    if (code != 0) {
        driver_error(code, "cuLaunchKernel");
        goto fail;
    }
    if (self->n_makes == 0) {
        Py_RETURN_NONE;
    }
    if (self->n_makes == 1) {
        return outputs[0];
    }
    PyObject *result = PyTuple_New(self->n_makes);
    if (result == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < self->n_makes; ++i) {
        PyTuple_SET_ITEM(result, i, outputs[i]);
    }
    return result;
fail:
    for (Py_ssize_t i = 0; i < made; ++i) {
        Py_DECREF(outputs[i]);
    }
    return NULL;
}

static int read_fills(PyObject *seq, Fill *fills, Py_ssize_t *count, Py_ssize_t sources,
                      Py_ssize_t slots, const char *what) {
    if (!PyTuple_Check(seq) || PyTuple_GET_SIZE(seq) > MAX_FILLS) {
        PyErr_Format(PyExc_ValueError, "%s must be a tuple of at most %d (source, slot, offset)",
                     what, MAX_FILLS);
        return -1;
    }
    *count = PyTuple_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < *count; ++i) {
        Fill *fill = &fills[i];
        long long offset;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(seq, i), "nnL", &fill->source, &fill->slot,
                              &offset)) {
            return -1;
        }
        fill->offset = offset;
        if (fill->source < 0 || fill->source >= sources || fill->slot < 0 ||
            fill->slot >= slots) {
            PyErr_Format(PyExc_ValueError,
                         "%s[%zd] = (%zd, %zd, ...) is out of range: %zd sources, %zd slots",
                         what, i, fill->source, fill->slot, sources, slots);
            return -1;
        }
    }
    return 0;
}

static void launch_dealloc(Launch *self) {
    for (Py_ssize_t i = 0; i < self->n_makes; ++i) {
        Py_XDECREF(self->shapes[i]);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject LaunchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rope_dispatch_direct_launch.Launch",
    .tp_doc = "One kernel launch, its outputs allocated in the same call: launch(stream, *inputs)",
    .tp_basicsize = sizeof(Launch),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Launch, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_dealloc = (destructor)launch_dealloc,
};

/* bind(function, grid, threads, shared, slots, inputs, takes, makes, fills) -> Launch

   slots: bytes, the parameters' values in 8-byte little-endian slots; inputs: the number of
   tensors (or int addresses) each call passes after the stream; takes: (input, slot, offset)
   for each slot written from an input's address; makes: (input, shape) for each output,
   allocated as inputs[input].new_empty(shape); fills: (output, slot, offset) for each slot
   written from an output's address. The current CUDA context is the launch's. */
static PyObject *bind(PyObject *Py_UNUSED(module), PyObject *args) {
    unsigned long long function;
    unsigned grid_x, grid_y, grid_z, threads, shared;
    Py_buffer slots;
    Py_ssize_t inputs;
    PyObject *takes, *makes, *fills;
    if (!PyArg_ParseTuple(args, "K(III)IIy*nOOO", &function, &grid_x, &grid_y, &grid_z,
                          &threads, &shared, &slots, &inputs, &takes, &makes, &fills)) {
        return NULL;
    }
    Py_ssize_t n_slots = slots.len / 8;
    if (slots.len % 8 != 0 || n_slots > MAX_SLOTS) {
        PyErr_Format(PyExc_ValueError, "slots must hold at most %d 8-byte values, got %zd bytes",
                     MAX_SLOTS, slots.len);
        PyBuffer_Release(&slots);
        return NULL;
    }
    if (inputs < 0 || !PyTuple_Check(makes) || PyTuple_GET_SIZE(makes) > MAX_MAKES) {
        PyErr_Format(PyExc_ValueError,
                     "inputs must be >= 0 and makes a tuple of at most %d (input, shape)",
                     MAX_MAKES);
        PyBuffer_Release(&slots);
        return NULL;
    }
    Launch *self = PyObject_New(Launch, &LaunchType);
    if (self == NULL) {
        PyBuffer_Release(&slots);
        return NULL;
    }
    self->vectorcall = launch_call;
    self->n_makes = 0;
    self->function = (CUfunction)(uintptr_t)function;
    self->grid[0] = grid_x;
    self->grid[1] = grid_y;
    self->grid[2] = grid_z;
    self->threads = threads;
    self->shared = shared;
    self->n_slots = n_slots;
    memcpy(self->slots, slots.buf, slots.len);
    PyBuffer_Release(&slots);
    self->n_inputs = inputs;
    Py_ssize_t n_makes = PyTuple_GET_SIZE(makes);
    for (Py_ssize_t i = 0; i < n_makes; ++i) {
        PyObject *shape;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(makes, i), "nO!", &self->templates[i],
                              &PyTuple_Type, &shape)) {
            Py_DECREF(self);
            return NULL;
        }
        if (self->templates[i] < 0 || self->templates[i] >= inputs) {
            PyErr_Format(PyExc_ValueError, "makes[%zd] names input %zd of %zd", i,
                         self->templates[i], inputs);
            Py_DECREF(self);
            return NULL;
        }
        Py_INCREF(shape);
        self->shapes[i] = shape;
        self->n_makes = i + 1;
    }
    if (read_fills(takes, self->takes, &self->n_takes, inputs, n_slots, "takes") < 0 ||
        read_fills(fills, self->fills, &self->n_fills, n_makes, n_slots, "fills") < 0) {
        Py_DECREF(self);
        return NULL;
    }
    if (cu_launch_kernel == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "no CUDA driver opened (open_driver)");
        Py_DECREF(self);
        return NULL;
    }
    CUresult code = cu_ctx_get_current(&self->context);
    if (code != 0 || self->context == NULL) {
        if (code != 0) {
            driver_error(code, "cuCtxGetCurrent");
        } else {
            PyErr_SetString(PyExc_RuntimeError, "no current CUDA context to bind the launch to");
        }
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static PyMethodDef methods[] = {
    {"open_driver", open_driver, METH_VARARGS, "open_driver(path): the CUDA driver to launch with"},
    {"bind", bind, METH_VARARGS, "bind(function, grid, threads, shared, slots, inputs, takes, "
                                 "makes, fills) -> Launch"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "rope_dispatch_direct_launch",
    "One call that allocates a Triton kernel's outputs and launches it", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_rope_dispatch_direct_launch(void) {
    if (PyType_Ready(&LaunchType) < 0) {
        return NULL;
    }
    data_ptr_name = PyUnicode_InternFromString("data_ptr");
    new_empty_name = PyUnicode_InternFromString("new_empty");
    if (data_ptr_name == NULL || new_empty_name == NULL) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&LaunchType);
    if (PyModule_AddObject(module, "Launch", (PyObject *)&LaunchType) < 0) {
        Py_DECREF(&LaunchType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
