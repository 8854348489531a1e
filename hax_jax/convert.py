"""Converts HF `MambaForCausalLM` / `Mamba2ForCausalLM` and original mamba_ssm checkpoints to
hax_jax, and back.

    python -m hax_jax.convert SRC OUT            # HF or mamba_ssm directory -> hax_jax checkpoint
    python -m hax_jax.convert SRC OUT --to-hf    # hax_jax checkpoint -> HF directory transformers
    loads
        [--drop-sparse-branch]                   # a HAX model: write its SSM only (else refused)

Reads config.json with model.safetensors, sharded safetensors (model.safetensors.index.json) or
pytorch_model.bin (needs torch: `pip install hax-jax[convert]`). Model code never imports this
module. A failure on the command line is one `error: ...` line naming the file or value (exit status
1).
"""

import argparse
import json
import pickle
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from hax_jax import checkpoint
from hax_jax.config import ModelConfig
from hax_jax.convert_configs import ConversionError, hf_config, read_config, read_json
from hax_jax.data.text import TOKENIZER_FILES
from hax_jax.layers.fused import FusedConv1d, FusedLinear, Part, fuse, unfuse
from hax_jax.models.lm import LanguageModel

# ----------------------------------------------------------------------------- tensors


def read_tensors(src: Path) -> dict[str, np.ndarray]:
    """All tensors of an HF / mamba_ssm directory, as fp32-or-native numpy arrays keyed by name."""
    if (src / "model.safetensors").is_file():
        return _read_safetensors([src / "model.safetensors"])
    if (src / "model.safetensors.index.json").is_file():
        index = read_json(src / "model.safetensors.index.json")
        return _read_safetensors([src / f for f in sorted(set(index["weight_map"].values()))])
    bins = [src / "pytorch_model.bin"] if (src / "pytorch_model.bin").is_file() else []
    if (src / "pytorch_model.bin.index.json").is_file():
        index = read_json(src / "pytorch_model.bin.index.json")
        bins = [src / f for f in sorted(set(index["weight_map"].values()))]
    if bins:
        return _read_torch(bins)
    raise ConversionError(
        f"{str(src)!r} holds no weights: looked for model.safetensors, "
        "model.safetensors.index.json, pytorch_model.bin(.index.json)"
    )


def _read_safetensors(files: list[Path]) -> dict[str, np.ndarray]:
    """Reads safetensors files (bf16 included, through the flax framework)."""
    from safetensors import SafetensorError, safe_open

    out = {}
    for f in files:
        try:
            with safe_open(f, framework="flax") as handle:
                for key in handle.keys():
                    out[key] = np.asarray(handle.get_tensor(key))
        except (SafetensorError, OSError) as err:  # truncated, corrupt or missing
            raise ConversionError(f"{str(f)!r} is not a readable safetensors file: {err}") from None
    return out


def _read_torch(files: list[Path]) -> dict[str, np.ndarray]:
    """Reads pytorch_model.bin files (weights only; never unpickles code)."""
    try:
        import torch
    except ImportError as e:
        raise ConversionError(
            "reading pytorch_model.bin needs torch: pip install 'hax-jax[convert]'"
        ) from e
    out = {}
    for f in files:
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)
        except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as err:
            raise ConversionError(f"{str(f)!r} is not a readable PyTorch file: {err}") from None
        for key, value in state.items():
            out[key] = value.float().numpy() if value.is_floating_point() else value.numpy()
    return out


def _hf_key(path: tuple, embedding_key: str) -> str:
    """Our parameter path -> the HF / mamba_ssm tensor name."""
    if path == ("embedding", "embedding"):
        return f"backbone.{embedding_key}.weight"
    if path == ("lm_head", "kernel"):
        return "lm_head.weight"
    names = [str(p) for p in path]
    if names[-1] == "kernel":
        names[-1] = "weight"
    return "backbone." + ".".join(names)


