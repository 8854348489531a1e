"""The Mamba-2 (SSD) mixer, exactly the official block (Mamba-2 paper §7; mamba_ssm `Mamba2`)."""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from hax_jax.config import DEFAULT_CAPACITY, ModelConfig
from hax_jax.layers import SCAN_IO
from hax_jax.layers.fused import (
    JOINED,
    FusedConv1d,
    FusedLinear,
    Part,
    conv_joined,
    for_shard_map,
    fuse,
    fused_linear,
    unfuse,
)
from hax_jax.layers.hax_attention import SparseAttentionCache, sparse_branch
from hax_jax.layers.init import dt_bias_init, linear
from hax_jax.layers.norms import GatedRMSNorm
from hax_jax.parallel import (
    from_previous_shard,
    per_device,
    seq_shards,
    ssd_head_and_group_names,
    ssd_sequence_parallel,
)
from pallas_kernels.ssd import BlockSizes

XBC = ("x", "B", "C")  # the conv's parts, contiguous in in_proj's output


class Mamba2Cache(NamedTuple):
    """Decode state of one Mamba-2 layer."""

    conv: jax.Array  # (b, d_conv - 1, d_inner + 2 G N): the last pre-conv [x | B | C] inputs
    ssm: jax.Array  # (b, n_heads, headdim, d_state), fp32
    sparse: SparseAttentionCache | None = (
        None  # the sparse branch's keys, values, buckets, running top-k
    )


