"""The state layers' C kernels (kvflow/csrc/state_update.c) give the PyTorch paths' numbers on
every instruction set this CPU runs: the causal conv over decodes and prompt chunks with their
carried windows and snapshots, Gated DeltaNet's and Mamba2's one-token state updates on states
in scattered slots; and the layers give the same outputs and states with and without them."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvflow.csrc import state_update as su
from kvflow.layers.causal_conv import causal_conv1d
from kvflow.layers.gated_deltanet import (GatedDeltaNet, chunk_gated_delta_rule, l2norm,
                                          recurrent_gated_delta_rule)
from kvflow.layers.mamba2 import Mamba2, chunk_scan, recurrent_scan
from kvflow.layers.short_conv import ShortConv
from kvflow.model.cpu_features import cpu_features
from kvflow.model.kernels import select_kernels

torch.set_num_threads(1)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)  # a bf16 rounding either side
F32_TOL = dict(atol=1e-5, rtol=1e-5)


def _isas_here() -> list[str]:
    if su.state_isas() == []:
        pytest.skip("the C kernels did not build")
    f = cpu_features()
    runs = {"scalar": True, "avx2": {"avx2", "fma"} <= f.flags, "avx512": f.avx512}
    return [i for i in su.state_isas() if runs[i]]


def _need(isa: str) -> None:
    if isa not in _isas_here():
        pytest.skip(f"this CPU (or KVFLOW_CPU_ISA) has no {isa}")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request, monkeypatch):
    """Two threads split even these small calls."""
    if request.param > 1:
        monkeypatch.setattr(su, "MIN_PARALLEL_VALUES", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_the_build_has_each_path_this_cpu_runs():
    f = cpu_features()
    assert "scalar" in su.state_isas()
    assert ("avx512" in su.state_isas()) == f.avx512
    assert su.best_state_isa(f) == _isas_here()[-1]
    assert select_kernels(torch.float32).state_isa == su.best_state_isa(f)


# three requests in scattered slots: a decode, a prompt chunk with a snapshot inside it, and
# a decode whose snapshot is its one token; C = 300 leaves tails past the vector widths and
# the 128-channel blocks
LENS, SLOTS, SAVES = np.array([1, 6, 1]), np.array([5, 1, 3]), {1: (2, 0), 2: (0, 6)}


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel_size,bias,silu", [(4, False, True), (4, True, True), (3, True, False)])
@pytest.mark.parametrize("saves", [SAVES, {}], ids=["snapshots", "none"])
def test_conv_matches_the_reference_over_decodes_chunks_and_snapshots(isa, dtype, kernel_size, bias,
                                                                      silu, saves, threads):
    _need(isa)
    g = torch.Generator().manual_seed(0)
    c = 300
    starts = np.concatenate([[0], np.cumsum(LENS)])
    state = torch.randn(8, kernel_size - 1, c, generator=g).to(dtype)
    weight = torch.randn(c, kernel_size, generator=g).to(dtype)
    b = torch.randn(c, generator=g).to(dtype) if bias else None
    wide = torch.randn(int(starts[-1]), c + 20, generator=g).to(dtype)  # strided rows
    x = wide[:, 7:7 + c]
    ref_state = state.clone()
    ref = causal_conv1d(ref_state, weight, b, x, starts, LENS, torch.from_numpy(SLOTS), saves)
    if silu:
        ref = F.silu(ref)
    got = su.causal_conv(state, weight, b, x, starts, LENS, SLOTS, saves, silu, isa)
    assert torch.equal(state, ref_state)  # windows and snapshots: copies, exact
    torch.testing.assert_close(got, ref, **(F32_TOL if dtype == torch.float32 else BF16_TOL))


def _gdn_reference(x, ba, a_log, dt_bias, state, rows, slots, nk, dk, dv):
    """The layer's PyTorch decode: its preprocessing, then recurrent_gated_delta_rule."""
    nv = state.shape[1]
    xr = x[rows].float()
    q, k, v = xr.split([nk * dk, nk * dk, nv * dv], dim=-1)
    q = (l2norm(q.view(len(rows), nk, dk)) * dk ** -0.5).repeat_interleave(nv // nk, 1)
    k = l2norm(k.view(len(rows), nk, dk)).repeat_interleave(nv // nk, 1)
    b, a = ba[rows].split(nv, dim=-1)
    g = -a_log.exp() * F.softplus(a.float() + dt_bias)
    s = state[slots]
    out = recurrent_gated_delta_rule(q, k, v.view(len(rows), nv, dv), g, b.sigmoid().float(), s)
    state[slots] = s
    return out


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# dv 36: tails past 16 and 8 lanes; dv 64: whole vectors
@pytest.mark.parametrize("dk,dv", [(32, 36), (16, 64)])
def test_gated_delta_step_matches_the_recurrence(isa, dtype, dk, dv, threads):
    _need(isa)
    g = torch.Generator().manual_seed(1)
    nk, nv, t = 2, 4, 6
    rows, slots = np.array([0, 2, 5]), np.array([4, 1, 2])
    x = torch.randn(t, 2 * nk * dk + nv * dv, generator=g).to(dtype)
    proj = torch.randn(t, 3 + 2 * nv, generator=g).to(dtype)
    ba = proj[:, 3:]  # strided rows, as the layer's projection gives them
    a_log, dt_bias = torch.randn(nv, generator=g) * 0.5, torch.randn(nv, generator=g)
    state = torch.randn(7, nv, dk, dv, generator=g)
    ref_state = state.clone()
    ref = _gdn_reference(x, ba, a_log, dt_bias, ref_state, torch.from_numpy(rows),
                         torch.from_numpy(slots), nk, dk, dv)
    out = torch.full((t, nv, dv), float("nan"))
    su.gated_delta_decode(x, ba, a_log, dt_bias, state, rows, slots, out, nk, isa)
    torch.testing.assert_close(out[rows], ref, **F32_TOL)
    torch.testing.assert_close(state, ref_state, **F32_TOL)  # the others' slots untouched too
    assert out[[1, 3, 4]].isnan().all()  # other rows are not written


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_delta_step_with_the_gated_norm_matches_the_layers(isa, dtype, threads):
    """The decode-only step's fused output: the layer's _gated_norm of the step's output."""
    _need(isa)
    g = torch.Generator().manual_seed(5)
    nk, nv, dk, dv, t = 2, 4, 32, 36, 3
    layer = GatedDeltaNet(16, nk, nv, dk, dv, 4, 1e-6, dtype)
    with torch.no_grad():
        layer.norm.copy_(torch.randn(dv, generator=g))
    rows, slots = np.arange(t), np.array([4, 1, 2])
    x = torch.randn(t, 2 * nk * dk + nv * dv, generator=g).to(dtype)
    proj = torch.randn(t, nv * dv + 2 * nv, generator=g).to(dtype)  # z, then b and a
    z, ba = proj[:, :nv * dv], proj[:, nv * dv:]
    a_log, dt_bias = torch.randn(nv, generator=g) * 0.5, torch.randn(nv, generator=g)
    state = torch.randn(7, nv, dk, dv, generator=g)
    ref_state, out = state.clone(), torch.empty(t, nv, dv)
    su.gated_delta_decode(x, ba, a_log, dt_bias, ref_state, rows, slots, out, nk, "scalar")
    ref = layer._gated_norm(out.to(dtype), z)
    gated = torch.empty(t, nv, dv, dtype=dtype)
    su.gated_delta_decode(x, ba, a_log, dt_bias, state, rows, slots, gated, nk, isa,
                          gate=(z, layer.norm, layer.eps))
    torch.testing.assert_close(state, ref_state, **F32_TOL)
    torch.testing.assert_close(gated, ref, **(F32_TOL if dtype == torch.float32 else BF16_TOL))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_delta_gated_norm_matches_the_layers(dtype, threads):
    """A prompt step's output: the layer's _gated_norm of the recurrence's rows."""
    g = torch.Generator().manual_seed(8)
    nk, nv, dk, dv, t = 2, 4, 16, 36, 7
    layer = GatedDeltaNet(16, nk, nv, dk, dv, 4, 1e-6, dtype)
    with torch.no_grad():
        layer.norm.copy_(torch.randn(dv, generator=g))
    out = torch.randn(t, nv, dv, generator=g)
    z = torch.randn(t, nv * dv + 3, generator=g).to(dtype)[:, 3:]  # strided rows
    got = su.gdn_gated_norm(out, z, layer.norm, layer.eps)
    ref = layer._gated_norm(out.to(dtype), z)
    torch.testing.assert_close(got, ref, **(F32_TOL if dtype == torch.float32 else BF16_TOL))


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.05, 0.4)])
@pytest.mark.parametrize("p,n", [(24, 40), (16, 64)])
def test_ssm_step_matches_the_recurrence(isa, dtype, limit, p, n, threads):
    _need(isa)
    g = torch.Generator().manual_seed(2)
    nh, groups, t = 4, 2, 5
    rows, slots = np.array([4, 1, 2]), np.array([0, 6, 3])
    x = torch.randn(t, nh * p + 2 * groups * n, generator=g).to(dtype)
    proj = torch.randn(t, 5 + nh, generator=g).to(dtype)
    dt = proj[:, 5:]
    a_log, dt_bias = torch.randn(nh, generator=g) * 0.5, torch.randn(nh, generator=g)
    state = torch.randn(7, nh, p, n, generator=g)
    ref_state = state.clone()
    r, s = torch.from_numpy(rows), torch.from_numpy(slots)
    xs, b, c = x[r].float().split([nh * p, groups * n, groups * n], dim=-1)
    b, c = (y.view(3, groups, n).repeat_interleave(nh // groups, 1) for y in (b, c))
    d = F.softplus(dt[r].float() + dt_bias).clamp(*limit)
    gathered = ref_state[s]
    ref = recurrent_scan(xs.view(3, nh, p), d, -a_log.exp(), b, c, gathered)
    ref_state[s] = gathered
    y = torch.full((t, nh, p), float("nan"))
    su.ssm_decode(x, dt, a_log, dt_bias, state, rows, slots, y, groups, limit, isa)
    torch.testing.assert_close(y[rows], ref, **F32_TOL)
    torch.testing.assert_close(state, ref_state, **F32_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 2])
def test_ssm_gated_norm_matches_the_layers(dtype, groups):
    """The decode-only step's output: the D skip, then the layer's _gated_norm, rounded once."""
    g = torch.Generator().manual_seed(6)
    nh, p, n, t = 4, 24, 16, 3
    layer = Mamba2(16, nh, p, n, groups, 4, 1e-5, True, False, (0.0, float("inf")), dtype)
    with torch.no_grad():
        layer.norm.copy_(torch.randn(nh * p, generator=g))
        layer.D.copy_(torch.randn(nh, generator=g))
    y = torch.randn(t, nh, p, generator=g)
    x = torch.randn(t, nh * p + 2 * groups * n, generator=g).to(dtype)
    z = torch.randn(t, nh * p + 5, generator=g).to(dtype)[:, 5:]
    ref = (y + layer.D[:, None] * x[:, :nh * p].float().view(t, nh, p)).view(t, -1)
    ref = layer._gated_norm(ref, z).to(dtype)
    got = su.ssm_gated_norm(y, x, z, layer.D, layer.norm, layer.eps, groups)
    torch.testing.assert_close(got, ref, **(F32_TOL if dtype == torch.float32 else BF16_TOL))


# three prompt chunks in scattered slots: past the kernels' 32-token blocks, one token long
# (a chunk of one), and one with a snapshot inside a block; rows strided in a wider batch
CHUNK_LENS, CHUNK_SLOTS, CHUNK_SAVES = np.array([37, 1, 70]), np.array([5, 1, 3]), {0: (33, 0), 2: (9, 6)}


def _chunk_rows(lens):
    starts = np.concatenate([[0], np.cumsum(lens)])
    return starts, [np.arange(starts[i], starts[i + 1]) for i in range(len(lens))]


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dk,dv", [(32, 36), (16, 64)])
@pytest.mark.parametrize("saves", [CHUNK_SAVES, {}], ids=["snapshots", "none"])
def test_gated_delta_chunks_match_the_recurrence_token_by_token(isa, dtype, dk, dv, saves, threads):
    """A prompt chunk through the C scan gives each token's one-token recurrence, its state
    moved on in its slot and its snapshot kept after the given token."""
    _need(isa)
    g = torch.Generator().manual_seed(11)
    nk, nv = 2, 4
    starts, rows = _chunk_rows(CHUNK_LENS)
    t = int(starts[-1])
    x = torch.randn(t, 2 * nk * dk + nv * dv + 9, generator=g).to(dtype)[:, 9:]
    ba = torch.randn(t, 3 + 2 * nv, generator=g).to(dtype)[:, 3:]
    a_log, dt_bias = torch.randn(nv, generator=g) * 0.5, torch.randn(nv, generator=g)
    state = torch.randn(7, nv, dk, dv, generator=g) * 0.3
    ref_state = state.clone()
    ref = torch.full((t, nv, dv), float("nan"))
    for i, (slot, token_rows) in enumerate(zip(CHUNK_SLOTS, rows)):
        for n, row in enumerate(token_rows):
            ref[row] = _gdn_reference(x, ba, a_log, dt_bias, ref_state, torch.tensor([row]),
                                      torch.tensor([slot]), nk, dk, dv)[0]
            if i in saves and saves[i][0] == n:
                ref_state[saves[i][1]] = ref_state[slot]
    out = torch.full((t, nv, dv), float("nan"))
    su.gated_delta_chunks(x, ba, a_log, dt_bias, state, starts, CHUNK_LENS, CHUNK_SLOTS, saves,
                          out, nk, isa)
    torch.testing.assert_close(out, ref, **F32_TOL)
    torch.testing.assert_close(state, ref_state, **F32_TOL)  # snapshots and untouched slots too


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_gated_delta_chunk_split_over_column_groups_matches_the_recurrence(isa, monkeypatch):
    """More threads than heads: each head's columns in groups (here 3 of dv 100: 48, 48 and a
    tail of 4), each group its own unit; the same outputs, state and snapshot."""
    _need(isa)
    monkeypatch.setattr(su, "MIN_PARALLEL_VALUES", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        g = torch.Generator().manual_seed(14)
        nk, nv, dk, dv, t = 1, 2, 32, 100, 37
        x = torch.randn(t, 2 * nk * dk + nv * dv, generator=g)
        ba = torch.randn(t, 2 * nv, generator=g)
        a_log, dt_bias = torch.randn(nv, generator=g) * 0.5, torch.randn(nv, generator=g)
        state = torch.randn(3, nv, dk, dv, generator=g) * 0.3
        ref_state, ref = state.clone(), torch.empty(t, nv, dv)
        for row in range(t):
            ref[row] = _gdn_reference(x, ba, a_log, dt_bias, ref_state, torch.tensor([row]),
                                      torch.tensor([1]), nk, dk, dv)[0]
            if row == 20:
                ref_state[2] = ref_state[1]
        out = torch.empty(t, nv, dv)
        su.gated_delta_chunks(x, ba, a_log, dt_bias, state, np.array([0, t]), np.array([t]),
                              np.array([1]), {0: (20, 2)}, out, nk, isa)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, ref, **F32_TOL)
    torch.testing.assert_close(state, ref_state, **F32_TOL)


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.05, 0.4)])
# n 40: tails past the vector paths' 64 and 32 columns; n 128: whole blocks
@pytest.mark.parametrize("p,n", [(24, 40), (16, 128)])
@pytest.mark.parametrize("saves", [CHUNK_SAVES, {}], ids=["snapshots", "none"])
def test_ssm_chunks_match_the_recurrence_token_by_token(isa, dtype, limit, p, n, saves, threads):
    _need(isa)
    g = torch.Generator().manual_seed(12)
    nh, groups = 4, 2
    starts, rows = _chunk_rows(CHUNK_LENS)
    t = int(starts[-1])
    x = torch.randn(t, nh * p + 2 * groups * n, generator=g).to(dtype)
    dt = torch.randn(t, 5 + nh, generator=g).to(dtype)[:, 5:]
    a_log, dt_bias = torch.randn(nh, generator=g) * 0.5, torch.randn(nh, generator=g)
    state = torch.randn(7, nh, p, n, generator=g)
    ref_state = state.clone()
    xs, b, c = x.float().split([nh * p, groups * n, groups * n], dim=-1)
    b, c = (y.view(t, groups, n).repeat_interleave(nh // groups, 1) for y in (b, c))
    d = F.softplus(dt.float() + dt_bias).clamp(*limit)
    ref = torch.full((t, nh, p), float("nan"))
    for i, (slot, token_rows) in enumerate(zip(CHUNK_SLOTS, rows)):
        for k, row in enumerate(token_rows):
            s = ref_state[slot:slot + 1]  # a view: updated in place
            ref[row] = recurrent_scan(xs[row:row + 1].view(1, nh, p), d[row:row + 1], -a_log.exp(),
                                      b[row:row + 1], c[row:row + 1], s)[0]
            if i in saves and saves[i][0] == k:
                ref_state[saves[i][1]] = ref_state[slot]
    y = torch.full((t, nh, p), float("nan"))
    su.ssm_chunks(x, dt, a_log, dt_bias, state, starts, CHUNK_LENS, CHUNK_SLOTS, saves, y, groups,
                  limit, isa)
    torch.testing.assert_close(y, ref, **F32_TOL)
    torch.testing.assert_close(state, ref_state, **F32_TOL)


@pytest.mark.parametrize("isa", ["scalar", "avx512"])
def test_the_scans_agree_with_the_layers_chunked_forms(isa):
    """The C scans against the PyTorch chunked forms the layers ran before them (the delta
    rule through triangular solves, the SSD as masked attention): the same outputs and state
    up to fp32 rounding over 100 tokens."""
    _need(isa)
    g = torch.Generator().manual_seed(13)
    nk, nv, dk, dv, t = 1, 2, 32, 48, 100
    x = torch.randn(t, 2 * nk * dk + nv * dv, generator=g)
    ba = torch.randn(t, 2 * nv, generator=g)
    a_log, dt_bias = torch.randn(nv, generator=g) * 0.5, torch.randn(nv, generator=g)
    state = torch.randn(1, nv, dk, dv, generator=g) * 0.3
    q, k, v = x.split([nk * dk, nk * dk, nv * dv], dim=-1)
    q = (l2norm(q.view(t, nk, dk)) * dk ** -0.5).repeat_interleave(nv // nk, 1)
    k = l2norm(k.view(t, nk, dk)).repeat_interleave(nv // nk, 1)
    gate = -a_log.exp() * F.softplus(ba[:, nv:] + dt_bias)
    ref, ref_state = chunk_gated_delta_rule(q.transpose(0, 1), k.transpose(0, 1),
                                            v.view(t, nv, dv).transpose(0, 1), gate.T,
                                            ba[:, :nv].sigmoid().T, state[0])
    out = torch.empty(t, nv, dv)
    su.gated_delta_chunks(x, ba, a_log, dt_bias, state, np.array([0, t]), np.array([t]),
                          np.array([0]), {}, out, nk, isa)
    torch.testing.assert_close(out, ref.transpose(0, 1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state[0], ref_state, atol=1e-4, rtol=1e-4)

    nh, groups, p, n = 4, 1, 16, 32
    x = torch.randn(t, nh * p + 2 * groups * n, generator=g)
    dt = torch.randn(t, nh, generator=g)
    a_log, dt_bias = torch.randn(nh, generator=g) * 0.5, torch.randn(nh, generator=g)
    state = torch.randn(1, nh, p, n, generator=g)
    xs, b, c = x.split([nh * p, n, n], dim=-1)
    d = F.softplus(dt + dt_bias)
    ref, ref_state = chunk_scan(xs.view(t, nh, p).transpose(0, 1), d.T, -a_log.exp(),
                                b.expand(nh, t, n), c.expand(nh, t, n), state[0])
    y = torch.empty(t, nh, p)
    su.ssm_chunks(x, dt, a_log, dt_bias, state, np.array([0, t]), np.array([t]), np.array([0]),
                  {}, y, groups, (0.0, float("inf")), isa)
    torch.testing.assert_close(y, ref.transpose(0, 1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state[0], ref_state, atol=1e-4, rtol=1e-4)


def test_wrong_shapes_are_refused():
    state = torch.zeros(2, 3, 8)
    with pytest.raises(ValueError, match="do not fit"):
        su.causal_conv(state, torch.zeros(9, 4), None, torch.zeros(1, 8), np.array([0, 1]),
                       np.array([1]), np.array([0]), {}, True, "scalar")


# -- the layers, with and without the kernels ---------------------------------------------------

def _meta(lens, seq_lens, slots, saves=None):
    lens = np.asarray(lens, dtype=np.int64)
    return SimpleNamespace(query_lens=lens, seq_lens=np.asarray(seq_lens, dtype=np.int64),
                           query_start_loc=np.concatenate([[0], np.cumsum(lens)]),
                           state_slots=np.asarray(slots, dtype=np.int64), state_saves=saves)


LAYERS = {
    "short_conv": lambda dtype: ShortConv(48, 3, True, dtype),
    "gated_deltanet": lambda dtype: GatedDeltaNet(48, 2, 4, 16, 24, 4, 1e-6, dtype),
    "mamba2": lambda dtype: Mamba2(48, 4, 16, 32, 2, 4, 1e-5, True, False, (0.0, float("inf")), dtype),
}
# a prompt arrives in two chunks (a snapshot inside the second), another is one token long,
# then all decode; slots scattered
STEPS = [([5, 1], [5, 1], [3, 0], None), ([4, 1, 1], [9, 2, 1], [3, 0, 5], {0: (1, 6)}),
         ([1, 1, 1], [10, 3, 2], [3, 0, 5], {2: (0, 7)})]


def _run_layer(layer, kernels, dtype) -> list[torch.Tensor]:
    """STEPS through the layer from fresh states: each step's output, then its states, fp32."""
    layer.allocate_state(8, dtype)
    assert layer.c_kernels
    g = torch.Generator().manual_seed(4)
    outs = []
    for lens, seq_lens, slots, saves in STEPS:
        h = torch.randn(sum(lens), 48, generator=g).to(dtype)
        with torch.no_grad():
            outs.append(layer(h, _meta(lens, seq_lens, slots, saves), kernels, {}).float())
    return outs + [getattr(layer, n).float().clone() for n in ("state", "conv_state", "recurrent_state")
                   if getattr(layer, n, None) is not None]


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_gives_the_same_outputs_and_states_with_the_kernels(name, dtype):
    """In fp32 the same numbers; in bf16 no further from the fp32 layer than the PyTorch path
    (whose bf16 rounding points differ: the kernels sum in fp32 and round once)."""
    _isas_here()
    torch.manual_seed(3)
    layer = LAYERS[name](dtype)
    with torch.no_grad():
        for prm in layer.parameters():
            prm.copy_(torch.randn_like(prm.float()) * 0.3)
        if hasattr(layer, "A_log"):
            layer.A_log.uniform_(-1.0, 0.5)
    kernels = select_kernels(dtype)
    assert kernels.state_isa is not None
    got = _run_layer(layer, kernels, dtype)
    ref = _run_layer(layer, replace(kernels, state_isa=None), dtype)
    if dtype == torch.float32:
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, **F32_TOL)
        return
    exact = _run_layer(layer.float(), replace(select_kernels(torch.float32), state_isa=None),
                       torch.float32)
    for a, b, e in zip(got, ref, exact):
        err_c, err_torch = (a - e).abs().max(), (b - e).abs().max()
        assert err_c <= 1.25 * err_torch + 1e-3 * e.abs().max(), (err_c, err_torch)


@pytest.mark.parametrize("name", list(LAYERS))
def test_a_decode_reads_only_its_state_whatever_the_context(name):
    """The same state decoded at context 10 and at 100,000 gives the same output and state:
    nothing the layer holds or reads grows with the context."""
    _isas_here()
    torch.manual_seed(7)
    layer = LAYERS[name](torch.float32)
    with torch.no_grad():
        for prm in layer.parameters():
            prm.copy_(torch.randn_like(prm) * 0.3)
    kernels = select_kernels(torch.float32)
    layer.allocate_state(4, torch.float32)
    names = [n for n in ("state", "conv_state", "recurrent_state") if getattr(layer, n, None) is not None]
    with torch.no_grad():
        layer(torch.randn(9, 48), _meta([9], [9], [2]), kernels, {})  # a prompt fills slot 2
        before = [getattr(layer, n).clone() for n in names]
        h = torch.randn(1, 48)
        results = []
        for context in (10, 100_000):
            for n, saved in zip(names, before):
                getattr(layer, n).copy_(saved)
            out = layer(h, _meta([1], [context], [2]), kernels, {})
            results.append([out] + [getattr(layer, n).clone() for n in names])
    assert [t.shape for t in before] == [t.shape for t in results[1][1:]]
    for a, b in zip(*results):
        assert torch.equal(a, b)
