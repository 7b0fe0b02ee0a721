"""A few random-weight Qwen3-Next layers (mlx-lm's own classes), shared by the add-norm tests."""

from __future__ import annotations

import mlx.core as mx


def small_qwen3_next(dtype=mx.float32, *, hidden: int = 64, head_dim: int = 16,
                     linear_head_dim: int = 32, ffn: int = 64, vocab: int = 128,
                     max_positions: int = 512):
    """A 4-layer ``qwen3_next.Model`` (3 Gated DeltaNet + 1 attention, 4 experts, top-2).

    Seeded (``mx.random.seed(3)``); the post-attention RMSNorm weights are moved
    away from 1 so a wrong weight multiply shows. ``ffn`` is the routed and the
    shared expert's width; the dense MLP width is ``2 * ffn``.
    """
    from mlx_lm.models import qwen3_next

    mx.random.seed(3)
    args = qwen3_next.ModelArgs(
        model_type="qwen3_next", hidden_size=hidden, num_hidden_layers=4,
        intermediate_size=2 * ffn, num_attention_heads=4, num_key_value_heads=2,
        head_dim=head_dim, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        shared_expert_intermediate_size=ffn, mlp_only_layers=[], moe_intermediate_size=ffn,
        vocab_size=vocab, rope_theta=1e4, partial_rotary_factor=0.25,
        max_position_embeddings=max_positions, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=linear_head_dim,
        linear_value_head_dim=linear_head_dim, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
        full_attention_interval=4, tie_word_embeddings=False)
    model = qwen3_next.Model(args)
    for layer in model.layers:
        layer.post_attention_layernorm.weight = 1.0 + 0.2 * mx.random.normal((hidden,))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    model.eval()
    return model
