"""npattn.torch.scaled_dot_product_attention == torch.nn.functional.scaled_dot_product_attention,
called the same way: the same arguments go to both, forward and backward, on the
parity tests' shapes (helpers.PEER_SHAPES), every mask kind and four dtypes.

Forward: helpers.assert_parity. Backward: helpers.assert_gradient_parity (the
adapter's gradients and PyTorch's autograd's against the float64 reference's).
torch.autograd.gradcheck checks the gradients in float64 by finite differences.
"""

import os
import warnings

import numpy as np
import pytest

import npattn
from helpers import (
    MASK_KINDS,
    PEER_SHAPES,
    ParityStats,
    assert_gradient_parity,
    assert_parity,
    assert_sigint_stops,
    f64,
    run_script,
)
from npattn import _interop, reference

torch = pytest.importorskip("torch")
nt = pytest.importorskip("npattn.torch")
F = torch.nn.functional
bias = pytest.importorskip("torch.nn.attention.bias")

from test_vs_torch import mask_for, tensors  # noqa: E402  (the parity tests' builders)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
STATS = ParityStats(lambda: f"torch {torch.__version__} (through npattn.torch)")
parity_summary = STATS.fixture()


def both(q, k, v, **kwargs):
    """(npattn.torch's result, PyTorch's) for the same call, GQA on when H_q != H_kv."""
    kwargs.setdefault("enable_gqa", q.dim() >= 3 and q.shape[-3] != k.shape[-3])
    return nt.scaled_dot_product_attention(q, k, v, **kwargs), F.scaled_dot_product_attention(q, k, v, **kwargs)


def lower_right(L, S):
    """PyTorch's bottom-right causal bias (which warns, wrongly since 2.5, of NaNs when L > S)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Lower right causal bias will produce NaNs", UserWarning)
        return bias.causal_lower_right(L, S)


def leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


# ---- parity: the same call to both, forward and backward ----


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("mask_kind", MASK_KINDS, ids=str)
@pytest.mark.parametrize("shape", list(PEER_SHAPES))
def test_equals_torch_forward_and_backward(rng, shape, mask_kind, dtype_name):
    """npattn.torch(q, k, v, **kw) == F.scaled_dot_product_attention(q, k, v, **kw) with
    kw PyTorch's spelling of each mask (is_causal, causal_lower_right, bool, float), and
    the gradients of both == the reference's."""
    batch, H_q, H_kv, L, S, D = PEER_SHAPES[shape]
    dtype = DTYPES[dtype_name]
    mask, torch_kwargs = mask_for(mask_kind, rng, batch, H_q, L, S, dtype)
    q, k, v = tensors(rng, batch, H_q, H_kv, L, S, D, dtype=dtype)
    mine_in, theirs_in = leaves(q, k, v), leaves(q, k, v)
    mine, _ = both(*mine_in, **torch_kwargs)
    _, theirs = both(*theirs_in, **torch_kwargs)
    assert type(mine) is torch.Tensor and mine.dtype == dtype and mine.shape == theirs.shape
    assert mine.grad_fn is not None
    assert_parity(_interop.asarray(mine.detach()), theirs.detach(), q, k, v, mask=mask, stats=STATS)
    dout = tensors(rng, batch, H_q, H_q, L, L, D, dtype=dtype)[0]
    grads_mine = torch.autograd.grad(mine, mine_in, dout)
    grads_theirs = torch.autograd.grad(theirs, theirs_in, dout)
    assert_gradient_parity(grads_mine, grads_theirs, q, k, v, dout, mask=mask)


# ---- gradcheck in float64 ----


GRADCHECK = {  # name: (q shape, k shape, v shape, keyword arguments)
    "gqa, is_causal, L < S": ((2, 4, 3, 5), (2, 2, 6, 5), (2, 2, 6, 3), {"is_causal": True, "enable_gqa": True}),
    "gqa, lower right, L > S": ((1, 4, 5, 4), (1, 2, 3, 4), (1, 2, 3, 4), {"lower_right": True, "enable_gqa": True}),
    "bool mask, broadcast batch": ((2, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 2), {"bool": True}),
    "float mask, scale": ((1, 3, 4, 3), (1, 3, 4, 3), (1, 3, 4, 3), {"float": True, "scale": 0.7}),
    "one key/value head, no gqa": ((2, 3, 2, 4), (2, 1, 5, 4), (2, 1, 5, 4), {}),
    "one query head, no gqa": ((1, 1, 2, 4), (1, 3, 5, 4), (1, 3, 5, 4), {}),
    "rank 3": ((3, 4, 5), (3, 6, 5), (3, 6, 2), {"is_causal": True}),
    "rank 2": ((4, 5), (6, 5), (6, 2), {}),
}


