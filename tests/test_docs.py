"""The README's Python blocks run as written, in order, in one namespace (as a reader pastes them)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


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
