"""qcache.attention: fp32 accumulation proved on flat attention at long length, and "qcache_fp32" equals stock sdpa
in fp32 through model.generate with QuantCache (tiny random Llama, Gemma 3 with sliding layers)."""

import pytest
import torch
from torch import nn
from transformers import Gemma2Config, Gemma2ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from conftest import COMMON, make_model
from qcache import QuantCache
from qcache.attention import ATTN_IMPLEMENTATION, fp32_sdpa_attention_forward, use_fp32_attention

LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}
# a sequential running sum of equal terms stops growing at 2**(significant bits): bf16 has 8, fp16 11
STALL_TERMS = {torch.bfloat16: 256, torch.float16: 2048}
OPTS = dict(k_group_size=16, v_group_size=16, v_scale="minmax", recent_tokens=4, sink_tokens=2)  # as tests/test_cache.py


class _Attn(nn.Module):
    """Stands in for a model's attention module: what an attention function reads from it."""

    def __init__(self, num_key_value_groups: int = 1):
        super().__init__()
        self.num_key_value_groups = num_key_value_groups
        self.is_causal = True


def running_sum(term: float, n: int, dtype: torch.dtype) -> float:
    """Add `term` n times, rounding to `dtype` after each addition (a low-precision accumulator)."""
    s, t = torch.zeros((), dtype=dtype), torch.tensor(term, dtype=dtype)
    for _ in range(n):
        nxt = s + t
        if nxt == s:  # adding the term no longer changes the sum: every later addition is lost too
            break
        s = nxt
    return float(s)


# ---------------------------------------------------------------------------------------------------------------
# flat attention: n equal scores, so the output must be mean(V)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", LOW_PRECISION.values(), ids=LOW_PRECISION.keys())
@pytest.mark.parametrize("n", [64, 256, 512, 4096, 131072])
def test_low_precision_running_sum_collapses(n, dtype):
    """What fp32 accumulation prevents: n weights 1/n summed in bf16 reach only min(n, 256) / n (fp16: 2048)."""
    total = running_sum(1.0 / n, n, dtype)
    assert total == min(n, STALL_TERMS[dtype]) / n
    if dtype == torch.bfloat16 and n == 131072:
        assert 1.0 - total > 0.998  # 99.8 % of the attention mass lost: a flat-attention test would fail


@pytest.mark.parametrize("dtype", LOW_PRECISION.values(), ids=LOW_PRECISION.keys())
@pytest.mark.parametrize("n", [4096, 131072])
@pytest.mark.parametrize("masked", [False, True], ids=["all-keys", "last-quarter-masked"])
def test_flat_attention_is_mean_of_values(n, dtype, masked):
    """One query over n keys with equal scores (GQA: 2 query heads on 1 kv head, head_dim 64): output == mean(V)
    within the output's rounding. Values lie in [1, 2), so a low-precision running sum would be off by 99.8 %."""
    gen = torch.Generator().manual_seed(0)
    D = 64
    q = torch.randn(1, 2, 1, D, generator=gen).to(dtype)  # [B, Hq, 1, D]
    k = torch.randn(1, 1, 1, D, generator=gen).to(dtype).expand(1, 1, n, D)  # one key repeated: equal scores
    v = (1.0 + torch.rand(1, 1, n, D, generator=gen)).to(dtype)  # [B, Hkv, n, D]
    mask, visible = None, n
    if masked:  # the hidden keys hold huge values: any leak shows
        visible = 3 * n // 4
        v[:, :, visible:] = 1000.0
        mask = torch.zeros(1, 1, 1, n, dtype=torch.bool)
        mask[..., :visible] = True
    out, weights = fp32_sdpa_attention_forward(_Attn(num_key_value_groups=2), q, k, v, mask)
    assert weights is None and out.dtype == dtype and out.shape == (1, 1, 2, D)  # [B, Tq, Hq, D]
    expected = v[:, :, :visible].double().mean(dim=2)  # [1, 1, D], the same for both query heads
    rel = ((out[0, 0].double() - expected[0]).abs() / expected[0]).max()
    unit_roundoff = 2.0 ** -(8 if dtype == torch.bfloat16 else 11)  # relative error of rounding the output to dtype
    assert rel <= unit_roundoff, f"max relative error {float(rel):.2e}"


