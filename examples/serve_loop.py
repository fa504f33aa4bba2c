"""Continuous batching over one paged cache with the Kimi-K3 MLA layer (random weights).

A toy language model: token embedding -> a stack of MLA layers (``jax_kimi_mla.layer``, residual
around each) -> RMSNorm -> logits through the tied embedding -> greedy next token. Requests with
different prompt lengths wait in a queue. Every scheduler step admits waiting requests while a
batch row and enough cache blocks are free, runs one packed prefill call (the next chunks of every
request still prefilling, packed back to back with ``cu_seqlens``, each attending to its own
cached context: one compile for any mix), then decodes one token for every request whose prompt
is done, in a fixed-size batch whose empty rows are padding (slot -1). A finished request hands
its blocks back and the next one takes its row.

    python examples/serve_loop.py
    python examples/serve_loop.py --layers 8 --hidden 4096 --heads 16 --requests 64 --batch 32 \\
        --num-blocks 1024 --cache-format fp8_ds_mla

Prints the tokens per second of prefill, decode and overall (compile time excluded), then checks
every generated token against the same model run without cache or fused ops (float32, the whole
sequence at once): it must be that model's greedy choice, up to a small margin (PASS, or an
AssertionError).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

import jax_kimi_mla
from jax_kimi_mla import layer as mla


class BlockAllocator:
    """Hands out cache blocks from a free list. A request reserves the blocks for its whole
    length (prompt + new tokens) when admitted, so a running request never waits for one."""

    def __init__(self, num_blocks):
        self.free = list(range(num_blocks))
        self.num_blocks = num_blocks

    def allocate(self, n):
        if n > len(self.free):
            return None
        blocks, self.free = self.free[:n], self.free[n:]
        return blocks

    def release(self, blocks):
        self.free += blocks

    @property
    def used(self):
        return self.num_blocks - len(self.free)


@dataclass
class Request:
    id: int
    prompt: np.ndarray  # int32 token ids
    max_new_tokens: int
    blocks: list = field(default_factory=list)
    generated: list = field(default_factory=list)
    prefilled: int = 0  # prompt tokens in the cache

    @property
    def length(self):
        """Tokens in the cache once the last generated token is fed back."""
        return len(self.prompt) + len(self.generated)

    def done(self):
        return len(self.generated) >= self.max_new_tokens


def init_model(key, config, num_layers, vocab):
    k_embed, k_layers = jax.random.split(key)
    embed = jax.random.normal(k_embed, (vocab, config.hidden_size), jnp.float32).astype(config.dtype)
    return {"embed": embed, "layers": mla.init_params(k_layers, config, num_layers)}


def logits_of(params, h, config):
    """Logits through the tied embedding of RMS-normed hidden states h [..., hidden] (float32)."""
    h32 = h.astype(jnp.float32)
    h32 = h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, -1, keepdims=True) + config.rms_norm_eps)
    return h32.astype(config.dtype).astype(jnp.float32) @ params["embed"].astype(jnp.float32).T


def make_steps(config, cos_sin_cache):
    """Jitted prefill-chunk and decode steps of the whole model, the cache donated."""

    def next_token(params, h):
        return jnp.argmax(logits_of(params, h, config), -1).astype(jnp.int32)

    @functools.partial(jax.jit, donate_argnums=7)
    def prefill(params, tokens, positions, slots, cu_seqlens, block_tables, context_lens, kv_cache):
        step = functools.partial(mla.prefill, config=config)
        h, kv_cache = mla.scan_layers(
            step, params["layers"], params["embed"][tokens], kv_cache, positions, slots,
            cu_seqlens=cu_seqlens, block_table=block_tables, context_len=context_lens, cos_sin_cache=cos_sin_cache,
        )
        # The token after each sequence's last packed token (meaningful when that ends its prompt).
        return next_token(params, h[jnp.maximum(cu_seqlens[1:] - 1, 0)]), kv_cache

    @functools.partial(jax.jit, donate_argnums=6)
    def decode(params, tokens, positions, slots, block_tables, context_lens, kv_cache):
        step = functools.partial(mla.decode, config=config)
        h, kv_cache = mla.scan_layers(
            step, params["layers"], params["embed"][tokens], kv_cache, positions, slots, block_tables, context_lens,
            cos_sin_cache=cos_sin_cache,
        )
        return next_token(params, h), kv_cache

    return prefill, decode


class Server:
    def __init__(self, args):
        self.args = args
        self.config = mla.MLAConfig(hidden_size=args.hidden, num_heads=args.heads, cache_format=args.cache_format)
        max_len = args.max_prompt + args.max_new_tokens
        self.max_blocks = math.ceil(max_len / args.block_size)
        self.cos_sin = cos_sin = jax_kimi_mla.make_cos_sin_cache(max_len) if args.rope else None
        self.params = init_model(jax.random.key(args.seed), self.config, args.layers, args.vocab)
        self.kv_cache = mla.allocate_cache(self.config, args.num_blocks, args.block_size, args.layers)
        self.allocator = BlockAllocator(args.num_blocks)
        self.prefill_step, self.decode_step = make_steps(self.config, cos_sin)
        self.occupancy = []  # blocks in use in each scheduler step

    def slots(self, req, start, n):
        pos = np.arange(start, start + n)
        return np.asarray(req.blocks, np.int32)[pos // self.args.block_size] * self.args.block_size + pos % self.args.block_size

    def table(self, req):
        t = np.zeros(self.max_blocks, np.int32)
        t[: len(req.blocks)] = req.blocks
        return t

    def prefill(self, prefilling):
        """One packed call: the next chunk (up to --chunk tokens each, --chunk * --batch in all)
        of every request still prefilling, each after the part of its prompt already cached.
        A request whose prompt ends in this call gets its first generated token."""
        b, c = self.args.batch, self.args.chunk
        tokens, positions, slots = np.zeros(b * c, np.int32), np.zeros(b * c, np.int32), np.full(b * c, -1, np.int32)
        tables, context = np.zeros((b, self.max_blocks), np.int32), np.zeros(b, np.int32)
        cu, packed = [0], []
        for req in prefilling[:b]:
            start, n = req.prefilled, min(c, len(req.prompt) - req.prefilled)
            at = cu[-1]
            tokens[at : at + n] = req.prompt[start : start + n]
            positions[at : at + n] = np.arange(start, start + n)
            slots[at : at + n] = self.slots(req, start, n)
            tables[len(packed)], context[len(packed)] = self.table(req), start
            cu.append(at + n)
            packed.append((req, n))
        cu += [cu[-1]] * (b + 1 - len(cu))  # trailing empty sequences: one compile
        out, self.kv_cache = self.prefill_step(self.params, tokens, positions, slots, np.asarray(cu, np.int32), tables, context, self.kv_cache)
        for i, (req, n) in enumerate(packed):
            req.prefilled += n
            if req.prefilled == len(req.prompt):
                req.generated.append(int(out[i]))
        return sum(n for _, n in packed)

    def decode(self, running):
        """One token for each running request; rows past len(running) are padding."""
        b = self.args.batch
        tokens, positions, lens = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
        slots, tables = np.full(b, -1, np.int32), np.zeros((b, self.max_blocks), np.int32)
        for i, req in enumerate(running):
            pos = req.length - 1  # the last generated token goes into the cache now
            tokens[i], positions[i], lens[i] = req.generated[-1], pos, pos + 1
            slots[i], tables[i] = self.slots(req, pos, 1)[0], self.table(req)
        out, self.kv_cache = self.decode_step(self.params, tokens, positions, slots, tables, lens, self.kv_cache)
        for req, token in zip(running, np.asarray(out)):
            req.generated.append(int(token))

    def serve(self, requests):
        waiting, running, finished = list(requests), [], []
        stats = {"prefill_tokens": 0, "decode_tokens": 0, "prefill_s": 0.0, "decode_s": 0.0}
        while waiting or running:
            while waiting and len(running) < self.args.batch:
                req = waiting[0]
                blocks = self.allocator.allocate(math.ceil((len(req.prompt) + req.max_new_tokens) / self.args.block_size))
                if blocks is None:
                    break  # wait for a running request to finish
                req.blocks = blocks
                running.append(waiting.pop(0))
            if not running:
                raise RuntimeError(f"request {waiting[0].id} needs more cache blocks than the cache has")
            prefilling = [r for r in running if r.prefilled < len(r.prompt)]
            if prefilling:
                t = time.perf_counter()
                stats["prefill_tokens"] += self.prefill(prefilling)
                stats["prefill_s"] += time.perf_counter() - t
            decoding = [r for r in running if r.prefilled == len(r.prompt) and not r.done()]
            if decoding:
                t = time.perf_counter()
                self.decode(decoding)
                stats["decode_s"] += time.perf_counter() - t
                stats["decode_tokens"] += len(decoding)
            self.occupancy.append(self.allocator.used)
            for req in [r for r in running if r.done()]:
                running.remove(req)
                self.allocator.release(req.blocks)
                finished.append(req)
        return finished, stats

    def warm_up(self):
        """Compiles both steps on a throwaway request, so the timings below exclude compiling."""
        req = Request(-1, np.zeros(1, np.int32), 1, blocks=self.allocator.allocate(1))
        self.prefill([req])
        self.decode([req])
        self.allocator.release(req.blocks)
        jax.block_until_ready(self.kv_cache)


@functools.partial(jax.jit, static_argnames=("config",))
def reference_logits(params, tokens, cos_sin_cache, *, config):
    """The model without any cache or fused op: float32 layers (``layer.reference_attention``,
    residual around each) over a whole sequence -> logits [len(tokens), vocab]."""
    h = params["embed"][tokens].astype(jnp.float32)
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    for i in range(jax.tree.leaves(params["layers"])[0].shape[0]):
        layer_params = jax.tree.map(lambda a, i=i: a[i], params["layers"])
        h = h + mla.reference_attention(layer_params, h, positions, config=config, cos_sin_cache=cos_sin_cache)
    return logits_of(params, h, config)


def check_against_reference(server, finished, margin):
    """Every generated token must be a greedy choice of the reference model, up to ``margin``
    (in units of the logits' standard deviation): the served path rounds to bf16 and quantizes
    its cache, so an exact argmax tie-break cannot be asked for. Returns the worst shortfall."""
    ref_config = dataclasses.replace(server.config, cache_format="bf16")
    ref_params = {"embed": server.params["embed"], "layers": {k: v for k, v in server.params["layers"].items() if k != "fp8_scale_inv"}}
    worst = 0.0
    for req in finished:
        fed = np.concatenate([req.prompt, np.asarray(req.generated[:-1], np.int32)])
        logits = np.asarray(reference_logits(ref_params, jnp.asarray(fed), server.cos_sin, config=ref_config))
        rows = logits[len(req.prompt) - 1 :]  # the positions whose next token was generated
        chosen = rows[np.arange(len(req.generated)), req.generated]
        shortfall = (rows.max(-1) - chosen) / rows.std(-1)
        worst = max(worst, float(shortfall.max()))
    if worst > margin:
        raise AssertionError(f"a served token is {worst:.3f} std below the reference's best logit (margin {margin})")
    return worst


def make_requests(args):
    """Random prompts of random lengths; each request wants between a quarter of and all of
    --max-new-tokens, so requests finish at different steps."""
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_prompt, args.max_prompt + 1, args.requests)
    new_tokens = rng.integers(max(1, args.max_new_tokens // 4), args.max_new_tokens + 1, args.requests)
    return [Request(i, rng.integers(0, args.vocab, n).astype(np.int32), int(m)) for i, (n, m) in enumerate(zip(lengths, new_tokens))]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--cache-format", choices=mla.CACHE_FORMATS, default="bf16")
    p.add_argument("--rope", action="store_true", help="GPT-J RoPE (Kimi-K3 itself runs NoPE)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--min-prompt", type=int, default=8)
    p.add_argument("--max-prompt", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=4, help="decode batch rows")
    p.add_argument("--chunk", type=int, default=32, help="prefill tokens per request per step")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-margin", type=float, default=0.25,
                   help="the check at the end: how far (in logit std) a served token may fall below the reference's best")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    server = Server(args)
    print(f"{jax.devices()[0].platform}: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
          f"{args.cache_format} cache of {args.num_blocks} blocks x {args.block_size}")
    server.warm_up()
    requests = make_requests(args)
    start = time.perf_counter()
    finished, stats = server.serve(requests)
    total_s = time.perf_counter() - start
    assert len(finished) == len(requests) and all(len(r.generated) == r.max_new_tokens for r in finished)
    print(f"served {len(finished)} requests in {len(server.occupancy)} scheduler steps, "
          f"peak cache use {max(server.occupancy)}/{args.num_blocks} blocks")
    print(f"prefill: {stats['prefill_tokens']} tokens, {stats['prefill_tokens'] / stats['prefill_s']:.0f} tokens/s")
    print(f"decode:  {stats['decode_tokens']} tokens, {stats['decode_tokens'] / stats['decode_s']:.0f} tokens/s")
    print(f"overall: {(stats['prefill_tokens'] + stats['decode_tokens']) / total_s:.0f} tokens/s")
    worst = check_against_reference(server, finished, args.check_margin)
    print(f"check: every generated token is the reference model's greedy choice within {worst:.3f} logit std (margin {args.check_margin}): PASS")


if __name__ == "__main__":
    main()
