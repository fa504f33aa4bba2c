"""The public ops: check the arguments, then one XLA FFI call. The epilogues write the paged
cache (aliased to their output, so updated in place); the readers (``mla_decode_attention``,
``gather_mla_cache``, at the end) only read it.

In place: every epilogue returns the new cache as an output aliased to the ``kv_cache`` input
(``input_output_aliases``), and with RoPE the prefill ops alias the returned ``q`` to the input
``q`` as well. XLA then writes into the caller's buffer when the caller donates it::

    step = jax.jit(fused_mla_decode_q_concat_kv_cache_insert, donate_argnums=(4,))
    mqa_q, kv_cache = step(ql_nope, q_pe, kv_c_normed, k_pe, kv_cache, slot_mapping)

Without donation (and in eager calls) XLA copies the cache first: correct, but it moves the
whole cache.

No copy of q either: a jitted function cannot return one of its arguments unchanged without
copying it, and jax gives a donated argument to the *first* output of its shape and dtype. So a
top-level jit of a prefill epilogue that returns the op's ``(k, q, kv_cache)`` copies q: the
unchanged q without RoPE, and, with RoPE, the rotated q even when q is donated (the donated q goes
to k). The recommended patterns (tested for copies in tests/test_copy_traps.py):

- in a model step, make q inside the step (q_b_proj's output), use it there (the attention) and
  return only what is new (the attention output and the cache): with RoPE, q is rotated in its own
  buffer;
- a standalone prefill epilogue step donates q and the cache and returns q first (see the example
  of :func:`fused_mla_key_concat_kv_cache_insert`): the rotated q stays in the donated buffer, and
  the unchanged (NoPE) q is handed back with no work at all.

Only rows addressed by a valid slot change; a slot < 0 (padding) or
>= num_blocks * block_size writes nothing. Positions outside the cos/sin table are clamped.
Among valid tokens sharing a slot, which one's entry is kept is undefined on the GPU.

``k_nope``, ``v``, ``k_pe`` and ``q_pe`` may be given as :func:`columns` of a wider producer
tensor (e.g. ``k_nope=columns(kv, 0), v=columns(kv, 128)`` for kv_b_proj's [T, H, 256] output):
the kernel then reads those columns in place and XLA needs no slice copy before the call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _batching, _checks, _device, _ffi, reference
from .formats import ENTRY, EPILOGUES, Epilogue, L, P, R, V

_NO_POSITIONS = ((0,), jnp.int32)
_NO_COS_SIN = ((0, R), jnp.float32)


def _operands(a, epilogue: Epilogue, checked, scales=()):
    """The FFI operands of an epilogue target: its checked inputs, then the RoPE pair (empty
    stand-ins without RoPE), then its scales; and its attributes: ``rope_style``, and the column
    attributes of inputs given as ``columns(...)``."""
    operands, attrs = [], {"rope_style": checked.rope_style}
    for name in epilogue.inputs:
        x = a[name]
        if isinstance(x, _checks.Columns):
            attrs[f"{name}_col"] = np.int64(x.start)
            x = x.array
        operands.append(x)
    if a["positions"] is None:
        operands += [jnp.zeros(*_NO_POSITIONS), jnp.zeros(*_NO_COS_SIN)]
    else:
        operands += [a["positions"], a["cos_sin_cache"]]
    return operands + list(scales), attrs


def _like(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _call(epilogue: Epilogue, operands, result_shapes, attrs, aliases=None):
    """One epilogue target, its cache aliased (and ``aliases``)."""
    aliases = {epilogue.cache_input: epilogue.cache_output} | (aliases or {})
    return _ffi.call(epilogue.target, operands, result_shapes, aliases, attrs, fold=_batching.epilogue(epilogue))


def _prefill(epilogue: Epilogue, q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, positions, cos_sin_cache, rope_style):
    checked, a = _checks.prefill(
        q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, positions, cos_sin_cache, cache_format=epilogue.cache_format.name, style=rope_style
    )
    T, H = checked.tokens, checked.heads
    # Without RoPE q comes back unchanged: the handler gets empty stand-ins and never touches it.
    q_in = a["q"] if checked.rope else jnp.zeros((0,), checked.act)
    operands, attrs = _operands(dict(a, q=q_in), epilogue, checked)
    k, q_out, cache = _call(
        epilogue,
        operands,
        [jax.ShapeDtypeStruct((T, H, P + R), checked.act), _like(q_in), _like(a["kv_cache"])],
        attrs,
        aliases={epilogue.inputs.index("q"): epilogue.outputs.index("q")},
    )
    return k, (q_out if checked.rope else a["q"]), cache


def fused_mla_key_concat_kv_cache_insert(q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, *, positions=None, cos_sin_cache=None, rope_style="gptj"):
    """Prefill epilogue, bf16/fp16 cache: per-head key concat, optional RoPE, cache insert.

    Args:
      q: [T, H, 192] bfloat16 or float16 (the activation dtype). With RoPE, q[..., 128:] is rotated.
      k_nope: [T, H, 128] activation dtype.
      k_pe: [T, 64] or [T, 1, 64] activation dtype.
      kv_c_normed: [T, 512] activation dtype.
      kv_cache: [num_blocks, block_size, 576] activation dtype (or rows padded to W > 576
        elements, a multiple of 16 bytes: entries go to the first 576, the padding is never
        written). Donate it to update it in place.
      slot_mapping: [T] int32 or int64; row ``slot`` of the flattened cache, < 0 = padding.
      positions: [T] int32 or int64, with ``cos_sin_cache`` float32 [max_position, 64]: RoPE.
      rope_style: "gptj" (pairs of elements 2i, 2i + 1 of the 64-wide rope part; the default) or
        "neox" (rotate-half: elements i, i + 32). Both read cos/sin of pair i from columns i, 32 + i.

    Returns:
      (k [T, H, 192] = [k_nope | r], q, kv_cache) where r = rope(k_pe) or k_pe and the cache row of
      each valid slot holds [kv_c_normed | r]. Without RoPE every output is an exact copy.

    Example: a standalone step with no copy of q or of the cache (q and the cache donated, q
    returned first, so that jax pairs the donated q with it and not with k; the same with RoPE)::

      @functools.partial(jax.jit, donate_argnums=(0, 4))
      def prefill_epilogue(q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, positions, cos_sin_cache):
          k, q, kv_cache = fused_mla_key_concat_kv_cache_insert(
              q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, positions=positions, cos_sin_cache=cos_sin_cache)
          return q, k, kv_cache

      q, k, kv_cache = prefill_epilogue(q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, positions, cos_sin_cache)

    ``jax.jit(fused_mla_key_concat_kv_cache_insert, donate_argnums=(4,))`` would copy q on every
    call (it returns q from the top-level jit). In a model step, q is better made and used inside
    the step, which then returns only the new values and the cache.
    """
    return _prefill(EPILOGUES["prefill_bf16"], q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, positions, cos_sin_cache, rope_style)


def fused_mla_key_concat_ds_mla_insert(q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, *, positions=None, cos_sin_cache=None, rope_style="gptj"):
    """Prefill epilogue, fp8_ds_mla cache: as :func:`fused_mla_key_concat_kv_cache_insert`, but
    ``kv_cache`` is uint8 [num_blocks, block_size, 656] (or padded rows: W > 656, a multiple of 16
    bytes) and each valid slot's row gets the 656-byte
    entry: 512 E4M3 codes of kv_c_normed in 4 tiles of 128, 4 float32 power-of-two tile scales,
    64 bfloat16 values of r. ``k`` and ``q`` stay in the activation dtype.
    Read entries back with :func:`jax_kimi_mla.ds_mla_dequantize`. Call it as in the example of
    :func:`fused_mla_key_concat_kv_cache_insert` (q and the cache donated, q returned first).
    """
    return _prefill(EPILOGUES["prefill_fp8_ds_mla"], q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, positions, cos_sin_cache, rope_style)


def fused_mla_qkv_quant_kv_cache_fp8_insert(
    q, k_nope, k_pe, kv_c_normed, v, kv_cache, slot_mapping, q_scale_inv, k_scale_inv, v_scale_inv, cache_scale_inv, *, positions=None, cos_sin_cache=None,
    rope_style="gptj",
):
    """Prefill epilogue, fp8 attention inputs and plain fp8 cache.

    Args:
      q: [T, H, 192], k_nope: [T, H, 128], v: [T, H, 128], k_pe: [T, 64] or [T, 1, 64],
        kv_c_normed: [T, 512], all bfloat16 or float16.
      kv_cache: [num_blocks, block_size, 576] float8_e4m3fn (or padded rows, as above).
      slot_mapping: [T] int32/int64. positions / cos_sin_cache / rope_style: optional RoPE, as above.
      q_scale_inv, k_scale_inv, v_scale_inv, cache_scale_inv: float32 arrays of shape () or (1,),
        the reciprocals of the per-tensor scales (traced values are fine).

    Returns:
      (q_fp8 [T, H, 192], k_fp8 [T, H, 192], v_fp8 [T, H, 128], kv_cache), every value
      E4M3(clamp(x * scale_inv, -448, 448)) rounded to nearest-even from float32 (RoPE'd values
      straight from float32); NaN stays NaN. ``q`` itself is not modified.

    Every output but the cache is new, so nothing to pair: donate the cache (argument 5), e.g.
    ``jax.jit(functools.partial(fused_mla_qkv_quant_kv_cache_fp8_insert, **rope), donate_argnums=5)``.
    """
    checked, a = _checks.prefill(
        q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, positions, cos_sin_cache, cache_format="fp8", v=v, style=rope_style
    )
    scales = _checks.fp8_prefill_scales(q_scale_inv, k_scale_inv, v_scale_inv, cache_scale_inv)
    T, H = checked.tokens, checked.heads
    fp8 = jnp.float8_e4m3fn
    epilogue = EPILOGUES["prefill_fp8"]
    operands, attrs = _operands(a, epilogue, checked, scales)
    return _call(
        epilogue,
        operands,
        [
            jax.ShapeDtypeStruct((T, H, P + R), fp8),
            jax.ShapeDtypeStruct((T, H, P + R), fp8),
            jax.ShapeDtypeStruct((T, H, V), fp8),
            _like(a["kv_cache"]),
        ],
        attrs,
    )


def fused_mla_decode_q_concat_kv_cache_insert(
    ql_nope, q_pe, kv_c_normed, k_pe, kv_cache, slot_mapping, *, ds_mla=False, q_scale_inv=None, cache_scale_inv=None, positions=None, cos_sin_cache=None,
    rope_style="gptj",
):
    """Decode epilogue: the absorbed MQA query and the cache insert, for all three cache formats.

    Args:
      ql_nope: [B, H, 512] bfloat16 or float16 (W_UK-absorbed query).
      q_pe: [B, H, 64], kv_c_normed: [B, 512], k_pe: [B, 64] or [B, 1, 64], activation dtype.
      kv_cache: one of
        - [num_blocks, block_size, 576] in the activation dtype (default);
        - [num_blocks, block_size, 576] float8_e4m3fn, with q_scale_inv and cache_scale_inv
          (float32, shape () or (1,)): mqa_q is float8_e4m3fn too;
        - [num_blocks, block_size, 656] uint8 with ``ds_mla=True`` (fp8_ds_mla entries);
        any of them with rows padded to a multiple of 16 bytes (the padding is never written).
      slot_mapping: [B] int32/int64. positions / cos_sin_cache / rope_style: optional RoPE, as in
        :func:`fused_mla_key_concat_kv_cache_insert`.

    Returns:
      (mqa_q [B, H, 576] = [ql_nope | rope(q_pe)], kv_cache with row(slot) = [kv_c_normed | rope(k_pe)]).
    """
    checked, fmt, a = _checks.decode(
        ql_nope, q_pe, kv_c_normed, k_pe, kv_cache, slot_mapping, ds_mla, q_scale_inv, cache_scale_inv, positions, cos_sin_cache, rope_style
    )
    epilogue = EPILOGUES[f"decode_{fmt}"]
    q_dtype = jnp.float8_e4m3fn if fmt == "fp8" else checked.act
    operands, attrs = _operands(a, epilogue, checked, [a[name] for name in epilogue.scales])
    return _call(
        epilogue,
        operands,
        [jax.ShapeDtypeStruct((checked.tokens, checked.heads, ENTRY), q_dtype), _like(a["kv_cache"])],
        attrs,
    )


# ---- the cache readers ----

SPLIT_TOKENS = 64  # tokens of one split are whole 64-token tiles (DecodeAttention::kSplitTokens)
PARTIAL_ROW_FLOATS = 4 + L + 1  # float32 scratch a partial row: its split claims (16 bytes), 512 outputs, an lse
ROWS_PER_CTA = 16  # query rows (S_q x heads) one CUDA block of the decode kernel takes
# ... or 64, where the 64-row wgmma kernel takes the call: a 16-bit cache at S_q = 1 with at least
# WIDE_MIN_ROWS heads (WIDE_MIN_ROWS_BATCHED from WIDE_MIN_BATCH sequences), on an sm_90 GPU
# (decode_attention_cuda.cu: wide_attention_kernel, choose_kernel).
WIDE_ROWS_PER_CTA = 64
WIDE_MIN_ROWS, WIDE_MIN_ROWS_BATCHED, WIDE_MIN_BATCH = 64, 32, 8


def _reader_scale(scale_inv):
    """A readers' optional scale operand: float32 [1], or [0] when there is none."""
    return jnp.zeros((0,), jnp.float32) if scale_inv is None else jnp.reshape(scale_inv, (1,))


