"""paged_attention over int8 / fp8 KV caches (entries with an fp32 scale per token and KV head,
as kv_cache_write stores them): against the reference on the same quantized cache (the kernel's
only extra error is fp32 dequantization), and against attention over the unquantized values
within the tolerance that README states. Unwritten slots have NaN scales, so reading one shows.
"""

import pytest
import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing import reference
from tests.kernels.capability import CAPABILITIES, check_variant
from tests.kernels.test_paged_attention import SCENARIOS, TILE_EDGES, TOLERANCES, Batch

ops = torch.ops.kvserve

KV_DTYPES = [torch.int8, torch.float8_e4m3fn]
# Worst |error| over all outputs against attention on the unquantized fp32 values (keys and
# values ~ N(0, 1), outputs ~ 0.1-1), and the mean |error|: the figures README quotes.
QUANT_ERROR = {torch.int8: dict(max=0.04, mean=0.003), torch.float8_e4m3fn: dict(max=0.16,
                                                                              mean=0.01)}


class QuantizedBatch:
    """A Batch whose caches are quantized row by row (reference.quantize_kv_rows); slots that hold
    no token get a NaN scale."""

    def __init__(self, batch: Batch, cache_dtype):
        self.batch = batch
        self.latent = batch.value_cache is batch.key_cache

        def quantize(cache):
            written = ~cache.isnan().any(-1)  # [num_blocks, block_size, heads]
            q, scale = reference.quantize_kv_rows(torch.nan_to_num(cache.float()), cache_dtype)
            return q, torch.where(written, scale, torch.full_like(scale, float("nan")))

        self.key_cache, self.key_scale = quantize(batch.key_cache)
        if self.latent:
            self.value_cache, self.value_scale = self.key_cache, self.key_scale
        else:
            self.value_cache, self.value_scale = quantize(batch.value_cache)

    def run(self, **kwargs):
        b = self.batch
        out = torch.empty(*b.query.shape[:2], b.value_head_dim, dtype=b.query.dtype)
        ops.paged_attention(out, b.query, self.key_cache, self.value_cache, *b.metadata(),
                            kwargs.get("scale") or b.scale, kwargs.get("sliding_window", 0),
                            kwargs.get("logit_softcap", 0.0), self.key_scale, self.value_scale)
        return out

    def reference(self, **kwargs):
        b = self.batch
        return reference.paged_attention(
            b.query, self.key_cache, self.value_cache, *b.metadata(),
            kwargs.get("scale") or b.scale, kwargs.get("sliding_window", 0),
            kwargs.get("logit_softcap", 0.0), b.value_head_dim, self.key_scale, self.value_scale)


def check(qbatch, dtype, **kwargs):
    out = qbatch.run(**kwargs)
    assert not out.isnan().any(), "read a slot that holds no token"
    torch.testing.assert_close(out.double(), qbatch.reference(**kwargs), **TOLERANCES[dtype])
    return out


@pytest.mark.parametrize("cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads",
                         [(64, 4, 4), (80, 8, 2), (24, 8, 1), (40, 6, 3), (128, 16, 2)])
def test_matches_reference(head_dim, num_heads, num_kv_heads, block_size, dtype, cache_dtype):
    batch = Batch(SCENARIOS["mixed"] + [(45, 45)], head_dim, num_heads, num_kv_heads, block_size,
                  dtype)
    check(QuantizedBatch(batch, cache_dtype), dtype)


@pytest.mark.parametrize("cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_tile_edges_window_softcap_and_value_size(dtype, cache_dtype):
    check(QuantizedBatch(Batch(TILE_EDGES, 80, 8, 2, 16, dtype), cache_dtype), dtype,
          sliding_window=70, logit_softcap=10.0)
    check(QuantizedBatch(Batch(SCENARIOS["mixed"], 24, 8, 2, 16, dtype, value_head_dim=40),
                         cache_dtype), dtype)


@pytest.mark.parametrize("cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("num_heads", [4, 16])
def test_latent_cache(num_heads, cache_dtype):
    """MLA's absorbed form: one quantized latent per token, one scale, read as key and value."""
    for scenario in ("mixed", "decode"):
        batch = Batch(SCENARIOS[scenario], 72, num_heads, 1, 16, torch.float32, value_head_dim=64,
                      latent=True)
        check(QuantizedBatch(batch, cache_dtype), torch.float32, scale=72 ** -0.5)


@pytest.mark.parametrize("cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("scenario", ["prefill", "decode", "mixed"])
def test_close_to_unquantized_attention(scenario, cache_dtype):
    """The stated tolerance: quantized KV against fp32 attention on the original values."""
    batch = Batch(SCENARIOS[scenario] + TILE_EDGES[:3], 128, 8, 2, 16, torch.float32, seed=1)
    out = QuantizedBatch(batch, cache_dtype).run().double()
    exact = batch.reference()
    error = (out - exact).abs()
    bound = QUANT_ERROR[cache_dtype]
    assert error.max() <= bound["max"] and error.mean() <= bound["mean"], (
        f"max {error.max():.4f}, mean {error.mean():.5f}")
    assert error.max() > 0  # the cache really is quantized


def test_rejects_bad_scales():
    batch = Batch(SCENARIOS["decode"], 64, 4, 2, 16, torch.float32)
    q = QuantizedBatch(batch, torch.int8)
    out = torch.empty_like(batch.query)
    meta = (*batch.metadata(), batch.scale, 0, 0.0)
    with pytest.raises(RuntimeError, match="needs its scales"):
        ops.paged_attention(out, batch.query, q.key_cache, q.value_cache, *meta)
    with pytest.raises(RuntimeError, match="scales of value_cache must be contiguous fp32"):
        ops.paged_attention(out, batch.query, q.key_cache, q.value_cache, *meta, q.key_scale,
                            q.value_scale[:, :, :1].contiguous())
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.paged_attention(out, batch.query, q.key_cache, q.value_cache.view(
            torch.float8_e4m3fn), *meta, q.key_scale, q.value_scale)
    with pytest.raises(RuntimeError, match="takes no scales"):
        ops.paged_attention(out, batch.query, batch.key_cache, batch.value_cache, *meta,
                            q.key_scale, q.value_scale)
    with pytest.raises(RuntimeError, match="takes the key's scales"):
        ops.paged_attention(out, batch.query, q.key_cache, q.key_cache, *meta, q.key_scale,
                            q.value_scale)


# ------------------------------------------------------------------ every CPU capability variant


def capability_checks():
    """A subset of the checks above, run once per CPU capability (the dequantization of a row is
    vector code)."""
    for cache_dtype in KV_DTYPES:
        for dtype in TOLERANCES:
            for head_dim, num_heads, num_kv_heads in [(40, 6, 3), (128, 8, 1)]:
                batch = Batch(SCENARIOS["mixed"] + [(45, 45)], head_dim, num_heads, num_kv_heads,
                              16, dtype)
                check(QuantizedBatch(batch, cache_dtype), dtype)
        batch = Batch(SCENARIOS["mixed"], 72, 16, 1, 16, torch.float32, value_head_dim=64,
                      latent=True)
        check(QuantizedBatch(batch, cache_dtype), torch.float32)


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_cpu_capability_variants(capability, capability_processes):
    check_variant(capability, capability_processes, capability_checks)