@pytest.mark.parametrize("case", list(GRADCHECK))
def test_gradcheck_float64(rng, case):
    """torch.autograd.gradcheck: the backward through npattn.sdpa_backward == finite
    differences of the forward, in float64 (true double in npattn)."""
    q_shape, k_shape, v_shape, options = GRADCHECK[case]
    q, k, v = (torch.from_numpy(rng.standard_normal(s)).requires_grad_(True) for s in (q_shape, k_shape, v_shape))
    L, S = q_shape[-2], k_shape[-2]
    kwargs = {key: val for key, val in options.items() if key in ("is_causal", "enable_gqa", "scale")}
    if options.get("lower_right"):
        kwargs["attn_mask"] = lower_right(L, S)
    if options.get("bool"):
        kwargs["attn_mask"] = torch.from_numpy(rng.random((L, S)) < 0.7)
        kwargs["attn_mask"][:, 0] = True
    if options.get("float"):
        kwargs["attn_mask"] = torch.from_numpy(rng.standard_normal((L, S)))

    def f(q, k, v):
        return nt.scaled_dot_product_attention(q, k, v, **kwargs)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6)
    want = F.scaled_dot_product_attention(q, k, v, **kwargs)
    np.testing.assert_allclose(f(q, k, v).detach().numpy(), want.detach().numpy(), rtol=0, atol=1e-13)


# ---- PyTorch's semantics, pinned ----


@pytest.mark.parametrize("L, S", [(3, 7), (7, 3), (1, 6)])
def test_is_causal_is_top_left_and_lower_right_bias_bottom_right(rng, L, S):
    """is_causal=True is top-left (npattn's "causal_top_left"), causal_lower_right(L, S)
    bottom-right (npattn's "causal"), as in PyTorch; the two differ when L != S."""
    q, k, v = tensors(rng, (2,), 4, 2, L, S, 8)
    top, want_top = both(q, k, v, is_causal=True)
    low, want_low = both(q, k, v, attn_mask=lower_right(L, S))
    np.testing.assert_allclose(top.numpy(), npattn.sdpa(q, k, v, mask="causal_top_left"), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(low.numpy(), npattn.sdpa(q, k, v, mask="causal"), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(top.numpy(), want_top.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(low.numpy(), want_low.numpy(), rtol=1e-5, atol=1e-6)
    assert not np.allclose(top.numpy(), low.numpy(), rtol=1e-3, atol=1e-3)


def test_upper_left_bias_is_is_causal(rng):
    q, k, v = tensors(rng, (1,), 2, 2, 5, 3, 4)
    got, want = both(q, k, v, attn_mask=bias.causal_upper_left(5, 3))
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got.numpy(), nt.scaled_dot_product_attention(q, k, v, is_causal=True).numpy())


@pytest.mark.parametrize("H_q, H_kv", [(4, 1), (1, 4)])
def test_heads_broadcast_without_gqa(rng, H_q, H_kv):
    """Without enable_gqa, a head dim of 1 broadcasts against the other, as in PyTorch
    (one key/value head for all queries, or one query head against every key head)."""
    q, k, v = tensors(rng, (2,), H_q, H_kv, 3, 5, 8)
    mine_in, theirs_in = leaves(q, k, v), leaves(q, k, v)
    mine, _ = both(*mine_in, enable_gqa=False)
    _, theirs = both(*theirs_in, enable_gqa=False)
    assert mine.shape == theirs.shape == (2, max(H_q, H_kv), 3, 8)
    np.testing.assert_allclose(mine.detach().numpy(), theirs.detach().numpy(), rtol=1e-5, atol=1e-6)
    dout = torch.ones_like(mine)
    for a, b in zip(torch.autograd.grad(mine, mine_in, dout), torch.autograd.grad(theirs, theirs_in, dout)):
        assert a.shape == b.shape
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)


def test_bool_mask_true_attends_and_float_mask_adds(rng):
    """A bool attn_mask: True = attend (False hides); a float one is added to the scores."""
    q, k, v = tensors(rng, (1,), 2, 2, 3, 5, 4)
    visible = torch.from_numpy(rng.random((3, 5)) < 0.6)
    visible[:, 0] = True
    added = torch.from_numpy(rng.standard_normal((2, 3, 5), dtype=np.float32))
    for mask, npattn_mask in [(visible, visible.numpy()), (added, added.numpy())]:
        got, want = both(q, k, v, attn_mask=mask)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got.numpy(), npattn.sdpa(q, k, v, mask=npattn_mask))


