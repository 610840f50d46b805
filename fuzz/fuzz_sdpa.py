"""Coverage-guided fuzzing of npattn.sdpa with atheris: see fuzz/README.md.

Each input is decoded into one call of ``npattn.sdpa``: shapes (batch dims
that broadcast or not, GQA head counts, empty sizes, now and then a size that
does not fit), dtypes, memory layouts (transposed, reversed, strided, zero
strides, Fortran order, unaligned, byte-swapped, read-only), values (with NaN,
infinities, huge and tiny numbers mixed in), the mask (every kind, broadcast
shapes, wrong shapes and kinds), sinks, scale and threads; a second call
writes into ``out=``.

What counts as a finding (the harness raises, atheris saves the input):

- any exception but TypeError, ValueError and MemoryError, or one of those
  whose message does not start with "sdpa: " (NumPy's own allocation errors
  excepted);
- an input array modified by the call;
- a result of the wrong shape or dtype, or not bitwise equal to a second
  identical call into ``out=``;
- for finite float32/float64 inputs: a result that differs from
  ``npattn.reference`` by more than the test suite's tolerance plus S ulps;
  for finite float16/bfloat16 inputs, NaN where the reference has none;
- with NaN or infinities in the inputs and every key visible (``mask=None``):
  NaN in other places than the reference's;
- and, with the extension built with AddressSanitizer (see the README), any
  memory error in the C core, which aborts the process.

Run directly: ``python fuzz/fuzz_sdpa.py [libFuzzer flags] [corpus dir]``;
``python fuzz/fuzz_sdpa.py crash-file`` replays one input.
"""

import os
import sys

import atheris
import numpy as np  # imported first, so that NumPy is not instrumented: it is not under test

with atheris.instrument_imports(include=["npattn"]):
    import npattn
    import npattn._api
    from npattn import reference

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from conftest import tolerance

try:
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    BFLOAT16 = None

DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)] + ([BFLOAT16] if BFLOAT16 else [])
SPECIALS = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, -1e30, 1e-30, 65504.0, 3e38, 1e300]
LAYOUTS = [
    "contiguous",
    "transposed",
    "reversed_rows",
    "reversed_last",
    "strided_last",
    "every_other_head",
    "zero_stride_rows",
    "zero_stride_last",
    "fortran",
    "unaligned",
    "byteswapped",
    "read_only",
    "list",
]
ALLOWED = (TypeError, ValueError, MemoryError)
NUMPY_MESSAGES = ("Unable to allocate", "array is too big", "iterator is too large", "Maximum allowed size")


class Input:
    """Draws from the fuzzer's bytes."""

    def __init__(self, data):
        self.fdp = atheris.FuzzedDataProvider(data)

    def int(self, lo, hi):
        return self.fdp.ConsumeIntInRange(lo, hi)

    def pick(self, items):
        return items[self.fdp.ConsumeIntInRange(0, len(items) - 1)]

    def chance(self, one_in):
        return self.fdp.ConsumeIntInRange(0, one_in - 1) == 0

    def float(self):
        return self.fdp.ConsumeRegularFloat() if self.chance(2) else self.fdp.ConsumeFloat()


def values(inp, rng, shape, dtype, specials):
    """Unit-normal values of `shape`, in float64, with some special values mixed in."""
    x = rng.standard_normal(shape)
    if specials and x.size and inp.chance(3):
        for _ in range(inp.int(1, 3)):
            x.flat[inp.int(0, x.size - 1)] = inp.pick(SPECIALS)
    return x


