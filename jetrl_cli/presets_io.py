"""Preset files: YAML loading, strict top-level schema, ``key.sub=value`` overrides.

A preset is one YAML file that chooses everything about a job (the schema is ``config.py``). Its
``precision:`` section is a precision flow (see ``jetrl_cli.precision.flow``): a flow name, or ``base:`` plus overrides.
Presets that ship with jetrl live in ``presets/`` (installed as ``jetrl_cli.presets``) and can be
named without a path: ``fp8-unified`` finds ``presets/fp8-unified.yaml``.
"""

from __future__ import annotations

import json
import shlex
import types
import typing
from dataclasses import dataclass
from pathlib import Path

from .errors import PresetError
from .precision.flow import PrecisionFlow

PRESET_KEYS = ("precision", "model", "task", "rollout", "train", "correction", "eval", "run")


def shipped_presets_dir() -> Path:
    from . import presets

    return Path(presets.__file__).parent


def resolve_preset_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.exists():
        return p
    shipped = shipped_presets_dir() / (name_or_path if name_or_path.endswith(".yaml") else f"{name_or_path}.yaml")
    if shipped.exists():
        return shipped
    names = ", ".join(sorted(q.stem for q in shipped_presets_dir().glob("*.yaml")))
    raise PresetError(str(name_or_path), "", f"no such file, and no shipped preset of that name (shipped: {names})")


