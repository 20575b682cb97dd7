"""Enums, structs and callback types of `include/llama.h` at the pin, in header order.

Field order and names mirror the header exactly; `tests/integration/test_layout.py`
compiles a C program against the pinned header and compares every `sizeof` and
`offsetof` with these definitions. Nothing Pythonic lives here.
"""

from __future__ import annotations

import ctypes
from ctypes import (
    POINTER,
    Structure,
    c_bool,
    c_char,
    c_char_p,
    c_double,
    c_float,
    c_int8,
    c_int32,
    c_int64,
    c_size_t,
    c_uint32,
    c_void_p,
)

# typedef int32_t llama_pos; llama_token; llama_seq_id;
llama_pos = c_int32
llama_token = c_int32
llama_seq_id = c_int32
# typedef struct llama_memory_i * llama_memory_t;
llama_memory_t = c_void_p
# Opaque handles: struct llama_vocab / llama_model / llama_context / llama_sampler *
llama_vocab_p = c_void_p
llama_model_p = c_void_p
llama_context_p = c_void_p
llama_sampler_p = c_void_p

# #define LLAMA_DEFAULT_SEED 0xFFFFFFFF
LLAMA_DEFAULT_SEED = 0xFFFFFFFF
# #define LLAMA_TOKEN_NULL -1
LLAMA_TOKEN_NULL = -1
# #define LLAMA_STATE_SEQ_FLAGS_*
LLAMA_STATE_SEQ_FLAGS_NONE = 0
LLAMA_STATE_SEQ_FLAGS_SWA_ONLY = 1
LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY = 1
LLAMA_STATE_SEQ_FLAGS_ON_DEVICE = 2
llama_state_seq_flags = c_uint32

# enum ggml_type (ggml.h): the KV cache types Reame uses
GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
GGML_TYPE_Q4_0 = 2
GGML_TYPE_Q8_0 = 8

# enum ggml_log_level (ggml.h)
GGML_LOG_LEVEL_NONE = 0
GGML_LOG_LEVEL_DEBUG = 1
GGML_LOG_LEVEL_INFO = 2
GGML_LOG_LEVEL_WARN = 3
GGML_LOG_LEVEL_ERROR = 4
GGML_LOG_LEVEL_CONT = 5

# enum ggml_numa_strategy (ggml-cpu.h)
GGML_NUMA_STRATEGY_DISABLED = 0

# enum llama_vocab_type
LLAMA_VOCAB_TYPE_NONE = 0
LLAMA_VOCAB_TYPE_SPM = 1
LLAMA_VOCAB_TYPE_BPE = 2
LLAMA_VOCAB_TYPE_WPM = 3
LLAMA_VOCAB_TYPE_UGM = 4
LLAMA_VOCAB_TYPE_RWKV = 5
LLAMA_VOCAB_TYPE_PLAMO2 = 6
LLAMA_VOCAB_TYPE_TEST = 7

# enum llama_token_attr
LLAMA_TOKEN_ATTR_UNDEFINED = 0
LLAMA_TOKEN_ATTR_CONTROL = 1 << 3

# enum llama_rope_scaling_type
LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED = -1

# enum llama_pooling_type
LLAMA_POOLING_TYPE_UNSPECIFIED = -1
LLAMA_POOLING_TYPE_NONE = 0
LLAMA_POOLING_TYPE_MEAN = 1
LLAMA_POOLING_TYPE_CLS = 2
LLAMA_POOLING_TYPE_LAST = 3

# enum llama_attention_type
LLAMA_ATTENTION_TYPE_UNSPECIFIED = -1
LLAMA_ATTENTION_TYPE_CAUSAL = 0

# enum llama_flash_attn_type
LLAMA_FLASH_ATTN_TYPE_AUTO = -1
LLAMA_FLASH_ATTN_TYPE_DISABLED = 0
LLAMA_FLASH_ATTN_TYPE_ENABLED = 1

# enum llama_split_mode
LLAMA_SPLIT_MODE_NONE = 0

# enum llama_load_mode
LLAMA_LOAD_MODE_AUTO = -1
LLAMA_LOAD_MODE_NONE = 0
LLAMA_LOAD_MODE_MMAP = 1
LLAMA_LOAD_MODE_MLOCK = 2
LLAMA_LOAD_MODE_MMAP_MLOCK = 3
LLAMA_LOAD_MODE_DIRECT_IO = 4

# enum llama_lazy_mode
LLAMA_LAZY_MODE_OFF = 0
LLAMA_LAZY_MODE_AUTO = 1
LLAMA_LAZY_MODE_ON = 2

# enum llama_context_type
LLAMA_CONTEXT_TYPE_DEFAULT = 0
LLAMA_CONTEXT_TYPE_MTP = 1

# C enums are int-sized on every ABI llama.cpp supports.
c_enum = ctypes.c_int


# typedef bool (*llama_progress_callback)(float progress, void * user_data);
llama_progress_callback = ctypes.CFUNCTYPE(c_bool, c_float, c_void_p)


