"""Compile-only checks (no GPU) of the sm100 CuTe DSL kernels (nvfp4, mxfp8, mxfp8 x mxfp4)
for `sm_100a`, one command line for all three (each kernel's check is its folder's
`compile` module). Run in a fresh process (the drops own top-level module names; the CuTe
DSL reads the target arch from the environment at import):

    CUTE_DSL_ARCH=sm_100a python -m moe_ep_sm100.compile_check KERNEL --arch sm_100a

with KERNEL one of `nvfp4`, `mxfp8`, `mxfp8_mxfp4`.

Prints one JSON line; exit code 0 on success.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main"]

_KERNELS = {
    "nvfp4": "sm100_nvfp4_nvfp4_bf16_cutedsl",
    "mxfp8": "sm100_mxfp8_mxfp8_bf16_cutedsl",
    "mxfp8_mxfp4": "sm100_mxfp8_mxfp4_bf16_cutedsl",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_ep_sm100.compile_check")
    parser.add_argument("kernel", choices=list(_KERNELS))
    parser.add_argument("--arch", default="sm_100a")
    args = parser.parse_args(argv)
    try:
        if args.kernel == "nvfp4":
            from moe_ep_sm100.kernels.sm100_nvfp4_nvfp4_bf16_cutedsl.compile import compile_nvfp4
            from moe_ep_sm100.kernels.sm100_nvfp4_nvfp4_bf16_cutedsl.config import (
                Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
            )

            seconds = compile_nvfp4(Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig(), arch=args.arch)
        elif args.kernel == "mxfp8_mxfp4":
            from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.compile import (
                compile_mxfp8_mxfp4,
            )
            from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.config import (
                Sm100_Mxfp8_Mxfp4_Bf16_Cutedsl_MegaMoeConfig,
            )

            config = Sm100_Mxfp8_Mxfp4_Bf16_Cutedsl_MegaMoeConfig()
            seconds = compile_mxfp8_mxfp4(config, arch=args.arch)
        else:
            from moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.compile import compile_mxfp8
            from moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.config import (
                Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
            )

            seconds = compile_mxfp8(Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig(), arch=args.arch)
    except Exception as exc:
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:4000]}))
        return 1
    kernel = _KERNELS[args.kernel]
    print(json.dumps({"ok": True, "kernel": kernel, "arch": args.arch, "seconds": seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
