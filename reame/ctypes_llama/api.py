"""Prototypes of the llama.h functions Reame uses, in header order.

Each binding is preceded by its C declaration so a reviewer can diff this file
against `include/llama.h` when the pin moves. `load()` binds them all onto this
module (`api.llama_decode(...)`); a symbol missing from the loaded library is a
one-line ModelError. Every pointer-returning function has its `restype` set:
the ctypes default (int) would truncate 64-bit pointers.
"""

from __future__ import annotations

from ctypes import POINTER, c_bool, c_char_p, c_float, c_int32, c_size_t, c_uint8, c_uint32, c_uint64, c_void_p
from typing import Any

from reame.ctypes_llama import _lib
from reame.ctypes_llama.types import (
    c_enum,
    ggml_abort_callback,
    ggml_threadpool_params,
    ggml_log_callback,
    llama_batch,
    llama_chat_message,
    llama_context_p,
    llama_context_params,
    llama_logit_bias,
    llama_memory_t,
    llama_model_p,
    llama_model_params,
    llama_model_quantize_params,
    llama_pos,
    llama_sampler_chain_params,
    llama_sampler_p,
    llama_seq_id,
    llama_token,
    llama_token_data_array,
    llama_vocab_p,
)
from reame.errors import ModelError

_PROTOTYPES: list[tuple[str, list[Any], Any, str]] = []
_bound = False
_missing: set[str] = set()


def _declare(name: str, argtypes: list[Any], restype: Any, feature: str = "") -> None:
    """A prototype to bind; with `feature`, the symbol is optional: a library without it loads, and only
    that feature fails, naming what is missing."""
    _PROTOTYPES.append((name, argtypes, restype, feature))


# LLAMA_API struct llama_model_params llama_model_default_params(void);
_declare("llama_model_default_params", [], llama_model_params)
# LLAMA_API struct llama_context_params llama_context_default_params(void);
_declare("llama_context_default_params", [], llama_context_params)
# LLAMA_API struct llama_sampler_chain_params llama_sampler_chain_default_params(void);
_declare("llama_sampler_chain_default_params", [], llama_sampler_chain_params)
# LLAMA_API struct llama_model_quantize_params llama_model_quantize_default_params(void);
_declare("llama_model_quantize_default_params", [], llama_model_quantize_params)
# LLAMA_API void llama_backend_init(void);
_declare("llama_backend_init", [], None)
# LLAMA_API void llama_attach_threadpool(struct llama_context * ctx, ggml_threadpool_t threadpool,
#                                        ggml_threadpool_t threadpool_batch);
_declare("llama_attach_threadpool", [llama_context_p, c_void_p, c_void_p], None)
# LLAMA_API struct llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params);
_declare("llama_model_load_from_file", [c_char_p, llama_model_params], llama_model_p)
# LLAMA_API void llama_model_free(struct llama_model * model);
_declare("llama_model_free", [llama_model_p], None)
# LLAMA_API struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
_declare("llama_init_from_model", [llama_model_p, llama_context_params], llama_context_p)
# LLAMA_API void llama_free(struct llama_context * ctx);
_declare("llama_free", [llama_context_p], None)
# LLAMA_API uint32_t llama_n_ctx(const struct llama_context * ctx);
_declare("llama_n_ctx", [llama_context_p], c_uint32)
# LLAMA_API uint32_t llama_n_ctx_seq(const struct llama_context * ctx);
_declare("llama_n_ctx_seq", [llama_context_p], c_uint32)
# LLAMA_API uint32_t llama_n_batch(const struct llama_context * ctx);
_declare("llama_n_batch", [llama_context_p], c_uint32)
# LLAMA_API uint32_t llama_n_seq_max(const struct llama_context * ctx);
_declare("llama_n_seq_max", [llama_context_p], c_uint32)
# LLAMA_API llama_memory_t llama_get_memory(const struct llama_context * ctx);
_declare("llama_get_memory", [llama_context_p], llama_memory_t)
# LLAMA_API const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);
_declare("llama_model_get_vocab", [llama_model_p], llama_vocab_p)
# LLAMA_API int32_t llama_model_n_ctx_train(const struct llama_model * model);
_declare("llama_model_n_ctx_train", [llama_model_p], c_int32)
# LLAMA_API int32_t llama_model_n_embd(const struct llama_model * model);
_declare("llama_model_n_embd", [llama_model_p], c_int32)
# LLAMA_API int32_t llama_model_n_swa(const struct llama_model * model);
_declare("llama_model_n_swa", [llama_model_p], c_int32)
# LLAMA_API int32_t llama_vocab_n_tokens(const struct llama_vocab * vocab);
_declare("llama_vocab_n_tokens", [llama_vocab_p], c_int32)
# LLAMA_API int32_t llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);
_declare("llama_model_meta_val_str", [llama_model_p, c_char_p, c_char_p, c_size_t], c_int32)
# LLAMA_API int32_t llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
_declare("llama_model_desc", [llama_model_p, c_char_p, c_size_t], c_int32)
# LLAMA_API uint64_t llama_model_size(const struct llama_model * model);
_declare("llama_model_size", [llama_model_p], c_uint64)
# LLAMA_API const char * llama_model_chat_template(const struct llama_model * model, const char * name);
_declare("llama_model_chat_template", [llama_model_p, c_char_p], c_char_p)
# LLAMA_API uint64_t llama_model_n_params(const struct llama_model * model);
_declare("llama_model_n_params", [llama_model_p], c_uint64)
# LLAMA_API bool llama_model_is_recurrent(const struct llama_model * model);
_declare("llama_model_is_recurrent", [llama_model_p], c_bool)
# LLAMA_API bool llama_model_is_hybrid(const struct llama_model * model);
_declare("llama_model_is_hybrid", [llama_model_p], c_bool)
# LLAMA_API uint32_t llama_model_quantize(const char * fname_inp, const char * fname_out,
#                                         const llama_model_quantize_params * params);
_declare("llama_model_quantize", [c_char_p, c_char_p, POINTER(llama_model_quantize_params)], c_uint32)

