"""Checkpoints: a Hugging Face model directory plus the trainer's state, written atomically.

``OUT/checkpoints/step_000010/`` holds ``config.json``, ``model.safetensors`` (fp32 master weights),
the tokenizer files and ``trainer_state.pt`` (optimizer state, step); with LoRA, the merged weights
and the adapters beside them (``adapter_model.safetensors``, ``adapter_config.json``: PEFT's files).
It is written under a temporary name and renamed when complete; ``OUT/latest`` (replaced atomically)
names the newest.
A killed run therefore always leaves its last complete checkpoint, and ``--resume`` starts there.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from ..errors import JetrlError

# What a model directory holds beside its weights and config.json, copied into each checkpoint: the
# tokenizer in every form transformers and vLLM read (fast tokenizer.json; slow vocab/merges or a
# sentencepiece model), its added tokens and chat template, and the generation defaults.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json")


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a directory's entries) to the disk: a rename makes a checkpoint
    complete for a killed process, an fsync for a machine that loses power."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """``path`` replaced by ``text`` all at once: written beside it, flushed, renamed over it. A process
    killed meanwhile leaves the old file whole (and a hidden temporary file, replaced next time)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def write_model_files(dst: Path, state: dict, source_dir: Path, tie_word_embeddings: bool) -> None:
    """The Hugging Face model directory part of a checkpoint: fp32 safetensors, config.json and the
    tokenizer files of ``source_dir``, every file with the user's umask (not a temp file's 0600)."""
    from ..fileio import save_safetensors

    state = {k: v.detach().float().cpu().contiguous() for k, v in state.items()}
    if tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_safetensors(state, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((source_dir / "config.json").read_text())
    cfg["torch_dtype"] = "float32"
    if "dtype" in cfg:  # transformers 5's name: it reads it first, and would load the fp32 weights as the source's
        cfg["dtype"] = "float32"
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in TOKENIZER_FILES:
        if (source_dir / f).exists():
            shutil.copyfile(source_dir / f, dst / f)  # a new file: the umask's mode, like the rest


def write_model_state(dst: Path, model, state: dict, source_dir: Path) -> None:
    """``write_model_files`` of ``model``'s ``state`` (its state dict, or a sharded one's gathered whole); with
    LoRA, the merged model (loadable anywhere) and the adapters as PEFT writes them (``models/lora.py``)."""
    spec = getattr(model, "lora", None)
    if spec is None:
        write_model_files(dst, state, source_dir, model.config.tie_word_embeddings)
        return
    from ..models.lora import is_adapter_key, merge_state, save_adapters

    freed = [k for k, v in state.items() if not v.numel() and not is_adapter_key(k)]
    if freed:  # frozen weights whose master copy the trainer freed (``hold_frozen_weights``): the source's
        from ..models.hf import load_state_dict

        source = load_state_dict(source_dir)
        state = {**state, **{k: source[k].float() for k in freed}}
    write_model_files(dst, merge_state(state, spec.scale), source_dir, model.config.tie_word_embeddings)
    save_adapters(state, spec, dst, str(source_dir))


def checkpoint_dirs(out: Path, step: int) -> tuple[Path, Path]:
    """``(staging, final)`` directories of step ``step``'s checkpoint (nothing is created)."""
    ckdir = out / "checkpoints"
    return ckdir / f".tmp-step_{step:06d}", ckdir / f"step_{step:06d}"


def fresh_dir(path: Path) -> None:
    """``path`` as a new empty directory (its parents made, an old one removed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir()


def save_checkpoint(out: Path, step: int, model, optimizer, source_dir: Path, extra: dict, keep: int) -> Path:
    tmp, final = checkpoint_dirs(out, step)
    fresh_dir(tmp)
    write_model_state(tmp, model, model.state_dict(), source_dir)
    torch.save({"step": step, "optimizer": optimizer.state_dict(), **extra}, tmp / "trainer_state.pt")
    return publish_checkpoint(out, tmp, final, keep)


def _step_of(p: Path) -> int | None:
    """The step of a checkpoint directory ``step_NNNNNN`` (any number of digits), or None."""
    digits = p.name[len("step_"):]
    return int(digits) if p.name.startswith("step_") and digits.isdigit() else None


def publish_checkpoint(out: Path, tmp: Path, final: Path, keep: int) -> Path:
    """Flush the complete ``tmp`` directory, rename it to ``final``, point ``OUT/latest`` at it, and
    delete all but the newest ``keep`` checkpoints up to its step, by step number. Checkpoints of later
    steps (left by a run that was resumed from an earlier one) are not counted, and are replaced when
    this run reaches their steps; staging directories left by a killed save are removed."""
    for f in tmp.rglob("*"):
        if f.is_file():
            _fsync(f)
    _fsync(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(final.parent)
    atomic_write_text(out / "latest", final.name + "\n")
    step = _step_of(final)
    done = sorted((s, p) for p in final.parent.iterdir() if p.is_dir() and (s := _step_of(p)) is not None
                  and s <= step)
    for _, old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in final.parent.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    return final


def latest_checkpoint(out: Path) -> Path | None:
    f = out / "latest"
    if not f.exists():
        return None
    ckdir = out / "checkpoints"
    fix = f"write the name of a complete checkpoint in {ckdir} into it, e.g. step_000002"
    try:
        name = f.read_text().strip()
    except UnicodeDecodeError:
        raise JetrlError(f"{f}: not a text file; the file is damaged ({fix})") from None
    except OSError as e:
        raise JetrlError(f"{f}: cannot read ({e.strerror or e})") from None
    if not name:
        raise JetrlError(f"{f}: empty; the file is damaged ({fix})")
    if "\n" in name or Path(name).name != name or name in (".", ".."):
        raise JetrlError(f"{f}: holds {name[:60]!r}, not a checkpoint name; the file is damaged ({fix})")
    p = ckdir / name
    if not (p / "trainer_state.pt").exists():
        raise JetrlError(f"{f} names {p.name}, which is missing or incomplete")
    return p


def _load_failure(e: Exception) -> str:
    """Why ``torch.load`` failed, in a few words: the safe unpickler's own reason where it gave one (its
    message opens with advice to load unsafely, which a damaged file does not need), else the first line."""
    text = str(e)
    if "WeightsUnpickler error:" in text:
        why = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation", 1)[0]
        return " ".join(why.split()) or type(e).__name__
    return text.splitlines()[0] if text else type(e).__name__


def load_trainer_state(ckpt: Path) -> dict:
    """``trainer_state.pt`` of a checkpoint: a dict with at least ``step``; a damaged file is one line."""
    path = ckpt / "trainer_state.pt"
    damaged = (f"the file is damaged (resume from an earlier checkpoint: point "
               f"{ckpt.parent.parent / 'latest'} at it)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain data: nothing to run
    except OSError as e:
        raise JetrlError(f"{path}: cannot read ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - unpickling garbage raises anything (ValueError, KeyError, zip errors)
        first = _load_failure(e)
        raise JetrlError(f"{path}: unreadable ({first[:100]}); {damaged}") from None
    if not isinstance(state, dict) or isinstance(state.get("step"), bool) or not isinstance(state.get("step"), int):
        raise JetrlError(f"{path}: not a jetrl trainer state (no integer 'step'); {damaged}")
    return state