def wide_kernel_applies(cache_dtype, batch: int, q_tokens: int, heads: int, kernel: str = "auto") -> bool:
    """Whether the 64-row wgmma decode attention kernel takes a call of these sizes on sm_90
    (``kernel``: the call's choice, as in :func:`mla_decode_attention`)."""
    many = heads >= WIDE_MIN_ROWS or (heads >= WIDE_MIN_ROWS_BATCHED and batch >= WIDE_MIN_BATCH)
    return kernel != "mma" and jnp.dtype(cache_dtype).itemsize == 2 and q_tokens == 1 and (many or kernel == "wide")


def _decode_rows_per_cta(cache_dtype, batch: int, q_tokens: int, heads: int, kernel: str = "auto") -> int:
    """Query rows of one CUDA block of the decode attention kernel that the call will take."""
    wide = wide_kernel_applies(cache_dtype, batch, q_tokens, heads, kernel) and _device.gpu_is_sm90()
    return WIDE_ROWS_PER_CTA if wide else ROWS_PER_CTA


def default_num_splits(batch: int, rows: int, max_len: int, sm_count: int, rows_per_cta: int = ROWS_PER_CTA) -> int:
    """The split-KV count: the fewest splits whose CUDA blocks (batch x ceil(rows / rows_per_cta)
    x splits) keep >= 90% of the GPU's ``sm_count`` block slots busy in whole waves (else the best
    one), at most one split per 64-token tile. One split (no combine launch) without a GPU."""
    ctas = batch * -(-rows // rows_per_cta)
    most = min(max(1, -(-max_len // SPLIT_TOKENS)), _checks.MAX_SPLITS)
    if sm_count <= 0 or ctas == 0:
        return 1

    def use(s):  # the fraction of block slots that s splits keep busy
        n = ctas * s
        return min(1.0, n / sm_count) * n / (-(-n // sm_count) * sm_count)

    return next((s for s in range(1, most + 1) if use(s) >= 0.9), max(range(1, most + 1), key=use))


# Splits by work: how many times default_num_splits a long sequence of a ragged batch may take
# (the room of the split-KV scratch; the grid holds the planned B x default_num_splits CTAs, each
# taking one live split: the work list), and the tiles a planned split must hold for splits by
# work (H100, before the work list, when the grid held every sequence's most splits and the empty
# ones cost about 2 us of an SM's time each: calls with splits of 4-8 tiles ran 9-16% slower by
# work, of 32 and more within 1%; docs/DECODE_ATTENTION.md, Thirty-second round). With the work
# list (H200, Thirty-fourth round) twice the headroom bought nothing, and an average of 3/4 or 3/2
# the plan was 14-39% slower.
SPLIT_HEADROOM = 4
SPLIT_BY_WORK_MIN_TILES = 16
# A batch whose one split a sequence is one wave (B 119-132 at H <= 16 on 132 SMs): splits by work,
# two a sequence on average. H100, B 128 x 16k tables, one wave against this (span of the call):
# 100 live sequences of random lengths -20% (fp8_ds_mla), -26% (plain fp8), -23% (bf16); all 128
# live -7.5%; a uniform batch, whose one split a sequence is already even, +6%, +4%, +3%. Two
# waves (B 256) by work were slower than one split even when ragged (docs/DECODE_ATTENTION.md,
# Thirty-seventh round).
SPLIT_ONE_WAVE_WORK = 2


def split_plan(batch: int, rows: int, max_len: int, sm_count: int, rows_per_cta: int = ROWS_PER_CTA,
               split_by_work: bool = True) -> tuple[int, int]:
    """(num_splits, work_splits) of a call that leaves its split count to the op. With
    ``split_by_work`` and more than one split, the batch's default_num_splits x B splits are shared
    out by the sequences' lengths at run time (every split the fewest whole tiles with which the
    batch needs at most that many): a uniform batch is cut as before, a ragged or padded one gives
    its long sequences more splits (num_splits: up to SPLIT_HEADROOM times as many, at most a split
    a 64-token tile) and its short ones fewer. A batch whose one split a sequence fills the GPU in
    one wave, with one CUDA block of rows a sequence, is shared out as two a sequence
    (SPLIT_ONE_WAVE_WORK): else a ragged one waits on its longest sequence. Else, where the batch
    has more sequences than the GPU has SMs, where a planned split of the table holds fewer than
    SPLIT_BY_WORK_MIN_TILES tiles, or where a sequence may take no more than the plan (one
    sequence), (default_num_splits, 0): every sequence cut into that many."""
    planned = default_num_splits(batch, rows, max_len, sm_count, rows_per_cta)
    # Splits by work only where the batch has no more sequences than the GPU has SMs: each CTA
    # counts the batch's splits before it starts, 32 sequences a pass, so a longer batch starts its
    # CTAs later (H100, B 160-200 of ragged lengths: 9-24% slower by work than by count; uniform 5%).
    few_sequences = 0 < batch <= sm_count
    # One split a sequence, the batch one wave: two by work. Measured with one row group a sequence
    # (H <= 16) only; with more (H = 128, whose target is the tensor cores' rate at uniform B 64)
    # one split stays.
    one_wave = planned == 1 and rows <= rows_per_cta and few_sequences
    work = SPLIT_ONE_WAVE_WORK if one_wave else planned
    tiles = -(-max_len // SPLIT_TOKENS)
    # The most splits a sequence may take: at most all of the batch's B x work ones.
    most = min(SPLIT_HEADROOM * work, batch * work, tiles, _checks.MAX_SPLITS)
    long_splits = tiles >= SPLIT_BY_WORK_MIN_TILES * work
    # More sequences than SMs, one split (the batch fills the GPU: no combine launch), short splits,
    # or no room above the plan (one sequence; a split a tile already): splits by count.
    if split_by_work and few_sequences and long_splits and 1 < work < most:
        return most, work
    return planned, 0


def mla_decode_attention(
    mqa_q, kv_cache, block_tables, context_lens, *, softmax_scale, ds_mla=False, q_scale_inv=None, cache_scale_inv=None, return_lse=False, num_splits=None,
    kernel="auto", programmatic_combine=True, balance_splits=True, split_by_work=True,
):
    """Paged MLA decode attention: the absorbed query over the latent cache, in one call.

    Args:
      mqa_q: [B, H, 576], or [B, S_q, H, 576] for S_q = 1..4 new tokens per sequence (the
        decode epilogue's output). bfloat16 or float16 with any cache; float8_e4m3fn (with
        ``q_scale_inv``) with the plain fp8 cache only.
      kv_cache: [num_blocks, block_size, 576] in mqa_q's dtype; [num_blocks, block_size, 576]
        float8_e4m3fn with ``cache_scale_inv``; or uint8 [num_blocks, block_size, 656] with
        ``ds_mla=True``, as the epilogues write them (rows may be padded: wider, a multiple of
        16 bytes, the entry in their first columns).
      block_tables: [B, max_blocks] int32/int64: token t of sequence b is row
        ``block_tables[b, t // block_size] * block_size + t % block_size``.
      context_lens: [B] int32/int64, the tokens of each sequence, counting the new one(s);
        clamped to [0, max_blocks * block_size].
      softmax_scale: a Python float (static).
      q_scale_inv, cache_scale_inv: float32 scalars of the plain fp8 format (the reciprocals of
        the per-tensor scales the epilogues quantized with).
      return_lse: also return the log-sum-exp of the scaled scores.
      num_splits: the split-KV count of the CUDA kernel (static): every sequence's context cut
        into that many parts. None chooses it from the sizes and the GPU and, with
        ``split_by_work`` (a static bool, default True), shares the splits out by the sequences'
        lengths at run time (:func:`split_plan`: a padded, ragged batch's long sequences take more
        splits, its short ones fewer; batches of no more sequences than the GPU has SMs). Results
        do not depend on either beyond float rounding (the CPU handler ignores both).
      kernel, programmatic_combine, balance_splits: for comparisons and tests (static; the CPU
        handler and the reference check and ignore them). ``kernel`` is "auto" (the kernel that
        suits the call), or one asked for where it applies (docs/DECODE_ATTENTION.md, "Kernels
        and the launch choices"): "mma" (the general mma.sync kernel), "wide" (the 64-row wgmma kernel, 16-bit cache at
        S_q = 1, also with fewer heads), "rs" (the 1-byte caches' wgmma kernel at S_q = 1:
        fp8_ds_mla also with short splits, the plain fp8 cache under an fp8 mqa_q) or "rs-combine"
        (that kernel with its splits merged by the combine kernel).
        ``programmatic_combine=False`` launches the kernel that merges the splits after the
        attention kernel instead of as its programmatic dependent. ``balance_splits`` (a static
        Python bool): by default, where the 1-byte caches' kernel merges its splits in the
        combine kernel (fp8_ds_mla; plain fp8 from 64 tiles a split), a sequence's splits share
        out their last tiles at run time, so that they end together, and the float rounding then
        depends on timing (results may differ from run to run in the last bits);
        ``balance_splits=False`` keeps each split's tiles as cut, for bit-for-bit repeatable results.

    The CUDA kernel needs sm_90+ (Hopper or newer); on older GPUs this calls
    ``jax_kimi_mla.reference.mla_decode_attention`` instead (same contract, jnp speed).

    Returns:
      out [B, (S_q,) H, 512] in mqa_q's dtype (bfloat16 for an fp8 mqa_q): the softmax-weighted
      latents (before W_UV), and with ``return_lse`` lse float32 [B, (S_q,) H] (natural log).
      Query j of S_q sees tokens ``0 .. context_len - S_q + j``; a query that sees no token gets
      zeros and lse -inf. Tokens whose block id is outside [0, num_blocks) are masked out.

    Example::

      out = jax.jit(functools.partial(mla_decode_attention, softmax_scale=192 ** -0.5))(
          mqa_q, kv_cache, block_tables, context_lens)
    """
    c = _checks.decode_attention(
        mqa_q, kv_cache, block_tables, context_lens, softmax_scale, ds_mla, q_scale_inv, cache_scale_inv, num_splits, return_lse, kernel,
        programmatic_combine, balance_splits, split_by_work)
    if _device.gpu_before_hopper():  # the documented fallback: the jnp reference, same contract
        return reference.mla_decode_attention(
            mqa_q, kv_cache, block_tables, context_lens, softmax_scale=softmax_scale, ds_mla=ds_mla,
            q_scale_inv=q_scale_inv, cache_scale_inv=cache_scale_inv, return_lse=return_lse)
    B, S, H = c.q.shape[:3]
    max_len = c.block_tables.shape[1] * c.kv_cache.shape[1]
    splits, work_splits = (c.num_splits, 0) if c.num_splits else split_plan(
        B, S * H, max_len, _device.sm_count(), _decode_rows_per_cta(c.kv_cache.dtype, B, S, H, c.kernel), c.split_by_work)
    by_work = {"work_splits": np.int64(work_splits)} if work_splits else {}  # absent: lowers as before it existed
    scales = [_reader_scale(c.q_scale_inv), _reader_scale(c.cache_scale_inv)]
    partials = (splits * B * S * H * PARTIAL_ROW_FLOATS,) if splits > 1 else (0,)
    # The FFI query is [B * S_q, H, 576]: the decode epilogue's mqa_q as it comes.
    out, lse, _ = _ffi.call(
        "mla_decode_attention",
        [c.q.reshape(B * S, H, ENTRY), c.kv_cache, c.block_tables, c.context_lens, *scales],
        [
            jax.ShapeDtypeStruct((B * S, H, L), c.out_dtype),
            jax.ShapeDtypeStruct((B * S, H), jnp.float32),
            jax.ShapeDtypeStruct(partials, jnp.float32),
        ],
        {},
        {"softmax_scale": np.float32(c.softmax_scale), "q_tokens": np.int64(S), "num_splits": np.int64(splits), **by_work, **c.launch_attributes},
        fold=_batching.decode_attention,
    )
    lead = (B,) if c.squeeze else (B, S)
    out, lse = out.reshape(*lead, H, L), lse.reshape(*lead, H)
    return (out, lse) if return_lse else out


def gather_mla_cache(kv_cache, block_tables, context_lens, *, num_tokens=None, ds_mla=False, cache_scale_inv=None, out_dtype=jnp.bfloat16):
    """The cached entries of a batch of sequences, dequantized and packed densely, in one call.

    For chunked prefill: the context of each sequence, read through its block table, as the rows
    that ``kv_b_proj`` then up-projects.

    Args:
      kv_cache: [num_blocks, block_size, 576] bfloat16/float16; float8_e4m3fn with
        ``cache_scale_inv``; or uint8 [num_blocks, block_size, 656] with ``ds_mla=True`` (rows
        may be padded, as for :func:`mla_decode_attention`).
      block_tables: [B, max_blocks] int32/int64; context_lens: [B] int32/int64, clamped to
        [0, max_blocks * block_size].
      num_tokens: the output rows (static); None: B * max_blocks * block_size.
      out_dtype: bfloat16, float16 or float32.

    Returns:
      [num_tokens, 576] in ``out_dtype``: token t of sequence b at row ``sum(clamped context_lens[:b]) + t``
      (values: the latent and k_pe as the cache holds them, dequantized: plain fp8 codes divided
      by cache_scale_inv, fp8_ds_mla codes times their tile scale), rounded to nearest even. A
      token whose block id is outside [0, num_blocks) gives a zero row; rows past the last token
      are zeros; tokens past ``num_tokens`` are dropped.

    Example::

      context = jax.jit(functools.partial(gather_mla_cache, num_tokens=4096))(kv_cache, block_tables, context_lens)
    """
    c = _checks.gather_cache(kv_cache, block_tables, context_lens, num_tokens, ds_mla, cache_scale_inv, out_dtype)
    (out,) = _ffi.call(
        "gather_mla_cache",
        [c.kv_cache, c.block_tables, c.context_lens, _reader_scale(c.cache_scale_inv)],
        [jax.ShapeDtypeStruct((c.num_tokens, ENTRY), c.out_dtype)],
        {},
        {},
        fold=_batching.gather_cache,
    )
    return out
