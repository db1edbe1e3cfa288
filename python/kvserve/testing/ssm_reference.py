"""Slow, obviously-correct pure-torch references for the state-space ops (Mamba2's causal
convolution, selective scan and gated RMSNorm), in the manner of reference.py: fp64, loops over
sequences and tokens, new tensors returned instead of writing in place.

The token layout is the engine's: the tokens of several sequences back to back, sequence i
being rows cu_seqlens[i]:cu_seqlens[i + 1]; each sequence reads and writes its state in slot
slots[i] of a pool, starting from zeros where has_initial_state[i] is false.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d", "ssm_scan", "rms_norm_gated"]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_state: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                  has_initial_state: torch.Tensor, silu: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution. x [tokens, dim]; weight [dim, kernel]; bias [dim];
    conv_state [num_slots, dim, kernel - 1]: the sequence's previous kernel - 1 inputs, oldest
    first. Returns (out [tokens, dim], the new conv_state)."""
    kernel = weight.shape[1]
    w = weight.double()
    out = torch.empty(x.shape, dtype=torch.float64)
    state = conv_state.clone()
    for i in range(len(slots)):
        start, end = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        slot = int(slots[i])
        history = (conv_state[slot].double() if bool(has_initial_state[i])
                   else torch.zeros(x.shape[1], kernel - 1, dtype=torch.float64))
        seq = torch.cat([history, x[start:end].double().T], dim=1)  # [dim, kernel - 1 + len]
        for t in range(end - start):
            value = (seq[:, t:t + kernel] * w).sum(dim=1)
            if bias is not None:
                value = value + bias.double()
            out[start + t] = F.silu(value) if silu else value
        state[slot] = seq[:, seq.shape[1] - (kernel - 1):].to(conv_state.dtype)
    return out.to(x.dtype), state


def ssm_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor | None, dt_bias: torch.Tensor | None,
             state: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
             has_initial_state: torch.Tensor, dt_softplus: bool = True,
             dt_min: float = 0.0, dt_max: float = float("inf")
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan, one token at a time. x [tokens, heads, head_dim]; dt [tokens,
    heads] (dt_bias added, then softplus, then clamped to [dt_min, dt_max]); A [heads] (Mamba2)
    or [heads, state_size] (Mamba, a head a channel); B, C [tokens, groups, state_size] (heads
    split evenly over groups); D [heads]; state [num_slots, heads, head_dim, state_size]. Per
    token: h = exp(dt * A) h + dt * x B^T, y = h C + D x. Returns (y [tokens, heads, head_dim],
    the new state)."""
    heads, groups = x.shape[1], B.shape[1]
    per_group = heads // groups
    y = torch.empty(x.shape, dtype=torch.float64)
    new_state = state.clone()
    dt = dt.double() + (dt_bias.double() if dt_bias is not None else 0.0)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(dt_min, dt_max)
    group_of = torch.arange(heads) // per_group
    for i in range(len(slots)):
        start, end = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        slot = int(slots[i])
        h = (state[slot].double() if bool(has_initial_state[i])
             else torch.zeros(state.shape[1:], dtype=torch.float64))
        for t in range(start, end):
            b = B[t].double()[group_of]  # [heads, state_size]
            c = C[t].double()[group_of]
            rate = A.double() if A.dim() == 2 else A.double()[:, None]  # [heads, 1 or N]
            decay = torch.exp(dt[t][:, None] * rate)
            h = decay[:, None, :] * h + (dt[t][:, None, None] * x[t].double()[:, :, None]
                                            * b[:, None, :])
            y[t] = (h * c[:, None, :]).sum(-1)
            if D is not None:
                y[t] = y[t] + D.double()[:, None] * x[t].double()
        new_state[slot] = h.to(state.dtype)
    return y.to(x.dtype), new_state


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor | None,
                   group_size: int, epsilon: float,
                   norm_before_gate: bool = False) -> torch.Tensor:
    """The mixer's gated output, x and z [tokens, dim]: weight * RMSNorm over groups of
    group_size channels of x * silu(z) (Mamba2: the gate before the norm); with
    norm_before_gate, weight * RMSNorm(x) * silu(z) (FalconH1); without a weight, x * silu(z)
    (FalconH1 without its norm)."""
    h = x.double()
    gate = F.silu(z.double()) if z is not None else None
    if weight is None:
        return (h * gate).to(x.dtype)
    if gate is not None and not norm_before_gate:
        h = h * gate
    g = h.view(h.shape[0], -1, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + epsilon)
    out = weight.double() * g.view(h.shape)
    if gate is not None and norm_before_gate:
        out = out * gate
    return out.to(x.dtype)
