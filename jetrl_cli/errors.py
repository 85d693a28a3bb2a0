"""User-facing errors: each one prints as a single line naming the file, key or tensor at fault."""

from __future__ import annotations


class JetrlError(Exception):
    """A mistake in the user's input. The CLI prints ``error: <message>`` and exits with code 2."""

    exit_code = 2


class PresetError(JetrlError):
    """A preset file or flow value is wrong: names the file and the dotted key."""

    def __init__(self, source: str, key: str, message: str):
        self.source, self.key, self.message = source, key, message
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where}: {message}")


# What torch's allocators say when an allocation fails (the CPU allocator raises a plain RuntimeError)
_ALLOCATOR_FAILURES = ("DefaultCPUAllocator", "can't allocate memory", "not enough memory", "out of memory")


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocation that failed, on a GPU (``torch.OutOfMemoryError``) or on the CPU."""
    import sys

    torch = sys.modules.get("torch")  # an allocation of torch's failed only if torch is imported
    oom = getattr(torch, "OutOfMemoryError", MemoryError) if torch is not None else MemoryError
    if isinstance(e, (MemoryError, oom)):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _ALLOCATOR_FAILURES)
