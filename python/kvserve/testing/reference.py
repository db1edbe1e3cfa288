"""Slow, obviously-correct pure-torch references for the kvserve ops (torch.ops.kvserve.*).

Each function mirrors the contract of one op (csrc/kernels/<domain>/<op>.h) but computes in fp64
with plain loops and indexing, and returns new tensors instead of writing in place. Tests,
benchmarks (--refcheck) and notebooks compare the real kernels against these. Speed is not a goal.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "rms_norm",
    "fused_add_rms_norm",
    "layer_norm",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "clamped_swiglu_and_mul",
    "linear",
    "quantized_weight",
    "quantized_linear",
    "round_input_to_int8_blocks",
    "llm_int8_linear",
    "rotary_cos_sin_cache",
    "rotary_embedding",
    "quantize_kv_rows",
    "dequantize_kv",
    "kv_cache_write",
    "kv_cache_copy_blocks",
    "paged_attention",
    "sampling_filter_logits",
    "sampling_probs",
]

# ----------------------------------------------------------------------------------------- norms


def rms_norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + epsilon) * weight, row by row.

    x [T, hidden], weight [hidden] -> fp64 [T, hidden].
    """
    x = x.double()
    inv_rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    return x * inv_rms * weight.double()


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x) fp64 [T, hidden], residual + x [T, hidden] in residual's dtype).

    x, residual [T, hidden]; weight [hidden]. The sum is rounded to the model dtype before it
    is normalized, as the op (and HF models) do.
    """
    new_residual = (residual.double() + x.double()).to(residual.dtype)
    return rms_norm(new_residual, weight, epsilon), new_residual


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               epsilon: float) -> torch.Tensor:
    """(x - mean) * rsqrt(var + epsilon) * weight (+ bias), row by row; var the biased
    variance. x [T, hidden], weight and bias [hidden] -> fp64 [T, hidden]."""
    x = x.double()
    centered = x - x.mean(dim=-1, keepdim=True)
    out = centered * torch.rsqrt(centered.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    out = out * weight.double()
    return out if bias is None else out + bias.double()


# ------------------------------------------------------------------------------------ activation


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] [T, 2d] -> fp64 [T, d]."""
    gate, up = x.double().chunk(2, dim=-1)
    return gate / (1.0 + torch.exp(-gate)) * up


def lora_add(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             slots: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """out + scales[s] * B_s (A_s x[t]) for each token t of slot s = slots[t] >= 0, fp64 [T, out];
    lora_a [S, rank, in], lora_b [S, rank, out] (B_s transposed)."""
    result = out.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            shrunk = lora_a[s].double() @ x[t].double()  # [rank]
            result[t] += float(scales[s]) * (shrunk @ lora_b[s].double())
    return result


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for x = [gate | up] [T, 2d] -> fp64 [T, d]."""
    gate, up = x.double().chunk(2, dim=-1)
    inner = math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate ** 3)
    return 0.5 * gate * (1.0 + torch.tanh(inner)) * up


def clamped_swiglu_and_mul(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gate for x = [gate | up] [T, 2d] -> fp64 [T, d]: (clamp(up, -limit, limit) + 1)
    * g * sigmoid(alpha * g), g = min(gate, limit)."""
    gate, up = x.double().chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


# ---------------------------------------------------------------------------------------- linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, k] @ weight [n, k]^T + bias [n] -> fp64 [T, n]."""
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def quantized_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     group_size: int, super_scales: torch.Tensor | None = None,
                     super_mins: torch.Tensor | None = None) -> torch.Tensor:
    """What a quantized_linear weight means, fp64 [n, k]: (q[o, i] - zeros[o, i // g]) *
    scales[o, i // g] (zeros [1]: that one for every row and group), with q read as the
    contract says: int8 as is; uint8 as int4 in chunks of 32 inputs, byte j of a chunk holding
    input j (low nibble) and input j + 16 (high nibble); float8_e4m3fn through torch's own
    conversion. With two-level scales: q[o, i] * super_scales[o, j // S] * scales[o, j] -
    super_mins[o, j // S] * zeros[o, j], j = i // g, S = groups / super_scales.shape[1]."""
    if qweight.dtype == torch.uint8:
        n, k = qweight.shape[0], 2 * qweight.shape[1]
        q = torch.empty(n, k, dtype=torch.float64)
        for i in range(k):
            chunk, j = divmod(i, 32)
            byte = qweight[:, chunk * 16 + j % 16].long()
            q[:, i] = (byte & 0x0F if j < 16 else byte >> 4).double()
    else:
        q = qweight.double()
        k = q.shape[1]
    group = torch.arange(k) // group_size
    if super_scales is not None:
        per_super = scales.shape[1] // super_scales.shape[1]
        block = group // per_super
        w = q * (super_scales.double()[:, block] * scales.double()[:, group])
        if zeros is not None:
            w = w - super_mins.double()[:, block] * zeros.double()[:, group]
        return w
    if zeros is None:
        zero = 0.0
    elif zeros.dim() == 1:  # one for all
        zero = float(zeros.double()[0])
    else:
        zero = zeros.double()[:, group]
    return (q - zero) * scales.double()[:, group]