class Mamba2Mixer(nnx.Module):
    """in_proj -> z, x, B, C, dt; conv + SiLU on x, B, C; SSD over heads; gated grouped RMSNorm;
    out_proj. in_proj and conv1d are stored per part (layers/fused.py)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        m = cfg.mamba2
        d, e = cfg.d_model, m.expand * cfg.d_model
        h, g, n = e // m.headdim, m.ngroups, m.d_state
        dtype = jnp.dtype(cfg.dtype)
        self.d_inner, self.n_heads, self.headdim, self.ngroups, self.d_state = e, h, m.headdim, g, n
        self.dtype, self.chunk_size, self.ssd_impl, self.dt_limit = (
            dtype,
            m.chunk_size,
            m.ssd_impl,
            m.dt_limit,
        )
        self.ssd_block_sizes = (
            None if m.ssd_mosaic_gpu is None else BlockSizes(mosaic_gpu=m.ssd_mosaic_gpu)
        )

        # Tensor parallelism (Mamba-2 paper §8.1): a device holds z, x, dt of its heads and B, C of
        # its groups (one group is replicated: every head reads it), so in_proj and the conv need no
        # communication; out_proj contracts the split d_inner: the block's one all-reduce.
        xbc = (
            Part("x", (e,), ("inner",)),
            Part("B", (g, n), ("groups", "state")),
            Part("C", (g, n), ("groups", "state")),
        )
        self.in_proj = FusedLinear(
            d,
            (Part("z", (e,), ("inner",)), *xbc, Part("dt", (h,), ("heads",))),
            in_axis="embed",
            use_bias=m.bias,
            dtype=dtype,
            rngs=rngs,
        )
        self.conv1d = FusedConv1d(xbc, m.d_conv, use_bias=m.conv_bias, impl=m.conv_impl, rngs=rngs)
        self.dt_bias = nnx.Param(
            dt_bias_init(m.dt_min, m.dt_max, m.dt_init_floor)(rngs.params(), (h,)),
            logical_axes=("heads",),
        )
        lo, hi = m.A_init_range
        self.A_log = nnx.Param(
            jnp.log(jax.random.uniform(rngs.params(), (h,), jnp.float32, lo, hi)),
            logical_axes=("heads",),
        )
        self.D = nnx.Param(jnp.ones((h,), jnp.float32), logical_axes=("heads",))
        self.norm = GatedRMSNorm(e, group_size=e // g, eps=cfg.norm_eps, impl=m.norm_impl)
        # rescale_prenorm_residual
        self.out_proj = linear(
            e,
            d,
            ("inner", "embed"),
            rngs=rngs,
            dtype=dtype,
            use_bias=m.bias,
            scale=1 / math.sqrt(cfg.n_layer),
        )
        self.branch = sparse_branch(cfg, d_inner=e, d_state=n, rngs=rngs)

    def init_cache(self, batch: int, capacity: int = DEFAULT_CAPACITY) -> Mamba2Cache:
        """The cache at the start of a sequence; a sparse branch holds up to `capacity` tokens."""
        return Mamba2Cache(
            conv=self.conv1d.init_state(batch, self.dtype),
            ssm=jnp.zeros((batch, self.n_heads, self.headdim, self.d_state), jnp.float32),
            sparse=None
            if self.branch is None
            else self.branch.init_cache(batch, capacity, self.dtype),
        )

    def _project_token(self, u: jax.Array, conv_state):
        """u (b, d) -> z (b, e), x (b, h, p), B, C (b, g, n) post-conv and SiLU, dt (b, h) fp32
        positive, and the conv's new state."""
        proj = self.in_proj(u)
        dt = jax.nn.softplus(proj["dt"].astype(jnp.float32) + self.dt_bias[...])
        xBC, conv_state = self.conv1d.step({k: proj[k] for k in XBC}, conv_state, silu=True)
        x, B, C = (xBC[k] for k in XBC)
        x = x.reshape(*x.shape[:-1], self.n_heads, self.headdim)
        return proj["z"], x, B, C, jnp.clip(dt, *self.dt_limit), conv_state

    def __call__(
        self, u: jax.Array, *, cache: Mamba2Cache | None = None, seq_idx=None, mask=None, rng=None
    ) -> tuple[jax.Array, Mamba2Cache]:
        """Parallel mode: u (b, l, d) -> (out (b, l, d), cache after the last token).

        `seq_idx` (b, l) marks packed documents: no state and no conv window crosses a boundary.
        With a sparse branch, decoding continues only from a cache that started as `init_cache`.
        """
        if seq_idx is not None and self.branch is not None:
            raise ValueError(
                "seq_idx (packed documents) is not supported with a sparse-attention branch"
            )
        b, l, _ = u.shape
        # One shard_map from in_proj to the SSD (Mamba-2 paper §8.1): each device projects,
        # convolves and scans its heads (and groups) with no communication, and the backward sums
        # the input's
        # gradient over "tensor" once, at the boundary (per part, GSPMD would all-reduce each).
        heads, groups = ssd_head_and_group_names(self.n_heads, self.ngroups)
        inner = "inner" if heads else None
        part_axes = {
            "z": (inner,),
            "x": (inner,),
            "B": (groups, None),
            "C": (groups, None),
            "dt": (heads,),
        }
        # Cast (and with heads whole, joined) here, not inside: fused.for_shard_map says why.
        proj = for_shard_map(self.in_proj, self.dtype, part_axes, join=inner is None)
        xbc = {k: part_axes[k] for k in XBC}
        conv = for_shard_map(self.conv1d, None, xbc, join=inner is None)
        # Heads whole on every device: the gate goes out as in_proj's whole output, whose first
        # channels the norm's kernels read in place (a slice would be copied for them, and kept
        # for the backward beside that output, which the conv's backward keeps).
        front = functools.partial(
            _front_shard,
            mixer=self,
            chunk_size=self.chunk_size,
            impl=self.ssd_impl,
            whole_gate=inner is None,
            order=proj.order,
            conv_order=conv.order,
        )
        y, z, x, ssm_state, *conv_states = per_device(
            front,
            dict(
                u=u,
                in_kernels=proj.kernels,
                in_biases=proj.biases,
                conv_kernels=conv.kernels,
                conv_biases=conv.biases,
                conv_states=None if cache is None else unfuse(cache.conv, self.conv1d.parts),
                # One array: its gradient is then one sum over "data" and "seq", not three.
                per_head=jnp.stack([self.dt_bias[...], -jnp.exp(self.A_log[...]), self.D[...]]),
                initial_state=None if cache is None else cache.ssm,
                seq_idx=seq_idx,
            ),
            dict(
                u=("batch", "seq", None),
                in_kernels=proj.kernel_axes,
                in_biases=proj.bias_axes,
                conv_kernels=conv.kernel_axes,
                conv_biases=conv.bias_axes,
                conv_states={k: ("batch", None, *v) for k, v in xbc.items()},
                per_head=(None, heads),
                initial_state=("batch", heads, None, None),
                seq_idx=("batch", "seq"),
            ),
            [
                ("batch", "seq", heads, None),
                ("batch", "seq", inner),
                ("batch", "seq", inner),
                ("batch", heads, None, None),
                *(("batch", None, *xbc[p.name]) for p in self.conv1d.parts),
            ],
            seq_aware=True,
        )
        conv_state = fuse(
            dict(zip((p.name for p in self.conv1d.parts), conv_states, strict=True)),
            self.conv1d.parts,
            lead=2,
        )
        y = y.reshape(b, l, self.d_inner)
        sparse_cache = None
        added = None
        if self.branch is not None and cache is None:
            # HAX with Mamba-2: the gated norm of y = ssd(x) + o * E, the product and the sum
            # taken inside the norm's kernels (E's gradient summed there too).
            added = (self.branch(x, mask=mask, rng=rng, gated=False), self.branch.E[...])
        elif self.branch is not None:
            o, sparse_cache = self.branch.forward(x, cache, mask=mask, rng=rng)
            y = y.astype(jnp.float32) + o.astype(jnp.float32)
        y = self.norm(y, z, added=added)
        return self.out_proj(y.astype(self.dtype)), Mamba2Cache(conv_state, ssm_state, sparse_cache)

    def step(self, u: jax.Array, cache: Mamba2Cache) -> tuple[jax.Array, Mamba2Cache]:
        """Recurrent mode, one token: u (b, d) -> (out (b, d), cache); constant cost per token."""
        z, x, B, C, dt, conv_state = self._project_token(u, cache.conv)
        heads_per_group = self.n_heads // self.ngroups
        B = jnp.repeat(B.astype(jnp.float32), heads_per_group, axis=1)  # (b, h, n)
        C = jnp.repeat(C.astype(jnp.float32), heads_per_group, axis=1)
        x32 = x.astype(jnp.float32)
        # h_t = exp(dt A) h_{t-1} + dt x_t B_t^T per head; y = h C + D x.
        dA = jnp.exp(dt * -jnp.exp(self.A_log[...]))  # (b, h)
        h = cache.ssm * dA[:, :, None, None] + jnp.einsum("bhp,bhn->bhpn", dt[:, :, None] * x32, B)
        y = jnp.einsum("bhpn,bhn->bhp", h, C) + self.D[...][:, None] * x32
        y = y.reshape(u.shape[0], self.d_inner)
        sparse_cache = None
        if self.branch is not None:
            o, sparse_cache = self.branch.step(x.reshape(u.shape[0], self.d_inner), cache)
            y = y + o.astype(jnp.float32)
        y = self.norm(y, z, impl="reference")  # one token: XLA fuses it into the step
        return self.out_proj(y.astype(self.dtype)), Mamba2Cache(conv_state, h, sparse_cache)