def test_row_that_sees_no_key_is_zero_and_its_gradient_too(rng):
    """A row a bool mask hides from every key is 0 in both, and gets no gradient."""
    q, k, v = leaves(*tensors(rng, (1,), 2, 2, 3, 5, 4))
    visible = torch.ones(3, 5, dtype=torch.bool)
    visible[1] = False
    out = nt.scaled_dot_product_attention(q, k, v, attn_mask=visible)
    assert (out[:, :, 1] == 0).all()
    out.sum().backward()
    assert (q.grad[:, :, 1] == 0).all() and torch.isfinite(k.grad).all()


@pytest.mark.parametrize("L, S", [(0, 4), (3, 0), (0, 0)])
def test_empty_sizes(rng, L, S):
    """No queries or no keys: the reference's zeros, and zero gradients."""
    q, k, v = leaves(*tensors(rng, (1,), 2, 1, L, S, 4))
    out = nt.scaled_dot_product_attention(q, k, v)
    assert out.shape == (1, 2, L, 4)
    np.testing.assert_array_equal(
        out.detach().numpy(), reference.sdpa(f64(q.detach()), f64(k.detach()), f64(v.detach()), mask=None)
    )
    out.sum().backward()
    assert all((t.grad == 0).all() for t in (q, k, v))


# ---- results, memory and autograd ----


def test_no_grad_gives_a_plain_tensor(rng):
    """Without an input that requires grad, or under torch.no_grad, no graph is built."""
    q, k, v = tensors(rng, (1,), 2, 2, 3, 5, 4)
    assert nt.scaled_dot_product_attention(q, k, v).grad_fn is None
    with torch.no_grad():
        assert nt.scaled_dot_product_attention(q.requires_grad_(True), k, v).grad_fn is None


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16", "float64"])
def test_results_share_numpys_memory(dtype_name):
    """npattn's NumPy result becomes a tensor without a copy: bfloat16 through its 16 bits."""
    a = npattn.sdpa(*(np.ones((2, 3, 4), npattn._interop.bfloat16() if dtype_name == "bfloat16" else dtype_name),) * 3)
    t = npattn._interop.to_torch(a)
    assert t.dtype == DTYPES[dtype_name] and t.shape == a.shape
    assert t.data_ptr() == a.ctypes.data
    np.testing.assert_array_equal(t.float().numpy(), np.asarray(a, np.float32))


def test_output_modified_in_place_is_caught(rng):
    """The forward saves its output for the backward: changing it in place makes the
    backward fail loudly (PyTorch's version check), rather than give wrong gradients."""
    q, k, v = leaves(*tensors(rng, (1,), 2, 2, 3, 5, 4))
    out = nt.scaled_dot_product_attention(q, k, v)
    out.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_second_derivative_is_refused(rng):
    """The backward is not itself differentiable: asking for a second derivative fails."""
    q, k, v = leaves(*tensors(rng, (1,), 2, 2, 3, 5, 4))
    out = nt.scaled_dot_product_attention(q, k, v)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        dq.sum().backward()


# ---- errors ----


def test_errors_name_the_argument(rng):
    q, k, v = tensors(rng, (1,), 4, 2, 3, 5, 8)
    call = nt.scaled_dot_product_attention
    cases = [
        (lambda: call(q, k, v, dropout_p=0.1), ValueError, "dropout_p"),
        (
            lambda: call(q, k, v, attn_mask=torch.ones(3, 5, dtype=torch.bool), is_causal=True, enable_gqa=True),
            ValueError,
            "attn_mask",
        ),
        (lambda: call(q, k.double(), v), TypeError, "same dtype"),
        (lambda: call(q, k, v), ValueError, "enable_gqa"),
        (lambda: call(q, k[:, :1], v, enable_gqa=True), ValueError, "enable_gqa"),
        (lambda: call(q, k, v, enable_gqa=True, attn_mask=lower_right(3, 4)), ValueError, "S=5"),
        (lambda: call(q.numpy(), k, v), TypeError, "query"),
        (lambda: call(q, k, v, enable_gqa=True, attn_mask=torch.zeros(3, 5).requires_grad_(True)), ValueError, "grad"),
        (lambda: call(q, k, v, enable_gqa=True, attn_mask=np.ones((3, 5), bool)), TypeError, "attn_mask"),
        (lambda: call(q, k, v, enable_gqa=True, attn_mask=torch.zeros(3, 5, dtype=torch.int32)), TypeError, "mask"),
        (lambda: call(q, k, v, enable_gqa=True, is_causal=1), TypeError, "is_causal"),
    ]
    for fn, exception, text in cases:
        with pytest.raises(exception, match=text):
            fn()


