"""Copy traps (issue 12): every call pattern that the README, the docstrings, the notebooks and the
serve loop recommend for an epilogue under ``jax.jit`` with donation compiles, on the CPU, to a
program with no copy of q (or of another per-head q/k array) and none of the cache, and with the
donated cache aliased to an output. Every cache format, RoPE on and off, small shapes.

The detector reads the optimized HLO (``jax.jit(...).lower(...).compile().as_text()``): a ``copy``
or ``copy-start`` outside fusion bodies whose result has a watched shape is a copy of that array;
a watched shape is the cache's (every donated argument's) and q's. ``test_detector_catches_*``
keep it honest: the patterns this replaced are caught. The README's explicit "this copies" notes
(no donation, eager calls) are not patterns to keep copy-free and are not run here."""

import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from _util import load_script
from test_docs import README, SHARDING, docstring_examples, example_inputs, python_blocks

import jax_kimi_mla as kmla
from jax_kimi_mla import layer as mla
from jax_kimi_mla.formats import CACHE_FORMATS

ROOT = Path(__file__).resolve().parents[1]
T, H, NUM_BLOCKS, BLOCK_SIZE = 6, 2, 5, 8  # no per-head shape equals the cache's
FORMATS = tuple(CACHE_FORMATS)  # "bf16", "fp8", "fp8_ds_mla"
ROPE = pytest.mark.parametrize("rope", [False, True], ids=["nope", "rope"])
FMT = pytest.mark.parametrize("fmt", FORMATS)
# The last dims of q-like arrays: prefill q / k (192), decode ql_nope (512), mqa_q (576).
Q_WIDTHS = (192, 512, 576)


# ---- the detector ----


