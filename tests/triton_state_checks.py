"""The Triton state kernels (kvflow/model/triton/state_update.py, state_scan.py) against the
PyTorch paths of the state layers: the causal conv over decodes and prompt chunks with their
snapshots, Gated DeltaNet's recurrent step and Mamba2's selective state update, and both
scanned over prompt chunks, on states in scattered slots; and the three layers' steps
(prompts in chunks, snapshots, decodes) with them wired in as on a GPU. Run as its own pytest process (tests/test_triton_state.py): on CPU
through Triton's interpreter, which must be on before triton is first imported; with
KERNEL_CHECKS_DEVICE=cuda the same checks run compiled on a GPU."""
from __future__ import annotations

import os
import sys

DEVICE = os.environ.get("KERNEL_CHECKS_DEVICE", "cpu")
if DEVICE == "cpu":
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported without TRITON_INTERPRET=1; run this file in "
                           "its own process (tests/test_triton_state.py does)")
    os.environ["TRITON_INTERPRET"] = "1"

from dataclasses import replace  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kvflow.layers.causal_conv import causal_conv1d  # noqa: E402
from kvflow.layers.gated_deltanet import GatedDeltaNet, l2norm, recurrent_gated_delta_rule  # noqa: E402
from kvflow.layers.mamba2 import Mamba2, recurrent_scan  # noqa: E402
from kvflow.layers.short_conv import ShortConv  # noqa: E402
from kvflow.model.kernels import KernelOptions, select_kernels  # noqa: E402

F32_TOL = dict(atol=1e-5, rtol=1e-5)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)  # a bf16 rounding either side
ROWS, SLOTS = np.array([0, 2, 3]), np.array([5, 1, 3])  # three decodes of five rows, scattered slots


@pytest.fixture(scope="module")
def su():
    from kvflow.model.triton import state_scan, state_update
    if DEVICE == "cpu":
        from triton.runtime.interpreter import InterpretedFunction
        assert isinstance(state_update._gdn_decode_kernel, InterpretedFunction)
    return state_scan.ops()


def _dev(*ts):
    return [t.to(DEVICE) for t in ts]


