"""The Mamba-2 (SSD) mixer, exactly the official block (Mamba-2 paper §7; mamba_ssm `Mamba2`)."""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from hax_jax.config import DEFAULT_CAPACITY, ModelConfig
from hax_jax.layers.conv import CausalConv1d, torch_linear_init
from hax_jax.layers.hax_attention import SparseAttentionCache
from hax_jax.layers.mamba import dt_bias_init, sparse_branch
from hax_jax.layers.norms import GatedRMSNorm
from hax_jax.parallel import per_device, ssd_head_and_group_names, ssd_sequence_parallel
from hax_jax.sharding import linear_axes


class Mamba2Cache(NamedTuple):
    """Decode state of one Mamba-2 layer."""

    conv: jax.Array  # (b, d_conv - 1, d_inner + 2 G N): the last pre-conv [x | B | C] inputs
    ssm: jax.Array  # (b, n_heads, headdim, d_state), fp32
    sparse: SparseAttentionCache | None = (
        None  # the sparse branch's keys, values, buckets, running top-k
    )


class Mamba2Mixer(nnx.Module):
    """in_proj -> [z | xBC | dt]; conv + SiLU on xBC; SSD over heads; gated grouped RMSNorm; out_proj."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        m = cfg.mamba2
        d, e = cfg.d_model, m.expand * cfg.d_model
        h, g, n = e // m.headdim, m.ngroups, m.d_state
        dtype = jnp.dtype(cfg.dtype)
        self.d_inner, self.n_heads, self.headdim, self.ngroups, self.d_state = e, h, m.headdim, g, n
        self.conv_dim = e + 2 * g * n
        self.dtype, self.chunk_size, self.ssd_impl, self.dt_limit = (
            dtype,
            m.chunk_size,
            m.ssd_impl,
            m.dt_limit,
        )

        def linear(i, o, axes, scale=1.0):
            init = torch_linear_init(i, scale)
            return nnx.Linear(
                i,
                o,
                use_bias=m.bias,
                dtype=dtype,
                kernel_init=init,
                rngs=rngs,
                **linear_axes(*axes),
            )

        # Tensor parallelism (Mamba-2 paper §8.1): heads are split. The fused in_proj output
        # [z | xBC | dt] and the conv's [x | B | C] are split as one axis each, so their slices
        # (and B, C, which every head needs) reshard: not communication-free, unlike the paper's
        # per-shard layout. out_proj contracts the split d_inner: the block's all-reduce.
        self.in_proj = linear(d, 2 * e + 2 * g * n + h, ("embed", "inner"))
        self.conv1d = CausalConv1d(self.conv_dim, m.d_conv, use_bias=m.conv_bias, rngs=rngs)
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
        self.norm = GatedRMSNorm(e, group_size=e // g, eps=cfg.norm_eps)
        # rescale_prenorm_residual
        self.out_proj = linear(e, d, ("inner", "embed"), scale=1 / math.sqrt(cfg.n_layer))
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

    def _split(self, zxbcdt: jax.Array):
        """in_proj output -> z (..., e), xBC (..., conv_dim), dt (..., h) fp32 positive."""
        z, xBC, dt = jnp.split(zxbcdt, [self.d_inner, self.d_inner + self.conv_dim], axis=-1)
        dt = jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...])
        return z, xBC, jnp.clip(dt, *self.dt_limit)

    def _x_B_C(self, xBC: jax.Array):
        """Post-conv xBC (..., conv_dim) -> x (..., h, p), B, C (..., g, n)."""
        gn = self.ngroups * self.d_state
        x, B, C = jnp.split(xBC, [self.d_inner, self.d_inner + gn], axis=-1)
        lead = xBC.shape[:-1]
        return (
            x.reshape(*lead, self.n_heads, self.headdim),
            B.reshape(*lead, self.ngroups, self.d_state),
            C.reshape(*lead, self.ngroups, self.d_state),
        )

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
        z, xBC, dt = self._split(self.in_proj(u))
        xBC, conv_state = self.conv1d(
            xBC, state=None if cache is None else cache.conv, seq_idx=seq_idx
        )
        x, B, C = self._x_B_C(jax.nn.silu(xBC))

        scan = functools.partial(
            ssd_sequence_parallel, chunk_size=self.chunk_size, impl=self.ssd_impl
        )
        heads, groups = ssd_head_and_group_names(self.n_heads, self.ngroups)
        h0 = None if cache is None else cache.ssm
        y, ssm_state = per_device(
            scan,
            self.ssd_impl,
            dict(x=x, dt=dt, A=-jnp.exp(self.A_log[...]), B=B, C=C, D=self.D[...],
                 initial_state=h0, seq_idx=seq_idx),
            dict(x=("batch", "seq", heads, None), dt=("batch", "seq", heads), A=(heads,),
                 B=("batch", "seq", groups, None), C=("batch", "seq", groups, None), D=(heads,),
                 initial_state=("batch", heads, None, None), seq_idx=("batch", "seq")),
            [("batch", "seq", heads, None), ("batch", heads, None, None)],
            seq_aware=True,
        )  # fmt: skip
        y = y.reshape(b, l, self.d_inner)
        sparse_cache = None
        if self.branch is not None:
            # HAX with Mamba-2: y = ssd(x) + o * E, then the gated norm.
            o, sparse_cache = self.branch.forward(
                x.reshape(b, l, self.d_inner), cache, mask=mask, rng=rng
            )
            y = y.astype(jnp.float32) + o.astype(jnp.float32)
        y = self.norm(y, z)
        return self.out_proj(y.astype(self.dtype)), Mamba2Cache(conv_state, ssm_state, sparse_cache)

    def step(self, u: jax.Array, cache: Mamba2Cache) -> tuple[jax.Array, Mamba2Cache]:
        """Recurrent mode, one token: u (b, d) -> (out (b, d), cache); constant cost per token."""
        z, xBC, dt = self._split(self.in_proj(u))
        xBC, conv_state = self.conv1d.step(xBC, cache.conv)
        x, B, C = self._x_B_C(jax.nn.silu(xBC))
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
            o, sparse_cache = self.branch.step(
                x.reshape(u.shape[0], self.d_inner), self.branch.decode_cache(cache)
            )
            y = y + o.astype(jnp.float32)
        y = self.norm(y, z)
        return self.out_proj(y.astype(self.dtype)), Mamba2Cache(conv_state, h, sparse_cache)
