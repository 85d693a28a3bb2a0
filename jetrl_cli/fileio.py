"""File modes of what jetrl writes: the user's umask, like every other program's files.

Two writers jetrl uses create private files: ``safetensors``' ``save_file`` writes a temporary
file and renames it, keeping the temporary file's mode 0600, and ``tempfile.mkdtemp`` (the
staging directory ``jetrl quantize`` renames into place) makes a 0700 directory. Left alone, a
checkpoint or a quantized model would be unreadable to the group and to other users (a shared
model directory, a serving process under another account) although every other file of the run
follows the umask. These helpers give such files the mode ``open()`` / ``mkdir()`` would have.
"""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_mode(is_dir: bool) -> int:
    """The mode ``open()`` (0666) or ``mkdir()`` (0777) gives under the current umask."""
    return (0o777 if is_dir else 0o666) & ~current_umask()


def apply_umask(path: Path, recursive: bool = False) -> None:
    """Give ``path`` (and with ``recursive`` everything under it) the umask's default mode."""
    path = Path(path)
    os.chmod(path, default_mode(path.is_dir()))
    if recursive and path.is_dir():
        for root, dirs, files in os.walk(path):
            for d in dirs:
                os.chmod(os.path.join(root, d), default_mode(True))
            for f in files:
                os.chmod(os.path.join(root, f), default_mode(False))


def save_safetensors(tensors: dict, path: Path, metadata: dict | None = None) -> None:
    """``safetensors.torch.save_file`` with the file's mode set by the umask, not 0600."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    apply_umask(Path(path))


def read_json(path: Path):
    """The JSON value in file ``path``; a file that is not UTF-8 JSON is a one-line error naming it."""
    import json

    from .errors import JetrlError

    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise JetrlError(f"{path}: invalid JSON ({e.msg}, line {e.lineno})") from None
    except UnicodeDecodeError:
        raise JetrlError(f"{path}: not a UTF-8 text file") from None
