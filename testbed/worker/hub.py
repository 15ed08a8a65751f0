"""A Hugging Face hub id (`org/name`) resolved as vLLM resolves it offline: to its snapshot folder in the local
Hugging Face cache ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub; or `download_dir`).
Nothing is ever downloaded: a model that is not in the cache is a clear error saying where it was looked for.
`resolve_model` turns any --model into what the executors load; no torch is imported here, so the API server and a
node launcher resolve the model without it."""
from __future__ import annotations

import os
import re
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(name: str) -> bool:
    """`org/name` that is not a path on this machine."""
    return bool(_HUB_ID.match(name)) and not os.path.exists(name)


def hub_cache_dir(download_dir: str | None = None) -> Path:
    """The cache folder a hub id is looked up in (read from the environment at each call)."""
    if download_dir:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def resolve_hub_id(repo_id: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """The local snapshot folder of `repo_id` at `revision` (default: the cached `main`); FileNotFoundError
    when the cache does not hold it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    cache = hub_cache_dir(download_dir)
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"model {repo_id!r}{'' if revision is None else f' at revision {revision!r}'} is not a local folder or "
            f"file, and the local Hugging Face cache ({cache}) does not hold it; nothing is downloaded here: put it "
            f"in the cache first (huggingface-cli download {repo_id}), set HF_HUB_CACHE / HF_HOME (or download_dir) "
            "to the cache that has it, or give the model's folder") from None


DEFAULT_MODEL_NAMES = ("", "default", "smollm2", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct")


def resolve_model(model: str | None, load_format: str = "auto", revision: str | None = None,
                  download_dir: str | None = None) -> str:
    """The bundled SmolLM2 folder for an empty/default name (real weights), a hub id's folder in the local
    Hugging Face cache (resolve_hub_id), else `model` unchanged (a folder, a file, or a preset with dummy weights)."""
    if load_format != "dummy" and (model is None or model.lower() in DEFAULT_MODEL_NAMES):
        from testbed.worker.smollm2 import default_model_dir
        return str(default_model_dir())
    if load_format != "dummy" and model is not None:
        if is_hub_id(model):
            return resolve_hub_id(model, revision, download_dir)
    return model or "SmolLM2-135M"