def layout(inp, x, dtype):
    """x (float64 values) in `dtype`, in a memory layout the fuzzer picks."""
    kind = inp.pick(LAYOUTS)
    shape = x.shape
    with np.errstate(over="ignore", invalid="ignore"):
        if kind == "transposed" and x.ndim >= 3:
            return np.ascontiguousarray(x.swapaxes(-3, -2).astype(dtype)).swapaxes(-3, -2)
        if kind == "reversed_rows" and x.ndim >= 2:
            return np.ascontiguousarray(x[..., ::-1, :].astype(dtype))[..., ::-1, :]
        if kind == "reversed_last":
            return np.ascontiguousarray(x[..., ::-1].astype(dtype))[..., ::-1]
        if kind == "strided_last":
            y = np.zeros((*shape[:-1], 2 * shape[-1]), dtype)
            y[..., ::2] = x
            return y[..., ::2]
        if kind == "every_other_head" and x.ndim >= 3:
            y = np.zeros((*shape[:-3], 2 * shape[-3], *shape[-2:]), dtype)
            y[..., ::2, :, :] = x
            return y[..., ::2, :, :]
        if kind == "zero_stride_rows" and x.ndim >= 2:
            return np.broadcast_to(x[..., :1, :].astype(dtype), shape)
        if kind == "zero_stride_last":
            return np.broadcast_to(x[..., :1].astype(dtype), shape)
        if kind == "fortran":
            return np.asfortranarray(x.astype(dtype))
        if kind == "unaligned" and dtype.itemsize > 1:
            n = x.size * dtype.itemsize
            y = np.frombuffer(bytearray(n + 1), np.uint8)[1:].view(dtype).reshape(shape)
            y[...] = x
            return y
        if kind == "byteswapped" and dtype.kind == "f":
            return x.astype(dtype.newbyteorder(">"))
        if kind == "read_only":
            y = x.astype(dtype)
            y.setflags(write=False)
            return y
        if kind == "list" and dtype == np.float64 and x.size <= 64:
            return x.tolist()
        return x.astype(dtype)


def batch_of(inp, batch):
    """A batch shape that broadcasts to `batch` (or now and then one that does not)."""
    dims = [inp.pick([b, 1]) for b in batch]
    dims = dims[inp.int(0, len(dims)) :]
    if dims and inp.chance(25):
        dims[0] += 1  # does not broadcast, unless it was 1
    return tuple(dims)