def round_input_to_int8_blocks(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """quantized_linear's quantize_input, written out: x [T, k] -> fp32 [T, k]. Each group of
    group_size inputs is cut into blocks of 32 from its start; a block with a = max |x| becomes
    d * q, d = a / 127 and q = round_half_even(x * (127 / a)) (0 when a = 0), in fp32 divisions
    (not multiplications by a reciprocal); a block holding a NaN or an infinity becomes NaN."""
    x = x.float()
    out = torch.empty_like(x)
    for start in range(0, x.shape[1], group_size):
        for begin in range(start, start + group_size, 32):
            end = min(begin + 32, start + group_size)
            block = x[:, begin:end]
            amax = block.abs().amax(dim=1, keepdim=True)
            full = torch.full_like(amax, 127.0)
            inverse = torch.where(amax > 0, full / amax, torch.zeros_like(amax))
            q = torch.round(block * inverse).clamp(-127, 127)
            rounded = q * (amax / full)
            finite = torch.isfinite(block).all(dim=1, keepdim=True)
            out[:, begin:end] = torch.where(finite, rounded, torch.nan)
    return out


def quantized_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor | None, group_size: int,
                     bias: torch.Tensor | None, quantize_input: bool = False,
                     super_scales: torch.Tensor | None = None,
                     super_mins: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, k] @ quantized_weight(...)^T + bias -> fp64 [T, n]; with quantize_input, x rounded
    by round_input_to_int8_blocks first (the block-quantized product, in fp64)."""
    if quantize_input:
        x = round_input_to_int8_blocks(x, group_size)
    return linear(x, quantized_weight(qweight, scales, zeros, group_size, super_scales,
                                      super_mins), bias)


def llm_int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
                    threshold: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """LLM.int8()'s decomposition, written out: x [T, k] (any float dtype), weight int8 [n, k]
    with one scale per row (fp32 [n]) -> fp64 [T, n].

    Entries with |x| >= threshold (none when threshold <= 0), token by token, multiply the
    dequantized weight in floating point; each token's other entries are rounded to int8
    (scale = their max |x| / 127, round half to even, computed in fp32 as the op does) and
    multiplied with the int8 weight in exact integers, then scaled."""
    x32 = x.float()
    outlier = torch.zeros_like(x32, dtype=torch.bool)
    if threshold > 0:
        outlier = x32.abs() >= threshold
    inliers = x32.masked_fill(outlier, 0.0)
    scale = inliers.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    xq = torch.round(inliers / safe[:, None]).clamp(-127, 127).long()
    integer = xq @ weight.long().T  # exact
    w = weight.double() * weight_scales.double()[:, None]
    out = integer.double() * scale.double()[:, None] * weight_scales.double()[None, :]
    out += x.double().masked_fill(~outlier, 0.0) @ w.T
    if bias is not None:
        out += bias.double()
    return out


# ---------------------------------------------------------------------------------------- rotary


def rotary_cos_sin_cache(max_position: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    """The standard RoPE table fp32 [max_position, rot_dim]: rot_dim/2 cosines, then the sines."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotates the first rot_dim dims of each head. x [heads, head_dim], cos/sin [rot_dim/2]."""
    half = cos.numel()
    out = x.clone()
    if is_neox:  # pairs (i, i + half): Hugging Face rotate_half
        first, second = x[:, :half], x[:, half:2 * half]
        out[:, :half] = first * cos - second * sin
        out[:, half:2 * half] = second * cos + first * sin
    else:  # pairs (2i, 2i + 1): GPT-J / llama2.c interleaved
        even, odd = x[:, 0:2 * half:2], x[:, 1:2 * half:2]
        out[:, 0:2 * half:2] = even * cos - odd * sin
        out[:, 1:2 * half:2] = odd * cos + even * sin
    return out


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     head_dim: int, cos_sin_cache: torch.Tensor, is_neox: bool,
                     query_norm: torch.Tensor | None = None, key_norm: torch.Tensor | None = None,
                     norm_epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated (query, key) in fp64, same shapes as the inputs.

    positions [T]; query [T, num_heads * head_dim]; key [T, num_kv_heads * head_dim];
    cos_sin_cache [max_position, rot_dim] (cosines then sines); dims past rot_dim pass through.
    query_norm / key_norm [head_dim]: each head of that side is first rms_norm'ed with the
    weight and rounded to the input's dtype (as the op and the models do), then rotated.
    """

    def normed(x, weight):
        if weight is None:
            return x.double()
        heads = x.reshape(-1, head_dim)
        return rms_norm(heads, weight, norm_epsilon).to(x.dtype).double().view(x.shape)

    half = cos_sin_cache.size(1) // 2
    q_out, k_out = normed(query, query_norm).clone(), normed(key, key_norm).clone()
    for t in range(positions.numel()):
        row = cos_sin_cache[int(positions[t])].double()
        cos, sin = row[:half], row[half:]
        for out in (q_out, k_out):
            heads = out[t].view(-1, head_dim)
            out[t] = _rotate(heads, cos, sin, is_neox).reshape(-1)
    return q_out, k_out


# ----------------------------------------------------------------------------------------- cache


_KV_QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize_kv_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes each row (last dimension) of x to int8 or float8_e4m3fn with its own fp32 scale
    s = max|x| / qmax (127 / 448): returns (q, s) with q = round(x / s) (int8, half to even) or
    e4m3(x / s), and q = 0, s = 0 for a row of zeros. Computed in fp32, as the op does."""
    qmax = _KV_QUANT_MAX[dtype]
    x = x.float()
    scale = x.abs().amax(dim=-1) / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.where(scale[..., None] > 0, x / safe[..., None], torch.zeros_like(x))
    if dtype == torch.int8:
        return torch.round(y).clamp(-127, 127).to(torch.int8), scale
    return y.clamp(-448, 448).to(torch.float8_e4m3fn), scale


