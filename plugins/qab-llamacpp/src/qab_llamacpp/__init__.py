"""qab-llamacpp: llama.cpp (llama-cpp-python) as a qwen-apple-backend backend.

Installed beside ``qwen-apple-backend``, this plugin registers the backend
``llama.cpp`` through the ``qab_register_backends`` hook (entry-point group
``qwen_apple_backend``), so GGUF models run side by side with ``stock`` and
``fused`` in ``qab compare`` and ``qab bench``::

    qab compare --model path/to/mlx-checkpoint \\
        --backends stock,fused,llama.cpp=path/to/model.gguf --prompt "Hello"

It also ships ``qab-llamacpp convert-gguf``, which dequantizes a GGUF into a
checkpoint that stock mlx-lm loads (:mod:`qab_llamacpp.convert`).

The target is a string: nothing here imports llama_cpp.
"""

from __future__ import annotations

from qwen_apple_backend import hookimpl

__version__ = "0.1.0"


@hookimpl
def qab_register_backends(register):
    register("llama.cpp", "qab_llamacpp.backend:LlamaCppBackend",
             description="llama.cpp through llama-cpp-python: GGUF files (qab-llamacpp plugin)")