def draw_call(inp):
    """(q, k, v, kwargs, finite) for one call; finite says no input holds NaN or inf."""
    rng = np.random.default_rng(inp.int(0, 2**32 - 1))
    specials = inp.chance(4)
    dt = inp.pick(DTYPES)
    dtypes = {name: dt for name in "qkv"}
    if inp.chance(6):
        dtypes[inp.pick("qkv")] = inp.pick(DTYPES)  # mixed dtypes
    batch = tuple(inp.int(0, 3) for _ in range(inp.int(0, 2)))
    H_kv = inp.int(1, 3)
    H_q = H_kv * inp.int(0, 3) + (1 if inp.chance(25) else 0)
    L, S = (
        inp.int(0, 9) if not inp.chance(20) else inp.int(0, 700),
        inp.int(0, 9) if not inp.chance(8) else inp.int(0, 2600),
    )
    D, D_v = inp.int(1, 9) if not inp.chance(10) else inp.int(0, 300), inp.int(0, 7)
    shapes = {
        "q": (*batch_of(inp, batch), H_q, L, D),
        "k": (*batch_of(inp, batch), H_kv, S, D + (1 if inp.chance(30) else 0)),
        "v": (*batch_of(inp, batch), H_kv, S + (1 if inp.chance(30) else 0), D_v),
    }
    if inp.chance(5):
        shapes = {name: s[-2:] for name, s in shapes.items()}  # rank 2
    if L * S * max(H_q, 1) > 400_000:  # keep each call quick
        L = min(shapes["q"][-2], 9)
        shapes["q"] = (*shapes["q"][:-2], L, shapes["q"][-1])
    raw = {name: values(inp, rng, shapes[name], dtypes[name], specials) for name in "qkv"}
    q, k, v = (layout(inp, raw[name], dtypes[name]) for name in "qkv")

    kwargs = {}
    full = None
    try:
        full = np.broadcast_shapes(shapes["q"][:-3], shapes["k"][:-3], shapes["v"][:-3]) + (
            shapes["q"][-3] if len(shapes["q"]) >= 3 else 1,
            shapes["q"][-2],
            shapes["k"][-2],
        )
    except ValueError:
        pass
    kind = inp.pick(["default", "causal", "causal_top_left", None, "bool", "float", "bad"])
    if kind in ("bool", "float") and full is not None:
        mshape = [inp.pick([n, 1]) for n in full]
        mshape = tuple(mshape[inp.int(0, len(mshape)) :])
        if inp.chance(20) and mshape:
            mshape = (*mshape[:-1], mshape[-1] + 1)
        if kind == "bool":
            mask = rng.random(mshape) < inp.pick([0.0, 0.5, 0.9, 1.0])
        else:
            mask = rng.standard_normal(mshape)
            mask[rng.random(mshape) < 0.3] = -np.inf
            if specials and mask.size:
                mask.flat[inp.int(0, mask.size - 1)] = inp.pick(SPECIALS)
            with np.errstate(over="ignore"):
                mask = mask.astype(inp.pick([np.float16, np.float32, np.float64]))
        if inp.chance(4) and mask.ndim >= 2:
            mask = mask.swapaxes(-1, -2).copy().swapaxes(-1, -2)
        kwargs["mask"] = mask
    elif kind == "bad":
        kwargs["mask"] = inp.pick(["Causal", "", 0.0, 1, np.zeros((3, 3), np.int32), np.zeros(2, complex), [[True]]])
    elif kind != "default" and kind not in ("bool", "float"):
        kwargs["mask"] = kind
    if inp.chance(3):
        n = H_q if not inp.chance(20) else H_q + 1
        sinks = rng.uniform(-4, 4, n)
        if specials and n and inp.chance(2):
            sinks[inp.int(0, n - 1)] = inp.pick([np.nan, np.inf, -np.inf, 1e30, -1e30])
        kwargs["sinks"] = sinks.astype(inp.pick([np.float32, np.float64, np.int64]))
    if inp.chance(3):
        kwargs["scale"] = inp.pick([inp.float(), inp.int(-3, 3), 0.5, -1.0, 1e-3])
    if inp.chance(2):
        kwargs["threads"] = inp.pick([1, 2, 3, 4, 16, 0, -1, 1.5, "2", None])
    finite = not specials
    return q, k, v, kwargs, finite


def snapshot(x):
    """The bytes and the shape of x, to tell afterwards whether it was written."""
    if isinstance(x, np.ndarray):
        return (x.shape, x.strides, np.array(x, copy=True).tobytes())
    return repr(x)


def describe(x):
    """A short description of one argument, for FUZZ_DESCRIBE=1."""
    if isinstance(x, np.ndarray):
        text = f"{x.dtype}{x.shape} strides={x.strides}"
        if x.size <= 8 or not np.isfinite(x).all():
            text += f" values={np.array2string(x.ravel()[:8], precision=3)}"
        return text
    return repr(x)


