"""paged_attention against kvserve.testing.reference: prefill, prefill after a cached prefix,
chunked prefill, decode and a mix of them in one call; GQA/MQA; sliding window; soft-cap; values
of another size than keys; MLA's latent cache read as both key and value.
Every cache slot that holds no token (and the null block 0) is NaN, so reading one shows up."""

import math

import pytest
import torch

import kvserve  # noqa: F401  (registers torch.ops.kvserve)
from kvserve.testing import reference
from tests.kernels.cuda_ops import host_check
from tests.kernels.capability import CAPABILITIES, check_variant

ops = torch.ops.kvserve

# One tolerance per dtype: fp32 softmax and accumulation, then one rounding to the dtype.
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
    torch.float16: dict(atol=1e-3, rtol=2e-3),
}
DTYPES = list(TOLERANCES)
BLOCK_SIZES = [1, 8, 16, 32]
# (head_dim, num_heads, num_kv_heads): GQA ratios 1, 2, 4, 8, MQA, and a group wider than the
# kernel's 32-row work item.
CONFIGS = [(64, 4, 4), (80, 8, 4), (96, 8, 2), (128, 16, 2), (256, 2, 2), (24, 8, 1), (40, 6, 3),
           (32, 40, 1)]
# A batch is a list of (context_len, query_len) per sequence: the queries are the last query_len
# positions of the context. query_len == context_len: prefill from scratch; smaller: prefill
# after a cached prefix or a later chunk of a chunked prefill; 1: decode.
SCENARIOS = {
    "prefill": [(1, 1), (7, 7), (45, 45)],
    "prefix-prefill": [(37, 5), (20, 19), (66, 33)],
    "decode": [(1, 1), (19, 1), (100, 1), (33, 1)],
    "mixed": [(13, 13), (37, 5), (1, 1), (70, 1), (9, 0), (40, 3)],
}
# Lengths around the CPU kernel's tiles: 64 keys per softmax pass; work items of 64 (query, head)
# rows (16 queries with a GQA group of 4, 64 with MHA); items of 8 rows or more take the tiled
# path, smaller ones (decode) the dot-product path. Prefills just below / at / above a tile,
# prefixes whose query block starts mid-tile, and several such runs in one batch.
TILE_EDGES = [(63, 63), (64, 64), (65, 65), (129, 17), (128, 16), (200, 2), (97, 33), (66, 1),
              (140, 130)]


