"""Property tests: npattn.sdpa == reference.sdpa on random small problems.

Hypothesis draws the shapes (batch dims that broadcast, GQA head counts,
empty sizes), the memory layout of each operand, the mask (every kind, any
broadcastable shape, any float dtype), sinks and scale.
"""

import npattn
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

LAYOUTS = [
    "contiguous",
    "contiguous",
    "transposed",
    "reversed_rows",
    "reversed_last",
    "strided_last",
    "every_other_head",
    "zero_stride_rows",
    "fortran",
]


def make(rng, shape, dtype, kind):
    """Unit-normal values of `shape` in a view with the layout `kind`."""

    def randn(s):
        return rng.standard_normal(s).astype(dtype)

    if len(shape) < 3 and kind in ("transposed", "every_other_head"):
        kind = "contiguous"
    if kind == "transposed":  # (*B, L, H, D) memory seen as (*B, H, L, D)
        return randn((*shape[:-3], shape[-2], shape[-3], shape[-1])).swapaxes(-3, -2)
    if kind == "reversed_rows":
        return randn(shape)[..., ::-1, :]
    if kind == "reversed_last":
        return randn(shape)[..., ::-1]
    if kind == "strided_last":
        return randn((*shape[:-1], 2 * shape[-1]))[..., ::2]
    if kind == "every_other_head":
        return randn((*shape[:-3], 2 * shape[-3], *shape[-2:]))[..., ::2, :, :]
    if kind == "zero_stride_rows":
        return np.broadcast_to(randn((*shape[:-2], 1, shape[-1])), shape)
    if kind == "fortran":
        return np.asfortranarray(randn(shape))
    return randn(shape)


@st.composite
def operand_batch(draw, batch):
    """A batch shape that broadcasts to `batch`: some dims 1, some leading dims dropped."""
    dims = [draw(st.sampled_from([b, 1])) for b in batch]
    return tuple(dims[draw(st.integers(0, len(dims))) :])


@st.composite
def problems(draw):
    """(q, k, v, kwargs) for one random small problem."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    batch = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    H_kv = draw(st.integers(1, 3))
    H_q = H_kv * draw(st.integers(0, 3))
    L, S = draw(st.integers(0, 9)), draw(st.integers(0, 9))
    D, D_v = draw(st.integers(1, 9)), draw(st.integers(0, 7))

    shapes = {
        "q": (*draw(operand_batch(batch)), H_q, L, D),
        "k": (*draw(operand_batch(batch)), H_kv, S, D),
        "v": (*draw(operand_batch(batch)), H_kv, S, D_v),
    }
    if not batch and H_q == H_kv == 1 and draw(st.booleans()):
        shapes = {name: shape[-2:] for name, shape in shapes.items()}  # the rank-2 form
    q, k, v = (make(rng, shapes[name], dtype, draw(st.sampled_from(LAYOUTS))) for name in "qkv")

    kwargs = {}
    kind = draw(st.sampled_from(["causal", "causal_top_left", None, "bool", "float", "default"]))
    if kind in ("bool", "float"):
        full = np.broadcast_shapes(shapes["q"][:-3], shapes["k"][:-3], shapes["v"][:-3]) + (H_q, L, S)
        shape = [draw(st.sampled_from([n, 1])) for n in full]
        shape = tuple(shape[draw(st.integers(0, len(shape) - 1)) :])  # an array, never a scalar
        if kind == "bool":
            kwargs["mask"] = rng.random(shape) < draw(st.sampled_from([0.0, 0.5, 0.9]))
        else:
            mask_dtype = draw(st.sampled_from([np.float16, np.float32, np.float64]))
            mask = rng.standard_normal(shape).astype(mask_dtype)
            mask[rng.random(shape) < 0.3] = -np.inf
            kwargs["mask"] = mask
        if draw(st.booleans()) and len(shape) >= 2:
            kwargs["mask"] = kwargs["mask"].swapaxes(-1, -2).copy().swapaxes(-1, -2)  # Fortran-like strides
    elif kind != "default":
        kwargs["mask"] = kind
    if draw(st.booleans()):
        kwargs["sinks"] = rng.uniform(-4, 4, H_q).astype(draw(st.sampled_from([np.float32, np.float64])))
    # 0, or a magnitude sdpa accepts (it refuses scales below 1e-30: see test_errors.py)
    scale = draw(st.one_of(st.none(), st.just(0.0), st.floats(1e-3, 3), st.floats(-3, -1e-3)))
    if scale is not None:
        kwargs["scale"] = scale
    kwargs["threads"] = draw(st.integers(1, 4))
    return q, k, v, kwargs


@settings(max_examples=100, deadline=None)
@given(problems())
def test_sdpa_equals_reference(check, problem):
    """sdpa == reference on float64 copies, for random shapes, strides, masks, sinks and scale."""
    q, k, v, kwargs = problem
    check(q, k, v, **kwargs)


@settings(max_examples=40, deadline=None)
@given(problems())
def test_out_equals_return_and_repeats_bitwise(problem):
    """sdpa(out=buf) fills buf with exactly what sdpa returns; a second call is bitwise equal."""
    q, k, v, kwargs = problem
    first = npattn.sdpa(q, k, v, **kwargs)
    buf = np.empty_like(first)
    assert npattn.sdpa(q, k, v, out=buf, **kwargs) is buf
    np.testing.assert_array_equal(buf, first)
