"""docs/ERRORS.md is executable: every table row's call is run and must raise exactly the
documented exception type and message, from the FFI op and from the reference alike.

A row's call is a small Python expression (see "How to read the tables" in the doc): a format
name from _util.FORMATS applied to changes of a valid base call, ``check_inputs(...)``,
``checkify(check_inputs)(...)`` (jitted under jax.experimental.checkify), or another public
function. Besides, every ``raise`` in _checks.py, debug.py and numerics.py must be reached by
some row, so a new error cannot go undocumented.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from _util import FORMATS, invoke
from jax.experimental import checkify

import jax_kimi_mla
from jax_kimi_mla import _checks, debug, layer, numerics, reference
from jax_kimi_mla.formats import EPILOGUES

DOC = Path(__file__).resolve().parents[1] / "docs" / "ERRORS.md"
DTYPES = {name: np.dtype(name) for name in ("float16", "float32", "int16", "int32", "int64", "uint8")}
DTYPES.update(bfloat16=np.dtype(ml_dtypes.bfloat16), float8_e4m3fn=np.dtype(ml_dtypes.float8_e4m3fn))
ROW = re.compile(r"^\| *(\d+) *\|[^|]*\| *`(.+?)` *\| *(\w+) *\| *(.+?) *\|$")


@dataclass(frozen=True)
class Row:
    number: int
    call: str
    raises: str
    message: str


def code_span(cell: str) -> str:
    """The text of a markdown code span: `x`, or `` x `` when x itself holds a backtick."""
    if cell.startswith("`` ") and cell.endswith(" ``"):
        return cell[3:-3]
    assert cell.startswith("`") and cell.endswith("`") and "`" not in cell[1:-1], f"not a code span: {cell}"
    return cell[1:-1]


def rows() -> list:
    found = [ROW.match(line) for line in DOC.read_text().splitlines()]
    out = [Row(int(m[1]), m[2], m[3], code_span(m[4])) for m in found if m]
    assert [r.number for r in out] == list(range(1, len(out) + 1)), "rows of docs/ERRORS.md must be numbered 1, 2, ..."
    return out


def value(node):
    """An argument of a row's call: a literal, dtype[shape] (zeros), a list (int32), dtype(list),
    or columns(array, start)."""
    if isinstance(node, (ast.Constant, ast.UnaryOp)):  # a literal, -1 included
        return ast.literal_eval(node)
    if isinstance(node, ast.Subscript) and node.value.id in DTYPES:
        shape = ast.literal_eval(node.slice)
        shape = shape if isinstance(shape, tuple) else (shape,)
        if any(isinstance(d, str) for d in shape):  # a symbolic dimension: an abstract argument of an export
            return jax.ShapeDtypeStruct(jax.export.symbolic_shape(", ".join(map(str, shape))), DTYPES[node.value.id])
        return np.zeros(shape, DTYPES[node.value.id])
    if isinstance(node, ast.List):
        return np.array(ast.literal_eval(node), np.int32)
    if isinstance(node, ast.Call) and node.func.id in DTYPES:
        return np.array(ast.literal_eval(node.args[0]), DTYPES[node.func.id])
    if isinstance(node, ast.Call) and node.func.id == "columns":
        return jax_kimi_mla.columns(value(node.args[0]), ast.literal_eval(node.args[1]))
    raise ValueError(f"unsupported argument in docs/ERRORS.md: {ast.unparse(node)}")


def base(fmt: str) -> dict:
    """The valid call that a format's rows change: T = 2, H = 3, bfloat16 zeros."""
    T, H = 2, 3
    zeros = lambda *shape: np.zeros(shape, DTYPES["bfloat16"])  # noqa: E731
    if fmt.startswith("prefill"):
        a = dict(q=zeros(T, H, 192), k_nope=zeros(T, H, 128))
    else:
        a = dict(ql_nope=zeros(T, H, 512), q_pe=zeros(T, H, 64))
    a.update(k_pe=zeros(T, 64), kv_c_normed=zeros(T, 512))
    if fmt == "prefill_fp8":
        a["v"] = zeros(T, H, 128)
    cache = EPILOGUES[fmt].cache_format
    a["kv_cache"] = np.zeros((4, 2, cache.width), cache.cache_dtype(DTYPES["bfloat16"]))
    a["slot_mapping"] = np.zeros(T, np.int32)
    a.update({name: np.zeros((), np.float32) for name in EPILOGUES[fmt].scales})
    return a


def attention_base() -> dict:
    """The valid mla_decode_attention call that the attention(...) rows change."""
    return dict(
        mqa_q=np.zeros((2, 3, 576), DTYPES["bfloat16"]),
        kv_cache=np.zeros((4, 2, 576), DTYPES["bfloat16"]),
        block_tables=np.zeros((2, 2), np.int32),
        context_lens=np.zeros(2, np.int32),
        softmax_scale=0.1,
    )


