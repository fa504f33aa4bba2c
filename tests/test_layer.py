"""The MLA layer on the epilogues against a naive from-scratch reference.

Prompts are prefilled (one of them in two chunks), then a batch decodes step by step over one paged
cache, under jax.jit with the cache donated; every output is compared with
``layer.reference_attention`` over the whole sequence. The cache starts as random bits (NaN and
inf included), as blocks freed by earlier sequences would: the layer must not let the unused rows
leak into its outputs, and the ops must leave them bit-for-bit alone.
The compiled HLO is checked for in-place updates and for copies feeding the epilogues.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kimi_mla
from jax_kimi_mla import layer as ml
from jax_kimi_mla import ops
from jax_kimi_mla import reference as reference_ops

HIDDEN, HEADS = 256, 4
BLOCK, NUM_BLOCKS, MAX_BLOCKS = 8, 24, 4  # 12 of the 24 blocks are never handed out
PROMPTS = (5, 11, 19)
CHUNKS = {0: (5,), 1: (11,), 2: (10, 9)}  # the 19-token prompt is prefilled in two chunks
CHUNK_PAD = 16  # every prefill chunk is padded to 16 tokens (slot -1): one compile
DECODE_STEPS = 4
SEQ_LEN = max(PROMPTS) + DECODE_STEPS  # 23 tokens fit in MAX_BLOCKS * BLOCK = 32
BATCH_ROWS = (0, None, 1, 2)  # the decode batch: sequence per row, None = padding row
MAX_POSITION = 64

# Max |layer - reference| allowed per layer, outputs being O(1) (max |ref| ~ 3-4). The reference
# is float32 with no quantization. bf16: the layer rounds to bf16 (2^-9 relative) at each
# projection, and decode goes through the absorbed W_UK / W_UV (other rounding points); 0.015
# measured. fp8 quantizes q, k, v and the cache to E4M3, 3 mantissa bits (up to 6% relative per
# value): 0.11 measured. fp8_ds_mla quantizes only the cached latent, with per-tile power-of-two
# scales: 0.07 measured. (Maxima over several seeds; the limits are about twice that. Attending
# one token short, for comparison, is off by 0.1-0.9.) A stack of n layers adds up n layers'
# errors plus a bf16 rounding (2^-9 relative) of the residual stream per layer.
TOLERANCE = {"bf16": 0.03, "fp8": 0.25, "fp8_ds_mla": 0.15}
FORMATS = ml.CACHE_FORMATS
# The quantized twin of a step: the same layer with jax_kimi_mla.reference's ops on the same cache,
# so the same quantized q, k, v and cache values; only the float rounding of the attention
# separates them. Measured on the CPU: prefill steps equal bit for bit, decode steps within 0.004
# (a bf16 rounding of the latent or the output). On the H200 the plain fp8 prefill step differs by
# up to 0.094 (XLA fuses the reference's quantization into its GEMMs, so a few fp8 codes round the
# other way; the CUDA decode attention may also differ from the reference by 2^-6 relative), hence
# a wider limit there. Attending one token short is off by 0.1-1.3 (0.47-1.3 in the mutation test).
TWIN_RTOL, TWIN_ATOL = 0.0, 0.02 if jax.default_backend() == "cpu" else 0.16

prefill_step = jax.jit(ml.prefill, static_argnames="config", donate_argnums=4)
decode_step = jax.jit(ml.decode, static_argnames="config", donate_argnums=6)


@functools.partial(jax.jit, static_argnames=("config", "num_layers"))
def reference(params, xs, cos_sin_cache, *, config, num_layers):
    """Float32 reference of each sequence xs[s] [SEQ_LEN, hidden]; a stack adds a residual per layer."""
    positions = jnp.arange(xs.shape[1], dtype=jnp.int32)

    def one(p, x):
        return ml.reference_attention(p, x, positions, config=config, cos_sin_cache=cos_sin_cache)

    if num_layers is None:
        return jax.vmap(functools.partial(one, params))(xs)
    h = xs.astype(jnp.float32)
    for i in range(num_layers):
        h = h + jax.vmap(functools.partial(one, jax.tree.map(lambda a, i=i: a[i], params)))(h)
    return h


@functools.partial(jax.jit, static_argnames="config", donate_argnums=4)
def stack_prefill(params, x, positions, slot_mapping, kv_cache, *, config, **kwargs):
    step = functools.partial(ml.prefill, config=config)
    return ml.scan_layers(step, params, x, kv_cache, positions, slot_mapping, **kwargs)


@functools.partial(jax.jit, static_argnames="config", donate_argnums=6)
def stack_decode(params, x, positions, slot_mapping, block_tables, context_lens, kv_cache, *, config, **kwargs):
    step = functools.partial(ml.decode, config=config)
    return ml.scan_layers(step, params, x, kv_cache, positions, slot_mapping, block_tables, context_lens, **kwargs)


STEPS = {
    ("prefill", False): prefill_step,
    ("decode", False): decode_step,
    ("prefill", True): stack_prefill,
    ("decode", True): stack_decode,
}


@contextlib.contextmanager
def calling_ops(namespace):
    """The layer calls its ops from ``namespace`` (a function traced meanwhile keeps them)."""
    saved, ml.ops = ml.ops, namespace
    try:
        yield
    finally:
        ml.ops = saved


def fresh_step(kind, donate=False):
    """A single-layer step under a jit of its own, so it is traced with the ops of the moment
    (jax.jit of ml.decode itself could reuse another jit's trace)."""
    fn = {"prefill": ml.prefill, "decode": ml.decode}[kind]
    donated = {"prefill": 4, "decode": 6}[kind] if donate else ()
    return jax.jit(lambda *a, **k: fn(*a, **k), static_argnames="config", donate_argnums=donated)


def garbage_cache(config, seed, num_layers=None):
    """A cache of random bits, so never-written rows hold NaN, inf and huge values."""
    empty = ml.allocate_cache(config, NUM_BLOCKS, BLOCK, num_layers)
    bits = np.random.default_rng(seed).integers(0, 256, empty.size * empty.dtype.itemsize, np.uint8)
    return jnp.asarray(bits.view(empty.dtype).reshape(empty.shape))


def as_bits(cache):
    return np.asarray(jax.lax.bitcast_convert_type(cache, jnp.dtype(f"uint{8 * cache.dtype.itemsize}")))


class Run:
    """One scenario's data: weights, sequences, block tables; drives the jitted steps."""

    def __init__(self, fmt, rope, seed, num_layers=None, *, twin_atol=None, layer_ops=None, layer_list=False, **overrides):
        """``twin_atol``: also check every step against its quantized twin (see
        :func:`quantized_twin`) to this absolute tolerance. ``layer_ops``: the namespace the layer
        calls its ops from (default jax_kimi_mla.ops), with steps traced for this run.
        ``layer_list``: scan_layers gets the stack's params as a list of per-layer ones."""
        self.twin_atol, self.layer_ops, self.layer_list = twin_atol, layer_ops, layer_list
        self.steps = STEPS if layer_ops is None else {k: fresh_step(k[0], donate=True) for k in STEPS if not k[1]}
        self.twins = {kind: fresh_step(kind) for kind in ("prefill", "decode")}
        self.config = ml.MLAConfig(hidden_size=HIDDEN, num_heads=HEADS, cache_format=fmt, **overrides)
        self.num_layers = num_layers
        keys = jax.random.split(jax.random.key(seed), 3)
        self.params = ml.init_params(keys[0], self.config, num_layers)
        self.step_params = ml.unstack_layers(self.params) if layer_list else self.params  # what scan_layers gets
        # Hidden states of every token of every sequence, prompt and decoded tokens alike.
        self.xs = jax.random.normal(keys[1], (len(PROMPTS), SEQ_LEN, HIDDEN), jnp.float32).astype(self.config.dtype)
        self.pad_x = jax.random.normal(keys[2], (CHUNK_PAD, HIDDEN), jnp.float32).astype(self.config.dtype)
        self.cache = garbage_cache(self.config, seed, num_layers)
        self.initial_bits = as_bits(self.cache)
        self.cos_sin = jax_kimi_mla.make_cos_sin_cache(MAX_POSITION) if rope else None
        rng = np.random.default_rng(seed)
        self.tables = rng.permutation(NUM_BLOCKS)[: len(PROMPTS) * MAX_BLOCKS].reshape(len(PROMPTS), MAX_BLOCKS).astype(np.int32)
        self.written = []  # (layer-local) slots written so far
        self.twin_errors = []  # max |step - twin| of each step
        self.compiled_checked = set()
        # The reference ignores the cache format: without it (and the fp8 scales) one compile
        # serves every format.
        ref_params = {k: v for k, v in self.params.items() if k != "fp8_scale_inv"}
        ref_config = dataclasses.replace(self.config, cache_format="bf16")
        self.expected = np.asarray(reference(ref_params, self.xs, self.cos_sin, config=ref_config, num_layers=num_layers))

    def slot(self, seq, pos):
        return int(self.tables[seq, pos // BLOCK]) * BLOCK + pos % BLOCK

    def step(self, kind, x, *args, **kwargs):
        """One jitted step with the cache donated; checks that it updates the cache in place."""
        fn = self.steps[kind, self.num_layers is not None]
        args = (self.step_params, x, *args, self.cache)
        kwargs.update(config=self.config, cos_sin_cache=self.cos_sin)
        if self.twin_atol is not None:  # before the step: the twin reads the same cache
            assert self.num_layers is None
            with calling_ops(reference_ops):
                twin, _ = self.twins[kind](*args[:-1], jnp.copy(self.cache), **kwargs)
        with calling_ops(self.layer_ops or ops):
            if kind not in self.compiled_checked:  # compiling here fills the cache the call then uses
                hlo = fn.lower(*args, **kwargs).compile().as_text()
                assert_cache_in_place(hlo, self.cache)
                assert (self.num_layers is None) or (" while(" in hlo) != self.layer_list, "scanned: a stack; unrolled: a list"
                self.compiled_checked.add(kind)
            pointer = self.cache.unsafe_buffer_pointer()
            out, self.cache = fn(*args, **kwargs)
        assert self.cache.unsafe_buffer_pointer() == pointer, "the donated cache was not updated in place"
        out = np.asarray(out.astype(jnp.float32))
        if self.twin_atol is not None:
            twin = np.asarray(twin.astype(jnp.float32))
            self.twin_errors.append(float(np.abs(out - twin).max()))
            np.testing.assert_allclose(out, twin, rtol=TWIN_RTOL, atol=self.twin_atol, err_msg=f"{kind} step against its quantized twin")
        return out

    def prefill_chunk(self, seq, start, n, packed=False):
        """Tokens [start, start + n) of sequence seq, after its cached context; ``packed``: passed
        as the one sequence of a packed (cu_seqlens) call."""
        positions = np.zeros(CHUNK_PAD, np.int32)
        positions[:n] = np.arange(start, start + n)
        slots = np.full(CHUNK_PAD, -1, np.int32)
        slots[:n] = [self.slot(seq, p) for p in range(start, start + n)]
        x = self.pad_x.at[:n].set(self.xs[seq, start : start + n])
        if packed:
            context = dict(cu_seqlens=jnp.asarray([0, n], jnp.int32), block_table=jnp.asarray(self.tables[seq : seq + 1]),
                           context_len=jnp.asarray([start], jnp.int32))
        else:
            context = dict(block_table=jnp.asarray(self.tables[seq]), context_len=jnp.int32(start))
        out = self.step("prefill", x, jnp.asarray(positions), jnp.asarray(slots), **context)
        self.written += list(slots[:n])
        return out[:n]

    def decode(self, k):
        rows = [(s, PROMPTS[s] + k) if s is not None else None for s in BATCH_ROWS]
        x = jnp.stack([self.xs[r[0], r[1]] if r else self.pad_x[0] for r in rows])
        positions = np.array([r[1] if r else 0 for r in rows], np.int32)
        slots = np.array([self.slot(*r) if r else -1 for r in rows], np.int32)
        # The padding row gets a real sequence's table: only context_len 0 keeps it from reading.
        tables = np.stack([self.tables[r[0] if r else 0] for r in rows])
        lens = np.array([r[1] + 1 if r else 0 for r in rows], np.int32)
        out = self.step("decode", x, *map(jnp.asarray, (positions, slots, tables, lens)))
        self.written += [s for s in slots if s >= 0]
        return rows, x, out

    def decode_tokens(self, k, q_tokens):
        """Decode step k: q_tokens new tokens of every sequence at once (speculative decoding)."""
        rows = [(s, PROMPTS[s] + k * q_tokens) for s in range(len(PROMPTS))]
        pos = np.array([[p + j for j in range(q_tokens)] for _, p in rows], np.int32)
        x = jnp.stack([self.xs[s, p : p + q_tokens] for s, p in rows])
        slots = np.array([[self.slot(s, p + j) for j in range(q_tokens)] for s, p in rows], np.int32)
        lens = pos[:, -1] + 1
        out = self.step("decode", x, *map(jnp.asarray, (pos, slots, self.tables, lens)))
        self.written += list(slots.reshape(-1))
        return rows, out

    def check_untouched(self):
        """Rows no valid slot addressed keep their initial bits (in every layer of a stack)."""
        flat_now = as_bits(self.cache).reshape(-1, NUM_BLOCKS * BLOCK, self.initial_bits.shape[-1])
        flat_before = self.initial_bits.reshape(flat_now.shape)
        untouched = np.setdiff1d(np.arange(NUM_BLOCKS * BLOCK), self.written)
        np.testing.assert_array_equal(flat_now[:, untouched], flat_before[:, untouched])
        assert not np.array_equal(flat_now, flat_before)


def run_and_check(run):
    residuals = run.num_layers or 0  # a single layer's output has no residual added
    tolerance = dict(rtol=residuals * 2.0**-9, atol=max(residuals, 1) * TOLERANCE[run.config.cache_format])
    for seq, chunks in CHUNKS.items():
        start = 0
        for n in chunks:
            got = run.prefill_chunk(seq, start, n)
            np.testing.assert_allclose(got, run.expected[seq, start : start + n], **tolerance, err_msg=f"prefill seq {seq} [{start}:{start + n}]")
            start += n
    for k in range(DECODE_STEPS):
        rows, x, got = run.decode(k)
        for i, r in enumerate(rows):
            if r is None:  # it attends to nothing: the layer gives 0, a stack its residual input
                want = 0.0 if run.num_layers is None else np.asarray(x[i].astype(jnp.float32))
                np.testing.assert_array_equal(got[i], want, err_msg="padding row")
            else:
                np.testing.assert_allclose(got[i], run.expected[r[0], r[1]], **tolerance, err_msg=f"decode step {k}, seq {r[0]}")
    run.check_untouched()


@pytest.mark.parametrize(
    "fmt, rope, seed",
    [("bf16", False, 1), ("bf16", True, 2), ("fp8", False, 3), ("fp8_ds_mla", False, 4), ("fp8_ds_mla", True, 5)],
)
def test_prefill_then_decode_matches_reference(fmt, rope, seed):
    run_and_check(Run(fmt, rope, seed))


@pytest.mark.parametrize("fmt, rope, seed", [("fp8", True, 51), ("fp8", False, 52), ("fp8_ds_mla", True, 53)])
def test_quantized_layer_matches_its_quantized_twin_tightly(fmt, rope, seed):
    """The loose tolerance against the float32 reference covers quantization; this check, on the
    same quantized values, leaves room for rounding only, so a masking mistake cannot hide."""
    run = Run(fmt, rope, seed, twin_atol=TWIN_ATOL)
    run_and_check(run)
    assert len(run.twin_errors) == sum(map(len, CHUNKS.values())) + DECODE_STEPS


def off_by_one_ops(shift):
    """jax_kimi_mla.ops with a decode attention that sees ``shift`` tokens more (or fewer)."""
    faulty = types.SimpleNamespace(**{n: getattr(ops, n) for n in dir(ops) if not n.startswith("_")})

    def attention(mqa_q, kv_cache, block_tables, context_lens, **kw):
        return ops.mla_decode_attention(mqa_q, kv_cache, block_tables, jnp.maximum(context_lens + shift, 0), **kw)

    faulty.mla_decode_attention = attention
    return faulty


@pytest.mark.parametrize("fmt, shift", [("fp8", -1), ("fp8_ds_mla", -1), ("fp8", 1)])
def test_the_twin_check_catches_an_off_by_one_token(fmt, shift):
    """The mutation that the fp8 tolerance against the float32 reference may let through: the
    decode attention one token short (or long, into an unwritten row). The twin check fails."""
    run = Run(fmt, True, 54, twin_atol=TWIN_ATOL, layer_ops=off_by_one_ops(shift))
    with pytest.raises(AssertionError, match="decode step against its quantized twin"):
        run_and_check(run)
    *prefill, decode = run.twin_errors  # every prefill step passed; the first decode failed
    assert len(prefill) == sum(map(len, CHUNKS.values())) and max(prefill) <= TWIN_ATOL, run.twin_errors
    assert not decode <= 4 * TWIN_ATOL, run.twin_errors  # far outside the limit (NaN: an unwritten row)


@pytest.mark.parametrize("fmt, rope, seed", [("fp8", True, 11), ("fp8_ds_mla", False, 12)])
def test_scanned_layer_stack_matches_reference(fmt, rope, seed):
    run_and_check(Run(fmt, rope, seed, num_layers=2))


@pytest.mark.parametrize("fmt, rope, seed", [("bf16", True, 13), ("fp8_ds_mla", False, 14)])
def test_layer_list_matches_reference(fmt, rope, seed):
    """scan_layers over a list of per-layer params: a Python loop over the same stacked cache."""
    run_and_check(Run(fmt, rope, seed, num_layers=2, layer_list=True))


@pytest.mark.parametrize(
    "fmt, overrides, seed",
    [
        ("bf16", dict(attention_block=4), 21),  # several query and key tiles, with context
        ("fp8_ds_mla", dict(output_gate=True, q_lora_rank=None, softmax_scale=0.11, attention_block=8), 22),
        ("fp8", dict(output_gate=True, attention_block=4), 23),
    ],
)
def test_model_variants_match_reference(fmt, overrides, seed):
    """Blockwise prefill attention over several tiles, Kimi-K3's output gate, q without q_lora, a
    YaRN-style softmax scale: each against the naive float32 reference of the same config."""
    run_and_check(Run(fmt, False, seed, **overrides))


@pytest.mark.parametrize("fmt, seed", [("bf16", 31), ("fp8_ds_mla", 32)])
def test_multi_token_decode_matches_reference(fmt, seed):
    """Two new tokens per sequence in one decode step: token j sees the tokens up to itself."""
    run = Run(fmt, False, seed)
    tolerance = dict(rtol=0, atol=TOLERANCE[fmt])
    for seq, chunks in CHUNKS.items():
        start = 0
        for n in chunks:
            run.prefill_chunk(seq, start, n)
            start += n
    for k in range(DECODE_STEPS // 2):
        rows, got = run.decode_tokens(k, 2)
        for i, (seq, pos) in enumerate(rows):
            np.testing.assert_allclose(got[i], run.expected[seq, pos : pos + 2], **tolerance, err_msg=f"step {k}, seq {seq}")
    run.check_untouched()


@pytest.mark.parametrize("fmt, seed", [("bf16", 41), ("fp8_ds_mla", 42)])
def test_packed_prefill_matches_reference(fmt, seed):
    """The three prompts' first chunks packed into one call (cu_seqlens, padded to 32 tokens, a
    trailing empty sequence), then the 19-token prompt's second chunk with its context: each token
    must see only its own sequence."""
    packed_first_chunks(Run(fmt, False, seed, attention_block=8), TOLERANCE[fmt])


def packed_first_chunks(run, atol):
    """The packed scenario of the test above on a given run (also used with other attention
    implementations)."""
    firsts = [(seq, chunks[0]) for seq, chunks in CHUNKS.items()]
    total = sum(n for _, n in firsts)
    pad = 2 * CHUNK_PAD
    positions = np.zeros(pad, np.int32)
    slots = np.full(pad, -1, np.int32)
    x = jnp.zeros((pad, HIDDEN), run.config.dtype)
    cu, at = [0], 0
    for seq, n in firsts:
        positions[at : at + n] = np.arange(n)
        slots[at : at + n] = [run.slot(seq, p) for p in range(n)]
        x = x.at[at : at + n].set(run.xs[seq, :n])
        at += n
        cu.append(at)
    cu.append(at)  # an empty trailing sequence: S is bucketed
    got = run.step("prefill", x, jnp.asarray(positions), jnp.asarray(slots), cu_seqlens=jnp.asarray(cu, jnp.int32))
    run.written += list(slots[:total])
    for (seq, n), start in zip(firsts, cu):
        np.testing.assert_allclose(got[start : start + n], run.expected[seq, :n], rtol=0, atol=atol, err_msg=f"packed seq {seq}")
    # The second chunk of sequence 2, as one packed sequence with its cached context.
    seq, (first, n) = 2, CHUNKS[2]
    got = run.prefill_chunk(seq, first, n, packed=True)
    np.testing.assert_allclose(got, run.expected[seq, first : first + n], rtol=0, atol=atol, err_msg="second chunk")
    run.check_untouched()


def packed_with_context(run, atol):
    """Packed chunks after cached contexts: the first chunks of sequences 0 and 2 packed, then one
    call with later tokens of sequence 0 (after 5 cached tokens), all of sequence 1 (no context)
    and the rest of sequence 2 (after 10), and an empty trailing sequence."""
    firsts = [(seq, chunks[0]) for seq, chunks in CHUNKS.items()]
    pad = 2 * CHUNK_PAD

    def call(parts, n_seqs):
        positions = np.zeros(pad, np.int32)
        slots = np.full(pad, -1, np.int32)
        x = jnp.zeros((pad, HIDDEN), run.config.dtype)
        cu, at, tables, lens = [0], 0, [], []
        for seq, start, n in parts:
            positions[at : at + n] = np.arange(start, start + n)
            slots[at : at + n] = [run.slot(seq, p) for p in range(start, start + n)]
            x = x.at[at : at + n].set(run.xs[seq, start : start + n])
            at += n
            cu.append(at)
            tables.append(run.tables[seq])
            lens.append(start)
        while len(cu) < n_seqs + 1:  # empty trailing sequences
            cu.append(at)
            tables.append(run.tables[0])
            lens.append(0)
        got = run.step("prefill", x, jnp.asarray(positions), jnp.asarray(slots), cu_seqlens=jnp.asarray(cu, jnp.int32),
                       block_table=jnp.asarray(np.stack(tables)), context_len=jnp.asarray(lens, jnp.int32))
        run.written += [s for s in slots if s >= 0]
        for (seq, start, n), at in zip(parts, cu):
            np.testing.assert_allclose(got[at : at + n], run.expected[seq, start : start + n], rtol=0, atol=atol,
                                       err_msg=f"seq {seq} [{start}:{start + n}]")

    call([(seq, 0, n) for seq, n in firsts if seq != 1], 3)
    call([(0, 5, 4), (1, 0, 11), (2, 10, 9)], 4)  # sequence 1 starts here: no context, mid-batch
    run.check_untouched()


@pytest.mark.parametrize("fmt, seed", [("bf16", 43), ("fp8", 44)])
def test_packed_prefill_with_context_matches_reference(fmt, seed):
    packed_with_context(Run(fmt, False, seed, attention_block=8), TOLERANCE[fmt])


# ---- the compiled HLO --------------------------------------------------------------------------

_INSTR = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<type>.+?) (?P<op>[\w\-]+)\((?P<args>[^)]*)\)(?P<attrs>.*)$")


def computations(hlo):
    """{computation name: [parsed instruction dicts]} from compiled.as_text()."""
    comps, current = {}, None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if header:
            current = comps.setdefault(header.group(1), [])
        elif current is not None and (m := _INSTR.match(line)):
            current.append({**m.groupdict(), "operands": re.findall(r"%([\w.\-]+)", m.group("args"))})
    return comps


def fused(comps):
    """Names of the computations that fusions call: their instructions allocate no buffers."""
    return {c for comp in comps.values() for ins in comp if ins["op"] == "fusion" for c in re.findall(r"calls=%([\w.\-]+)", ins["attrs"])}


def entry_cache_parameter(hlo, shape):
    """The entry parameter number of the (only) argument of this shape and dtype."""
    entry = hlo[hlo.index("\nENTRY ") :]
    numbers = re.findall(rf"= {re.escape(shape)}\{{[\d,]*\}} parameter\((\d+)\)", entry)
    assert len(numbers) == 1, numbers
    return int(numbers[0])


def hlo_shape(x):
    dtype = {"bfloat16": "bf16", "float8_e4m3fn": "f8e4m3fn", "uint8": "u8"}[str(x.dtype)]
    return f"{dtype}[{','.join(map(str, x.shape))}]"


def assert_cache_in_place(hlo, cache):
    """The cache parameter is aliased to an output, and nothing but parameters, bitcasts and the
    epilogue (and the loop plumbing of a scan) produces an array the size of the cache or of one
    layer's part of a stacked cache: no copy of it, no slice copied out of the stack."""
    number = entry_cache_parameter(hlo, hlo_shape(cache))
    header = hlo[: hlo.index("entry_computation_layout")]
    assert re.search(rf"input_output_alias=\{{.*\({number}, \{{\}}, may-alias\)", header), header
    sizes = {cache.size, cache.size // cache.shape[0] if cache.ndim == 4 else cache.size}
    comps = computations(hlo)
    inside_fusions = fused(comps)
    for name, comp in comps.items():
        if name in inside_fusions:
            continue
        for ins in comp:
            dims = re.fullmatch(r"[a-z0-9]+\[([\d,]*)\]\{[\d,]*\}", ins["type"])
            if dims and dims.group(1) and math.prod(int(d) for d in dims.group(1).split(",")) in sizes:
                assert ins["op"] in ("parameter", "bitcast", "get-tuple-element"), f"cache-sized {ins['op']}: %{ins['name']}"


def hidden_copies(hlo):
    """Operands of the jax_kimi_mla custom calls that are a copy, or a fusion that only slices or
    copies a wider tensor, and feed nothing but that call: work that ``jax_kimi_mla.columns``
    exists to avoid. Not counted: a fusion whose output dtype differs from its inputs' (the op
    needs bf16/fp16 whatever it reads, e.g. XLA:GPU's convert+slice of a merged q_a/kv_a GEMM's
    float32 output; converts inside a same-dtype slice, as XLA:CPU emits for bf16, still count),
    and a transpose (ql_nope comes out of the per-head BMM head-major and has to be laid out
    token-major)."""
    comps = computations(hlo)
    moving = {"parameter", "bitcast", "reshape", "convert", "slice", "dynamic-slice", "copy"}
    dtype = lambda type_text: type_text.split("[", 1)[0]
    found = []
    for comp in comps.values():
        by_name = {ins["name"]: ins for ins in comp}
        for call in comp:
            target = re.search(r'custom_call_target="(jax_kimi_mla_[^"]+)"', call["attrs"])
            if call["op"] != "custom-call" or not target:
                continue
            for name in call["operands"]:
                ins = by_name.get(name)
                if ins is None or re.search(r"\[[\d,]*\b0\b[\d,]*\]", ins["type"]):  # absent or empty
                    continue
                users = [u for u in comp if name in u["operands"]]
                if ins["op"] == "fusion":
                    body = comps[re.search(r"calls=%([\w.\-]+)", ins["attrs"]).group(1)]
                    ops = {i["op"] for i in body}
                    same_dtype = all(dtype(i["type"]) == dtype(ins["type"]) for i in body if i["op"] == "parameter")
                    copies = ops <= moving and bool(ops & {"slice", "dynamic-slice", "copy"}) and same_dtype
                else:
                    copies = ins["op"] in ("copy", "slice")
                if copies and users == [call]:
                    found.append(f"{target.group(1)} <- {ins['op']} %{name}")
    return found


# XLA's dot merger joins GEMMs that share an operand when they are small (below 16 MB on a GPU),
# and slices the joint product: at this file's sizes it merges q's GEMM with kv_a's, and k_nope's
# with v's, which no Kimi-K3-sized weight allows. The layer's own slicing is what is checked, so
# the pass is off (it is not part of XLA:CPU's pipeline anyway).
NO_DOT_MERGER = {"xla_disable_hlo_passes": "dot-merger"}


def lowered_steps(fmt, heads=HEADS, head_groups=None):
    """Compiled HLO of the jitted prefill (with context) and decode steps (the shapes of the
    scenarios above, so the compiles are shared), without XLA's dot merger (NO_DOT_MERGER)."""
    config = ml.MLAConfig(hidden_size=HIDDEN, num_heads=heads, cache_format=fmt, head_groups=head_groups)
    params = ml.init_params(jax.random.key(7), config)
    cache = ml.allocate_cache(config, NUM_BLOCKS, BLOCK)
    x = jnp.zeros((CHUNK_PAD, HIDDEN), config.dtype)
    idx = jnp.arange(CHUNK_PAD, dtype=jnp.int32)
    table = jnp.arange(MAX_BLOCKS, dtype=jnp.int32)
    prefill_hlo = prefill_step.lower(
        params, x, idx, idx, cache, block_table=table, context_len=jnp.int32(3), config=config, cos_sin_cache=None
    ).compile(NO_DOT_MERGER).as_text()
    b = len(BATCH_ROWS)
    decode_hlo = decode_step.lower(
        params, x[:b], idx[:b], idx[:b], jnp.tile(table, (b, 1)), idx[:b], cache, config=config, cos_sin_cache=None
    ).compile(NO_DOT_MERGER).as_text()
    return prefill_hlo, decode_hlo


def test_hidden_copy_check_can_fail():
    """k_pe sliced out of kv_a is a slice made only for the epilogue; columns(kv_a, 512) is not."""

    def decode_insert(k_pe_of, ql_nope, q_pe, kv_c_normed, kv_a, kv_cache, slot_mapping):
        k_pe = k_pe_of(kv_a)
        return jax_kimi_mla.fused_mla_decode_q_concat_kv_cache_insert(ql_nope, q_pe, kv_c_normed, k_pe, kv_cache, slot_mapping)

    b, h, bf16 = 2, 2, jnp.bfloat16
    args = (
        jnp.zeros((b, h, ml.L), bf16),
        jnp.zeros((b, h, ml.R), bf16),
        jnp.zeros((b, ml.L), bf16),
        jnp.zeros((b, ml.ENTRY), bf16),
        jnp.zeros((NUM_BLOCKS, BLOCK, ml.ENTRY), bf16),
        jnp.zeros((b,), jnp.int32),
    )
    ways = {"slice": lambda kv_a: kv_a[:, ml.L :], "columns": lambda kv_a: jax_kimi_mla.columns(kv_a, ml.L)}
    found = {
        way: hidden_copies(jax.jit(functools.partial(decode_insert, k_pe_of), donate_argnums=4).lower(*args).compile().as_text())
        for way, k_pe_of in ways.items()
    }
    assert len(found["slice"]) == 1 and "decode_kv_cache" in found["slice"][0], found
    assert found["columns"] == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_no_hidden_copies_feed_the_epilogues(fmt):
    prefill_hlo, decode_hlo = lowered_steps(fmt)
    assert hidden_copies(prefill_hlo) + hidden_copies(decode_hlo) == []
    grouped_hlo, _ = lowered_steps(fmt, heads=8, head_groups=4)  # the epilogue in the loop over head groups too
    assert " while(" in grouped_hlo and hidden_copies(grouped_hlo) == []



# ---- heads in groups (MLAConfig.head_groups) and what the GPU program holds ----------------


@pytest.mark.parametrize("fmt, rope, groups, seed", [("bf16", True, 2, 91), ("fp8", False, 4, 92), ("fp8_ds_mla", True, 2, 93)])
def test_head_groups_change_nothing(fmt, rope, groups, seed):
    """Prefill with its heads in groups (group 0 writes the cache, the others run in a loop and
    add their o_proj products into the output): against the reference (chunks after a context,
    packed calls, then decode over what it cached), and against the same run with all heads at
    once, within a quarter of the reference's tolerance (each head's attention output is the
    same; only o_proj's sum over the heads is rounded once per group instead of once)."""
    run = Run(fmt, rope, seed, head_groups=groups, output_gate=True, attention_block=8)
    whole = Run(fmt, rope, seed, output_gate=True, attention_block=8)
    assert ml.prefill_head_groups(run.config, CHUNK_PAD) == groups and ml.prefill_head_groups(whole.config, CHUNK_PAD) == 1
    # A bf16 rounding step (2^-8 relative, one ulp) per group's addition into the output.
    same = dict(rtol=groups * 2.0**-8, atol=TOLERANCE[fmt] / 4)
    for seq, chunks in CHUNKS.items():
        start = 0
        for n in chunks:
            got = run.prefill_chunk(seq, start, n)
            np.testing.assert_allclose(got, run.expected[seq, start : start + n], rtol=0, atol=TOLERANCE[fmt])
            np.testing.assert_allclose(got, whole.prefill_chunk(seq, start, n), **same, err_msg="grouped vs all heads")
            start += n
    for k in range(DECODE_STEPS):
        rows, _, got = run.decode(k)
        for i, r in enumerate(rows):
            if r is not None:
                np.testing.assert_allclose(got[i], run.expected[r[0], r[1]], rtol=0, atol=TOLERANCE[fmt], err_msg=f"decode {k}")
    run.check_untouched()
    packed_with_context(Run(fmt, rope, seed + 100, head_groups=groups, attention_block=8), TOLERANCE[fmt])


def test_head_groups_in_a_layer_stack():
    run_and_check(Run("fp8_ds_mla", True, 95, num_layers=2, head_groups=2))


def test_head_groups_must_divide_the_heads():
    for bad in (3, 0, -2, 2.0, True):
        with pytest.raises(ValueError, match="head_groups must be None or a divisor of num_heads=4"):
            ml.MLAConfig(num_heads=4, head_groups=bad)


def gpu_program(config, tokens):
    """The StableHLO of a jitted prefill step of one ``tokens``-token sequence lowered for CUDA
    (jax.export: no GPU needed; shapes only), and its dot_generals as (operand dtypes, result
    type, result elements)."""
    from jax_kimi_mla import _ffi

    params = jax.eval_shape(functools.partial(ml.init_params, config=config), jax.random.key(0))
    S = jax.ShapeDtypeStruct
    args = (params, S((tokens, config.hidden_size), config.dtype), S((tokens,), jnp.int32), S((tokens,), jnp.int32),
            S((tokens // 64 + 1, 64, ml.ENTRY), config.dtype))
    unchecked = [jax.export.DisabledSafetyCheck.custom_call(_ffi.target_name(op)) for op in _ffi.FFI_TARGETS]
    step = jax.jit(functools.partial(ml.prefill, config=config, attention_impl="blockwise"), donate_argnums=4)
    text = jax.export.export(step, platforms=["cuda"], disabled_checks=unchecked)(*args).mlir_module()
    dots = []
    for m in re.finditer(r"stablehlo\.dot_general .*?: \(tensor<([\dx]+)x(\w+)>, tensor<[\dx]+x(\w+)>\) -> tensor<([\dx]+)x(\w+)>", text):
        dots.append(({m.group(2), m.group(3)}, m.group(5), math.prod(int(n) for n in m.group(4).split("x"))))
    return text, dots


@pytest.mark.parametrize("heads, groups", [(12, 1), (96, 6)])
def test_the_gpu_program_holds_no_float32_products_nor_all_heads_at_once(heads, groups):
    """The prefill step as the GPU gets it, at issue 11's sizes (hidden 7168, q_lora 1536, the
    output gate, T = 8192): every GEMM on bf16 writes bf16 (accumulating in float32 inside),
    except the gate's logits, float32 for one head group only; no float32 [T, hidden] o_proj
    product, which made a third of the peak. With the size rule (head_groups=None, the default)
    Kimi-K3's 12 heads at TP8 run at once, DeepSeek's 96 in groups, in a while loop: q and k
    exist for one group's heads at a time, never for all of them, and no [T, H, 128] output of
    all heads is held (each group adds its o_proj product into the output)."""
    T = 8192
    config = ml.MLAConfig(hidden_size=7168, num_heads=heads, q_lora_rank=1536, output_gate=True)
    assert ml.prefill_head_groups(config, T) == groups
    g = heads // groups
    text, dots = gpu_program(config, T)
    on_bf16 = [(out, size) for operands, out, size in dots if operands == {"bf16"}]
    assert len(on_bf16) >= 7 and sum(out == "bf16" for out, _ in on_bf16) >= 6, on_bf16
    assert all(out == "bf16" or (out == "f32" and size == T * g * ml.V) for out, size in on_bf16), on_bf16
    assert f"tensor<{T}x{g}x192xbf16>" in text
    if groups > 1:
        assert f"tensor<{T}x{heads}x192x" not in text and f"tensor<{T}x{heads}x128x" not in text
        assert "stablehlo.while" in text


@pytest.mark.parametrize("field, value, error, message", [
    ("dtype", jnp.float32, TypeError, "dtype .* must be bfloat16 or float16"),
    ("num_heads", 0, ValueError, "num_heads must be an int >= 1"),
    ("hidden_size", 256.0, ValueError, "hidden_size must be an int >= 1"),
])
def test_config_refuses_what_the_ops_cannot_take(field, value, error, message):
    with pytest.raises(error, match=message):
        ml.MLAConfig(**{field: value})


def test_decode_without_rope_takes_no_positions():
    """positions only feed RoPE: without a cos/sin table, decode (as prefill) takes None."""
    config = ml.MLAConfig(hidden_size=HIDDEN, num_heads=HEADS)
    params = ml.init_params(jax.random.key(3), config)
    x = jax.random.normal(jax.random.key(4), (2, HIDDEN), jnp.bfloat16)
    tables = jnp.array([[0, 1], [2, 3]], jnp.int32)
    lens, slots = jnp.array([9, 3], jnp.int32), jnp.array([8, 18], jnp.int32)
    cache = ml.allocate_cache(config, NUM_BLOCKS, BLOCK)
    with_positions = ml.decode(params, x, lens - 1, slots, tables, lens, cache, config=config)
    without = ml.decode(params, x, None, slots, tables, lens, cache, config=config)
    for a, b in zip(with_positions, without):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
