"""Prefill attention: choosing the implementation, and the cuDNN path.

On the CPU: the choice ("auto" -> blockwise, "cudnn" -> a clear error, the version guard and the
public fallback's limits, with the device check patched), and the cuDNN path's plumbing (packed
offsets, the two-call merge over a cached context, the softmax-stats layout) run against a dense
jnp stand-in for jax's cuDNN module that implements the contract the layer assumes. On a GPU
(marked cuda): the layer on the real cuDNN attention against the float32 reference, and the
public fallback.
"""

from __future__ import annotations

import enum
import functools
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import load_script
from test_layer import TOLERANCE, Run, packed_first_chunks, packed_with_context, run_and_check

import jax_kimi_mla
from jax_kimi_mla import layer as ml
from jax_kimi_mla import prefill_attention as pa


class FakeCudnn:
    """Dense jnp stand-in for ``jax._src.cudnn.fused_attention_stablehlo`` with batch 1 and the
    BTNH layout, as the layer calls it: padding / causal masks, packed segments given by
    q_offsets / q_seqlen ([1, M + 1] / [1, M], -1 = left out, live ones compacted to the front),
    causal top-left within a segment; softmax stats [live segments or 1, N, T] (segment j's row l
    at [j, :, l]). Rows that see no key are NaN, like memory nobody wrote."""

    class MaskType(enum.Enum):
        NO_MASK = 0
        PADDING = 1
        CAUSAL = 2
        PADDING_CAUSAL = 3

    calls = []

    @classmethod
    def dot_product_attention(cls, query, key, value, bias=None, mask=None, q_seqlen=None, kv_seqlen=None, q_offsets=None,
                              kv_offsets=None, *, scale=1.0, mask_type, qkv_layout="BTNH", return_residual=False):
        assert qkv_layout == "BTNH" and query.shape[0] == 1 and bias is None and mask is None
        cls.calls.append((mask_type, q_offsets is not None, value.shape[-1]))
        q, k, v = (a[0].astype(jnp.float32) for a in (query, key, value))
        T, S = q.shape[0], k.shape[0]
        causal = mask_type in (cls.MaskType.CAUSAL, cls.MaskType.PADDING_CAUSAL)
        qi, kj = jnp.arange(T), jnp.arange(S)
        if q_offsets is None:
            q_len = T if q_seqlen is None else q_seqlen[0]
            k_len = S if kv_seqlen is None else kv_seqlen[0]
            seg_q, loc_q = jnp.where(qi < q_len, 0, -1), qi
            seg_k, loc_k = jnp.where(kj < k_len, 0, -2), kj
            starts, lens = jnp.zeros(1, jnp.int32), jnp.full((1,), q_len)
        else:
            assert value.shape[-1] == query.shape[-1], "packed segments: v must come padded to q's head width"
            M = q_seqlen.shape[1]
            live = q_seqlen[0] >= 0
            idx = jnp.nonzero(live, size=M, fill_value=M)[0]
            take = lambda a: jnp.where(idx < M, a[jnp.clip(idx, 0, M - 1)], 0)
            starts, lens = take(q_offsets[0, :M]), take(q_seqlen[0])
            k_starts, k_lens = take(kv_offsets[0, :M]), take(kv_seqlen[0])
            seg_q, loc_q, seg_k, loc_k = jnp.full(T, -1), qi, jnp.full(S, -2), kj
            for j in range(M):
                inside = (qi >= starts[j]) & (qi < starts[j] + lens[j])
                seg_q, loc_q = jnp.where(inside, j, seg_q), jnp.where(inside, qi - starts[j], loc_q)
                inside = (kj >= k_starts[j]) & (kj < k_starts[j] + k_lens[j])
                seg_k, loc_k = jnp.where(inside, j, seg_k), jnp.where(inside, kj - k_starts[j], loc_k)
        seen = seg_q[:, None] == seg_k[None, :]
        if causal:
            seen &= loc_k[None, :] <= loc_q[:, None]
        s = jnp.where(seen[None], jnp.einsum("thd,shd->hts", q, k) * scale, -jnp.inf)
        lse = jax.nn.logsumexp(s, axis=-1)  # [N, T]
        out = jnp.einsum("hts,shv->thv", jnp.exp(s - lse[..., None]), v)  # rows that see nothing: NaN
        out = out.astype(query.dtype)[None]
        if not return_residual:
            return out
        rows = starts[:, None] + jnp.arange(T)[None, :]  # [segments, T]
        stats = jnp.where((jnp.arange(T)[None, :] < lens[:, None])[:, None, :], lse[:, jnp.clip(rows, 0, T - 1)].transpose(1, 0, 2), jnp.nan)
        return out, stats


