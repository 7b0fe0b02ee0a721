"""GGUF to an MLX / Hugging Face checkpoint that stock mlx-lm loads.

:func:`gguf_to_mlx` dequantizes every tensor of a GGUF file with the ``gguf``
package (numpy only: no llama.cpp, no torch), renames it to the Hugging Face
layout, undoes the rotary permutation llama.cpp's converter applies to the
query and key projections, and writes ``config.json``, ``model.safetensors``
and tokenizer files built from the GGUF's own tokenizer metadata
(``tokenizer.ggml.*``: byte-level BPE vocabulary, merges, token types, special
token ids, pre-tokenizer name and chat template).

Supported: the ``llama`` architecture (Llama, SmolLM, ...) with a byte-level
BPE (``tokenizer.ggml.model == "gpt2"``) vocabulary. Anything else raises
:class:`GGUFConversionError` naming what is missing.

Example:
    >>> from qab_llamacpp.convert import gguf_to_mlx
    >>> out = gguf_to_mlx("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-mlx")
    >>> from mlx_lm import load
    >>> model, tokenizer = load(str(out))
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

__all__ = ["GGUFConversionError", "gguf_config", "gguf_to_mlx", "gguf_tokenizer",
           "read_metadata", "unpermute_rope"]

PathLike = Union[str, Path]


class GGUFConversionError(ValueError):
    """The GGUF file uses an architecture, tokenizer or feature the converter does not handle."""


# GGUF tensor name (after ``blk.N.``) -> Hugging Face name (after ``model.layers.N.``).
_LLAMA_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LLAMA_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# Pre-tokenizer split rules by ``tokenizer.ggml.pre`` (llama.cpp's names). Each
# entry: split every digit apart first (as llama.cpp's "\p{N}" rule does), then
# GPT-2's regex inside byte-level encoding.
_GPT2_ONLY = {"default", "gpt-2", "gpt2"}
_DIGITS_THEN_GPT2 = {"smollm", "codeshell", "exaone", "minerva"}

# ``tokenizer.ggml.token_type`` values (llama.cpp's ``llama_token_type``).
_CONTROL, _USER_DEFINED = 3, 4


# ------------------------------------------------------------------------- metadata


def read_metadata(reader: Any) -> dict:
    """Every scalar and array field of a ``gguf.GGUFReader`` as plain Python values."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = field.contents()
        except Exception:  # noqa: BLE001 - a field type the reader cannot decode
            continue
    return out


