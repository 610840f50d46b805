"""The systems timed, one small class each: how to tell it the thread count,
how to hand it arrays, and how to call its attention (and its backward pass).

Every system computes the same thing: float32, causal with positions aligned
to the bottom-right corner (MLX's and npattn's "causal"; PyTorch, JAX, ONNX's
Attention and OpenVINO's opset-13 SDPA get their causal flag only where L == S,
since theirs is top-left, and an explicit bottom-right bool mask otherwise;
ONNX Runtime's GroupQueryAttention and OpenVINO's KV-cache form take the first
S - L keys as the past, which makes their causal flag bottom-right), scale
1/sqrt(D).

ONNX Runtime and OpenVINO run one-node models built here; what their timed
region holds is in each class's docstring (benchmarks/README.md has the table).
Where a layout has to change (ONNX Runtime's BSNH inputs, the past/new split of
the KV-cache forms), it changes once per case, on the first (warm-up) call,
outside the clock.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

LABELS = {
    "npattn": "npattn",
    "numpy": "NumPy",
    "torch": "PyTorch",
    "mlx": "MLX",
    "jax": "JAX",
    "ort-gqa": "ORT GQA",
    "ort-attention": "ORT Attention",
    "openvino-sdpa": "OpenVINO SDPA",
    "openvino-kv": "OpenVINO KV cache",
}


def bottom_right(L: int, S: int) -> np.ndarray:
    """True where query i sees key j: j <= i + S - L."""
    return np.tri(L, S, S - L, dtype=bool)


class System:
    name = ""
    package = ""

    @property
    def label(self) -> str:
        return LABELS[self.name]

    def version(self) -> str | None:
        """The installed version, or None when the system is missing."""
        if importlib.util.find_spec(self.package) is None:
            return None
        try:
            return importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:
            return "?"

    def set_threads(self, threads: int) -> dict:
        """Tell the system its thread count where it has a knob; report what it says."""
        return {}

    def native(self, x: np.ndarray) -> Any:
        """A NumPy input as this system's array, outside the clock."""
        return x

    def attention(self, L: int, S: int, threads: int, window=None, softcap=None, causal=True) -> Callable:
        """f(q, k, v) -> the result, computed and waited for, on native arrays."""
        raise NotImplementedError

    def to_numpy(self, out: Any) -> np.ndarray:
        return np.asarray(out)


class Npattn(System):
    name = package = "npattn"

    def attention(self, L, S, threads, window=None, softcap=None, causal=True):
        import npattn

        mask = "causal" if causal else None
        return partial(npattn.sdpa, mask=mask, window=window, softcap=softcap, threads=threads)

    def backward(self, threads):
        """(forward, backward): forward(q, k, v) -> (out, lse); backward(dout, q, k, v, out, lse) -> grads."""
        import npattn

        return (
            partial(npattn.sdpa, return_lse=True, threads=threads),
            partial(npattn.sdpa_backward, threads=threads),
        )


class Numpy(System):
    """The tutorial's formula (npattn.reference.formula), NumPy's own BLAS limited to T threads."""

    name = package = "numpy"

    def attention(self, L, S, threads, window=None, softcap=None, causal=True):
        from npattn.reference import causal_mask, formula

        mask = causal_mask(L, S, np.float32) if causal and L > 1 else None  # decode sees every key
        return partial(formula, mask=mask)


class Torch(System):
    name = package = "torch"

    def set_threads(self, threads):
        import torch

        torch.set_num_threads(threads)
        return {"torch.get_num_threads()": torch.get_num_threads()}

    def native(self, x):
        import torch

        return torch.from_numpy(x)

    def attention(self, L, S, threads, window=None, softcap=None, causal=True):
        import torch
        import torch.nn.functional as F

        kw: dict[str, Any] = {"enable_gqa": True}
        if causal and L == S:
            kw["is_causal"] = True
        elif causal and L > 1:
            kw["attn_mask"] = torch.from_numpy(bottom_right(L, S))

        def call(q, k, v):
            with torch.inference_mode():
                return F.scaled_dot_product_attention(q, k, v, **kw)

        return call

    def to_numpy(self, out):
        return out.detach().numpy()

    def backward(self, threads):
        """Autograd through F.scaled_dot_product_attention (its CPU flash backward)."""
        import torch.nn.functional as F

        def forward(q, k, v):
            q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[-3] != k.shape[-3])
            return out, (q, k, v)

        def backward(dout, q, k, v, out, saved):
            out.backward(dout)
            return tuple(x.grad for x in saved)

        return forward, backward


