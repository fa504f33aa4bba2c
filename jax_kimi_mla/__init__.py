"""Kimi-K3 MLA for JAX: the fused prefill/decode epilogues and the paged decode attention that reads
their cache back, as XLA FFI custom calls (CPU and CUDA)."""

__version__ = "0.2.0"

from . import debug, layer, reference, sharding
from ._checks import columns
from ._ffi import ABI_VERSION, HAS_CUDA_MODULE
from .numerics import ds_mla_dequantize, make_cos_sin_cache
from .ops import (
    fused_mla_decode_q_concat_kv_cache_insert,
    fused_mla_key_concat_ds_mla_insert,
    fused_mla_key_concat_kv_cache_insert,
    fused_mla_qkv_quant_kv_cache_fp8_insert,
    gather_mla_cache,
    mla_decode_attention,
)

__all__ = [
    "__version__",
    "ABI_VERSION",
    "debug",
    "HAS_CUDA_MODULE",
    "columns",
    "ds_mla_dequantize",
    "fused_mla_decode_q_concat_kv_cache_insert",
    "fused_mla_key_concat_ds_mla_insert",
    "fused_mla_key_concat_kv_cache_insert",
    "fused_mla_qkv_quant_kv_cache_fp8_insert",
    "gather_mla_cache",
    "layer",
    "make_cos_sin_cache",
    "mla_decode_attention",
    "reference",
    "sharding",
]
