"""``from_pretrained(dir, quantization_config=bs.BlockscaleConfig(...))`` equals ``bs.quantize_model`` (RTN, the
same recipe and scale rule) on the same checkpoint bit for bit: every tensor of the state dict (codes, block and
outer scales, biases, everything kept in high precision) and the logits. And it holds at most one decoder layer
in full precision while loading."""
import json

import pytest
import torch

pytest.importorskip("transformers")

import blockscale as bs  # noqa: E402
from blockscale.errors import CheckpointError, QuantizationError, UsageError  # noqa: E402
from blockscale.nn.quantized_modules import QUANTIZED_LINEAR_TYPES  # noqa: E402

from hf_on_load import by_quantize_model, decoder_linears, on_load, saved, state_differences, tiny_llama  # noqa: E402
from tiny_models import logits, tiny_family, token_ids  # noqa: E402
from tiny_moe import tiny_deepseek, tiny_gpt_oss, tiny_moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "reference_backend")


def _same(path, config, **load_args):
    """Quantize the checkpoint both ways; assert bit-for-bit equal state dicts and logits; return the on-load one."""
    ours = on_load(path, config, **load_args)
    ref = by_quantize_model(path, config, **load_args)
    assert state_differences(ours, ref) == []
    x = token_ids(2, 16)
    assert torch.equal(logits(ours, x), logits(ref, x))
    return ours


@pytest.mark.parametrize("config, kind", [
    (dict(recipe="nvfp4", scale_rule="4over6"), "nvfp4"),
    (dict(recipe="nvfp4", scale_rule="4over6", error="mae"), "nvfp4"),
    (dict(recipe="nvfp4", scale_rule="sweep"), "nvfp4"),
    (dict(recipe="nvfp4-w4a16"), "nvfp4"),
    (dict(recipe="mxfp4"), "mx"),  # W4A4 with dynamic (per-32 UE8M0) activation scales
    (dict(recipe="mxfp4-w4a16"), "mx"),
    (dict(recipe=bs.Scheme("fp8-w8a8", activations="dynamic")), "fp8"),  # per-token dynamic activations
    (dict(recipe="fp8-block"), "fp8"),
], ids=["4over6", "4over6-mae", "sweep", "nvfp4-w4a16", "mxfp4-w4a4-dynamic", "mxfp4-w4a16", "fp8-dynamic",
        "fp8-block"])
def test_hf_on_load_equals_quantize_model_bit_for_bit(tmp_path, config, kind):
    cfg = bs.BlockscaleConfig(**config)
    model = _same(saved(tiny_llama(), tmp_path / "fp"), cfg)
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QUANTIZED_LINEAR_TYPES)}
    assert len(quantized) == 14 and {m.kind for m in quantized.values()} == {kind}  # 2 layers x 7 Linears
    assert decoder_linears(model) == {}
    assert type(model.lm_head) is torch.nn.Linear  # the recipe's ignore list: lm_head, embeddings
    assert model.hf_quantizer.report.layers == 2 and len(model.hf_quantizer.report.linears) == 14
    assert model.config.quantization_config.to_dict() == cfg.to_dict()


