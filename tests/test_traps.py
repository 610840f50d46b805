"""SPEC section 13's silent traps, closed: causal_mask's bool mask is True where a key
is visible (as sdpa reads a bool mask) and an integer dtype is a TypeError; and
sdpa_backward refuses options that differ from those its lse was computed under
(a forgotten mask= must not give another problem's gradients), while a plain lse
is taken as before."""

import math
import pickle

import numpy as np
import pytest

import npattn
from helpers import assert_raises_naming, check_backward, failing_allocations, qkv, randn
from npattn import reference

CAUSAL_L3_S5 = [  # S - L = 2: row i sees keys 0 .. i + 2
    [1, 1, 1, 0, 0],
    [1, 1, 1, 1, 0],
    [1, 1, 1, 1, 1],
]


BOOL_DTYPES = [
    pytest.param(bool, id="bool"),
    pytest.param(np.bool_, id="np.bool_"),
    pytest.param(np.dtype(bool), id="np.dtype(bool)"),
    pytest.param("mlx", id="mx.bool_"),
    pytest.param("torch", id="torch.bool"),
]


def peer_dtype(name, numpy_name):
    """MLX's or PyTorch's dtype of that name; the test skips without the library."""
    if name == "mlx":
        mx = pytest.importorskip("mlx.core")
        return getattr(mx, {"bool": "bool_"}.get(numpy_name, numpy_name))
    torch = pytest.importorskip("torch")
    return getattr(torch, numpy_name)


@pytest.mark.parametrize("dtype", BOOL_DTYPES)
def test_bool_causal_mask_is_true_where_a_key_is_visible(dtype):
    """causal_mask(3, 5, bool) == the hand-written table of visible keys, dtype bool."""
    if dtype in ("mlx", "torch"):
        dtype = peer_dtype(dtype, "bool")
    got = reference.causal_mask(3, 5, dtype)  # npattn.causal_mask's values, in NumPy (test_frictions: its library)
    assert type(got) is np.ndarray and got.dtype == np.bool_
    np.testing.assert_array_equal(got, np.array(CAUSAL_L3_S5, bool))