# --- Memory ---
# LLAMA_API void llama_memory_clear(llama_memory_t mem, bool data);
_declare("llama_memory_clear", [llama_memory_t, c_bool], None)
# LLAMA_API bool llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
_declare("llama_memory_seq_rm", [llama_memory_t, llama_seq_id, llama_pos, llama_pos], c_bool)
# LLAMA_API void llama_memory_seq_cp(llama_memory_t mem, llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1);
_declare("llama_memory_seq_cp", [llama_memory_t, llama_seq_id, llama_seq_id, llama_pos, llama_pos], None)
# LLAMA_API void llama_memory_seq_add(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos delta);
_declare("llama_memory_seq_add", [llama_memory_t, llama_seq_id, llama_pos, llama_pos, llama_pos], None)
# LLAMA_API bool llama_memory_can_shift(llama_memory_t mem);
_declare("llama_memory_can_shift", [llama_memory_t], c_bool)
# LLAMA_API void llama_memory_seq_keep(llama_memory_t mem, llama_seq_id seq_id);
_declare("llama_memory_seq_keep", [llama_memory_t, llama_seq_id], None)
# LLAMA_API llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id);
_declare("llama_memory_seq_pos_max", [llama_memory_t, llama_seq_id], llama_pos)

# --- State / sessions ---
# LLAMA_API size_t llama_state_seq_get_size(struct llama_context * ctx, llama_seq_id seq_id);
_declare("llama_state_seq_get_size", [llama_context_p, llama_seq_id], c_size_t)
# LLAMA_API size_t llama_state_seq_get_data(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id);
_declare("llama_state_seq_get_data", [llama_context_p, POINTER(c_uint8), c_size_t, llama_seq_id], c_size_t)
# LLAMA_API size_t llama_state_seq_set_data(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id);
_declare("llama_state_seq_set_data", [llama_context_p, POINTER(c_uint8), c_size_t, llama_seq_id], c_size_t)

