"""Key fields of published Hugging Face config.json files, written by hand (no download), with the
parameter counts their model cards state: (total, active) in billions; active None where none is published."""

_LLAMA = dict(model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False,
              torch_dtype="bfloat16", vocab_size=128256)
_QWEN3_MOE = dict(model_type="qwen3_moe", hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000.0,
                  vocab_size=151936, head_dim=128, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
                  decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, max_position_embeddings=40960)

CONFIGS = {
    # meta-llama/Meta-Llama-3-8B
    "llama3-8b": dict(_LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0),
    # meta-llama/Meta-Llama-3-70B
    "llama3-70b": dict(_LLAMA, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0),
    # meta-llama/Llama-3.2-1B: tied embeddings, llama3 rope scaling
    "llama3.2-1b": dict(_LLAMA, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rope_theta=500000.0,
                        tie_word_embeddings=True, rope_scaling={"rope_type": "llama3", "factor": 32.0}),
    # Qwen/Qwen2.5-7B
    "qwen2.5-7b": dict(model_type="qwen2", hidden_act="silu", hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       use_sliding_window=False, tie_word_embeddings=False),
    # Qwen/Qwen3-8B
    "qwen3-8b": dict(model_type="qwen3", hidden_act="silu", hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     attention_bias=False, tie_word_embeddings=False),
    # Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B
    "qwen3-30b-a3b": dict(_QWEN3_MOE, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32),
    "qwen3-235b-a22b": dict(_QWEN3_MOE, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                            num_hidden_layers=94, num_attention_heads=64),
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": dict(model_type="mixtral", hidden_act="silu", hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                         num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
                         rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False),
    # deepseek-ai/DeepSeek-V3
    "deepseek-v3": dict(model_type="deepseek_v3", hidden_act="silu", hidden_size=7168, intermediate_size=18432,
                        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8,
                        routed_scaling_factor=2.5, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                        qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=3, moe_layer_freq=1,
                        n_group=8, topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid",
                        norm_topk_prob=True, num_nextn_predict_layers=1, vocab_size=129280,
                        max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000,
                        rope_scaling={"type": "yarn", "factor": 40}, tie_word_embeddings=False,
                        attention_bias=False),
    # openai/gpt-oss-120b, openai/gpt-oss-20b
    "gpt-oss-120b": dict(model_type="gpt_oss", hidden_act="silu", hidden_size=2880, intermediate_size=2880,
                         num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                         num_local_experts=128, num_experts_per_tok=4, experts_per_token=4, vocab_size=201088,
                         sliding_window=128, attention_bias=True, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, rope_theta=150000, rope_scaling={"rope_type": "yarn", "factor": 32.0},
                         tie_word_embeddings=False,
                         layer_types=["sliding_attention", "full_attention"] * 18),
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_act="silu", hidden_size=2880, intermediate_size=2880,
                        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        num_local_experts=32, num_experts_per_tok=4, vocab_size=201088, sliding_window=128,
                        attention_bias=True, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=150000,
                        tie_word_embeddings=False, layer_types=["sliding_attention", "full_attention"] * 12),
}

#: Published counts (billions): total, active. DeepSeek-V3's 671B/37B leave out its 14B MTP module;
#: GPT-OSS's active counts leave out the input embedding (OpenAI's model card).
PUBLISHED = {
    "llama3-8b": (8.03, None), "llama3-70b": (70.6, None), "llama3.2-1b": (1.24, None), "qwen2.5-7b": (7.62, None),
    "qwen3-8b": (8.19, None), "qwen3-30b-a3b": (30.5, 3.3), "qwen3-235b-a22b": (235.0, 22.0),
    "mixtral-8x7b": (46.7, 12.9), "deepseek-v3": (671.0, 37.0), "gpt-oss-120b": (116.83, 5.13),
    "gpt-oss-20b": (20.91, 3.61),
}
