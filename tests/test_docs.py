"""The README's Python blocks run as written, in order, in one namespace (as a reader pastes them);
so do docs/SHARDING.md's and docs/ABI.md's, the doctests and the ``::`` example blocks of the docstrings."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
SHARDING = README.parent / "docs" / "SHARDING.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def test_readme_has_python_blocks():
    assert len(python_blocks(README.read_text())) >= 2


def test_readme_python_blocks_run():
    namespace = {"__name__": "readme"}
    for i, block in enumerate(python_blocks(README.read_text())):
        exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)  # noqa: S102
    # The decode steps did what the README says: the new tokens are in the caches, read back.
    assert namespace["latent"].shape == (4, 12, 512)
    assert bool((namespace["cached_latent"] != 0).any())


def test_sharding_doc_python_blocks_run():
    """docs/SHARDING.md's example, on every device of the default backend (8 CPUs in the tests)."""
    namespace = {"__name__": "sharding_doc"}
    blocks = python_blocks(SHARDING.read_text())
    assert blocks
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/SHARDING.md python block {i + 1}", "exec"), namespace)  # noqa: S102


def test_abi_doc_python_blocks_run():
    """docs/ABI.md's export example, as written (serialize() needs flatbuffers: the [test] extra)."""
    namespace = {"__name__": "abi_doc"}
    blocks = python_blocks((README.parent / "docs" / "ABI.md").read_text())
    assert blocks
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/ABI.md python block {i + 1}", "exec"), namespace)  # noqa: S102
    assert namespace["outputs"][1].shape == (8, 16, 576)


def test_docstring_examples_run():
    """Every ``>>>`` example in the package's docstrings (doctest), on the installed package."""
    import doctest
    import importlib
    import pkgutil

    import jax_kimi_mla

    failed = tried = 0
    for info in pkgutil.iter_modules(jax_kimi_mla.__path__):
        if info.name.startswith("_c"):  # the compiled modules
            continue
        module = importlib.import_module(f"jax_kimi_mla.{info.name}")
        result = doctest.testmod(module, extraglobs={"jax": __import__("jax"), "jnp": __import__("jax.numpy").numpy})
        failed, tried = failed + result.failed, tried + result.attempted
    assert tried > 0 and failed == 0


def literal_blocks(docstring: str) -> list[str]:
    """The indented literal blocks (after a line ending in ``::``) of a docstring, dedented;
    blocks of ``>>>`` examples are left to doctest."""
    import textwrap

    blocks, lines = [], docstring.splitlines()
    for i, line in enumerate(lines):
        if not line.rstrip().endswith("::"):
            continue
        indent, body = len(line) - len(line.lstrip()), []
        for follower in lines[i + 1 :]:
            if follower.strip() and len(follower) - len(follower.lstrip()) <= indent:
                break
            body.append(follower)
        block = textwrap.dedent("\n".join(body)).strip()
        if block and ">>>" not in block:
            blocks.append(block)
    return blocks


def docstring_examples():
    """(where, block, module globals) of every literal block in the public modules' docstrings."""
    import importlib
    import inspect

    for name in ("ops", "layer", "sharding", "debug", "numerics", "reference", "formats"):
        module = importlib.import_module(f"jax_kimi_mla.{name}")
        owners = [(name, module)] + [(f"{name}.{n}", f) for n, f in vars(module).items() if inspect.isfunction(f) and f.__module__ == module.__name__]
        for where, owner in owners:
            for i, block in enumerate(literal_blocks(inspect.getdoc(owner) or "")):
                yield f"{where} example {i + 1}", block, vars(module)


def example_inputs() -> dict:
    """The names the docstring examples use, as small valid arrays (a bf16 cache of 8 blocks of
    16 rows, 4 tokens / sequences, 2 heads), and a 2-device mesh with axis "tp"."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_kimi_mla
    from jax_kimi_mla import layer

    T, H = 4, 2
    k = iter(jax.random.split(jax.random.key(0), 8))
    normal = lambda *shape: jax.random.normal(next(k), shape, jnp.bfloat16)  # noqa: E731
    names = {n: getattr(jax_kimi_mla, n) for n in jax_kimi_mla.__all__}
    return names | dict(
        jax=jax, jnp=jnp, np=np, functools=functools,
        q=normal(T, H, 192), k_nope=normal(T, H, 128), k_pe=normal(T, 64), kv_c_normed=normal(T, 512),
        ql_nope=normal(T, H, 512), q_pe=normal(T, H, 64), mqa_q=normal(T, H, 576),
        kv_cache=jnp.zeros((8, 16, 576), jnp.bfloat16), block_size=16, slot_mapping=jnp.array([0, 17, -1, 40], jnp.int32),
        positions=jnp.arange(T, dtype=jnp.int32), cos_sin_cache=jax_kimi_mla.make_cos_sin_cache(64),
        block_tables=jnp.arange(2 * T, dtype=jnp.int32).reshape(T, 2), context_lens=jnp.array([1, 5, 0, 32], jnp.int32),
        mesh=jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",)),
        config=layer.MLAConfig(hidden_size=256, num_heads=H), decode=layer.decode, check_inputs=jax_kimi_mla.debug.check_inputs,
    )


def test_docstring_literal_examples_run():
    """Every ``::`` example block of the public modules' docstrings (``Example::`` of the ops
    included) runs as written, on inputs of the documented shapes."""
    examples = list(docstring_examples())
    where = [w for w, _, _ in examples]
    for op in ("fused_mla_key_concat_kv_cache_insert", "mla_decode_attention", "gather_mla_cache"):
        assert f"ops.{op} example 1" in where
    for w, block, module_globals in examples:
        exec(compile(block, f"<{w}>", "exec"), dict(module_globals) | example_inputs())  # noqa: S102