@pytest.fixture
def fake_gpu(monkeypatch):
    """The cuDNN path, with the stand-in module, on whatever device runs the test."""
    monkeypatch.setattr(pa, "device_problem", lambda: None)
    monkeypatch.setattr(pa, "private_api", lambda: FakeCudnn)
    FakeCudnn.calls.clear()
    return FakeCudnn


# ---- choosing ----------------------------------------------------------------------------------


def test_config_rejects_an_unknown_implementation():
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        ml.MLAConfig(attention_impl="flash")
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        pa.choose("flash", packed=False, context=False)


def test_auto_is_blockwise_where_cudnn_cannot_run(monkeypatch):
    monkeypatch.setattr(pa, "device_problem", lambda: "the default device is cpu (cpu), not a CUDA GPU")
    for packed in (False, True):
        for context in (False, True):
            assert pa.choose("auto", packed=packed, context=context) == "blockwise"
            assert pa.choose("blockwise", packed=packed, context=context) == "blockwise"
            with pytest.raises(ValueError, match=r"attention_impl='cudnn' cannot run: the default device is cpu"):
                pa.choose("cudnn", packed=packed, context=context)


def test_cudnn_requested_on_cpu_is_a_clear_error():
    if pa.device_problem() is None:
        pytest.skip("this device runs cuDNN attention")
    assert pa.choose("auto", packed=True, context=True) == "blockwise"
    config = ml.MLAConfig(hidden_size=64, num_heads=2)
    params = ml.init_params(jax.random.key(0), config)
    cache = ml.allocate_cache(config, 2, 8)
    x = jnp.zeros((4, 64), config.dtype)
    idx = jnp.arange(4, dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"attention_impl='cudnn' cannot run: the default device is"):
        ml.prefill(params, x, idx, idx, cache, config=config, attention_impl="cudnn")
    with pytest.raises(ValueError, match=r"attention_impl='cudnn' cannot run"):
        ml.prefill(params, x, idx, idx, cache, config=ml.MLAConfig(hidden_size=64, num_heads=2, attention_impl="cudnn"))
    out, _ = ml.prefill(params, x, idx, idx, cache, config=config)  # auto: blockwise
    assert out.shape == (4, 64)


def test_without_the_private_module_the_public_api_covers_one_sequence(monkeypatch):
    monkeypatch.setattr(pa, "device_problem", lambda: None)
    monkeypatch.setattr(pa, "private_api", lambda: None)
    assert pa.choose("auto", packed=False, context=False) == "cudnn-public"
    assert pa.choose("cudnn", packed=False, context=False) == "cudnn-public"
    for packed, context in ((True, False), (False, True), (True, True)):
        assert pa.choose("auto", packed=packed, context=context) == "blockwise"
        with pytest.raises(ValueError, match="public jax.nn.dot_product_attention takes neither packed sequences"):
            pa.choose("cudnn", packed=packed, context=context)


def test_with_the_private_module_cudnn_covers_everything(monkeypatch):
    monkeypatch.setattr(pa, "device_problem", lambda: None)
    monkeypatch.setattr(pa, "private_api", lambda: FakeCudnn)
    for packed in (False, True):
        for context in (False, True):
            assert pa.choose("auto", packed=packed, context=context) == "cudnn"


