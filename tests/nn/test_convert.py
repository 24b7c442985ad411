"""convert / unconvert on a real Hugging Face LlamaForCausalLM built from a config (no download)."""
import pytest
import torch

import blockscale as bs
from blockscale.nn import QuantizedLinear, convert, find_blocks, unconvert

pytestmark = pytest.mark.usefixtures("reference_backend")

transformers = pytest.importorskip("transformers")


def _tiny_llama(n_layers=6, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=n_layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_convert_honours_exclusions_and_last_blocks():
    model = _tiny_llama(n_layers=6)
    report = convert(model, "nvfp4-fwd-mxfp8-bwd")
    assert find_blocks(model) == ("model.layers", 6)
    assert report.n_last_blocks == 1
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    for i in range(6):
        for p in per_layer:
            name = f"model.layers.{i}.{p}"
            mod = model.get_submodule(name)
            assert isinstance(mod, QuantizedLinear), name
            want = "mxfp8" if i == 5 else "nvfp4-fwd-mxfp8-bwd"
            assert report.converted[name] == want
            assert mod.recipe == bs.get_recipe(want).linear
    assert report.excluded == ["lm_head"]
    assert type(model.lm_head) is torch.nn.Linear
    assert "42 linear layers converted (35 x nvfp4-fwd-mxfp8-bwd, 7 x mxfp8)" in str(report)


def test_round_trip_state_dict_and_outputs():
    ref = _tiny_llama()
    model = _tiny_llama()
    keys = list(model.state_dict().keys())
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    before = ref(ids).logits
    convert(model, "nvfp4-nvidia")
    assert list(model.state_dict().keys()) == keys
    q_logits = model(ids).logits
    assert not torch.equal(q_logits, before)
    rel = ((q_logits - before).norm() / before.norm()).item()
    assert 1e-3 < rel < 0.5
    # the converted model's state_dict loads into an unconverted model
    fresh = _tiny_llama(seed=5)
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh(ids).logits, before)
    assert unconvert(model) == 42
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    assert torch.equal(model(ids).logits, before)


def _train_losses(opt, recipe, steps=25):
    model = _tiny_llama(n_layers=2).train()
    if recipe:
        convert(model, recipe)
    params = list(model.parameters())
    optim = torch.optim.SGD(params, lr=0.5) if opt == "sgd" else torch.optim.AdamW(params, lr=3e-3)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        optim.zero_grad()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params if p.requires_grad)
        optim.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_converted_model_trains(opt):
    """Same optimizer, data and steps: the 4-bit model learns, and keeps most of the FP32 model's progress."""
    fp = _train_losses(opt, None)
    q = _train_losses(opt, "nvfp4-nvidia-4over6")
    assert q[0] == pytest.approx(fp[0], rel=0.02)
    assert q[-1] < 0.85 * q[0]
    assert (q[0] - q[-1]) > 0.4 * (fp[0] - fp[-1])


def test_convert_rejects_unknown_recipe_and_reconverts():
    model = _tiny_llama(n_layers=2)
    with pytest.raises(ValueError, match="neither a built-in recipe"):
        convert(model, "nvfp3")
    convert(model, "bf16")
    r = convert(model, "mxfp8")
    assert set(r.counts()) == {"mxfp8"}
    assert model.model.layers[0].mlp.up_proj.recipe == bs.get_recipe("mxfp8").linear
