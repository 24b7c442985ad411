"""Our MoE Llama saved as a transformers Mixtral (models.hf_moe_export, ``blockscale to-hf``): logits of
MixtralForCausalLM (in memory and from_pretrained) equal ours up to float rounding with the same routing, the
fused expert layout, the tokenizers saved next to the weights, refusals of what Mixtral cannot represent,
and the saved directory through ``blockscale quantize`` and ``blockscale eval ppl``."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from blockscale import cli
from blockscale.data import ByteTokenizer, data_root, evaluation_tokens
from blockscale.errors import UsageError
from blockscale.eval import perplexity
from blockscale.models import PRESETS, Llama, save_hf_mixtral, to_hf_mixtral
from blockscale.models.hf_moe_export import byte_transformers_tokenizer, mixtral_state_dict
from blockscale.nn.moe import GroupedExperts, MoEConfig

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

# FP32 rounding: RoPE angles (ours FP64 then rounded, transformers FP32) and the order of the expert sums;
# measured ~1e-7 on these logits (|logits| ~1), the bound leaves room for other BLAS orders
ATOL = 1e-5


def moe_llama(seed: int = 0, **changes) -> Llama:
    """tiny-moe (dim 32, 2 layers, 8 experts, top-2) with a router sharp enough that tokens route unevenly."""
    cfg = dataclasses.replace(PRESETS["tiny-moe"], **changes)
    model = Llama(cfg, seed=seed).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.feed_forward.router.weight.mul_(30.0)
    return model


def tokens(vocab: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (3, 48), generator=torch.Generator().manual_seed(seed))


def _routed_experts(model: Llama, hf, x):
    """Each layer's chosen experts per token, sorted: (ours, transformers')."""
    ours, theirs, hooks = [], [], []
    for layer in model.layers:
        hooks.append(layer.feed_forward.router.register_forward_hook(
            lambda m, inp, out: ours.append(m.probs(inp[0]).topk(m.top_k, dim=-1).indices.sort(-1).values)))
    for layer in hf.model.layers:
        hooks.append(layer.mlp.gate.register_forward_hook(lambda m, inp, out: theirs.append(out[2].sort(-1).values)))
    with torch.no_grad():
        a, b = model(x), hf(x).logits
    for h in hooks:
        h.remove()
    return a, b, ours, theirs


@pytest.mark.parametrize("changes", [{}, {"rope_interleaved": False}, {"tie_embeddings": False},
                                     {"moe": MoEConfig(n_experts=4, top_k=1, d_ff=48)}],
                         ids=["tiny-moe", "rope-halves", "untied", "top1-dff48"])
def test_mixtral_logits_and_routing_equal_ours(changes):
    model = moe_llama(**changes)
    hf = to_hf_mixtral(model)
    assert type(hf).__name__ == "MixtralForCausalLM" and not hf.training
    x = tokens()
    a, b, ours, theirs = _routed_experts(model, hf, x)
    assert (a - b).abs().max() <= ATOL
    assert len(ours) == len(theirs) == model.config.n_layers
    for o, t in zip(ours, theirs):
        assert torch.equal(o, t)
    # the routing is not trivial: several experts get tokens in every layer
    assert all(o.unique().numel() >= 3 for o in ours)


def test_fused_expert_layout_and_config():
    model = moe_llama()
    sd = mixtral_state_dict(model)
    ex = model.layers[1].feed_forward.experts
    gate_up = sd["model.layers.1.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (8, 2 * 64, 32)
    for e in range(8):  # gate rows first, then up rows, per expert; down as is
        assert torch.equal(gate_up[e, :64], ex.w1[e]) and torch.equal(gate_up[e, 64:], ex.w3[e])
    assert torch.equal(sd["model.layers.1.mlp.experts.down_proj"], ex.w2)
    assert torch.equal(sd["model.layers.1.mlp.gate.weight"], model.layers[1].feed_forward.router.weight)
    assert "lm_head.weight" not in sd  # tied
    c = to_hf_mixtral(model).config
    assert (c.num_local_experts, c.num_experts_per_tok, c.intermediate_size, c.hidden_size) == (8, 2, 64, 32)
    assert c.sliding_window is None and c.router_jitter_noise == 0.0 and c.tie_word_embeddings


def test_saved_directory_loads_with_from_pretrained(tmp_path):
    model = moe_llama(seed=3)
    out = save_hf_mixtral(model, tmp_path / "hf", tokenizer="bytes")
    hf = transformers.MixtralForCausalLM.from_pretrained(out).eval()
    x = tokens(seed=1)
    with torch.no_grad():
        assert torch.equal(hf(x).logits, to_hf_mixtral(model)(x).logits)  # FP32 written and read exactly
        assert (hf(x).logits - model(x)).abs().max() <= ATOL
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["architectures"] == ["MixtralForCausalLM"]
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "Once upon a time, a cat named Momo saw \u00e9t\u00e9 and \u65e5\u672c.\n\nThe end."
    assert tok(text, add_special_tokens=False)["input_ids"] == ByteTokenizer().encode(text)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary directory left


def test_byte_tokenizer_equals_byte_tokenizer():
    tok = byte_transformers_tokenizer()
    text = "abc \x00\x7f \u00ff\u0100 \U0001f600\n\t end"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8")) and len(tok) == 256
    assert tok.decode(ids) == text
    assert tok.bos_token_id is None and tok.eos_token_id is None


@pytest.mark.skipif(not (data_root() / "stories260K" / "tok512.bin").is_file(), reason="needs the shared data folder")
def test_tok512_saved_and_reloaded(tmp_path):
    from blockscale.models import load_tokenizer

    model = moe_llama(vocab_size=512)
    out = save_hf_mixtral(model, tmp_path / "hf", tokenizer="tok512")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ref = load_tokenizer(data_root() / "stories260K" / "tok512.bin")
    text = "Once upon a time, there was a little girl named Lily. She loved to play outside."
    assert tok(text, add_special_tokens=False)["input_ids"] == ref.encode(text)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (ref.bos_id, ref.eos_id)


@pytest.mark.parametrize("changes, match", [
    ({"moe": None}, r"LlamaConfig\.moe is None.*to_hf_llama"),
    ({"moe_every": 2}, r"LlamaConfig\.moe_every=2"),
    ({"moe": MoEConfig(shared_expert=True)}, r"MoEConfig\.shared_expert=True"),
    ({"moe": MoEConfig(normalize_top_k=False)}, r"MoEConfig\.normalize_top_k=False"),
], ids=["dense", "moe-every-2", "shared-expert", "no-renormalisation"])
def test_refuses_what_mixtral_cannot_represent(changes, match, tmp_path):
    model = Llama(dataclasses.replace(PRESETS["tiny-moe"], **changes), seed=0)
    with pytest.raises(UsageError, match=match):
        to_hf_mixtral(model)
    with pytest.raises(UsageError, match=match):
        save_hf_mixtral(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_refuses_a_slice_of_the_experts():
    model = moe_llama()
    model.layers[0].feed_forward.experts = GroupedExperts(8, 32, 64, first_expert=4, n_local=4)
    with pytest.raises(UsageError, match=r"layers\.0\.feed_forward .* 4 of the experts"):
        to_hf_mixtral(model)


def test_refuses_a_vocabulary_mismatch_and_a_foreign_directory(tmp_path):
    with pytest.raises(UsageError, match="512 tokens but the model's vocabulary is 256"):
        save_hf_mixtral(moe_llama(), tmp_path / "a", tokenizer=_FakeTok(512))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="not empty"):
        save_hf_mixtral(moe_llama(), tmp_path / "b")
    with pytest.raises(UsageError, match="no config.json"):
        save_hf_mixtral(moe_llama(), tmp_path / "b", overwrite=True)
    assert (tmp_path / "b" / "notes.txt").read_text() == "mine"
    with pytest.raises(UsageError, match="allowed values: 'tok512', 'bytes'"):
        save_hf_mixtral(moe_llama(), tmp_path / "c", tokenizer="gpt2")


class _FakeTok:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def test_cli_train_to_hf_quantize_eval(tmp_path, capsys):
    run, hf_dir, q_dir = tmp_path / "run", tmp_path / "hf", tmp_path / "q"
    assert cli.main(["train", "--data", "tinystories", "--model-preset", "tiny-moe", "--steps", "3", "--batch-size",
                     "2", "--seq-len", "32", "--warmup-steps", "1", "--eval-batches", "1", "--out", str(run),
                     "--no-progress", "--no-plot", "--device", "cpu"]) == 0
    assert cli.main(["to-hf", str(run), "--out", str(hf_dir)]) == 0
    assert "tokenizer bytes" in capsys.readouterr().out
    assert cli.main(["to-hf", str(run), "--out", str(hf_dir)]) == 2  # exists: needs --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert cli.main(["to-hf", str(run), "--out", str(hf_dir), "--overwrite"]) == 0
    assert cli.main(["to-hf", str(run), "--out", str(run)]) == 2
    # the saved directory's perplexity (eval ppl, its saved byte tokenizer) = our model's on the same tokens
    report = tmp_path / "ppl.json"
    assert cli.main(["eval", "ppl", str(hf_dir), "--data", "tinystories", "--ctx", "32", "--max-tokens", "600",
                     "--json", str(report)]) == 0
    from blockscale.cli.to_hf import llama_from_training_checkpoint

    model, record = llama_from_training_checkpoint(run / "ckpt.pt")
    assert record["recipe"] is None
    ids = evaluation_tokens(ByteTokenizer(), "tinystories", max_tokens=600)
    ours = perplexity(model, ids, 32, batch_size=4)
    got = json.loads(report.read_text())
    assert got["tokens_evaluated"] == ours.tokens_evaluated
    assert got["loss"] == pytest.approx(ours.loss, abs=1e-5)
    # calibrated PTQ (W4A4 needs text, so the saved tokenizer) of the fused experts, then eval of the export
    assert cli.main(["quantize", str(hf_dir), "--out", str(q_dir), "--w4a4", "--calib", "tinystories",
                     "--n-samples", "4", "--seq-len", "32", "--batch-size", "4"]) == 0
    assert "fused-experts modules" in capsys.readouterr().out
    assert cli.main(["eval", "ppl", str(q_dir), "--data", "tinystories", "--ctx", "32", "--max-tokens", "600"]) == 0
    assert "ppl" in capsys.readouterr().out


def test_cli_refuses_a_checkpoint_without_a_model_record(tmp_path, capsys):
    from blockscale.train import TrainConfig
    from blockscale.train.token_data import load_data
    from blockscale.train.trainer import train

    model = Llama(dataclasses.replace(PRESETS["tiny-moe"], max_seq_len=32), seed=0)
    train(model, load_data("tinystories"), TrainConfig(steps=1, batch_size=1, seq_len=16, warmup_steps=0,
                                                       eval_batches=0, out_dir=str(tmp_path / "run"), progress=False,
                                                       plot=False, device="cpu"))
    assert cli.main(["to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2
    assert "records no model config" in capsys.readouterr().err
    assert cli.main(["to-hf", str(tmp_path / "missing"), "--out", str(tmp_path / "hf")]) == 2


def test_cli_checkpoint_trained_with_a_recipe_saves_its_master_weights(tmp_path, capsys):
    import blockscale as bs
    from blockscale.cli.to_hf import llama_from_training_checkpoint

    run, hf_dir = tmp_path / "run", tmp_path / "hf"
    assert cli.main(["train", "--data", "tinystories", "--model-preset", "tiny-moe", "--steps", "1", "--batch-size",
                     "1", "--seq-len", "16", "--warmup-steps", "0", "--eval-batches", "0", "--recipe", "nvfp4-nvidia",
                     "--out", str(run), "--no-progress", "--no-plot", "--device", "cpu"]) == 0
    assert cli.main(["to-hf", str(run / "ckpt.pt"), "--out", str(hf_dir)]) == 0
    assert "master weights" in capsys.readouterr().out
    model, record = llama_from_training_checkpoint(run)
    assert record["recipe"]["name"] == "nvfp4-nvidia"
    assert model.layers[0].feed_forward.experts.recipe is not None  # rebuilt as trained
    bs.unconvert(model)
    hf = transformers.MixtralForCausalLM.from_pretrained(hf_dir).eval()
    x = tokens()
    with torch.no_grad():
        assert (hf(x).logits - model(x)).abs().max() <= ATOL