@pytest.mark.parametrize("dtype", [bool, np.float32, np.float64])
@pytest.mark.parametrize("L, S", [(3, 7), (7, 3), (5, 5)])
def test_sdpa_with_causal_mask_equals_the_causal_reference(rng, L, S, dtype):
    """sdpa(mask=causal_mask(L, S, dtype)) == reference.sdpa(mask="causal"), bool and float."""
    q, k, v = qkv(rng, (2,), 6, 2, L, S, 5, 3, dtype=np.float64)
    got = npattn.sdpa(q, k, v, mask=npattn.causal_mask(L, S, dtype))
    np.testing.assert_allclose(got, reference.sdpa(q, k, v, mask="causal"), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("library, name", [("mlx", "float32"), ("mlx", "bfloat16"), ("torch", "float16")])
def test_reference_causal_mask_of_a_peer_dtype_is_a_numpy_array(library, name):
    """reference.causal_mask(L, S, mx.float32) is a NumPy array of that dtype, as its docstring
    says (npattn.causal_mask gives the dtype's own library's array: test_frictions.py)."""
    got = reference.causal_mask(2, 4, peer_dtype(library, name))
    assert type(got) is np.ndarray and got.dtype.name == name
    np.testing.assert_array_equal(got.astype(np.float64), npattn.causal_mask(2, 4, np.float64))


@pytest.mark.parametrize("dtype", [np.int32, int, np.uint8, "mlx", "torch"], ids=str)
def test_integer_causal_mask_is_a_type_error_naming_the_dtype(dtype):
    """An integer dtype cannot hold -inf: TypeError naming causal_mask's dtype (0.2 gave
    -2147483648 with a RuntimeWarning)."""
    if dtype in ("mlx", "torch"):
        dtype = peer_dtype(dtype, "int32")
    with pytest.raises(TypeError, match=r"^causal_mask: dtype must be a float or bool dtype, got .*int") as info:
        npattn.causal_mask(3, 7, dtype)
    assert "int" in str(info.value)


# ---- forward and backward under the same options ----

# (the option sdpa was given, what the backward is given instead)
DISAGREEING = {
    "mask None forgotten": ({"mask": None}, {}),
    "mask causal_top_left forgotten": ({"mask": "causal_top_left"}, {}),
    "mask bool array forgotten": ({"mask": "bool"}, {}),
    "mask another bool array": ({"mask": "bool"}, {"mask": "bool_other"}),
    "scale forgotten": ({"scale": 0.3}, {}),
    "scale other": ({"scale": 0.3}, {"scale": 0.4}),
    "sinks forgotten": ({"sinks": np.linspace(-1, 1, 6)}, {}),
    "sinks other": ({"sinks": np.linspace(-1, 1, 6)}, {"sinks": np.zeros(6)}),
    "window forgotten": ({"window": (2, 0)}, {}),
    "softcap forgotten": ({"softcap": 2.0}, {}),
    "q_offset forgotten": ({"q_offset": 1}, {}),
    "k_offset other": ({"k_offset": 3}, {"k_offset": 2}),
}


def options(rng, given, L=5, S=7):
    """The options with "bool" and "bool_other" made into two different bool masks."""
    masks = {"bool": rng.random((L, S)) < 0.7}
    masks["bool_other"] = ~masks["bool"]
    return {key: masks[val] if isinstance(val, str) and val in masks else val for key, val in given.items()}


@pytest.mark.parametrize("case", DISAGREEING)
def test_backward_refuses_options_other_than_the_forwards(rng, capfd, case):
    """sdpa_backward with an option other than the one its lse was made with: ValueError
    naming the option (0.2 gave the gradients of the other problem, dq off by 1.40)."""
    forward, backward = DISAGREEING[case]
    q, k, v = qkv(rng, (2,), 6, 2, 5, 7, 4, 3, dtype=np.float64)
    forward = options(np.random.default_rng(1), forward)
    backward = options(np.random.default_rng(1), backward)
    out, lse = npattn.sdpa(q, k, v, return_lse=True, **forward)
    (name,) = forward
    dout = np.ones_like(out)
    assert_raises_naming(
        capfd,
        lambda: npattn.sdpa_backward(dout, q, k, v, out, lse, **backward),
        ValueError,
        name,
        ("lse was computed by sdpa with",),
        function="sdpa_backward",
    )


@pytest.mark.parametrize(
    "forward, backward",
    [
        ({}, {}),
        ({"mask": None}, {"mask": None}),
        ({"mask": "bool"}, {"mask": "bool"}),
        ({"scale": None}, {"scale": 4**-0.5}),  # the default, written out
        ({"scale": np.float32(0.5)}, {"scale": np.array(0.5)}),
        ({"window": None}, {"window": (None, None)}),
        ({"q_offset": None}, {"q_offset": 2}),  # S - L, the default
        ({"sinks": [0.5] * 6, "softcap": 3.0}, {"sinks": np.full(6, 0.5), "softcap": 3}),
    ],
    ids=str,
)
def test_backward_with_the_forwards_options_matches_the_reference(rng, forward, backward):
    """The same options, written alike or as equal values: the reference's gradients."""
    q, k, v = qkv(rng, (2,), 6, 2, 5, 7, 4, 3, dtype=np.float64)
    forward, backward = options(np.random.default_rng(1), forward), options(np.random.default_rng(1), backward)
    dout = randn(rng, (2, 6, 5, 3), np.float64)
    out, lse = npattn.sdpa(q, k, v, return_lse=True, **forward)
    got = npattn.sdpa_backward(dout, q, k, v, out, lse, **backward)
    want = check_backward(q, k, v, dout, **forward)  # the reference's, within tolerance
    for name in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))


def test_a_bool_mask_and_its_additive_mask_are_the_same_option(rng):
    """A bool mask in the forward, the additive mask hiding the same keys in the backward."""
    q, k, v = qkv(rng, (), 4, 2, 5, 7, 8, dtype=np.float64)
    visible = npattn.causal_mask(5, 7, bool)
    out, lse = npattn.sdpa(q, k, v, mask=visible, return_lse=True)
    got = npattn.sdpa_backward(np.ones_like(out), q, k, v, out, lse, mask=npattn.causal_mask(5, 7, np.float64))
    want = npattn.sdpa_backward(np.ones_like(out), q, k, v, out, lse, mask=visible)
    np.testing.assert_array_equal(got.dq, want.dq)


