"""stories260K's tok512 as a transformers tokenizer (``stories260k.transformers_tokenizer``), saved next to
its exported checkpoints: ``AutoTokenizer.from_pretrained(dir)`` gives exactly tok512's ids (dummy-prefix
space, byte fallback for characters tok512 lacks, BOS 1 / EOS 2) and decodes back to the text."""
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from blockscale.data import Tokenizer  # noqa: E402
from blockscale.data.paths import data_root  # noqa: E402
from blockscale.models.stories260k import load_tokenizer, transformers_tokenizer  # noqa: E402

TRICKY = ["", " ", "  two  spaces ", " leading", "trailing  ", "\n", "\n\nnew\nlines\n\n", "a\tb\r\nc",
          "héllo wörld ✓ 日本語 🙂 \x00", "“quoted” — it’s…", "<s> and </s> are text here", "aaaaaaaa", "Lily!!"]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    from transformers import AutoTokenizer

    ours = load_tokenizer(data_root() / "stories260K" / "tok512.bin")
    d = tmp_path_factory.mktemp("tok")
    transformers_tokenizer(ours).save_pretrained(d)
    assert {p.name for p in d.iterdir()} >= {"tokenizer.json", "tokenizer_config.json"}
    return ours, AutoTokenizer.from_pretrained(d)


def _val_head(n=20000):
    return (data_root() / "tinystories" / "tinystories_val_head.txt").read_text(encoding="utf-8")[:n]


@pytest.mark.parametrize("text", [_val_head()] + TRICKY,
                         ids=["val_head"] + [repr(t)[:20] for t in TRICKY])
def test_same_ids_and_round_trip(toks, text):
    ours, theirs = toks
    ids = theirs.encode(text, add_special_tokens=False)
    assert ids == ours.encode(text)
    assert theirs.decode(ids, skip_special_tokens=True) == text == ours.decode(ids)


def test_special_tokens_and_byte_fallback(toks):
    ours, theirs = toks
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.unk_token_id) == (1, 2, 0)
    assert len(theirs) == ours.vocab_size == 512
    ids = ours.encode("日")  # not in tok512: its three UTF-8 bytes become byte-fallback tokens 3 + byte
    assert ids[-3:] == [3 + 0xE6, 3 + 0x97, 3 + 0xA5] and theirs.encode("日", add_special_tokens=False) == ids


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning")
def test_quantized_stories260k_directory_runs_in_transformers(tmp_path, stories260k_copy):
    """The built-in model's export carries the tokenizer; plain transformers tokenizes, loads and generates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from blockscale.export import export_checkpoint
    from blockscale.ptq import PTQConfig, quantize_model

    lm = stories260k_copy
    assert lm.tokenizer.hf is not None
    quantize_model(lm.model, PTQConfig(method="rtn", skip_indivisible=True), progress=False)
    out = export_checkpoint(lm.model, tmp_path / "ck", "compressed-tensors", tokenizer=lm.tokenizer.hf)
    tok = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([[1] + tok.encode("Once upon a time", add_special_tokens=False)])
    assert ids[0, 1:].tolist() == lm.tokenizer.encode("Once upon a time")
    assert isinstance(lm.tokenizer, Tokenizer) and lm.tokenizer.vocab_size == 512  # the one tokenizer interface
    assert lm.tokenizer.decode(lm.tokenizer.encode("Once upon a time")) == "Once upon a time"
    gen = AutoModelForCausalLM.from_pretrained(out).generate(ids, max_new_tokens=4, do_sample=False)
    assert gen.shape == (1, ids.shape[1] + 4)
    assert tok.decode(gen[0], skip_special_tokens=True).startswith("Once upon a time")
