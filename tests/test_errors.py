"""Every invalid input of SPEC section 1 raises the right exception, naming the argument.

One table: (description, call, exception, argument named, extra substrings).
Each call breaks exactly one rule of an otherwise valid call:
q (1, 4, 3, 8), k (1, 2, 5, 8), v (1, 2, 5, 6), float32.
"""

import re

import npattn
import numpy as np
import pytest

Q_SHAPE, K_SHAPE, V_SHAPE = (1, 4, 3, 8), (1, 2, 5, 8), (1, 2, 5, 6)
OUT_SHAPE = (1, 4, 3, 6)


def arr(shape, dtype=np.float32):
    return np.ones(shape, dtype)


VALID = object()


def call(q=VALID, k=VALID, v=VALID, **kwargs):
    """A valid call with some operands or keywords replaced."""
    q = arr(Q_SHAPE) if q is VALID else q
    k = arr(K_SHAPE) if k is VALID else k
    v = arr(V_SHAPE) if v is VALID else v
    return lambda: npattn.sdpa(q, k, v, **kwargs)


def read_only(shape, dtype=np.float32):
    x = np.zeros(shape, dtype)
    x.setflags(write=False)
    return x


def bad_dtype_rows():
    """A TypeError naming the operand for every non-float dtype of q, k and v."""
    bad = {
        "int32": lambda s: np.ones(s, np.int32),
        "int64": lambda s: np.ones(s, np.int64),
        "bool": lambda s: np.ones(s, bool),
        "complex": lambda s: np.ones(s, np.complex64),
        "object": lambda s: np.ones(s, object),
        "str": lambda s: np.full(s, "1.0"),
    }
    shapes = {"q": Q_SHAPE, "k": K_SHAPE, "v": V_SHAPE}
    rows = []
    for name, shape in shapes.items():
        for kind, make in bad.items():
            rows.append((f"{name} {kind} array", call(**{name: make(shape)}), TypeError, name, ()))
        rows.append((f"{name} None", call(**{name: None}), TypeError, name, ()))
    return rows


def overlapping_out():
    """out aliasing q's memory (q given the result's shape, D = D_v)."""
    q = np.ones((1, 4, 3, 8), np.float32)
    return lambda: npattn.sdpa(q, arr(K_SHAPE), arr((1, 2, 5, 8)), out=q)


def out_overlapping_v():
    """out and v two views of one buffer that share 20 elements."""
    buf = np.zeros(200, np.float32)
    v = buf[:60].reshape(V_SHAPE)
    out = buf[40:112].reshape(OUT_SHAPE)
    return lambda: npattn.sdpa(arr(Q_SHAPE), arr(K_SHAPE), v, out=out)


def out_overlapping_mask():
    """out a view of a float mask's memory."""
    mask = np.zeros((1, 4, 3, 7), np.float32)
    out = mask[..., :6]
    return lambda: npattn.sdpa(arr(Q_SHAPE), arr(K_SHAPE), arr(V_SHAPE), mask=mask[..., :5], out=out)


