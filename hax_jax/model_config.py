"""The model's typed, frozen configs: the network and its mixers (hax_jax.config re-exports them).

Every field has a default and a comment; cross-field invariants live in `__post_init__`. Field names
follow mamba_ssm (`d_model n_layer d_state d_conv expand headdim ngroups chunk_size vocab_size`).
"""

import dataclasses
import math
from typing import Literal

from pallas_kernels.sparse_attention import SparseSpec

MIXER_KINDS = ("mamba", "mamba2", "attention", "swa", "mlp", "infini")
# Tokens a decode cache holds unless init_cache is asked for more (full attention's KV buffer and
# the sparse branch's key/value buffers grow with it; SSM states, windows and memories do not).
DEFAULT_CAPACITY = 4096
# remat="auto" recomputes every block in the backward for rows of at least this many tokens. The
# 130M step at 1 x 32768 tokens held 35 GiB on one GPU (ENV.md; ~1.1 MB a token, mostly saved
# activations), so from 8192 tokens a row a batch of 8 rows outgrows an 80 GB GPU, while the
# 8 x 2048 steps fit and are spared the extra forward. H200, Mamba-2 130M, 1 x 32768, whole-row
# loss: 118.8 ms / 35.0 GiB without remat, 145.4 ms / 13.1 GiB with.
REMAT_MIN_LEN = 8192
# loss_chunk=0 (auto): the most fp32 logits (b, l, padded vocab) one device computes at once. The
# 130M step at 8 x 2048 (3.3 GB at a 50288 vocab) stays whole; 1 x 1M tokens (211 GB) goes in 64
# chunks. H200, 1 x 32768 with remat: 2 chunks 152.1 ms / 8.7 GiB, whole rows 145.4 ms / 13.1 GiB.
LOGITS_BUDGET = 4 * 2**30
# mamba.scan_states="auto" recomputes the Pallas scan's states in the backward when every Mamba
# layer's (kept at once where blocks are not rematerialised) would pass this share of a device's
# memory. On GPUs they are fp32 every 4 steps, b l d_inner d_state bytes a layer: 130M 32 x 2048,
# 36 GiB (H200: 90.1 GiB a step against mamba_ssm's 65.7); 1.4B 8 x 2048, 48 GiB (failed to
# allocate 86.63 GiB where mamba_ssm ran 16 rows). Below it they stay: recomputing costs a forward
# kernel a layer (455 us at 8 x 2048 x 1536 on an H100: about 11 ms of the 130M 8 x 2048 step, ours
# 86.32 ms against mamba_ssm's 96.71; BENCHMARKS.md).
SCAN_STATES_SHARE = 0.25


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseConfig:
    """The sparse-attention branch beside every mamba / mamba2 mixer (HAX paper §4; SPEC §1.3)."""

    pattern: str = ""  # "" = no branch; else '+'-joined components ("lsh+ks" = HAX; see SparseSpec)
    num_keys: int = 64  # keys per query over all components; each gets num_keys // n_components
    hash_bits: int = 8  # lsh: h random projections (2^h sign-bit buckets, or h argmax buckets)
    binning: Literal["sign", "argmax"] = "sign"  # lsh bucket rule (paper eqs. 6-7)
    max_len: int = 1058  # dilated: dilation = max_len // (keys per component)
    rank_loss_weight: float = 0.1  # alpha in L = L_task + alpha * sum_layers L_rank
    eval_hash_seed: int = 0  # the fixed hash projection used in evaluation
    official_code: bool = (
        False  # the official code's (leaky, dense) behaviours instead of the paper's
    )
    impl: Literal["auto", "indexed", "pallas"] = "auto"  # op impl; auto: Pallas on GPU

    def __post_init__(self):
        """A set pattern must describe a valid attention: building its spec checks every setting."""
        if self.pattern:
            _ = self.spec

    @property
    def spec(self) -> SparseSpec:
        """The attention these settings describe; a ValueError naming model.sparse if invalid."""
        try:
            return SparseSpec(
                self.pattern,
                self.num_keys,
                hash_bits=self.hash_bits,
                binning=self.binning,
                max_len=self.max_len,
                official_code=self.official_code,
            )
        except ValueError as err:
            raise ValueError(f"model.sparse: {err}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """Multi-head causal attention with RoPE ("attention"), and its sliding-window form ("swa")."""

    n_heads: int = 4  # query/key/value heads
    head_dim: int | None = None  # None = d_model // n_heads
    rope_theta: float = 10000.0  # RoPE base
    window: int = 64  # swa: each query sees itself and the window - 1 keys before it
    qkv_bias: bool = False  # bias in the q/k/v projections


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlpConfig:
    """The SwiGLU MLP block ("mlp")."""

    hidden_ratio: float = (
        4.0  # d_ff = 2/3 * hidden_ratio * d_model, rounded up to a multiple of 256 ...
    )
    d_ff: int | None = None  # ... unless given here


@dataclasses.dataclass(frozen=True, kw_only=True)
class InfiniConfig:
    """Infini-attention ("infini"): local causal attention per segment plus a compressive memory."""

    n_heads: int = 4  # heads, each with its own memory and gate
    head_dim: int | None = None  # None = d_model // n_heads
    segment_len: int = 64  # N: tokens per segment
    update: Literal["linear", "delta"] = "linear"  # memory update rule (Infini paper eqs. 8-9)
    rope_theta: float = 10000.0  # RoPE for the local attention only


@dataclasses.dataclass(frozen=True, kw_only=True)
class MambaConfig:
    """The Mamba-1 (S6) mixer (mamba_ssm `Mamba`)."""

    d_state: int = 16  # SSM state size N
    d_conv: int = 4  # depthwise causal conv width
    expand: int = 2  # d_inner = expand * d_model
    dt_rank: int | None = None  # rank R of the dt projection; None = ceil(d_model / 16)
    dt_min: float = 1e-3  # dt init: log-uniform in [dt_min, dt_max] ...
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4  # ... clamped below at this floor
    dt_scale: float = 1.0  # dt_proj weight init bound = dt_scale / sqrt(R)
    conv_bias: bool = True  # bias in the conv
    bias: bool = False  # bias in in_proj and out_proj
    scan_impl: Literal["auto", "reference", "associative", "pallas"] = "auto"  # auto: Pallas on GPU
    # Where the Pallas scan's backward gets its fp32 states (selective_scan recompute_states):
    # "saved" from the forward, "recomputed" by running the forward kernel again in the backward;
    # "auto" recomputes when blocks are not rematerialised and every Mamba layer's states would
    # pass SCAN_STATES_SHARE of a device's memory (never where the memory is not known: CPU).
    scan_states: Literal["auto", "saved", "recomputed"] = "auto"
    # The causal conv and its SiLU: auto = their Triton kernels on a GPU where rows are whole
    # 32-row chunks (pallas_kernels/conv1d), per device under a mesh, else XLA ("reference").
    conv_impl: Literal["auto", "reference", "pallas"] = "auto"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mamba2Config:
    """The Mamba-2 (SSD) mixer (mamba_ssm `Mamba2`)."""

    d_state: int = 128  # SSM state size N
    d_conv: int = 4  # depthwise causal conv width (over x, B and C)
    expand: int = 2  # d_inner = expand * d_model
    headdim: int = 64  # P; n_heads = d_inner // headdim
    ngroups: int = 1  # G groups of B and C shared by n_heads // G heads each
    A_init_range: tuple[float, float] = (1.0, 16.0)  # -A init: uniform in this range
    dt_min: float = 1e-3  # dt init: log-uniform in [dt_min, dt_max] ...
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4  # ... clamped below at this floor
    dt_limit: tuple[float, float] = (0.0, math.inf)  # dt = clip(softplus(dt + dt_bias), *dt_limit)
    conv_bias: bool = True  # bias in the conv
    bias: bool = False  # bias in in_proj and out_proj
    chunk_size: int = 256  # SSD chunk length Q (any sequence length works; padded internally)
    ssd_impl: Literal["auto", "reference", "chunked", "pallas"] = "auto"  # auto: Pallas on GPU
    # The Pallas SSD's chunk_state / chunk_out by Mosaic GPU: None = on Hopper where they suit
    # (pallas_kernels/ssd/kernel_mgpu.use_mosaic_gpu), False = Triton only, True = forced.
    ssd_mosaic_gpu: bool | None = None
    # The gated norm after the SSD: auto = its Triton kernels on a GPU, per device under a mesh
    # unless "tensor" splits a group (pallas_kernels/gated_norm), else XLA ("reference").
    norm_impl: Literal["auto", "reference", "pallas"] = "auto"
    conv_impl: Literal["auto", "reference", "pallas"] = "auto"  # as MambaConfig's

    def __post_init__(self):
        if self.chunk_size < 1:
            raise ValueError(f"mamba2.chunk_size must be positive, got {self.chunk_size}")
        if self.ssd_mosaic_gpu is not None and self.ssd_impl in ("chunked", "reference"):
            raise ValueError(
                f"mamba2.ssd_mosaic_gpu={self.ssd_mosaic_gpu} chooses between Pallas kernels; "
                f"mamba2.ssd_impl={self.ssd_impl!r} runs none (use 'auto' or 'pallas')"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The language model: embeddings -> blocks -> final norm -> head."""

    d_model: int = 768  # residual width
    n_layer: int = 24  # number of residual blocks
    vocab_size: int = 50277  # real vocabulary; token ids must be below this
    pad_vocab_size_multiple: int = 8  # embedding rows = vocab_size rounded up to this multiple
    block_pattern: tuple[str, ...] = ("mamba",)  # mixer kinds, repeated cyclically over the layers
    tie_embeddings: bool = True  # the head reuses the embedding matrix
    residual_in_fp32: bool = True  # keep the residual stream in fp32 whatever the compute dtype
    norm_eps: float = 1e-5  # RMSNorm epsilon (block norms, final norm, Mamba-2 gated norm)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # compute dtype; params are fp32
    # Initial parameters: "mamba_ssm" (the official models') or "hax_code", as the HAX code's
    # joint-recall models start (flash-linear-attention's init at its configs' std 0.1; mamba and
    # mamba2 layers only): layers/init.py's hax_code_init says which parameters it re-draws.
    init: Literal["mamba_ssm", "hax_code"] = "mamba_ssm"
    # The backward's memory: "block" keeps each residual block's input only and recomputes the
    # rest of the block; "block_keep_scan" keeps also each Mamba mixer's GEMM outputs (in_proj's,
    # x_proj's), its scan's y and the SSD's chunk states, and recomputes the cheap work between
    # them (conv, SiLU, norms, gates; the sparse branch), as mamba_ssm's fused layer does (Mamba-1's
    # scan still runs again for its states, as under "block"); "none" keeps what autodiff saves;
    # "auto" = "block" for rows of at least REMAT_MIN_LEN tokens.
    remat: Literal["auto", "none", "block", "block_keep_scan"] = "auto"
    # Positions per row whose logits the loss computes at once (more wait in a scan under
    # jax.checkpoint, so neither pass holds (b, l, vocab) logits); 0 = auto, under LOGITS_BUDGET.
    loss_chunk: int = 0
    mamba: MambaConfig = MambaConfig()  # settings of every "mamba" layer
    mamba2: Mamba2Config = Mamba2Config()  # settings of every "mamba2" layer
    sparse: SparseConfig = (
        SparseConfig()
    )  # the sparse-attention branch of every mamba / mamba2 layer
    attention: AttentionConfig = AttentionConfig()  # settings of every "attention" / "swa" layer
    mlp: MlpConfig = MlpConfig()  # settings of every "mlp" layer
    infini: InfiniConfig = InfiniConfig()  # settings of every "infini" layer

    def __post_init__(self):
        for name in ("d_model", "n_layer", "vocab_size", "pad_vocab_size_multiple"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.loss_chunk < 0:
            raise ValueError(f"model.loss_chunk must be >= 0 (0 = auto), got {self.loss_chunk}")
        if not self.block_pattern:
            raise ValueError("model.block_pattern must name at least one mixer kind")
        for kind in self.block_pattern:
            if kind not in MIXER_KINDS:
                raise ValueError(
                    f"unknown mixer kind {kind!r} in model.block_pattern; known: {MIXER_KINDS}"
                )
        others = sorted(set(self.block_pattern) - {"mamba", "mamba2"})
        if self.init == "hax_code" and others:
            raise ValueError(
                f"model.init='hax_code' covers mamba and mamba2 layers only; "
                f"model.block_pattern has {others}"
            )
        if self.n_layer % len(self.block_pattern):
            raise ValueError(
                f"model.n_layer={self.n_layer} must be a multiple of "
                f"len(model.block_pattern)={len(self.block_pattern)}"
            )
        if "mamba2" in self.block_pattern:
            m2 = self.mamba2
            d_inner = m2.expand * self.d_model
            if d_inner % m2.headdim:
                raise ValueError(
                    f"d_inner={d_inner} must be a multiple of mamba2.headdim={m2.headdim}"
                )
            if (d_inner // m2.headdim) % m2.ngroups:
                raise ValueError(
                    f"n_heads={d_inner // m2.headdim} must be a multiple of "
                    f"mamba2.ngroups={m2.ngroups}"
                )

    def remat_mode(self, length: int) -> str:
        """model.remat resolved for rows of `length`: "none", "block" or "block_keep_scan"."""
        if self.remat == "auto":
            return "block" if length >= REMAT_MIN_LEN else "none"
        return self.remat

    def remat_blocks(self, length: int) -> bool:
        """Whether each block recomputes its activations in the backward, for rows of `length`."""
        return self.remat_mode(length) != "none"

    @property
    def padded_vocab_size(self) -> int:
        """Embedding rows: vocab_size rounded up to pad_vocab_size_multiple."""
        m = self.pad_vocab_size_multiple
        return -(-self.vocab_size // m) * m

    @property
    def mixer_kinds(self) -> tuple[str, ...]:
        """The mixer kind of every layer."""
        return tuple(self.block_pattern[i % len(self.block_pattern)] for i in range(self.n_layer))
