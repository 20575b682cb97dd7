"""Hand-written ctypes binding of llama.cpp's `include/llama.h` at the pinned commit.

`types` holds the structs and enums, `api` the function prototypes (bound by
`api.load()`), `_lib` the loading of the shared libraries. Only
`reame.model.backend` may call into this package.
"""