def _f32(value: float) -> float:
    """The shortest decimal that round-trips a float32 (``9.99999974e-06`` -> ``1e-05``)."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def gguf_config(meta: dict, *, has_output: bool, dtype: str = "float32") -> dict:
    """A Hugging Face ``config.json`` for a ``llama``-architecture GGUF.

    Args:
        meta (dict): GGUF metadata (:func:`read_metadata`).
        has_output (bool): whether the file has its own ``output.weight`` (else tied).
        dtype (str): weight dtype written (recorded as ``torch_dtype``).

    Returns:
        dict: the config.

    Raises:
        GGUFConversionError: for another architecture or an unsupported rope scaling.
    """
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFConversionError(
            f"architecture {arch!r} is not supported by this converter (only 'llama')")

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    rot_dims = int(get("rope.dimension_count", head_dim))
    if rot_dims != head_dim:
        raise GGUFConversionError(f"partial rotary embeddings ({rot_dims} of {head_dim} dims) "
                                  "are not supported")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    vocab = int(get("vocab_size", len(tokens)))
    rope_scaling = None
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise GGUFConversionError(f"rope scaling {scaling!r} is not supported")
        rope_scaling = {"type": "linear", "factor": _f32(get("rope.scaling.factor"))}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": vocab,
        "tie_word_embeddings": not has_output,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }
    for name in ("bos", "eos", "padding"):
        tid = meta.get(f"tokenizer.ggml.{name}_token_id")
        if tid is not None:
            config[f"{'pad' if name == 'padding' else name}_token_id"] = int(tid)
    return config


# ------------------------------------------------------------------------- tensors


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary reordering of a query or key projection.

    llama.cpp rotates adjacent pairs ``(x[2i], x[2i+1])`` of each head; Hugging
    Face (and mlx-lm) rotate the two halves ``(x[i], x[i + D/2])``. The GGUF
    converter therefore interleaves the two halves of every head's rows; this
    puts them back.

    Shapes:
        w: [n_heads * D, H] (or [n_heads * D] for a bias); returns the same shape.
    """
    rows = w.shape[0]
    d = rows // n_heads
    if d * n_heads != rows or d % 2:
        raise GGUFConversionError(f"cannot split {rows} rows into {n_heads} heads of even size")
    # GGUF row order inside a head: (pair index p, member m) -> HF order (m, p).
    return (w.reshape(n_heads, d // 2, 2, *w.shape[1:])
             .swapaxes(1, 2)
             .reshape(w.shape))


def _hf_name(name: str) -> Optional[str]:
    if name in _LLAMA_GLOBAL:
        return _LLAMA_GLOBAL[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LLAMA_BLOCK:
        return f"model.layers.{m.group(1)}.{_LLAMA_BLOCK[m.group(2)]}"
    return None


def _dequantize(tensor: Any) -> np.ndarray:
    from gguf import quants

    arr = quants.dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dimensions innermost first; numpy wants them outermost first.
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    return np.asarray(arr, dtype=np.float32).reshape(shape)


# ------------------------------------------------------------------------- tokenizer


def gguf_tokenizer(meta: dict):
    """A ``transformers.PreTrainedTokenizerFast`` built from the GGUF's tokenizer metadata.

    Byte-level BPE only (``tokenizer.ggml.model == "gpt2"``): vocabulary and merges
    as stored, control tokens (type 3) added as special tokens and user-defined
    ones (type 4) as plain added tokens (both matched whole, as llama.cpp does),
    the pre-tokenizer chosen by ``tokenizer.ggml.pre``, BOS prepended only when
    ``tokenizer.ggml.add_bos_token`` says so, and the chat template copied.

    Raises:
        GGUFConversionError: for another tokenizer model or an unknown pre-tokenizer.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFConversionError(f"tokenizer model {kind!r} is not supported (only byte-level "
                                  "BPE, 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_ONLY:
        pre_tok = byte_level
    elif pre in _DIGITS_THEN_GPT2:
        pre_tok = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level])
    else:
        raise GGUFConversionError(f"pre-tokenizer {pre!r} is not supported; known: "
                                  f"{sorted(_GPT2_ONLY | _DIGITS_THEN_GPT2)}")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFConversionError("the GGUF vocabulary repeats a token")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(t, special=(ty == _CONTROL), normalized=False)
             for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED)]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])

    def tok_of(key):
        tid = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(tid)] if tid is not None and 0 <= int(tid) < len(tokens) else None

    bos = tok_of("bos")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, vocab[bos])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    kwargs = {k: v for k, v in {"bos_token": bos, "eos_token": tok_of("eos"),
                                "unk_token": tok_of("unknown"),
                                "pad_token": tok_of("padding")}.items() if v is not None}
    template = meta.get("tokenizer.chat_template")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False,
                                   **kwargs)
    if template:
        fast.chat_template = template
    return fast


# ------------------------------------------------------------------------- converter


def gguf_to_mlx(gguf_path: PathLike, out_dir: PathLike, *, dtype: str = "float32",
                overwrite: bool = False) -> Path:
    """Convert a GGUF file into a checkpoint directory that stock mlx-lm loads.

    Args:
        gguf_path (str | Path): the ``.gguf`` file (any tensor type ``gguf`` can
            dequantize: F32, F16, BF16, Q8_0, Q4_0, Q4_1, K-quants ...).
        out_dir (str | Path): directory to write (created).
        dtype (str): ``"float32"`` (default; every dequantized value is exact),
            ``"float16"`` or ``"bfloat16"``.
        overwrite (bool): allow writing into a non-empty directory. Default False.

    Returns:
        Path: ``out_dir``, holding ``config.json``, ``model.safetensors``, the
        tokenizer files and ``qab_gguf_source.json`` (source file, tensor types).

    Raises:
        FileNotFoundError: if ``gguf_path`` does not exist.
        FileExistsError: if ``out_dir`` is not empty and ``overwrite`` is False.
        GGUFConversionError: for a file ``gguf`` cannot read (bad magic,
            truncated), or an unsupported architecture, tokenizer or tensor.
    """
    import hashlib

    from gguf import GGUFReader

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path}: no such GGUF file")
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} is not empty (pass overwrite=True / --overwrite)")
    try:
        reader = GGUFReader(str(gguf_path))
        meta = read_metadata(reader)
    except (ValueError, IndexError, EOFError) as exc:  # gguf's own messages name no file
        raise GGUFConversionError(f"{gguf_path}: not a readable GGUF file ({exc})") from exc
    names = {t.name for t in reader.tensors}
    config = gguf_config(meta, has_output="output.weight" in names, dtype=dtype)
    tokenizer = gguf_tokenizer(meta)

    weights: dict[str, np.ndarray] = {}
    types: dict[str, int] = {}
    for t in reader.tensors:
        hf = _hf_name(t.name)
        if hf is None:
            raise GGUFConversionError(f"tensor {t.name!r} has no Hugging Face counterpart here")
        w = _dequantize(t)
        if hf.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rope(w, config["num_attention_heads"])
        elif hf.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rope(w, config["num_key_value_heads"])
        weights[hf] = w
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    if any(k.endswith("_proj.bias") for k in weights):
        config["attention_bias"] = True

    out_dir.mkdir(parents=True, exist_ok=True)
    _save_safetensors(weights, out_dir / "model.safetensors", dtype)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(str(out_dir))
    digest = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    (out_dir / "qab_gguf_source.json").write_text(json.dumps({
        "source": gguf_path.name, "sha256": digest.hexdigest(),
        "general.name": meta.get("general.name"), "architecture": meta.get("general.architecture"),
        "tensor_types": types, "dtype": dtype,
        "tokenizer": {"model": meta.get("tokenizer.ggml.model"),
                      "pre": meta.get("tokenizer.ggml.pre")},
    }, indent=2) + "\n")
    return out_dir


def _save_safetensors(weights: dict, path: Path, dtype: str) -> None:
    if dtype == "bfloat16":
        # numpy has no bfloat16: MLX writes it.
        import mlx.core as mx

        mx.save_safetensors(str(path), {k: mx.array(v).astype(mx.bfloat16)
                                        for k, v in weights.items()},
                            metadata={"format": "mlx"})
        return
    from safetensors.numpy import save_file

    np_dtype = np.float16 if dtype == "float16" else np.float32
    save_file({k: np.ascontiguousarray(v.astype(np_dtype)) for k, v in weights.items()},
              str(path), metadata={"format": "pt"})
    # save_file writes through a private temporary file (mode 0600): give it the usual mode.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