ROWS = [
    # ranks
    ("q 1-D", call(q=arr((8,))), ValueError, "q", ()),
    ("q 0-D", call(q=arr(())), ValueError, "q", ()),
    ("k 1-D", call(k=arr((8,))), ValueError, "k", ()),
    ("k 0-D", call(k=arr(())), ValueError, "k", ()),
    ("v 1-D", call(v=arr((6,))), ValueError, "v", ()),
    ("v 0-D", call(v=arr(())), ValueError, "v", ()),
    # shapes that do not fit together
    ("D of k != D of q", call(k=arr((1, 2, 5, 7))), ValueError, "k", ("(1, 2, 5, 7)",)),
    ("D of q != D of k", call(q=arr((1, 4, 3, 9))), ValueError, "q", ("(1, 4, 3, 9)",)),
    ("D = 0", call(q=arr((1, 4, 3, 0)), k=arr((1, 2, 5, 0))), ValueError, "q", ()),
    ("S of v != S of k", call(v=arr((1, 2, 4, 6))), ValueError, "v", ("(1, 2, 4, 6)",)),
    ("H_kv of v != H_kv of k", call(v=arr((1, 1, 5, 6))), ValueError, "v", ("(1, 1, 5, 6)",)),
    ("H_kv = 0", call(q=arr((1, 0, 3, 8)), k=arr((1, 0, 5, 8)), v=arr((1, 0, 5, 6))), ValueError, "k", ()),
    ("H_q not a multiple of H_kv", call(q=arr((1, 5, 3, 8))), ValueError, "q", ("(1, 5, 3, 8)", "multiple")),
    ("H_q < H_kv", call(q=arr((1, 1, 3, 8))), ValueError, "q", ("(1, 1, 3, 8)",)),
    (
        "batch dims of q and k do not broadcast",
        call(q=arr((2, 4, 3, 8)), k=arr((3, 2, 5, 8)), v=arr((3, 2, 5, 6))),
        ValueError,
        "q",
        ("(2, 4, 3, 8)", "(3, 2, 5, 8)"),
    ),
    (
        "batch dims of v do not broadcast",
        call(q=arr((2, 4, 3, 8)), k=arr((2, 2, 5, 8)), v=arr((3, 2, 5, 6))),
        ValueError,
        "v",
        ("(3, 2, 5, 6)",),
    ),
    ("ragged list", call(q=[[1.0, 2.0], [3.0]]), ValueError, "q", ()),
    # dtypes of q, k, v
    *bad_dtype_rows(),
    # mask
    ("unknown mask string", call(mask="bogus"), ValueError, "mask", ("causal_top_left", "bogus")),
    ("mask string in other case", call(mask="Causal"), ValueError, "mask", ("causal_top_left",)),
    ("mask 'top_left' alone", call(mask="top_left"), ValueError, "mask", ("causal_top_left",)),
    ("bool mask of wrong shape", call(mask=np.ones((4, 3), bool)), ValueError, "mask", ("(4, 3)",)),
    ("float mask of wrong shape", call(mask=np.zeros((3, 6), np.float32)), ValueError, "mask", ("(3, 6)",)),
    (
        "mask that would grow the batch",
        call(mask=np.zeros((2, 4, 3, 5), np.float32)),
        ValueError,
        "mask",
        ("(2, 4, 3, 5)",),
    ),
    ("mask with extra dims", call(mask=np.zeros((1, 1, 4, 3, 5), np.float32)), ValueError, "mask", ()),
    ("int mask", call(mask=np.zeros((3, 5), np.int32)), TypeError, "mask", ("int32",)),
    ("uint8 mask", call(mask=np.ones((3, 5), np.uint8)), TypeError, "mask", ("uint8",)),
    ("complex mask", call(mask=np.zeros((3, 5), np.complex128)), TypeError, "mask", ("complex",)),
    ("object mask", call(mask=np.zeros((3, 5), object)), TypeError, "mask", ("object",)),
    ("float number as mask", call(mask=0.0), TypeError, "mask", ()),
    ("int number as mask", call(mask=1), TypeError, "mask", ()),
    ("numpy scalar as mask", call(mask=np.float32(0)), TypeError, "mask", ()),
    # sinks
    ("sinks too short", call(sinks=np.zeros(3)), ValueError, "sinks", ("(3,)",)),
    ("sinks one per kv head", call(sinks=np.zeros(2)), ValueError, "sinks", ("(2,)",)),
    ("sinks 2-D", call(sinks=np.zeros((1, 4))), ValueError, "sinks", ("(1, 4)",)),
    ("sinks a scalar", call(sinks=0.0), ValueError, "sinks", ()),
    ("sinks complex", call(sinks=np.zeros(4, np.complex64)), TypeError, "sinks", ()),
    ("sinks str", call(sinks=np.array(["0"] * 4)), TypeError, "sinks", ()),
    ("sinks object", call(sinks=np.array([None] * 4)), TypeError, "sinks", ()),
    # scale
    ("scale nan", call(scale=float("nan")), ValueError, "scale", ()),
    ("scale inf", call(scale=float("inf")), ValueError, "scale", ()),
    ("scale -inf", call(scale=-np.inf), ValueError, "scale", ()),
    ("scale numpy nan", call(scale=np.float32("nan")), ValueError, "scale", ()),
    ("scale a string", call(scale="a"), TypeError, "scale", ()),
    ("scale a list", call(scale=[1.0]), TypeError, "scale", ()),
    ("scale complex", call(scale=1j), TypeError, "scale", ()),
    # threads
    ("threads 0", call(threads=0), ValueError, "threads", ("0",)),
    ("threads -1", call(threads=-1), ValueError, "threads", ("-1",)),
    ("threads a float", call(threads=1.5), TypeError, "threads", ()),
    ("threads a float with int value", call(threads=2.0), TypeError, "threads", ()),
    ("threads a string", call(threads="2"), TypeError, "threads", ()),
    # out
    (
        "out of wrong shape",
        call(out=np.empty((1, 4, 3, 5), np.float32)),
        ValueError,
        "out",
        ("(1, 4, 3, 5)",),
    ),
    ("out missing the rank-4 batch", call(out=np.empty((4, 3, 6), np.float32)), ValueError, "out", ()),
    ("out of wrong dtype", call(out=np.empty(OUT_SHAPE, np.float64)), ValueError, "out", ("float64",)),
    ("out read-only", call(out=read_only(OUT_SHAPE)), ValueError, "out", ()),
    ("out overlapping q", overlapping_out(), ValueError, "out", ()),
    ("out overlapping v", out_overlapping_v(), ValueError, "out", ()),
    ("out overlapping mask", out_overlapping_mask(), ValueError, "out", ()),
    ("out a list", call(out=[[0.0] * 6] * 3), TypeError, "out", ()),
]


