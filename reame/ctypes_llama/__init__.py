"""Hand-written ctypes binding of llama.cpp's `include/llama.h` at the pinned commit.

`types` holds the structs and enums, `api` the function prototypes (bound by
`api.load()`), `_lib` the loading of the shared libraries. Only `reame.model`
(the llama backend, its sampler chains and embedding context, the library's
loading) and `reame.quantize` call into this package.
"""