# ---------------------------------------------------------------------------------------------------------------
# the function against an explicit float64 reference
# ---------------------------------------------------------------------------------------------------------------

def reference_attention(q, k, v, mask=None, scaling=None, causal=False, bias=None, softcap=None):
    """float64 attention, GQA by repeating kv heads: [B, Hq, Tq, D] -> [B, Tq, Hq, D]."""
    q, k, v = q.double(), k.double(), v.double()
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias.double()
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return (scores.softmax(-1) @ v).transpose(1, 2)


CASES = {
    "causal-no-mask": dict(tq=7, tk=7, causal=True),
    "bool-mask-gqa": dict(tq=5, tk=9, mask="bool"),
    "float-mask-mha": dict(tq=5, tk=9, mask="float", hkv=4),
    "decode-gqa": dict(tq=1, tk=9, mask="bool"),
    "decode-mqa-no-mask": dict(tq=1, tk=9, hkv=1),
    "position-bias": dict(tq=6, tk=6, causal=True, bias=True),
    "softcap": dict(tq=5, tk=9, mask="bool", softcap=0.5),
    "scaling": dict(tq=5, tk=9, mask="float", scaling=0.3),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_matches_float64_reference(case, dtype):
    c = {"hkv": 2, "mask": None, "causal": False, "bias": False, "softcap": None, "scaling": None, **CASES[case]}
    gen = torch.Generator().manual_seed(1)
    B, Hq, D = 2, 4, 16
    q = torch.randn(B, Hq, c["tq"], D, generator=gen).to(dtype)
    k = torch.randn(B, c["hkv"], c["tk"], D, generator=gen).to(dtype)
    v = torch.randn(B, c["hkv"], c["tk"], D, generator=gen).to(dtype)
    mask = None
    if c["mask"] is not None:  # lower-right causal with the first key of row 1 hidden (left padding)
        allowed = torch.ones(c["tq"], c["tk"], dtype=torch.bool).tril(c["tk"] - c["tq"])
        allowed = allowed.expand(B, 1, c["tq"], c["tk"]).clone()  # [B, 1, Tq, Tk]
        allowed[1, :, :, 0] = False
        mask = allowed if c["mask"] == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, -1e9).to(dtype)
    bias = torch.randn(1, Hq, c["tq"], c["tk"], generator=gen) if c["bias"] else None
    out, _ = fp32_sdpa_attention_forward(_Attn(Hq // c["hkv"]), q, k, v, mask, scaling=c["scaling"],
                                         is_causal=c["causal"], position_bias=bias, softcap=c["softcap"])
    ref = reference_attention(q, k, v, mask, c["scaling"], c["causal"], bias, c["softcap"])
    tol = 1e-5 if dtype == torch.float32 else 2.0 ** -8  # fp32 math; bf16: the output's own rounding
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_attention_sinks_raise():
    q = k = v = torch.zeros(1, 1, 1, 8)
    with pytest.raises(ValueError, match="s_aux"):
        fp32_sdpa_attention_forward(_Attn(), q, k, v, None, s_aux=torch.zeros(1))


# ---------------------------------------------------------------------------------------------------------------
# through transformers: registration, and generate with QuantCache against stock sdpa
# ---------------------------------------------------------------------------------------------------------------

def test_use_fp32_attention_registers_function_and_mask():
    model = use_fp32_attention(make_model("llama"))
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION] is fp32_sdpa_attention_forward
    # without a mask builder transformers would hand the function attention_mask=None (no causal/padding mask)
    assert ALL_MASK_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION] is sdpa_mask