class Mlx(System):
    name = "mlx"
    package = "mlx"

    def native(self, x):
        import mlx.core as mx

        mx.set_default_device(mx.cpu)
        a = mx.array(x)
        mx.eval(a)
        return a

    def attention(self, L, S, threads, window=None, softcap=None, causal=True):
        import mlx.core as mx

        mask = "causal" if causal and L > 1 else None  # MLX's "causal" is bottom-right

        def call(q, k, v):
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask=mask)
            mx.eval(out)
            return out

        return call


class Jax(System):
    name = package = "jax"

    def set_threads(self, threads):
        return {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}

    def native(self, x):
        import jax
        import jax.numpy as jnp

        # JAX's layout is (B, T, N, H): transpose once, outside the clock
        return jax.device_put(jnp.asarray(x.transpose(0, 2, 1, 3)), jax.devices("cpu")[0])

    def attention(self, L, S, threads, window=None, softcap=None, causal=True):
        import jax
        import jax.numpy as jnp

        kw: dict[str, Any] = {}
        if causal and L == S:
            kw["is_causal"] = True
        elif causal and L > 1:
            kw["mask"] = jnp.asarray(bottom_right(L, S)[None, None])
        compiled = {}

        def call(q, k, v):
            if q.shape not in compiled:
                compiled[q.shape] = jax.jit(partial(jax.nn.dot_product_attention, **kw)).lower(q, k, v).compile()
            return compiled[q.shape](q, k, v).block_until_ready()

        return call

    def to_numpy(self, out):
        return np.asarray(out).transpose(0, 2, 1, 3)


def prepared(prepare: Callable) -> Callable:
    """f(q, k, v) -> prepare(q, k, v), computed once per (q, k, v) and kept: the
    layout a system needs, made on the warm-up call, outside the clock."""
    cache: dict = {}

    def get(q, k, v):
        key = (id(q), id(k), id(v))
        if key not in cache:
            cache.clear()
            cache[key] = (q, k, v, prepare(q, k, v))  # the arrays held, so their ids stay theirs
        return cache[key][3]

    return get


