"""The MTP block from its definition: embed(t_{p+1}) and the trunk streams at p, mixed by e_proj and
h_proj, then a window-only block (run here by HF's decoder layer), its own hc_head and norm, and the
shared head."""
import pytest
import torch
from tiny import tiny_config, write_checkpoint

from dsv4cli.model import load_model

transformers = pytest.importorskip("transformers")


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


def test_mtp_matches_definition(tmp_path):
    cfg = tiny_config()
    trunk = write_checkpoint(tmp_path / "trunk", cfg, seed=3)
    ours = load_model(tmp_path / "trunk", dtype=torch.float32)
    # The same MTP block as a one-layer HF model: layers.0 <- mtp.0, hc_head/norm <- the MTP's own.
    sd = trunk.state_dict()
    one = {"embed.weight": sd["embed.weight"], "head.weight": sd["head.weight"]}
    for k, v in sd.items():
        if k.startswith("mtp.0."):
            rest = k[len("mtp.0."):]
            if rest.startswith(("hc_head_", "norm.")):
                one[rest] = v
            elif not rest.startswith(("enorm", "hnorm", "e_proj", "h_proj")):
                one["layers.0." + rest] = v
    cfg1 = dict(cfg, num_hidden_layers=1, compress_ratios=[0], num_hash_layers=0, num_nextn_predict_layers=0)
    from dsv4cli.model.checkpoint import save_checkpoint
    save_checkpoint(one, cfg1, tmp_path / "mtp_as_model")
    transformers.logging.set_verbosity_error()
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "mtp_as_model", dtype=torch.float32).eval()

    ids = torch.randint(0, cfg["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(4))
    _, hidden = ours(ids, return_hidden=True)
    next_ids = torch.roll(ids, -1, dims=1)
    got = ours.mtp_forward(hidden, next_ids)

    e = rms(sd["embed.weight"][next_ids], sd["mtp.0.enorm.weight"])
    h = rms(hidden, sd["mtp.0.hnorm.weight"])
    x = (e @ sd["mtp.0.e_proj.weight"].T).unsqueeze(2) + h @ sd["mtp.0.h_proj.weight"].T
    hf.model.layers[0].register_forward_pre_hook(lambda mod, args, kw: ((x,) + args[1:], kw), with_kwargs=True)
    with torch.no_grad():
        ref = hf(next_ids, use_cache=False).logits
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    print(f"MTP max relative error {rel:.2e}")
    assert rel <= 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_mtp_row_depends_only_on_its_prefix(tmp_path):
    write_checkpoint(tmp_path, tiny_config(), seed=5)
    model = load_model(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(6))
    _, hidden = model(ids, return_hidden=True)
    nxt = torch.roll(ids, -1, 1)
    a = model.mtp_forward(hidden, nxt)
    nxt2 = nxt.clone()
    nxt2[0, 20] = (nxt2[0, 20] + 1) % 256
    b = model.mtp_forward(hidden, nxt2)
    assert torch.allclose(a[:, :20], b[:, :20], atol=1e-6)     # rows before p=20 unchanged
    assert not torch.allclose(a[:, 20], b[:, 20])               # row 20 sees its token t_{p+1}
