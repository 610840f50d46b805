"""npattn.testing.assert_attention_grads_close passes right gradients, of npattn, MLX and
PyTorch, over many seeds, shapes and dtypes; and names each usual mistake of a backward
pass, planted in a student's NumPy backward written by hand (the chain rule step by
step, independent of the checker's own), whatever library holds the result. And
assert_attention_close names the transposed layout (B, L, H, D)."""

import numpy as np
import pytest

import npattn
from helpers import dtype_of, f64, qkv, random_problem
from npattn.testing import assert_attention_close, assert_attention_grads_close

SEEDS = range(120)


def failure(grads, dout, q, k, v, **kwargs):
    """The message of the AssertionError assert_attention_grads_close raises."""
    with pytest.raises(AssertionError) as info:
        assert_attention_grads_close(grads, dout, q, k, v, **kwargs)
    return str(info.value)


# ---- right gradients pass ----


@pytest.mark.parametrize("seed", SEEDS)
def test_npattns_gradients_pass_on_random_problems(seed):
    """npattn.sdpa_backward's gradients, on random problems of the whole contract (ranks,
    broadcast batch dims, GQA, every mask kind, sinks, window, softcap, positions, key
    ranges, layouts, four dtypes), pass: a right result is never failed."""
    rng = np.random.default_rng(seed)
    q, k, v, kwargs = random_problem(rng, codes=False)  # no gradient through codes
    options = {key: val for key, val in kwargs.items() if key not in ("return_lse", "out", "threads")}
    out, lse = npattn.sdpa(q, k, v, return_lse=True, **options)
    dout = rng.standard_normal(out.shape).astype(out.dtype)
    grads = npattn.sdpa_backward(dout, q, k, v, out, lse, **options)
    options.pop("precision", None)
    assert_attention_grads_close(grads, dout, q, k, v, **options)


def peer_problem(rng, dtype):
    """(q, k, v, dout, mask) in NumPy, (B, H, L, D), GQA and L <= S or no mask."""
    B, H_kv = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    H_q = H_kv * int(rng.integers(1, 4))
    L, S, D = int(rng.integers(1, 12)), int(rng.integers(1, 20)), int(rng.choice([4, 16, 64]))
    q, k, v = qkv(rng, (B,), H_q, H_kv, L, S, D, dtype=dtype_of(dtype))
    dout = rng.standard_normal((B, H_q, L, D)).astype(dtype_of(dtype))
    return q, k, v, dout, ("causal" if L <= S and rng.random() < 0.7 else None)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_mlx_gradients_pass(seed, dtype):
    """MLX's own gradients (mx.vjp of mx.fast.scaled_dot_product_attention, on the CPU)
    pass, in MLX arrays: half-precision ones within the half type's rounding of the
    weights and dS before their products."""
    mx = pytest.importorskip("mlx.core")
    q, k, v, dout, mask = peer_problem(np.random.default_rng(seed), dtype)
    xs = [mx.array(np.asarray(x, np.float32)).astype(getattr(mx, dtype)) for x in (q, k, v, dout)]
    scale = q.shape[-1] ** -0.5

    def attention(q_, k_, v_):
        return mx.fast.scaled_dot_product_attention(q_, k_, v_, scale=scale, mask=mask, stream=mx.cpu)

    _, grads = mx.vjp(attention, xs[:3], [xs[3]])
    assert_attention_grads_close(grads, xs[3], *xs[:3], mask=mask)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_pytorch_gradients_pass(seed, dtype):
    """PyTorch's autograd gradients of F.scaled_dot_product_attention pass, as tensors."""
    torch = pytest.importorskip("torch")
    from torch.nn.attention.bias import causal_lower_right

    q, k, v, dout, mask = peer_problem(np.random.default_rng(seed), dtype)
    tensors = [torch.tensor(f64(x)).to(getattr(torch, dtype)) for x in (q, k, v, dout)]
    leaves = [t.clone().requires_grad_() for t in tensors[:3]]
    bias = causal_lower_right(q.shape[-2], k.shape[-2]) if mask else None
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=bias, enable_gqa=True)
    out.backward(tensors[3])
    assert_attention_grads_close([t.grad for t in leaves], tensors[3], *tensors[:3], mask=mask)


