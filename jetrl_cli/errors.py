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

