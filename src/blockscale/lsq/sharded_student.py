"""The scale-learning student built for FSDP2 without ever holding the whole model on a rank (``blockscale
learn-scales --fsdp``): the PTQ initialisation streams the source one decoder layer at a time with the
data-parallel calibration of ``ptq.distributed`` (each rank runs its share of the calibration batches, the
statistics are reduced over the ranks, GPTQ's solves are spread over them), and as soon as a layer is
quantized its scales are made trainable (``enable``, starting from the exact PTQ model as
``quantize_student`` + ``recover`` do) and the layer is ``fully_shard``-ed, so each rank keeps its shard of
the latent weights and amaxes and the next layer is read.

    student = stream_sharded_student("model_dir", PTQConfig(), calibration, RecoveryConfig(...))
    teacher = train.fsdp_source.sharded_from_source(StreamingModel("model_dir", torch.bfloat16))

What a rank holds at any time: its shards of the layers done, the quantized buffers of those layers (packed
codes, block and outer scales: FSDP2 does not shard buffers), the embeddings / final norm / head until the
root is sharded at the end, the calibration activations of its batches, and the one layer being quantized.
What it reads: every layer of the source once (each rank calibrates on whole layers).
``shard_enabled_student`` does the same for a student that is quantized already (a checkpoint input):
``enable`` and ``fully_shard`` block by block.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from ..models.hf_streaming import StreamingModel, release, trim_heap
from ..ptq import PTQConfig, PTQReport
from ..ptq.capture import decoder_layers
from ..ptq.finite import check_finite_parameters
from ..ptq.quantize_model import finish_pass, first_inputs, quantize_layer, start_pass
from ..train.fsdp import block_modules, checkpoint_blocks, shard_block, shard_model
from .enable import enable, exact_latent_weights, learner_modules
from .quantizer import ignore_fsdp_view_warning
from .recover import FUSED_EXPERT_WEIGHTS, RecoveryConfig


@dataclass(frozen=True)
class ShardingOptions:
    """FSDP2 settings of the student: the mixed-precision parameter dtype of everything but the LSQ learners
    (always FP32), FSDP2's CPU offload policy (an accelerator run) and activation checkpointing per block."""

    param_dtype: str = "fp32"
    cpu_offload: bool = False
    activation_checkpointing: bool = False


@dataclass
class ShardedStudent:
    """``stream_sharded_student``'s result: the sharded LSQ ``model``, the PTQ ``report``, the Linears whose
    latent weight is the dequantized one (``dequantized``, e.g. GPTQ's) and ``bytes_read`` (this rank's bytes
    read from the source)."""

    model: nn.Module
    report: PTQReport
    dequantized: list = field(default_factory=list)
    bytes_read: int = 0


def _enable_layer(layer: nn.Module, recovery: RecoveryConfig, weights) -> None:
    if not learner_candidates(layer):
        return  # nothing NVFP4 in this layer (a recipe that keeps it in high precision)
    enable(layer, mode=recovery.mode, init="stored", weights=weights, param=recovery.param,
           dual_form=recovery.dual_form, learn_input_scales=recovery.learn_input_scales,
           weight_units=recovery.weight_units)


def learner_candidates(module: nn.Module) -> bool:
    """Whether ``module`` holds an NVFP4 layer ``enable`` makes trainable."""
    from ..nn.nvfp4_experts import NVFP4Experts
    from ..nn.nvfp4_linear import NVFP4Linear

    return any(isinstance(m, (NVFP4Linear, NVFP4Experts)) for m in module.modules())


def _shard(layer: nn.Module, options: ShardingOptions) -> None:
    ignore_fsdp_view_warning()
    shard_block(layer, options.param_dtype, learner_modules(layer), options.cpu_offload)