def load_yaml(path: str | Path) -> dict:
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PresetError(str(path), "", "no such file") from None
    except OSError as e:
        raise PresetError(str(path), "", f"cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise PresetError(str(path), "", f"not a UTF-8 text file (byte {e.start}: {e.object[e.start]:#04x})") from None
    try:
        data = yaml.load(text, Loader=_strict_loader(str(path)))
    except yaml.YAMLError as e:
        line = yaml_error_line(text, e)
        where = f"line {line}" if line else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        src = text.splitlines()[line - 1].strip() if line and line <= len(text.splitlines()) else ""
        raise PresetError(str(path), where, f"invalid YAML: {problem}" + (f": {src!r}" if src else "")) from None
    if data is None:
        raise PresetError(str(path), "", "empty file")
    if not isinstance(data, dict):
        raise PresetError(str(path), "", f"expected a mapping at the top level, got {type(data).__name__}")
    return data


_LOADERS: dict = {}


def _yaml12_numbers_loader():
    """PyYAML's SafeLoader, except that the integers and floats only YAML 1.1 reads as numbers load as the
    text written: base 60 (``steps: 1:30`` would be 90, ``1:30.5`` 90.5) and a leading-zero octal
    (``steps: 010`` would be 8). YAML 1.2, and so every other YAML tool a preset may pass through, reads them
    as strings; kept as text, the schema's type check refuses them on a number key with the key named
    (``expected an integer, got '1:30'``) instead of a number the user never wrote running silently, and a
    string key gets what was written."""
    if "numbers" not in _LOADERS:
        import yaml

        class Yaml12Numbers(yaml.SafeLoader):
            pass

        def scalar_or(construct):
            def constructor(loader, node):
                v = node.value.replace("_", "").lstrip("+-")
                if ":" in v or (len(v) > 1 and v[0] == "0" and v[1:].isdigit()):  # 1:30, 010 (not 0x1f, 0.5)
                    return loader.construct_scalar(node)
                return construct(loader, node)
            return constructor

        Yaml12Numbers.add_constructor("tag:yaml.org,2002:int", scalar_or(yaml.SafeLoader.construct_yaml_int))
        Yaml12Numbers.add_constructor("tag:yaml.org,2002:float", scalar_or(yaml.SafeLoader.construct_yaml_float))
        _LOADERS["numbers"] = Yaml12Numbers
    return _LOADERS["numbers"]


def _strict_loader(source: str):
    """``_yaml12_numbers_loader``, except that a key given twice in one mapping (at any depth) is a
    ``PresetError`` naming the dotted key and both lines: YAML itself keeps the last silently, so a
    second ``train:`` section would drop the whole first one."""
    class StrictLoader(_yaml12_numbers_loader()):
        def construct_document(self, node):
            _refuse_duplicate_keys(source, node, "", set())
            return super().construct_document(node)

    return StrictLoader


def _refuse_duplicate_keys(source: str, node, path: str, seen: set) -> None:
    import yaml

    if id(node) in seen:  # an alias of a node already walked
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(source, item, f"{path}[{i}]", seen)
    elif isinstance(node, yaml.MappingNode):
        first: dict = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                dotted = f"{path}.{key_node.value}" if path else str(key_node.value)
                line = key_node.start_mark.line + 1
                ident = (key_node.tag, key_node.value)
                if ident in first:
                    lines = f"on line {line}" if line == first[ident] else f"on lines {first[ident]} and {line}"
                    raise PresetError(source, dotted, f"set twice, {lines} (YAML would silently keep only the "
                                      "last; remove one)")
                first[ident] = line
                _refuse_duplicate_keys(source, value_node, dotted, seen)
            else:
                _refuse_duplicate_keys(source, value_node, path, seen)


def yaml_error_line(text: str, e) -> int | None:
    """The 1-based line a YAML syntax error is on, as a person would point at it.

    PyYAML marks where it noticed the problem, which for the commonest mistake, a key without its
    ``:``, is the line after: ``path tiny`` followed by ``device: cpu`` reads as one plain scalar
    ``path tiny device`` until the next ``:`` ("mapping values are not allowed here", marked on the
    ``device`` line). There the line is where that scalar starts; for "could not find expected
    ':'" it is where the key being scanned starts, and for an unclosed ``[`` or ``{`` where it
    opens (the error's context mark)."""
    import yaml

    mark = getattr(e, "problem_mark", None)
    if mark is None:
        return None
    problem = getattr(e, "problem", "") or ""
    context = getattr(e, "context_mark", None)
    where = getattr(e, "context", "") or ""
    if context is not None and ("could not find expected ':'" in problem or "flow sequence" in where
                                or "flow mapping" in where):
        return context.line + 1
    if "mapping values are not allowed" in problem:
        last = None
        try:
            for tok in yaml.scan(text):
                last = tok
        except yaml.YAMLError:
            pass
        if isinstance(last, yaml.ScalarToken) and last.start_mark.line <= mark.line:
            return last.start_mark.line + 1
    return mark.line + 1


def apply_overrides(data: dict, overrides: list[str], source: str) -> dict:
    """Apply ``key.sub=value`` overrides (values parsed as YAML scalars) to a preset mapping."""
    import yaml

    for item in overrides:
        if "=" not in item:
            raise PresetError(source, item, "an override must look like key.sub=value")
        dotted, raw = item.split("=", 1)
        keys = dotted.strip().split(".")
        if not all(keys):
            raise PresetError(source, dotted, "empty key in override")
        node = data
        for i, k in enumerate(keys[:-1]):
            child = node.get(k)
            if isinstance(child, str) and k == "precision" and i == 0:
                child = {"base": child}  # a flow name becomes base + overrides
            if child is None:
                child = {}
            if not isinstance(child, dict):
                raise PresetError(source, ".".join(keys[: i + 1]), f"is {child!r}, not a mapping; cannot set {dotted}")
            node[k] = child
            node = child
        try:
            value = yaml.load(raw, Loader=_yaml12_numbers_loader()) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        if value is not None and not isinstance(value, str) and _takes_a_string(keys):
            kind = {dict: "a mapping", list: "a list"}.get(type(value), "")
            quoted = shlex.quote(f"{dotted.strip()}={json.dumps(raw, ensure_ascii=False)}")
            raise PresetError(source, dotted.strip(), f"expected a string, got {kind + ' ' if kind else ''}{value!r}: "
                              f"--set reads the value as YAML; quote it: --set {quoted}")
        node[keys[-1]] = value
    return data


def _takes_a_string(keys: list[str]) -> bool:
    """Whether ``section.key`` is a string-typed preset key (``task.prompt_template``, ``model.path``, ...)."""
    from .config import SECTIONS

    if len(keys) != 2 or keys[0] not in SECTIONS:
        return False
    tp = typing.get_type_hints(SECTIONS[keys[0]]).get(keys[1])
    if tp is str:
        return True
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType)  # str | None, not list[str]
    return optional and str in typing.get_args(tp) and set(typing.get_args(tp)) <= {str, type(None)}


@dataclass(frozen=True)
class Preset:
    source: str
    flow: PrecisionFlow
    raw: dict


def load_preset(name_or_path: str, overrides: list[str] | None = None) -> Preset:
    path = resolve_preset_path(name_or_path)
    data = load_yaml(path)
    src = str(path)
    for k in data:
        if k not in PRESET_KEYS:
            raise PresetError(src, str(k), f"unknown key (allowed: {', '.join(PRESET_KEYS)})")
    if overrides:
        data = apply_overrides(data, overrides, src)
    from .config import build_job_config

    job = build_job_config(data, src, Path(src).stem)  # checks every section, not only the flow
    return Preset(src, job.flow, data)
