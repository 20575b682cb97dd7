"""The model: the Backend protocol and LlamaBackend (the only user of the ctypes binding), its settings and
fingerprint, sampler steps, the chat template. Below both the engine and speculative decoding."""
