"""Tiny DeepSeek V4 configs and random checkpoints in the official layout, for tests."""
import torch

from dsv4cli.model import ModelConfig, Segment, Transformer
from dsv4cli.model.checkpoint import init_weights, save_checkpoint


def tiny_config(**overrides) -> dict:
    """A config.json dict with every attention kind: window-only, ratio 4 (CSA) and ratio 128 (HCA)."""
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4, "num_nextn_predict_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "qk_rope_head_dim": 16,
        "q_lora_rank": 48, "o_lora_rank": 24, "o_groups": 2,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "num_hash_layers": 1, "swiglu_limit": 10.0, "hidden_act": "silu",
        "sliding_window": 16, "compress_ratios": [0, 4, 128, 4, 0],
        "index_n_heads": 4, "index_head_dim": 32, "index_topk": 8,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 256,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32",
    }
    cfg.update(overrides)
    return cfg


def random_model(cfg: dict, seed: int = 0, spread: float = 0.5) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.from_dict(cfg))
    init_weights(model, seed=seed, std=0.1, spread=spread)
    return model.eval()


def write_checkpoint(path, cfg: dict, seed: int = 0, max_shard_bytes: int = 0) -> Transformer:
    """An fp32 checkpoint in the official naming; returns the model it was written from."""
    model = random_model(cfg, seed)
    save_checkpoint(model.state_dict(), cfg, path, max_shard_bytes=max_shard_bytes)
    return model


def prompts(n_list, vocab, seed=0) -> list[list[int]]:
    """Random prompts of the given lengths, ids above the special tokens."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(21, vocab, (n,), generator=g).tolist() for n in n_list]


def chunk_logits(model: Transformer, tokens, start, state, context=None, length=None):
    """The trunk's logits and streams over one chunk through the cached path (as a step runs it)."""
    (rows,) = model.forward_segments([Segment(tokens, start, state, context, length)])
    return model.logits(rows.hidden), rows.hidden


def mtp_chunk_logits(model: Transformer, hidden, next_ids, start, state, length=None):
    """The MTP layer's logits and streams over one chunk through the cached path."""
    (x,) = model.mtp_forward_segments([hidden], [Segment(next_ids, start, state, length=length)])
    return model.mtp_logits(x), x


def tiny_dspark_config(**overrides) -> dict:
    """A 0731-layout config: the trunk of `tiny_config` and a DSpark drafter of three stages (the legacy
    num_nextn_predict_layers still 1; the stages are the compress_ratios past the trunk)."""
    cfg = tiny_config(compress_ratios=[0, 4, 128, 4, 0, 0, 0], dspark_block_size=5, dspark_noise_token_id=7,
                      dspark_target_layer_ids=[1, 2, 3], dspark_markov_rank=16)
    cfg.update(overrides)
    return cfg


# A tiny config.json of each drafter kind (model.drafters.DRAFTERS), for the tests every kind passes
# (test_drafters.py); a new kind adds its own.
TINY_DRAFTERS = {"dspark": tiny_dspark_config, "mtp": tiny_config}
