"""Wire codecs (quant/transforms/wire.py): token rows <-> self-contained byte rows for the MoE all-to-all."""
import pytest
import torch

import blockscale as bs
from blockscale.quant import WIRE_PAYLOADS, decode_rows, emulate, encode_rows, row_bytes, wire_spec

pytestmark = pytest.mark.usefixtures("one_thread")

QUANTIZED = ("nvfp4", "mxfp8", "s2f6")
INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def same_bits(a, b):
    """Equal dtype, shape and bit patterns (so -0.0 != +0.0 and NaN == NaN with the same payload)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    it = INT_VIEW[a.element_size()]
    return torch.equal(a.contiguous().view(it), b.contiguous().view(it))


def library_values(x, payload, seed=0):
    """What the library alone gives: fake_quantize with the wire spec (bf16: a cast)."""
    if payload == "bf16":
        return x.to(torch.bfloat16).float()
    return bs.fake_quantize(x, wire_spec(payload, seed), dtype=torch.float32)


def token_rows(T=6, d=64, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g) * torch.logspace(-3, 3, T).unsqueeze(1)
    x[1] = 0.0  # a token of all zeros
    x[2, ::3] = -0.0
    x[3] = 1e-6 * torch.sign(x[3])  # one outlier next to tiny values
    x[3, 5] = 3e4
    return x.to(dtype)


# ---- sizes ---------------------------------------------------------------------------------------

def test_row_bytes_at_d_4096():
    d = 4096
    expected = {"bf16": 8192, "nvfp4": 2048 + 256 + 4, "mxfp8": 4096 + 128, "s2f6": 4096 + 128}
    bits = {"bf16": 16.0, "nvfp4": 4.5078125, "mxfp8": 8.25, "s2f6": 8.25}
    for payload in WIRE_PAYLOADS:
        assert row_bytes(payload, d) == expected[payload]
        assert 8 * row_bytes(payload, d) / d == bits[payload]


@pytest.mark.parametrize("d", [32, 64, 96, 2880])
def test_row_bytes_formula(d):
    assert row_bytes("bf16", d) == 2 * d
    assert row_bytes("nvfp4", d) == d // 2 + d // 16 + 4
    assert row_bytes("mxfp8", d) == row_bytes("s2f6", d) == d + d // 32
    assert row_bytes("nvfp4", 16) == 13 and row_bytes("bf16", 3) == 6


def test_wire_specs():
    assert wire_spec("bf16") is None
    assert wire_spec("nvfp4") == bs.NVFP4(outer="row")
    assert wire_spec("mxfp8") == bs.MX(element="e4m3", scale_rule="ceil")
    assert wire_spec("s2f6", seed=5) == bs.S2F6(hadamard=True, seed=5)


# ---- round trip = emulation = library ------------------------------------------------------------

@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("payload", WIRE_PAYLOADS)
def test_round_trip_equals_emulate_and_library(payload, in_dtype):
    x = token_rows(dtype=in_dtype)
    buf = encode_rows(x, payload, seed=3)
    assert buf.dtype == torch.uint8 and buf.shape == (6, row_bytes(payload, 64)) and buf.is_contiguous()
    y = decode_rows(buf, payload, 64, seed=3)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert same_bits(y, emulate(x, payload, seed=3))
    assert same_bits(y, library_values(x, payload, seed=3))
    assert torch.isfinite(y).all()
    assert (y[1] == 0).all()  # the zero token decodes to exact zeros
    # a lower-precision output is the FP32 result rounded once
    assert same_bits(decode_rows(buf, payload, 64, seed=3, dtype=torch.bfloat16), y.to(torch.bfloat16))
    assert same_bits(emulate(x, payload, seed=3, dtype=torch.bfloat16), y.to(torch.bfloat16))


@pytest.mark.parametrize("payload", QUANTIZED)
def test_byte_fields_are_the_quantized_tensor(payload):
    x = token_rows(T=4, d=64)
    q = bs.quantize(x, wire_spec(payload))
    buf = encode_rows(x, payload)
    n_codes = q.codes.shape[1] * q.codes.element_size()
    n_scales = q.scales.shape[1]
    assert torch.equal(buf[:, :n_codes], q.codes.view(torch.uint8))
    assert torch.equal(buf[:, n_codes:n_codes + n_scales], q.scales.view(torch.uint8))
    if payload == "nvfp4":
        outer = buf[:, n_codes + n_scales:].contiguous().view(torch.float32)
        assert same_bits(outer, q.outer_scale)
        assert outer[1].item() == 1.0  # zero row: S = 1


def test_golden_bytes():
    row = torch.tensor([[0.5, -6.0, 1.0, 0.0, -0.0, 3.0, -1.5, 6.0] + [0.0] * 8])
    # amax 6 -> S = 448, block scale 448 (E4M3 0x7E), codes as packed by the spec example
    expected = [0xF1, 0x02, 0x58, 0x7B, 0, 0, 0, 0, 0x7E, 0x00, 0x00, 0xE0, 0x43]
    assert encode_rows(row, "nvfp4")[0].tolist() == expected

    row = torch.zeros(1, 32)
    row[0, :5] = torch.tensor([448.0, -2.0, 1.0, 0.5, -0.0])
    # amax 448 -> k = 0 -> b = 127; E4M3 codes 0x7E, 0xC0, 0x38, 0x30, 0x80
    assert encode_rows(row, "mxfp8")[0].tolist() == [0x7E, 0xC0, 0x38, 0x30, 0x80] + [0] * 27 + [0x7F]

    # bf16 RNE: 1 + 2^-8 ties to 1.0 (even), 1 + 3 * 2^-8 ties up to 1 + 2^-6
    row = torch.tensor([[1.0, -2.0, 1 + 2**-8, 1 + 3 * 2**-8]])
    assert encode_rows(row, "bf16")[0].tolist() == [0x80, 0x3F, 0x00, 0xC0, 0x80, 0x3F, 0x82, 0x3F]


# ---- rows are independent (what lets the all-to-all split them) -----------------------------------

@pytest.mark.parametrize("payload", WIRE_PAYLOADS)
def test_rows_are_independent(payload):
    x = token_rows(T=7, d=96, seed=1)
    buf = encode_rows(x, payload, seed=2)
    y = decode_rows(buf, payload, 96, seed=2)
    for a, b in [(0, 1), (2, 5), (6, 7), (0, 7)]:
        assert torch.equal(encode_rows(x[a:b], payload, seed=2), buf[a:b])
        assert same_bits(decode_rows(buf[a:b], payload, 96, seed=2), y[a:b])
    perm = torch.tensor([4, 0, 6, 2, 1, 5, 3])
    assert torch.equal(encode_rows(x[perm], payload, seed=2), buf[perm])
    # rows received from several ranks, concatenated in another order
    assert same_bits(decode_rows(torch.cat((buf[5:], buf[:5])), payload, 96, seed=2), torch.cat((y[5:], y[:5])))


@pytest.mark.parametrize("payload", WIRE_PAYLOADS)
def test_strided_inputs(payload):
    x = token_rows(T=5, d=64)
    xt = x.t().contiguous().t()  # same values, column-major
    buf = encode_rows(xt, payload)
    assert torch.equal(buf, encode_rows(x, payload))
    wide = torch.cat((buf, torch.full((5, 7), 0xAB, dtype=torch.uint8)), dim=1)[:, :buf.shape[1]]
    assert same_bits(decode_rows(wide, payload, 64), decode_rows(buf, payload, 64))


# ---- edge cases ------------------------------------------------------------------------------------

@pytest.mark.parametrize("payload", WIRE_PAYLOADS)
def test_no_tokens(payload):
    x = torch.zeros(0, 64)
    buf = encode_rows(x, payload)
    assert buf.shape == (0, row_bytes(payload, 64)) and buf.dtype == torch.uint8
    y = decode_rows(buf, payload, 64, dtype=torch.bfloat16)
    assert y.shape == (0, 64) and y.dtype == torch.bfloat16
    assert emulate(x, payload).shape == (0, 64)


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("payload", WIRE_PAYLOADS)
def test_zero_rows_decode_to_zeros(payload, in_dtype):
    x = torch.zeros(3, 32, dtype=in_dtype)
    x[1] = -0.0
    y = decode_rows(encode_rows(x, payload), payload, 32)
    assert not torch.isnan(y).any() and (y == 0).all()
    assert same_bits(y, emulate(x, payload))
    if payload != "s2f6":  # the rotation mixes signs of zeros; the others keep them
        assert not torch.signbit(y[0]).any() and torch.signbit(y[1]).all()


@pytest.mark.parametrize("payload", WIRE_PAYLOADS)
def test_extreme_rows(payload):
    x = torch.full((4, 64), 1e-30)
    x[0, 7] = -1e30          # huge outlier next to tiny values
    x[1] = 1e-40             # FP32 subnormals only (NVFP4: S clamps to FLT_MAX)
    x[2] = torch.linspace(-3e36, 3e36, 64)  # S2F6's rotation needs |x| < FLT_MAX/32
    x[3, ::2] = -x[3, ::2]
    y = decode_rows(encode_rows(x, payload), payload, 64)
    assert same_bits(y, emulate(x, payload)) and same_bits(y, library_values(x, payload))
    assert torch.isfinite(y).all()
    assert y[0, 7].item() == pytest.approx(-1e30, rel=0.07)
    assert y[2].abs().max().item() == pytest.approx(3e36, rel=0.07)


def test_s2f6_seed_is_part_of_the_format():
    x = token_rows(T=4, d=64)
    a, b = encode_rows(x, "s2f6", seed=0), encode_rows(x, "s2f6", seed=1)
    assert not torch.equal(a, b)
    assert same_bits(decode_rows(b, "s2f6", 64, seed=1), emulate(x, "s2f6", seed=1))
    assert not torch.equal(decode_rows(b, "s2f6", 64, seed=0), decode_rows(b, "s2f6", 64, seed=1))


def test_bf16_carries_non_finite_values():
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), 1.0]])
    y = decode_rows(encode_rows(x, "bf16"), "bf16", 4)
    assert same_bits(y, emulate(x, "bf16"))
    assert torch.isnan(y[0, 0]) and y[0, 1] == float("inf") and y[0, 2] == -float("inf")


def test_outputs_are_private_copies():
    x = torch.ones(2, 32, dtype=torch.bfloat16)
    buf = encode_rows(x, "bf16")
    buf.zero_()
    assert (x == 1).all()
    buf = encode_rows(x, "bf16")
    y = decode_rows(buf, "bf16", 32, dtype=torch.bfloat16)
    buf.zero_()
    assert (y == 1).all()


# ---- errors ----------------------------------------------------------------------------------------

def test_unknown_payload():
    x = torch.zeros(2, 32)
    for call in (lambda: row_bytes("fp8", 32), lambda: encode_rows(x, "fp8"), lambda: wire_spec("fp8"),
                 lambda: decode_rows(torch.zeros(2, 33, dtype=torch.uint8), "fp8", 32),
                 lambda: emulate(x, "fp8")):
        with pytest.raises(ValueError, match=r"payload='fp8'.*'bf16', 'nvfp4', 'mxfp8', 's2f6'"):
            call()


def test_d_not_a_multiple_of_the_block():
    with pytest.raises(ValueError, match="d=24: payload 'nvfp4' needs d to be a multiple of 16"):
        row_bytes("nvfp4", 24)
    for payload in ("mxfp8", "s2f6"):
        with pytest.raises(ValueError, match=f"d=48: payload '{payload}' needs d to be a multiple of 32"):
            encode_rows(torch.zeros(2, 48), payload)
        with pytest.raises(ValueError, match="multiple of 32"):
            emulate(torch.zeros(2, 48), payload)
        with pytest.raises(ValueError, match="multiple of 32"):
            decode_rows(torch.zeros(2, 49, dtype=torch.uint8), payload, 48)
    for d in (0, -32, 32.0, True):
        with pytest.raises(ValueError, match="expected a positive int"):
            row_bytes("mxfp8", d)


def test_bad_buffers():
    buf = encode_rows(torch.ones(2, 64), "nvfp4")
    with pytest.raises(ValueError, match=r"buf has shape \(2, 37\).*\[T, 40\]"):
        decode_rows(buf[:, :-3], "nvfp4", 64)
    with pytest.raises(ValueError, match=r"buf has shape \(2, 40\).*\[T, 31\]"):
        decode_rows(buf, "nvfp4", 48)  # the wrong d: 24 + 3 + 4 bytes
    with pytest.raises(ValueError, match=r"buf has shape \(80,\)"):
        decode_rows(buf.reshape(-1), "nvfp4", 64)
    with pytest.raises(ValueError, match="buf has dtype torch.int8; allowed dtype: torch.uint8"):
        decode_rows(buf.view(torch.int8), "nvfp4", 64)
    with pytest.raises(ValueError, match="dtype=torch.int32 is not supported"):
        decode_rows(buf, "nvfp4", 64, dtype=torch.int32)


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"x must be 2-D \[tokens, d\], got shape \(64,\)"):
        encode_rows(torch.ones(64), "mxfp8")
    with pytest.raises(ValueError, match=r"x must be 2-D.*\(2, 2, 32\)"):
        emulate(torch.ones(2, 2, 32), "bf16")
    with pytest.raises(ValueError, match="x has dtype torch.int32"):
        encode_rows(torch.ones(2, 32, dtype=torch.int32), "s2f6")
    for payload in QUANTIZED:
        for bad in (float("nan"), float("inf")):
            x = torch.ones(2, 32)
            x[1, 3] = bad
            with pytest.raises(ValueError, match=f"x contains 1 NaN/inf value.*payload '{payload}' needs finite"):
                encode_rows(x, payload)
            with pytest.raises(ValueError, match="NaN/inf"):
                emulate(x, payload)
    # the library's own range check of the S2F6 rotation comes through unchanged
    with pytest.raises(ValueError, match="FLT_MAX/32"):
        encode_rows(torch.full((1, 32), 2e37), "s2f6")
