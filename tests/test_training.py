"""The training script's loss backpropagates through the model's cached path (the same code inference
runs), into the attention, compressor, MoE and MTP weights."""
import torch
from tiny import random_model, tiny_config

from scripts.train_tiny import losses


def test_training_loss_backpropagates_through_the_cached_path():
    model = random_model(tiny_config(vocab_size=256)).train()
    rows = torch.randint(2, 256, (2, 42), generator=torch.Generator().manual_seed(0))
    main, mtp = losses(model, rows, pad_id=-1)
    (main + mtp).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name in ("layers.1.attn.wq_b.weight", "layers.1.attn.compressor.wkv.weight",
                 "layers.1.attn.compressor.wgate.weight", "layers.3.ffn.shared_experts.w2.weight",
                 "layers.0.hc_attn_fn", "mtp.0.e_proj.weight", "head.weight"):
        assert grads[name] is not None and torch.isfinite(grads[name]).all() and grads[name].abs().sum() > 0, name
    routed = [grads[f"layers.3.ffn.experts.{e}.w1.weight"] for e in range(8)]
    assert any(g is not None and g.abs().sum() > 0 for g in routed)
