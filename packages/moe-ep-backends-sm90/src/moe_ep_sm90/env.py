"""The environment variables the sm90 backends read, parsed here (core's `moe_ep.env`
rules: explicit arguments win, unset or empty is "not set", a malformed value names the
variable). Core's `env.check_all` and docs/runtime.md's one table take them through the
`moe_ep.env` entry point.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from moe_ep.env import EnvVar, absolute_dir, raw_value, zero_one

__all__ = ["CHECKS", "ENV_VARS", "push_build_enabled", "push_cache_dir"]

ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(
        "MOE_EP_PUSH_CACHE",
        "absolute directory (default $HOME/.cache/moe-ep/sm90_push)",
        "Where the sm90 push kernel's nvcc-built modules are cached, one subdirectory per "
        "digest of the sources, flags and toolchain versions (nvcc, torch, CUDA, "
        "apache-tvm-ffi, arch). A relative path is refused. Created 0700; refused when another "
        "user could write it or a directory above it; an entry is loaded only if it is "
        "yours, not group/other-writable and matches the sha256 manifest recorded when it "
        "was built (else rebuilt).",
    ),
    EnvVar(
        "MOE_EP_PUSH_BUILD",
        "0 or 1 (default 0)",
        "1: the GPU tests and the GPU check also build and run the sm90 push kernel "
        "(nvcc builds of several minutes).",
    ),
)


def push_cache_dir(env: Mapping[str, str] | None = None) -> str | None:
    """MOE_EP_PUSH_CACHE as written (it must be absolute), None when unset or empty."""
    return absolute_dir(env, "MOE_EP_PUSH_CACHE")


def push_build_enabled(env: Mapping[str, str] | None = None) -> bool:
    """MOE_EP_PUSH_BUILD: True for "1", False for "0" or unset; anything else is an error."""
    return zero_one(raw_value(env, "MOE_EP_PUSH_BUILD"), "MOE_EP_PUSH_BUILD")


CHECKS: dict[str, Callable[[Mapping[str, str] | None], object]] = {
    "MOE_EP_PUSH_CACHE": push_cache_dir,
    "MOE_EP_PUSH_BUILD": push_build_enabled,
}
"""The reader of each `ENV_VARS` entry (by its name), for `moe_ep.env.check_all`."""