@pytest.mark.parametrize("plain", ["np.asarray", "copy", "slice", "pickle", "file"])
def test_an_lse_without_a_record_is_taken_as_before(rng, tmp_path, plain):
    """A plain lse (from a file, a copy, a view) is not compared: the backward computes
    under the options given, as in 0.2, and equals the reference's gradients for them."""
    q, k, v = qkv(rng, (2,), 6, 2, 5, 7, 4, 3, dtype=np.float64)
    out, lse = npattn.sdpa(q, k, v, mask=None, return_lse=True)
    if plain == "np.asarray":
        lse = np.asarray(lse)
    elif plain == "copy":
        lse = lse.copy()
    elif plain == "slice":
        lse = lse[...]
    elif plain == "pickle":
        lse = pickle.loads(pickle.dumps(lse))
    else:
        np.save(tmp_path / "lse.npy", lse)
        lse = np.load(tmp_path / "lse.npy")
    assert getattr(lse, "options", None) is None
    dout = randn(rng, out.shape, np.float64)
    got = npattn.sdpa_backward(dout, q, k, v, out, lse, mask=None)
    want = reference.sdpa_backward(dout, q, k, v, None, None, mask=None)
    np.testing.assert_allclose(got.dq, want[0], rtol=1e-10, atol=1e-12)
    # unchecked: the forgotten mask is the caller's, as before
    npattn.sdpa_backward(dout, q, k, v, out, lse)


def test_the_lse_records_the_options_and_stays_an_array(rng):
    """lse.options holds the options the core computed under, its defaults resolved
    (mask and sinks as given); arithmetic on lse gives plain arrays."""
    q, k, v = qkv(rng, (), 4, 2, 5, 7, 8)
    mask = np.ones((5, 7), bool)
    out, lse = npattn.sdpa(q, k, v, 0.5, mask, window=(3, 1), return_lse=True)
    assert isinstance(lse, np.ndarray) and isinstance(lse, npattn.Lse)
    assert lse.options["mask"] is mask
    assert dict(lse.options) == {
        "scale": 0.5,
        "mask": mask,
        "sinks": None,
        "window": (3, 1),
        "softcap": None,
        "q_offset": 2,  # S - L
        "k_offset": 0,
        "k_start": 0,
        "k_lengths": 7,
    }
    assert npattn.sdpa(q, k, v, return_lse=True)[1].options["scale"] == 1 / math.sqrt(8)  # None resolved
    with pytest.raises(TypeError):
        lse.options["mask"] = None  # read-only
    assert type(lse + 0) is np.ndarray and type(np.exp(lse)) is np.ndarray
    np.testing.assert_array_equal(lse - 1, np.asarray(lse) - 1)
    assert type(npattn.sdpa(q, k, v)) is np.ndarray  # without return_lse, as before


def test_backward_refuses_forgotten_key_ranges_and_takes_equal_ones():
    """The lse remembers k_lengths and an array q_offset: sdpa_backward refuses a call
    that forgets them and takes the same values in another form (a list)."""
    rng = np.random.default_rng(0)
    q, k, dout = rng.standard_normal((3, 2, 4, 8)), rng.standard_normal((3, 1, 9, 8)), rng.standard_normal((3, 2, 4, 8))
    lengths = np.array([3, 9, 5])
    out, lse = npattn.sdpa(q, k, k, k_lengths=lengths, return_lse=True)
    with pytest.raises(ValueError, match=r"^sdpa_backward: k_lengths is None, so k_lengths\[0\] = 9, but lse was "
                       r"computed by sdpa with k_lengths\[0\] = 3"):  # fmt: skip
        npattn.sdpa_backward(dout, q, k, k, out, lse)
    got = npattn.sdpa_backward(dout, q, k, k, out, lse, k_lengths=[3, 9, 5])
    want = npattn.sdpa_backward(dout, q, k, k, out, np.asarray(lse), k_lengths=lengths)
    np.testing.assert_array_equal(got.dq, want.dq)
    out, lse = npattn.sdpa(q, k, k, q_offset=np.array([1, 2, 3]), return_lse=True)
    with pytest.raises(ValueError, match=r"^sdpa_backward: q_offset is"):
        npattn.sdpa_backward(dout, q, k, k, out, lse, q_offset=np.array([1, 2, 4]))
    npattn.sdpa_backward(dout, q, k, k, out, lse, q_offset=(1, 2, 3))


# ---- per-request positions: compared as the core resolves them (issue 56, item 2) ----


def _ranged(rng):
    """A batch of 3 requests over S = 9 keys with right-padded lengths, L = 4."""
    q, k, v = (rng.standard_normal(s) for s in ((3, 2, 4, 8), (3, 1, 9, 8), (3, 1, 9, 5)))
    return q, k, v, rng.standard_normal((3, 2, 4, 5)), np.array([5, 9, 6])


