"""The cache formats and the epilogue FFI targets as data: the one Python home of those facts.

The ops, their argument checks and references, the layer, the benchmark workloads and the tests
read these tables; the C++ side has its twins in ``ffi/include/jax_kimi_mla/epilogue.h``
(``CacheFormat``, ``cache_entry_bytes``), ``ffi_plan.h`` (``op_shape``; each epilogue's cache dtype)
and ``paged_cache.h`` (the readers' format from the cache dtype). Format names are those of ``layer.MLAConfig.cache_format``:

- ``"bf16"``: [N, bs, 576] entries [kv_c_normed | k_pe] in the activation dtype (bf16 or fp16);
- ``"fp8"``: [N, bs, 576] float8_e4m3fn, quantized with a per-tensor ``cache_scale_inv``;
- ``"fp8_ds_mla"``: [N, bs, 656] uint8, DeepSeek's block-scaled entry (docs/SPEC.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

L, P, R, V = 512, 128, 64, 128  # kv_lora_rank, qk_nope, qk_rope, v_head (docs/SPEC.md)
ENTRY = L + R  # 576: a plain cache entry, a decode mqa_q row
DS_MLA_ENTRY_BYTES = 656


@dataclass(frozen=True)
class CacheFormat:
    name: str
    width: int  # the cache's last dimension: one entry, in elements of its dtype
    dtype: jnp.dtype | None  # None: the activation dtype
    what: str  # how error messages name it

    def cache_dtype(self, act) -> jnp.dtype:
        return jnp.dtype(act if self.dtype is None else self.dtype)

    def entry_bytes(self, act=jnp.bfloat16) -> int:
        return self.width * self.cache_dtype(act).itemsize


CACHE_FORMATS = {
    f.name: f
    for f in (
        CacheFormat("bf16", ENTRY, None, "a bf16/fp16 cache in the activation dtype"),
        CacheFormat("fp8", ENTRY, jnp.dtype(jnp.float8_e4m3fn), "the plain fp8 cache"),
        CacheFormat("fp8_ds_mla", DS_MLA_ENTRY_BYTES, jnp.dtype(jnp.uint8), "the fp8_ds_mla cache"),
    )
}


@dataclass(frozen=True)
class Epilogue:
    """One epilogue FFI target: the public op it serves, and its operands and results in order.

    The FFI operands are ``inputs``, then ``positions`` and ``cos_sin_cache`` (empty stand-ins
    without RoPE), then ``scales``. The public op takes ``inputs`` positionally, then the scales
    (positionally in prefill, as keywords in decode), then the RoPE keywords.
    """

    phase: str  # "prefill" or "decode"
    cache_format: CacheFormat
    target: str  # FFI target name, before the jax_kimi_mla_ prefix and the _v<ABI> suffix
    op: str  # the public function in jax_kimi_mla and jax_kimi_mla.reference
    inputs: tuple[str, ...]
    scales: tuple[str, ...]
    outputs: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.phase}_{self.cache_format.name}"

    @property
    def cache_input(self) -> int:
        return self.inputs.index("kv_cache")

    @property
    def cache_output(self) -> int:
        return self.outputs.index("kv_cache")

    @property
    def static_kwargs(self) -> dict:
        """Keyword arguments that select this target of its public op."""
        return {"ds_mla": True} if self.phase == "decode" and self.cache_format.name == "fp8_ds_mla" else {}


_PREFILL = ("q", "k_nope", "k_pe", "kv_c_normed", "kv_cache", "slot_mapping")
_DECODE = ("ql_nope", "q_pe", "kv_c_normed", "k_pe", "kv_cache", "slot_mapping")
_DECODE_OP = "fused_mla_decode_q_concat_kv_cache_insert"
_F = CACHE_FORMATS

EPILOGUES = {
    e.name: e
    for e in (
        Epilogue("prefill", _F["bf16"], "prefill_kv_cache", "fused_mla_key_concat_kv_cache_insert", _PREFILL, (), ("k", "q", "kv_cache")),
        Epilogue("prefill", _F["fp8_ds_mla"], "prefill_ds_mla", "fused_mla_key_concat_ds_mla_insert", _PREFILL, (), ("k", "q", "kv_cache")),
        Epilogue(
            "prefill", _F["fp8"], "prefill_fp8", "fused_mla_qkv_quant_kv_cache_fp8_insert",
            ("q", "k_nope", "k_pe", "kv_c_normed", "v", "kv_cache", "slot_mapping"),
            ("q_scale_inv", "k_scale_inv", "v_scale_inv", "cache_scale_inv"),
            ("q_fp8", "k_fp8", "v_fp8", "kv_cache"),
        ),
        Epilogue("decode", _F["bf16"], "decode_kv_cache", _DECODE_OP, _DECODE, (), ("mqa_q", "kv_cache")),
        Epilogue("decode", _F["fp8"], "decode_fp8", _DECODE_OP, _DECODE, ("q_scale_inv", "cache_scale_inv"), ("mqa_q", "kv_cache")),
        Epilogue("decode", _F["fp8_ds_mla"], "decode_ds_mla", _DECODE_OP, _DECODE, (), ("mqa_q", "kv_cache")),
    )
}

READERS = ("mla_decode_attention", "gather_mla_cache")  # FFI targets that only read the cache
FFI_TARGETS = tuple(e.target for e in EPILOGUES.values()) + READERS
# The per-head arrays [T or B, H, width] among the ops' inputs and among their outputs, by name:
# the head axis that tensor parallelism shards (_partition's rules; sharding's shard_map specs of
# the inputs, its outputs being per-head first and the cache last).
PER_HEAD_INPUTS = frozenset({"q", "k_nope", "v", "ql_nope", "q_pe"})
PER_HEAD_OUTPUTS = frozenset({"q", "k", "q_fp8", "k_fp8", "v_fp8", "mqa_q"})


def shift_ids(ids, count: int, first):
    """Ids into one range of ``count`` items (a cache's slots, or its block ids) moved to start at
    ``first`` in a larger range (a stack of caches); an id outside [0, count) becomes -1, which
    the ops skip or mask, instead of reaching into another cache of the stack."""
    return jnp.where((ids >= 0) & (ids < count), ids + first, -1)