def test_version_guard(monkeypatch):
    """The private module is used on the checked jax versions only, and only with the expected
    signature."""
    pa.private_api.cache_clear()
    try:
        monkeypatch.setattr(jax, "__version__", "0.99.0")
        assert pa.private_api() is None
        pa.private_api.cache_clear()
        monkeypatch.setattr(jax, "__version__", "{}.{}.0".format(*pa.TESTED_JAX[0]))
        module = pa.private_api()
        assert module is not None and hasattr(module, "dot_product_attention")
    finally:
        monkeypatch.undo()
        pa.private_api.cache_clear()



ROOT = Path(__file__).resolve().parents[1]
LOWERING_RECORD = ROOT / "tests" / "data" / "cudnn_prefill_lowering.txt"


@pytest.fixture(scope="module")
def cudnn_lowering():
    if pa.private_module() is None:
        pytest.skip(f"jax {jax.__version__} has no private cuDNN module with the arguments the layer passes")
    return load_script(ROOT / "scripts" / "cudnn_lowering.py", "cudnn_lowering")


def test_cudnn_calls_are_the_gpu_checked_ones(cudnn_lowering):
    """On a version in TESTED_JAX, the cuDNN path hands XLA the custom calls recorded on jax 0.11.2,
    whose GPU tests passed on the H200 (scripts/cudnn_lowering.py; docs/PREFILL.md, "Guard")."""
    text = cudnn_lowering.lowered_calls()
    same = text == LOWERING_RECORD.read_text()
    if tuple(int(p) for p in jax.__version__.split(".")[:2]) not in pa.TESTED_JAX:
        pytest.skip(f"jax {jax.__version__} is not in TESTED_JAX; its cuDNN calls "
                    + ("are the recorded ones" if same else "differ from the record"))
    assert same, f"jax {jax.__version__}: run python3 -P scripts/cudnn_lowering.py --check {LOWERING_RECORD}"


def test_cudnn_lowering_record_tells_a_changed_call(cudnn_lowering, monkeypatch):
    """The comparison sees what cuDNN is asked: another softmax scale changes every call."""
    monkeypatch.setattr(cudnn_lowering, "SCALE", 0.25)
    changed = cudnn_lowering.lowered_calls().splitlines()
    record = LOWERING_RECORD.read_text().splitlines()
    assert len(changed) == len(record) and sum(c.startswith("==") for c in record) == 4
    differ = [(a, b) for a, b in zip(record, changed) if a != b]
    assert len(differ) == 6 and all("fmha_scale\\22: 0.1," in a and "fmha_scale\\22: 0.25," in b for a, b in differ)

# ---- the cuDNN path's plumbing, on the stand-in ------------------------------------------------


@pytest.mark.parametrize("fmt, seed", [("bf16", 61), ("fp8_ds_mla", 62)])
def test_cudnn_plumbing_single_sequences_and_chunks(fake_gpu, fmt, seed):
    """Single-sequence chunks, the second one after its cached context (two calls, merged)."""
    run_and_check(Run(fmt, False, seed, attention_impl="cudnn"))
    masks = {mask for mask, _, _ in fake_gpu.calls}
    assert fake_gpu.MaskType.CAUSAL in masks and fake_gpu.MaskType.PADDING in masks


@pytest.mark.parametrize("fmt, seed", [("bf16", 63), ("fp8", 64)])
def test_cudnn_plumbing_packed(fake_gpu, fmt, seed):
    packed_first_chunks(Run(fmt, False, seed, attention_impl="cudnn"), TOLERANCE[fmt])
    assert any(packed for _, packed, _ in fake_gpu.calls)


def test_cudnn_plumbing_packed_with_context(fake_gpu):
    packed_with_context(Run("bf16", False, 65, attention_impl="cudnn"), TOLERANCE["bf16"])
    assert (fake_gpu.MaskType.PADDING, True, 192) in fake_gpu.calls  # chunk over context, packed


def test_cudnn_plumbing_with_head_groups(fake_gpu):
    """The cuDNN path with the heads in groups (the loop over groups 1..), the context's k and v
    made through ctx_kv after the chunk's own attention, in every group."""
    packed_with_context(Run("bf16", False, 67, attention_impl="cudnn", head_groups=2), TOLERANCE["bf16"])
    run_and_check(Run("fp8", True, 68, attention_impl="cudnn", head_groups=4, output_gate=True))
    assert (fake_gpu.MaskType.PADDING, True, 192) in fake_gpu.calls
    q = jnp.zeros((4, 1, 192), jnp.bfloat16)
    with pytest.raises(ValueError, match="not both"):
        pa.cudnn_attention(q, q, q[..., :128], jnp.array([0, 4], jnp.int32), scale=1.0, ctx_k=q, ctx_v=q[..., :128],
                           ctx_lens=jnp.array([4], jnp.int32), ctx_kv=(lambda: (q, q), ()))