# --- Decoding ---
# LLAMA_API struct llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max);
_declare("llama_batch_init", [c_int32, c_int32, c_int32], llama_batch)
# LLAMA_API void llama_batch_free(struct llama_batch batch);
_declare("llama_batch_free", [llama_batch], None)
# LLAMA_API int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);
_declare("llama_decode", [llama_context_p, llama_batch], c_int32)
# LLAMA_API void llama_set_abort_callback(struct llama_context * ctx, ggml_abort_callback abort_callback,
#                                         void * abort_callback_data);
_declare("llama_set_abort_callback", [llama_context_p, ggml_abort_callback, c_void_p], None)
# LLAMA_API float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);
_declare("llama_get_logits_ith", [llama_context_p, c_int32], POINTER(c_float))
# LLAMA_API float * llama_get_embeddings_ith(struct llama_context * ctx, int32_t i);
_declare("llama_get_embeddings_ith", [llama_context_p, c_int32], POINTER(c_float))
# LLAMA_API float * llama_get_embeddings_seq(struct llama_context * ctx, llama_seq_id seq_id);
_declare("llama_get_embeddings_seq", [llama_context_p, llama_seq_id], POINTER(c_float),
         "embeddings")

# --- Vocab ---
# LLAMA_API const char * llama_vocab_get_text(const struct llama_vocab * vocab, llama_token token);
_declare("llama_vocab_get_text", [llama_vocab_p, llama_token], c_char_p)
# LLAMA_API bool llama_vocab_is_eog(const struct llama_vocab * vocab, llama_token token);
_declare("llama_vocab_is_eog", [llama_vocab_p, llama_token], c_bool)
# LLAMA_API llama_token llama_vocab_bos(const struct llama_vocab * vocab);
_declare("llama_vocab_bos", [llama_vocab_p], llama_token)
# LLAMA_API llama_token llama_vocab_eos(const struct llama_vocab * vocab);
_declare("llama_vocab_eos", [llama_vocab_p], llama_token)
# LLAMA_API bool llama_vocab_get_add_bos(const struct llama_vocab * vocab);
_declare("llama_vocab_get_add_bos", [llama_vocab_p], c_bool)
# LLAMA_API llama_token llama_vocab_fim_pre(const struct llama_vocab * vocab);
_declare("llama_vocab_fim_pre", [llama_vocab_p], llama_token)
# LLAMA_API llama_token llama_vocab_fim_suf(const struct llama_vocab * vocab);
_declare("llama_vocab_fim_suf", [llama_vocab_p], llama_token)
# LLAMA_API llama_token llama_vocab_fim_mid(const struct llama_vocab * vocab);
_declare("llama_vocab_fim_mid", [llama_vocab_p], llama_token)
# LLAMA_API llama_token llama_vocab_fim_rep(const struct llama_vocab * vocab);
_declare("llama_vocab_fim_rep", [llama_vocab_p], llama_token)
# LLAMA_API llama_token llama_vocab_fim_sep(const struct llama_vocab * vocab);
_declare("llama_vocab_fim_sep", [llama_vocab_p], llama_token)

# --- Tokenization ---
# LLAMA_API int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
#                                  llama_token * tokens, int32_t n_tokens_max, bool add_special, bool parse_special);
_declare("llama_tokenize",
         [llama_vocab_p, c_char_p, c_int32, POINTER(llama_token), c_int32, c_bool, c_bool], c_int32)
# LLAMA_API int32_t llama_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf,
#                                        int32_t length, int32_t lstrip, bool special);
_declare("llama_token_to_piece", [llama_vocab_p, llama_token, c_char_p, c_int32, c_int32, c_bool], c_int32)
# LLAMA_API int32_t llama_detokenize(const struct llama_vocab * vocab, const llama_token * tokens, int32_t n_tokens,
#                                    char * text, int32_t text_len_max, bool remove_special, bool unparse_special);
_declare("llama_detokenize",
         [llama_vocab_p, POINTER(llama_token), c_int32, c_char_p, c_int32, c_bool, c_bool], c_int32)

