"""Tiny offline lm-evaluation-harness tasks (a task YAML over local JSONL data) and an independent hand count
of what lm-eval should report for them, for the ``blockscale eval tasks`` tests."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

# multiple choice: the story so far and three ways to go on; the labels are not always what the model prefers
MC_DOCS = [
    ("Once upon a time, there was a little", [" girl", " dog", " girl named Lily"], 0),  # acc, not acc_norm
    ("She loved to play outside in the", [" park", " garden", " sun"], 1),
    ("One day, she saw a big, red", [" ball", " apple", " balloon"], 2),
    ("Tom and his mom went to the store to buy some", [" food", " milk", " new shoes"], 1),
    ("The cat was very", [" hungry", " happy", " big"], 2),
    ("Lily wanted to share her toys with her", [" friend", " brother", " mom"], 0),
    ("The sun was shining and the birds were", [" singing", " flying", " happy"], 1),
    ("Ben was sad because he lost his", [" toy", " ball", " favorite red car"], 2),
    ("They played together all day and became best", [" friends", " buddies", " pals"], 0),
    ("Mom said, \"It is time to go to", [" bed", " sleep", " the park"], 0),
]
# loglikelihood (greedy match of the last word, as lm-eval's LAMBADA tasks score it)
LL_DOCS = [
    ("Once upon a time, there was a little girl named Lily. She loved to play outside in the", " park"),
    ("Tim had a red ball. He liked to throw the ball to his dog. The dog ran after the", " ball"),
    ("Sue was very hungry. Her mom made her a sandwich and Sue ate the", " sandwich"),
    ("The bird flew up into the tree. It sat on a branch and began to", " sing"),
    ("Max and Mia went to the beach. They built a big sand castle and played in the", " water"),
    ("Anna saw a cat in the garden. The cat was black and white. Anna wanted to pet the", " cat"),
]
MC_TASK, LL_TASK = "bs_tiny_mc", "bs_tiny_lastword"


def write_tasks(folder: Path) -> Path:
    """The two task YAMLs and their JSONL data in ``folder`` (the datasets cache inside it too)."""
    folder.mkdir(parents=True, exist_ok=True)
    mc, ll = folder / "mc.jsonl", folder / "ll.jsonl"
    mc.write_text("".join(json.dumps({"context": c, "choices": ch, "label": y}) + "\n" for c, ch, y in MC_DOCS))
    ll.write_text("".join(json.dumps({"context": c, "target": t}) + "\n" for c, t in LL_DOCS))
    cache = folder / "hf-datasets-cache"
    (folder / f"{MC_TASK}.yaml").write_text(f"""task: {MC_TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
target_delimiter: ""
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""")
    (folder / f"{LL_TASK}.yaml").write_text(f"""task: {LL_TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {ll}
  cache_dir: {cache}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
""")
    return folder


@torch.no_grad()
def score(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """(log-likelihood of ``continuation`` after ``context``, whether each of its tokens is the argmax): one
    sequence, no batch, the context encoded alone and the continuation's tokens those after it in the whole."""
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    cont = whole[len(ctx):]
    logits = model(torch.tensor([ctx + cont])).logits[0, len(ctx) - 1:-1].double()
    lp = torch.log_softmax(logits, dim=-1)
    picked = lp[torch.arange(len(cont)), torch.tensor(cont)]
    return float(picked.sum()), bool((lp.argmax(-1) == torch.tensor(cont)).all())


def hand_count(model, tokenizer, limit=None) -> dict:
    """{task: {metric: value}} counted here, one document at a time: multiple choice acc (argmax of the
    choices' log-likelihoods) and acc_norm (divided by each choice's length in characters); the last-word task's
    acc (the target is the greedy continuation) and perplexity (exp of minus the mean log-likelihood)."""
    mc = MC_DOCS[:limit]
    acc = norm = 0
    for context, choices, label in mc:
        lls = [score(model, tokenizer, context, c)[0] for c in choices]
        acc += max(range(len(lls)), key=lambda k: (lls[k], -k)) == label
        normed = [v / len(c) for v, c in zip(lls, choices)]
        norm += max(range(len(lls)), key=lambda k: (normed[k], -k)) == label
    ll = [score(model, tokenizer, c, t) for c, t in LL_DOCS[:limit]]
    return {MC_TASK: {"acc": acc / len(mc), "acc_norm": norm / len(mc)},
            LL_TASK: {"acc": sum(g for _, g in ll) / len(ll), "perplexity": math.exp(-sum(v for v, _ in ll) / len(ll))}}