LAYER_CONFIG = dict(hidden_size=64, num_heads=2)
# Keywords of layer rows read as literals: MLAConfig fields that change the call's config (the
# params stay the base config's), and params_config={...}, fields that change the params' config.
LAYER_LITERALS = {"num_heads", "hidden_size", "q_lora_rank", "output_gate", "cache_format", "params_config", "params_list"}
LAYER_CALLS = ("layer_prefill", "layer_decode", "layer_scan")


@functools.cache
def _layer_weights(params_changes: tuple = (), num_layers=None):
    config = layer.MLAConfig(**{**LAYER_CONFIG, **dict(params_changes)})
    return config, layer.init_params(jax.random.key(0), config, num_layers)


def layer_base(name: str, params_changes: tuple = ()) -> dict:
    """The valid layer.prefill / layer.decode call that the layer_prefill(...) / layer_decode(...)
    rows change: 2 tokens (2 sequences in decode), hidden 64, 2 heads, a bf16 cache [4, 2, 576]."""
    num_layers = 2 if name == "layer_scan" else None
    config, params = _layer_weights(params_changes, num_layers)
    a = dict(params=params, x=np.zeros((2, 64), DTYPES["bfloat16"]), positions=np.zeros(2, np.int32),
             slot_mapping=np.zeros(2, np.int32), kv_cache=layer.allocate_cache(config, 4, 2, num_layers), config=config)
    if name == "layer_decode":
        a.update(block_tables=np.zeros((2, 2), np.int32), context_lens=np.zeros(2, np.int32))
    return a


def staged_check_inputs(**kwargs):
    """check_inputs under jax.jit(checkify.checkify(...)): arrays traced, the rest static."""
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, np.ndarray)}
    static = {k: v for k, v in kwargs.items() if k not in arrays}
    err, _ = jax.jit(checkify.checkify(lambda a: debug.check_inputs(**a, **static)))(arrays)
    err.throw()


def exported(fn, kwargs: dict):
    """fn(**kwargs) exported for the CPU, its arrays (some with symbolic dimensions) as the jitted
    function's arguments and the rest bound."""
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, np.ndarray | jax.ShapeDtypeStruct)}
    rest = {k: v for k, v in kwargs.items() if k not in arrays}
    disabled = [jax.export.DisabledSafetyCheck.custom_call(jax_kimi_mla._ffi.target_name(op)) for op in jax_kimi_mla._ffi.FFI_TARGETS]
    return jax.export.export(jax.jit(lambda a: fn(**a, **rest)), platforms=("cpu",), disabled_checks=disabled)(arrays)


def callables(call: str) -> list:
    """(label, thunk) pairs that a row's call stands for; a call with a symbolic dimension
    (``bfloat16["b", 3, 576]``) is exported."""
    node = ast.parse(call, mode="eval").body
    if getattr(node.func, "id", None) in LAYER_CALLS:  # config fields and params_config={...} are literals
        kwargs = {k.arg: ast.literal_eval(k.value) if k.arg in LAYER_LITERALS else value(k.value) for k in node.keywords}
    else:
        kwargs = {k.arg: value(k.value) for k in node.keywords}
    assert not node.args, f"use keyword arguments only: {call}"
    if any(isinstance(v, jax.ShapeDtypeStruct) for v in kwargs.values()):
        assert node.func.id == "attention", f"symbolic dimensions are wired for attention(...) rows: {call}"
        a = dict(attention_base(), **kwargs)
        return [(impl.__name__, lambda impl=impl: exported(impl.mla_decode_attention, a)) for impl in (jax_kimi_mla, reference)]
    if isinstance(node.func, ast.Call):
        assert ast.unparse(node.func) == "checkify(check_inputs)", call
        return [("checkify", lambda: staged_check_inputs(**kwargs))]
    name = node.func.id
    if name == "attention":
        a = dict(attention_base(), **kwargs)
        return [(impl.__name__, lambda impl=impl: impl.mla_decode_attention(**a)) for impl in (jax_kimi_mla, reference)]
    if name == "gather":
        a = {k: v for k, v in attention_base().items() if k in ("kv_cache", "block_tables", "context_lens")} | kwargs
        return [(impl.__name__, lambda impl=impl: impl.gather_mla_cache(**a)) for impl in (jax_kimi_mla, reference)]
    if name in FORMATS:
        a = dict(base(name), **kwargs)
        return [(impl.__name__, functools.partial(invoke, impl, name, a)) for impl in (jax_kimi_mla, reference)]
    if name in LAYER_CALLS:
        params_list = kwargs.pop("params_list", None)
        changes = {k: kwargs.pop(k) for k in list(kwargs) if k in LAYER_LITERALS and k != "params_config"}
        params_config = kwargs.pop("params_config", {})
        a = dict(layer_base(name, tuple(sorted(params_config.items()))), **kwargs)
        a["config"] = layer.MLAConfig(**{**LAYER_CONFIG, **changes})
        if params_list is not None:  # the first params_list layers, as a list of per-layer params
            a["params"] = layer.unstack_layers(a["params"])[:params_list]
        if name == "layer_scan":
            step = functools.partial(layer.prefill, config=a["config"])
            return [(name, lambda: layer.scan_layers(step, a["params"], a["x"], a["kv_cache"], a["positions"], a["slot_mapping"]))]
        step = layer.prefill if name == "layer_prefill" else layer.decode
        return [(name, lambda: step(**a))]
    fn = debug.check_inputs if name == "check_inputs" else getattr(jax_kimi_mla, name)
    return [(name, lambda: fn(**kwargs))]