@pytest.mark.filterwarnings("ignore:22.2% of the decoder layers:RuntimeWarning")  # the ignored down_proj
def test_hf_bf16_checkpoint_and_ignore(tmp_path):
    path = saved(tiny_llama(dtype=torch.bfloat16), tmp_path / "fp")
    cfg = bs.BlockscaleConfig(recipe="nvfp4", scale_rule="4over6", ignore=[r"\.mlp\.down_proj$"])
    model = _same(path, cfg)  # dtype "auto": the checkpoint's bfloat16
    assert model.dtype == torch.bfloat16
    kept = decoder_linears(model)
    assert sorted(kept) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert all(m.weight.dtype == torch.bfloat16 for m in kept.values())
    _same(path, cfg, dtype=torch.float32)  # an explicit dtype: the tensors cast on load, as for quantize_model


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # routers stay in high precision: said once per model
@pytest.mark.parametrize("family, config", [
    ("mixtral", dict(recipe="nvfp4", expert_outer_scale="tensor")),
    ("qwen2_moe", dict(recipe="mxfp8")),
    ("gpt_oss", dict(recipe="mxfp4")),
    ("deepseek_v3", dict(recipe="nvfp4", scale_rule="4over6")),  # MLA attention, layer 0 dense, layer 1 MoE
])
def test_hf_fused_experts_equal_quantize_model(tmp_path, family, config):
    """Checkpoints hold experts per expert; transformers merges them into fused 3-D experts as it loads, and the
    merged tensors reach the quantizer like any other (one decoder layer at a time)."""
    src = {"gpt_oss": tiny_gpt_oss, "deepseek_v3": tiny_deepseek}.get(family, lambda: tiny_moe(family))()
    model = _same(saved(src, tmp_path / "fp"), bs.BlockscaleConfig(**config))
    assert len(model.hf_quantizer.report.experts) == (1 if family == "deepseek_v3" else 2)


@pytest.mark.parametrize("family", ["qwen2", "phi3", "gemma3"])
def test_hf_families_equal_quantize_model(tmp_path, family):
    """Biases (Qwen2's q / k / v), fused projections in one Linear (Phi-3's qkv_proj, gate_up_proj), sliding
    and full attention with tied embeddings (Gemma 3)."""
    _same(saved(tiny_family(family), tmp_path / "fp"), bs.BlockscaleConfig(scale_rule="4over6"))


def _record_what_is_held(monkeypatch):
    """After every tensor transformers hands the quantizer: which decoder layers hold full-precision weights of
    modules PTQ replaces, looked up two ways: plain nn.Linear weights off the meta device in the model, and the
    quantizer's own planned modules (which would also show copies kept outside the model)."""
    from blockscale.hf import QuantizeOnLoad

    seen = []
    convert = QuantizeOnLoad.convert

    def recording(self, input_dict, **kwargs):
        out = convert(self, input_dict, **kwargs)
        model = self.loader.model
        in_model = sorted({int(n.split(".layers.")[1].split(".")[0]) for n, m in decoder_linears(model).items()
                           if m.weight.device.type != "meta"})
        kinds = [type(layer.self_attn.q_proj).__name__ for layer in model.model.layers]
        seen.append((sorted(input_dict), in_model, self.loader.held_layers(), kinds))
        return out

    monkeypatch.setattr(QuantizeOnLoad, "convert", recording)
    return seen


def test_hf_holds_at_most_one_layer_in_full_precision(tmp_path, monkeypatch):
    """A sharded 4-layer checkpoint: while it loads, the full-precision weights alive are those of the one layer
    being read; each layer is quantized as soon as its last tensor arrives (before the next layer's first), and
    afterwards no quantized module or planned module holds a full-precision weight."""
    path = saved(tiny_llama(layers=4), tmp_path / "fp", max_shard_size="100KB")
    assert len(list(path.glob("model-*.safetensors"))) > 1
    seen = _record_what_is_held(monkeypatch)
    model = on_load(path, bs.BlockscaleConfig(recipe="nvfp4", scale_rule="4over6"))
    assert len(seen) == 4 * 7  # every decoder Linear weight went through the quantizer, one per call
    for names, in_model, held, kinds in seen:
        layer = int(names[0].split(".layers.")[1].split(".")[0])
        assert in_model in ([], [layer]) and held == in_model, (names, in_model, held)
        assert all(k == "NVFP4Linear" for k in kinds[:layer]) and all(k == "Linear" for k in kinds[layer + 1:])
    assert [s[1] for s in seen if s[0][0].endswith("v_proj.weight")] == [[]] * 4  # v_proj sorts last: done
    stored = {"weight_packed": torch.uint8, "weight_scale": torch.float8_e4m3fn, "weight_global_scale": torch.float32}
    for m in model.modules():
        if isinstance(m, QUANTIZED_LINEAR_TYPES):  # codes and scales only: no full-precision weight
            assert dict(m.named_parameters()) == {} and {n: t.dtype for n, t in m.named_buffers()} == stored
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path)  # the classic call: the flat PTQConfig, RTN with the 4/6 rule
    bs.quantize_model(ref, bs.PTQConfig(method="rtn", scale_rule="4over6"), progress=False)
    assert state_differences(model, ref) == []