def TestOneInput(data):
    inp = Input(data)
    q, k, v, kwargs, finite = draw_call(inp)
    if os.environ.get("FUZZ_DESCRIBE"):
        print("q", describe(q), "\nk", describe(k), "\nv", describe(v), flush=True)
        print({key: describe(val) for key, val in kwargs.items()}, "finite" if finite else "specials", flush=True)
    watched = [q, k, v, kwargs.get("mask"), kwargs.get("sinks")]
    before = [snapshot(x) for x in watched]
    try:
        got = npattn.sdpa(q, k, v, **kwargs)
    except ALLOWED as e:
        message = str(e)
        if not message.startswith("sdpa: ") and not any(m in message for m in NUMPY_MESSAGES):
            raise AssertionError(f"{type(e).__name__} without 'sdpa: ': {message!r}") from e
        return
    finally:
        after = [snapshot(x) for x in watched]
        assert after == before, "an input was modified"

    try:
        dtype = np.result_type(*(np.asarray(x).dtype for x in (q, k, v)))
    except TypeError:  # float16 with bfloat16, which NumPy cannot promote
        dtype = np.dtype(np.float32)
    with np.errstate(all="ignore"):  # the reference meets NaN and inf like the formula does
        want = reference.sdpa(*(np.array(x, dtype=np.float64) for x in (q, k, v)), **_ref_kwargs(kwargs))
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == dtype.newbyteorder("="), (got.dtype, dtype)
    # The same call again, into out= (now and then a strided view): bitwise the same.
    if got.ndim and inp.chance(2):
        out = np.zeros((*got.shape[:-1], 2 * got.shape[-1]), got.dtype)[..., ::2]
    else:
        out = np.zeros_like(got)
    assert npattn.sdpa(q, k, v, out=out, **kwargs) is out
    assert out.tobytes() == got.tobytes(), "two identical calls differ"

    scale = kwargs.get("scale")
    computed = np.dtype(np.float64 if dtype == np.float64 else np.float32)
    with np.errstate(all="ignore"):
        q_max, k_max = (float(np.nanmax(np.abs(np.asarray(x, dtype=np.float64)), initial=0.0)) for x in (q, k))
    q_max, k_max = (x if np.isfinite(x) else 1.0 for x in (q_max, k_max))
    D = np.asarray(q).shape[-1]
    eff_scale = abs(float(scale)) if scale is not None else D**-0.5
    if eff_scale * max(q_max, 1.0) * max(k_max, 1.0) * D > np.finfo(computed).max / 4:
        # Scores near the computed dtype's range: the float64 reference is no oracle for
        # float32 there, and (known, tests/test_fuzz_regressions.py) the core computes
        # (q * scale * log2(e)) . k, which overflows where scale * (q . k) need not.
        return
    if not finite:
        # NaN and infinities: with every key visible, NaN lands where the reference puts it
        sinks = kwargs.get("sinks")
        known = (
            # tests/test_safety.py: NaN/+inf sinks vanish in the AVX float32 kernels
            (sinks is not None and not np.isfinite(np.asarray(sinks, dtype=np.float64)).all())
            # tests/test_fuzz_regressions.py: scale * log2(e) underflows to 0 in float32
            or (scale is not None and 0 < abs(float(scale)) < 1e-30)
        )
        if "mask" in kwargs and kwargs["mask"] is None and not known:
            differ = np.isnan(got) != np.isnan(want)
            # Allowed: NaN where the reference has +-inf. An inf in v times a weight that
            # underflows to 0 in the computed dtype (exp(-278) in float32) is NaN, where
            # the float64 reference's weight 1e-121 gives inf (crash-a3594ec3).
            differ &= ~(np.isnan(got) & np.isinf(want))
            assert not differ.any(), "NaN where the reference has none, or none where it has"
        return
    result = got.astype(np.float64)
    if np.asarray(q).dtype in (np.float32, np.float64) and got.dtype in (np.float32, np.float64):
        # The suite's tolerance plus the bound of a running sum over S keys, S ulps of
        # max|v|: where v's rows are all alike the rounding errors add up instead of
        # cancelling (false alarms: S = 1707 equal rows, 8 ulps, NumPy's float32 formula
        # 12; S = 470 equal rows in the decode kernel, 48 ulps).
        S = np.asarray(k).shape[-2]
        atol = tolerance(q, k, v, kwargs.get("scale"), kwargs.get("mask"), kwargs.get("sinks"))
        v_max = float(np.abs(np.asarray(v, dtype=np.float64)).max(initial=0.0))
        atol += S * np.finfo(got.dtype).eps * v_max
        if np.isfinite(want).all() and np.isfinite(atol):
            np.testing.assert_allclose(result, want, rtol=0, atol=atol)
    elif np.isfinite(want).all():
        assert not np.isnan(result).any(), "NaN from finite inputs"


def _ref_kwargs(kwargs):
    return {key: val for key, val in kwargs.items() if key not in ("threads", "out")}


def main():
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
