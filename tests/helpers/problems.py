"""Random problems of npattn.sdpa's whole contract: the property tests and the
differential fuzzer (fuzz/differential.py) draw the same ones."""

import numpy as np

from .codes import FORMATS, GROUPINGS, random_codes, random_groups
from .inputs import LAYOUTS, dtype_of, layout, layout_fits, make_mask, read_only

SPECIAL_SIZE = 1.5  # |finite value| in a problem with NaN and infinities (see random_problem)
INT_DTYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")  # for per-request ints
HUGE_OFFSETS = (-(2**63), -(2**62), 2**62, 2**63 - 1)  # per-request q_offset: int64's ends and near them


def _operand_batch(rng, batch):
    """A batch shape that broadcasts to `batch`: some dims 1, some leading dims dropped."""
    dims = [int(b) if rng.random() < 0.7 else 1 for b in batch]
    return tuple(dims[rng.integers(0, len(dims) + 1) :])


def _values(rng, shape, dtype, kind, specials):
    """Values of `shape` in `dtype`, laid out as `kind`, with `specials` NaN or infinities
    (and the finite values then within SPECIAL_SIZE)."""
    a = layout(rng, shape, dtype, kind)
    scale = 10.0 ** rng.choice([0, 0, 0, -3, 3]) if dtype != np.float16 else 1.0
    if scale != 1.0 or specials:
        a = np.array(a, dtype=np.dtype(dtype).newbyteorder("="))  # writeable and native
        if specials:
            np.clip(a, -SPECIAL_SIZE, SPECIAL_SIZE, out=a)
        else:
            a *= a.dtype.type(scale)
        for _ in range(specials):
            if a.size:
                a.flat[rng.integers(0, a.size)] = rng.choice([np.nan, np.inf, -np.inf])
    return a


def _request_shape(rng, B):
    """A shape that broadcasts to the batch shape B: (), (1,), B itself, or B partly
    broadcast (some dims 1, some leading dims dropped)."""
    r = rng.random()
    if r < 0.25:
        return ()
    if r < 0.35 and B:
        return (1,) * int(rng.integers(1, len(B) + 1))
    if r < 0.65:
        return B
    return _operand_batch(rng, B)


def _edge_ints(rng, shape, high):
    """Ints in [0, high] (high an int or an array of `shape`), a fifth of them 0 and a
    fifth `high`: empty ranges, full ones, ranges touching 0 and S."""
    x = rng.integers(0, np.asarray(high) + 1, size=shape)
    pick = rng.random(shape)
    return np.where(pick < 0.2, 0, np.where(pick < 0.4, high, x))


def _least_over_broadcast(room, shape, S):
    """The least of `room` (of shape B) over each axis that `shape` broadcasts along:
    an array of `shape` (S where such an axis is empty)."""
    lead = room.ndim - len(shape)
    axes = tuple(d for d in range(room.ndim) if d < lead or shape[d - lead] == 1)
    return room.min(axis=axes, keepdims=True, initial=S).reshape(shape)


def _per_request_int(rng, values):
    """`values` (ints, of a shape broadcastable to B) as sdpa may take them: a Python
    int, a NumPy scalar or a 0-d array for shape (); else an array of an integer dtype
    that holds them (now and then byte-swapped, strided or read-only) or a list."""
    values = np.asarray(values, dtype=object)
    low, high = (int(f(values, initial=0)) for f in (np.min, np.max))
    fits = [n for n in INT_DTYPES if np.iinfo(n).min <= low and high <= np.iinfo(n).max]
    dtype = np.dtype(rng.choice(fits))
    if values.ndim == 0:
        r = rng.random()
        return int(values) if r < 0.5 else dtype.type(int(values)) if r < 0.75 else np.array(int(values), dtype)
    a = values.astype(dtype)
    r = rng.random()
    if r < 0.1 and a.size:  # an empty list reads as float64
        return a.tolist()
    if r < 0.2:
        return a.astype(dtype.newbyteorder("S"))
    if r < 0.3:
        wide = np.zeros((*a.shape[:-1], 2 * a.shape[-1]), dtype)
        wide[..., ::2] = a
        return wide[..., ::2]  # every other element
    if r < 0.35:
        return read_only(a)
    return a