# a decode, a prompt chunk with a snapshot inside it, a decode whose snapshot is its token,
# and a chunk shorter than the window
LENS, CONV_SLOTS, SAVES = np.array([1, 6, 1, 2]), np.array([5, 1, 3, 4]), {1: (2, 0), 2: (0, 6)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel_size,bias,silu", [(4, False, True), (3, True, False)])
@pytest.mark.parametrize("saves", [SAVES, {}], ids=["snapshots", "none"])
def test_conv_matches_the_reference_over_decodes_chunks_and_snapshots(su, dtype, kernel_size, bias,
                                                                      silu, saves):
    g = torch.Generator().manual_seed(0)
    c = 300  # past one 256-channel block
    starts = np.concatenate([[0], np.cumsum(LENS)])
    state = torch.randn(8, kernel_size - 1, c, generator=g).to(dtype)
    weight = torch.randn(c, kernel_size, generator=g).to(dtype)
    b = torch.randn(c, generator=g).to(dtype) if bias else None
    x = torch.randn(int(starts[-1]), c + 20, generator=g).to(dtype)[:, 7:7 + c]  # strided rows
    ref_state = state.clone()
    ref = causal_conv1d(ref_state, weight, b, x, starts, LENS, torch.from_numpy(CONV_SLOTS), saves)
    ref = F.silu(ref) if silu else ref
    state_d, weight_d, x_d = _dev(state, weight, x)
    got = su.causal_conv(state_d, weight_d, None if b is None else b.to(DEVICE), x_d, starts, LENS,
                         CONV_SLOTS, saves, silu)
    assert torch.equal(state_d.cpu(), ref_state)  # windows and snapshots: copies, exact
    torch.testing.assert_close(got.cpu(), ref, **(F32_TOL if dtype == torch.float32 else BF16_TOL))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dk,dv", [(32, 36), (16, 64)])  # dv 36: a partial column block
def test_gated_delta_step_matches_the_recurrence(su, dtype, dk, dv):
    g = torch.Generator().manual_seed(1)
    nk, nv, t = 2, 4, 5
    x = torch.randn(t, 2 * nk * dk + nv * dv, generator=g).to(dtype)
    ba = torch.randn(t, 3 + 2 * nv, generator=g).to(dtype)[:, 3:]
    a_log, dt_bias = torch.randn(nv, generator=g) * 0.5, torch.randn(nv, generator=g)
    state = torch.randn(7, nv, dk, dv, generator=g)
    r, s = torch.from_numpy(ROWS), torch.from_numpy(SLOTS)
    q, k, v = x[r].float().split([nk * dk, nk * dk, nv * dv], dim=-1)
    q = (l2norm(q.view(3, nk, dk)) * dk ** -0.5).repeat_interleave(nv // nk, 1)
    k = l2norm(k.view(3, nk, dk)).repeat_interleave(nv // nk, 1)
    b, a = ba[r].split(nv, dim=-1)
    ref_state = state.clone()
    gathered = ref_state[s]
    ref = recurrent_gated_delta_rule(q, k, v.view(3, nv, dv), -a_log.exp() * F.softplus(a.float() + dt_bias),
                                     b.sigmoid().float(), gathered)
    ref_state[s] = gathered
    x_d, ba_d, state_d = _dev(x, ba, state)
    out = torch.full((t, nv, dv), float("nan"), device=DEVICE)
    su.gated_delta_decode(x_d, ba_d, a_log.to(DEVICE), dt_bias.to(DEVICE), state_d, ROWS, SLOTS, out, nk)
    torch.testing.assert_close(out.cpu()[ROWS], ref, **F32_TOL)
    torch.testing.assert_close(state_d.cpu(), ref_state, **F32_TOL)  # the others' slots untouched
    assert out.cpu()[[1, 4]].isnan().all()  # other rows are not written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.05, 0.4)])
@pytest.mark.parametrize("p,n", [(24, 40), (16, 64)])  # p 24: a partial row block
def test_ssm_step_matches_the_recurrence(su, dtype, limit, p, n):
    g = torch.Generator().manual_seed(2)
    nh, groups, t = 4, 2, 5
    x = torch.randn(t, nh * p + 2 * groups * n, generator=g).to(dtype)
    dt = torch.randn(t, 5 + nh, generator=g).to(dtype)[:, 5:]
    a_log, dt_bias = torch.randn(nh, generator=g) * 0.5, torch.randn(nh, generator=g)
    state = torch.randn(7, nh, p, n, generator=g)
    r, s = torch.from_numpy(ROWS), torch.from_numpy(SLOTS)
    xs, b, c = x[r].float().split([nh * p, groups * n, groups * n], dim=-1)
    b, c = (y.view(3, groups, n).repeat_interleave(nh // groups, 1) for y in (b, c))
    ref_state = state.clone()
    gathered = ref_state[s]
    ref = recurrent_scan(xs.view(3, nh, p), F.softplus(dt[r].float() + dt_bias).clamp(*limit),
                         -a_log.exp(), b, c, gathered)
    ref_state[s] = gathered
    x_d, dt_d, state_d = _dev(x, dt, state)
    y = torch.full((t, nh, p), float("nan"), device=DEVICE)
    su.ssm_decode(x_d, dt_d, a_log.to(DEVICE), dt_bias.to(DEVICE), state_d, ROWS, SLOTS, y, groups, limit)
    torch.testing.assert_close(y.cpu()[ROWS], ref, **F32_TOL)
    torch.testing.assert_close(state_d.cpu(), ref_state, **F32_TOL)


# three prompt chunks in scattered slots (one a single token), snapshots inside two
CHUNK_LENS, CHUNK_SLOTS, CHUNK_SAVES = np.array([37, 1, 20]), np.array([5, 1, 3]), {0: (33, 0), 2: (9, 6)}


def _token_by_token(lens, slots, saves, step):
    """Each chunk's tokens through `step(row, slot)` in order, snapshots copied as asked."""
    starts = np.concatenate([[0], np.cumsum(lens)])
    for i, slot in enumerate(slots):
        for n, row in enumerate(range(starts[i], starts[i + 1])):
            step(row, slot)
            if i in saves and saves[i][0] == n:
                yield saves[i][1], slot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dk,dv", [(32, 36), (16, 64)])
def test_gated_delta_chunks_match_the_recurrence_token_by_token(su, dtype, dk, dv):
    g = torch.Generator().manual_seed(11)
    nk, nv = 2, 4
    t = int(CHUNK_LENS.sum())
    x = torch.randn(t, 2 * nk * dk + nv * dv + 9, generator=g).to(dtype)[:, 9:]
    ba = torch.randn(t, 3 + 2 * nv, generator=g).to(dtype)[:, 3:]
    a_log, dt_bias = torch.randn(nv, generator=g) * 0.5, torch.randn(nv, generator=g)
    state = torch.randn(7, nv, dk, dv, generator=g) * 0.3
    ref_state, ref = state.clone(), torch.full((t, nv, dv), float("nan"))
    xf = x.float()
    q, k, v = xf.split([nk * dk, nk * dk, nv * dv], dim=-1)
    q = (l2norm(q.view(t, nk, dk)) * dk ** -0.5).repeat_interleave(nv // nk, 1)
    k = l2norm(k.view(t, nk, dk)).repeat_interleave(nv // nk, 1)
    b, a = ba.split(nv, dim=-1)
    gate, beta = -a_log.exp() * F.softplus(a.float() + dt_bias), b.sigmoid().float()

    def step(row, slot):
        s = ref_state[slot:slot + 1]  # a view: updated in place
        ref[row] = recurrent_gated_delta_rule(q[row:row + 1], k[row:row + 1], v[row:row + 1].view(1, nv, dv),
                                              gate[row:row + 1], beta[row:row + 1], s)[0]
    for snap, slot in _token_by_token(CHUNK_LENS, CHUNK_SLOTS, CHUNK_SAVES, step):
        ref_state[snap] = ref_state[slot]
    x_d, ba_d, state_d = _dev(x, ba, state)
    out = torch.full((t, nv, dv), float("nan"), device=DEVICE)
    su.gated_delta_chunks(x_d, ba_d, a_log.to(DEVICE), dt_bias.to(DEVICE), state_d,
                          np.concatenate([[0], np.cumsum(CHUNK_LENS)]), CHUNK_LENS, CHUNK_SLOTS,
                          CHUNK_SAVES, out, nk)
    torch.testing.assert_close(out.cpu(), ref, **F32_TOL)
    torch.testing.assert_close(state_d.cpu(), ref_state, **F32_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p,n", [(24, 40), (16, 64)])
def test_ssm_chunks_match_the_recurrence_token_by_token(su, dtype, p, n):
    g = torch.Generator().manual_seed(12)
    nh, groups, limit = 4, 2, (0.05, 0.4)
    t = int(CHUNK_LENS.sum())
    x = torch.randn(t, nh * p + 2 * groups * n, generator=g).to(dtype)
    dt = torch.randn(t, 5 + nh, generator=g).to(dtype)[:, 5:]
    a_log, dt_bias = torch.randn(nh, generator=g) * 0.5, torch.randn(nh, generator=g)
    state = torch.randn(7, nh, p, n, generator=g)
    ref_state, ref = state.clone(), torch.full((t, nh, p), float("nan"))
    xs, b, c = x.float().split([nh * p, groups * n, groups * n], dim=-1)
    b, c = (y.view(t, groups, n).repeat_interleave(nh // groups, 1) for y in (b, c))
    d = F.softplus(dt.float() + dt_bias).clamp(*limit)

    def step(row, slot):
        ref[row] = recurrent_scan(xs[row:row + 1].view(1, nh, p), d[row:row + 1], -a_log.exp(),
                                  b[row:row + 1], c[row:row + 1], ref_state[slot:slot + 1])[0]
    for snap, slot in _token_by_token(CHUNK_LENS, CHUNK_SLOTS, CHUNK_SAVES, step):
        ref_state[snap] = ref_state[slot]
    x_d, dt_d, state_d = _dev(x, dt, state)
    y = torch.full((t, nh, p), float("nan"), device=DEVICE)
    su.ssm_chunks(x_d, dt_d, a_log.to(DEVICE), dt_bias.to(DEVICE), state_d,
                  np.concatenate([[0], np.cumsum(CHUNK_LENS)]), CHUNK_LENS, CHUNK_SLOTS, CHUNK_SAVES,
                  y, groups, limit)
    torch.testing.assert_close(y.cpu(), ref, **F32_TOL)
    torch.testing.assert_close(state_d.cpu(), ref_state, **F32_TOL)


LAYERS = {
    "short_conv": lambda: ShortConv(48, 3, True, torch.float32),
    "gated_deltanet": lambda: GatedDeltaNet(48, 2, 4, 16, 24, 4, 1e-6, torch.float32),
    "mamba2": lambda: Mamba2(48, 4, 16, 32, 2, 4, 1e-5, True, False, (0.0, float("inf")), torch.float32),
}


def _meta(lens, seq_lens, slots, saves=None):
    lens = np.asarray(lens, dtype=np.int64)
    return SimpleNamespace(query_lens=lens, seq_lens=np.asarray(seq_lens, dtype=np.int64),
                           query_start_loc=np.concatenate([[0], np.cumsum(lens)]),
                           state_slots=np.asarray(slots, dtype=np.int64), state_saves=saves)


# a prompt arrives in two chunks (a snapshot inside the second), another is one token long,
# then all decode (a snapshot at one's token); slots scattered
STEPS = [([5, 1], [5, 1], [3, 0], None), ([4, 1, 1], [9, 2, 1], [3, 0, 5], {0: (1, 6)}),
         ([1, 1, 1], [10, 3, 2], [3, 0, 5], {2: (0, 7)})]


@pytest.mark.parametrize("name", list(LAYERS))
def test_a_layers_steps_with_the_triton_kernels_match_its_torch_path(su, name):
    """Prompts in chunks, snapshots, decodes: the layer with the Triton kernels wired in as on
    a GPU gives its PyTorch path's outputs and states."""
    torch.manual_seed(3)
    layer = LAYERS[name]()
    with torch.no_grad():
        for prm in layer.parameters():
            prm.copy_(torch.randn_like(prm) * 0.3)
        if hasattr(layer, "A_log"):
            layer.A_log.uniform_(-1.0, 0.5)
    torch_kernels = replace(select_kernels(torch.float32, options=KernelOptions(c_kernels=False)),
                            state_isa=None)
    results = []
    for kernels in (torch_kernels, replace(torch_kernels, state_triton=su)):
        layer.allocate_state(8, torch.float32)
        layer.to(DEVICE)
        g = torch.Generator().manual_seed(4)
        outs = []
        with torch.no_grad():
            for lens, seq_lens, slots, saves in STEPS:
                h = torch.randn(sum(lens), 48, generator=g).to(DEVICE)
                outs.append(layer(h, _meta(lens, seq_lens, slots, saves), kernels, {}).cpu())
        results.append(outs + [getattr(layer, n).cpu().clone() for n in ("state", "conv_state", "recurrent_state")
                               if getattr(layer, n, None) is not None])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **F32_TOL)
