"""SPEC section 10: npattn.dask.sdpa over Dask arrays equals npattn.sdpa on the
whole arrays for every chunking (ragged, GQA groups split by chunks, masks,
windows, softcap, sinks, positions, lse), holds no L x S block, runs on a
distributed.LocalCluster of worker processes, and recovers from a worker
killed mid-computation. The module skips without dask and distributed."""

import os

import numpy as np
import pytest

import npattn
from helpers import make_mask, own_tolerance, qkv, run_script

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")
nd = pytest.importorskip("npattn.dask")


def whole_vs_chunked(q, k, v, q_chunks, kv_chunks, scheduler="sync", mask_chunks=None, **kwargs):
    """npattn.dask.sdpa on chunked copies == npattn.sdpa on the arrays (out and lse), within
    npattn's own tolerance; returns the Dask result."""
    want, want_lse = npattn.sdpa(q, k, v, return_lse=True, **kwargs)
    dk = dict(kwargs)
    if mask_chunks is not None:
        dk["mask"] = da.from_array(kwargs["mask"], chunks=mask_chunks)
    out, lse = nd.sdpa(
        da.from_array(q, chunks=q_chunks),
        da.from_array(k, chunks=kv_chunks),
        da.from_array(v, chunks=kv_chunks),
        return_lse=True,
        **dk,
    )
    assert out.dtype == want.dtype and lse.dtype == want_lse.dtype
    assert out.shape == want.shape and lse.shape == want_lse.shape
    got, got_lse = dask.compute(out, lse, scheduler=scheduler)
    assert got.dtype == want.dtype
    bound = ("scale", "mask", "sinks", "softcap", "k_start", "k_lengths")
    rtol, atol = own_tolerance(q, k, v, want.dtype, **{x: kwargs.get(x) for x in bound})
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=2 * atol)
    np.testing.assert_array_equal(np.isinf(got_lse), np.isinf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(got_lse[finite], want_lse[finite], rtol=1e-5 if want.dtype != np.float64 else 1e-12)
    return out


CHUNKINGS = {
    "one block": ((2, 6, 37, 8), (2, 2, 101, 8)),
    "ragged rows and keys": ((1, 6, 10, 8), (1, 2, 23, 8)),
    "a group split by head chunks": ((1, 2, 37, 8), (2, 1, 50, 8)),
    "one key per chunk": ((2, 3, 37, 8), (2, 1, 1, 8)),
    "batch and heads": ((1, 3, 40, 8), (1, 1, 101, 8)),
}


RANGES = [
    {"k_start": [0, 5, 90], "k_lengths": [101, 12, 11]},  # whole, inside a chunk, at the end
    {"k_lengths": [3, 101, 0]},  # right-padded, one empty
    {"k_start": [10, 0, 101]},  # to the end, one empty at S
    {"q_offset": [0, 5, 60]},  # per-request positions only
    {"k_start": 7, "k_lengths": [9, 40, 94], "q_offset": [3, 4, 200], "k_offset": 11},
]


# every mask kind with every range (causal_top_left means q_offset=0: not with one given)
MASKED_RANGES = [
    (m, r) for m in ("causal", "causal_top_left", None) for r in RANGES if m != "causal_top_left" or "q_offset" not in r
]


@pytest.mark.parametrize("chunking", CHUNKINGS, ids=str)
@pytest.mark.parametrize("mask, ranges", MASKED_RANGES, ids=str)
def test_per_request_ranges(rng, chunking, mask, ranges):
    """k_start, k_lengths and an int-array q_offset: each request's range cut to each key
    chunk, its positions kept; with a window and sinks too."""
    q_chunks, kv_chunks = CHUNKINGS[chunking]
    q, k, v = qkv(rng, (3,), 6, 2, 37, 101, 8, 8)
    q_chunks, kv_chunks = (min(q_chunks[0], 3), *q_chunks[1:]), (min(kv_chunks[0], 3), *kv_chunks[1:])
    whole_vs_chunked(q, k, v, q_chunks, kv_chunks, mask=mask, **ranges)
    whole_vs_chunked(q, k, v, q_chunks, kv_chunks, mask=mask, window=(6, 0), sinks=rng.standard_normal(6), **ranges)


def test_ranges_are_checked_against_the_whole_cache(rng):
    q, k, v = qkv(rng, (2,), 2, 1, 3, 20, 4, 4)
    chunked = [da.from_array(x, chunks=(1, 1, 7, 4)) for x in (q, k, v)]
    with pytest.raises(ValueError, match=r"k_lengths\[1\] = 21 runs past S = 20"):
        nd.sdpa(*chunked, k_lengths=[3, 21])
    with pytest.raises(ValueError, match=r"k_start\[0\] = -1"):
        nd.sdpa(*chunked, k_start=[-1, 0])


@pytest.mark.parametrize("chunking", CHUNKINGS, ids=str)
@pytest.mark.parametrize("mask", ["causal", "causal_top_left", None], ids=str)
def test_every_chunking(rng, chunking, mask):
    q, k, v = qkv(rng, (2,), 6, 2, 37, 101, 8)
    whole_vs_chunked(q, k, v, *CHUNKINGS[chunking], mask=mask)


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("dask_mask", [False, True])
def test_array_masks(rng, kind, dask_mask):
    """A NumPy or Dask mask, broadcast along the batch, chunked like the scores or not."""
    q, k, v = qkv(rng, (2,), 4, 2, 30, 70, 8)
    mask = make_mask(rng, kind, (4, 30, 70), empty_rows=False)
    whole_vs_chunked(q, k, v, (1, 2, 11, 8), (2, 1, 20, 8), mask=mask, mask_chunks=(1, 13, 31) if dask_mask else None)


@pytest.mark.parametrize(
    "options",
    [
        {"window": (7, 2)},
        {"softcap": 3.0, "sinks": np.array([0.5, -1.0, 2.0, 0.0])},
        {"q_offset": 50, "k_offset": 10, "scale": 0.4},
        {"window": (None, 0), "mask": None, "sinks": np.ones(4)},
    ],
    ids=str,
)
def test_options(rng, options):
    q, k, v = qkv(rng, (1,), 4, 2, 25, 90, 8)
    whole_vs_chunked(q, k, v, (1, 2, 8, 8), (1, 1, 17, 8), **options)


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_dtypes(rng, dtype):
    q, k, v = qkv(rng, (1,), 4, 2, 20, 50, 8, dtype=dtype)
    whole_vs_chunked(q, k, v, (1, 2, 7, 8), (1, 1, 13, 8))


def test_rank_2_and_empty(rng):
    q, k, v = qkv(rng, (), 1, 1, 9, 30, 4)
    whole_vs_chunked(q[0], k[0], v[0], (4, 4), (7, 4))
    whole_vs_chunked(q[..., :0, :], k, v, (1, 0, 4), (1, 7, 4))
    whole_vs_chunked(q, k[..., :0, :], v[..., :0, :], (1, 4, 4), (1, 0, 4), sinks=[1.0])


@pytest.mark.parametrize(
    "batch, H_q, H_kv, chunks",
    [((1,), 0, 2, 1), ((1,), 0, 2, 2), ((0,), 4, 2, 1), ((0, 3), 2, 1, 2), ((2,), 4, 2, 1)],
    ids=["H_q=0, one head a chunk", "H_q=0, two heads a chunk", "empty batch", "empty batch, rank 5", "L=0"],
)
@pytest.mark.parametrize("mask", ["causal", "bool", "additive"])
def test_no_query_row_gives_the_empty_result(rng, batch, H_q, H_kv, chunks, mask):
    """H_q = 0, an empty batch or L = 0, with a NumPy mask too: the empty results of
    npattn.sdpa, as Dask arrays."""
    L = 0 if batch == (2,) else 4
    q, k, v = qkv(rng, batch, H_q, H_kv, L, 5, 8)
    m = make_mask(rng, mask, (*batch, H_q, L, 5))
    want, want_lse = npattn.sdpa(q, k, v, mask=m, return_lse=True)
    out, lse = nd.sdpa(da.from_array(q, chunks=chunks), da.from_array(k, chunks=chunks), v, mask=m, return_lse=True)
    got, got_lse = dask.compute(out, lse, scheduler="sync")
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    assert (got_lse.shape, got_lse.dtype) == (want_lse.shape, want_lse.dtype)


@pytest.mark.parametrize("name", ["q", "k", "v", "mask"])
def test_unknown_chunk_sizes_are_named(rng, name):
    """A Dask array with nan chunk sizes (after boolean indexing): a ValueError naming
    the argument and compute_chunk_sizes(), before any task runs."""
    q, k, v = qkv(rng, (1,), 2, 1, 6, 6, 4)
    arrays = {"q": q, "k": k, "v": v, "mask": np.ones((6, 6), bool)}
    rows = da.from_array(np.ones(6, bool), chunks=3)
    arrays[name] = da.from_array(arrays[name], chunks=3)[..., rows, :]  # every row kept, their count unknown
    assert np.isnan(arrays[name].shape[-2])
    with pytest.raises(ValueError, match=rf"^sdpa: {name} has unknown \(nan\) chunk sizes along axis .*"
                       rf"call {name}\.compute_chunk_sizes\(\) first"):  # fmt: skip
        nd.sdpa(arrays["q"], arrays["k"], arrays["v"], mask=arrays["mask"])


TOP = 2**63 - 1


@pytest.mark.parametrize(
    "offsets",
    [
        {"q_offset": TOP - 5, "mask": None, "window": (3, 1)},
        {"q_offset": TOP, "k_offset": TOP - 20, "window": (7, 0)},
        {"q_offset": 0, "k_offset": TOP - 5, "mask": None},
        {"q_offset": -TOP, "k_offset": -TOP + 3},
    ],
    ids=str,
)
def test_offsets_near_int64_s_end(rng, offsets):
    """q_offset and k_offset near 2**63 - 1 (valid for sdpa): each chunk's positions pass
    2**63 - 1, yet the chunked call computes and equals the whole one."""
    q, k, v = qkv(rng, (1,), 2, 1, 10, 24, 8)
    whole_vs_chunked(q, k, v, (1, 2, 3, 8), (1, 1, 5, 8), **offsets)


def test_errors_are_sdpa_s():
    q = da.zeros((1, 3, 4, 8), chunks=2)
    k = da.zeros((1, 2, 5, 8), chunks=2)
    with pytest.raises(ValueError, match=r"^sdpa: .*multiple"):
        nd.sdpa(q, k, k)
    with pytest.raises(ValueError, match=r"^sdpa: mask must broadcast"):
        nd.sdpa(q[:, :2], k, k, mask=np.ones((3, 5), bool))
    with pytest.raises(ValueError, match="split_every"):
        nd.sdpa(q[:, :2], k, k, split_every=1)


def test_threads_reach_every_task(rng, monkeypatch):
    """threads=2 is what each of the 8 partial calls gets, not only the first."""
    calls = []

    def recording(*args, **kwargs):
        calls.append(kwargs.get("threads"))
        return npattn.sdpa(*args, **kwargs)

    monkeypatch.setattr(nd, "_sdpa", recording)
    q, k, v = qkv(rng, (1,), 2, 1, 8, 32, 8)
    nd.sdpa(da.from_array(q, chunks=(1, 2, 4, 8)), da.from_array(k, chunks=(1, 1, 8, 8)), v, threads=2).compute(
        scheduler="sync"
    )
    assert calls == [2] * 9  # the up-front check, then 2 row chunks x 4 key chunks


def test_no_task_holds_an_l_by_s_block(rng):
    """Every result in the graph, recorded as it is computed, is smaller than one L x S
    block of scores (here L = 64, S = 512, chunks of 16 rows and 64 keys)."""
    from dask.callbacks import Callback

    q, k, v = qkv(rng, (1,), 2, 1, 64, 512, 16)
    sizes = []

    class Record(Callback):
        def _posttask(self, key, result, dsk, state, id):
            sizes.append(getattr(result, "size", 0))

    out = nd.sdpa(da.from_array(q, chunks=(1, 2, 16, 16)), da.from_array(k, chunks=(1, 1, 64, 16)), v)
    with Record():
        got = out.compute(scheduler="sync")
    np.testing.assert_allclose(got, npattn.sdpa(q, k, v), rtol=1e-5, atol=1e-5)
    assert max(sizes) < 64 * 512, max(sizes)
    assert len(sizes) > 8 * 4  # 8 key chunks for each of 4 row chunks, and their merges


@pytest.fixture(scope="module")
def cluster():
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, silence_logs=40
    ) as c:
        with distributed.Client(c) as client:
            yield client