class Batch:
    """A paged cache holding the contexts of `seqs`, with blocks handed out in random order and
    everything else NaN, and the query of the new tokens as a strided view of a fused qkv.

    value_head_dim: the value's size when it differs from the key's (MLA expanded: 192 / 128).
    latent: one cache for keys and values, [num_blocks, block_size, 1, head_dim], whose values
    are the first value_head_dim elements of each entry (MLA absorbed: MQA over latents)."""

    def __init__(self, seqs, head_dim, num_heads, num_kv_heads, block_size, dtype, seed=0,
                 value_head_dim=None, latent=False):
        g = torch.Generator().manual_seed(seed)
        value_head_dim = value_head_dim or head_dim
        assert not latent or (num_kv_heads == 1 and value_head_dim <= head_dim)
        blocks_per_seq = [math.ceil(context / block_size) for context, _ in seqs]
        num_blocks = 1 + sum(blocks_per_seq) + 2  # block 0 is the null block; 2 stay unused
        free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.key_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.value_cache = self.key_cache if latent else torch.full(
            shape[:3] + (value_head_dim,), float("nan"), dtype=dtype)
        self.value_head_dim = value_head_dim
        # One spare column of padding, pointing at the (poisoned) null block.
        self.block_tables = torch.zeros(len(seqs), max(blocks_per_seq) + 1, dtype=torch.int32)
        for b, (context, _) in enumerate(seqs):
            table = [free.pop() for _ in range(blocks_per_seq[b])]
            self.block_tables[b, :len(table)] = torch.tensor(table, dtype=torch.int32)
            for p in range(context):
                block, offset = table[p // block_size], p % block_size
                self.key_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=g)
                if not latent:
                    self.value_cache[block, offset] = torch.randn(num_kv_heads, value_head_dim,
                                                                  generator=g)
        query_lens = [q for _, q in seqs]
        self.query_start_loc = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).int()
        self.seq_lens = torch.tensor([context for context, _ in seqs], dtype=torch.int32)
        num_tokens = sum(query_lens)
        qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=g)
        self.query = qkv.to(dtype)[:, :num_heads]
        self.scale = head_dim ** -0.5

    def metadata(self):
        return self.query_start_loc, self.seq_lens, self.block_tables

    def run(self, sliding_window=0, logit_softcap=0.0, scale=None, sinks=None):
        """Runs the op into a strided out view; checks it wrote nothing outside that view."""
        num_tokens, num_heads, _ = self.query.shape
        out_full = torch.full((num_tokens, num_heads + 3, self.value_head_dim), float("nan"),
                              dtype=self.query.dtype)
        out = out_full[:, :num_heads]
        ops.paged_attention(out, self.query, self.key_cache, self.value_cache, *self.metadata(),
                            scale or self.scale, sliding_window, logit_softcap, sinks=sinks)
        assert out_full[:, num_heads:].isnan().all(), "paged_attention wrote outside out"
        return out

    def reference(self, sliding_window=0, logit_softcap=0.0, scale=None, sinks=None):
        return reference.paged_attention(self.query, self.key_cache, self.value_cache,
                                         *self.metadata(), scale or self.scale, sliding_window,
                                         logit_softcap, self.value_head_dim, sinks=sinks)


def check(batch, dtype, **kwargs):
    out = batch.run(**kwargs)
    assert not out.isnan().any(), "read a poisoned cache slot"
    torch.testing.assert_close(out.double(), batch.reference(**kwargs), **TOLERANCES[dtype])
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads", CONFIGS)
def test_mixed_batch(head_dim, num_heads, num_kv_heads, block_size, dtype):
    batch = Batch(SCENARIOS["mixed"], head_dim, num_heads, num_kv_heads, block_size, dtype)
    check(batch, dtype)