def test_parameters_are_tensors(rng):
    """torch.nn.Parameter, a Tensor subclass (what a model's weights are), is read as a
    tensor, by npattn.sdpa and through the adapter's autograd."""
    q, k, v = tensors(rng, (1,), 2, 2, 3, 5, 4)
    weights = [torch.nn.Parameter(t.clone()) for t in (q, k, v)]
    np.testing.assert_array_equal(npattn.sdpa(*weights, threads=1), npattn.sdpa(q, k, v, threads=1))
    out = nt.scaled_dot_product_attention(*weights)
    out.sum().backward()
    assert all(w.grad is not None and w.grad.shape == w.shape for w in weights)


# ---- one set of threads: PyTorch's ----

THREADS_SCRIPT = r"""
import os
import numpy as np
import torch
import npattn
import npattn.torch

torch.set_num_threads(2)
torch.randn(512, 512).exp().sum()  # a parallel region: PyTorch's OpenMP team exists
tasks = lambda: len(os.listdir("/proc/self/task"))
q, k, v = (torch.randn(2, 4, 200, 64) for _ in range(3))
before = tasks()
npattn.torch.sdpa(q, k, v, threads=2)
through_torch = tasks()
npattn.sdpa(q.numpy(), k.numpy(), v.numpy(), threads=2)
print(npattn.torch.SHARES_TORCH_THREADS, through_torch - before, tasks() - through_torch)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_calls_through_the_adapter_run_on_torchs_threads():
    """In a fresh process: a call through npattn.torch starts no thread (its helpers are
    PyTorch's OpenMP team); the same call through npattn.sdpa starts npattn's helper."""
    proc = run_script(THREADS_SCRIPT)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    shares, new_through_torch, new_through_npattn = proc.stdout.split()
    if shares != "True":
        pytest.skip("this PyTorch does not run on an OpenMP runtime npattn can share")
    assert (new_through_torch, new_through_npattn) == ("0", "1")


@pytest.mark.parametrize(
    "shape, dtype_name",
    [(((2, 16, 300, 64), (2, 8, 900, 64)), "float32"), (((1, 16, 1, 128), (1, 8, 8192, 128)), "float32"),
     (((1, 16, 1, 128), (1, 8, 4096, 128)), "bfloat16"), (((3, 4, 40, 32), (3, 4, 40, 32)), "float64")],
    ids=["prefill", "split decode", "bfloat16 decode", "float64"],
)  # fmt: skip
def test_results_on_torchs_threads_equal_npattns_own(rng, shape, dtype_name):
    """On PyTorch's threads or on npattn's pool, the same bits (and the gradients too)."""
    (q_shape, k_shape), dtype = shape, DTYPES[dtype_name]
    q = torch.from_numpy(rng.standard_normal(q_shape)).to(dtype)
    k, v = (torch.from_numpy(rng.standard_normal(k_shape)).to(dtype) for _ in range(2))
    got = nt.sdpa(q, k, v, threads=3)
    want = npattn.sdpa(*(_interop.asarray(t) for t in (q, k, v)), threads=3)
    np.testing.assert_array_equal(_interop.asarray(got), want)
    q.requires_grad_(True)
    out, lse = npattn.sdpa(*(_interop.asarray(t.detach()) for t in (q, k, v)), return_lse=True, threads=3)
    dout = torch.ones_like(got)
    (dq,) = torch.autograd.grad(nt.sdpa(q, k, v, threads=3), q, dout)
    want_dq = npattn.sdpa_backward(
        *(_interop.asarray(t.detach()) for t in (dout, q, k, v)), out, lse, threads=3
    ).dq  # fmt: skip
    np.testing.assert_array_equal(_interop.asarray(dq), want_dq)


INTERRUPTED_ON_TORCH_THREADS = r"""
import time
import numpy as np
import torch
import npattn
import npattn.torch

torch.set_num_threads(2)
q = torch.randn(2, 32, 4096, 128)
k, v = torch.randn(2, 8, 4096, 128), torch.randn(2, 8, 4096, 128)
print("start", time.monotonic(), flush=True)
try:
    npattn.torch.sdpa(q, k, v, mask=None, threads=2)
    print("finished", time.monotonic(), flush=True)
except KeyboardInterrupt:
    print("interrupted", time.monotonic(), flush=True)
q, k, v = (np.random.default_rng(0).standard_normal(s) for s in [(2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 6)])
got = npattn.torch.sdpa(*(torch.from_numpy(x) for x in (q, k, v))).numpy()
print("second", bool(np.allclose(got, npattn.reference.sdpa(q, k, v), rtol=0, atol=1e-12)), flush=True)
"""


@pytest.mark.skipif(os.name != "posix", reason="sends SIGINT to a subprocess")
def test_sigint_stops_a_call_on_torchs_threads():
    """Ctrl-C stops a long call through npattn.torch, on PyTorch's threads, within 0.5 s."""
    assert_sigint_stops(INTERRUPTED_ON_TORCH_THREADS, after=1.0)