# ---- a student's backward pass by hand, with one planted mistake ----


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def student_backward(dout, q, k, v, causal=True, mistake=None):
    """The gradients of sum(dout * attention) the way a student derives them: GQA by
    repeating k and v, P = softmax(scores), then dV, dP, dS, dQ, dK; `mistake` is the
    one step written wrong."""
    H_q, L, D = q.shape[-3:]
    H_kv, S = k.shape[-3], k.shape[-2]
    n = H_q // H_kv
    kr, vr = np.repeat(k, n, axis=-3), np.repeat(v, n, axis=-3)
    scale = D**-0.5
    scores = q @ kr.swapaxes(-1, -2) * scale
    hidden = ~np.tril(np.ones((L, S), dtype=bool), k=S - L) if causal else np.zeros((L, S), bool)
    logits = np.where(hidden, -np.inf, scores)
    P = softmax(logits)
    out = P @ vr
    if mistake == "mask forgotten":  # P recomputed in the backward from the saved log-sum-exp, unmasked
        lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) + logits.max(
            -1, keepdims=True
        )
        P = np.exp(scores - lse)
    dv = P.swapaxes(-1, -2) @ dout
    dP = dout @ vr.swapaxes(-1, -2)
    if mistake == "D missing":
        dS = P * dP
    elif mistake == "D from dP":
        dS = P * (dP - dP.sum(-1, keepdims=True))
    elif mistake == "D from the unnormalised output":
        unnormalised = np.exp(logits - logits.max(-1, keepdims=True)) @ vr  # the forward loop's O, before / l
        dS = P * (dP - (dout * unnormalised).sum(-1, keepdims=True))
    else:
        dS = P * (dP - (dout * out).sum(-1, keepdims=True))
    dq = dS @ kr * (1.0 if mistake in ("scale missing", "scale missing from dq") else scale)
    dk = dS.swapaxes(-1, -2) @ q * (1.0 if mistake == "scale missing" else scale)
    if mistake == "GQA not summed":
        return dq, dk, dv
    if mistake == "first head of each group":
        return dq, dk[..., ::n, :, :], dv[..., ::n, :, :]
    grouped = (x.reshape(*x.shape[:-3], H_kv, n, *x.shape[-2:]) for x in (dk, dv))
    if mistake == "GQA interleaved":
        grouped = (x.reshape(*x.shape[:-3], n, H_kv, *x.shape[-2:]).swapaxes(-3, -4) for x in (dk, dv))
    dk, dv = (x.sum(axis=-3) for x in grouped)
    if mistake == "group mean":
        dk, dv = dk / n, dv / n
    if mistake == "dk and dv swapped":
        return dq, dv, dk
    return dq, dk, dv


PLANTED = {  # mistake: (the gradients it makes wrong, what the message must say)
    "D missing": (["dq", "dk"], "the softmax's D_i term missing"),
    "D from dP": (["dq", "dk"], "D_i taken as the plain row sum of dP"),
    "D from the unnormalised output": (["dq", "dk"], "D_i taken from the wrong output"),
    "scale missing": (["dq", "dk"], "the scale (0.3536) missing from dq and dk"),
    "scale missing from dq": (["dq"], "the scale (0.3536) missing from dq: dS K unscaled"),
    "mask forgotten": (["dq", "dk", "dv"], "the mask forgotten in the backward"),
    "GQA not summed": (["dk", "dv"], "GQA groups not summed into their key/value head"),
    "first head of each group": (["dk", "dv"], "only the first query head of each group kept"),
    "group mean": (["dk", "dv"], "each group's mean instead of its sum"),
    "GQA interleaved": (["dk", "dv"], "GQA groups interleaved: query head h summed into key/value head h % H_kv"),
    "dk and dv swapped": (["dk", "dv"], "dk and dv swapped: dk is dv of these inputs"),
}