def stream_sharded_student(source, config: PTQConfig, calibration: Optional[torch.Tensor],
                           recovery: RecoveryConfig = RecoveryConfig(), options: ShardingOptions = ShardingOptions(),
                           *, on_layer: Optional[Callable[[int, nn.Module], None]] = None,
                           progress: bool = True) -> ShardedStudent:
    """Quantize the model at ``source`` (a local safetensors directory or a streamable GGUF file) layer by
    layer with ``config`` (``calibration``: the token ids [n, T] every rank passes, None for RTN-like
    methods), make each layer's scales trainable and shard it (see the module docstring); collective: every
    rank of the process group calls it. ``on_layer(i, model)``: called after layer i is sharded (tests)."""
    t0 = time.time()
    src = StreamingModel(source, torch.float32)
    model = src.model
    if getattr(model.config, "use_cache", None) is not None:  # as models.hf.load_model
        model.blockscale_use_cache = bool(model.config.use_cache)
        model.config.use_cache = False
    layers = decoder_layers(model)
    prefix = next(n for n, m in model.named_modules() if m is layers)
    src.load_outside(prefix)
    run = start_pass(model, config, calibration, check_finite=False, data_parallel=None)
    run.latent = {}
    inputs = first_inputs(run, calibration)
    dequantized: list[str] = []
    it = range(len(layers))
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc=f"PTQ {config.label} + sharding (streaming)", unit="layer")
    for i in it:
        path = f"{prefix}.{i}"
        src.load_module(path)
        check_finite_parameters([nn.Module()] * i + [layers[i]], prefix)
        run.method.check_layer(layers[i], path)
        inputs = quantize_layer(run, i, inputs)
        floats = {**run.per_layer[i], **dict(run.per_layer_experts[i])}
        candidates = {n[len(path) + 1:]: run.latent.pop(n) for n in [k for k in run.latent if k.startswith(path + ".")]}
        for name, mod in dict(run.per_layer_experts[i]).items():  # the full-precision fused experts (RTN: exact)
            for key in FUSED_EXPERT_WEIGHTS:
                w = getattr(mod, key, None)
                if isinstance(w, torch.Tensor) and w.dim() == 3:
                    candidates.setdefault(f"{name[len(path) + 1:]}.{key}", w.detach())
        weights, deq = exact_latent_weights(layers[i], candidates)
        dequantized += [f"{path}.{n}" for n in deq]
        _enable_layer(layers[i], recovery, weights)
        del weights, candidates
        for mod in floats.values():
            release(mod)  # the float modules the plan refers to (replaced in the model)
        if options.activation_checkpointing:
            from torch.distributed._composable import checkpoint

            checkpoint(layers[i])
        _shard(layers[i], options)
        trim_heap()
        if on_layer is not None:
            on_layer(i, model)
    report = finish_pass(run, t0)
    shard_model(model, options.param_dtype, cpu_offload=options.cpu_offload, blocks=False)
    src.close()
    return ShardedStudent(model, report, dequantized, src.bytes_read)


def shard_enabled_student(student: nn.Module, recovery: RecoveryConfig = RecoveryConfig(),
                          options: ShardingOptions = ShardingOptions(), weights=None) -> nn.Module:
    """A quantized ``student`` (e.g. a checkpoint, whole on every rank: its packed codes) made trainable and
    sharded block by block: ``enable`` on one block (its latent weights: ``weights`` or the dequantized ones),
    that block ``fully_shard``-ed, then the next, so the FP32 latent weights of the whole model never exist on
    a rank; then the rest and the root. Collective."""
    if options.activation_checkpointing:
        checkpoint_blocks(student)
    for block in block_modules(student):
        prefix = next(n for n, m in student.named_modules() if m is block)
        _enable_layer(block, recovery, _under(weights, prefix))
        _shard(block, options)
        trim_heap()
    inside = {id(m) for b in block_modules(student) for m in b.modules()}
    if any(learner_candidates(m) for m in student.modules() if id(m) not in inside and not list(m.children())):
        raise ValueError("the student has NVFP4 layers outside its decoder blocks (e.g. the head): sharding it block "
                         "by block would leave them out; run it without --fsdp")
    shard_model(student, options.param_dtype, cpu_offload=options.cpu_offload, blocks=False)
    return student


def _under(weights, prefix: str):
    if weights is None:
        return None
    return {k[len(prefix) + 1:]: w for k, w in weights.items() if k.startswith(prefix + ".")}


__all__ = ["ShardedStudent", "ShardingOptions", "learner_candidates", "shard_enabled_student",
           "stream_sharded_student"]