def _left_padded_batch():
    ids = torch.randint(2, 96, (2, 70), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    ids[1, :9], mask[1, :9] = 0, 0  # row 1: 9 pad tokens on the left
    return ids, mask


def _generate_logits(model, attn, ids, mask):
    if attn == "sdpa":
        model.set_attn_implementation("sdpa")
    else:
        use_fp32_attention(model)
    cache = QuantCache(bits=4, **OPTS)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=8, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert cache.memory().packed > 0  # the quantized path was taken
    return out.sequences, torch.stack(out.logits, dim=1).float()  # [B, new, vocab]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_generate_with_quantcache_matches_stock_sdpa_fp32(family):
    """fp32 model: the same logits as stock sdpa at every generated step (left-padded batch; Gemma 3's sliding layers
    of window 24 over a 70-token prompt)."""
    model = make_model(family, torch.float32)
    ids, mask = _left_padded_batch()
    seq_ref, ref = _generate_logits(model, "sdpa", ids, mask)
    seq, out = _generate_logits(model, "fp32", ids, mask)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(out, ref, atol=1e-5 * float(ref.std()), rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_generate_with_quantcache_bf16_close_to_stock(family):
    """bf16 model: differs from stock bf16 sdpa only by rounding (stock rounds probabilities to bf16)."""
    model = make_model(family, torch.bfloat16)
    ids, mask = _left_padded_batch()
    _, ref = _generate_logits(model, "sdpa", ids, mask)
    _, out = _generate_logits(model, "fp32", ids, mask)
    assert (out - ref).abs().max() <= 0.1 * ref.std()


def _gemma2(softcap: float):
    torch.manual_seed(0)
    config = Gemma2Config(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=24,
                          query_pre_attn_scalar=32, attn_logit_softcapping=softcap, final_logit_softcapping=None,
                          **{**COMMON, "num_key_value_heads": 1})
    return Gemma2ForCausalLM(config).eval()


def _set_softcap(model, softcap):
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = softcap


def test_softcap_matches_eager_where_stock_sdpa_raises():
    """Gemma 2 soft-caps attention logits: stock sdpa raises on it, qcache_fp32 computes it (as eager, in fp32)."""
    model = _gemma2(softcap=0.5)  # small enough to change the logits of this tiny model
    ids, mask = _left_padded_batch()

    def logits(attn):
        if attn == ATTN_IMPLEMENTATION:
            use_fp32_attention(model)
        else:
            model.set_attn_implementation(attn)
        with torch.no_grad():
            return model(ids, attention_mask=mask).logits

    ref = logits("eager")
    torch.testing.assert_close(logits(ATTN_IMPLEMENTATION), ref, atol=1e-5 * float(ref.std()), rtol=1e-5)
    _set_softcap(model, None)
    assert (logits(ATTN_IMPLEMENTATION) - ref).abs().max() > 1e-3 * ref.std()  # the cap did change the logits
    q = torch.zeros(1, 1, 1, 8)
    with pytest.raises(ValueError, match="softcap"):
        sdpa_attention_forward(_Attn(), q, q, q, None, softcap=0.5)


def test_from_pretrained_by_name_after_import(tmp_path):
    """`import qcache` registers "qcache_fp32": from_pretrained(..., attn_implementation="qcache_fp32") just works
    (in a fresh process, so nothing else registered it first) and gives eager attention's logits in fp32."""
    import subprocess
    import sys

    make_model("llama").save_pretrained(tmp_path)
    script = (
        "import torch, qcache\n"
        "from transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, attn_implementation='qcache_fp32')\n"
        "assert model.config._attn_implementation == 'qcache_fp32'\n"
        "ids = torch.randint(2, 96, (1, 40))\n"
        "with torch.no_grad():\n"
        "    got = model(ids).logits\n"
        "    model.set_attn_implementation('eager')\n"
        "    ref = model(ids).logits\n"
        "torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)\n"
        "print('ok')\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]