def test_merge_of_two_parts_is_attention_over_both():
    key = jax.random.split(jax.random.key(3), 3)
    T, H, A, B = 5, 2, 7, 4
    q = jax.random.normal(key[0], (T, H, 8))
    k = jax.random.normal(key[1], (A + B, H, 8))
    v = jax.random.normal(key[2], (A + B, H, 3))

    def part(keys, values):  # float32 products in full (a GPU's default matmul rounds to TF32)
        s = jnp.einsum("thd,shd->ths", q, keys, precision="highest")
        return jnp.einsum("ths,shv->thv", jax.nn.softmax(s, -1), values, precision="highest"), jax.nn.logsumexp(s, -1)

    whole, _ = part(k, v)
    merged = pa._merge(*part(k[:A], v[:A]), *part(k[A:], v[A:]))
    np.testing.assert_allclose(merged, whole, rtol=1e-5, atol=1e-6)
    # An empty part (lse -inf, out NaN) contributes nothing.
    o2, lse2 = part(k[A:], v[A:])
    empty = pa._merge(jnp.full_like(o2, jnp.nan), jnp.full_like(lse2, -jnp.inf), o2, lse2)
    np.testing.assert_allclose(empty, o2, rtol=1e-6)


def test_auto_follows_the_lowering_platform(cudnn_lowering):
    """"auto" where the default device runs cuDNN: a call lowered for the CPU (the arrays on CPU
    devices of a GPU machine) runs the blockwise loop, with the same bits as asking for it; one
    lowered for CUDA calls cuDNN alone. "cudnn" asked for stays cuDNN on every platform."""
    config = ml.MLAConfig(hidden_size=64, num_heads=2)
    params = ml.init_params(jax.random.key(5), config)
    cache = ml.allocate_cache(config, 4, 8)
    x = jax.random.normal(jax.random.key(6), (12, 64), jnp.float32).astype(config.dtype)
    positions, slots = jnp.arange(12, dtype=jnp.int32), jnp.arange(12, dtype=jnp.int32) + 3
    cu = np.array([0, 5, 12], np.int32)

    def step(impl):
        return jax.jit(functools.partial(ml.prefill, config=config, cu_seqlens=cu, attention_impl=impl))

    def cudnn_calls(impl, platform):
        # Exported, so that the epilogue lowers for CUDA without this machine's CUDA module.
        names = [f"jax_kimi_mla_{op}_v{jax_kimi_mla.ABI_VERSION}" for op in ("prefill_kv_cache", "gather_mla_cache")]
        names += ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"]
        checks = [jax.export.DisabledSafetyCheck.custom_call(name) for name in names]
        exported = jax.export.export(step(impl), platforms=(platform,), disabled_checks=checks)(params, x, positions, slots, cache)
        text = exported.mlir_module()
        return text.count("__cudnn$fmha"), text.count("stablehlo.while")  # the blockwise loop is a while

    with cudnn_lowering.as_if_on_an_h200(), mock.patch.object(pa, "device_problem", lambda: None):
        assert pa.choose("auto", packed=True, context=False) == "cudnn"
        assert cudnn_calls("auto", "cpu") == (0, *cudnn_calls("blockwise", "cpu")[1:])
        assert cudnn_calls("auto", "cuda") == cudnn_calls("cudnn", "cuda")  # no loop added
        # (The choice leaves a stablehlo.case on a constant index, which XLA folds, as it does those
        # of the layer's per-platform GEMMs, layer._proj.)
        assert cudnn_calls("cudnn", "cuda")[0] > 0
        # Run on CPU devices, as on a GPU machine; there the default device runs cuDNN for real.
        on_cpu = jax.device_put((params, x, positions, slots, cache), jax.devices("cpu")[0])
        got, _ = step("auto")(*on_cpu)
    want, _ = step("blockwise")(*on_cpu)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_garbage_cu_seqlens_stays_inside_x():
    """cu_seqlens past T or decreasing (traced values: no trace-time check) is clipped to [0, T]
    and made non-decreasing, so it never addresses outside x: the same results as that packing."""
    config = ml.MLAConfig(hidden_size=64, num_heads=2)
    params = ml.init_params(jax.random.key(7), config)
    x = jax.random.normal(jax.random.key(8), (12, 64), jnp.float32).astype(config.dtype)
    positions, slots = jnp.arange(12, dtype=jnp.int32), jnp.arange(12, dtype=jnp.int32)
    step = jax.jit(functools.partial(ml.prefill, config=config))
    got = step(params, x, positions, slots, ml.allocate_cache(config, 4, 8), cu_seqlens=jnp.array([0, 7, 3, 40], jnp.int32))
    want = step(params, x, positions, slots, ml.allocate_cache(config, 4, 8), cu_seqlens=jnp.array([0, 7, 7, 12], jnp.int32))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_blockwise_when_asked_for():
    """"blockwise" runs on any backend (on a GPU "auto" would pick cuDNN, so this keeps the loop
    covered there), several tiles, chunks after a context."""
    assert pa.choose("blockwise", packed=True, context=True) == "blockwise"
    run_and_check(Run("bf16", False, 81, attention_impl="blockwise", attention_block=4))