@pytest.mark.parametrize(
    "forward, backward, name",
    [
        # each request's default q_offset is k_lengths[b] - L, not S - L
        ({}, {"q_offset": 5}, "q_offset"),
        ({"q_offset": 5}, {}, "q_offset"),
        ({"k_offset": 3}, {"k_offset": 3, "q_offset": 8}, "q_offset"),
        # a k_start moves the default k_lengths, S - k_start[b], and so the q_offset
        (
            {"k_start": [1, 0, 2], "k_lengths": None},
            {"k_start": [1, 0, 2], "k_lengths": [8, 9, 7], "q_offset": 4},
            "q_offset",
        ),
    ],
    ids=["default then S - L", "S - L then default", "k_offset", "k_start"],
)
def test_backward_refuses_another_q_offset_than_the_core_used(capfd, forward, backward, name):
    """With key ranges, sdpa_backward's q_offset is compared as the core resolves it:
    the forward's default (each request's bottom-right corner) and S - L differ, and
    either way round is a ValueError naming q_offset (0.3 took both and gave the
    gradients of another problem, errors of about 2)."""
    q, k, v, dout, lengths = _ranged(np.random.default_rng(5))
    forward = {"k_lengths": lengths, **forward}
    backward = {"k_lengths": lengths, **backward}
    out, lse = npattn.sdpa(q, k, v, return_lse=True, **forward)
    assert_raises_naming(capfd, lambda: npattn.sdpa_backward(dout, q, k, v, out, lse, **backward), ValueError, name,
                         ("lse was computed by sdpa with",), function="sdpa_backward")  # fmt: skip


def test_backward_refuses_a_lengths_buffer_advanced_in_place(capfd):
    """A decode loop's k_lengths advanced in place between sdpa and sdpa_backward: the
    lse holds a copy of the lengths the core used, so the backward is refused naming
    k_lengths (0.3 compared the buffer with itself and gave gradients off by about 1)."""
    q, k, v, dout, lengths = _ranged(np.random.default_rng(6))
    lengths[:] = [4, 7, 5]
    out, lse = npattn.sdpa(q, k, v, k_lengths=lengths, return_lse=True)
    lengths += 1
    assert_raises_naming(capfd, lambda: npattn.sdpa_backward(dout, q, k, v, out, lse, k_lengths=lengths), ValueError,
                         "k_lengths", ("k_lengths[0] = 5", "k_lengths[0] = 4"), function="sdpa_backward")  # fmt: skip
    assert not lse.options["k_lengths"].flags.writeable
    np.testing.assert_array_equal(lse.options["k_lengths"], [4, 7, 5])


@pytest.mark.parametrize(
    "forward, backward",
    [
        ({}, {}),
        ({}, {"q_offset": [1, 5, 2]}),  # the defaults, k_lengths[b] - L, written out
        ({"q_offset": [1, 5, 2]}, {}),
        ({"k_start": 0}, {"k_start": [0, 0, 0], "q_offset": np.array([[1], [5], [2]])[:, 0]}),
        ({"k_offset": 2}, {"k_offset": 2, "q_offset": [3, 7, 4]}),
    ],
    ids=str,
)
def test_backward_takes_positions_that_mean_the_same(forward, backward):
    """Positions written otherwise but resolving to the same per-request values pass,
    and the gradients are the reference's for the forward's problem."""
    q, k, v, dout, lengths = _ranged(np.random.default_rng(7))
    forward = {"k_lengths": lengths, **forward}
    backward = {"k_lengths": lengths.tolist(), **backward}
    out, lse = npattn.sdpa(q, k, v, return_lse=True, **forward)
    got = npattn.sdpa_backward(dout, q, k, v, out, lse, **backward)
    want = check_backward(q, k, v, dout, **forward)
    for name in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))


def test_the_comparison_comes_before_computing(monkeypatch):
    """A refused backward computes nothing: the comparison runs before the core is
    called (the core's allocations fail here, and the refusal is still a ValueError)."""
    q, k, v, dout, lengths = _ranged(np.random.default_rng(8))
    out, lse = npattn.sdpa(q, k, v, k_lengths=lengths, return_lse=True)
    with failing_allocations(0), pytest.raises(ValueError, match="q_offset"):
        npattn.sdpa_backward(dout, q, k, v, out, lse, k_lengths=lengths, q_offset=5)