def dequantize_kv(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """fp64 values of a KV cache: its entries, times their row's scale when quantized."""
    if scale is None:
        return cache.double()
    return cache.double() * scale.double()[..., None]


def kv_cache_write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   key_scale: torch.Tensor | None = None,
                   value_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Returns copies of the caches with token t written at slot_mapping[t] (skipped when -1).

    key, value [T, num_kv_heads, head_dim];
    key_cache, value_cache [num_blocks, block_size, num_kv_heads, head_dim]; slot_mapping [T].
    int8 / float8_e4m3fn caches come with scales [num_blocks, block_size, num_kv_heads]: each
    (token, head) row is stored as quantize_kv_rows makes it, and the result is
    (key_cache, value_cache, key_scale, value_scale).
    """
    block_size = key_cache.size(1)
    new_key, new_value = key_cache.clone(), value_cache.clone()
    quantized = key_scale is not None
    if quantized:
        new_key_scale, new_value_scale = key_scale.clone(), value_scale.clone()
        key_q, key_s = quantize_kv_rows(key, key_cache.dtype)
        value_q, value_s = quantize_kv_rows(value, value_cache.dtype)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        if quantized:
            new_key[block, offset], new_key_scale[block, offset] = key_q[t], key_s[t]
            new_value[block, offset], new_value_scale[block, offset] = value_q[t], value_s[t]
        else:
            new_key[block, offset] = key[t]
            new_value[block, offset] = value[t]
    if quantized:
        return new_key, new_value, new_key_scale, new_value_scale
    return new_key, new_value


def kv_cache_copy_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                         block_mapping: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Returns copies of every layer's caches with block dst replaced by block src for each
    (src, dst) row of block_mapping [num_pairs, 2]; sources are read before any write.
    value_caches may be empty (latent caches have none)."""
    new_keys = [k.clone() for k in key_caches]
    new_values = [v.clone() for v in value_caches]
    for src, dst in block_mapping.tolist():
        for old, new in zip(key_caches + value_caches, new_keys + new_values):
            new[dst] = old[src]
    return new_keys, new_values


# ------------------------------------------------------------------------------------- attention


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, scale: float, sliding_window: int = 0,
                    logit_softcap: float = 0.0, value_head_dim: int | None = None,
                    key_scale: torch.Tensor | None = None,
                    value_scale: torch.Tensor | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of variable-length query runs over a paged KV cache.

    query [T, num_heads, head_dim]; key_cache [num_blocks, block_size, num_kv_heads, head_dim];
    value_cache [num_blocks, block_size, num_kv_heads, value_row], of which a value is the first
    value_head_dim elements (all of them when None; MLA passes its latent cache as both caches);
    query_start_loc [B + 1]; seq_lens [B]; block_tables [B, max_blocks_per_seq].
    The q queries of sequence b are the last q positions of its context of seq_lens[b] tokens;
    position p of b is at block block_tables[b][p // block_size], offset p % block_size. A query
    at position i sees positions (i - sliding_window, i] (all of [0, i] when sliding_window <= 0);
    scores are scale * q.k, then c * tanh(score / c) when logit_softcap c > 0.
    int8 / float8_e4m3fn caches come with their scales [num_blocks, block_size, num_kv_heads]
    (see kv_cache_write) and are read as entries times scales. sinks [num_heads]: a logit per
    head appended to each query's scores before the softmax, its probability then dropped.
    Returns fp64 [T, num_heads, value_head_dim].
    """
    key_cache = dequantize_kv(key_cache, key_scale)
    value_cache = dequantize_kv(value_cache, value_scale)
    num_heads, block_size, num_kv_heads = query.size(1), key_cache.size(1), key_cache.size(2)
    group = num_heads // num_kv_heads  # query heads per kv head (GQA; MQA when num_kv_heads is 1)
    value_head_dim = value_cache.size(3) if value_head_dim is None else value_head_dim
    value_cache = value_cache[..., :value_head_dim]
    out = torch.zeros(query.size(0), num_heads, value_head_dim, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for b, context_len in enumerate(seq_lens.tolist()):
        query_len = starts[b + 1] - starts[b]
        if query_len == 0:
            continue
        table = block_tables[b].tolist()
        # Walk the block table: keys, values [context_len, num_kv_heads, head_dim].
        slots = [(table[p // block_size], p % block_size) for p in range(context_len)]
        keys = torch.stack([key_cache[blk, off] for blk, off in slots]).double()
        values = torch.stack([value_cache[blk, off] for blk, off in slots]).double()
        for i in range(query_len):
            t, position = starts[b] + i, context_len - query_len + i
            first = max(0, position - sliding_window + 1) if sliding_window > 0 else 0
            for h in range(num_heads):
                k = keys[first:position + 1, h // group]  # [n, head_dim]
                v = values[first:position + 1, h // group]
                scores = (k @ query[t, h].double()) * scale  # [n]
                if logit_softcap > 0:
                    scores = logit_softcap * torch.tanh(scores / logit_softcap)
                if sinks is not None:  # the sink's share of the softmax, no value
                    probs = torch.softmax(torch.cat([scores, sinks[h:h + 1].double()]), 0)[:-1]
                else:
                    probs = torch.softmax(scores, dim=0)
                out[t, h] = probs @ v
    return out


def mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, latents: torch.Tensor,
                  kv_b_proj: torch.Tensor, scale: float, kv_lora_rank: int) -> torch.Tensor:
    """Multi-head latent attention of one sequence, the way transformers computes it: the
    context's latents expanded to per-head keys and values, then causal softmax attention.

    q_nope [q, H, nope] and q_rope [q, H, rope]: the last q positions' queries; latents
    [context, kv_lora_rank + rope]: every position's [normalized latent | rotated key];
    kv_b_proj [H * (nope + v), kv_lora_rank]. Returns fp64 [q, H, v]."""
    q, heads, nope = q_nope.shape
    context = latents.size(0)
    kv = (latents[:, :kv_lora_rank].double() @ kv_b_proj.double().T).view(context, heads, -1)
    keys = torch.cat([kv[..., :nope], latents[:, None, kv_lora_rank:].double().expand(
        context, heads, -1)], dim=-1)  # [context, H, nope + rope]
    values = kv[..., nope:]
    query = torch.cat([q_nope, q_rope], dim=-1).double()
    out = torch.zeros(q, heads, values.size(-1), dtype=torch.float64)
    for i in range(q):
        position = context - q + i
        for h in range(heads):
            scores = keys[:position + 1, h] @ query[i, h] * scale
            out[i, h] = torch.softmax(scores, dim=0) @ values[:position + 1, h]
    return out


# ------------------------------------------------------------------------------------------- moe


def fused_moe(hidden: torch.Tensor, w13: list[torch.Tensor], w2: list[torch.Tensor],
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
              activation: str = "silu", alpha: float = 1.702,
              limit: float = 7.0) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with
    e = topk_ids[t, j], one token and slot at a time. hidden [T, H]; w13[e] [2I, H] (gate rows,
    then up rows); w2[e] [H, I]; topk_weights, topk_ids [T, k]; optional biases [E, 2I] /
    [E, H]; activation "clamped_swiglu": clamped_swiglu_and_mul's gate; "relu2": no gate,
    w13[e] [I, H] the up rows, relu(up)^2 (in fp64 here). Returns fp64 [T, H]."""
    x = hidden.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.size(0)):
        for j in range(topk_ids.size(1)):
            e = int(topk_ids[t, j])
            gate_up = w13[e].double() @ x[t]
            if w13_bias is not None:
                gate_up = gate_up + w13_bias[e].double()
            inter = gate_up.numel() // 2
            if activation == "relu2":
                act = torch.relu(gate_up) ** 2
            elif activation == "clamped_swiglu":
                act = clamped_swiglu_and_mul(gate_up[None], alpha, limit)[0]
            else:
                act = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            down = w2[e].double() @ act
            if w2_bias is not None:
                down = down + w2_bias[e].double()
            out[t] += float(topk_weights[t, j]) * down
    return out


def fused_moe_quantized(hidden: torch.Tensor, w13: list[torch.Tensor],
                        w13_scales: list[torch.Tensor], w13_zeros: list[torch.Tensor],
                        w13_group_size: int, w2: list[torch.Tensor],
                        w2_scales: list[torch.Tensor], w2_zeros: list[torch.Tensor],
                        w2_group_size: int, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """fused_moe on each expert's dequantized weights (quantized_weight; empty zeros lists for
    none), SwiGLU or (activation "relu2") no gate. Returns fp64 [T, H]."""
    def weights(q, scales, zeros, group_size):
        return [quantized_weight(q[e], scales[e], zeros[e] if zeros else None, group_size)
                for e in range(len(q))]
    return fused_moe(hidden, weights(w13, w13_scales, w13_zeros, w13_group_size),
                     weights(w2, w2_scales, w2_zeros, w2_group_size), topk_weights, topk_ids,
                     activation=activation)


def moe_routing(router_logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int,
                scoring_func: str, n_group: int, topk_group: int, renormalize: bool,
                routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The router as transformers writes it (Mixtral / Qwen3-MoE softmax top-k; DeepSeek-V2
    group-limited greedy: groups rank by their best score; DeepSeek-V3: sigmoid scores plus a
    correction bias choose, groups rank by their best two, the plain scores weigh), with ties
    settled by the lower id: stable sorts instead of torch.topk. Returns (fp32 weights, int64 ids)
    [T, top_k], best first."""
    logits = router_logits.float()
    scores = logits.sigmoid() if scoring_func == "sigmoid" else logits.softmax(-1)
    choice = scores if correction_bias is None else scores + correction_bias
    tokens, experts = choice.shape
    if n_group > 1:
        grouped = choice.view(tokens, n_group, experts // n_group)
        ranked = torch.sort(grouped, dim=-1, descending=True, stable=True).values
        group_scores = ranked[..., :2].sum(-1) if scoring_func == "sigmoid" else ranked[..., 0]
        order = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices
        best = order[:, :topk_group]
        keep = torch.zeros(tokens, n_group, dtype=torch.bool)
        keep.scatter_(1, best, True)
        keep = keep[:, :, None].expand(grouped.shape).reshape(tokens, experts)
        choice = choice.masked_fill(~keep, -math.inf)
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


# -------------------------------------------------------------------------------------- sampling


def _filter_row(x: torch.Tensor, temperature: float, top_k: int, top_p: float,
                min_p: float) -> torch.Tensor:
    """One row [vocab] fp64: temperature, then top-k, top-p and min-p set removed logits to -inf."""
    x = x / temperature
    vocab = x.numel()
    if 0 < top_k < vocab:  # keep everything >= the k-th largest, so ties at the threshold stay
        threshold = torch.sort(x, descending=True).values[top_k - 1]
        x = x.masked_fill(x < threshold, -math.inf)
    if top_p < 1.0:  # keep x when the mass of the logits <= x exceeds 1 - p (ties alike)
        values = torch.sort(x).values
        cumulative = torch.softmax(values, dim=0).cumsum(dim=0)
        at_or_below = cumulative[torch.searchsorted(values, x, right=True) - 1]
        # the most likely token always stays
        x = x.masked_fill((at_or_below <= 1.0 - top_p) & (x < values[-1]), -math.inf)
    if min_p > 0.0:  # drop tokens less likely than min_p times the most likely one
        probs = torch.softmax(x, dim=0)
        x = x.masked_fill(probs < min_p * probs.max(), -math.inf)
    return x


def sampling_filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                           top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Filtered logits fp64 [rows, vocab]: removed tokens are -inf; greedy rows (temperature 0)
    are returned unchanged.

    logits [rows, vocab]; temperature, top_p, min_p [rows] float; top_k [rows] int (<= 0: off).
    """
    out = logits.double().clone()
    for r in range(out.size(0)):
        if float(temperature[r]) == 0.0:
            continue
        out[r] = _filter_row(out[r], float(temperature[r]), int(top_k[r]), float(top_p[r]),
                             float(min_p[r]))
    return out


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """The distribution each row samples from, fp64 [rows, vocab]: softmax of the filtered logits,
    or one-hot on the (first) argmax for greedy rows (temperature 0)."""
    filtered = sampling_filter_logits(logits, temperature, top_k, top_p, min_p)
    probs = torch.softmax(filtered, dim=-1)
    for r in range(probs.size(0)):
        if float(temperature[r]) == 0.0:
            probs[r] = torch.nn.functional.one_hot(filtered[r].argmax(), probs.size(1)).double()
    return probs


def apply_penalties(logits: torch.Tensor, prompt_ids: list[list[int]], output_ids: list[list[int]],
                    repetition: list[float], presence: list[float],
                    frequency: list[float]) -> torch.Tensor:
    """Penalized logits fp64 [rows, vocab], per row: the repetition penalty over every token id in
    the prompt or the output (a positive logit divided by it, a negative one multiplied), then
    logit -= presence * (count > 0) + frequency * count over the output tokens only.

    logits [rows, vocab]; one id list and one float of each penalty per row (1, 0, 0: off).
    """
    out = logits.double().clone()
    vocab = out.size(1)
    for r in range(out.size(0)):
        counts = torch.bincount(torch.tensor(output_ids[r], dtype=torch.long), minlength=vocab)
        in_prompt = torch.bincount(torch.tensor(prompt_ids[r], dtype=torch.long), minlength=vocab)
        seen = (counts + in_prompt) > 0
        x = out[r]
        penalized = torch.where(x > 0, x / float(repetition[r]), x * float(repetition[r]))
        x = torch.where(seen, penalized, x)
        out[r] = x - float(presence[r]) * (counts > 0).double() - float(frequency[r]) * counts.double()
    return out


def _draw(weights: torch.Tensor, u: float) -> int:
    """Inverse CDF: the first index whose cumulative weight exceeds u * total."""
    cumulative = weights.cumsum(dim=0)
    above = (cumulative > u * float(cumulative[-1])).nonzero()
    return int(above[0]) if above.numel() else int(weights.nonzero()[-1])


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     draft_token_ids: list[int], cu_num_drafts: list[int],
                     uniform: torch.Tensor) -> tuple[list[list[int]], list[int]]:
    """Speculative verification (Leviathan et al. 2023, algorithm 1), one sequence at a time in
    fp64. Sequence b has drafts cu[b]:cu[b+1] and target rows from cu[b] + b (one per draft, then
    the bonus row); draft_probs None means point-mass drafts. Draft j is accepted when
    uniform * q(x) < p(x); the first rejection draws from max(p - q, 0) normalised (p when that is
    all zero) with the uniform of the bonus row; all accepted: a draw from the bonus row.
    Returns per sequence the emitted tokens (-1 for a draw from a row with no mass) and the
    number of accepted drafts."""
    p_all = target_probs.double()
    tokens, accepted = [], []
    for b in range(len(cu_num_drafts) - 1):
        first, k = cu_num_drafts[b], cu_num_drafts[b + 1] - cu_num_drafts[b]
        row0, u_final = first + b, float(uniform[first + b + k])
        out = []
        for j in range(k + 1):
            p = p_all[row0 + j]
            if not (torch.isfinite(p).all() and (p >= 0).all() and p.sum() > 0):
                out.append(-1)
                break
            if j == k:
                out.append(_draw(p, u_final))
                break
            x = draft_token_ids[first + j]
            q = (draft_probs[first + j].double() if draft_probs is not None
                 else torch.nn.functional.one_hot(torch.tensor(x), p.numel()).double())
            if float(uniform[row0 + j]) * float(q[x]) < float(p[x]):
                out.append(x)
                continue
            residual = (p - q).clamp(min=0)
            out.append(_draw(residual if residual.sum() > 0 else p, u_final))
            break
        tokens.append(out)
        accepted.append(len(out) - 1)
    return tokens, accepted
