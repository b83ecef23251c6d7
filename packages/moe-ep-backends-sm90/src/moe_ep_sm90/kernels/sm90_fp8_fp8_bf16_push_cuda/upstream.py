"""The push kernel's upstream bytes, reached only through the drops' package `__init__`s:
the `sm90_push_cuda` drop (`vendor/sm90_push_cuda/src/`: `a2a`, `fp8_gemm`) and the
headers drop `sm90_push_cuda_deps` (`vendor/sm90_push_cuda_deps/src/`: FlashInfer /
TRT-LLM / CUTLASS headers and the common sources the GEMM module links). `build` compiles
them."""

from __future__ import annotations

from moe_ep.backends.support.drop_access import DropRef

__all__ = ["PUSH_DEPS_DROP", "PUSH_DROP"]

PUSH_DROP = DropRef(import_name="moe_ep_drop_sm90_push", dist="moe-ep-drop-sm90-push-cuda")
PUSH_DEPS_DROP = DropRef(
    import_name="moe_ep_drop_sm90_push_cuda_deps", dist="moe-ep-drop-sm90-push-cuda-deps"
)
