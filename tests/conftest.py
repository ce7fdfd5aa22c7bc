"""Test set-up, fixed before jax is imported: 8 fake CPU devices, full-precision matmuls,
XLA:CPU's fast-compile settings (tests are dominated by compile time, not run time), and one
persistent compilation cache per session so engines rebuilt with the same config (CLI tests,
restored checkpoints) reuse compiled programs."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true",
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

_CACHE = tempfile.mkdtemp(prefix="k3text-test-xla-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
