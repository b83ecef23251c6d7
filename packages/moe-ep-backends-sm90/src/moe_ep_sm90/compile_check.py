"""Compile-only checks (no GPU) of the sm90 kernels, one command line for all:
the pull kernels with CuTe DSL (`kernels/sm90_fp8_fp8_bf16_pull_cutedsl/compile.py`, `pull`;
`kernels/sm90_bf16_bf16_bf16_pull_cutedsl/compile.py`, `bf16-pull`;
`kernels/sm90_fp8_mxfp4_bf16_pull_cutedsl/compile.py`, `mxfp4-pull`;
`kernels/sm90_fp8_nvfp4_bf16_pull_cutedsl/compile.py`, `nvfp4-pull`), the push units with
nvcc (`kernels/sm90_fp8_fp8_bf16_push_cuda/compile.py`). Run in a fresh
process (the drop owns generic top-level module names, and the CuTe DSL reads the target
arch from the environment at import):

    CUTE_DSL_ARCH=sm_90a python -m moe_ep_sm90.compile_check pull --arch sm_90a
    CUTE_DSL_ARCH=sm_90a python -m moe_ep_sm90.compile_check bf16-pull --arch sm_90a
    CUTE_DSL_ARCH=sm_90a python -m moe_ep_sm90.compile_check mxfp4-pull --arch sm_90a
    CUTE_DSL_ARCH=sm_90a python -m moe_ep_sm90.compile_check nvfp4-pull --arch sm_90a
    python -m moe_ep_sm90.compile_check push-a2a      # or push-binding (~60 s)

Exit code 0 and a JSON line with the compile time on success.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moe_ep_sm90.kernels.sm90_bf16_bf16_bf16_pull_cutedsl.config import (
    Sm90_Bf16_Bf16_Bf16_PullCutedsl_MegaMoeConfig,
)
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.config import (
    Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig,
)

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_ep_sm90.compile_check")
    parser.add_argument(
        "kernel",
        choices=["pull", "bf16-pull", "mxfp4-pull", "nvfp4-pull", "push-a2a", "push-binding"],
    )
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--swap-ab", action="store_true", help="compile the swap-AB layout")
    args = parser.parse_args(argv)
    config = (
        Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig(swap_ab=True, mma_tiler_mnk=(128, 32, 128))
        if args.swap_ab
        else Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig()
    )
    try:
        if args.kernel == "bf16-pull":
            from moe_ep_sm90.kernels.sm90_bf16_bf16_bf16_pull_cutedsl.compile import (
                compile_bf16_pull,
            )

            bf16 = (
                Sm90_Bf16_Bf16_Bf16_PullCutedsl_MegaMoeConfig(
                    swap_ab=True, mma_tiler_mnk=(128, 32, 64)
                )
                if args.swap_ab
                else Sm90_Bf16_Bf16_Bf16_PullCutedsl_MegaMoeConfig()
            )
            result = compile_bf16_pull(bf16, arch=args.arch)
        elif args.kernel == "mxfp4-pull":  # swap-AB only: --swap-ab changes nothing
            from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.compile import (
                compile_mxfp4_pull,
            )
            from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.config import (
                Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig,
            )

            result = compile_mxfp4_pull(
                Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig(), arch=args.arch
            )
        elif args.kernel == "nvfp4-pull":  # swap-AB only: --swap-ab changes nothing
            from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.compile import (
                compile_nvfp4_pull,
            )
            from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.config import (
                Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig,
            )

            result = compile_nvfp4_pull(
                Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig(), arch=args.arch
            )
        elif args.kernel == "pull":
            from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.compile import compile_pull

            result = compile_pull(config, arch=args.arch)
        else:
            import tempfile

            from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.compile import compile_push

            with tempfile.TemporaryDirectory() as tmp:
                _, result = compile_push(Path(tmp), args.kernel[5:], arch=args.arch)
    except Exception as exc:
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:4000]}))
        return 1
    print(json.dumps({"ok": True, **result.__dict__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