def planted(mistake, dtype=np.float32):
    """(the student's gradients, dout, q, k, v): 6 query heads over 2, L 5 < S 9, D 8, a batch of 2."""
    rng = np.random.default_rng(len(mistake))
    q, k, v = qkv(rng, (2,), 6, 2, 5, 9, 8, dtype=np.float64)
    dout = rng.standard_normal((2, 6, 5, 8))
    if mistake == "GQA interleaved":  # H_kv = 3 over 6 query heads: h % 3 and h // 2 differ
        k, v = (rng.standard_normal((2, 3, 9, 8)) for _ in range(2))
    grads = student_backward(dout, q, k, v, mistake=mistake)
    return [g.astype(dtype) for g in grads], *(x.astype(dtype) for x in (dout, q, k, v))


@pytest.mark.parametrize("mistake", PLANTED)
def test_each_planted_mistake_is_named(mistake):
    """The gradient a mistake makes wrong fails, and the message names the mistake;
    the gradients it leaves right are said to be within tolerance."""
    grads, dout, q, k, v = planted(mistake)
    message = failure(grads, dout, q, k, v)
    wrong, says = PLANTED[mistake]
    assert message.startswith("attention gradients differ from the float64 reference: " + ", ".join(wrong)), message
    for name in wrong:
        assert f"  {name} matches, within tolerance, " in message, message
    assert says in message, message
    right = [n for n in ("dq", "dk", "dv") if n not in wrong]
    if right:
        assert f"(within tolerance: {', '.join(right)})" in message, message


def test_the_students_right_backward_passes():
    """The student's backward without a mistake passes, GQA groups of 2 and of 3."""
    grads, dout, q, k, v = planted("none")
    assert_attention_grads_close(grads, dout, q, k, v)
    grads, dout, q, k, v = planted("GQA interleaved")
    q64 = f64(q)
    assert_attention_grads_close(student_backward(f64(dout), q64, f64(k), f64(v)), dout, q, k, v)


@pytest.mark.parametrize("library", ["mlx", "torch"])
@pytest.mark.parametrize("mistake", ["D missing", "scale missing from dq", "mask forgotten", "dk and dv swapped"])
def test_mistakes_are_named_in_mlx_and_pytorch_arrays(library, mistake):
    """The same gradients held by MLX or PyTorch: the same mistake named."""
    grads, dout, q, k, v = planted(mistake)
    if library == "mlx":
        mx = pytest.importorskip("mlx.core")
        convert = mx.array
    else:
        torch = pytest.importorskip("torch")
        convert = torch.from_numpy
    message = failure([convert(g) for g in grads], *(convert(x) for x in (dout, q, k, v)))
    assert PLANTED[mistake][1] in message, message


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mistakes_are_named_in_half_precision(dtype):
    """A half-precision result's wider tolerance still tells the mistakes apart."""
    for mistake in ("D missing", "scale missing from dq", "group mean"):
        grads, dout, q, k, v = planted(mistake, dtype_of(dtype))
        message = failure(grads, dout, q, k, v)
        assert PLANTED[mistake][1] in message, (mistake, message)


def test_the_message_locates_the_worst_element():
    """Each failing gradient: its count, the worst element with both values, the tolerance,
    per head; then what was checked against."""
    grads, dout, q, k, v = planted("scale missing from dq")
    message = failure(grads, dout, q, k, v)
    assert message.startswith("attention gradients differ from the float64 reference: dq (within tolerance: dk, dv)")
    assert "\ndq: " in message and " of 480 elements beyond tolerance" in message, message
    assert "worst at batch " in message and ": actual " in message and ", reference " in message, message
    assert "(npattn.testing.backward_tolerance)" in message and "failing elements per head: " in message, message
    assert "checked against npattn.reference.sdpa_backward in float64" in message, message


def test_sinks_gradients_are_checked_and_the_d_term_named():
    """dsinks is checked where given; a missing D_i term makes it 0, and is named there too."""
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, (1,), 4, 2, 3, 6, 8, dtype=np.float64)
    sinks = np.array([0.5, -1.0, 2.0, 0.0])
    out, lse = npattn.sdpa(q, k, v, sinks=sinks, return_lse=True)
    dout = rng.standard_normal(out.shape)
    grads = npattn.sdpa_backward(dout, q, k, v, out, lse, sinks=sinks)
    assert_attention_grads_close(grads, dout, q, k, v, sinks=sinks)
    message = failure((*grads[:3], np.zeros(4)), dout, q, k, v, sinks=sinks)
    assert "dsinks" in message and "the softmax's D_i term missing" in message, message
    assert_attention_grads_close(grads[:3], dout, q, k, v, sinks=sinks)  # no dsinks given: not checked