# ---- the real thing (GPU) ----------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("fmt, rope, seed", [("bf16", False, 71), ("bf16", True, 72), ("fp8", False, 73), ("fp8_ds_mla", False, 74)])
def test_cudnn_layer_matches_reference(fmt, rope, seed):
    if pa.device_problem() is not None:
        pytest.skip(pa.device_problem())
    assert pa.choose("cudnn", packed=True, context=True) == "cudnn"
    run_and_check(Run(fmt, rope, seed, attention_impl="cudnn"))


@pytest.mark.cuda
@pytest.mark.parametrize("fmt, seed", [("bf16", 75), ("fp8_ds_mla", 76)])
def test_cudnn_packed_layer_matches_reference(fmt, seed):
    if pa.device_problem() is not None:
        pytest.skip(pa.device_problem())
    packed_first_chunks(Run(fmt, False, seed, attention_impl="cudnn"), TOLERANCE[fmt])
    packed_with_context(Run(fmt, False, seed + 100, attention_impl="cudnn"), TOLERANCE[fmt])


@pytest.mark.cuda
def test_cudnn_matches_blockwise_on_long_ragged_batches():
    """cudnn_attention against the blockwise loop (float32) on 1k-token packed chunks of five
    sequences (one empty) after contexts of 0 to 700 tokens, H = 4, bf16."""
    if pa.device_problem() is not None:
        pytest.skip(pa.device_problem())
    rng = np.random.default_rng(0)
    H, chunk_lens, ctx_lens = 4, [300, 0, 250, 200, 170], [0, 64, 700, 1, 129]
    T, C = 1024, 1024
    cu = np.concatenate([[0], np.cumsum(chunk_lens)]).astype(np.int32)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    q, k, v = normal(T, H, 192), normal(T, H, 192), normal(T, H, 128)
    ctx_k, ctx_v = normal(C, H, 192), normal(C, H, 128)
    lens = jnp.asarray(ctx_lens, jnp.int32)
    config = ml.MLAConfig(num_heads=H, attention_block=128)
    got = jax.jit(functools.partial(pa.cudnn_attention, scale=config.attention_scale))(
        q, k, v, jnp.asarray(cu), ctx_k=ctx_k, ctx_v=ctx_v, ctx_lens=lens)
    want = jax.jit(functools.partial(pa.blockwise_attention, scale=config.attention_scale, block=config.attention_block))(
        q, k, v, jnp.asarray(cu), lens, ctx_k, ctx_v)
    n = int(cu[-1])
    np.testing.assert_allclose(np.asarray(got[:n], np.float32), np.asarray(want[:n]), rtol=0, atol=0.02)
    assert np.all(np.asarray(got[n:], np.float32) == 0)  # padding tokens


