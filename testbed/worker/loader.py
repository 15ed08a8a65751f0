"""Build a `LlamaForCausalLM` and fill its weights from safetensors, a GGUF file, or random (dummy) values.

Every path feeds FULL checkpoint tensors by HF name into the parameters' `weight_loader`s, which
keep this rank's shard, so loading works at any tensor-parallel size; a pipeline stage takes the tensors of its
own layers only (LlamaForCausalLM.checkpoint_target). Invariant after `load_model`:
every parameter (and every packed shard) was written exactly from the checkpoint, or all were random.
"""
from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path
from typing import Iterable, Iterator

import torch

from testbed.specs.presets import get_model_spec
from testbed.worker.model import LlamaForCausalLM
from testbed.worker.layers import cpu_weight_layout

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json; a Hugging Face model folder needs config.json "
                                "next to its *.safetensors files")
    return json.loads(path.read_text())


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(folder.glob("*.safetensors"))


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"weight file {file} listed in the safetensors index is missing")
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _find_gguf(path: Path) -> Path | None:
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ValueError(f"{path} holds several GGUF files ({', '.join(f.name for f in found)}); pass one file")
    return found[0] if found else None


def _load_gguf(file: Path) -> tuple[dict, Iterable[tuple[str, torch.Tensor]]]:
    """Dequantize a GGUF file through transformers (needs packages gguf + accelerate)."""
    try:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32)
    except ImportError as e:
        raise ImportError(f"loading {file} needs the packages gguf and accelerate: pip install gguf accelerate ({e})") from e
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    return config, hf.state_dict().items()


def _resolve(model: str, load_format: str) -> tuple[dict, Iterable[tuple[str, torch.Tensor]] | None, str]:
    """(hf config dict, named full tensors or None for dummy, description of the source)."""
    path = Path(model).expanduser()
    if load_format == "dummy":
        return (_read_config(path) if path.is_dir() else get_model_spec(str(model)).hf_config()), None, "dummy"
    if not path.exists():
        raise FileNotFoundError(f"model {model!r} not found: pass a local Hugging Face folder (config.json + "
                                "*.safetensors), a .gguf file, or a preset name with load_format='dummy'")
    if path.is_dir() and load_format in ("auto", "safetensors"):
        files = _safetensors_files(path)
        if files:
            return _read_config(path), _iter_safetensors(files), str(path)
        if load_format == "safetensors":
            raise FileNotFoundError(f"no *.safetensors files in {path}")
    gguf = _find_gguf(path)
    if gguf is None:
        what = "*.safetensors or *.gguf files" if path.is_dir() else "a .gguf file or a folder"
        raise FileNotFoundError(f"no weights found at {path}: expected {what} (load_format={load_format!r}); "
                                "for random weights of this shape use load_format='dummy'")
    config, tensors = _load_gguf(gguf)
    return config, tensors, str(gguf)


def model_config(model: str, load_format: str = "auto") -> dict:
    """The model's config (config.json of a folder, a preset's with dummy weights; {} for a GGUF file,
    whose config only comes with its weights)."""
    path = Path(model).expanduser()
    if load_format == "dummy" and not path.is_dir():
        return get_model_spec(str(model)).hf_config()
    return _read_config(path) if path.is_dir() and (path / "config.json").is_file() else {}


def load_weights(model: LlamaForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> None:
    """Feed full HF-named tensors into the parameters' weight_loaders; raise if any parameter stays unset."""
    params = dict(model.named_parameters())
    packed_shards: dict[str, list] = {}
    for ckpt_name, (packed, shard) in model.packed_modules_mapping.items():
        packed_shards.setdefault(packed, []).append(shard)
    expected = set()
    for name in params:
        expected |= {(name, s) for s in packed_shards.get(name.split(".")[-2], [None])}
    loaded, unexpected = set(), []
    with torch.no_grad():
        for name, tensor in tensors:
            if "rotary_emb.inv_freq" in name or (model.config.tie_word_embeddings and name == "lm_head.weight"):
                continue
            target, shard = model.checkpoint_target(name), None
            if target is None:  # another pipeline stage's
                continue
            for ckpt_part, (packed, shard_id) in model.packed_modules_mapping.items():
                if f".{ckpt_part}." in target:
                    target, shard = target.replace(f".{ckpt_part}.", f".{packed}."), shard_id
                    break
            param = params.get(target)
            if param is None:
                unexpected.append(name)
                continue
            param.weight_loader(param, tensor, shard)
            loaded.add((target, shard))
    if unexpected:
        logger.warning("%s: ignored %d tensors the model has no parameter for, e.g. %s",
                       source, len(unexpected), ", ".join(unexpected[:5]))
    missing = sorted(f"{n}" if s is None else f"{n}[{s}]" for n, s in expected - loaded)
    if missing:
        raise ValueError(f"{source} lacks {len(missing)} tensors the {model.config.architecture} needs, e.g. "
                         f"{', '.join(missing[:5])}")


def init_dummy_weights(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic random weights generated on the parameters' device: norms 1, the rest N(0, std), each
    parameter from a generator seeded by `seed` and its name, so a pipeline stage's layers get the values the
    same layers have in the whole model (a tied LM head is named after the embedding it shares)."""
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
                continue
            key = "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name
            g = torch.Generator(device=param.device).manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
            param.normal_(0.0, std, generator=g)


def build_model(hf_config: dict, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """Allocate the (uninitialised) model directly on `device` in `dtype`."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return LlamaForCausalLM(hf_config).eval()
    finally:
        torch.set_default_dtype(previous)


def load_model(model: str, load_format: str = "auto", dtype: torch.dtype = torch.bfloat16,
               device: str | torch.device = "cpu", seed: int = 0) -> tuple[LlamaForCausalLM, dict]:
    """(model with weights, HF config dict) from a folder, a .gguf file or a preset name (load_format='dummy')."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose one of {', '.join(LOAD_FORMATS)}")
    hf_config, tensors, source = _resolve(str(model), load_format)
    net = build_model(hf_config, dtype, device)
    if tensors is None:
        init_dummy_weights(net, seed)
    else:
        load_weights(net, tensors, source)
    cpu_weight_layout(net)
    return net, hf_config


def load_tokenizer(model: str, trust_remote_code: bool = False):
    """HF tokenizer of a local folder or .gguf file (offline); presets (dummy weights) have none.
    `trust_remote_code` lets a tokenizer run the code it ships with."""
    from transformers import AutoTokenizer
    path = Path(model).expanduser()
    if path.is_dir() and any((path / f).is_file() for f in _TOKENIZER_FILES):
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    gguf = _find_gguf(path) if path.exists() else None
    if gguf is not None:
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True,
                                             trust_remote_code=trust_remote_code)
    raise FileNotFoundError(f"no tokenizer for {model!r}: expected a local folder with tokenizer.json / "
                            "tokenizer_config.json or a .gguf file (dummy-weight presets have no tokenizer; "
                            "pass prompt token ids instead)")