@pytest.mark.parametrize(
    "description, fn, exception, argument, substrings", ROWS, ids=[row[0] for row in ROWS]
)
def test_invalid_input_raises_naming_the_argument(capfd, description, fn, exception, argument, substrings):
    """An invalid input raises `exception`; the message starts "sdpa: " and names the argument.

    Nothing is printed to stderr.
    """
    with pytest.raises(exception) as info:
        fn()
    message = str(info.value)
    assert message.startswith("sdpa: "), message
    assert re.search(rf"\b{argument}\b", message[len("sdpa: ") :]), message
    for text in substrings:
        assert text in message, message
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("mask", ["bogus", "Causal", "top_left", "causal "])
def test_unknown_mask_string_lists_the_accepted_ones(mask):
    """An unknown mask string is a ValueError whose message lists "causal" and "causal_top_left"."""
    with pytest.raises(ValueError, match=r"^sdpa: ") as info:
        call(mask=mask)()
    assert re.search(r"\bcausal\b", str(info.value)), info.value
    assert re.search(r"\bcausal_top_left\b", str(info.value)), info.value


@pytest.mark.parametrize(
    "description, fn",
    [
        ("unknown keyword", lambda: npattn.sdpa(arr(Q_SHAPE), arr(K_SHAPE), arr(V_SHAPE), bogus=1)),
        (
            "sinks passed positionally",
            lambda: npattn.sdpa(arr(Q_SHAPE), arr(K_SHAPE), arr(V_SHAPE), None, "causal", None),
        ),
        ("v missing", lambda: npattn.sdpa(arr(Q_SHAPE), arr(K_SHAPE))),
        (
            "is_causal (PyTorch's keyword)",
            lambda: npattn.sdpa(arr(Q_SHAPE), arr(K_SHAPE), arr(V_SHAPE), is_causal=True),
        ),
    ],
)
def test_bad_call_signature_is_type_error(description, fn):
    """Keywords sdpa does not take, or too few or too many positional arguments: TypeError."""
    with pytest.raises(TypeError):
        fn()


def test_accepted_edge_values():
    """Values at the edge of the rules are accepted: scale None, int scale, int sinks, threads as numpy int."""
    q, k, v = arr(Q_SHAPE), arr(K_SHAPE), arr(V_SHAPE)
    for kwargs in (
        {"scale": None},
        {"scale": 1},
        {"sinks": [0, 1, 2, 3]},
        {"threads": np.int64(2)},
        {"threads": 1},
    ):
        assert npattn.sdpa(q, k, v, **kwargs).shape == OUT_SHAPE
