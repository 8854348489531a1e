"""The Mamba-1 (S6) mixer, exactly the official block (Mamba paper §3.4; mamba_ssm `Mamba`)."""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from hax_jax.config import DEFAULT_CAPACITY, SCAN_STATES_SHARE, ModelConfig
from hax_jax.layers import SCAN_IO, init
from hax_jax.layers.conv import CausalConv1d, conv_shard
from hax_jax.layers.fused import FusedLinear, Part, for_shard_map, fused_linear
from hax_jax.layers.hax_attention import SparseAttentionCache, sparse_branch
from hax_jax.parallel import per_device, selective_scan_sequence_parallel, seq_shards
from hax_jax.sharding import current_mesh
from pallas_kernels.selective_scan import saved_states_bytes


class MambaCache(NamedTuple):
    """Decode state of one Mamba layer."""

    conv: jax.Array  # (b, d_conv - 1, d_inner): the last pre-conv inputs
    ssm: jax.Array  # (b, d_inner, d_state), fp32
    sparse: SparseAttentionCache | None = (
        None  # the sparse branch's keys, values, buckets, running top-k
    )


class MambaMixer(nnx.Module):
    """in_proj -> x, z; conv + SiLU on x; x_proj -> [dt | B | C]; selective scan; * SiLU(z);
    out_proj."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        m = cfg.mamba
        d, e, n = cfg.d_model, m.expand * cfg.d_model, m.d_state
        r = m.dt_rank or math.ceil(d / 16)
        dtype = jnp.dtype(cfg.dtype)
        self.d_inner, self.d_state, self.dt_rank, self.dtype = e, n, r, dtype
        self.scan_impl, self.scan_states = m.scan_impl, m.scan_states
        # Layers whose scan states one backward holds at once when blocks are not rematerialised.
        self.mamba_layers = cfg.mixer_kinds.count("mamba")
        self.remat_blocks = cfg.remat_blocks

        linear = functools.partial(init.linear, rngs=rngs, dtype=dtype)

        # Tensor parallelism (Mamba-2 paper §8.1 for Mamba-1): d_inner is split. in_proj is stored
        # per part (layers/fused.py), so a device's x and z are local; x_proj contracts the split
        # d_inner (a small all-reduce of dt, B, C) and out_proj too (the block's all-reduce).
        self.in_proj = FusedLinear(
            d,
            (Part("x", (e,), ("inner",)), Part("z", (e,), ("inner",))),
            in_axis="embed",
            use_bias=m.bias,
            dtype=dtype,
            rngs=rngs,
        )
        self.conv1d = CausalConv1d(e, m.d_conv, use_bias=m.conv_bias, impl=m.conv_impl, rngs=rngs)
        self.x_proj = linear(e, r + 2 * n, ("inner", "state"))
        self.dt_proj = linear(
            r,
            e,
            ("state", "inner"),
            use_bias=True,
            kernel_init=init.torch_linear_init(
                1, scale=m.dt_scale / math.sqrt(r)
            ),  # U(+-dt_scale/sqrt(R))
            bias_init=init.dt_bias_init(m.dt_min, m.dt_max, m.dt_init_floor),
        )
        # S4D-real init: A = -(1..N) for every channel, stored as log.
        self.A_log = nnx.Param(
            jnp.log(jnp.tile(jnp.arange(1, n + 1, dtype=jnp.float32), (e, 1))),
            logical_axes=("inner", "state"),
        )
        self.D = nnx.Param(jnp.ones((e,), jnp.float32), logical_axes=("inner",))
        # mamba_ssm rescales out_proj by 1/sqrt(n_layer) (rescale_prenorm_residual).
        self.out_proj = linear(
            e,
            d,
            ("inner", "embed"),
            use_bias=m.bias,
            scale=1 / math.sqrt(cfg.n_layer),
        )
        self.branch = sparse_branch(cfg, d_inner=e, d_state=n, rngs=rngs)

    def init_cache(self, batch: int, capacity: int = DEFAULT_CAPACITY) -> MambaCache:
        """The cache at the start of a sequence; a sparse branch holds up to `capacity` tokens."""
        return MambaCache(
            conv=self.conv1d.init_state(batch, self.dtype),
            ssm=jnp.zeros((batch, self.d_inner, self.d_state), jnp.float32),
            sparse=None
            if self.branch is None
            else self.branch.init_cache(batch, capacity, self.dtype),
        )

    def _dt_B_C(self, x: jax.Array):
        """x (..., e) post-conv -> dt (..., e) fp32 positive, B, C (..., n)."""
        dt_raw, B, C = jnp.split(
            checkpoint_name(self.x_proj(x), SCAN_IO),
            [self.dt_rank, self.dt_rank + self.d_state],
            axis=-1,
        )
        dt = jax.nn.softplus(
            self.dt_proj(dt_raw).astype(jnp.float32)
        )  # the bias sits inside softplus
        return dt, B, C

    def __call__(
        self, u: jax.Array, *, cache: MambaCache | None = None, seq_idx=None, mask=None, rng=None
    ) -> tuple[jax.Array, MambaCache]:
        """Parallel mode: u (b, l, d) -> (out (b, l, d), cache after the last token).

        With a sparse branch, decoding continues only from a cache that started as `init_cache`.
        """
        if seq_idx is not None:
            raise ValueError(
                "seq_idx (packed documents) is supported by mamba2 layers only, not mamba"
            )
        # in_proj and the conv in one shard_map: each device's x and z are local, and the backward
        # sums the input's gradient over "tensor" once (per part, GSPMD would all-reduce each).
        conv = self.conv1d
        # Channels whole on every device: the gate goes on as in_proj's whole output [x | z],
        # which the scan's kernels read in place (a slice would be copied for them, and kept for
        # the backward beside that output, which the conv's backward keeps).
        mesh = current_mesh()
        whole = mesh is None or dict(mesh.shape).get("tensor", 1) == 1
        gate = ("batch", "seq", None) if whole else ("batch", "seq", "inner")
        # Cast (and with channels whole, joined) here, not inside: fused.for_shard_map says why.
        axes = {"x": ("inner",), "z": ("inner",)}
        proj = for_shard_map(self.in_proj, self.dtype, axes, join=whole)
        x, z, conv_state = per_device(
            functools.partial(
                _front_shard,
                dtype=self.dtype,
                conv_impl=conv.impl,
                whole_gate=whole,
                order=proj.order,
            ),
            dict(
                u=u,
                in_kernels=proj.kernels,
                in_biases=proj.biases,
                conv_kernel=conv.kernel[...],
                conv_bias=None if conv.bias is None else conv.bias[...],
                conv_state=None if cache is None else cache.conv,  # None: zeros, made per shard
            ),
            dict(
                u=("batch", "seq", None),
                in_kernels=proj.kernel_axes,
                in_biases=proj.bias_axes,
                conv_kernel=(None, "inner"),
                conv_bias=("inner",),
                conv_state=("batch", None, "inner"),
            ),
            [("batch", "seq", "inner"), gate, ("batch", None, "inner")],
            seq_aware=True,
        )
        z_start = z.shape[-1] - x.shape[-1]  # the gate's first channel in z
        dt, B, C = self._dt_B_C(x)

        h0 = None if cache is None else cache.ssm
        channels = ("batch", "seq", "inner")
        layers_held = 0 if self.remat_blocks(u.shape[1]) else self.mamba_layers
        y, ssm_state = per_device(
            functools.partial(
                _scan_shard,
                impl=self.scan_impl,
                states=self.scan_states,
                layers=layers_held,
                z_start=z_start,
            ),
            dict(
                x=x,
                dt=dt,
                A=-jnp.exp(self.A_log[...]),
                B=B,
                C=C,
                D=self.D[...],
                z=z,
                initial_state=h0,
            ),
            dict(
                x=channels,
                dt=channels,
                A=("inner", None),
                B=("batch", "seq", None),
                C=("batch", "seq", None),
                D=("inner",),
                z=gate,
                initial_state=("batch", "inner", None),
            ),
            [channels, ("batch", "inner", None)],
            seq_aware=True,
        )
        sparse_cache = None
        if self.branch is not None:
            # HAX with Mamba: y = scan(x) * SiLU(z) + o * E * SiLU(z).
            o, sparse_cache = self.branch.forward(x, cache, mask=mask, rng=rng)
            z = z[..., z_start:]
            y = y.astype(jnp.float32) + o.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        return self.out_proj(y.astype(self.dtype)), MambaCache(conv_state, ssm_state, sparse_cache)

    def step(self, u: jax.Array, cache: MambaCache) -> tuple[jax.Array, MambaCache]:
        """Recurrent mode, one token: u (b, d) -> (out (b, d), cache); constant cost per token."""
        proj = self.in_proj(u)
        x, z = proj["x"], proj["z"]
        x, conv_state = self.conv1d.step(x, cache.conv, silu=True)
        dt, B, C = self._dt_B_C(x)
        x32 = x.astype(jnp.float32)
        # h_t = exp(dt A) h_{t-1} + dt B x_t (Euler B, as the official code); y = C.h + D x.
        dA = jnp.exp(dt[:, :, None] * -jnp.exp(self.A_log[...]))
        h = cache.ssm * dA + (dt * x32)[:, :, None] * B.astype(jnp.float32)[:, None, :]
        y = jnp.einsum("ben,bn->be", h, C.astype(jnp.float32)) + self.D[...] * x32
        sparse_cache = None
        if self.branch is not None:
            o, sparse_cache = self.branch.step(x, cache)
            y = y + o.astype(jnp.float32)
        y = y * jax.nn.silu(z.astype(jnp.float32))
        return self.out_proj(y.astype(self.dtype)), MambaCache(conv_state, h, sparse_cache)


def _front_shard(
    u,
    in_kernels,
    in_biases,
    conv_kernel,
    conv_bias,
    conv_state,
    *,
    dtype,
    conv_impl,
    whole_gate,
    order,
):
    """in_proj and conv + SiLU of one device's rows and channels (or of everything, outside
    shard_map): -> (x post-conv (b, l, e), z (b, l, e) (with `whole_gate` in_proj's whole output
    [x | z] (b, l, 2e)), the conv's new state). in_kernels / in_biases and `order` as
    fused.for_shard_map gives them."""
    xz, _ = fused_linear(u, in_kernels, in_biases, dtype, order)
    xz = checkpoint_name(xz, SCAN_IO)
    e = xz.shape[-1] // 2  # x and z are alike wide
    # The conv reads x in place in in_proj's output (its first channels).
    x, new_state = conv_shard(
        xz, conv_kernel, conv_bias, conv_state, None, silu=True, impl=conv_impl
    )
    return x, xz if whole_gate else xz[..., e:], new_state


def _scan_shard(x, dt, A, B, C, D, z, initial_state, *, impl, states, layers, z_start):
    """The selective scan of one device's shard (`selective_scan_sequence_parallel`), its backward's
    states saved or recomputed as `states` says ("auto" on this shard's sizes, `layers` Mamba
    layers' states held at once)."""
    b, l, d = x.shape
    scans = 1 if seq_shards() == 1 else 2  # a split sequence's shard is scanned twice
    held = layers * scans * saved_states_bytes(b, l, d, A.shape[1])
    recompute = recomputes_scan_states(states, held)
    y, final = selective_scan_sequence_parallel(
        x, dt, A, B, C, D, z, initial_state, impl=impl, recompute_states=recompute, z_start=z_start
    )
    return checkpoint_name(y, SCAN_IO), final


def recomputes_scan_states(setting: str, held_bytes: int) -> bool:
    """mamba.scan_states resolved: "auto" recomputes when `held_bytes` of saved states would pass
    SCAN_STATES_SHARE of a device's memory (kept where the device does not tell it: CPU)."""
    if setting != "auto":
        return setting == "recomputed"
    limit = device_memory_bytes()
    return limit is not None and held_bytes > SCAN_STATES_SHARE * limit


def device_memory_bytes() -> int | None:
    """What jax may allocate on one of this process's devices, or None where unknown. Every process
    of a multi-process run must compile the same step: on alike devices with alike
    XLA_PYTHON_CLIENT_MEM_FRACTION they read the same limit."""
    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
