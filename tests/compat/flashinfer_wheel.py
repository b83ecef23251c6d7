"""flashinfer-python 0.7.4's `flashinfer.moe_ep` public signatures, read from its wheel.

The wheel is the one the vendored drops are pinned to (`vendor/*/vendor.lock.json`), cached
by the vendor tool in `~/.cache/moe-ep-vendor/pypi/<sha256>/` when the session start
materializes the drops; it is fetched here when absent. Its source is parsed with `ast`,
never imported and never copied into the repository.
"""

from __future__ import annotations

import ast
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DROP = "sm90_pull_cutedsl"
"""A drop pinned to the wheel (all the flashinfer drops share one)."""
MODULES = {
    "BootstrapConfig": "flashinfer/moe_ep/config.py",
    "FleetParams": "flashinfer/moe_ep/config.py",
    "MoEEpTensors": "flashinfer/moe_ep/tensors.py",
    "MoEWeightPack": "flashinfer/moe_ep/weights.py",
    "MoEEpLayer": "flashinfer/moe_ep/layer.py",
}


@dataclass(frozen=True)
class Param:
    """One constructor parameter: its name, whether keyword-only, and its default as source
    text (None: required)."""

    name: str
    kw_only: bool
    default: str | None


def wheel_path() -> Path:
    """The pinned wheel in the vendor cache (fetched when absent); skips when unreachable."""
    from vendorlib import sources
    from vendorlib.drops import load_drop
    from vendorlib.errors import SourceError
    from vendorlib.progress import make_progress

    pin = load_drop(REPO, DROP).meta.source
    assert pin.fields["distribution"] == "flashinfer-python", pin.fields
    assert pin.fields["version"] == "0.7.4", pin.fields
    try:
        return sources._download(pin, make_progress(True))  # the cached file when present
    except SourceError as exc:
        pytest.skip(f"the flashinfer-python 0.7.4 wheel is not cached and cannot be fetched: {exc}")


def _field_param(node: ast.AnnAssign, kw_only_after: bool) -> Param | None:
    assert isinstance(node.target, ast.Name)
    if "ClassVar" in ast.unparse(node.annotation) or node.annotation == "KW_ONLY":
        return None
    kw_only, default = kw_only_after, None
    value = node.value
    if isinstance(value, ast.Call) and ast.unparse(value.func) in ("field", "dataclasses.field"):
        for kw in value.keywords:
            if kw.arg == "kw_only":
                kw_only = ast.literal_eval(kw.value)
            elif kw.arg == "default":
                default = ast.unparse(kw.value)
            elif kw.arg == "default_factory":
                default = f"{ast.unparse(kw.value)}()"
    elif value is not None:
        default = ast.unparse(value)
    return Param(node.target.id, kw_only, default)


def _dataclass_init(cls: ast.ClassDef) -> list[Param]:
    """The generated `__init__`'s parameters: positional fields in order, then kw-only."""
    params: list[Param] = []
    kw_only_after = False
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.annotation).endswith("KW_ONLY"):
            kw_only_after = True
        elif isinstance(node, ast.AnnAssign):
            p = _field_param(node, kw_only_after)
            if p is not None:
                params.append(p)
    return [p for p in params if not p.kw_only] + [p for p in params if p.kw_only]


def _function_params(fn: ast.FunctionDef, skip_first: bool) -> list[Param]:
    a = fn.args
    positional = a.posonlyargs + a.args
    if skip_first:
        positional = positional[1:]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = [
        Param(arg.arg, False, None if d is None else ast.unparse(d))
        for arg, d in zip(positional, defaults, strict=True)
    ]
    out += [
        Param(arg.arg, True, None if d is None else ast.unparse(d))
        for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)
    ]
    return out


def _signature(tree: ast.Module, name: str) -> list[Param]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return _function_params(node, skip_first=False)
        if isinstance(node, ast.ClassDef) and node.name == name:
            methods = {m.name: m for m in node.body if isinstance(m, ast.FunctionDef)}
            if "__new__" in methods:  # MoEWeightPack: a factory __new__, no __init__
                return _function_params(methods["__new__"], skip_first=True)
            if "__init__" in methods:
                return _function_params(methods["__init__"], skip_first=True)
            return _dataclass_init(node)
    raise AssertionError(f"{name} not found")


def flashinfer_signatures(wheel: Path) -> dict[str, list[Param]]:
    """Each of the five public names' constructor parameters in flashinfer 0.7.4."""
    with zipfile.ZipFile(wheel) as zf:
        trees = {path: ast.parse(zf.read(path).decode()) for path in set(MODULES.values())}
    return {name: _signature(trees[path], name) for name, path in MODULES.items()}
