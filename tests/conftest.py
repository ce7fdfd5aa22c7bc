"""Test set-up, fixed before jax is imported: 8 fake CPU devices, full-precision matmuls,
XLA:CPU's fast-compile settings (tests are dominated by compile time, not run time), and one
persistent compilation cache for the whole run, shared by both pytest-xdist workers and the
commands tests start (`XLA_CACHE`), so engines rebuilt with the same config in another test,
file, worker or process (CLI tests, servers, restored checkpoints) reuse compiled programs."""

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

# The first process to load this file (pytest's controller, before it starts its workers, which
# inherit the variable) makes the directory and removes it when it exits.
_CACHE_VARIABLE = "K3TEXT_TEST_XLA_CACHE"
if _CACHE_VARIABLE not in os.environ:
    os.environ[_CACHE_VARIABLE] = tempfile.mkdtemp(prefix="k3text-test-xla-cache-")
    atexit.register(shutil.rmtree, os.environ[_CACHE_VARIABLE], ignore_errors=True)
XLA_CACHE = os.environ[_CACHE_VARIABLE]
jax.config.update("jax_compilation_cache_dir", XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
# A size bound turns on the cache's file lock, so processes writing and reading the same entry
# at once never see half a file.
jax.config.update("jax_compilation_cache_max_size", 16 * 2**30)