# --- Chat templates ---
# LLAMA_API int32_t llama_chat_apply_template(const char * tmpl, const struct llama_chat_message * chat,
#                                             size_t n_msg, bool add_ass, char * buf, int32_t length);
_declare("llama_chat_apply_template",
         [c_char_p, POINTER(llama_chat_message), c_size_t, c_bool, c_char_p, c_int32], c_int32)
# LLAMA_API int32_t llama_chat_builtin_templates(const char ** output, size_t len);
_declare("llama_chat_builtin_templates", [POINTER(c_char_p), c_size_t], c_int32)

# LLAMA_API float * llama_get_sampled_logits_ith(struct llama_context * ctx, int32_t i);
_declare("llama_get_sampled_logits_ith", [llama_context_p, c_int32], POINTER(c_float),
         "drafting with a draft model")
# LLAMA_API uint32_t llama_get_sampled_logits_count_ith(struct llama_context * ctx, int32_t i);
_declare("llama_get_sampled_logits_count_ith", [llama_context_p, c_int32], c_uint32,
         "drafting with a draft model")
# LLAMA_API llama_token * llama_get_sampled_candidates_ith(struct llama_context * ctx, int32_t i);
_declare("llama_get_sampled_candidates_ith", [llama_context_p, c_int32], POINTER(llama_token),
         "drafting with a draft model")
# LLAMA_API uint32_t llama_get_sampled_candidates_count_ith(struct llama_context * ctx, int32_t i);
_declare("llama_get_sampled_candidates_count_ith", [llama_context_p, c_int32], c_uint32,
         "drafting with a draft model")

# --- Sampling API ---
# LLAMA_API bool llama_set_sampler(struct llama_context * ctx, llama_seq_id seq_id, struct llama_sampler * smpl);
_declare("llama_set_sampler", [llama_context_p, llama_seq_id, llama_sampler_p], c_bool,
         "drafting with a draft model")
# LLAMA_API void llama_sampler_accept(struct llama_sampler * smpl, llama_token token);
_declare("llama_sampler_accept", [llama_sampler_p, llama_token], None)
# LLAMA_API void llama_sampler_apply(struct llama_sampler * smpl, llama_token_data_array * cur_p);
_declare("llama_sampler_apply", [llama_sampler_p, POINTER(llama_token_data_array)], None)
# LLAMA_API void llama_sampler_free(struct llama_sampler * smpl);
_declare("llama_sampler_free", [llama_sampler_p], None)
# LLAMA_API struct llama_sampler * llama_sampler_chain_init(struct llama_sampler_chain_params params);
_declare("llama_sampler_chain_init", [llama_sampler_chain_params], llama_sampler_p)
# LLAMA_API void llama_sampler_chain_add(struct llama_sampler * chain, struct llama_sampler * smpl);
_declare("llama_sampler_chain_add", [llama_sampler_p, llama_sampler_p], None)
# LLAMA_API struct llama_sampler * llama_sampler_chain_get(struct llama_sampler * chain, int32_t i);
_declare("llama_sampler_chain_get", [llama_sampler_p, c_int32], llama_sampler_p)
# LLAMA_API struct llama_sampler * llama_sampler_init_greedy(void);
_declare("llama_sampler_init_greedy", [], llama_sampler_p)
# LLAMA_API struct llama_sampler * llama_sampler_init_dist(uint32_t seed);
_declare("llama_sampler_init_dist", [c_uint32], llama_sampler_p)
# LLAMA_API struct llama_sampler * llama_sampler_init_top_k(int32_t k);
_declare("llama_sampler_init_top_k", [c_int32], llama_sampler_p)
# LLAMA_API struct llama_sampler * llama_sampler_init_top_p(float p, size_t min_keep);
_declare("llama_sampler_init_top_p", [c_float, c_size_t], llama_sampler_p)
# LLAMA_API struct llama_sampler * llama_sampler_init_min_p(float p, size_t min_keep);
_declare("llama_sampler_init_min_p", [c_float, c_size_t], llama_sampler_p)
# LLAMA_API struct llama_sampler * llama_sampler_init_temp(float t);
_declare("llama_sampler_init_temp", [c_float], llama_sampler_p)
# LLAMA_API struct llama_sampler * llama_sampler_init_grammar(const struct llama_vocab * vocab,
#                                                             const char * grammar_str, const char * grammar_root);
_declare("llama_sampler_init_grammar", [llama_vocab_p, c_char_p, c_char_p], llama_sampler_p, "structured output")
# LLAMA_API struct llama_sampler * llama_sampler_init_penalties(int32_t n_vocab, int32_t penalty_last_n,
#                                                               float penalty_repeat, float penalty_freq, float penalty_present);
_declare("llama_sampler_init_penalties", [c_int32, c_int32, c_float, c_float, c_float], llama_sampler_p)
# LLAMA_API struct llama_sampler * llama_sampler_init_logit_bias(int32_t n_vocab, int32_t n_logit_bias,
#                                                                const llama_logit_bias * logit_bias);
_declare("llama_sampler_init_logit_bias", [c_int32, c_int32, POINTER(llama_logit_bias)], llama_sampler_p)
# LLAMA_API llama_token llama_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx);
_declare("llama_sampler_sample", [llama_sampler_p, llama_context_p, c_int32], llama_token)