def onnx_session(node, inputs: list, outputs: list, threads: int, opsets: dict) -> Any:
    """An ONNX Runtime CPU session of the one-node model node(inputs) -> outputs."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    types = {
        np.dtype(np.float32): TensorProto.FLOAT,
        np.dtype(np.int32): TensorProto.INT32,
        np.dtype(bool): TensorProto.BOOL,
    }
    graph = helper.make_graph(
        [node],
        "attention",
        [helper.make_tensor_value_info(name, types[np.dtype(t)], None) for name, t in inputs],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


class OrtGqa(System):
    """ONNX Runtime's GroupQueryAttention (com.microsoft), the op its LLM exports use.

    Timed: session.run with q as (B, L, H_q * D), the last L keys and values as
    (B, L, H_kv * D) and the first S - L as past_key/past_value (B, H_kv, S - L, D).
    The op always writes present_key/present_value (past and new, S rows), so a
    copy of the whole cache is inside the clock. Causal only, bottom-right (the
    queries are the last L positions); D must be a multiple of 8."""

    name, package = "ort-gqa", "onnxruntime"

    def attention(self, L, S, threads, window=None, softcap=None, causal=True):
        from onnx import helper

        if not causal or window or softcap:
            raise NotImplementedError("GroupQueryAttention is causal, here without window or softcap")
        sessions: dict = {}

        def bsnh(x):  # (B, H, T, D) -> (B, T, H * D)
            return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(x.shape[0], x.shape[2], -1)

        def prepare(q, k, v):
            (B, H_q, _, D), H_kv, past = q.shape, k.shape[1], S - L
            if (H_q, H_kv) not in sessions:
                names = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"]
                node = helper.make_node(
                    "GroupQueryAttention", names, ["output", "present_key", "present_value"],
                    domain="com.microsoft", num_heads=H_q, kv_num_heads=H_kv, scale=D**-0.5,
                )  # fmt: skip
                kinds = [np.float32] * 5 + [np.int32] * 2
                outputs = ["output", "present_key", "present_value"]
                sessions[H_q, H_kv] = onnx_session(
                    node, list(zip(names, kinds)), outputs, threads, {"": 21, "com.microsoft": 1}
                )
            feeds = {
                "query": bsnh(q),
                "key": bsnh(k[:, :, past:]),
                "value": bsnh(v[:, :, past:]),
                "past_key": np.ascontiguousarray(k[:, :, :past]),
                "past_value": np.ascontiguousarray(v[:, :, :past]),
                "seqlens_k": np.full(B, S - 1, np.int32),
                "total_sequence_length": np.array(S, np.int32),
            }
            return sessions[H_q, H_kv], feeds, (B, L, H_q, D)

        ready = prepared(prepare)

        def call(q, k, v):
            session, feeds, shape = ready(q, k, v)
            return session.run(["output"], feeds)[0].reshape(shape)

        return call

    def to_numpy(self, out):
        return np.ascontiguousarray(out.transpose(0, 2, 1, 3))


class OrtAttention(System):
    """ONNX Runtime running the ONNX opset-23 Attention op, on (B, H, T, D) inputs.

    Timed: session.run on q, k, v as they are (GQA by the op's own head rule),
    with is_causal=1 where L == S and otherwise, for L > 1, a (L, S) bool mask
    input (its is_causal is top-left)."""

    name, package = "ort-attention", "onnxruntime"

    def attention(self, L, S, threads, window=None, softcap=None, causal=True):
        from onnx import helper

        if window:
            raise NotImplementedError("no window in ONNX's Attention")
        attrs = {"is_causal": 1} if causal and L == S else {}
        if softcap:
            attrs["softcap"] = float(softcap)
        mask = bottom_right(L, S) if causal and 1 < L != S else None
        sessions: dict = {}

        def call(q, k, v):
            D = q.shape[-1]
            if D not in sessions:
                names = ["Q", "K", "V"] + (["M"] if mask is not None else [])
                node = helper.make_node("Attention", names, ["Y"], scale=D**-0.5, **attrs)
                kinds = [np.float32] * 3 + [bool]
                sessions[D] = onnx_session(node, list(zip(names, kinds)), ["Y"], threads, {"": 23})
            feeds = {"Q": q, "K": k, "V": v}
            if mask is not None:
                feeds["M"] = mask
            return sessions[D].run(None, feeds)[0]

        return call


def openvino_config(threads: int) -> dict:
    """float32 throughout (the CPU plugin would pick bf16 where the CPU has it, and
    a u8 or f16 KV cache), on `threads` threads."""
    return {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}


def openvino_grouped(x, H_kv: int, group: int, D: int):
    """(B, H_kv, S, D) -> (B, H_kv * group, S, D): each key/value head repeated for its
    group, the Unsqueeze-Broadcast-Reshape pattern of exported models, which the
    CPU plugin folds into its SDPA node (opset-13 SDPA itself refuses H_kv != H_q)."""
    import openvino.opset3 as op3
    import openvino.opset13 as op

    if group == 1:
        return x
    wide = op3.broadcast(
        op.unsqueeze(x, op.constant(np.array([2], np.int64))),
        op.constant(np.array([1, 1, group, 1, 1], np.int64)),
        broadcast_spec="BIDIRECTIONAL",
    )
    return op.reshape(wide, op.constant(np.array([0, H_kv * group, -1, D], np.int64)), special_zero=True)


class OpenvinoSdpa(System):
    """OpenVINO's opset-13 scaled_dot_product_attention on the CPU plugin, one node
    (with the grouping pattern for GQA) on (B, H, T, D) inputs.

    Timed: a compiled model's infer request on q, k, v, with causal=True where
    L == S and otherwise, for L > 1, a (L, S) bool mask input (its causal flag is
    top-left); the result is the request's own output tensor."""

    name, package = "openvino-sdpa", "openvino"

    def set_threads(self, threads):
        return {"openvino": openvino_config(threads)}

    def attention(self, L, S, threads, window=None, softcap=None, causal=True):
        import openvino as ov
        import openvino.opset13 as op

        if window or softcap:
            raise NotImplementedError("no window or softcap in opset-13 SDPA")
        mask = bottom_right(L, S) if causal and 1 < L != S else None
        requests: dict = {}

        def call(q, k, v):
            if q.shape not in requests:
                (B, H_q, _, D), H_kv = q.shape, k.shape[1]
                Q = op.parameter([B, H_q, L, D], np.float32)
                K, V = (op.parameter([B, H_kv, S, D], np.float32) for _ in range(2))
                params = [Q, K, V] + ([op.parameter([L, S], np.bool_)] if mask is not None else [])
                args = [Q, *(openvino_grouped(x, H_kv, H_q // H_kv, D) for x in (K, V)), *params[3:]]
                node = op.scaled_dot_product_attention(*args, causal=causal and L == S)
                compiled = ov.Core().compile_model(ov.Model([node], params), "CPU", openvino_config(threads))
                requests[q.shape] = compiled.create_infer_request()
            request = requests[q.shape]
            request.infer([q, k, v] + ([mask] if mask is not None else []), share_inputs=True, share_outputs=True)
            return request.get_output_tensor(0).data

        return call

    def to_numpy(self, out):
        return np.array(out)  # the request's output tensor, which the next call overwrites


class OpenvinoKv(System):
    """OpenVINO's stateful KV-cache pattern (ReadValue, Gather by beam index, Concat,
    Assign around opset-13 SDPA), the form the CPU plugin fuses into its own SDPA
    node with the cache inside it.

    Before each timed call, outside the clock, the state is set to the first S - L
    keys and values. Timed: one infer request on q and the last L keys and values:
    appending them to the state's cache, and attention over all S; the plugin also
    takes the state it was given into its own cache layout there. (Filling the
    cache through the model instead would be a prefill of S - L queries: the
    fused node wants as many new keys as queries.) Its causal flag counts the
    cached keys, so it is bottom-right."""

    name, package = "openvino-kv", "openvino"

    def set_threads(self, threads):
        return {"openvino": openvino_config(threads)}

    def attention(self, L, S, threads, window=None, softcap=None, causal=True):
        import openvino as ov
        import openvino.opset6 as op6
        import openvino.opset13 as op

        if window or softcap:
            raise NotImplementedError("no window or softcap in opset-13 SDPA")
        past = S - L
        requests: dict = {}

        def compile_for(B, H_q, H_kv, D):
            Q = op.parameter([B, H_q, -1, D], np.float32)
            K, V = (op.parameter([B, H_kv, -1, D], np.float32) for _ in range(2))
            beam = op.parameter([B], np.int32)
            empty = op.constant(np.zeros((B, H_kv, 0, D), np.float32))
            assigns, present = [], []
            for name, new in (("past_key", K), ("past_value", V)):
                cached = op6.read_value(empty, name, np.float32, [B, H_kv, -1, D])
                joined = op.concat([op.gather(cached, beam, op.constant(np.int64(0))), new], 2)
                assigns.append(op6.assign(joined, name))
                present.append(openvino_grouped(joined, H_kv, H_q // H_kv, D))
            node = op.scaled_dot_product_attention(Q, *present, causal=causal)
            model = ov.Model([node.output(0)], assigns, [Q, K, V, beam])
            return ov.Core().compile_model(model, "CPU", openvino_config(threads)).create_infer_request()

        def prepare(q, k, v):
            (B, H_q, _, D), H_kv = q.shape, k.shape[1]
            if q.shape not in requests:
                requests[q.shape] = compile_for(B, H_q, H_kv, D)
            pasts = {"past_key": ov.Tensor(np.ascontiguousarray(k[:, :, :past])),
                     "past_value": ov.Tensor(np.ascontiguousarray(v[:, :, :past]))}  # fmt: skip
            feeds = [
                q,
                np.ascontiguousarray(k[:, :, past:]),
                np.ascontiguousarray(v[:, :, past:]),
                np.arange(B, dtype=np.int32),
            ]
            return requests[q.shape], pasts, feeds

        ready = prepared(prepare)

        def reset(q, k, v):
            request, pasts, feeds = ready(q, k, v)
            for state in request.query_state():
                state.state = pasts[state.name]
            return request, feeds

        def call(q, k, v):
            request, feeds = reset(q, k, v)
            request.infer(feeds, share_inputs=True, share_outputs=True)
            return request.get_output_tensor(0).data

        def timed(q, k, v):
            """Seconds of one call, the state reset outside the clock."""
            request, feeds = reset(q, k, v)
            start = time.perf_counter()
            request.infer(feeds, share_inputs=True, share_outputs=True)
            return time.perf_counter() - start

        call.timed = timed
        return call

    def to_numpy(self, out):
        return np.array(out)


SYSTEMS = {
    s.name: s
    for s in (Npattn(), Numpy(), Torch(), Mlx(), Jax(), OrtGqa(), OrtAttention(), OpenvinoSdpa(), OpenvinoKv())
}