def test_on_a_cluster_of_worker_processes(rng, cluster):
    """64 keys in 8 chunks, two worker processes: the same answer; each task ran with the
    one thread its worker grants it."""
    q, k, v = qkv(rng, (2,), 4, 2, 24, 64, 8)
    whole_vs_chunked(q, k, v, (1, 2, 8, 8), (1, 1, 8, 8), scheduler=cluster.get, window=(20, 0))
    workers = list(cluster.scheduler_info()["workers"])
    granted = cluster.gather([cluster.submit(nd._task_threads, pure=False, workers=[w]) for w in workers])
    assert granted == [1, 1]  # Dask's nanny starts workers with OMP_NUM_THREADS=1


def kill_once(block, flag):
    """The first task to run this kills its worker process; later ones pass the block on."""
    from distributed import get_worker

    get_worker()  # a task on a worker, never this process
    if not os.path.exists(flag):
        open(flag, "w").close()
        os._exit(1)
    return block


def test_a_killed_worker_is_recovered(rng, cluster, tmp_path):
    """A worker process dies mid-computation; Dask reruns its tasks elsewhere and the
    result is still exact."""
    q, k, v = qkv(rng, (1,), 4, 2, 16, 48, 8)
    flag = str(tmp_path / "killed")
    dq = da.from_array(q, chunks=(1, 2, 8, 8)).map_blocks(kill_once, flag, meta=np.empty((0,) * 4, q.dtype))
    out = nd.sdpa(dq, da.from_array(k, chunks=(1, 1, 12, 8)), da.from_array(v, chunks=(1, 1, 12, 8)))
    got = cluster.compute(out).result(timeout=120)
    assert os.path.exists(flag)
    np.testing.assert_allclose(got, npattn.sdpa(q, k, v), rtol=1e-5, atol=1e-5)


def test_import_npattn_never_imports_dask():
    result = run_script("import sys, npattn; print('dask' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
