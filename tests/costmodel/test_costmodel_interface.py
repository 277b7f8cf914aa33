"""The CostModel's face: presets, custom specs, and clear errors for bad choices."""

import dataclasses

import pytest

from labkit.costmodel import SM_COUNTS, CostModel
from labkit.errors import ConfigError
from labkit.specs import get_hardware


def test_presets_and_aliases():
    for name in ("h100", "h200", "b200", "H100-SXM"):
        cm = CostModel(name)
        assert cm.device.sms == SM_COUNTS[cm.hardware.name]
    assert CostModel(get_hardware("h200")).hardware.name == "h200"


def test_custom_spec_needs_an_sm_count():
    spec = dataclasses.replace(get_hardware("h100"), name="my-gpu", hbm_bandwidth=6e12)
    with pytest.raises(ConfigError, match="sm_count"):
        CostModel(spec)
    cm = CostModel(spec, sm_count=132)
    # only the bandwidth changed: long decode attention speeds up with it
    assert cm.attention_decode(64, 65536, 32, 8, 128) < \
        CostModel("h100").attention_decode(64, 65536, 32, 8, 128)


@pytest.mark.parametrize("call, match", [
    (lambda cm: cm.gemm(1, 2, 3, dtype="int4"), "GEMM dtype"),
    (lambda cm: cm.attention_decode(1, 2, 8, 1, 128, kv_dtype="fp4"), "KV-cache dtype"),
    (lambda cm: cm.moe(1, 2, 3, 1, 8, dtype="int4"), "MoE dtype"),
    (lambda cm: cm.moe(1, 2, 3, 1, 8, distribution="zipf"), "distribution"),
    (lambda cm: cm.collective("broadcast", 1, 8), "collective"),
    (lambda cm: cm.p2p(1, link="ethernet"), "link"),
    (lambda cm: cm.host_transfer(1, direction="d2d"), "direction"),
    (lambda cm: CostModel("v100"), "hardware preset"),
])
def test_bad_choices_name_the_problem(call, match):
    with pytest.raises(ConfigError, match=match):
        call(CostModel("h100"))


def test_mla_prefill_module_takes_the_absorbed_path_for_short_prefills():
    """vLLM runs up to 512 new tokens (bf16 cache) through the absorbed decode kernel."""
    cm = CostModel("h100")
    assert cm.mla_prefill_module(4, 512, 0, 16) == cm.mla_decode_module(4, 0, 16, query_len=512)
    assert cm.mla_prefill_module(4, 513, 0, 16) != cm.mla_decode_module(4, 0, 16, query_len=513)
    assert cm.mla_prefill_module(4, 128, 0, 16, kv_dtype="fp8") == \
        cm.mla_decode_module(4, 0, 16, kv_dtype="fp8", query_len=128)