def _computations(hlo: str) -> dict[str, list[str]]:
    """The module's computations by name (ENTRY as "ENTRY"), each as its instruction lines."""
    comps, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY\s+)?(%[\w.\-]+)\s*\(.*\{\s*$", line)
        if head:
            name = "ENTRY" if head.group(1) else head.group(2)
            comps[name] = []
        elif name is not None and line.strip() and line.strip() != "}":
            comps[name].append(line.strip())
    return comps


def _dims(type_text: str) -> list[tuple[int, ...]]:
    """Every array shape in an HLO type (a tuple type gives several)."""
    return [tuple(int(d) for d in m.split(",") if d) for m in re.findall(r"\w+\[([\d,]*)\]", type_text)]


def copies(hlo: str, shapes) -> list[str]:
    """``copy`` / ``copy-start`` instructions, outside fusion bodies (there a copy is part of
    computing a value), whose result has one of ``shapes``."""
    comps = _computations(hlo)
    fused = {m for lines in comps.values() for line in lines if " fusion(" in line for m in re.findall(r"calls=(%[\w.\-]+)", line)}
    shapes = {tuple(s) for s in shapes}
    found = []
    for name, lines in comps.items():
        if name in fused:
            continue
        for line in lines:
            m = re.match(r"^(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.*?)\s+copy(?:-start)?\(", line)
            if m and shapes & set(_dims(m.group(1))):
                found.append(line[:160])
    return found


def q_like_copies(hlo: str) -> list[str]:
    """Copies of any array of rank >= 3 whose last dim is a q width: q, k, ql_nope, mqa_q (or a
    576-wide cache), whatever their leading dims."""
    comps = _computations(hlo)
    fused = {m for lines in comps.values() for line in lines if " fusion(" in line for m in re.findall(r"calls=(%[\w.\-]+)", line)}
    found = []
    for name, lines in comps.items():
        for line in [] if name in fused else lines:
            m = re.match(r"^(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.*?)\s+copy(?:-start)?\(", line)
            if m and any(len(d) >= 3 and d[-1] in Q_WIDTHS for d in _dims(m.group(1))):
                found.append(line[:160])
    return found


def aliased_parameters(hlo: str) -> set[int]:
    """The entry parameters aliased to an output (the module's ``input_output_alias``)."""
    m = re.search(r"input_output_alias=\{(.*?)\}\s*,\s*entry_computation_layout", hlo)
    return set() if m is None else {int(p) for p in re.findall(r"\}:\s*\((\d+),", m.group(1))}


def parameters_of_shape(hlo: str, shape) -> list[int]:
    entry = _computations(hlo)["ENTRY"]
    dims = ",".join(map(str, shape))
    return [int(m.group(1)) for line in entry for m in [re.search(rf"\[{dims}\]\{{[^}}]*\}} parameter\((\d+)\)", line)] if m]


def check_no_copies(hlo: str, caches, q_shapes=()):
    """No copy of a cache (each of ``caches``' shapes, every cache parameter aliased) nor of q."""
    problems = []
    for shape in caches:
        params = parameters_of_shape(hlo, shape)
        assert params, f"no entry parameter of the cache's shape {shape}"
        if not set(params) <= aliased_parameters(hlo):
            problems.append(f"cache parameter(s) {params} {shape} not aliased to an output")
    problems += dict.fromkeys(copies(hlo, list(caches) + list(q_shapes)) + q_like_copies(hlo))
    assert not problems, "copies in the compiled step:\n" + "\n".join(problems)


def compiled(step, *args, **kwargs) -> str:
    return step.lower(*args, **kwargs).compile().as_text()


# ---- inputs ----


def _normal(key, shape, dtype=jnp.bfloat16):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def prefill_inputs(fmt, rope, padded=False):
    """Inputs of a prefill call; ``padded``: cache rows padded by 64 bytes (allowed widths)."""
    k = iter(jax.random.split(jax.random.key(1), 8))
    layout = CACHE_FORMATS[fmt]
    cache_dtype = layout.cache_dtype(jnp.bfloat16)
    width = layout.width + (64 // jnp.dtype(cache_dtype).itemsize if padded else 0)
    a = dict(
        q=_normal(next(k), (T, H, 192)), k_nope=_normal(next(k), (T, H, 128)), k_pe=_normal(next(k), (T, 64)),
        kv_c_normed=_normal(next(k), (T, 512)), v=_normal(next(k), (T, H, 128)),
        kv_cache=jnp.zeros((NUM_BLOCKS, BLOCK_SIZE, width), cache_dtype),
        slot_mapping=jnp.array([0, 9, -1, 17, 30, 39][:T], jnp.int32),
    )
    rope_kw = dict(positions=jnp.arange(T, dtype=jnp.int32), cos_sin_cache=kmla.make_cos_sin_cache(64)) if rope else {}
    return a, rope_kw


def decode_inputs(fmt, rope, padded=False):
    a, rope_kw = prefill_inputs(fmt, rope, padded)
    k = iter(jax.random.split(jax.random.key(2), 4))
    a.update(ql_nope=_normal(next(k), (T, H, 512)), q_pe=_normal(next(k), (T, H, 64)))
    fmt_kw = {"fp8": dict(q_scale_inv=jnp.float32(16.0), cache_scale_inv=jnp.float32(16.0)), "fp8_ds_mla": dict(ds_mla=True)}.get(fmt, {})
    return a, rope_kw, fmt_kw


SCALES = (jnp.float32(16.0),) * 4


# ---- the ops' documented patterns (ops.py docstrings) ----


def prefill_epilogue_step(fmt):
    """The recommended standalone prefill epilogue step (ops.py): q and the cache donated, the
    rotated (or unchanged) q returned first among the outputs of its shape."""
    if fmt == "fp8":  # every output is new: donate the cache, return what the op returns

        def step(q, k_nope, k_pe, kv_c_normed, v, kv_cache, slot_mapping, *, positions=None, cos_sin_cache=None):
            return kmla.fused_mla_qkv_quant_kv_cache_fp8_insert(
                q, k_nope, k_pe, kv_c_normed, v, kv_cache, slot_mapping, *SCALES, positions=positions, cos_sin_cache=cos_sin_cache)

        return jax.jit(step, donate_argnums=5)
    op = kmla.fused_mla_key_concat_ds_mla_insert if fmt == "fp8_ds_mla" else kmla.fused_mla_key_concat_kv_cache_insert

    @functools.partial(jax.jit, donate_argnums=(0, 4))
    def step(q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, *, positions=None, cos_sin_cache=None):
        k, q, kv_cache = op(q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, positions=positions, cos_sin_cache=cos_sin_cache)
        return q, k, kv_cache

    return step


def prefill_args(fmt, a):
    names = ["q", "k_nope", "k_pe", "kv_c_normed"] + (["v"] if fmt == "fp8" else []) + ["kv_cache", "slot_mapping"]
    return [a[n] for n in names]


PADDED = pytest.mark.parametrize("padded", [False, True], ids=["rows", "padded_rows"])


@FMT
@ROPE
@PADDED
def test_prefill_epilogue_step_copies_nothing(fmt, rope, padded):
    a, rope_kw = prefill_inputs(fmt, rope, padded)
    hlo = compiled(prefill_epilogue_step(fmt), *prefill_args(fmt, a), **rope_kw)
    check_no_copies(hlo, [a["kv_cache"].shape], [a["q"].shape])


@FMT
@ROPE
def test_prefill_inside_a_step_copies_nothing(fmt, rope):
    """The model-step pattern: q made inside the step (as by q_b_proj), used there, and only what
    is new returned (the attention's stand-in and the cache)."""
    a, rope_kw = prefill_inputs(fmt, rope)
    w = _normal(jax.random.key(3), (H * 192, H * 192))

    @functools.partial(jax.jit, donate_argnums=4)
    def step(x, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, v, positions=None, cos_sin_cache=None):
        q = (x @ w).reshape(T, H, 192)  # the projection
        kw = dict(positions=positions, cos_sin_cache=cos_sin_cache)
        if fmt == "fp8":
            q, k, _, kv_cache = kmla.fused_mla_qkv_quant_kv_cache_fp8_insert(q, k_nope, k_pe, kv_c_normed, v, kv_cache, slot_mapping, *SCALES, **kw)
        else:
            op = kmla.fused_mla_key_concat_ds_mla_insert if fmt == "fp8_ds_mla" else kmla.fused_mla_key_concat_kv_cache_insert
            k, q, kv_cache = op(q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, **kw)
        scores = jnp.einsum("thc,shc->hts", q.astype(jnp.float32), k.astype(jnp.float32))  # stands in for attention
        return scores, kv_cache

    x = a["q"].reshape(T, H * 192)
    hlo = compiled(step, x, a["k_nope"], a["k_pe"], a["kv_c_normed"], a["kv_cache"], a["slot_mapping"], a["v"], **rope_kw)
    check_no_copies(hlo, [a["kv_cache"].shape], [a["q"].shape])


@FMT
@ROPE
@PADDED
def test_decode_epilogue_step_copies_nothing(fmt, rope, padded):
    """ops.py's module docstring: ``jax.jit(fused_mla_decode_q_concat_kv_cache_insert, donate_argnums=(4,))``."""
    a, rope_kw, fmt_kw = decode_inputs(fmt, rope, padded)
    step = jax.jit(functools.partial(kmla.fused_mla_decode_q_concat_kv_cache_insert, **fmt_kw), donate_argnums=(4,))
    hlo = compiled(step, a["ql_nope"], a["q_pe"], a["kv_c_normed"], a["k_pe"], a["kv_cache"], a["slot_mapping"], **rope_kw)
    check_no_copies(hlo, [a["kv_cache"].shape], [a["ql_nope"].shape])


@FMT
@ROPE
def test_readme_decode_step_pattern_copies_nothing(fmt, rope):
    """The README's decode step (epilogue, then the decode attention), in every format."""
    a, rope_kw, fmt_kw = decode_inputs(fmt, rope)
    read_kw = {k: v for k, v in fmt_kw.items() if k != "q_scale_inv"} | ({"q_scale_inv": fmt_kw["q_scale_inv"]} if fmt == "fp8" else {})

    @functools.partial(jax.jit, donate_argnums=4)
    def decode_step(ql_nope, q_pe, kv_c_normed, k_pe, kv_cache, slot_mapping, block_tables, context_lens, positions=None, cos_sin_cache=None):
        mqa_q, kv_cache = kmla.fused_mla_decode_q_concat_kv_cache_insert(
            ql_nope, q_pe, kv_c_normed, k_pe, kv_cache, slot_mapping, positions=positions, cos_sin_cache=cos_sin_cache, **fmt_kw)
        latent = kmla.mla_decode_attention(mqa_q, kv_cache, block_tables, context_lens, softmax_scale=192**-0.5, **read_kw)
        return latent, kv_cache

    tables = jnp.arange(T * 2, dtype=jnp.int32).reshape(T, 2) % NUM_BLOCKS
    lens = jnp.array([1, 3, 8, 9, 16, 2][:T], jnp.int32)
    hlo = compiled(decode_step, a["ql_nope"], a["q_pe"], a["kv_c_normed"], a["k_pe"], a["kv_cache"], a["slot_mapping"], tables, lens, **rope_kw)
    check_no_copies(hlo, [a["kv_cache"].shape], [a["ql_nope"].shape])


# ---- the layer (its docstrings, notebook 02) and the serve loop ----


def layer_setup(fmt, rope, num_layers=None):
    config = mla.MLAConfig(hidden_size=128, num_heads=H, cache_format=fmt, attention_block=8, attention_impl="blockwise")
    params = mla.init_params(jax.random.key(0), config, num_layers)
    cache = mla.allocate_cache(config, NUM_BLOCKS, BLOCK_SIZE, num_layers)
    cos_sin = kmla.make_cos_sin_cache(64) if rope else None
    return config, params, cache, cos_sin


@FMT
@ROPE
def test_layer_prefill_and_decode_steps_copy_nothing(fmt, rope):
    """Notebook 02 and the layer docstring: ``jax.jit(mla.prefill, static_argnames="config",
    donate_argnums=4)`` and ``jax.jit(mla.decode, ..., donate_argnums=6)``."""
    config, params, cache, cos_sin = layer_setup(fmt, rope)
    x = _normal(jax.random.key(4), (T, 128))
    positions, slots = jnp.arange(T, dtype=jnp.int32), jnp.arange(T, dtype=jnp.int32)
    prefill = jax.jit(mla.prefill, static_argnames="config", donate_argnums=4)
    hlo = compiled(prefill, params, x, positions, slots, cache, config=config, cos_sin_cache=cos_sin)
    check_no_copies(hlo, [cache.shape], [(T, H, 192)])

    decode = jax.jit(mla.decode, static_argnames="config", donate_argnums=6)
    tables = jnp.arange(T * 2, dtype=jnp.int32).reshape(T, 2) % NUM_BLOCKS
    lens = jnp.full((T,), 3, jnp.int32)
    hlo = compiled(decode, params, x, positions, slots, tables, lens, cache, config=config, cos_sin_cache=cos_sin)
    check_no_copies(hlo, [cache.shape], [(T, H, 512), (T, H, 576)])


def _serve_loop():
    return load_script(ROOT / "examples" / "serve_loop.py", "serve_loop_under_test")


@FMT
@ROPE
def test_scan_layers_and_serve_loop_steps_copy_nothing(fmt, rope):
    """``scan_layers`` (its docstring) and examples/serve_loop.py's jitted prefill-chunk and decode
    steps over a stacked 2-layer cache."""
    layers = 2
    config, _, cache, cos_sin = layer_setup(fmt, rope, layers)
    serve = _serve_loop()
    params = serve.init_model(jax.random.key(5), config, layers, vocab=32)
    prefill, decode = serve.make_steps(config, cos_sin)
    tokens, positions, slots = jnp.arange(T, dtype=jnp.int32), jnp.arange(T, dtype=jnp.int32), jnp.arange(T, dtype=jnp.int32)
    tables = jnp.arange(2 * 2, dtype=jnp.int32).reshape(2, 2)
    hlo = compiled(prefill, params, tokens, positions, slots, jnp.array([0, 4, T], jnp.int32), tables, jnp.array([0, 0], jnp.int32), cache,
                   context_tokens=32)
    check_no_copies(hlo, [cache.shape], [(T, H, 192)])
    hlo = compiled(decode, params, tokens[:2], positions[:2], slots[:2], tables, jnp.array([1, 2], jnp.int32), cache)
    check_no_copies(hlo, [cache.shape], [(2, H, 512), (2, H, 576)])
    assert " while(" not in hlo, "the serve loop's layers are a list of per-layer params: no scan slicing a stack of weights"

    step = jax.jit(lambda p, x, c, *a: mla.scan_layers(functools.partial(mla.decode, config=config), p, x, c, *a, cos_sin_cache=cos_sin),
                   donate_argnums=2)
    x = _normal(jax.random.key(6), (2, 128))
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *params["layers"])
    for layer_params in (stacked, params["layers"]):
        hlo = compiled(step, layer_params, x, cache, positions[:2], slots[:2], tables, jnp.array([1, 2], jnp.int32))
        check_no_copies(hlo, [cache.shape], [(2, H, 512), (2, H, 576)])


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_ds_mla"])
def test_layers_called_one_by_one_copy_nothing(fmt):
    """layer=i from an unrolled loop (layers of different kinds cannot share one scan): the
    epilogues write the stack whole, so neither the stack nor a flat view of it is copied (with
    the stack reshaped before the in-place call, XLA copied it in and out on every step)."""
    layers = 2
    config, params, cache, _ = layer_setup(fmt, False, layers)
    positions = slots = jnp.arange(2, dtype=jnp.int32)
    tables, lens = jnp.arange(4, dtype=jnp.int32).reshape(2, 2), jnp.array([1, 2], jnp.int32)

    def decode_step(params, x, cache):
        for i in range(layers):
            out, cache = mla.decode(jax.tree.map(lambda a, i=i: a[i], params), x, positions, slots, tables, lens, cache, config=config, layer=i)
            x = x + out
        return x, cache

    def prefill_step(params, x, cache):
        for i in range(layers):
            out, cache = mla.prefill(jax.tree.map(lambda a, i=i: a[i], params), x, jnp.arange(T, dtype=jnp.int32),
                                     jnp.arange(T, dtype=jnp.int32), cache, config=config, layer=i)
            x = x + out
        return x, cache

    flat = (layers * NUM_BLOCKS, *cache.shape[2:])
    hlo = compiled(jax.jit(decode_step, donate_argnums=2), params, _normal(jax.random.key(8), (2, 128)), cache)
    check_no_copies(hlo, [cache.shape], [flat, (2, H, 576)])
    hlo = compiled(jax.jit(prefill_step, donate_argnums=2), params, _normal(jax.random.key(9), (T, 128)), cache)
    check_no_copies(hlo, [cache.shape], [flat])


# ---- the README's and the docstrings' code blocks, as written ----


class JitRecorder:
    """Stands in for ``jax.jit`` while documentation blocks run: a jit with donation compiles
    each call for inspection first, recording (name, HLO, shapes of the donated leaves)."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, fun=None, **kw):
        if fun is None:
            return functools.partial(self, **kw)
        jitted = self.real(fun, **kw)
        donated = kw.get("donate_argnums", ())
        donated = (donated,) if isinstance(donated, int) else tuple(donated)
        if not donated:
            return jitted

        @functools.wraps(fun)
        def call(*args, **kwargs):
            leaves = [x for i in donated for x in jax.tree.leaves(args[i])]
            hlo = jitted.lower(*args, **kwargs).compile().as_text()
            self.calls.append((getattr(fun, "__name__", repr(fun)), hlo, [x.shape for x in leaves]))
            return jitted(*args, **kwargs)

        return call


def check_recorded_calls(calls, source: str):
    """check_no_copies on each recorded (name, hlo, caches) call, the failure naming its source."""
    for name, hlo, caches in calls:
        try:
            check_no_copies(hlo, caches)
        except AssertionError as e:
            raise AssertionError(f"{source} {name}: {e}") from None


def run_recorded(monkeypatch, blocks, namespace_of):
    recorder = JitRecorder(jax.jit)
    monkeypatch.setattr(jax, "jit", recorder)
    for where, block in blocks:
        exec(compile(block, where, "exec"), namespace_of(where))  # noqa: S102
    monkeypatch.setattr(jax, "jit", recorder.real)
    return recorder.calls


def test_readme_blocks_copy_nothing(monkeypatch):
    """The README's Python blocks, run as written: each donating jit call is copy-free."""
    namespace = {"__name__": "readme"}
    blocks = [(f"README.md python block {i + 1}", b) for i, b in enumerate(python_blocks(README.read_text()))]
    calls = run_recorded(monkeypatch, blocks, lambda _: namespace)
    assert {"decode_step", "decode_step_ds_mla", "prefill_step", "decode_layers"} <= {name for name, _, _ in calls}
    check_recorded_calls(calls, "README")
    # Pattern 4: neither the stack's flat view nor one layer's rows is copied either.
    (stack,) = [caches[0] for name, _, caches in calls if name == "decode_layers"]
    layers, blocks, *row = stack
    views = [(layers * blocks, *row), (blocks, *row)]
    check_recorded_calls([(name, hlo, caches) for name, hlo, caches in calls if name == "decode_layers"], "README")
    for name, hlo, _ in calls:
        if name == "decode_layers":
            assert not copies(hlo, views) and not copy_fusions(hlo, views), copies(hlo, views) + copy_fusions(hlo, views)


def copy_fusions(hlo: str, shapes) -> list[str]:
    """Fusions that XLA names a copy (``bitcast_copy_fusion``: a slice copied out) with a result of
    one of ``shapes``."""
    found = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%([\w.\-]*copy[\w.\-]*)\s*=\s*(.*?)\s+fusion\(", line)
        if m and set(_dims(m.group(2))) & {tuple(x) for x in shapes}:
            found.append(line.strip())
    return found


def test_detector_catches_a_layer_sliced_out_of_the_stack():
    """What pattern 4 of the README avoids: stack[i] in, .at[i].set out, copies a layer a step."""
    layers, B = 3, 2
    stack = jnp.zeros((layers, NUM_BLOCKS, BLOCK_SIZE, 576), jnp.bfloat16)
    args = [_normal(jax.random.key(i), shape) for i, shape in enumerate([(B, H, 512), (B, H, 64), (B, 512), (B, 64)])]
    slots = jnp.array([0, 9], jnp.int32)

    def step(stack, ql_nope, q_pe, kv_c_normed, k_pe):
        def layer(stack, i):
            mqa_q, cache = kmla.fused_mla_decode_q_concat_kv_cache_insert(ql_nope, q_pe, kv_c_normed, k_pe, stack[i], slots)
            return stack.at[i].set(cache), mqa_q

        return jax.lax.scan(layer, stack, jnp.arange(layers))

    stack, args = jax.device_put((stack, args), jax.devices("cpu")[0])  # XLA:CPU's program (a GPU's names differ)
    hlo = compiled(jax.jit(step, donate_argnums=0), stack, *args)
    # The layer, sliced out (jax 0.10 also copies the whole stack every iteration; 0.12 does not).
    assert copy_fusions(hlo, [(NUM_BLOCKS, BLOCK_SIZE, 576)])


def test_sharding_and_errors_doc_blocks_copy_nothing(monkeypatch):
    """docs/SHARDING.md's tensor-parallel step (on every CPU device of the tests) and
    docs/ERRORS.md's checkified step, run as written."""
    sharding = [(f"docs/SHARDING.md python block {i + 1}", b) for i, b in enumerate(python_blocks(SHARDING.read_text()))]
    errors = [(f"docs/ERRORS.md python block {i + 1}", b) for i, b in enumerate(python_blocks((ROOT / "docs" / "ERRORS.md").read_text()))]
    namespaces = {"sharding": {"__name__": "sharding_doc"}, "errors": example_inputs()}
    calls = run_recorded(monkeypatch, sharding + errors, lambda where: namespaces["sharding" if "SHARDING" in where else "errors"])
    assert len(calls) >= 2
    check_recorded_calls(calls, "docs")


def test_docstring_blocks_copy_nothing(monkeypatch):
    """The ``::`` example blocks of the docstrings, run as written: each donating jit call (the
    ops' examples among them) is copy-free."""
    examples = {where: (block, module_globals) for where, block, module_globals in docstring_examples()}
    calls = run_recorded(monkeypatch, [(w, b) for w, (b, _) in examples.items()], lambda w: dict(examples[w][1]) | example_inputs())
    assert {"prefill_epilogue", "fused_mla_decode_q_concat_kv_cache_insert"} <= {name for name, _, _ in calls}
    check_recorded_calls(calls, "docstring")


# ---- the detector catches the known traps ----


@FMT
def test_detector_catches_the_old_nope_prefill_docstring_pattern(fmt):
    """Trap 1: ``jax.jit(op, donate_argnums=(cache,))`` returns the op's unchanged q from the
    top-level jit, which XLA can only do by copying q."""
    if fmt == "fp8":
        pytest.skip("the fp8 prefill op returns no input unchanged")
    a, _ = prefill_inputs(fmt, False)
    op = kmla.fused_mla_key_concat_ds_mla_insert if fmt == "fp8_ds_mla" else kmla.fused_mla_key_concat_kv_cache_insert
    hlo = compiled(jax.jit(op, donate_argnums=(4,)), *prefill_args(fmt, a))
    assert copies(hlo, [a["q"].shape]), "the detector missed copy(q)"
    with pytest.raises(AssertionError, match="copies in the compiled step"):
        check_no_copies(hlo, [a["kv_cache"].shape], [a["q"].shape])


@FMT
def test_detector_catches_donated_q_paired_with_k(fmt):
    """Trap 2: with RoPE and q donated, a jit returning the op's (k, q, kv_cache) gives the donated
    q to k (the first output of its shape) and copies q."""
    if fmt == "fp8":
        pytest.skip("the fp8 prefill op does not alias q")
    a, rope_kw = prefill_inputs(fmt, True)
    op = kmla.fused_mla_key_concat_ds_mla_insert if fmt == "fp8_ds_mla" else kmla.fused_mla_key_concat_kv_cache_insert
    hlo = compiled(jax.jit(op, donate_argnums=(0, 4)), *prefill_args(fmt, a), **rope_kw)
    with pytest.raises(AssertionError, match="copies in the compiled step"):
        check_no_copies(hlo, [a["kv_cache"].shape], [a["q"].shape])


def test_detector_catches_an_undonated_cache():
    a, _, _ = decode_inputs("bf16", False)
    hlo = compiled(jax.jit(kmla.fused_mla_decode_q_concat_kv_cache_insert), a["ql_nope"], a["q_pe"], a["kv_c_normed"], a["k_pe"], a["kv_cache"],
                   a["slot_mapping"])
    with pytest.raises(AssertionError, match="not aliased"):
        check_no_copies(hlo, [a["kv_cache"].shape])
