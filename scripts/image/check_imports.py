"""The image build's import check (Dockerfile, build stage): torch is the build TORCH_VARIANT asked
for, Megatron-Core and the planner server import, and the compiled exact path compiles (numba's
LLVM on the image's libc; the cache it writes is swept with the build's __pycache__).

    python scripts/image/check_imports.py cpu|cuda

cpu refuses a CUDA build of torch (the default index's Linux wheel is one: several GB of CUDA
libraries the planner never uses); cuda accepts only a CUDA build. megatron.core imports triton
(pipeline_parallel.schedules -> transformer.moe.paged_stash -> transformer/moe/ops/paged_stash.py),
which the CPU build of torch does not bring: requirements/image.lock pins it.
"""

from __future__ import annotations

import sys


def fail(message: str) -> None:
    print(f"check_imports: {message}", file=sys.stderr)
    sys.exit(1)


def check_torch(variant: str) -> str:
    import torch

    cuda = torch.version.cuda
    if variant == "cpu" and cuda is not None:
        fail(f"torch {torch.__version__} is a CUDA {cuda} build, but TORCH_VARIANT=cpu asked for the CPU build. "
             "Install torch from a CPU wheel index (build argument TORCH_INDEX_URL) or a wheelhouse holding the "
             "CPU wheel; or, where no CPU wheel can be had, pass --build-arg TORCH_VARIANT=cuda (a ~5.8 GB image).")
    if variant == "cuda" and cuda is None:
        fail(f"torch {torch.__version__} is the CPU build, but TORCH_VARIANT=cuda asked for a CUDA build: "
             "drop --build-arg TORCH_VARIANT=cuda (cpu is the default).")
    return f"torch {torch.__version__} ({f'CUDA {cuda}' if cuda else 'CPU'})"


def check_megatron_core() -> str:
    try:
        import megatron.core
    except ModuleNotFoundError as error:
        if error.name == "triton":
            fail(f"megatron.core imports triton ({error}; the CPU build of torch does not bring it): "
                 "requirements/image.lock must pin triton (scripts/lock_requirements.py keeps it).")
        raise
    import triton

    return f"megatron-core {megatron.core.__version__}, triton {triton.__version__}"


def check_compiler() -> str:
    """The compiled exact path compiles here (numba and its LLVM run on the image's libc)."""
    from batch_planner.exact import compiler
    from batch_planner.exact.compiled_dynamic_cp import prepare

    if not compiler.available():
        fail(f"the compiled exact path cannot run: {compiler.unavailable_reason()} (requirements/image.lock pins numba)")
    prepare()
    return f"{compiler.version()} compiles"


def main(argv: list[str]) -> None:
    if len(argv) != 1 or argv[0] not in ("cpu", "cuda"):
        fail(f"usage: check_imports.py cpu|cuda (the TORCH_VARIANT build argument), got {argv}")
    found = [check_torch(argv[0]), check_megatron_core(), check_compiler()]
    import planner_server.server  # noqa: F401  (the entry point's module, with grpc and the schedulers)

    print("check_imports: " + ", ".join(found) + ", planner_server.server imports")


if __name__ == "__main__":
    main(sys.argv[1:])