def _to_ours(path: tuple, tensor: np.ndarray) -> np.ndarray:
    """An HF tensor in our layout: Linear (out, in) -> (in, out); Conv1d (c, 1, k) -> (k, c)."""
    if path[-2:] == ("conv1d", "kernel"):
        return tensor[:, 0, :].T
    if path[-1] == "kernel" and path[0] != "embedding":
        return tensor.T
    return tensor


def _to_hf(path: tuple, array: np.ndarray) -> np.ndarray:
    """Inverse of `_to_ours`."""
    if path[-2:] == ("conv1d", "kernel"):
        return array.T[:, None, :]
    if path[-1] == "kernel" and path[0] != "embedding":
        return array.T
    return array


def _names(path) -> tuple[str, ...]:
    """A jax tree path as a tuple of str."""
    return tuple(str(k.key) for k in path)


def _hf_shape(path: tuple, shape: tuple) -> tuple:
    """The HF shape of one of our parameters (what `_to_hf` would give)."""
    if path[-2:] == ("conv1d", "kernel"):
        return (shape[1], 1, shape[0])
    if path[-1] == "kernel" and path[0] != "embedding":
        return tuple(reversed(shape))
    return tuple(shape)


def _fused_layouts(model: LanguageModel) -> dict[tuple[str, ...], tuple[Part, ...]]:
    """The paths of the modules stored part by part (layers/fused.py) -> their parts, in the order
    the checkpoints' fused tensors hold them."""
    return {
        tuple(str(k) for k in path): node.parts
        for path, node in nnx.iter_graph(model)
        if isinstance(node, FusedLinear | FusedConv1d)
    }


def _fused_path(path: tuple, layouts: dict) -> tuple:
    """The path of the checkpoint tensor a parameter lives in: a part's (..., module, "kernel" or
    "bias", part) is a slice of (..., module, "kernel" or "bias")."""
    return path[:-1] if path[:-2] in layouts else path


def tensors_to_model(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> LanguageModel:
    """Builds the model from HF / mamba_ssm tensors; errors name missing, extra or misshapen
    keys."""
    embedding_key = "embedding" if "backbone.embedding.weight" in tensors else "embeddings"
    abstract = checkpoint.abstract_model(cfg)
    layouts = _fused_layouts(abstract)
    graphdef, state = nnx.split(abstract, nnx.Param)
    nested = nnx.to_pure_dict(state)
    paths = [_names(path) for path, _ in jax.tree_util.tree_flatten_with_path(nested)[0]]
    keys = {path: _hf_key(_fused_path(path, layouts), embedding_key) for path in paths}
    missing = sorted({k for k in keys.values() if k not in tensors})
    if missing:
        raise ConversionError(f"missing tensors: {missing}")
    extra = set(tensors) - set(keys.values())
    if cfg.tie_embeddings:
        extra.discard("lm_head.weight")  # HF may store the tied copy
    if extra:
        raise ConversionError(f"unexpected tensors (another architecture?): {sorted(extra)}")

    def load(path, leaf):
        names = _names(path)
        key, hf_path = keys[names], _fused_path(names, layouts)
        shape = leaf.shape
        if hf_path != names:  # a part: the checkpoint holds all parts side by side
            parts = layouts[names[:-2]]
            part = next(p for p in parts if p.name == names[-1])
            shape = (*shape[: len(shape) - len(part.shape)], sum(p.size for p in parts))
        want = _hf_shape(hf_path, shape)
        if tuple(tensors[key].shape) != want:
            raise ConversionError(
                f"tensor {key!r} has shape {tuple(tensors[key].shape)}, expected {want}"
            )
        value = _to_ours(hf_path, tensors[key])
        if hf_path != names:
            value = unfuse(value, layouts[names[:-2]])[names[-1]]
        return jax.numpy.asarray(value, jax.numpy.float32)

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(load, nested))
    return nnx.merge(graphdef, state)


