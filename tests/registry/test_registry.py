"""Registry behaviour on fake entry points: aliases, listings, unknown/duplicate names, breakage."""

from __future__ import annotations

import importlib.metadata
import sys
import types
import warnings
from collections.abc import Iterator

import pytest

from moe_ep.contract import KernelConfig
from moe_ep.errors import MoeEpUnavailableError, MoeEpUsageError
from moe_ep.registry import Registry

MODULE = "moe_ep_fake_backend_for_tests"


class GoodKernel:
    kernel_name = "sm90_fp8_fp8_bf16_fake"
    deprecated_aliases = ("old_fake",)

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        return False, "no GPU: needs compute capability 9.0"


class OtherKernel:
    kernel_name = "any_bf16_bf16_bf16_fake"
    deprecated_aliases = ()


class RaisingAvailability:
    kernel_name = "any_fp8_fp8_bf16_fake"
    deprecated_aliases = ()

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        raise RuntimeError("probe exploded")


class FakeConfig(KernelConfig):
    kernel_name = "sm90_fp8_fp8_bf16_fake"


@pytest.fixture(autouse=True)
def fake_module() -> Iterator[None]:
    module = types.ModuleType(MODULE)
    for cls in (GoodKernel, OtherKernel, RaisingAvailability):
        setattr(module, cls.__name__, cls)
    sys.modules[MODULE] = module
    yield
    del sys.modules[MODULE]


def ep(name: str, value: str) -> importlib.metadata.EntryPoint:
    return importlib.metadata.EntryPoint(name=name, value=value, group="moe_ep.backends")


def make_registry(*eps: importlib.metadata.EntryPoint) -> Registry:
    return Registry(entry_points=list(eps))


def test_alias_warns_and_resolves_listing_hides_it() -> None:
    reg = make_registry(ep("sm90_fp8_fp8_bf16_fake", f"{MODULE}:GoodKernel"))
    with pytest.warns(
        DeprecationWarning, match="'old_fake' is deprecated; use 'sm90_fp8_fp8_bf16_fake'"
    ):
        assert reg.resolve("old_fake") == "sm90_fp8_fp8_bf16_fake"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert reg.resolve("sm90_fp8_fp8_bf16_fake") == "sm90_fp8_fp8_bf16_fake"
    infos = reg.infos()
    assert [i.name for i in infos] == ["sm90_fp8_fp8_bf16_fake"]
    assert infos[0].deprecated_aliases == ("old_fake",)
    assert infos[0].available is False
    assert infos[0].reason == "no GPU: needs compute capability 9.0"


def test_lookup_by_config_object_and_alias() -> None:
    reg = make_registry(ep("sm90_fp8_fp8_bf16_fake", f"{MODULE}:GoodKernel"))
    assert reg.get(FakeConfig()) is GoodKernel
    with pytest.warns(DeprecationWarning):
        assert reg.get("old_fake") is GoodKernel


def test_unknown_name_lists_known() -> None:
    reg = make_registry(
        ep("sm90_fp8_fp8_bf16_fake", f"{MODULE}:GoodKernel"),
        ep("any_bf16_bf16_bf16_fake", f"{MODULE}:OtherKernel"),
    )
    with pytest.raises(KeyError) as info:
        reg.get("sm90_fp8_fp8_bf16_nope")
    message = str(info.value)
    assert "unknown kernel 'sm90_fp8_fp8_bf16_nope'" in message
    assert "any_bf16_bf16_bf16_fake, sm90_fp8_fp8_bf16_fake" in message


def test_bad_backend_argument_type() -> None:
    reg = make_registry()
    with pytest.raises(MoeEpUsageError, match="got int"):
        reg.get(3)


def test_broken_entry_point_is_listed_unavailable_without_breaking_others() -> None:
    reg = make_registry(
        ep("sm100_nvfp4_nvfp4_bf16_fake", "moe_ep_module_that_does_not_exist:Kernel"),
        ep("any_bf16_bf16_bf16_fake", f"{MODULE}:OtherKernel"),
    )
    infos = {i.name: i for i in reg.infos()}
    assert infos["any_bf16_bf16_bf16_fake"].available is True
    broken = infos["sm100_nvfp4_nvfp4_bf16_fake"]
    assert broken.available is False
    assert "ModuleNotFoundError" in broken.reason
    assert "moe_ep_module_that_does_not_exist" in broken.reason
    with pytest.raises(MoeEpUnavailableError, match="ModuleNotFoundError"):
        reg.get("sm100_nvfp4_nvfp4_bf16_fake")


def test_availability_that_raises_is_reported() -> None:
    reg = make_registry(ep("any_fp8_fp8_bf16_fake", f"{MODULE}:RaisingAvailability"))
    (info,) = reg.infos()
    assert info.available is False
    assert "RuntimeError: probe exploded" in info.reason


def test_entry_name_must_match_registered_name() -> None:
    reg = make_registry(ep("any_bf16_bf16_bf16_other", f"{MODULE}:OtherKernel"))
    (info,) = reg.infos()
    assert info.available is False
    assert "names must match" in info.reason


def test_two_backends_with_one_name() -> None:
    reg = make_registry(
        ep("any_bf16_bf16_bf16_fake", f"{MODULE}:OtherKernel"),
        ep("any_bf16_bf16_bf16_fake", f"{MODULE}:OtherKernel"),
    )
    (info,) = reg.infos()
    assert info.available is False
    assert "provided by two backends" in info.reason


def test_register_same_name_twice_with_different_classes() -> None:
    reg = make_registry()
    reg.register("any_bf16_bf16_bf16_fake", OtherKernel)
    reg.register("any_bf16_bf16_bf16_fake", OtherKernel)  # same class again: idempotent
    with pytest.raises(MoeEpUsageError, match="registered twice"):
        reg.register("any_bf16_bf16_bf16_fake", GoodKernel)


def test_alias_conflicts() -> None:
    reg = make_registry()
    reg.register("any_bf16_bf16_bf16_fake", OtherKernel, deprecated_aliases=("legacy",))
    with pytest.raises(MoeEpUsageError, match="claimed by both"):
        reg.register("sm90_fp8_fp8_bf16_fake", GoodKernel, deprecated_aliases=("legacy",))
    with pytest.raises(MoeEpUsageError, match="itself a canonical name"):
        reg.register(
            "sm90_fp8_fp8_bf16_fake", GoodKernel, deprecated_aliases=("any_bf16_bf16_bf16_fake",)
        )


def test_register_rejects_unparseable_name() -> None:
    with pytest.raises(MoeEpUsageError, match="does not parse"):
        make_registry().register("fake", OtherKernel)
