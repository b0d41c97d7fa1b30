"""rotate="auto": keys rotated per layer where the weights predict a smaller score error (qcache/keyrot.py)."""

import logging

import pytest
import torch
from conftest import make_model

from qcache import QuantCache
from qcache.keyrot import key_rotation_ratio, weight_energies
from qcache.rotation import hadamard_rotation


def test_ratio_is_one_for_flat_queries_and_follows_the_overlap_of_energies():
    R = hadamard_rotation(16, seed=0)
    s = torch.rand(2, 16) + 0.1
    # queries equally strong in every channel: the rotation moves error around but keeps its total
    assert key_rotation_ratio(torch.ones(2, 16), s, R) == pytest.approx(1.0, rel=1e-5)
    # one block spanning the head: mean(w) mean(s) / mean(w s)
    w = torch.rand(2, 16) + 0.1
    expected = float((w.mean(-1) * s.mean(-1)).sum() / (w * s).mean(-1).sum())
    assert key_rotation_ratio(w, s, R) == pytest.approx(expected, rel=1e-5)
    # queries where the keys are large: rotating spreads their error onto channels the queries ignore (< 1);
    # queries where the keys are small: rotating moves the large channels' error onto them (> 1)
    big = torch.zeros(1, 16)
    big[0, :4] = 10.0
    k = big + 1.0
    assert key_rotation_ratio(k, k, R) < 1 < key_rotation_ratio(1 / k, k, R)


def _steer(model, layer: int, aligned: bool):
    """Make the query energy of `layer` follow its key energy (aligned) or the reverse, channel by channel."""
    att = model.model.layers[layer].self_attn
    D = att.head_dim
    with torch.no_grad():
        gain = torch.ones(D)
        gain[:4] = gain[D // 2:D // 2 + 4] = 8.0  # channels 0-3 and their RoPE partners
        att.k_proj.weight.view(-1, D, att.k_proj.weight.shape[1]).mul_(gain[None, :, None])
        q_gain = gain if aligned else 1 / gain
        att.q_proj.weight.view(-1, D, att.q_proj.weight.shape[1]).mul_(q_gain[None, :, None])


def test_auto_rotates_the_layers_the_weights_say():
    model = make_model("llama")
    _steer(model, 0, aligned=True)
    _steer(model, 1, aligned=False)
    ids = torch.randint(2, 96, (1, 300), generator=torch.Generator().manual_seed(0))
    auto = QuantCache(bits=3)
    with torch.no_grad():
        model(ids, cache=auto)
    choice = auto.key_rotation
    assert choice[0]["rotate"] == "kv" and choice[0]["ratio"] < 1
    assert choice[1]["rotate"] == "v" and choice[1]["ratio"] > 1
    assert auto.layers[0].k_codec.rotation and not auto.layers[1].k_codec.rotation


@pytest.mark.parametrize("aligned,fixed", [(True, "kv"), (False, "v")])
def test_auto_is_exactly_the_fixed_choice_it_makes(aligned, fixed):
    model = make_model("llama")
    for layer in (0, 1):
        _steer(model, layer, aligned=aligned)
    ids = torch.randint(2, 96, (1, 300), generator=torch.Generator().manual_seed(1))

    def two_turns(cache):  # the second forward reads the codes the first left (the first attends to its own states)
        return torch.cat([model(ids[:, :280], cache=cache).logits, model(ids[:, 280:], cache=cache).logits], dim=1)

    with torch.no_grad():
        auto_cache, fixed_cache = QuantCache(bits=3), QuantCache(bits=3, rotate=fixed)
        auto = two_turns(auto_cache)
        by_hand = two_turns(fixed_cache)
    assert {c["rotate"] for c in auto_cache.key_rotation.values()} == {fixed}
    assert torch.equal(auto, by_hand)
    # and not what the other choice gives
    other = QuantCache(bits=3, rotate="v" if fixed == "kv" else "kv")
    with torch.no_grad():
        assert not torch.equal(auto, two_turns(other))


def test_auto_without_a_model_warns_once_and_keeps_keys_unrotated(caplog):
    model = make_model("llama")
    k = torch.randn(1, 2, 200, 32)
    cache = QuantCache(model.config, bits=4)  # the row's rotate="auto"
    with caplog.at_level(logging.WARNING, logger="qcache.cache"):
        cache.update(k, k, 0, kwargs={"position_ids": torch.arange(200)[None]})
        cache.update(k, k, 1, kwargs={"position_ids": torch.arange(200)[None]})
    said = [r.getMessage() for r in caplog.records if "Keeping keys unrotated" in r.getMessage()]
    assert len(said) == 1 and "no attention module of layer 0" in said[0]  # said once, naming why
    assert cache.key_rotation[0] == {"rotate": "v", "rotated": False, "ratio": None}


def test_auto_names_what_it_cannot_read(caplog):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=96, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=128, max_position_embeddings=512)).eval()
    ids = torch.randint(2, 96, (1, 40))
    cache = QuantCache(bits=4, rotate="auto", rope="post", k_group_size=16, recent_tokens=4, sink_tokens=2)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="qcache.cache"):
        model(ids, past_key_values=cache)
    assert any("has no q_proj or k_proj" in r.getMessage() for r in caplog.records), caplog.text
    assert cache.key_rotation[0]["rotated"] is False
    # a norm over all heads at once (OLMo 2) is not a per-head gain
    att = make_model("qwen3").model.layers[0].self_attn
    att.q_norm = torch.nn.RMSNorm(4 * 32)
    with pytest.raises(ValueError, match=r"spans 128 channels .*not a head's 32"):
        weight_energies(att, 4, 2, 32, 32)


def test_head_norm_gain_enters_the_query_energy():
    # Qwen3 normalizes each head: the energy is the row norms' profile times the norm's squared gain
    att = make_model("qwen3").model.layers[0].self_attn
    with torch.no_grad():
        att.q_norm.weight.fill_(1.0)
        att.q_norm.weight[5] = 3.0
    q, _ = weight_energies(att, 4, 2, 32, 32)
    rows = att.q_proj.weight.pow(2).sum(1).view(4, 32)
    expected = (rows / rows.mean(-1, keepdim=True)).view(2, 2, 32).mean(1)
    expected[:, 5] *= 9.0
    expected = torch.cat([(expected[:, :16] + expected[:, 16:]) / 2] * 2, -1)  # RoPE pairs share their mean
    assert torch.allclose(q, expected, rtol=1e-4)


def test_energies_are_read_once_per_weights_and_again_after_they_change():
    model = make_model("llama")
    att = model.model.layers[0].self_attn
    args = (model.config.num_attention_heads, model.config.num_key_value_heads, att.head_dim, att.head_dim)
    first = weight_energies(att, *args)
    assert weight_energies(att, *args) is first  # a second fresh cache reuses what the first read
    _steer(model, 0, aligned=False)  # in-place writes to q_proj / k_proj
    changed = weight_energies(att, *args)
    assert changed is not first and not torch.allclose(changed[1], first[1])
    # a weight replaced by another tensor is read again too
    att.k_proj.weight = torch.nn.Parameter(att.k_proj.weight.detach() * 2)
    assert torch.allclose(weight_energies(att, *args)[1], changed[1] * 4)