@pytest.mark.parametrize(
    "grads, error",
    [("dq", r"must be \(dq, dk, dv\[, dsinks\]\)"), ([1, 2], "must hold 3 or 4 gradients"), ({"dx": 1}, "unknown")],
)
def test_what_is_not_gradients_is_said(grads, error):
    q, k, v = qkv(np.random.default_rng(0), (), 2, 1, 3, 4, 8)
    with pytest.raises(TypeError, match=error):
        assert_attention_grads_close(grads, np.ones((2, 3, 8)), q, k, v)


# ---- the forward checker: the transposed layout named ----


def model_arrays(rng, B=1, L=8, H=4, H_kv=2, D=16):
    """q, k, v laid out as a model holds them: (B, L, H, D)."""
    q = rng.standard_normal((B, L, H, D), dtype=np.float32)
    k, v = (rng.standard_normal((B, L, H_kv, D), dtype=np.float32) for _ in range(2))
    return q, k, v


def to_heads(x):
    return x.transpose(0, 2, 1, 3)


def test_attention_over_arrays_read_as_b_l_h_d_is_named():
    """A student's attention that reads its (B, H, L, D) inputs as (B, L, H, D) (heads and
    rows swapped inside) fails, named, where the swapped head counts divide (8 rows over 8)."""
    q, k, v = (to_heads(x) for x in model_arrays(np.random.default_rng(1), H_kv=4))
    wrong = to_heads(npattn.sdpa(*(to_heads(x) for x in (q, k, v))))  # attention across heads, transposed back
    with pytest.raises(AssertionError) as info:
        assert_attention_close(wrong, q, k, v)
    assert "the result matches, within tolerance, q, k and v read as (B, L, H, D)" in str(info.value), info.value


def test_checking_b_l_h_d_arrays_names_the_layout():
    """Right attention checked against a model's (B, L, H, D) arrays as given: the shapes
    disagree, and the message says the arrays are (B, L, H, D) and what to pass."""
    q, k, v = model_arrays(np.random.default_rng(2))
    right = npattn.sdpa(*(to_heads(x) for x in (q, k, v)))
    with pytest.raises(AssertionError) as info:
        assert_attention_close(right, q, k, v)
    message = str(info.value)
    assert "its heads and rows are swapped" in message and "q, k and v are laid out (B, L, H, D)" in message, message
    assert "x.transpose(0, 2, 1, 3)" in message, message


@pytest.mark.parametrize("library", ["numpy", "mlx", "torch"])
def test_a_result_laid_out_b_l_h_d_is_named(library):
    """Right attention returned as (B, L, H, D): named, and told to be transposed; for
    NumPy, MLX and PyTorch results alike."""
    q, k, v = (to_heads(x) for x in model_arrays(np.random.default_rng(3)))
    result = to_heads(npattn.sdpa(q, k, v))
    if library == "mlx":
        result = pytest.importorskip("mlx.core").array(result)
    elif library == "torch":
        result = pytest.importorskip("torch").from_numpy(np.ascontiguousarray(result))
    with pytest.raises(AssertionError) as info:
        assert_attention_close(result, q, k, v)
    assert "matches, within tolerance, this attention laid out (B, L, H, D)" in str(info.value), info.value


@pytest.mark.parametrize("seed", range(30))
def test_right_results_of_square_layouts_pass(seed):
    """Where L == H the transposed reading has the result's shape too: a right result still passes."""
    rng = np.random.default_rng(seed)
    q, k, v = (to_heads(x) for x in model_arrays(rng, L=4, H=4, H_kv=int(rng.choice([1, 2, 4]))))
    assert_attention_close(npattn.sdpa(q, k, v), q, k, v)