def model_to_tensors(
    model: LanguageModel, drop_sparse_branch: bool = False
) -> dict[str, np.ndarray]:
    """HF tensor dict of a pure Mamba / Mamba-2 model (fp32); see `to_hf_dir` for the branch."""
    _check_hf_can_hold(model.cfg, drop_sparse_branch)
    layouts = _fused_layouts(model)
    state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    ours: dict[tuple, np.ndarray] = {}
    fused: dict[tuple, dict[str, np.ndarray]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        names = _names(path)
        if "branch" in names:  # the HAX branch's parameters (only here when dropping it)
            continue
        hf_path = _fused_path(names, layouts)
        if hf_path == names:
            ours[names] = np.asarray(leaf, np.float32)
        else:
            fused.setdefault(hf_path, {})[names[-1]] = np.asarray(leaf, np.float32)
    for hf_path, arrays in fused.items():
        parts = layouts[hf_path[:-1]]
        lead = arrays[parts[0].name].ndim - len(parts[0].shape)
        ours[hf_path] = np.asarray(fuse(arrays, parts, lead))
    return {
        _hf_key(path, "embeddings"): np.ascontiguousarray(_to_hf(path, array))
        for path, array in ours.items()
    }


# ----------------------------------------------------------------------------- directories


def from_pretrained_dir(src: str | Path) -> LanguageModel:
    """An HF / mamba_ssm directory as a LanguageModel (fp32 parameters)."""
    src = Path(src)
    if not src.is_dir():
        raise ConversionError(f"{str(src)!r} is not a directory")
    return tensors_to_model(read_config(src), read_tensors(src))


def _check_hf_can_hold(cfg: ModelConfig, drop_sparse_branch: bool) -> None:
    """HF's Mamba / Mamba-2 have no sparse branch: refuse a model with one unless told to drop
    it."""
    if cfg.sparse.pattern and not drop_sparse_branch:
        raise ConversionError(
            f"the model has a HAX sparse branch (model.sparse.pattern={cfg.sparse.pattern!r}) "
            "that HF's Mamba / Mamba-2 cannot hold; pass --drop-sparse-branch "
            "(drop_sparse_branch=True) to write the SSM without it"
        )


def to_hf_dir(model: LanguageModel, out: str | Path, drop_sparse_branch: bool = False) -> None:
    """Writes config.json + model.safetensors that `transformers` loads.

    A model with a HAX sparse branch is refused (ConversionError) unless `drop_sparse_branch`:
    then the branch is left out, with a warning on stderr (HF computes the SSM alone).
    """
    from safetensors.numpy import save_file

    out = Path(out)
    config = hf_config(model.cfg)
    tensors = model_to_tensors(model, drop_sparse_branch)
    if model.cfg.sparse.pattern:
        print(
            "warning: dropped the sparse branch "
            f"(model.sparse.pattern={model.cfg.sparse.pattern!r}): "
            f"{out} holds the SSM only, whose outputs differ from the model's",
            file=sys.stderr,
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> None:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m hax_jax.convert", description=__doc__.split("\n")[0]
    )
    parser.add_argument("src", help="source directory")
    parser.add_argument("out", help="output directory")
    parser.add_argument("--to-hf", action="store_true", help="hax_jax checkpoint -> HF directory")
    parser.add_argument(
        "--drop-sparse-branch",
        action="store_true",
        help="with --to-hf: write a HAX model's SSM without its sparse branch (HF has none)",
    )
    args = parser.parse_args(argv)
    if args.drop_sparse_branch and not args.to_hf:
        parser.error("--drop-sparse-branch only applies with --to-hf")
    if args.to_hf:
        to_hf_dir(checkpoint.load_pretrained(args.src), args.out, args.drop_sparse_branch)
    else:
        checkpoint.save_pretrained(from_pretrained_dir(args.src), args.out)
    # The tokenizer travels with the weights: eval.py reads it from the checkpoint directory.
    for name in TOKENIZER_FILES:
        if (Path(args.src) / name).is_file():
            shutil.copy(Path(args.src) / name, Path(args.out) / name)
    print(f"wrote {args.out}")


def cli(argv: list[str] | None = None) -> None:
    """`main`, with a failure as one `error: ...` line and exit status 1 (no traceback)."""
    try:
        main(argv)
    except (ValueError, OSError) as err:  # ConversionError is a ValueError
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    cli()
