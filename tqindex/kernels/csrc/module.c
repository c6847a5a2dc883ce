/* Makes the kernel library (fastscan.c, quantize.c, packing.c) importable as the extension module
 * tqindex.kernels._native; its functions are called through ctypes (tqindex/kernels/native.py). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "tqindex CPU kernels (used through ctypes).",
                                    -1, NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