# (head_dim, value_head_dim, num_heads, num_kv_heads): MLA's expanded form (key 192, value 128)
# scaled down, values wider than keys, and values of a size that is no multiple of a vector.
VALUE_CONFIGS = [(48, 32, 4, 4), (24, 40, 8, 2), (64, 20, 6, 3)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("head_dim, value_head_dim, num_heads, num_kv_heads", VALUE_CONFIGS)
def test_value_head_dim_differs(head_dim, value_head_dim, num_heads, num_kv_heads, block_size,
                                dtype):
    seqs = SCENARIOS["mixed"] + [(70, 70)]
    batch = Batch(seqs, head_dim, num_heads, num_kv_heads, block_size, dtype,
                  value_head_dim=value_head_dim)
    check(batch, dtype)


# (latent size, value prefix, query heads): DeepSeek's 512 + 64 scaled down, with head counts on
# the dot-product path (fewer than 8 rows per KV head in decode) and the tiled one.
LATENT_CONFIGS = [(36, 32, 1), (36, 32, 4), (72, 64, 16), (40, 24, 40), (576, 512, 16)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("latent, kv_lora_rank, num_heads", LATENT_CONFIGS)
def test_latent_cache_is_both_key_and_value(latent, kv_lora_rank, num_heads, block_size, dtype):
    """MLA's absorbed form: MQA where the value is the first kv_lora_rank elements of each
    cached latent (one tensor passed as both caches)."""
    for scenario in ("mixed", "decode"):
        batch = Batch(SCENARIOS[scenario], latent, num_heads, 1, block_size, dtype,
                      value_head_dim=kv_lora_rank, latent=True)
        check(batch, dtype, scale=latent ** -0.5)


def test_latent_values_are_read_from_the_key_rows():
    """Changing the latent's value part changes the output; its tail (the rope part) is key
    only. The same memory feeds both, so a kernel that reads values elsewhere fails here."""
    batch = Batch(SCENARIOS["decode"], 24, 8, 1, 4, torch.float32, value_head_dim=16, latent=True)
    before = check(batch, torch.float32)
    batch.key_cache[..., :16] *= 2  # values double, scores change too: compare with the reference
    after = check(batch, torch.float32)
    assert (after - before).abs().max() > 0.1


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenarios(scenario, block_size):
    batch = Batch(SCENARIOS[scenario], 64, 8, 2, block_size, torch.bfloat16)
    check(batch, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("sliding_window, logit_softcap", [(1, 0.0), (4, 0.0), (17, 0.0),
                                                           (1000, 0.0), (0, 5.0), (0, 50.0),
                                                           (6, 5.0)])
def test_sliding_window_and_softcap(sliding_window, logit_softcap, block_size, dtype):
    """scale 1 makes scores large enough that the soft-cap changes the result."""
    batch = Batch(SCENARIOS["mixed"] + [(45, 45)], 64, 8, 2, block_size, dtype)
    out = check(batch, dtype, sliding_window=sliding_window, logit_softcap=logit_softcap, scale=1.0)
    plain = batch.reference(scale=1.0)
    if sliding_window < 45:  # the option must matter, or this test could not fail
        assert (out.double() - plain).abs().max() > 0.1


def make_sinks(num_heads, seed=7):
    """Sink logits spread around the scores' range, some far above it (sink-dominated heads),
    one far below (no effect): each head's sink must be its own."""
    g = torch.Generator().manual_seed(seed)
    sinks = 3 * torch.randn(num_heads, generator=g)
    sinks[0], sinks[-1] = 40.0, -40.0
    return sinks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads", [(64, 8, 2), (24, 8, 1), (80, 6, 6)])
@pytest.mark.parametrize("scenario", ["mixed", "tile-edges", "long"])
def test_attention_sinks(scenario, head_dim, num_heads, num_kv_heads, dtype):
    """gpt-oss's sinks over decode, prefill, prefixes, tile edges and split long contexts (the
    sink joins only the final merge), alone and with a window and a soft-cap; a sink that
    dominates leaves a small output, so the result must differ from plain attention."""
    seqs = {"mixed": SCENARIOS["mixed"], "tile-edges": TILE_EDGES,
            "long": [(1500, 1), (700, 3), (1, 1)]}[scenario]
    batch = Batch(seqs, head_dim, num_heads, num_kv_heads, 16, dtype, seed=9)
    sinks = make_sinks(num_heads)
    out = check(batch, dtype, sinks=sinks)
    check(batch, dtype, sinks=sinks, sliding_window=6, logit_softcap=5.0, scale=1.0)
    assert (out.double() - batch.reference()).abs().max() > 0.1, "the sinks changed nothing"
    assert out[:, 0].abs().max() < 1e-6 and out[:, -1].equal(batch.run()[:, -1])


@pytest.mark.parametrize("make_sinks, match", [
    (lambda: torch.zeros(7), "sinks must be"),
    (lambda: torch.zeros(8, dtype=torch.bfloat16), "sinks"),
    (lambda: torch.zeros(16)[::2], "contiguous"),
])
def test_bad_sinks_are_refused(make_sinks, match):
    batch = Batch(SCENARIOS["decode"], 64, 8, 2, 16, torch.float32)
    with pytest.raises(RuntimeError, match=match):
        batch.run(sinks=make_sinks())


@pytest.mark.parametrize("sliding_window", [0, 5])
@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_equals_one_shot(chunk, sliding_window):
    """Prefilling a prompt chunk by chunk gives the rows of the one-shot prefill."""
    prompt_len, dtype = 45, torch.float32
    full = Batch([(prompt_len, prompt_len)], 64, 4, 2, 8, dtype, seed=3)
    one_shot = check(full, dtype, sliding_window=sliding_window)
    for begin in range(0, prompt_len, chunk):
        end = min(begin + chunk, prompt_len)
        part = Batch([(end, end - begin)], 64, 4, 2, 8, dtype)
        # The same cache (positions >= end are not read, prove it) and the same query rows.
        part.key_cache, part.value_cache = full.key_cache.clone(), full.value_cache.clone()
        part.block_tables = full.block_tables.clone()
        for p in range(end, prompt_len):
            block = int(part.block_tables[0, p // 8])
            part.key_cache[block, p % 8] = float("nan")
            part.value_cache[block, p % 8] = float("nan")
        part.query = full.query[begin:end]
        chunk_out = check(part, dtype, sliding_window=sliding_window)
        torch.testing.assert_close(chunk_out, one_shot[begin:end], **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads", [(64, 8, 2), (80, 6, 6), (24, 8, 1)])
@pytest.mark.parametrize("sliding_window, logit_softcap", [(0, 0.0), (70, 10.0)])
def test_tile_edges(sliding_window, logit_softcap, head_dim, num_heads, num_kv_heads, dtype):
    batch = Batch(TILE_EDGES, head_dim, num_heads, num_kv_heads, 16, dtype)
    check(batch, dtype, sliding_window=sliding_window, logit_softcap=logit_softcap)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqs", [[(3000, 1)], [(2100, 1), (1, 1), (700, 1)],
                                  [(1500, 3), (40, 40)]],
                         ids=["one-long-decode", "decodes", "prefix-prefill"])
def test_long_contexts(seqs, dtype):
    """Few queries over long contexts: the CUDA kernel splits each context into partitions and
    merges them (flash-decoding); sliding windows leave partitions empty."""
    batch = Batch(seqs, 128, 8, 2, 16, dtype, seed=3)
    check(batch, dtype)
    check(batch, dtype, sliding_window=600, logit_softcap=30.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads",
                         [(128, 4, 2), (64, 12, 2), (256, 6, 3), (128, 40, 4)])
def test_gqa_groups_over_split_contexts(head_dim, num_heads, num_kv_heads, dtype):
    """Groups of 2, 3, 6 and 10 query heads per KV head: on CUDA the row kernel (head sizes 64,
    128, 256) holds 1, 2, 4 or 8 heads per block, so a group that does not fill its block, and
    one that takes two blocks, over contexts that split and merge."""
    batch = Batch([(700, 1), (1, 1), (300, 2), (129, 1)], head_dim, num_heads, num_kv_heads, 16,
                  dtype, seed=5)
    check(batch, dtype)
    check(batch, dtype, sliding_window=200, logit_softcap=15.0)


def _batched_and_alone(dtype, scenario):
    """The rows of a batch, and each sequence's rows run alone, over the same cache."""
    seqs = SCENARIOS["mixed"] if scenario == "mixed" else TILE_EDGES
    batch = Batch(seqs, 64, 8, 2, 16, dtype)
    batched = batch.run(sliding_window=9, logit_softcap=20.0)
    starts = batch.query_start_loc.tolist()
    for b in range(len(seqs)):
        alone = Batch(seqs[b:b + 1], 64, 8, 2, 16, dtype)
        alone.key_cache, alone.value_cache = batch.key_cache, batch.value_cache
        alone.block_tables = batch.block_tables[b:b + 1].clone()
        alone.query = batch.query[starts[b]:starts[b + 1]]
        yield b, batched[starts[b]:starts[b + 1]], alone.run(sliding_window=9, logit_softcap=20.0)


@pytest.mark.parametrize("dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.cpu_only),
    pytest.param(torch.float16, marks=pytest.mark.cpu_only)])
@pytest.mark.parametrize("scenario", ["mixed", "tile-edges"])
def test_batched_equals_per_sequence(dtype, scenario):
    """Each sequence's rows are the same, bit for bit, whatever else is in the batch. On CUDA
    this holds in fp32 (a query's rows depend on its context alone); bf16 / fp16 calls take the
    tensor-core kernel, whose tile shape follows the call's query rows per sequence (as cuBLAS
    picks kernels by shape), so there the rows agree within the dtype's tolerance (below)."""
    for b, batched, alone in _batched_and_alone(dtype, scenario):
        assert torch.equal(alone, batched), f"sequence {b}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scenario", ["mixed", "tile-edges"])
def test_batched_is_close_to_per_sequence(dtype, scenario):
    for b, batched, alone in _batched_and_alone(dtype, scenario):
        torch.testing.assert_close(alone, batched, **TOLERANCES[dtype], msg=f"sequence {b}")


@pytest.fixture
def attention_kernel():
    """Sets the CUDA attention kernel for one test (the CPU op has one kernel: no effect)."""
    yield kvserve._C.set_cuda_attention_kernel
    kvserve._C.set_cuda_attention_kernel("auto")


@pytest.mark.parametrize("kernel", ["mma", "mma64", "rows", "general"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_cuda_kernel(kernel, dtype, attention_kernel):
    """On CUDA each body that applies, forced: the tensor-core kernel (bf16 / fp16, head sizes
    64 and 128; prefill tiles of 128 rows, or 64 with mma64), the row kernel (head sizes 64, 128, 256), the general one (any), over decode,
    prefill and split contexts, GQA groups that fill a tile, leave it part empty or need two."""
    attention_kernel(kernel)
    for head_dim, num_heads, num_kv_heads in [(128, 8, 2), (64, 6, 2), (64, 40, 2), (256, 4, 4)]:
        batch = Batch(SCENARIOS["mixed"] + [(700, 1), (300, 70)], head_dim, num_heads,
                      num_kv_heads, 16, dtype, seed=11)
        check(batch, dtype)
        check(batch, dtype, sliding_window=50, logit_softcap=12.0)


def test_attention_kernel_choice_is_checked(attention_kernel):
    attention_kernel("rows")
    assert kvserve._C.cuda_attention_kernel() == "rows"
    with pytest.raises(ValueError, match="auto, mma, rows, general or mma64"):
        attention_kernel("flash")
    assert kvserve._C.cuda_attention_kernel() == "rows"


def test_contiguous_query_and_out():
    batch = Batch(SCENARIOS["mixed"], 80, 8, 2, 16, torch.float32)
    query = batch.query.contiguous()
    out = torch.empty_like(query)
    ops.paged_attention(out, query, batch.key_cache, batch.value_cache, *batch.metadata(),
                        batch.scale, 0, 0.0)
    assert torch.equal(out, batch.run())


@pytest.mark.parametrize("dtype", DTYPES)
def test_scratch_left_by_a_nan_prefill_does_not_reach_a_later_decode(dtype):
    """The CPU kernel keeps its scratch between calls: a prefill whose keys are NaN (a model gone
    bad) leaves NaN rows there, laid out for the tiled path; a later decode of other sequences,
    on the same thread, with a head size whose rows the dot-product path pads (72 -> 80), must
    not see them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one worker, so both calls use the same thread's scratch
    try:
        poisoned = Batch([(70, 70)], 72, 8, 2, 16, dtype, seed=3)
        poisoned.key_cache.fill_(float("nan"))
        assert poisoned.run().isnan().all()
        check(Batch([(100, 1), (19, 1), (64, 1)], 72, 8, 2, 16, dtype, seed=4), dtype)
    finally:
        torch.set_num_threads(threads)


def test_empty_batch():
    batch = Batch([(5, 0)], 64, 4, 2, 8, torch.float32)
    out = torch.empty(0, 4, 64)
    ops.paged_attention(out, batch.query, batch.key_cache, batch.value_cache, *batch.metadata(),
                        batch.scale, 0, 0.0)


@pytest.mark.parametrize("sliding_window", [0, 3])
def test_reference_matches_sdpa(sliding_window):
    """Self-check of the reference against torch's scaled_dot_product_attention with an explicit
    mask, for a prefill after a cached prefix with GQA."""
    context, query_len, num_heads, num_kv_heads = 11, 4, 6, 2
    batch = Batch([(context, query_len)], 16, num_heads, num_kv_heads, 4, torch.float64)
    slots = [int(batch.block_tables[0, p // 4]) * 4 + p % 4 for p in range(context)]
    keys = batch.key_cache.view(-1, num_kv_heads, 16)[slots]  # [context, kv_heads, 16]
    values = batch.value_cache.view(-1, num_kv_heads, 16)[slots]
    group = num_heads // num_kv_heads
    q_pos = torch.arange(context - query_len, context)[:, None]
    k_pos = torch.arange(context)[None, :]
    mask = k_pos <= q_pos
    if sliding_window:
        mask &= k_pos > q_pos - sliding_window
    want = torch.nn.functional.scaled_dot_product_attention(
        batch.query.transpose(0, 1), keys.transpose(0, 1).repeat_interleave(group, 0),
        values.transpose(0, 1).repeat_interleave(group, 0), attn_mask=mask,
        scale=batch.scale).transpose(0, 1)
    torch.testing.assert_close(batch.reference(sliding_window=sliding_window), want)


def bad_call(query_heads=4, query_dtype=torch.float32, out_dtype=None, cache_head_dim=16,
             seq_lens=(5, 3), query_lens=(2, 1), table=((1, 2), (3, 0)), query_start_loc=None,
             metadata_dtype=torch.int32, cache=None):
    """Arguments of a small valid call (4 blocks of 4 slots, 2 kv heads), with one thing changed."""
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, query_heads, 16, dtype=query_dtype)
    out = torch.empty(num_tokens, query_heads, 16, dtype=out_dtype or query_dtype)
    key_cache = cache if cache is not None else torch.zeros(4, 4, 2, cache_head_dim)
    if query_start_loc is None:
        query_start_loc = [0, query_lens[0], num_tokens]
    meta = [torch.tensor(x, dtype=metadata_dtype) for x in (query_start_loc, seq_lens, table)]
    return (out, query, key_cache, key_cache.clone(), *meta, 0.25, 0, 0.0)


def test_bad_call_baseline_is_valid():
    ops.paged_attention(*bad_call())


@pytest.mark.parametrize(
    "args, match",
    [
        (bad_call(query_dtype=torch.bfloat16), "dtype"),
        (bad_call(out_dtype=torch.float16), "dtype"),
        (bad_call(cache_head_dim=32), "head_dim"),
        (bad_call(query_heads=3), "not a multiple of num_kv_heads"),
        host_check(bad_call(table=((1, 4), (3, 0))), "block id 4 is outside the cache of 4 blocks"),
        host_check(bad_call(table=((1, -1), (3, 0))), "block id -1 is outside the cache"),
        host_check(bad_call(seq_lens=(5, 0)), "sequence 1 has 1 queries but a context of 0"),
        host_check(bad_call(seq_lens=(1, 3)), "sequence 0 has 2 queries but a context of 1"),
        host_check(bad_call(seq_lens=(9, 3)), "needs 3 blocks, its table has 2"),
        host_check(bad_call(query_start_loc=[0, 2, 2]), "query_start_loc must run from 0"),
        (bad_call(query_start_loc=[0, 3]), "query_start_loc must have 3 entries"),
        host_check(bad_call(query_start_loc=[0, 4, 3]), "sequence 1 has -1 queries"),
        (bad_call(metadata_dtype=torch.int64), "must be Int"),
        (bad_call(cache=torch.zeros(4, 2, 4, 16).transpose(1, 2)), "contiguous"),
    ],
    ids=["query-dtype", "out-dtype", "head-dim", "gqa", "block-too-large", "block-negative",
         "run-longer-than-context", "run-longer-than-context-2", "table-too-short",
         "start-loc-end", "start-loc-length", "start-loc-decreasing", "metadata-dtype",
         "cache-not-contiguous"],
)
def test_paged_attention_rejects_bad_arguments(args, match):
    with pytest.raises(RuntimeError, match=match):
        ops.paged_attention(*args)


def test_rejects_out_shape_and_strided_heads():
    out, query, *rest = bad_call()
    with pytest.raises(RuntimeError, match="like query"):
        ops.paged_attention(out[:, :2], query, *rest)
    with pytest.raises(RuntimeError, match="out's head_dim 17 must be in"):
        ops.paged_attention(torch.empty(*out.shape[:2], 17), query, *rest)
    key_cache, value_cache = rest[0], rest[1]
    with pytest.raises(RuntimeError, match="of one pool"):
        ops.paged_attention(out, query, key_cache, value_cache[:, :2].contiguous(), *rest[2:])
    with pytest.raises(RuntimeError, match="contiguous heads"):
        ops.paged_attention(out, query.transpose(0, 1).contiguous().transpose(0, 1), *rest)


# ------------------------------------------------------------------ every CPU capability variant



def capability_checks():
    """A subset of the checks above, run once per CPU capability."""
    for dtype in DTYPES:
        for head_dim, num_heads, num_kv_heads in [(40, 6, 3), (128, 8, 1)]:
            batch = Batch(SCENARIOS["mixed"], head_dim, num_heads, num_kv_heads, 16, dtype)
            check(batch, dtype)
            check(batch, dtype, sliding_window=6, logit_softcap=5.0, scale=1.0)
        check(Batch(TILE_EDGES, 80, 8, 2, 16, dtype), dtype, sliding_window=70, logit_softcap=10.0)
        check(Batch(SCENARIOS["mixed"], 24, 8, 2, 16, dtype, value_head_dim=40), dtype)
        check(Batch(TILE_EDGES, 64, 8, 2, 16, dtype), dtype, sinks=make_sinks(8))
        for heads in (4, 16):
            check(Batch(SCENARIOS["mixed"], 72, heads, 1, 16, dtype, value_head_dim=64,
                        latent=True), dtype)




@pytest.mark.parametrize("capability", CAPABILITIES)
def test_cpu_capability_variants(capability, capability_processes):
    check_variant(capability, capability_processes, capability_checks)


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["mma", "mma64"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [0, 700])
def test_cuda_long_prefill_matches_sdpa(kernel, head_dim, dtype, window, attention_kernel):
    """A prompt long enough for the 128-row prefill tiles on any GPU (mma; mma64 forces 64-row
    tiles), 32 query / 8 KV heads over shuffled 16-token blocks, against torch's SDPA on the
    same GPU, causal or in a sliding window (an explicit mask)."""
    attention_kernel(kernel)
    gen = torch.Generator(device="cuda").manual_seed(5)
    tokens, heads, kv_heads, block = 2500, 32, 8, 16
    num_blocks = math.ceil(tokens / block) + 3
    key = torch.randn(num_blocks, block, kv_heads, head_dim, device="cuda", generator=gen,
                      dtype=dtype)
    value = torch.randn(key.shape, device="cuda", generator=gen, dtype=dtype)
    table = torch.randperm(num_blocks, device="cuda", generator=gen)[:math.ceil(tokens / block)]
    query = torch.randn(tokens, heads, head_dim, device="cuda", generator=gen, dtype=dtype)
    out = torch.empty_like(query)
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    lens = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    ops.paged_attention(out, query, key, value, qsl, lens, table.int()[None], head_dim ** -0.5,
                        window, 0.0)
    k = key[table.long()].flatten(0, 1)[:tokens].transpose(0, 1)
    v = value[table.long()].flatten(0, 1)[:tokens].transpose(0, 1)
    pos = torch.arange(tokens, device="cuda")
    mask = pos[None, :] <= pos[:, None]
    if window:
        mask &= pos[None, :] > pos[:, None] - window
    want = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1).float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    error = (out.transpose(0, 1).float() - want).norm() / want.norm()
    assert error < 1e-2
