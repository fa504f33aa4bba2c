"""Continuous batching over one paged cache with the Kimi-K3 MLA layer (random weights).

A toy language model: token embedding -> a stack of MLA layers (``jax_kimi_mla.layer`` under
``scan_layers``, residual around each) -> RMSNorm -> logits through the tied embedding -> greedy
next token. Requests with different prompt lengths arrive over time (every scheduler step is a time
unit). Every step admits the arrived requests while a batch row and enough cache blocks are free,
runs one packed prefill call (the next chunks of the requests still prefilling, up to
--prefill-seqs sequences and --prefill-budget tokens, packed back to back with ``cu_seqlens``,
each attending to its own cached context, read back into a bucketed number of rows), then decodes
one token for every request whose prompt is done, in a fixed-size batch whose empty rows are
padding (slot -1). A finished request hands its blocks back to the allocator and the next one
takes its row.

    python examples/serve_loop.py                          # small, CPU-friendly
    python examples/serve_loop.py --cache-format all       # every cache format in turn
    python examples/serve_loop.py --preset h200            # Kimi-K3 TP8 layer shapes, prompts up to 32k

The h200 preset: hidden 7168, 12 heads, q_lora 1536, 4 layers, vocab 32000, 24 requests of 256 to
32768 prompt tokens arriving about every 2 steps, all three cache formats; the reference check
takes the requests of at most 8192 tokens (its float32 attention is dense).

Prints, per cache format, the tokens per second of prefill, decode and overall (compile time
excluded: every step shape is compiled before the clock starts), and the time of one layer in a
prefill and a decode step against its HBM floor (weights + the cache entries the step reads and
writes + activations, each moved once, over the bandwidth of a jitted copy measured in the same
run; prefill is compute-bound, so its floor is a lower bound only). A progress bar goes to stderr.
Then it checks every generated token against the same model run without cache or fused ops
(float32, the whole sequence at once): it must be that model's greedy choice, up to a small margin
(PASS, or an AssertionError). On a GPU it last runs its busiest decode step again under the
profiler and prints that step's device time against its HBM floor (the wall times above also hold
the host's share of each step: the inputs' transfers, the dispatch, the wait for the sampled tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

import jax_kimi_mla
from jax_kimi_mla import _profile  # the benchmarks' profiler-trace timing (device time of a jitted step)
from jax_kimi_mla import layer as mla
from jax_kimi_mla.formats import CACHE_FORMATS


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
    arrival: int = 0  # the scheduler step it arrives at
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
    """The embedding and the layers' params, a list of per-layer ones: scan_layers then reads each
    layer's weights in place (from a stack, its scan copies them out every step)."""
    k_embed, k_layers = jax.random.split(key)
    embed = jax.random.normal(k_embed, (vocab, config.hidden_size), jnp.float32).astype(config.dtype)
    return {"embed": embed, "layers": mla.unstack_layers(mla.init_params(k_layers, config, num_layers))}


def logits_of(params, h, config):
    """Logits through the tied embedding of RMS-normed hidden states h [..., hidden] (float32)."""
    h32 = h.astype(jnp.float32)
    h32 = h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, -1, keepdims=True) + config.rms_norm_eps)
    return h32.astype(config.dtype).astype(jnp.float32) @ params["embed"].astype(jnp.float32).T


def make_steps(config, cos_sin_cache):
    """Jitted prefill-chunk and decode steps of the whole model, the cache donated."""

    def next_token(params, h):
        return jnp.argmax(logits_of(params, h, config), -1).astype(jnp.int32)

    @functools.partial(jax.jit, donate_argnums=7, static_argnames="context_tokens")
    def prefill(params, tokens, positions, slots, cu_seqlens, block_tables, context_lens, kv_cache, context_tokens):
        step = functools.partial(mla.prefill, config=config, context_tokens=context_tokens)
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


class Progress:
    """A plain-text progress bar on stderr: redrawn in place on a terminal, a line per tenth
    otherwise (logs)."""

    def __init__(self, total, label, width=30, stream=sys.stderr):
        self.total, self.label, self.width, self.stream = max(total, 1), label, width, stream
        self.tty = stream.isatty()
        self.shown = -1

    def update(self, done, note=""):
        filled = self.width * done // self.total
        line = f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} {note}"
        if self.tty:
            self.stream.write("\r" + line)
        elif 10 * done // self.total > self.shown:
            self.shown = 10 * done // self.total
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self):
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def bucket(n, smallest, largest):
    """Rows for n context tokens: smallest * 4^k, or largest (which holds any n): few step shapes
    to compile."""
    rows = smallest
    while rows < n and rows < largest:
        rows *= 4
    return min(rows, largest)