# typedef struct llama_batch {
#     int32_t n_tokens; llama_token * token; float * embd; llama_pos * pos;
#     int32_t * n_seq_id; llama_seq_id ** seq_id; int8_t * logits;
# } llama_batch;
class llama_batch(Structure):
    _fields_ = [
        ("n_tokens", c_int32),
        ("token", POINTER(llama_token)),
        ("embd", POINTER(c_float)),
        ("pos", POINTER(llama_pos)),
        ("n_seq_id", POINTER(c_int32)),
        ("seq_id", POINTER(POINTER(llama_seq_id))),
        ("logits", POINTER(c_int8)),
    ]


# enum llama_model_kv_override_type
LLAMA_KV_OVERRIDE_TYPE_INT = 0
LLAMA_KV_OVERRIDE_TYPE_FLOAT = 1
LLAMA_KV_OVERRIDE_TYPE_BOOL = 2
LLAMA_KV_OVERRIDE_TYPE_STR = 3


class _llama_model_kv_override_value(ctypes.Union):
    _fields_ = [
        ("val_i64", c_int64),
        ("val_f64", c_double),
        ("val_bool", c_bool),
        ("val_str", c_char * 128),
    ]


# struct llama_model_kv_override {
#     enum llama_model_kv_override_type tag; char key[128]; union { ... };
# };
class llama_model_kv_override(Structure):
    _anonymous_ = ("value",)
    _fields_ = [
        ("tag", c_enum),
        ("key", c_char * 128),
        ("value", _llama_model_kv_override_value),
    ]


# struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; };
class llama_model_tensor_buft_override(Structure):
    _fields_ = [
        ("pattern", c_char_p),
        ("buft", c_void_p),
    ]


# struct llama_model_params { ... };
class llama_model_params(Structure):
    _fields_ = [
        ("devices", c_void_p),
        ("tensor_buft_overrides", POINTER(llama_model_tensor_buft_override)),
        ("n_gpu_layers", c_int32),
        ("split_mode", c_enum),
        ("load_mode", c_enum),
        ("lazy_mode", c_enum),
        ("main_gpu", c_int32),
        ("tensor_split", POINTER(c_float)),
        ("progress_callback", llama_progress_callback),
        ("progress_callback_user_data", c_void_p),
        ("kv_overrides", POINTER(llama_model_kv_override)),
        ("vocab_only", c_bool),
        ("check_tensors", c_bool),
        ("use_extra_bufts", c_bool),
        ("no_host", c_bool),
        ("no_alloc", c_bool),
        ("load_mtp", c_bool),
    ]


# struct llama_sampler_seq_config { llama_seq_id seq_id; struct llama_sampler * sampler; };
class llama_sampler_seq_config(Structure):
    _fields_ = [
        ("seq_id", llama_seq_id),
        ("sampler", llama_sampler_p),
    ]


# typedef bool (*ggml_backend_sched_eval_callback)(struct ggml_tensor * t, bool ask, void * user_data);
ggml_backend_sched_eval_callback = ctypes.CFUNCTYPE(c_bool, c_void_p, c_bool, c_void_p)
# typedef bool (*ggml_abort_callback)(void * data);
ggml_abort_callback = ctypes.CFUNCTYPE(c_bool, c_void_p)


# struct llama_context_params { ... };
class llama_context_params(Structure):
    _fields_ = [
        ("n_ctx", c_uint32),
        ("n_batch", c_uint32),
        ("n_ubatch", c_uint32),
        ("n_seq_max", c_uint32),
        ("n_rs_seq", c_uint32),
        ("n_outputs_max", c_uint32),
        ("n_outputs_max_per_seq", c_uint32),
        ("n_threads", c_int32),
        ("n_threads_batch", c_int32),
        ("ctx_type", c_enum),
        ("rope_scaling_type", c_enum),
        ("pooling_type", c_enum),
        ("attention_type", c_enum),
        ("flash_attn_type", c_enum),
        ("rope_freq_base", c_float),
        ("rope_freq_scale", c_float),
        ("yarn_ext_factor", c_float),
        ("yarn_attn_factor", c_float),
        ("yarn_beta_fast", c_float),
        ("yarn_beta_slow", c_float),
        ("yarn_orig_ctx", c_uint32),
        ("defrag_thold", c_float),
        ("cb_eval", ggml_backend_sched_eval_callback),
        ("cb_eval_user_data", c_void_p),
        ("type_k", c_enum),
        ("type_v", c_enum),
        ("abort_callback", ggml_abort_callback),
        ("abort_callback_data", c_void_p),
        ("embeddings", c_bool),
        ("offload_kqv", c_bool),
        ("no_perf", c_bool),
        ("op_offload", c_bool),
        ("swa_full", c_bool),
        ("kv_unified", c_bool),
        ("samplers", POINTER(llama_sampler_seq_config)),
        ("n_samplers", c_size_t),
        ("ctx_other", llama_context_p),
    ]


