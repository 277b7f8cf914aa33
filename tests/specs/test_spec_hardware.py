"""Hardware presets against the datasheet table of DESIGN.md §5, dtypes and errors."""

from __future__ import annotations

import pytest

from labkit.errors import ConfigError, unknown_choice
from labkit.specs import HARDWARE_PRESETS, HardwareSpec, dtype_bytes, get_hardware

T, G = 1e12, 1e9

# DESIGN.md §5 (NVIDIA H100 SXM / H200 SXM / HGX B200 datasheets): dense BF16 and FP8
# FLOP/s, HBM capacity and bandwidth, NVLink bandwidth as a bidirectional total.
DATASHEET = {
    "h100": dict(bf16=989 * T, fp8=1979 * T, hbm=80 * G, hbm_bw=3.35 * T, nvlink_bidir=900 * G),
    "h200": dict(bf16=989 * T, fp8=1979 * T, hbm=141 * G, hbm_bw=4.8 * T, nvlink_bidir=900 * G),
    "b200": dict(bf16=2250 * T, fp8=4500 * T, hbm=180 * G, hbm_bw=8 * T, nvlink_bidir=1800 * G),
}


def test_exactly_the_design_presets():
    # plus the GPUs of the measured end-to-end runs (tests/specs/test_measured_presets.py)
    assert set(HARDWARE_PRESETS) == set(DATASHEET) | {"a100-80gb", "l40s"}


@pytest.mark.parametrize("name", DATASHEET)
def test_datasheet_numbers(name):
    hw, ds = get_hardware(name), DATASHEET[name]
    assert hw.flops("bf16") == pytest.approx(ds["bf16"], rel=1e-12)
    assert hw.flops("fp8") == pytest.approx(ds["fp8"], rel=1e-12)
    assert hw.hbm_bytes == pytest.approx(ds["hbm"], rel=1e-12)
    assert hw.hbm_bandwidth == pytest.approx(ds["hbm_bw"], rel=1e-12)
    # Stored per direction: the bidirectional datasheet figure halved
    # (900 GB/s NVLink 4 -> 450e9 each way; 1.8 TB/s NVLink 5 -> 900e9).
    assert hw.nvlink_bandwidth == pytest.approx(ds["nvlink_bidir"] / 2, rel=1e-12)
    # One 400 Gb/s InfiniBand NIC per GPU: 400e9 / 8 = 50e9 bytes/s each way.
    assert hw.internode_bandwidth == pytest.approx(400e9 / 8, rel=1e-12)
    # PCIe Gen5 x16: 32 GT/s x 16 lanes ~ 64 GB/s each way.
    assert hw.pcie_bandwidth == pytest.approx(64 * G, rel=1e-12)
    assert hw.gpus_per_node == 8  # HGX baseboards carry 8 GPUs


@pytest.mark.parametrize("name", DATASHEET)
def test_fp8_doubles_bf16_and_fp16_equals_bf16(name):
    hw = get_hardware(name)
    # Every datasheet row: FP8 dense peak = 2 x BF16 dense peak (1979 ~ 2 x 989.4).
    assert hw.flops("fp8") == pytest.approx(2 * hw.flops("bf16"), rel=1e-3)
    assert hw.flops("fp16") == hw.flops("bf16")


def test_ordering_between_generations():
    h100, h200, b200 = (get_hardware(n) for n in ("h100", "h200", "b200"))
    # H200 = H100 compute with more and faster HBM; B200 more of everything.
    assert h200.flops("bf16") == h100.flops("bf16")
    assert h100.hbm_bytes < h200.hbm_bytes < b200.hbm_bytes
    assert h100.hbm_bandwidth < h200.hbm_bandwidth < b200.hbm_bandwidth
    assert b200.nvlink_bandwidth == 2 * h200.nvlink_bandwidth
    # Peaks sit above what is achieved: a large BF16 GEMM measured on an H200 reaches
    # about 790 TFLOP/s (DESIGN.md §5).
    assert h200.flops("bf16") > 790 * T


def test_hbm_never_overstates_device_memory():
    # nvidia-smi totals: "H100 80GB HBM3" 81559 MiB, H200 143771 MiB. The decimal
    # datasheet figures stored here must not exceed what the device has.
    assert get_hardware("h100").hbm_bytes <= 81559 * 2**20
    assert get_hardware("h200").hbm_bytes <= 143771 * 2**20


@pytest.mark.parametrize("alias,name", [
    ("H200", "h200"), ("h200-sxm", "h200"), ("H100-SXM", "h100"), ("b200-hgx", "b200"),
    ("B200", "b200"),
])
def test_aliases_and_case(alias, name):
    assert get_hardware(alias) is HARDWARE_PRESETS[name]


def test_spec_passes_through():
    hw = HardwareSpec("mine", 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0)
    assert get_hardware(hw) is hw


@pytest.mark.parametrize("bad", ["v100", "h20", "gb200", ""])
def test_unknown_hardware_lists_allowed(bad):
    with pytest.raises(ConfigError) as err:
        get_hardware(bad)
    msg = str(err.value)
    assert repr(bad) in msg
    for name in DATASHEET:
        assert name in msg


@pytest.mark.parametrize("bad", ["fp32", "int8", "fp4", "BF16"])
def test_unknown_compute_dtype_lists_allowed(bad):
    with pytest.raises(ConfigError) as err:
        get_hardware("h200").flops(bad)
    msg = str(err.value)
    assert repr(bad) in msg
    for dtype in ("bf16", "fp16", "fp8"):
        assert dtype in msg


# ------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("dtype,nbytes", [("fp32", 4), ("bf16", 2), ("fp16", 2), ("fp8", 1)])
def test_dtype_bytes(dtype, nbytes):
    assert dtype_bytes(dtype) == nbytes


def test_unknown_dtype_lists_allowed():
    with pytest.raises(ConfigError) as err:
        dtype_bytes("fp6")
    msg = str(err.value)
    assert "'fp6'" in msg
    for dtype in ("fp32", "bf16", "fp16", "fp8"):
        assert dtype in msg


def test_unknown_choice_message_shape():
    err = unknown_choice("widget", "blue", ["red", "green"])
    assert isinstance(err, ConfigError) and isinstance(err, ValueError)
    msg = str(err)
    assert "widget" in msg and "'blue'" in msg
    assert "red" in msg and "green" in msg
