"""`labkit bench kernels`: says it needs a GPU on CPU; its harness runs (tiny shapes, CPU)."""

from __future__ import annotations

import pytest
import torch

from labkit.kernels import bench, bench_cases


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_without_cuda_says_so_and_returns_0(capsys):
    assert bench.bench_kernels() == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_harness_on_tiny_cpu_shapes(torch_backend):
    cases = [bench_cases.gqa_decode(2, 256, 8, 2, 64),
             bench_cases.mla_decode(2, 256, 4, Q=2, Dl=32, Dr=16, page=16),
             bench_cases.sparse(2, 256, 4, topk=32, Dl=32, Dr=16, page=16),
             bench_cases.merge(2, 2, 4, 32), bench_cases.cache_write(16, 2, 32),
             bench_cases.cache_write(16, 1, 48, latent=True), bench_cases.prefill(64, 32, 4, 2, 32)]
    failures = []
    rows = bench.run_cases(cases, "cpu", bench.Timer("cpu", warmup=1, repeats=2),
                           printer=failures.append)
    assert not failures
    assert [r.kernel for r in rows] == [c.kernel for c in cases]
    assert all(r.seconds > 0 and r.bytes > 0 and r.baseline for r in rows)
    lines = bench.format_rows(rows, peak=4.8e12)
    text = "\n".join(lines)
    for c in cases:
        assert c.kernel in text and c.shape in text
    assert "%" in text and "x" in text
    assert bench.format_rows(rows, peak=None)


def test_default_case_lists_are_well_formed():
    full, quick = bench_cases.default_cases(), bench_cases.default_cases(quick=True)
    assert len(quick) < len(full)
    kernels = {c.kernel for c in full}
    assert kernels == {"paged_decode_attention", "mla_paged_decode", "sparse_topk_attention",
                       "merge_attn_states", "reshape_and_cache", "reshape_and_cache_latent",
                       "paged_prefill_attention"}


def test_latent_baseline_falls_back_to_plain_torch(monkeypatch):
    """When no fused SDPA backend takes a latent shape, the baseline is matmul + softmax
    (with the lower-right causal mask of speculative verify), equal to SDPA's answer."""
    from torch.nn.attention.bias import causal_lower_right

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 3, 48, generator=g), torch.randn(2, 1, 10, 48, generator=g)
    mask = causal_lower_right(3, 10)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, k[..., :32], attn_mask=mask, scale=0.1, enable_gqa=True)

    def refuse(*a, **kw):
        raise RuntimeError("No available kernel")

    monkeypatch.setattr(bench_cases, "_sdpa", refuse)
    fns = bench_cases._latent_baselines(q, k, 32, 0.1, mask)
    assert list(fns) == ["torch matmul+softmax"]
    torch.testing.assert_close(fns["torch matmul+softmax"](), expected, atol=1e-5, rtol=1e-5)
