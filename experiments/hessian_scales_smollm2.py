"""SmolLM2 W4A16 RTN: hessian / hessian-4over6 vs sweep / 4over6 (32 x 512 c4 calibration windows,
wikitext2 first 16384 tokens at ctx 1024, as experiments/ptq_results.py).

Usage: OMP_NUM_THREADS=1 python experiments/hessian_scales_smollm2.py hessian-4over6 4over6 sweep hessian
"""
import json, sys, time, torch
from blockscale.models.hf import load_model
from blockscale.ptq import PTQConfig
from blockscale.ptq.pipeline import default_texts, evaluate_ppl, quantized_copy
torch.set_num_threads(1)
lm = load_model("smollm2-135m")
d = default_texts("smollm2-135m")
for rule in sys.argv[1:]:
    cfg = PTQConfig(method="rtn", scale_rule=rule, n_samples=32, seq_len=512)
    t0 = time.time()
    qm, rep = quantized_copy(lm.model, lm.tokenizer, cfg, d.calib, d.calib_bos, progress=False)
    sec = time.time() - t0
    rec = evaluate_ppl(qm, lm.tokenizer, d.eval, d.ctx, d.bos, 16384)
    print(json.dumps({"rule": rule, "ppl": rec.ppl, "tokens": rec.tokens_evaluated, "quantize_seconds": sec,
                      "eval": d.eval, "calib": d.calib}), flush=True)
    del qm
