"""qcache.rope: undo -> redo is the identity, and our rotation is the model's."""

import pytest
import torch
from transformers import Gemma3TextConfig, GPT2Config, LlamaConfig, Phi3Config

from qcache.rope import RopeHelper

HEAD_DIM = 32


def llama(rope_parameters):
    return LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                       num_hidden_layers=2, max_position_embeddings=256, rope_parameters=rope_parameters)


ROPE_CONFIGS = {
    "default": lambda: llama({"rope_type": "default", "rope_theta": 10000.0}),
    "linear": lambda: llama({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "dynamic": lambda: llama({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    "yarn": lambda: llama({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                           "original_max_position_embeddings": 64}),
    "longrope": lambda: llama({"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": 64,
                               "short_factor": [1.0] * (HEAD_DIM // 2), "long_factor": [2.0] * (HEAD_DIM // 2)}),
    "llama3": lambda: llama({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "gemma3-per-layer-type": lambda: Gemma3TextConfig(
        hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM, num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"], sliding_window=16,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}}),
    "phi3-partial-rotary": lambda: Phi3Config(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                              num_hidden_layers=2, partial_rotary_factor=0.5),
}


SEQUENCE_DEPENDENT = ("dynamic", "longrope")


@pytest.mark.parametrize("name", sorted(set(ROPE_CONFIGS) - set(SEQUENCE_DEPENDENT)))
def test_undo_redo_identity(name):
    config = ROPE_CONFIGS[name]()
    rope = RopeHelper(config)
    gen = torch.Generator().manual_seed(0)
    head_dim = rope.head_dim
    x = torch.randn(2, 3, 40, head_dim, generator=gen)
    # per-row positions, as in a left-padded batch; past the original context for yarn/longrope/dynamic
    pos = torch.stack([torch.arange(100, 140), torch.arange(0, 40)])
    for layer_idx in range(config.num_hidden_layers):
        rotated = rope.redo(x, pos, layer_idx)
        assert not torch.allclose(rotated, x)
        back = rope.undo(rotated, pos, layer_idx)
        rel = (back - x).norm() / x.norm()
        assert rel < 1e-5, (name, layer_idx, float(rel))


@pytest.mark.parametrize("name", SEQUENCE_DEPENDENT)
def test_sequence_dependent_rope_is_refused(name):
    """Frequencies that change with the sequence length rotate a token differently depending on when attention saw
    it: such keys cannot be stored pre-RoPE, and the error says what to use instead."""
    with pytest.raises(ValueError, match=rf"rope_type '{name}'.*rope='post'"):
        RopeHelper(ROPE_CONFIGS[name]())


@pytest.mark.parametrize("name", sorted(set(ROPE_CONFIGS) - set(SEQUENCE_DEPENDENT)))
def test_composed_rotation_equals_the_models(name):
    """The read re-applies RoPE by angle addition from block-start and offset factors: the same rotation as the
    model's cos/sin at every position (per row, incl. rows starting at negative positions = left padding)."""
    from qcache.rope import compose

    config = ROPE_CONFIGS[name]()
    rope = RopeHelper(config)
    for first in (torch.tensor([0, -3, 7]), torch.tensor([5000])):
        # the model computes the angle p * t in fp32, rounded to within 2^-24 p t: cos/sin of far positions carry
        # that much of its own error (about 1.5e-4 at p = 5200 for t = 1); near 0 both agree to fp32 rounding
        atol = max(2e-6, 2 * float(first.max() + 200) * 2**-24)
        for layer_idx in range(config.num_hidden_layers):
            cos, sin = rope._compute(first[:, None] + torch.arange(200), rope._layer_type(layer_idx))  # the model's
            c, s = compose(rope.factors(first, 200, layer_idx, block=64), 200)
            h = cos.shape[-1] // 2
            torch.testing.assert_close(c, cos[..., :h], rtol=0, atol=atol)
            torch.testing.assert_close(s, sin[..., :h], rtol=0, atol=atol)


def test_partial_rotary_passes_tail_through():
    config = ROPE_CONFIGS["phi3-partial-rotary"]()
    rope = RopeHelper(config)
    x = torch.randn(1, 1, 4, rope.head_dim)
    out = rope.redo(x, torch.arange(4).unsqueeze(0) + 3, 0)
    half = rope.head_dim // 2
    assert torch.equal(out[..., half:], x[..., half:])
    assert not torch.allclose(out[..., :half], x[..., :half])


def test_gemma3_layer_types_rotate_differently():
    rope = RopeHelper(ROPE_CONFIGS["gemma3-per-layer-type"]())
    x = torch.randn(1, 1, 4, HEAD_DIM)
    pos = torch.arange(50, 54).unsqueeze(0)
    assert not torch.allclose(rope.redo(x, pos, 0), rope.redo(x, pos, 1))


def test_matches_model_rotation():
    """redo() must reproduce what LlamaAttention does to keys (apply_rotary_pos_emb with the model's cos/sin)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = ROPE_CONFIGS["llama3"]()
    x = torch.randn(2, 2, 8, HEAD_DIM)
    pos = torch.arange(8).unsqueeze(0).expand(2, 8) + torch.tensor([[0], [30]])
    cos, sin = LlamaRotaryEmbedding(config)(x, pos)
    _, expected = apply_rotary_pos_emb(x, x, cos, sin)
    got = RopeHelper(config).redo(x, pos, 0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_model_without_rope_raises():
    with pytest.raises(ValueError, match="gpt2.*rope='post'"):
        RopeHelper(GPT2Config(n_layer=1, n_embd=32, n_head=2))


# ---------------------------------------------------------------------------------------------------------
# the layout check: by calling the modeling file's rotary function, however it is wrapped
# ---------------------------------------------------------------------------------------------------------


def _rotate_half_reference(q, k, cos, sin, unsqueeze_dim=1):
    """The rotate-half layout, written here independently of qcache and of transformers."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def rot(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def _interleaved_reference(q, k, cos, sin, unsqueeze_dim=1):
    """Pairs (2i, 2i+1) rotated together (GLM style: the module's [t, t] re-interleaved), written independently."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    h = cos.shape[-1] // 2
    c, s = cos[..., :h].repeat_interleave(2, -1), sin[..., :h].repeat_interleave(2, -1)

    def rot(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    return q * c + rot(q) * s, k * c + rot(k) * s


def _mirrored_reference(q, k, cos, sin, unsqueeze_dim=1):
    """Pairs (i, D-1-i): a layout qcache neither has nor can reach by reordering pairs of its own, so it refuses."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def rot(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:].flip(-1), x[..., :h].flip(-1)), dim=-1)

    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


class _KernelsStyleWrapper(torch.nn.Module):
    """What the `kernels` package makes of a decorated function: a module whose forward takes anything."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def _functools_wrapped(fn):
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


def _modeling_module(apply_rotary_pos_emb):
    """A stand-in modeling file: Llama's rotary-embedding class beside the rotary function under test."""
    import types

    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    module = types.ModuleType("fake_modeling_llama")
    module.LlamaRotaryEmbedding = LlamaRotaryEmbedding
    if apply_rotary_pos_emb is not None:
        module.apply_rotary_pos_emb = apply_rotary_pos_emb
    return module


ACCEPTED_WRAPPINGS = {
    "plain-function": lambda: _rotate_half_reference,
    "functools-wraps": lambda: _functools_wrapped(_rotate_half_reference),
    "kernels-nn-module": lambda: _KernelsStyleWrapper(_rotate_half_reference),
    "lambda-args-kwargs": lambda: (lambda *a, **kw: _rotate_half_reference(*a, **kw)),
}


@pytest.mark.parametrize("wrapping", sorted(ACCEPTED_WRAPPINGS))
def test_layout_check_accepts_any_wrapping_of_the_rotate_half_function(wrapping):
    module = _modeling_module(ACCEPTED_WRAPPINGS[wrapping]())
    rope = RopeHelper(ROPE_CONFIGS["default"](), modeling_module=module, prefix="Llama")
    x = torch.randn(1, 2, 6, HEAD_DIM)
    pos = torch.arange(6)[None] + 11
    torch.testing.assert_close(rope.undo(rope.redo(x, pos, 0), pos, 0), x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wrapping", ["plain-function", "kernels-nn-module"])
def test_interleaved_pairs_are_kept_in_rotate_half_order(wrapping):
    """A modeling file rotating pairs (2i, 2i+1) is accepted as the interleaved layout: keys put in pair order
    (`to_pairs`) and rotated there, then put back (`from_pairs`), are what the modeling file's function gives, and
    undoing RoPE in pair order gives the keys back."""
    fn = _interleaved_reference if wrapping == "plain-function" else _KernelsStyleWrapper(_interleaved_reference)
    rope = RopeHelper(ROPE_CONFIGS["default"](), modeling_module=_modeling_module(fn), prefix="Llama")
    assert rope.layout == "interleaved"
    x = torch.randn(1, 2, 6, HEAD_DIM)
    pos = torch.arange(6)[None] + 11
    raw = rope._compute(pos, None, raw=True)
    expected, _ = _interleaved_reference(x, x, *raw)
    torch.testing.assert_close(rope.from_pairs(rope.redo(rope.to_pairs(x), pos, 0)), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rope.undo(rope.to_pairs(expected), pos, 0), rope.to_pairs(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(rope.from_pairs(rope.to_pairs(x)), x)
    assert not torch.equal(rope.to_pairs(x), x)  # (the order does change)


def test_rotate_half_keeps_the_channel_order():
    rope = RopeHelper(ROPE_CONFIGS["default"](), modeling_module=_modeling_module(_rotate_half_reference),
                      prefix="Llama")
    x = torch.randn(1, 2, 3, HEAD_DIM)
    assert rope.layout == "half" and rope.to_pairs(x) is x and rope.from_pairs(x) is x


REFUSED = {
    "mirrored-layout": (lambda: _mirrored_reference, r"layout qcache does not undo"),
    "mirrored-in-a-kernels-module": (lambda: _KernelsStyleWrapper(_mirrored_reference),
                                     r"layout qcache does not undo"),
    "cannot-be-called-so": (lambda: (lambda q, cos, sin: q), r"cannot be called as apply_rotary_pos_emb\(q, k, cos, sin\)"
                            r".*TypeError"),
    "returns-one-tensor": (lambda: (lambda q, k, cos, sin, unsqueeze_dim=1: q), r"returned Tensor, expected \(q_rot, "
                           r"k_rot\)"),
    "missing": (lambda: None, r"has no apply_rotary_pos_emb"),
    "not-callable": (lambda: "apply_rotary_pos_emb", r"has no apply_rotary_pos_emb .*found str"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_layout_check_refuses_what_it_cannot_verify(case):
    import transformers

    make, message = REFUSED[case]
    module = _modeling_module(make())
    with pytest.raises(ValueError, match=message) as err:
        RopeHelper(ROPE_CONFIGS["default"](), modeling_module=module, prefix="Llama")
    assert "rope='post'" in str(err.value) and "model_type='llama'" in str(err.value)
    if case not in ("mirrored-layout", "mirrored-in-a-kernels-module"):
        assert f"transformers {transformers.__version__}" in str(err.value)


def test_installed_llama_rotary_function_is_checked_by_calling_it():
    """On transformers with `kernels` installed, Llama's apply_rotary_pos_emb is an nn.Module taking *args/**kwargs;
    without it, a plain function. Either way the installed modeling file passes the numeric check."""
    import transformers.models.llama.modeling_llama as modeling_llama

    fn = modeling_llama.apply_rotary_pos_emb
    assert callable(fn)
    rope = RopeHelper(ROPE_CONFIGS["default"](), modeling_module=modeling_llama, prefix="Llama")
    assert rope.head_dim == HEAD_DIM