def raised(thunk):
    try:
        thunk()
    except Exception as e:  # noqa: BLE001 - the row says which type is right
        return e
    return None


def raise_site(error) -> tuple:
    tb = error.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return Path(tb.tb_frame.f_code.co_filename).resolve(), tb.tb_lineno


@pytest.mark.parametrize("row", rows(), ids=lambda r: f"row{r.number}")
def test_documented_error(row):
    for label, thunk in callables(row.call):
        error = raised(thunk)
        assert error is not None, f"row {row.number}: {label}: `{row.call}` raised nothing"
        assert (type(error).__name__, str(error)) == (row.raises, row.message), f"row {row.number}: {label}"


def test_every_raise_is_documented():
    reached = set()
    for row in rows():
        for _, thunk in callables(row.call):
            error = raised(thunk)
            if error is not None:
                reached.add(raise_site(error))
    for module in (_checks, debug, numerics):
        path = Path(module.__file__).resolve()
        lines = {n.lineno for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Raise)}
        missing = sorted(line for line in lines if (path, line) not in reached)
        assert not missing, f"{path.name}: the raise at line(s) {missing} is reached by no row of docs/ERRORS.md"


# ---- check_inputs beyond single messages ----


def test_check_inputs_passes_valid_calls():
    cache = np.zeros((2, 4, 576), DTYPES["bfloat16"])
    table = np.zeros((10, 64), np.float32)
    debug.check_inputs(cache, np.array([7, -1, 0, 3], np.int32), block_size=4)
    debug.check_inputs(cache, np.array([], np.int32), positions=np.array([], np.int32), cos_sin_cache=table)
    with jax.enable_x64(True):
        debug.check_inputs(cache, np.array([7, 0], np.int64), positions=np.array([0, 9], np.int64), cos_sin_cache=table)
    staged = checkify.checkify(lambda s, p: debug.check_inputs(cache, s, positions=p, cos_sin_cache=table))
    err, _ = jax.jit(staged)(np.array([5, -1, 2], np.int32), np.array([0, 9, 3], np.int32))
    assert err.get() is None


def test_check_inputs_takes_a_stack_as_the_epilogues_address_it():
    """A stack [layers, num_blocks, block_size, W]: slots range over all its rows, so layer i's
    slots offset by i * num_blocks * block_size pass, and one past the last layer is reported."""
    stack = np.zeros((3, 2, 4, 576), DTYPES["bfloat16"])
    layer_2 = 2 * 8 + np.array([0, 7, -1], np.int32)
    debug.check_inputs(stack, layer_2, block_size=4)
    with pytest.raises(ValueError, match=r"slot\(s\) >= the stack's rows, prod\(kv_cache.shape\[:-1\]\) = 24"):
        debug.check_inputs(stack, layer_2 + 8)
    err, _ = jax.jit(checkify.checkify(lambda s: debug.check_inputs(stack, s)))(layer_2 + 8)
    with pytest.raises(checkify.JaxRuntimeError, match=r"slot_mapping\[0\] = 24 is >= the stack's rows"):
        err.throw()


def test_check_inputs_under_jit_without_checkify_fails_to_trace():
    cache = np.zeros((2, 4, 576), DTYPES["bfloat16"])
    with pytest.raises(ValueError, match="checkify.check which was not functionalized"):
        jax.jit(lambda s: debug.check_inputs(cache, s))(np.zeros(2, np.int32))


def test_check_inputs_guards_a_jitted_step():
    """The documented pattern: checks and op in one jitted, checkified step; the op's result is
    returned as usual and the error names the offending token."""
    def step(ql_nope, q_pe, kv_c_normed, k_pe, kv_cache, slot_mapping):
        debug.check_inputs(kv_cache, slot_mapping, block_size=2)
        return jax_kimi_mla.fused_mla_decode_q_concat_kv_cache_insert(ql_nope, q_pe, kv_c_normed, k_pe, kv_cache, slot_mapping)

    a = base("decode_bf16")
    args = [a[k] for k in ("ql_nope", "q_pe", "kv_c_normed", "k_pe", "kv_cache")]
    checked = jax.jit(checkify.checkify(step), donate_argnums=(4,))
    err, (mqa_q, cache) = checked(*args, np.array([1, 7], np.int32))
    assert err.get() is None and mqa_q.shape == (2, 3, 576) and cache.shape == (4, 2, 576)
    err, _ = checked(*args, np.array([3, 3], np.int32))
    with pytest.raises(checkify.JaxRuntimeError, match="tokens 0 and 1 both write slot 3"):
        err.throw()