def _edit_checkpoint(path, fn):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_hf_layer_missing_a_tensor_is_quantized_after_loading(tmp_path, monkeypatch):
    """A norm weight missing from the checkpoint: transformers initializes it after loading (ones), so its
    layer is quantized then, by the quantizer's postprocess; still equal to quantize_model."""
    path = saved(tiny_llama(), tmp_path / "fp")
    _edit_checkpoint(path, lambda t: t.pop("model.layers.0.post_attention_layernorm.weight"))
    seen = _record_what_is_held(monkeypatch)
    _same(path, bs.BlockscaleConfig())
    assert seen[-1][2] == [0]  # layer 0 still in full precision when loading ended; layer 1 quantized


def test_hf_errors_keep_their_type_and_name_the_module(tmp_path):
    """quantize_model's errors, raised from from_pretrained as they are (not transformers' conversion report)."""
    path = saved(tiny_llama(), tmp_path / "fp")

    def nan(t):
        t["model.layers.1.self_attn.k_proj.weight"][3, 5] = float("nan")

    _edit_checkpoint(path, nan)
    with pytest.raises(QuantizationError, match=r"model\.layers\.1\.self_attn\.k_proj: weight contains NaN/inf"):
        on_load(path, bs.BlockscaleConfig())
    with pytest.raises(QuantizationError, match=r"model\.layers\.1\.self_attn\.k_proj: weight contains NaN/inf"):
        by_quantize_model(path, bs.BlockscaleConfig())


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
def test_hf_refuses_what_it_cannot_load(tmp_path):
    path = saved(tiny_llama(), tmp_path / "fp")
    with pytest.raises(UsageError, match="'disk'"):
        on_load(path, bs.BlockscaleConfig(), device_map={"": "disk"}, offload_folder=str(tmp_path / "off"))
    config = json.loads((path / "config.json").read_text())  # a config.json naming quant_method "blockscale"
    config["quantization_config"] = bs.BlockscaleConfig().to_dict()
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match="quant_method 'blockscale'"):
        on_load(path, bs.BlockscaleConfig())


def test_hf_refuses_a_quantized_checkpoint(tmp_path):
    ours = on_load(saved(tiny_llama(), tmp_path / "fp"), bs.BlockscaleConfig())
    ours.save_pretrained(tmp_path / "q")
    with pytest.raises(ValueError, match="CompressedTensorsConfig but you are passing a BlockscaleConfig"):
        on_load(tmp_path / "q", bs.BlockscaleConfig())


def test_hf_shape_mismatch_names_the_tensor(tmp_path):
    path = saved(tiny_llama(), tmp_path / "fp")

    def narrow(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:64].clone()

    _edit_checkpoint(path, narrow)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight: shape \[64, 64\]"):
        on_load(path, bs.BlockscaleConfig())


def test_hf_hub_name_resolves_as_for_any_model(tmp_path):
    """A hub name ("org/name") goes through transformers' own resolution (here from a hub cache laid out as
    huggingface_hub writes it; the hub is not reachable from the tests) before the quantizer sees anything."""
    import shutil

    src = saved(tiny_llama(), tmp_path / "fp")
    repo, rev = tmp_path / "hub" / "models--tiny-org--tiny-llama", "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(src, repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    cfg = bs.BlockscaleConfig(scale_rule="4over6")
    ours = on_load("tiny-org/tiny-llama", cfg, cache_dir=str(tmp_path / "hub"), local_files_only=True)
    assert state_differences(ours, by_quantize_model(src, cfg)) == []