# --- Misc ---
# LLAMA_API void llama_log_set(ggml_log_callback log_callback, void * user_data);
_declare("llama_log_set", [ggml_log_callback, c_void_p], None)

# From ggml.h: GGML_API struct ggml_threadpool_params ggml_threadpool_params_default(int n_threads);
_declare("ggml_threadpool_params_default", [c_int32], ggml_threadpool_params,
         "a persistent CPU threadpool")
# From ggml-backend.h: GGML_API ggml_backend_dev_t ggml_backend_dev_by_type(enum ggml_backend_dev_type type);
_declare("ggml_backend_dev_by_type", [c_enum], c_void_p, "a persistent CPU threadpool")
# GGML_API ggml_backend_reg_t ggml_backend_dev_backend_reg(ggml_backend_dev_t device);
_declare("ggml_backend_dev_backend_reg", [c_void_p], c_void_p, "a persistent CPU threadpool")
# GGML_API void * ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name);
_declare("ggml_backend_reg_get_proc_address", [c_void_p, c_char_p], c_void_p,
         "a persistent CPU threadpool")
# From ggml-backend.h: a portable build registers its best CPU variant library this way.
# GGML_API void ggml_backend_load_all_from_path(const char * dir_path);
_declare("ggml_backend_load_all_from_path", [c_char_p], None, "a portable build's CPU variants")



def load() -> None:
    """Load the libraries and bind every prototype onto this module (idempotent)."""
    global _bound
    if _bound:
        return
    lib = _lib.load_libraries()
    namespace = globals()
    for name, argtypes, restype, feature in _PROTOTYPES:
        try:
            function = getattr(lib, name)
        except AttributeError:
            if not feature:
                raise ModelError(f"the loaded libllama lacks {name}: it is not the pinned build; "
                                 "rebuild with: python build_zipapp.py --lib") from None
            _missing.add(name)
            namespace[name] = _unavailable(name, feature)
            continue
        function.argtypes = argtypes
        function.restype = restype
        namespace[name] = function
    _bound = True


def available(name: str) -> bool:
    """Whether the loaded library has an optional symbol."""
    return name not in _missing


def _unavailable(name: str, feature: str) -> Any:
    def missing(*_args: Any) -> Any:
        raise ModelError(f"this libllama lacks {name}, which {feature} needs; rebuild the pinned library "
                         "with: python build_zipapp.py --lib")
    return missing


def declared_names() -> list[str]:
    """Names of every bound function, in header order (for tests and docs)."""
    return [name for name, _, _, _ in _PROTOTYPES]


def __getattr__(name: str) -> Any:
    # Reached only for names not bound yet: say why instead of a bare AttributeError.
    if any(name == declared for declared, _, _, _ in _PROTOTYPES):
        raise ModelError(f"{name} used before reame.ctypes_llama.api.load()")
    raise AttributeError(name)


__all__ = ["declared_names", "load"]