@pytest.mark.cuda
def test_public_fallback_matches_reference(monkeypatch):
    """Without jax's private module: jax.nn.dot_product_attention with v padded to 192, one
    sequence without context (the prompts' first chunks)."""
    if pa.device_problem() is not None:
        pytest.skip(pa.device_problem())
    monkeypatch.setattr(pa, "private_api", lambda: None)
    run = Run("bf16", False, 77, attention_impl="cudnn")
    n = 16  # CHUNK_PAD: no padding tokens
    for seq in range(3):
        positions = jnp.arange(n, dtype=jnp.int32)
        slots = jnp.asarray([run.slot(seq, p) for p in range(n)], jnp.int32)
        got = run.step("prefill", run.xs[seq, :n], positions, slots)
        run.written += list(np.asarray(slots))
        np.testing.assert_allclose(got, run.expected[seq, :n], rtol=0, atol=TOLERANCE["bf16"], err_msg=f"seq {seq}")


def _dense_packed(q, k, v, cu, scale):
    """float32 attention of packed segments (same cu for q and k), causal within each: (out, lse [T, H])."""
    T = q.shape[0]
    seg = np.searchsorted(np.asarray(cu)[1:], np.arange(T), side="right")
    seen = (seg[:, None] == seg[None, :]) & np.tril(np.ones((T, T), bool))
    s = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    s = jnp.where(seen[None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, -1)
    return jnp.einsum("hts,shv->thv", jnp.exp(s - lse[..., None]), v.astype(jnp.float32)), lse.T


@pytest.mark.cuda
def test_cudnn_packed_layout_facts():
    """What the packed path assumes of jax's cuDNN module, checked directly on three segments:
    the softmax stats are [segments, H, T] with segment j's token l at [j, :, l] (natural-log
    log-sum-exp of the scaled scores), and the output is right with v padded to q's 192 columns.
    Also reports (xfail) whether v's own 128 columns would do, which would save the padding."""
    if pa.device_problem() is not None:
        pytest.skip(pa.device_problem())
    module = pa.private_api()
    rng = np.random.default_rng(1)
    T, H = 96, 2
    cu = np.array([0, 40, 72, 96], np.int32)
    q, k = (jnp.asarray(rng.standard_normal((T, H, 192)), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((T, H, 128)), jnp.bfloat16)
    scale = 192**-0.5
    want, want_lse = _dense_packed(q, k, v, cu, scale)
    lens = jnp.asarray(np.diff(cu))
    starts = jnp.asarray(cu[:-1])
    v192 = jnp.pad(v, ((0, 0), (0, 0), (0, 64)))
    out, stats = jax.jit(functools.partial(pa._call, module, scale=scale, causal=True, lse=True))(
        q, k, v192, q_lens=lens, kv_lens=lens, q_starts=starts, kv_starts=starts)
    np.testing.assert_allclose(np.asarray(out[..., :128], np.float32), np.asarray(want), atol=0.03)
    stats = np.asarray(stats)
    assert stats.shape == (3, H, T), stats.shape
    seg = np.searchsorted(cu[1:], np.arange(T), side="right")
    per_segment = stats[seg, :, np.arange(T) - cu[seg]]  # [T, H]
    if not np.allclose(per_segment, np.asarray(want_lse), atol=0.02):
        hint = "token-indexed ([0, :, t])" if np.allclose(stats[0].T, np.asarray(want_lse), atol=0.02) else "unknown"
        pytest.fail(f"cuDNN's packed softmax stats are not per segment; layout looks {hint}: fix prefill_attention._lse_rows")
    out128, _ = jax.jit(functools.partial(pa._call, module, scale=scale, causal=True, lse=False))(
        q, k, v, q_lens=lens, kv_lens=lens, q_starts=starts, kv_starts=starts)
    if not np.allclose(np.asarray(out128, np.float32), np.asarray(want), atol=0.03):
        pytest.xfail("packed layout with v's own 128 columns is wrong: the padding to 192 stays")