def copy_bandwidth(nbytes):
    """Read + write bytes per second of a jitted elementwise pass over nbytes (median of 5)."""
    x = jnp.zeros(nbytes // 2, jnp.bfloat16)
    step = jax.jit(lambda a: a + 1)
    jax.block_until_ready(step(x))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(step(x))
        times.append(time.perf_counter() - t)
    return 2 * nbytes / float(np.median(times))


class Server:
    def __init__(self, args, cache_format=None):
        """``cache_format``: one format name; default ``args.cache_format`` (not "all")."""
        cache_format = cache_format or args.cache_format
        self.args = args
        self.config = mla.MLAConfig(hidden_size=args.hidden, num_heads=args.heads, q_lora_rank=args.q_lora_rank, cache_format=cache_format,
                                    attention_impl=args.attention_impl)
        max_len = args.max_prompt + args.max_new_tokens
        self.max_blocks = math.ceil(max_len / args.block_size)
        self.cos_sin = cos_sin = jax_kimi_mla.make_cos_sin_cache(max_len) if args.rope else None
        self.params = init_model(jax.random.key(args.seed), self.config, args.layers, args.vocab)
        self.kv_cache = mla.allocate_cache(self.config, args.num_blocks, args.block_size, args.layers)
        self.allocator = BlockAllocator(args.num_blocks)
        self.prefill_step, self.decode_step = make_steps(self.config, cos_sin)
        self.occupancy = []  # blocks in use in each scheduler step
        # Context rows of a prefill step: buckets from the step's token budget up to every table full.
        self.context_rows = (max(args.prefill_budget, args.block_size), args.prefill_seqs * self.max_blocks * args.block_size)
        shapes = jax.eval_shape(lambda: self.params["layers"])
        self.layer_weight_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(shapes)) // args.layers
        self.entry_bytes = CACHE_FORMATS[cache_format].entry_bytes()
        # Per step kind: wall seconds, bytes one layer must move (the HBM floor's numerator), steps.
        self.timing = {kind: {"s": 0.0, "bytes": 0, "steps": 0} for kind in ("prefill", "decode")}
        self.busiest_decode = None  # (requests, inputs, bytes one layer moves) of the timed decode step of most requests

    def slots(self, req, start, n):
        pos = np.arange(start, start + n)
        return np.asarray(req.blocks, np.int32)[pos // self.args.block_size] * self.args.block_size + pos % self.args.block_size

    def table(self, req):
        t = np.zeros(self.max_blocks, np.int32)
        t[: len(req.blocks)] = req.blocks
        return t

    def prefill(self, prefilling, timed=True):
        """One packed call: the next chunk (up to --chunk tokens each) of up to --prefill-seqs
        requests still prefilling, --prefill-budget tokens in all, each after the part of its
        prompt already cached. A request whose prompt ends in this call gets its first token."""
        a = self.args
        budget, seqs = a.prefill_budget, a.prefill_seqs
        tokens, positions, slots = np.zeros(budget, np.int32), np.zeros(budget, np.int32), np.full(budget, -1, np.int32)
        tables, context = np.zeros((seqs, self.max_blocks), np.int32), np.zeros(seqs, np.int32)
        cu, packed = [0], []
        for req in prefilling:
            if len(packed) == seqs or cu[-1] == budget:
                break
            start = req.prefilled
            n = min(a.chunk, len(req.prompt) - start, budget - cu[-1])
            at = cu[-1]
            tokens[at : at + n] = req.prompt[start : start + n]
            positions[at : at + n] = np.arange(start, start + n)
            slots[at : at + n] = self.slots(req, start, n)
            tables[len(packed)], context[len(packed)] = self.table(req), start
            cu.append(at + n)
            packed.append((req, n))
        cu += [cu[-1]] * (seqs + 1 - len(cu))  # trailing empty sequences: one compile
        rows = bucket(int(context.sum()), *self.context_rows)
        t = time.perf_counter()
        out, self.kv_cache = self.prefill_step(self.params, tokens, positions, slots, np.asarray(cu, np.int32), tables, context,
                                               self.kv_cache, rows)
        out = np.asarray(out)
        if timed:
            self._account("prefill", time.perf_counter() - t,
                          (int(context.sum()) + cu[-1]) * self.entry_bytes + 2 * budget * a.hidden * 2)
        for i, (req, n) in enumerate(packed):
            req.prefilled += n
            if req.prefilled == len(req.prompt):
                req.generated.append(int(out[i]))
        return sum(n for _, n in packed)

    def decode(self, running, timed=True):
        """One token for each running request; rows past len(running) are padding."""
        b = self.args.batch
        tokens, positions, lens = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
        slots, tables = np.full(b, -1, np.int32), np.zeros((b, self.max_blocks), np.int32)
        for i, req in enumerate(running):
            pos = req.length - 1  # the last generated token goes into the cache now
            tokens[i], positions[i], lens[i] = req.generated[-1], pos, pos + 1
            slots[i], tables[i] = self.slots(req, pos, 1)[0], self.table(req)
        t = time.perf_counter()
        out, self.kv_cache = self.decode_step(self.params, tokens, positions, slots, tables, lens, self.kv_cache)
        out = np.asarray(out)
        if timed:
            layer_bytes = int(lens.sum()) * self.entry_bytes + 2 * b * self.args.hidden * 2
            self._account("decode", time.perf_counter() - t, layer_bytes)
            if self.busiest_decode is None or len(running) >= self.busiest_decode[0]:
                self.busiest_decode = (len(running), (tokens, positions, slots, tables, lens), layer_bytes)
        for req, token in zip(running, out):
            req.generated.append(int(token))

    def _account(self, kind, seconds, layer_bytes):
        entry = self.timing[kind]
        entry["s"] += seconds
        entry["bytes"] += self.layer_weight_bytes + layer_bytes
        entry["steps"] += 1

    def serve(self, requests):
        pending = sorted(requests, key=lambda r: r.arrival)
        waiting, running, finished = [], [], []
        stats = {"prefill_tokens": 0, "decode_tokens": 0}
        progress = Progress(len(requests), f"{self.config.cache_format:>10}")
        clock = 0
        while pending or waiting or running:
            if not waiting and not running and pending[0].arrival > clock:
                clock = pending[0].arrival  # idle until the next request arrives
            while pending and pending[0].arrival <= clock:
                waiting.append(pending.pop(0))
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
                stats["prefill_tokens"] += self.prefill(prefilling)
            decoding = [r for r in running if r.prefilled == len(r.prompt) and not r.done()]
            if decoding:
                self.decode(decoding)
                stats["decode_tokens"] += len(decoding)
            self.occupancy.append(self.allocator.used)
            for req in [r for r in running if r.done()]:
                running.remove(req)
                self.allocator.release(req.blocks)
                finished.append(req)
            clock += 1
            progress.update(len(finished), f"requests, step {clock}, {self.allocator.used}/{self.args.num_blocks} blocks")
        progress.close()
        stats["prefill_s"], stats["decode_s"] = self.timing["prefill"]["s"], self.timing["decode"]["s"]
        return finished, stats

    def warm_up(self):
        """Compiles every step shape (each context-rows bucket of prefill, and decode) on a
        throwaway request of one token, so the timings exclude compiling."""
        a = self.args
        req = Request(-1, np.zeros(1, np.int32), 1, blocks=self.allocator.allocate(1))
        self.prefill([req], timed=False)
        self.decode([req], timed=False)
        smallest, largest = self.context_rows
        rows = smallest
        while rows < largest:  # the other buckets, on an empty step
            rows = bucket(rows + 1, smallest, largest)
            tables = np.zeros((a.prefill_seqs, self.max_blocks), np.int32)
            cu = np.zeros(a.prefill_seqs + 1, np.int32)
            _, self.kv_cache = self.prefill_step(self.params, np.zeros(a.prefill_budget, np.int32), np.zeros(a.prefill_budget, np.int32),
                                                 np.full(a.prefill_budget, -1, np.int32), cu, tables, np.zeros(a.prefill_seqs, np.int32),
                                                 self.kv_cache, rows)
        self.allocator.release(req.blocks)
        jax.block_until_ready(self.kv_cache)

    def decode_device_seconds(self, calls=5):
        """Device seconds of the busiest timed decode step (the median span of ``calls`` runs of it
        again under the profiler, the cache donated as in serving): the step without the host's
        share of the wall time (the inputs' transfers, the dispatch, the wait for the sampled
        tokens). None where there is no device time (CPU)."""
        if self.busiest_decode is None or jax.devices()[0].platform != "gpu":
            return None
        args = [self.params, *(jnp.asarray(x) for x in self.busiest_decode[1]), self.kv_cache]
        timed = _profile.device_time_per_call(self.decode_step, args, {6: 1}, calls)
        self.kv_cache = args[6]
        # The span (first kernel's start to last one's end): the decode attention's combine starts
        # as a programmatic dependent while the attention kernel runs, so summed durations count
        # that overlap twice.
        return None if timed is None else timed.span_seconds or timed.seconds


@functools.partial(jax.jit, static_argnames=("config",))
def reference_logits(params, tokens, cos_sin_cache, *, config):
    """The model without any cache or fused op: float32 layers (``layer.reference_attention``,
    residual around each) over a whole sequence -> logits [len(tokens), vocab]."""
    h = params["embed"][tokens].astype(jnp.float32)
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    for layer_params in params["layers"]:
        h = h + mla.reference_attention(layer_params, h, positions, config=config, cos_sin_cache=cos_sin_cache)
    return logits_of(params, h, config)


def check_against_reference(server, finished, margin, max_tokens=None):
    """Every generated token must be a greedy choice of the reference model, up to ``margin``
    (in units of the logits' standard deviation): the served path rounds to bf16 and quantizes
    its cache, so an exact argmax tie-break cannot be asked for. Requests longer than
    ``max_tokens`` are left out (the reference's attention is dense). Returns (worst shortfall,
    requests checked)."""
    ref_config = dataclasses.replace(server.config, cache_format="bf16")
    ref_params = {"embed": server.params["embed"],
                  "layers": [{k: v for k, v in p.items() if k != "fp8_scale_inv"} for p in server.params["layers"]]}
    worst, checked = 0.0, 0
    for req in finished:
        fed = np.concatenate([req.prompt, np.asarray(req.generated[:-1], np.int32)])
        if max_tokens is not None and len(fed) > max_tokens:
            continue
        # Padded to a power of two (one compile per size); the reference is causal, so the padding
        # after the sequence changes none of its rows.
        padded = np.zeros(max(64, 1 << (len(fed) - 1).bit_length()), np.int32)
        padded[: len(fed)] = fed
        logits = np.asarray(reference_logits(ref_params, jnp.asarray(padded), server.cos_sin, config=ref_config))[: len(fed)]
        rows = logits[len(req.prompt) - 1 :]  # the positions whose next token was generated
        chosen = rows[np.arange(len(req.generated)), req.generated]
        shortfall = (rows.max(-1) - chosen) / rows.std(-1)
        worst = max(worst, float(shortfall.max()))
        checked += 1
    if worst > margin:
        raise AssertionError(f"a served token is {worst:.3f} std below the reference's best logit (margin {margin})")
    if not checked:
        raise AssertionError(f"no request is short enough (<= {max_tokens} tokens) to be checked")
    return worst, checked


def make_requests(args):
    """Random prompts of random lengths, arriving --arrival-every steps apart on average
    (exponential gaps; 0: all at once); each request wants between a quarter of and all of
    --max-new-tokens, so requests finish at different steps."""
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_prompt, args.max_prompt + 1, args.requests)
    new_tokens = rng.integers(max(1, args.max_new_tokens // 4), args.max_new_tokens + 1, args.requests)
    gaps = rng.exponential(args.arrival_every, args.requests) if args.arrival_every > 0 else np.zeros(args.requests)
    arrivals = np.floor(np.cumsum(gaps) - gaps[0]).astype(int)
    return [Request(i, rng.integers(0, args.vocab, n).astype(np.int32), int(m), int(t))
            for i, (n, m, t) in enumerate(zip(lengths, new_tokens, arrivals))]


PRESETS = {
    # Kimi-K3 at TP8 (12 of its 96 heads per GPU), a few layers, prompts up to 32k.
    "h200": dict(layers=4, hidden=7168, heads=12, q_lora_rank=1536, vocab=32000, cache_format="all", requests=24,
                 min_prompt=256, max_prompt=32768, max_new_tokens=64, batch=32, chunk=4096, prefill_budget=8192,
                 prefill_seqs=8, block_size=64, num_blocks=8192, arrival_every=2.0, check_max_tokens=8192),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=PRESETS, help="a named set of the defaults below (flags given explicitly still win)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--q-lora-rank", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--cache-format", choices=(*CACHE_FORMATS, "all"), default="bf16", help="'all': each format in turn")
    p.add_argument("--rope", action="store_true", help="GPT-J RoPE (Kimi-K3 itself runs NoPE)")
    p.add_argument("--attention-impl", choices=("auto", "cudnn", "blockwise"), default="auto",
                   help="prefill attention engine (docs/PREFILL.md): auto = cuDNN where it runs, else blockwise")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--min-prompt", type=int, default=8)
    p.add_argument("--max-prompt", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--arrival-every", type=float, default=1.0, help="mean scheduler steps between arrivals (0: all at once)")
    p.add_argument("--batch", type=int, default=4, help="decode batch rows")
    p.add_argument("--chunk", type=int, default=32, help="prefill tokens per request per step")
    p.add_argument("--prefill-budget", type=int, default=None, help="prefill tokens per step, all requests (default batch * chunk)")
    p.add_argument("--prefill-seqs", type=int, default=None, help="requests per prefill step (default batch)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-margin", type=float, default=0.25,
                   help="the check at the end: how far (in logit std) a served token may fall below the reference's best")
    p.add_argument("--check-max-tokens", type=int, default=None, help="check only requests of at most this many tokens")
    argv = sys.argv[1:] if argv is None else list(argv)
    preset = p.parse_known_args(argv)[0].preset
    if preset:
        p.set_defaults(**PRESETS[preset])
    args = p.parse_args(argv)
    args.prefill_budget = args.prefill_budget or args.batch * args.chunk
    args.prefill_seqs = args.prefill_seqs or args.batch
    return args


def serve_one_format(args, cache_format, bandwidth):
    server = Server(args, cache_format)
    engine = mla.prefill_attention.choose(args.attention_impl, packed=True, context=True)
    print(f"{cache_format}: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, q_lora {args.q_lora_rank}, "
          f"cache of {args.num_blocks} blocks x {args.block_size}, prefill attention {engine}", flush=True)
    t = time.perf_counter()
    server.warm_up()
    print(f"  compiled the steps in {time.perf_counter() - t:.1f} s", flush=True)
    requests = make_requests(args)
    start = time.perf_counter()
    finished, stats = server.serve(requests)
    total_s = time.perf_counter() - start
    assert len(finished) == len(requests) and all(len(r.generated) == r.max_new_tokens for r in finished)
    assert server.allocator.used == 0, "blocks were not handed back"
    print(f"  served {len(finished)} requests in {len(server.occupancy)} scheduler steps, "
          f"peak cache use {max(server.occupancy)}/{args.num_blocks} blocks, prompts {min(len(r.prompt) for r in finished)}"
          f"-{max(len(r.prompt) for r in finished)} tokens")
    print(f"  prefill: {stats['prefill_tokens']} tokens, {stats['prefill_tokens'] / stats['prefill_s']:.0f} tokens/s")
    print(f"  decode:  {stats['decode_tokens']} tokens, {stats['decode_tokens'] / stats['decode_s']:.0f} tokens/s")
    print(f"  overall: {(stats['prefill_tokens'] + stats['decode_tokens']) / total_s:.0f} tokens/s")
    for kind, entry in server.timing.items():
        if entry["steps"]:
            per_layer = entry["s"] / entry["steps"] / args.layers
            floor = entry["bytes"] / entry["steps"] / bandwidth
            note = " (compute-bound: the floor is a lower bound only)" if kind == "prefill" else ""
            on_gpu = jax.devices()[0].platform == "gpu"
            if not on_gpu:  # small steps' bytes fit in the CPU's caches, which the copy ceiling does not
                note += " (CPU: its memory's copy ceiling; cached steps may beat it)"
            print(f"  {kind} step, per layer: {per_layer * 1e6:.0f} us against {'an HBM' if on_gpu else 'a memory'} floor of {floor * 1e6:.0f} us "
                  f"({per_layer / floor:.1f}x; wall time, embedding and logits included){note}")
    worst, checked = check_against_reference(server, finished, args.check_margin, args.check_max_tokens)
    print(f"  check ({checked} of {len(finished)} requests): every generated token is the reference model's greedy choice "
          f"within {worst:.3f} logit std (margin {args.check_margin}): PASS", flush=True)
    device_s = server.decode_device_seconds()
    if device_s is not None:
        requests_in_step, _, layer_bytes = server.busiest_decode
        embed = server.params["embed"]
        floor = (args.layers * (server.layer_weight_bytes + layer_bytes) + embed.size * embed.dtype.itemsize) / bandwidth
        print(f"  decode step on the device: {device_s * 1e6:.0f} us against an HBM floor of {floor * 1e6:.0f} us "
              f"({device_s / floor:.1f}x; the busiest step, {requests_in_step} requests, run again under the profiler; "
              f"all {args.layers} layers, the embedding read for the logits included)", flush=True)


def main(argv=None):
    args = parse_args(argv)
    device = jax.devices()[0]
    bandwidth = copy_bandwidth(1 << 30 if device.platform == "gpu" else 1 << 26)
    print(f"{device.platform} ({device.device_kind}): copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)")
    formats = tuple(CACHE_FORMATS) if args.cache_format == "all" else (args.cache_format,)
    for cache_format in formats:
        serve_one_format(args, cache_format, bandwidth)
    print(f"all {len(formats)} cache format(s): PASS")


if __name__ == "__main__":
    main()