# enum llama_ftype: the file types `reame pull --quantize` writes (LLAMA_FTYPE_MOSTLY_*)
LLAMA_FTYPE_MOSTLY_Q4_0 = 2
LLAMA_FTYPE_MOSTLY_Q4_1 = 3
LLAMA_FTYPE_MOSTLY_Q8_0 = 7
LLAMA_FTYPE_MOSTLY_Q4_K_S = 14
LLAMA_FTYPE_MOSTLY_Q4_K_M = 15
LLAMA_FTYPE_MOSTLY_Q5_K_M = 17
LLAMA_FTYPE_MOSTLY_Q6_K = 18
# enum ggml_type: GGML_TYPE_COUNT means "the ftype's choice" for the output and embedding types
GGML_TYPE_COUNT = 43


# typedef struct llama_model_quantize_params {
#     int32_t nthread; enum llama_ftype ftype; enum ggml_type output_tensor_type;
#     enum ggml_type token_embedding_type; bool allow_requantize; bool quantize_output_tensor;
#     bool only_copy; bool pure; bool keep_split; bool dry_run;
#     const struct llama_model_imatrix_data * imatrix; const struct llama_model_kv_override * kv_overrides;
#     const struct llama_model_tensor_override * tt_overrides; const int32_t * prune_layers;
#     size_t max_buf_size;
# } llama_model_quantize_params;
class llama_model_quantize_params(Structure):
    _fields_ = [
        ("nthread", c_int32),
        ("ftype", c_enum),
        ("output_tensor_type", c_enum),
        ("token_embedding_type", c_enum),
        ("allow_requantize", c_bool),
        ("quantize_output_tensor", c_bool),
        ("only_copy", c_bool),
        ("pure", c_bool),
        ("keep_split", c_bool),
        ("dry_run", c_bool),
        ("imatrix", c_void_p),
        ("kv_overrides", c_void_p),
        ("tt_overrides", c_void_p),
        ("prune_layers", POINTER(c_int32)),
        ("max_buf_size", c_size_t),
    ]


# typedef struct llama_token_data { llama_token id; float logit; float p; } llama_token_data;
class llama_token_data(Structure):
    _fields_ = [
        ("id", llama_token),
        ("logit", c_float),
        ("p", c_float),
    ]


# typedef struct llama_token_data_array { llama_token_data * data; size_t size; int64_t selected;
#                                         bool sorted; } llama_token_data_array;
class llama_token_data_array(Structure):
    _fields_ = [
        ("data", POINTER(llama_token_data)),
        ("size", c_size_t),
        ("selected", c_int64),
        ("sorted", c_bool),
    ]


# typedef struct llama_logit_bias { llama_token token; float bias; } llama_logit_bias;
class llama_logit_bias(Structure):
    _fields_ = [
        ("token", llama_token),
        ("bias", c_float),
    ]


# typedef struct llama_sampler_chain_params { bool no_perf; } llama_sampler_chain_params;
class llama_sampler_chain_params(Structure):
    _fields_ = [
        ("no_perf", c_bool),
    ]


# typedef struct llama_chat_message { const char * role; const char * content; } llama_chat_message;
class llama_chat_message(Structure):
    _fields_ = [
        ("role", c_char_p),
        ("content", c_char_p),
    ]


# typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);
ggml_log_callback = ctypes.CFUNCTYPE(None, c_enum, c_char_p, c_void_p)


# ggml.h: #define GGML_MAX_N_THREADS 512; enum ggml_backend_dev_type (ggml-backend.h)
GGML_MAX_N_THREADS = 512
GGML_BACKEND_DEVICE_TYPE_CPU = 0


# ggml.h: struct ggml_threadpool_params { bool cpumask[GGML_MAX_N_THREADS]; int n_threads;
#     enum ggml_sched_priority prio; uint32_t poll; bool strict_cpu; bool paused; };
class ggml_threadpool_params(Structure):
    _fields_ = [
        ("cpumask", c_bool * GGML_MAX_N_THREADS),
        ("n_threads", ctypes.c_int),
        ("prio", c_enum),
        ("poll", c_uint32),
        ("strict_cpu", c_bool),
        ("paused", c_bool),
    ]


# ggml-cpu.h, reached through ggml_backend_reg_get_proc_address (the CPU backend may be a
# run-time-loaded variant library): struct ggml_threadpool * ggml_threadpool_new(params *);
ggml_threadpool_new_t = ctypes.CFUNCTYPE(c_void_p, ctypes.POINTER(ggml_threadpool_params))
# void ggml_threadpool_free(struct ggml_threadpool * threadpool);
ggml_threadpool_free_t = ctypes.CFUNCTYPE(None, c_void_p)
# Reame's patch (third_party/patches): void ggml_cpu_set_thread_use_ref(bool), reached the same way.
ggml_cpu_set_thread_use_ref_t = ctypes.CFUNCTYPE(None, c_bool)


# Every struct bound above, for the layout test.
BOUND_STRUCTS: tuple[type[Structure], ...] = (
    llama_batch,
    llama_model_kv_override,
    llama_model_tensor_buft_override,
    llama_model_params,
    llama_sampler_seq_config,
    llama_context_params,
    llama_logit_bias,
    llama_sampler_chain_params,
    llama_chat_message,
    llama_model_quantize_params,
    ggml_threadpool_params,
)