def _front_shard(
    u,
    in_kernels,
    in_biases,
    conv_kernels,
    conv_biases,
    conv_states,
    per_head,
    initial_state,
    seq_idx,
    *,
    mixer: Mamba2Mixer,
    chunk_size: int,
    impl: str,
    whole_gate: bool,
    order: list[str],
    conv_order: list[str],
):
    """in_proj, conv + SiLU and the SSD of one device's rows, heads and groups (or of everything,
    outside shard_map): -> (y (b, l, h, p), z (b, l, e) (with `whole_gate` in_proj's whole output
    (b, l, >= e), z its first e channels), x (b, l, e) post-conv, final SSM state, *the conv's new
    state per part). in_kernels / in_biases and `order`, conv_kernels / conv_biases and
    `conv_order` as fused.for_shard_map gives them; per_head (3, h): dt_bias, A and D."""
    # One GEMM and contiguous slices, as the fused layer: [z | x | B | C | dt] (local parts).
    project = functools.partial(
        fused_linear, kernels=in_kernels, biases=in_biases, dtype=mixer.dtype, order=order
    )
    zxbcdt, shapes = project(u)
    if order == [JOINED]:  # joined whole: the parts' own shapes
        shapes = [p.shape for p in mixer.in_proj.parts]
    zxbcdt = checkpoint_name(zxbcdt, SCAN_IO)
    e, conv_dim = shapes[0][0], sum(math.prod(s) for s in shapes[1:4])
    z, _, dt = jnp.split(zxbcdt, [e, e + conv_dim], axis=-1)
    dt_bias, A, D = per_head  # (h,) each
    dt = jax.nn.softplus(dt.astype(jnp.float32) + dt_bias)
    previous = None
    if seq_shards() > 1:
        # The conv's window from the previous shard: its last d_conv - 1 rows of u, projected
        # here. Sent before in_proj, not after, its collective-permute need not wait for the
        # GEMM (nor the backward's return of their gradient for this shard's in_proj backward).
        width = mixer.conv1d.width
        tail = u[:, u.shape[1] - (width - 1) :]
        u_prev = from_previous_shard(tail, jnp.zeros_like(tail))
        previous = project(u_prev)[0][..., e : e + conv_dim]
    # The conv reads x, B, C in place in in_proj's output and writes them apart.
    xBC, new_conv = conv_joined(
        zxbcdt,
        conv_kernels,
        conv_biases,
        conv_states,
        seq_idx,
        conv_order,
        previous,
        silu=True,
        start=e,
        impl=mixer.conv1d.impl,
        parts=mixer.conv1d.parts if conv_order == [JOINED] else None,
    )
    x, B, C = xBC.values()
    x_blhp = x.reshape(*x.shape[:-1], -1, mixer.headdim)
    y, h = ssd_sequence_parallel(
        x_blhp,
        jnp.clip(dt, *mixer.dt_limit),
        A,
        B,
        C,
        D,
        initial_state,
        seq_idx,
        chunk_size=chunk_size,
        impl=impl,
        block_sizes=mixer.ssd_block_sizes,
    )
    y = checkpoint_name(y, SCAN_IO)
    gate = zxbcdt if whole_gate else z
    return (y, gate, x, h, *(new_conv[p.name] for p in mixer.conv1d.parts))
