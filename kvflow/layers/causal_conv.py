"""The causal depthwise convolution of the state layers (Gated DeltaNet, Mamba2) over a step's
flat batch: each request's tokens convolved with its window (the last kernel_size - 1 inputs,
kept in the layer's conv state slot between steps), all requests at once, so that a prompt
can arrive in chunks and a decode reads only its window."""
from __future__ import annotations

import numpy as np
import torch


def causal_conv1d(conv_state: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                  mixed: torch.Tensor, starts: np.ndarray, lens: np.ndarray, slots: torch.Tensor,
                  saves: dict) -> torch.Tensor:
    """The causal depthwise convolution (weight [channels, taps], an optional bias) of every
    request's tokens [T, channels] over its window (its last taps - 1 inputs in `conv_state`
    [slots, taps - 1, channels], then this step's), all requests at once; the windows' last
    taps - 1 rows become the new states (and, for a snapshot after token `after` of request
    i, the taps - 1 rows up to it). Summed in fp32, returned in `mixed`'s dtype."""
    kernel_size, channels = conv_weight.shape[1], conv_weight.shape[0]
    taps, n_req, t = kernel_size - 1, len(lens), mixed.shape[0]
    # each request's rows in one buffer: its state, then its tokens (request i's start moves
    # down by i windows)
    shift = np.arange(n_req, dtype=np.int64) * taps
    offsets = np.asarray(starts[:-1], dtype=np.int64) + shift
    state_rows = torch.from_numpy((offsets[:, None] + np.arange(taps)).reshape(-1))
    token_rows = torch.from_numpy(np.arange(t) + np.repeat(shift + taps, lens))
    buf = torch.empty(t + n_req * taps, channels, dtype=mixed.dtype, device=mixed.device)
    buf[state_rows] = conv_state[slots].reshape(-1, channels)
    buf[token_rows] = mixed
    # out[t] = sum_j w[:, j] * window[t + j]: the last kernel_size inputs up to t
    w = conv_weight.float()
    first = token_rows - taps
    out = sum(buf[first + j].float() * w[:, j] for j in range(kernel_size))
    if conv_bias is not None:
        out += conv_bias.float()
    conv_state[slots] = buf[torch.from_numpy(offsets + lens)[:, None] + torch.arange(taps)]
    for i, (after, snap) in saves.items():
        at = int(offsets[i]) + after + 1
        conv_state[snap] = buf[at:at + taps]
    return out.to(mixed.dtype)