def _per_request_options(rng, B, S, q_offset_allowed):
    """Per-request key ranges and positions for a batch shape B over S keys: k_start,
    k_lengths (either, both, or neither with an array q_offset), every range within
    [0, S]; now and then an int-array q_offset (int64's ends included)."""
    which = rng.choice(["k_start", "k_lengths", "both", "both", "neither"])
    options = {}
    start = np.zeros(B, dtype=object)
    if which in ("k_start", "both"):
        start = _edge_ints(rng, _request_shape(rng, B), S).astype(object)
        options["k_start"] = _per_request_int(rng, start)
    if which in ("k_lengths", "both"):
        shape = _request_shape(rng, B)
        room = S - np.broadcast_to(start, B).astype(np.int64)  # keys from each request's start to S
        options["k_lengths"] = _per_request_int(rng, _edge_ints(rng, shape, _least_over_broadcast(room, shape, S)))
    if q_offset_allowed and (which == "neither" or rng.random() < 0.4):
        shape = _request_shape(rng, B)
        if which == "neither" and not shape:
            shape = B  # an array, of rank 0 only where B is ()
        offsets = rng.integers(-20, 20, size=shape).astype(object)
        if offsets.size and rng.random() < 0.1:
            offsets.flat[rng.integers(0, offsets.size)] = int(rng.choice(HUGE_OFFSETS))
        options["q_offset"] = _per_request_int(rng, offsets) if shape else np.array(offsets, np.int64)
    return options


def _with_codes(rng, arrays, kinds, kwargs):
    """k and v (arrays[1:], laid out as kinds) made codes, one or both: a random format,
    every code of it drawn, in the same layout, with scales (and zero points, now and
    then, for int8 and uint8) of a random grouping and dtype; their keywords added."""
    q, k, v = arrays
    out = [q]
    for name, x, kind in (("k", k, kinds[1]), ("v", v, kinds[2])):
        if rng.random() < 0.35:
            out.append(x)
            continue
        fmt = str(rng.choice(list(FORMATS)))
        dtype = dtype_of(fmt)
        codes = layout(rng, x.shape, dtype, kind, make=random_codes)
        grouping = str(rng.choice(GROUPINGS))
        scale_dtype = str(rng.choice(["float32", "float16", "bfloat16"]))
        scale, zero = random_groups(rng, x.shape, fmt, grouping, scale_dtype, zero=FORMATS[fmt] and rng.random() < 0.5)
        kwargs[f"{name}_scale"] = scale
        if zero is not None:
            kwargs[f"{name}_zero"] = zero
        out.append(codes)
    return out


def random_problem(rng, dtypes=("float32", "float64", "float16", "bfloat16"), specials=False, large=False, codes=True):
    """(q, k, v, kwargs) for one random problem of npattn.sdpa's whole contract:
    ranks 2 to 6 with broadcast batch dims, GQA groups, empty sizes, every layout
    of helpers.LAYOUTS, float dtypes (mixed now and then), every mask kind and
    broadcast shape, sinks, scale (extremes included), window, softcap,
    positions, return_lse and threads; in one case in four, per-request key ranges
    and positions (k_start, k_lengths, an int-array q_offset: _per_request_options);
    precision in three in ten; with `codes` (and no `specials`), in one in five, k or v
    or both 8-bit codes with their scales (_with_codes: every format, grouping and
    scale dtype, zero points).
    `large`: now and then model-sized decode and prefill.

    `specials`: NaN and infinities in q, k, v, and every key visible (every key of
    each request's range, where there are ranges; the rest are never read). So that each
    result has one right answer, every finite logit then lies within 2 * 1.5**2 *
    sqrt(D) <= 51 of its row's largest (finite values within SPECIAL_SIZE, |scale| at
    most 1/sqrt(D), sinks within 4): no weight comes near float32's underflow (e**-87),
    where a weight of 0 times an infinity of v would give NaN in one precision and
    inf in the other."""
    names = [n for n in dtypes if n != "bfloat16" or _has_ml_dtypes()]
    dtype = np.dtype(dtype_of(rng.choice(names)))
    mixed = rng.random() < 0.15
    batch = tuple(int(b) for b in rng.integers(0, 4, size=rng.integers(0, 3)))
    H_kv = int(rng.integers(1, 4))
    H_q = H_kv * int(rng.integers(0, 4))
    L, S = int(rng.integers(0, 12)), int(rng.integers(0, 12))
    D, D_v = int(rng.integers(1, 12)), int(rng.integers(0, 9))
    if large and rng.random() < 0.2:
        H_kv, H_q = 2, 14
        L, S = (1, int(rng.integers(100, 3000))) if rng.random() < 0.5 else (int(rng.integers(30, 150)),) * 2
        D = D_v = int(rng.choice([64, 128]))
    shapes = {
        "q": (*_operand_batch(rng, batch), H_q, L, D),
        "k": (*_operand_batch(rng, batch), H_kv, S, D),
        "v": (*_operand_batch(rng, batch), H_kv, S, D_v),
    }
    if not batch and H_q == H_kv == 1 and rng.random() < 0.3:
        shapes = {name: shape[-2:] for name, shape in shapes.items()}  # the rank-2 form
    arrays, kinds = [], []
    for name in "qkv":
        dt = np.dtype(dtype_of(rng.choice(names))) if mixed else dtype
        kind = rng.choice(["contiguous", "contiguous", *(k for k in LAYOUTS if layout_fits(k, len(shapes[name])))])
        arrays.append(_values(rng, shapes[name], dt, kind, int(rng.integers(1, 3)) if specials else 0))
        kinds.append(str(kind))
    q, k, v = arrays

    kwargs = {}
    kind = None if specials else rng.choice(["causal", "causal_top_left", None, "bool", "additive", "default"])
    if kind in ("bool", "additive"):
        full = np.broadcast_shapes(shapes["q"][:-3], shapes["k"][:-3], shapes["v"][:-3]) + (H_q, L, S)
        shape = [n if rng.random() < 0.6 else 1 for n in full]
        shape = tuple(shape[rng.integers(0, len(shape)) :])  # an array, never a scalar
        mask_dtype = dtype_of(rng.choice(names + ["float64"]))
        kwargs["mask"] = make_mask(rng, kind, shape, mask_dtype)
        if rng.random() < 0.3 and len(shape) >= 2:
            kwargs["mask"] = kwargs["mask"].swapaxes(-1, -2).copy().swapaxes(-1, -2)  # Fortran-like strides
    elif kind != "default":
        kwargs["mask"] = kind
    if rng.random() < 0.3:
        kwargs["sinks"] = rng.uniform(-4, 4, H_q).astype(rng.choice([np.float32, np.float64]))
    r = rng.random()
    if r < 0.3:
        kwargs["scale"] = float(rng.uniform(-3, 3))
    elif r < 0.35:
        kwargs["scale"] = float(rng.choice([0.0, 1e-40, -1e-30, 1e30, 3e38, 1e-300]))
    if rng.random() < 0.3:
        left, right = (None if rng.random() < 0.3 else int(rng.integers(0, 12)) for _ in range(2))
        kwargs["window"] = (left, right)
    if specials and "scale" in kwargs:
        kwargs["scale"] = float(np.clip(kwargs["scale"], -1, 1)) / np.sqrt(D)
    if rng.random() < 0.2:
        kwargs["softcap"] = float(rng.choice([0.5, 5.0, 30.0, 1e6]))
    if rng.random() < 0.3 and not (isinstance(kwargs.get("mask"), str) and kwargs["mask"] == "causal_top_left"):
        kwargs["q_offset"] = int(rng.integers(-20, 20)) if rng.random() < 0.9 else int(rng.choice([-(2**62), 2**62]))
    if rng.random() < 0.2:
        kwargs["k_offset"] = int(rng.integers(-20, 20))
    kwargs["return_lse"] = bool(rng.random() < 0.3)
    kwargs["threads"] = int(rng.integers(1, 5))
    if rng.random() < 0.25:  # drawn last, so that the draws above are those of 0.2's problems
        B = np.broadcast_shapes(*(shape[:-3] for shape in shapes.values()))
        top_left = isinstance(kwargs.get("mask"), str) and kwargs["mask"] == "causal_top_left"
        kwargs.update(_per_request_options(rng, B, S, q_offset_allowed=not top_left))
    if rng.random() < 0.3:  # drawn after the ranges, so that those draws stay as they were
        kwargs["precision"] = str(rng.choice(["highest", "fast"]))
    if codes and not specials and _has_ml_dtypes() and rng.random() < 0.2:  # drawn last, likewise
        q, k, v = _with_codes(rng, (q, k, v), kinds, kwargs)
    return q, k, v, kwargs


def _has_ml_dtypes():
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    return True
